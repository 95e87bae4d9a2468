"""score_runs.py's measurement of running statistics against the real tokens', on a tiny model."""

import math

import pytest
import torch

from model import NormLabConfig, NormLabForSequenceClassification
from normlab.data.batching import pad_rows
from normlab.study import scoring as score_runs

SENTENCES = [[2, 5, 6, 3], [2, 7, 3], [2, 8, 9, 10, 11, 3], [2, 12, 3]]  # 16 real tokens, lengths 3-6
ROWS = [{"input_ids": ids} for ids in SENTENCES]


def gap_after_one_batch(norm: str) -> dict:
    """Train-mode forward over all sentences as one padded batch with momentum 1, so the running statistics become
    that batch's; then measure them in eval."""
    torch.manual_seed(0)
    config = NormLabConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=16, norm=norm, norm_placement="pre", bn_momentum=1.0,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    model = NormLabForSequenceClassification(config).train()
    with torch.no_grad():
        model(**pad_rows(ROWS, pad_id=0, width=6))
    return score_runs.running_stat_gap(model.eval(), ROWS, batch_size=2, pad_id=0)


def test_masked_batchnorm_running_statistics_are_the_real_tokens():
    gap = gap_after_one_batch("masked_batchnorm")
    assert len(gap["mean_gap"]) == 3  # attention and FFN norms of the block, the final norm
    # the first norm sees the embeddings in train and eval alike: its running mean is the real tokens' mean, and
    # its running variance their unbiased variance (n / (n - 1) times the biased one)
    assert gap["mean_gap"][0] == pytest.approx(0, abs=1e-4)
    assert gap["log_var_ratio"][0] == pytest.approx(math.log(16 / 15), rel=1e-3)


def test_naive_batchnorm_running_statistics_carry_the_padding():
    naive, masked = gap_after_one_batch("batchnorm"), gap_after_one_batch("masked_batchnorm")
    assert naive["mean_gap"][0] > 0.1 > masked["mean_gap"][0]  # 8 of 24 positions were padding


def test_norms_without_running_statistics_have_no_record():
    config = NormLabConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=16, norm="layernorm", pad_token_id=0)
    model = NormLabForSequenceClassification(config).eval()
    assert score_runs.running_stat_gap(model, ROWS, batch_size=2, pad_id=0) is None


def test_partner_dependence_is_zero_in_one_batch_and_grows_as_the_batches_shrink():
    """A sentence's logit under batch statistics moves with its partners: in one batch of all 40 sentences every
    random batching holds the same partners (dependence ~0, float sums in another order), in batches of 2 a
    sentence's statistics are two sentences' (the largest); in batches of 8 in between. Fewer than 2 batchings
    measure nothing."""
    torch.manual_seed(0)
    config = NormLabConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, norm="masked_batchnorm", norm_placement="pre",
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)
    model = NormLabForSequenceClassification(config).eval()
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": torch.randint(1, 50, (int(k),), generator=g).tolist(), "index": i, "labels": 0}
            for i, k in enumerate(torch.randint(3, 12, (40,), generator=g))]
    got = {b: score_runs.partner_dependence(model, rows, b, pad_id=0, batchings=6) for b in (40, 8, 2)}
    assert got[40] < 1e-3 < got[8] < got[2]
    assert score_runs.partner_dependence(model, rows, 8, pad_id=0, batchings=1) is None


def test_the_dev_rows_are_the_last_training_rows_and_must_not_have_been_trained_on(monkeypatch):
    """The study's dev split is train.py's data.dev_rows split: the training split's last rows; runs that trained on
    any of them, or held out other rows, are refused with one line."""
    import pandas as pd

    from normlab.config.loader import REPO_ROOT, load_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    last = pd.read_parquet(REPO_ROOT.parent / "shared" / "datasets" / "sst2" / "train.parquet").iloc[-200:]
    for given in (["data.max_train_samples=300"], ["data.max_train_samples=300", "data.dev_rows=200"]):
        dev_texts, dev_labels = score_runs.score_sets(load_config(overrides=given), 200)["dev"]
        assert dev_texts == last["sentence"].tolist() and dev_labels == last["label"].tolist()
    with pytest.raises(SystemExit, match=r"^score_runs.py: data.max_train_samples=67300 overlaps the last "
                                         r"data.dev_rows=200 rows"):
        score_runs.score_sets(load_config(overrides=["data.max_train_samples=67300"]), 200)
    with pytest.raises(SystemExit, match="held out data.dev_rows=100"):
        score_runs.score_sets(load_config(overrides=["data.dev_rows=100"]), 200)
    with pytest.raises(SystemExit, match="trained on every training row"):
        score_runs.score_sets(load_config(overrides=["data.max_train_samples=null"]), 200)


