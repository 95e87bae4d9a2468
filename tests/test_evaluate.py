"""scripts/evaluate.py on a tiny checkpoint trained by train.py (once per session): the metrics against train.py's
own evaluation and a hand computation, JSON fields, --text, --data, accelerate with 2 processes, and the errors."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from normlab.cli import evaluate
from train_utils import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
EVALUATE = REPO_ROOT / "scripts" / "evaluate.py"  # the shim: the documented command

EVAL_ROWS = 96
TINY = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.num_attention_heads=2",
        "model.intermediate_size=64", "model.vocab_size=1000", "data.max_train_samples=300",
        f"data.max_eval_samples={EVAL_ROWS}", "train.batch_size=16", "train.warmup_steps=4", "train.lr=2e-3",
        "train.max_steps=12", "train.eval_steps=12", "train.save_steps=12", "wandb.mode=disabled"]
VALIDATION = REPO_ROOT.parent / "shared" / "datasets" / "sst2" / "validation.parquet"


def env():
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO_ROOT)}


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory):
    """A completed tiny train.py run (hidden 32, 2 layers, 300 rows, 12 steps), trained in this process."""
    from accelerate.state import AcceleratorState, GradientState

    from normlab.train import run as train

    out = tmp_path_factory.mktemp("evaluate") / "run"
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert train.main([f"output_dir={out}", *TINY]) == 0
    assert json.loads((out / "summary.json").read_text())["status"] == "completed"
    return out


def run_main(capsys, *argv):
    code = evaluate.main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def hand_metrics(cm):
    """Accuracy and macro-F1 from a confusion matrix (rows true, columns predicted), by the textbook formulas."""
    k = len(cm)
    f1s = []
    for c in range(k):
        tp, predicted, actual = cm[c][c], sum(row[c] for row in cm), sum(cm[c])
        if predicted == 0 and actual == 0:
            continue
        p = tp / predicted if predicted else 0.0
        r = tp / actual if actual else 0.0
        f1s.append(2 * p * r / (p + r) if p + r else 0.0)
    return sum(cm[c][c] for c in range(k)) / sum(map(sum, cm)), sum(f1s) / len(f1s)


def test_json_on_the_runs_split_in_a_fresh_process(run_dir):
    out = subprocess.run([sys.executable, str(EVALUATE), str(run_dir), "--json"], capture_output=True, text=True,
                         env=env(), cwd=REPO_ROOT, timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["checkpoint"] == str(run_dir / "final")
    assert result["dataset"]["split"] == "validation"
    assert result["num_examples"] == len(pd.read_parquet(VALIDATION))  # the whole split, not the run's 96 rows
    assert result["labels"] == ["negative", "positive"]
    cm = result["confusion_matrix"]
    assert sum(map(sum, cm)) == result["num_examples"]
    accuracy, macro_f1 = hand_metrics(cm)
    assert result["accuracy"] == pytest.approx(accuracy) and result["macro_f1"] == pytest.approx(macro_f1)
    assert math.isfinite(result["loss"]) and result["loss"] > 0
    assert [c["support"] for c in result["per_class"]] == [sum(row) for row in cm]


def test_data_file_reproduces_train_py_evaluation(run_dir, tmp_path, capsys):
    """The run evaluated the first 96 validation rows; the same rows as a file give train.py's numbers."""
    path = tmp_path / "first.parquet"
    pd.read_parquet(VALIDATION).head(EVAL_ROWS).to_parquet(path)
    code, out, err = run_main(capsys, run_dir / "final", "--data", path, "--json", "--batch-size", 7)
    assert code == 0, err
    result = json.loads(out)
    final = json.loads((run_dir / "summary.json").read_text())["final"]
    assert result["num_examples"] == EVAL_ROWS
    assert result["accuracy"] == pytest.approx(final["eval/accuracy"])
    assert result["loss"] == pytest.approx(final["eval/loss"], rel=1e-4)


