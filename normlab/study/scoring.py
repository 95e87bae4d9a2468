"""Score every finished run of a study and write the compact per-run records the report reads (scripts/score_runs.py;
docs/studies.md, "The records": which splits, batchings and statistics each run is scored with, what a record holds).
"""

import dataclasses
from pathlib import Path

import numpy as np
import torch

from model import NormLabForMaskedLM, NormLabForSequenceClassification
from model.norms import real_token_mask
from normlab.config.loader import model_config_from
from normlab.data.batching import MLM_PROBABILITY, encode_rows, row_batches
from normlab.data.documents import SENTENCE_IDS
from normlab.data.sources import DEV_SPLIT, DataError, resolve_dataset
from normlab.files.formats import atomic_write_json, read_json, read_jsonl, write_jsonl
from normlab.run_dir import FINISHED, RunDir
from normlab.study.study_dir import StudyDir
from normlab.train.evaluation import evaluate, in_row_order, score_batches
from normlab.train.progress_bars import bars_on
from normlab.train.run_summary import tokens_per_s

# sorted: length-sorted batches padded to their longest; shuffled: one fixed random order, padded to the batch's
# longest; fixed: the sorted batches padded to data.max_length
BATCHINGS = ("sorted", "shuffled", "fixed")
SHUFFLE_SEED = 1234  # one order for every model, so their shuffled batches hold the same sentences
MLM_SEED = 1234  # the masks of every MLM model's scoring: one draw, shared
# a study file's `score` block overrides them; partner_batchings > 0 also measures partner_dependence (that many
# random batchings of the validation split per batch-statistics run)
SCORE_DEFAULTS = {"dev_rows": 2000, "batch_size": 32, "partner_batchings": 0}
BN_EVALS = ("accuracy_batch_stats", "accuracy_precise_bn")  # the records' evaluations keep them with precise BN
COORDINATES = ("experiment", "variant", "lr", "warmup", "seed")  # a run's place in the study (study.json's entry)


def _sig(x, digits=5):
    return None if x is None or not np.isfinite(x) else float(f"{x:.{digits}g}")


def block_values(row: dict, name: str) -> list[float]:
    """The row's per-block `bn/{i}/<name>` values."""
    return [v for k, v in row.items() if k.startswith("bn/") and k.endswith(f"/{name}")]


def curves(metrics: list[dict]) -> dict:
    """Per-step series the report plots; layer-wise keys reduced to one number per step."""
    steps = [r for r in metrics if "train/loss" in r]
    out = {"step": [r["step"] for r in steps], "loss": [_sig(r["train/loss"]) for r in steps],
           "grad_norm": [_sig(r.get("train/grad_norm")) for r in steps]}
    logit = [[v for k, v in r.items() if k.endswith("/attn_logit_max")] for r in steps]
    if any(logit):
        out["attn_logit_max"] = [_sig(max(v)) if v else None for v in logit]
    drift = [block_values(r, "stat_drift") for r in steps]
    if any(drift):
        out["stat_drift"] = [_sig(float(np.mean(v))) if v else None for v in drift]
    out["eval"] = [{"step": r["step"], "loss": _sig(r["eval/loss"]), "accuracy": _sig(r["eval/accuracy"]),
                    **({"dev_loss": _sig(r["dev/loss"]), "dev_accuracy": _sig(r["dev/accuracy"])}
                       if "dev/loss" in r else {}),  # the dev rows (data.dev_rows), where the run held them out
                    # runs with precise BN (train.precise_bn_batches): its accuracy and the batch statistics' beside
                    # the running statistics' (only these: every earlier record stays byte for byte as it was)
                    **({k: _sig(r[f"eval/{k}"]) for k in BN_EVALS} if "eval/accuracy_precise_bn" in r else {}),
                    # the lag-free noise of the batch statistics, where the run logged it (the mean over blocks)
                    **({"stat_noise": _sig(float(np.mean(noise)))}
                       if (noise := block_values(r, "stat_noise")) else {})}
                   for r in metrics if "eval/loss" in r]
    return out


def predict(model, rows: list[dict], how: str, batch_size: int, max_length: int, pad_id: int,
            batch_stats: bool = False) -> dict:
    """Mean loss, accuracy and the predicted class of every example (in dataset order) under one batching of
    encode_rows' rows (BATCHINGS), with running statistics or (batch_stats) each batch's own."""
    order = "shuffled" if how == "shuffled" else "sorted"
    batches = row_batches(rows, batch_size, pad_id, order=order, width=max_length if how == "fixed" else None,
                          seed=SHUFFLE_SEED)
    scores = in_row_order(score_batches(None, model, batches, batch_stats=batch_stats), ("loss", "prediction", "label"))
    losses, preds = scores["loss"].numpy().astype(np.float64), scores["prediction"].numpy()
    return {"loss": _sig(losses.mean()), "accuracy": _sig(float((preds == scores["label"].numpy()).mean())),
            "pred": "".join(map(str, preds.tolist()))}