@pytest.mark.parametrize("overrides, full", [
    ([], False),
    (["model.final_norm=masked_batchnorm"], True),  # the final norm alone uses batch statistics
    (["model.center_pooled=true"], True),  # the pooled-vector centring alone
    (["model.norm=powernorm"], True),
])
def test_runs_with_any_batch_statistics_module_get_the_batch_statistics_scorings(tmp_path, monkeypatch, overrides,
                                                                                  full):
    """Not only the block norm decides: a run whose one batch-statistics module is the final norm or the pooled
    vector's centring is scored with batch statistics too (score_run's `full_batchings`)."""
    from normlab.config.loader import load_config
    from normlab.run_dir import RunDir

    run = RunDir(tmp_path / "runs" / "r")
    run.save_config(load_config(None, ["model.norm=layernorm", *overrides]))
    run.write_summary({"status": "completed"})
    run.final.mkdir()
    asked = []
    monkeypatch.setattr(score_runs, "score_run", lambda path, sets, full_batchings, bs, **kw:
                        asked.append(full_batchings) or ({}, {}))
    score_runs.record(tmp_path, "r", {"experiment": "e2"}, sets={}, batch_size=8)
    assert asked == [full]


def test_the_records_keep_the_batch_statistics_and_precise_bn_accuracies_of_runs_with_precise_bn():
    """A run with precise BN keeps all three accuracies of each evaluation; a run without keeps its record as every
    earlier study's (eval/accuracy_batch_stats alone is not kept: committed records must stay byte for byte)."""
    plain = {"step": 32, "eval/loss": 0.5, "eval/accuracy": 0.75, "eval/accuracy_batch_stats": 0.74}
    precise = {**plain, "eval/accuracy_precise_bn": 0.76}
    assert score_runs.curves([plain])["eval"] == [{"step": 32, "loss": 0.5, "accuracy": 0.75}]
    assert score_runs.curves([precise])["eval"] == [{"step": 32, "loss": 0.5, "accuracy": 0.75,
                                                     "accuracy_batch_stats": 0.74, "accuracy_precise_bn": 0.76}]
    # a run that logged the statistics noise keeps its mean over blocks beside them (records before it: nothing)
    noisy = {**precise, "bn/0/stat_noise": 0.2, "bn/1/stat_noise": 0.4}
    assert score_runs.curves([noisy])["eval"][0]["stat_noise"] == pytest.approx(0.3)


def test_a_record_is_kept_only_while_its_run_is_what_was_scored(tmp_path):
    import json

    from normlab.run_dir import RunDir

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    row = {"name": "run", "status": "completed", "curves": {"step": [1, 2, 3]}, "scores": {"val/sorted/running": {}}}
    assert score_runs.still_scored(row, run, needs_dev=False) is None  # no summary.json: the run is not finished
    run.summary_file.write_text(json.dumps({"status": "completed", "step": 3}))
    assert score_runs.still_scored(row, run, needs_dev=False) is row
    assert score_runs.still_scored(None, run, needs_dev=False) is None  # never scored
    assert score_runs.still_scored(row, run, needs_dev=True) is None  # now a sweep's run: it needs dev scores
    with_dev = {**row, "scores": {"dev/sorted/running": {}, **row["scores"]}}
    assert score_runs.still_scored(with_dev, run, needs_dev=True) is with_dev
    run.summary_file.write_text(json.dumps({"status": "completed", "step": 6}))  # trained further since
    assert score_runs.still_scored(row, run, needs_dev=False) is None
    run.summary_file.write_text(json.dumps({"status": "completed", "step": 3}))
    for status in ("failed", "interrupted"):  # a record of a run that had not finished is never kept
        assert score_runs.still_scored({**row, "status": status}, run, needs_dev=False) is None