def test_final_copied_elsewhere_reads_its_run_config_file(run_dir, tmp_path, capsys):
    """final/ carries the run config as data (normlab_run.yaml): copied away from its run directory, and without
    the model card, it still scores the run's own split exactly as the run directory does."""
    import yaml

    copied = tmp_path / "copied"
    shutil.copytree(run_dir / "final", copied)
    (copied / "README.md").unlink()  # nothing parses the card
    saved = yaml.safe_load((copied / "normlab_run.yaml").read_text())
    assert saved == yaml.safe_load((run_dir / "config.yaml").read_text())
    code, out, err = run_main(capsys, copied, "--json", "--split", "validation")
    assert code == 0, err
    code, from_run, err = run_main(capsys, run_dir, "--json", "--split", "validation")
    assert code == 0, err
    a, b = json.loads(out), json.loads(from_run)
    for key in ("dataset", "num_examples", "accuracy", "loss", "confusion_matrix"):
        assert a[key] == b[key], key
    (copied / "normlab_run.yaml").unlink()
    code, _, err = run_main(capsys, copied)
    assert code == 2 and err.count("\n") == 1 and "no run config for" in err and "normlab_run.yaml" in err


def test_table_output_and_other_column_names(run_dir, tmp_path, capsys):
    frame = pd.read_parquet(VALIDATION).head(20).rename(columns={"sentence": "review", "label": "stars"})
    path = tmp_path / "reviews.tsv"
    frame[["review", "stars"]].to_csv(path, sep="\t", index=False)
    code, out, err = run_main(capsys, run_dir, "--data", path, "--text-column", "review", "--label-column", "stars")
    assert code == 0, err
    assert "accuracy" in out and "macro-F1" in out and "confusion matrix (rows: true label" in out
    matrix = out.split("columns: predicted label)\n")[1].splitlines()
    assert matrix[0].split() == ["negative", "positive"]
    counts = [list(map(int, line.split()[1:])) for line in matrix[1:3]]
    assert sum(map(sum, counts)) == 20
    assert [sum(row) for row in counts] == [int((frame.stars == 0).sum()), int((frame.stars == 1).sum())]


def test_data_reads_the_runs_own_columns_by_default(run_dir, tmp_path, capsys):
    """--data without --text-column/--label-column: the columns the run trained on (its saved data.text_column and
    data.label_column), here a run whose data named them review and stars; the flags still win."""
    import yaml

    other = tmp_path / "reviews_run"
    shutil.copytree(run_dir / "final", other / "final")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    config["data"].update(text_column="review", label_column="stars")
    (other / "config.yaml").write_text(yaml.safe_dump(config))
    frame = pd.read_parquet(VALIDATION).head(20)
    path = tmp_path / "reviews.csv"
    frame.rename(columns={"sentence": "review", "label": "stars"}).to_csv(path, index=False)
    code, out, err = run_main(capsys, other, "--data", path, "--json")
    assert code == 0, err
    result = json.loads(out)
    assert (result["dataset"]["text_column"], result["dataset"]["label_column"]) == ("review", "stars")
    frame.to_csv(tmp_path / "plain.csv", index=False)
    code, plain, err = run_main(capsys, run_dir, "--data", tmp_path / "plain.csv", "--json")  # sentence, label
    assert code == 0, err
    assert result["confusion_matrix"] == json.loads(plain)["confusion_matrix"]
    code, _, err = run_main(capsys, other, "--data", tmp_path / "plain.csv", "--text-column", "sentence")
    assert code == 2 and "no column 'stars'" in err and "--label-column" in err


def test_text_predictions(run_dir, capsys):
    texts = ["a gorgeous , witty , seductive movie .", "a dull , tedious mess ."]
    code, out, err = run_main(capsys, run_dir, "--text", texts[0], "--text", texts[1], "--json")
    assert code == 0, err
    result = json.loads(out)
    assert "accuracy" not in result  # only predictions when only --text is given
    preds = result["predictions"]
    assert [p["text"] for p in preds] == texts
    for p in preds:
        assert sum(p["probabilities"].values()) == pytest.approx(1.0)
        assert p["label"] == max(p["probabilities"], key=p["probabilities"].get)
        assert p["probability"] == pytest.approx(p["probabilities"][p["label"]])
        assert p["label_id"] == ["negative", "positive"].index(p["label"])
    code, out, _ = run_main(capsys, run_dir, "--text", texts[0])
    assert code == 0 and out.splitlines()[1].endswith("\t" + texts[0])