@torch.no_grad()
def running_stat_gap(model, rows: list[dict], batch_size: int, pad_id: int) -> dict | None:
    """Per norm layer with running statistics (in model order), in the eval the report states (running statistics,
    sorted batches): the mean over features of |running mean - real mean| / real std, and of
    |log(running var / real var)|, where "real" is over the real (non-pad) tokens entering that layer on the
    validation split. Both are 0 when the running statistics are those of the real tokens. None: no such layer."""
    # the mean/variance ones: PowerNorm keeps a running quadratic mean instead
    norms = [m for m in model.batch_statistics_norms().values() if hasattr(m, "running_var")]
    if not norms:
        return None
    sums = {id(m): torch.zeros(3, m.num_features, dtype=torch.float64) for m in norms}  # count, sum x, sum x^2

    def record(module, args, kwargs):
        x, mask = args[0], (args[1] if len(args) > 1 else kwargs.get("mask"))
        real = real_token_mask(x, mask)  # (N,) bool
        xr = x.reshape(-1, module.num_features)[real].double()  # (n_real, D)
        sums[id(module)] += torch.stack([torch.full_like(xr[0], len(xr)), xr.sum(0), (xr ** 2).sum(0)])

    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in norms]
    try:
        score_batches(None, model, row_batches(rows, batch_size, pad_id, order="sorted"))
    finally:
        for h in hooks:
            h.remove()
    mean_gap, log_var_ratio = [], []
    for m in norms:
        count, total, squares = sums[id(m)]
        mean = total / count
        var = (squares / count - mean ** 2).clamp(min=1e-12)
        mean_gap.append(_sig(((m.running_mean.double() - mean).abs() / var.sqrt()).mean().item(), 4))
        log_var_ratio.append(_sig((m.running_var.double() / var).log().abs().mean().item(), 4))
    return {"mean_gap": mean_gap, "log_var_ratio": log_var_ratio}


def score_sets(cfg, dev_rows: int, dsd=None) -> dict:
    """{"dev": (texts, labels), "val": (texts, labels)} from the run's own config (a RunConfig), or from `dsd`
    (score_data's) where the caller has it: dev is the training split's last `dev_rows` rows."""
    dsd = dsd if dsd is not None else score_data(cfg, dev_rows)
    col, lab = cfg.data.text_column, cfg.data.label_column
    dev, val = dsd[DEV_SPLIT], dsd[cfg.data.eval_split]
    return {"dev": (dev[col], dev[lab]), "val": (val[col], val[lab])}


def document_rows(cfg, dsd) -> list[dict]:
    """One row per evaluation document (data.doc_sizes): its row in the val split, its number of sentences and its
    label, so that a study can score its long documents apart; [] where the rows are sentences."""
    val = dsd[cfg.data.eval_split]
    if SENTENCE_IDS not in val.column_names:
        return []
    return [{"split": "val", "row": i, "sentences": len(ids), "label": int(y)}
            for i, (ids, y) in enumerate(zip(val[SENTENCE_IDS], val[cfg.data.label_column]))]


def score_data(cfg, dev_rows: int):
    """The run's data as its config builds it, with the training split's last `dev_rows` rows held out as dev
    (normlab.data.sources.hold_out_dev, as train.py's data.dev_rows), which the runs must not have trained on."""
    bars_on()  # a study's scoring and LR choice write to its log: no "Casting the dataset" bars there
    d = cfg.data
    if d.dev_rows not in (None, dev_rows):
        raise SystemExit(f"score_runs.py: the runs held out data.dev_rows={d.dev_rows}, not the {dev_rows} dev rows "
                         f"asked for; score them with dev_rows: {d.dev_rows}")
    if d.dev_rows is None and d.max_train_samples is None:
        raise SystemExit("score_runs.py: the runs trained on every training row; none is left for dev")
    try:
        dsd = resolve_dataset(dataclasses.replace(d, dev_rows=dev_rows, max_eval_samples=None),
                              with_labels=cfg.task == "classification")
    except DataError as e:  # the dev rows overlap the trained ones
        raise SystemExit(f"score_runs.py: {e}") from None
    return dsd


@torch.no_grad()
def partner_dependence(model, rows: list[dict], batch_size: int, pad_id: int, batchings: int) -> float | None:
    """How much a sentence's prediction depends on the sentences it is batched with, under batch statistics: its
    logit margin (log p1 - log p0) over `batchings` random batchings of `rows` into batches of `batch_size` (the
    run's training batch, grouped as in training), the RMS over sentences of its SD across the batchings, divided
    by the SD across sentences of its mean margin. 0: the partners change nothing; None: too few batchings."""
    if batchings < 2:
        return None
    margins = []
    for seed in range(batchings):
        batches = row_batches(rows, batch_size, pad_id, order="shuffled", seed=seed)
        p = in_row_order(score_batches(None, model, batches, batch_stats=True), ("probabilities",))["probabilities"]
        p = p.double().clamp_min(1e-30)
        margins.append(p[:, 1].log() - p[:, 0].log())
    m = torch.stack(margins)  # (batchings, sentences)
    return _sig(float(m.var(0).mean().sqrt() / m.mean(0).std()), 4)


def score_run(run_dir: Path, sets: dict, full_batchings: bool, batch_size: int,
              partner_batchings: int = 0) -> tuple[dict, dict]:
    """({split/batching/statistics: predict()}, the record's other measures of the final model: running_stat_gap()
    on the validation split as `running_stats`, and with `partner_batchings` its `partner_dependence`, where
    they apply)"""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # quietly: a study loads hundreds of models
    run = RunDir(run_dir)
    cfg = run.read_config()
    if cfg.task == "mlm":
        return score_mlm(run, cfg, sets, batch_size), None
    model = NormLabForSequenceClassification.from_pretrained(run.final).eval()
    tokenizer = AutoTokenizer.from_pretrained(run.final)
    max_length = cfg.data.max_length
    out, rows = {}, {}
    for split, (texts, labels) in sets.items():
        rows[split] = encode_rows(tokenizer, texts, max_length, labels)
        full = full_batchings and split == "val"
        hows = BATCHINGS if full else ("sorted",)
        modes = ("running", "batch") if (full and model.batch_statistics_norms()) else ("running",)
        for mode in modes:
            for how in hows:
                out[f"{split}/{how}/{mode}"] = predict(model, rows[split], how, batch_size, max_length,
                                                       tokenizer.pad_token_id, batch_stats=mode == "batch")
    extras = {}
    if "val" in rows:
        extras["running_stats"] = running_stat_gap(model, rows["val"], batch_size, tokenizer.pad_token_id)
        if model.batch_statistics_norms():
            extras["partner_dependence"] = partner_dependence(model, rows["val"], cfg.train.batch_size,
                                                              tokenizer.pad_token_id, partner_batchings)
    return out, {k: v for k, v in extras.items() if v is not None}


def score_mlm(run: RunDir, cfg, sets: dict, batch_size: int) -> dict:
    """An MLM run's final model: mean masked-token loss and accuracy per split (length-sorted batches), with the
    same masks for every model (15% of the tokens, drawn under MLM_SEED), so that arms are compared on one task."""
    from transformers import AutoTokenizer, DataCollatorForLanguageModeling

    model = NormLabForMaskedLM.from_pretrained(run.final).eval()
    tokenizer = AutoTokenizer.from_pretrained(run.final)
    max_length = cfg.data.max_length
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=MLM_PROBABILITY)
    out = {}
    for split, (texts, _) in sets.items():
        enc = tokenizer(list(texts), truncation=True, max_length=max_length, return_special_tokens_mask=True)
        rows = [{"input_ids": i, "special_tokens_mask": m}
                for i, m in zip(enc["input_ids"], enc["special_tokens_mask"])]
        loader = row_batches(rows, batch_size, tokenizer.pad_token_id, order="sorted", collate=collate)
        metrics = evaluate(None, model, loader, "mlm", seed=MLM_SEED)
        out[f"{split}/sorted/running"] = {"loss": _sig(metrics["eval/loss"]),
                                          "accuracy": _sig(metrics["eval/accuracy"])}
    return out


def scored_before(folder: StudyDir) -> dict[str, dict]:
    """{run name: its record} from the study's last scoring, where there was one (with its gold labels)."""
    if not (folder.scored.is_file() and folder.labels_file.is_file()):
        return {}
    return {row["name"]: row for row in read_jsonl(folder.scored)}


def still_scored(row: dict | None, run: RunDir, needs_dev: bool) -> dict | None:
    """A record from an earlier scoring that still holds: its run had finished then, with the status and step its
    summary.json has now (a run trained further or again is scored anew), and with the dev scores it needs."""
    summary = run.read_summary() or {}
    if row is None or row.get("status") not in FINISHED or row.get("status") != summary.get("status"):
        return None
    if (row.get("curves", {}).get("step") or [None])[-1] != summary.get("step"):
        return None
    has_dev = any(key.startswith("dev/") for key in row.get("scores", {}))
    return row if has_dev or not needs_dev else None