def test_two_processes_score_every_example_once(run_dir, tmp_path, capsys):
    # 37 rows in batches of 4 over 2 processes: the last batches are padded with repeats that must be dropped
    path = tmp_path / "odd.jsonl"
    pd.read_parquet(VALIDATION).iloc[100:137].to_json(path, orient="records", lines=True)
    code, single, err = run_main(capsys, run_dir, "--data", path, "--json")
    assert code == 0, err
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(REPO_ROOT / "configs" / "accelerate" / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    double = subprocess.run([*launch, str(EVALUATE), str(run_dir), "--data", str(path), "--json", "--batch-size", "4"],
                            capture_output=True, text=True, env=env(), cwd=REPO_ROOT, timeout=300)
    assert double.returncode == 0, double.stderr[-2000:]
    one, two = json.loads(single), json.loads(double.stdout)  # printed once, by the main process
    assert two["num_processes"] == 2 and two["num_examples"] == 37
    assert two["confusion_matrix"] == one["confusion_matrix"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# errors: one line, exit code 2


def test_missing_checkpoint(tmp_path, capsys):
    code, _, err = run_main(capsys, tmp_path / "nope")
    assert code == 2 and err.startswith("evaluate.py: error: checkpoint not found") and err.count("\n") == 1


def test_run_without_final(run_dir, tmp_path, capsys):
    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoints" / "step_6").mkdir(parents=True)
    code, _, err = run_main(capsys, unfinished)
    assert code == 2 and "no checkpoint in" in err and "did not complete" in err
    assert f"evaluate its newest checkpoint, {unfinished / 'checkpoints' / 'step_6'}" in err
    assert f"python train.py output_dir={unfinished} train.resume=auto" in err


def test_file_without_the_columns(run_dir, tmp_path, capsys):
    path = tmp_path / "wrong.csv"
    pd.DataFrame({"text": ["good", "bad"], "y": [1, 0]}).to_csv(path, index=False)
    code, _, err = run_main(capsys, run_dir, "--data", path)
    assert code == 2 and err.count("\n") == 1
    assert "no column 'sentence' or 'label'" in err and "columns present: text, y" in err
    assert "--text-column and --label-column" in err


def test_labels_outside_the_models_label_set(run_dir, tmp_path, capsys):
    path = tmp_path / "three.csv"
    pd.DataFrame({"sentence": ["good", "bad", "meh", "odd"], "label": [1, 0, 2, -1]}).to_csv(path, index=False)
    code, _, err = run_main(capsys, run_dir, "--data", path)
    assert code == 2 and "2 rows of" in err
    assert "outside the model's label set {0 (negative), 1 (positive)}: -1, 2 (first: row 2)" in err


def test_vocabulary_mismatch(run_dir, tmp_path, capsys):
    broken = tmp_path / "small-vocab"
    shutil.copytree(run_dir / "final", broken)
    config = json.loads((broken / "config.json").read_text())
    config["vocab_size"] = 50
    (broken / "config.json").write_text(json.dumps(config))
    code, _, err = run_main(capsys, broken, "--text", "hello")
    assert code == 2 and "vocabulary mismatch" in err and "vocab_size is 50" in err


def test_missing_data_file(run_dir, tmp_path, capsys):
    code, _, err = run_main(capsys, run_dir, "--data", tmp_path / "none.csv")
    assert code == 2 and "data file not found" in err


# ----------------------------------------------------------------------------------------------------------------
# training checkpoints are model directories too; damaged model files are named


def test_a_checkpoint_evaluates_and_loads_as_final_does(run_dir, capsys):
    """checkpoints/step_12 (the last step: the same weights as final/) carries config.json, the model code, the
    tokenizer and the run config; evaluate.py and from_pretrained read it as they read final/."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    step = run_dir / "checkpoints" / "step_12"
    assert json.loads((step / "config.json").read_text()) == json.loads((run_dir / "final" / "config.json").read_text())
    results = []
    for checkpoint in (step, run_dir):
        code, out, err = run_main(capsys, checkpoint, "--json")
        assert code == 0, err
        results.append(json.loads(out))
    for key in ("dataset", "num_examples", "accuracy", "loss", "confusion_matrix"):
        assert results[0][key] == results[1][key], key
    model = AutoModelForSequenceClassification.from_pretrained(step, trust_remote_code=True)
    final = load_file(str(run_dir / "final" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in final.items())


def test_a_run_without_its_final_config_json_names_it(run_dir, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("wandb"))
    (copy / "final" / "config.json").unlink()
    code, _, err = run_main(capsys, copy)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"evaluate.py: error: {copy / 'final' / 'config.json'} is missing")


def test_a_checkpoint_from_older_code_says_why_it_does_not_load(run_dir, tmp_path, capsys):
    old = tmp_path / "step_12"
    shutil.copytree(run_dir / "checkpoints" / "step_12", old)
    (old / "config.json").unlink()  # what train.py wrote into a checkpoint before checkpoints carried it
    code, _, err = run_main(capsys, old)
    assert code == 2 and err.count("\n") == 1
    assert "saved by an older train.py, without its model config (config.json)" in err and "final/" in err


def _truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _junk(path):
    path.write_text("{not json")


# (the damaged file, how it is damaged, what the one-line error says about it)
DAMAGE = [
    ("model.safetensors", _truncate, "is truncated or corrupted"),
    ("config.json", _junk, "is not valid JSON"),
    ("tokenizer.json", Path.unlink, "is missing"),
    ("tokenizer_config.json", Path.unlink, "is missing"),
]


@pytest.mark.parametrize("where", ["final", "checkpoints/step_12"])
@pytest.mark.parametrize("name,damage,why", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_a_damaged_model_file_is_named_in_one_line(run_dir, tmp_path, capsys, where, name, damage, why):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("wandb"))
    damage(copy / where / name)
    code, out, err = run_main(capsys, copy / where, "--text", "a fine film")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"evaluate.py: error: {copy / where / name} {why}")
    assert "evaluate another checkpoint" in err and "train the model again" in err


@pytest.fixture(scope="session")
def bn_run_dir(tmp_path_factory):
    """The same tiny run with naive BatchNorm: its batch statistics depend on the batch's size."""
    from accelerate.state import AcceleratorState, GradientState

    from normlab.train import run as train

    out = tmp_path_factory.mktemp("evaluate-bn") / "run"
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    assert train.main([f"output_dir={out}", *TINY, "model.norm=batchnorm"]) == 0
    return out


def test_batch_stats_use_the_runs_batch_size_and_reproduce_train_py(bn_run_dir, tmp_path, capsys):
    """--batch-stats without --batch-size batches as the run trained (train.batch_size=16, not 64): on the rows
    the run evaluated it gives train.py's own eval/accuracy_batch_stats."""
    path = tmp_path / "first.parquet"
    pd.read_parquet(VALIDATION).head(EVAL_ROWS).to_parquet(path)
    final = json.loads((bn_run_dir / "summary.json").read_text())["final"]
    code, out, err = run_main(capsys, bn_run_dir, "--data", path, "--json", "--batch-stats")
    assert code == 0, err
    result = json.loads(out)
    assert result["batch_size"] == 16
    assert result["accuracy"] == pytest.approx(final["eval/accuracy_batch_stats"])
    code, out, err = run_main(capsys, bn_run_dir, "--data", path, "--json", "--batch-stats", "--batch-size", 64)
    assert code == 0, err
    assert json.loads(out)["batch_size"] == 64  # asked for: kept
    code, out, err = run_main(capsys, bn_run_dir, "--data", path, "--json")
    assert code == 0, err
    assert json.loads(out)["batch_size"] == 64  # running statistics: the size changes only the speed