def record(study_dir: Path, name: str, entry: dict, sets, batch_size: int, partner_batchings: int = 0) -> dict:
    run = RunDir(StudyDir(study_dir).run(name))
    cfg = run.read_config()  # None: the run never started
    summary = run.read_summary() or {}
    rec = {k: entry.get(k) for k in COORDINATES}
    model_cfg = cfg.model.given() if cfg is not None else {}
    rec.update(name=name, status=summary.get("status", entry.get("status")),
               task=cfg.task if cfg is not None else "classification",
               norm=model_cfg.get("norm"), placement=model_cfg.get("norm_placement"),
               qk_norm=bool(model_cfg.get("qk_norm")),
               grouped=bool(cfg is not None and cfg.data.group_by_length), duration_s=entry.get("duration_s"),
               loss_spikes=summary.get("loss_spikes"), wandb_run_id=summary.get("wandb_run_id"),
               cpu_threads=summary.get("cpu_threads"))  # a CPU run's last digits depend on its thread count
    if cfg is not None:  # the outcome rules' window is a number of examples, so they need the batch's size
        rec["examples_per_step"] = (cfg.train.batch_size * cfg.train.grad_accum_steps
                                    * (summary.get("num_processes") or 1))
    if run.metrics_file.is_file():
        metrics = read_jsonl(run.metrics_file)
        rec["curves"] = curves(metrics)
        # outside the curves, so that older studies' records (which lack them) keep their digests
        pads = [r["train/pad_fraction"] for r in metrics if r.get("train/pad_fraction") is not None]
        rec["pad_fraction"] = _sig(float(np.mean(pads))) if pads else None
        rec["tokens_per_s"] = _sig(tokens_per_s(rows=metrics))
    if rec["status"] == "completed" and run.has_final():
        # batch statistics anywhere (blocks, final norm, pooled vector), not only the block norm rec["norm"] names
        full = rec["experiment"] == "e3" or NormLabForSequenceClassification.builds_batch_statistics(
            model_config_from(cfg))
        rec["scores"], extras = score_run(run.path, sets, full, batch_size, partner_batchings=partner_batchings)
        rec.update(extras)
    return rec


def score(study_dir: Path, shard: tuple = (0, 1), out: Path | None = None) -> int:
    """Every run's record, written to `out` (default STUDY/runs.jsonl), with the gold labels beside it; `shard`
    (K, N): only every N-th run from the K-th (run_sharded's part). A record scored before whose run has not
    changed since is kept as it was. Returns the number of records written."""
    k, n = shard
    folder = StudyDir(study_dir)
    study, plan = read_json(folder.study_json), folder.spec().plan
    block = {**SCORE_DEFAULTS, **plan.score}  # the spec's `score` block
    torch.set_num_threads(1)  # small models: one thread, no spinning against other processes for the cores
    sets, out = None, Path(out or folder.scored)
    rows, kept = [], 0
    sweeps = plan.sweeps()
    earlier = scored_before(folder)
    for name, entry in sorted(study["runs"].items())[k::n]:
        # the dev rows choose LRs: a study with LR sweeps scores them for its sweeps' runs only
        needs_dev = not sweeps or bool(sweeps & set(entry.get("experiments", [entry.get("experiment")])))
        run = RunDir(folder.run(name))
        if (row := still_scored(earlier.get(name), run, needs_dev)) is not None:
            rows.append({**row, **{key: entry.get(key) for key in COORDINATES}})
            kept += 1
            continue
        cfg = run.read_config() if sets is None else None
        if cfg is not None:
            dsd = score_data(cfg, block["dev_rows"])
            sets, documents = score_sets(cfg, block["dev_rows"], dsd), document_rows(cfg, dsd)
        run_sets = sets if needs_dev or sets is None else {k: v for k, v in sets.items() if k != "dev"}
        rows.append(record(folder.path, name, entry, run_sets, block["batch_size"], block["partner_batchings"]))
        print(f"scored {name}: {rows[-1]['status']}", flush=True)
    if kept:
        print(f"kept {kept} records scored before: their runs have not changed since", flush=True)
    write_jsonl(out, rows)
    if sets is not None:  # the gold labels, once: the report scores the saved predictions against them
        labels = {split: "".join(str(int(y)) for y in ys) for split, (_, ys) in sets.items()}
        atomic_write_json(StudyDir(out.parent).labels_file, labels, indent=None)
        if documents:
            write_jsonl(StudyDir(out.parent).documents_file, documents)
    return len(rows)
