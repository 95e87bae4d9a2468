"""Evaluate a checkpoint saved by train.py: accuracy, macro-F1, loss and the confusion matrix.

    python scripts/evaluate.py runs/default                     # the run's final/ on the run's eval split
    python scripts/evaluate.py runs/default/final --split train --json
    python scripts/evaluate.py runs/default --data reviews.csv --text-column review --label-column stars
    python scripts/evaluate.py runs/default --text "a gorgeous film" --text "a dull mess"
    accelerate launch --num_processes 2 scripts/evaluate.py runs/default   # big sets: shards, gathered once
    python scripts/evaluate.py runs/default --wandb             # + confusion matrix and predictions table in W&B
    python scripts/evaluate.py wandb:ENTITY/normlab/model-RUNID:final   # a run's model artifact (online)
    python scripts/evaluate.py runs/mine --trust-remote-code    # its norm's package is not installed here: run the
                                                                # code the checkpoint carries (a checkpoint you trust)

How the checkpoint, its dataset and the scores are found: docs/studies.md; what --wandb logs: docs/wandb.md.
Bad input (missing checkpoint or columns, unknown labels, a tokenizer larger than the vocabulary) ends with one
line on stderr and exit code 2.
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

from normlab.command import command_parser, error_exit
from normlab.files.formats import read_json
from normlab.run_dir import MODEL_DIR_CONFIG, RunDir, saved_config_raw
from normlab.tracking.wandb_report import where_logged
from normlab.tracking.wandb_run import keep_offline_files_in, resolve_mode

DEFAULT_BATCH_SIZE = 64  # evaluation with the running statistics: the batch size changes only the speed
DEFAULT_COLUMNS = ("sentence", "label")  # --data's columns for a model without a saved run config (SST-2's)


class EvalError(ValueError):
    """Bad input; the message names the problem and what would be valid."""


def fetch_artifact(ref: str):
    """(downloaded directory, wandb Artifact) of a model artifact `[entity/project/]model-<run id>:alias`."""
    import wandb

    try:
        artifact = wandb.Api().artifact(ref, type="model")
        return Path(artifact.download()), artifact
    except Exception as err:  # no key, no network, no such artifact: wandb's own message, on one line
        raise EvalError(f"could not fetch the wandb artifact {ref!r}: {' '.join(str(err).split())} (fetching needs "
                        f"`wandb login` and the network; or `wandb artifact get {ref} --root DIR` elsewhere, then "
                        f"evaluate DIR)") from None


def resolve_checkpoint(path: str) -> Path:
    """An HF model directory (config.json: a run's final/ or checkpoints/step_N), or a run directory whose final/ is
    one."""
    p = Path(path)
    if not p.exists():
        raise EvalError(f"checkpoint not found: {p} does not exist; give a run directory (with final/) or its final/")
    if (p / "trainer_state.json").is_file() and not (p / "config.json").is_file():
        raise EvalError(f"{p} is a training checkpoint saved by an older train.py, without its model config "
                        f"(config.json), so it cannot be loaded as a model; evaluate the run's final/, or resume the "
                        f"run with this code (its new checkpoints carry config.json)")
    if (p / "config.json").is_file() or (p / "model.safetensors").is_file():
        return p  # a model directory (check_model_files names what is missing or damaged)
    run = RunDir(p)
    if run.has_final():
        return run.final
    hint = ""
    if run.checkpoints.is_dir() or run.summary_file.is_file():
        from normlab.train.checkpointing import list_checkpoints
        from normlab.train.run_summary import resume_command

        newest = list_checkpoints(p)[-1][1] if list_checkpoints(p) else None
        hint = (" (the run has no final/: it did not complete" + (f"; evaluate its newest checkpoint, {newest}"
                if newest else "") + f"; continue it with {resume_command(p)})")
    raise EvalError(f"no checkpoint in {p}: expected config.json there or in {run.final}{hint}")


def run_dir_of(checkpoint: Path) -> RunDir | None:
    """The run directory holding `checkpoint` (its final/ or checkpoints/step_N), or None for a model directory
    elsewhere."""
    for run in (RunDir(checkpoint.parent), RunDir(checkpoint.parent.parent)):
        if checkpoint in (run.final, run.checkpoints / checkpoint.name) and run.config_file.is_file():
            return run
    return None


def run_config(checkpoint: Path):
    """The training config's data, train and W&B settings (a RunConfig, validated): the run directory's
    config.yaml, else the copy train.py saved inside the model directory; None when there is neither. Its model
    section is left out: the model is the checkpoint's own (config.json), and a norm named `module:Class` need not
    be importable here when the checkpoint carries its code (--trust-remote-code)."""
    from normlab.config.loader import load_config

    run = run_dir_of(checkpoint)
    for path in ([run.config_file] if run is not None else []) + [checkpoint / MODEL_DIR_CONFIG]:
        if path.is_file():
            raw, where = saved_config_raw(path)
            return load_config(saved=({k: v for k, v in raw.items() if k != "model"}, where))
    return None


def check_model_files(checkpoint: Path) -> None:
    """EvalError naming the first missing or damaged file that loading reads (config.json, the weights, the
    tokenizer), before transformers reads them: their errors are tracebacks that do not say what to do."""
    def damaged(name: str, why: str) -> EvalError:
        return EvalError(f"{checkpoint / name} {why}: the model directory is damaged; evaluate another checkpoint "
                         f"(a run's final/ or checkpoints/step_N) or train the model again")

    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        if not (checkpoint / name).is_file():
            raise damaged(name, "is missing")
        if not isinstance(read_json(checkpoint / name), dict):
            raise damaged(name, "is not valid JSON")
    weights = checkpoint / "model.safetensors"
    if weights.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(weights), "pt") as f:  # reads the header, and checks the file covers every tensor
                f.keys()
        except (SafetensorError, OSError) as err:
            raise damaged(weights.name, f"is truncated or corrupted ({' '.join(str(err).split())})") from None
    elif not any(checkpoint.glob("*.safetensors")) and not any(checkpoint.glob("*.bin")):
        raise damaged(weights.name, "is missing")


def model_classes(checkpoint: Path, trust_remote_code: bool) -> tuple:
    """(config class, model class): this checkout's NormLab code (registered with the Auto classes, it wins over
    the code a checkpoint carries, so a checkpoint from elsewhere runs none of its own); with trust_remote_code, the
    code the checkpoint carries (its config's auto_map), which holds the norms of a user's package too."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    auto_map = read_json(checkpoint / "config.json").get("auto_map") or {}
    if not trust_remote_code or not {"AutoConfig", AutoModelForSequenceClassification.__name__} <= set(auto_map):
        return AutoConfig, AutoModelForSequenceClassification
    return tuple(get_class_from_dynamic_module(auto_map[name], checkpoint)
                 for name in ("AutoConfig", AutoModelForSequenceClassification.__name__))


def load_model(checkpoint: Path, trust_remote_code: bool = False):
    import datasets
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stdout/stderr stay the results and the errors
    datasets.disable_progress_bars()
    check_model_files(checkpoint)
    config_class, model_class = model_classes(checkpoint, trust_remote_code)
    try:
        config = config_class.from_pretrained(checkpoint)
    except ValueError as err:  # e.g. a norm from a package this environment cannot import
        carried = "auto_map" in read_json(checkpoint / "config.json") and not trust_remote_code
        raise EvalError(f"{err}" + (f"; or pass --trust-remote-code to run the model and norm code {checkpoint} "
                                    f"carries (only for a checkpoint you trust)" if carried else "")) from None
    architectures = getattr(config, "architectures", None) or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise EvalError(f"{checkpoint} holds a {', '.join(architectures)} model; evaluate.py scores sequence "
                        f"classifiers (train with task=classification)")
    tokenizer = AutoTokenizer.from_pretrained(checkpoint, config=config, trust_remote_code=trust_remote_code)
    if len(tokenizer) > config.vocab_size:
        raise EvalError(f"vocabulary mismatch: the tokenizer in {checkpoint} has {len(tokenizer)} tokens but the "
                        f"model's vocab_size is {config.vocab_size}; save the tokenizer the model was trained with")
    model = model_class.from_pretrained(checkpoint, config=config)
    return model, tokenizer


def batch_size_for(args, checkpoint: Path) -> int:
    """--batch-size, else with --batch-stats the run's training batch size (each batch's statistics depend on
    how many rows it has: train.py's own evaluation uses that size), else DEFAULT_BATCH_SIZE."""
    if args.batch_size is not None:
        return args.batch_size
    cfg = run_config(checkpoint) if args.batch_stats else None
    return cfg.train.batch_size if cfg is not None else DEFAULT_BATCH_SIZE


def check_batch_stats(model, checkpoint: Path) -> None:
    """--batch-stats needs batch-statistics norms, and model code (saved in the checkpoint) that can switch them."""
    if not model.config.uses_batch_statistics:
        raise EvalError(f"--batch-stats: {checkpoint} has no batch-statistics norms (norm={model.config.norm})")
    if not hasattr(model, "batch_stats_in_eval"):
        raise EvalError(f"--batch-stats: the model code saved in {checkpoint} predates batch_stats_in_eval; save "
                        f"the model again with this repository's model/ (from_pretrained, then save_pretrained)")


def label_id(value, by_name: dict, num_labels: int) -> int | None:
    """The class id of an integer id or a label name; None for anything outside the label set (None, NaN too)."""
    if isinstance(value, str) and value in by_name:
        return by_name[value]
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        return None
    return int(as_float) if as_float.is_integer() and 0 <= as_float < num_labels else None


def to_label_ids(values, names: list[str], source: str) -> list[int]:
    """Class ids from integer ids or label names; anything outside the model's label set is an error."""
    by_name = {name: i for i, name in enumerate(names)}
    ids = [label_id(v, by_name, len(names)) for v in values]
    bad = [(row, v) for row, (v, i) in enumerate(zip(values, ids)) if i is None]
    if bad:
        found = sorted({repr(v) for _, v in bad})
        valid = ", ".join(f"{i} ({n})" if n != str(i) else str(i) for i, n in enumerate(names))
        raise EvalError(f"{len(bad)} rows of {source} have labels outside the model's label set {{{valid}}}: "
                        f"{', '.join(found[:5])}{' ...' if len(found) > 5 else ''} (first: row {bad[0][0]})")
    return ids


def run_split(checkpoint: Path, split: str):
    """(Dataset, data section): the run's own dataset (data section of its config), split `split`, all rows."""
    cfg = run_config(checkpoint)
    if cfg is None:
        raise EvalError(f"no run config for {checkpoint} (looked for the config.yaml of its run directory and "
                        f"{checkpoint / MODEL_DIR_CONFIG}); evaluate a file with --data FILE")
    from normlab.data.sources import resolve_dataset

    d = dataclasses.replace(cfg.data, eval_split=split, max_eval_samples=None)
    # without the training-time label checks; the labels are checked against the model's label set, with this
    # script's message
    return resolve_dataset(d, with_labels=False)[split], d


def data_columns(args, checkpoint: Path) -> tuple[str, str]:
    """(text column, label column) of --data: --text-column and --label-column where given, else the run's own
    (data.text_column and data.label_column of its saved config), else DEFAULT_COLUMNS."""
    cfg = run_config(checkpoint) if args.text_column is None or args.label_column is None else None
    own = (cfg.data.text_column, cfg.data.label_column) if cfg is not None else DEFAULT_COLUMNS
    return args.text_column or own[0], args.label_column or own[1]


def labeled_examples(args, checkpoint: Path, names: list[str]):
    """(texts, label ids, {"source", "split"}) of --data FILE, else of the run's split (default validation)."""
    if args.data is not None:
        from normlab.data.sources import read_data_file

        ds = read_data_file(args.data)  # the reader training uses for data.path
        text_column, label_column = data_columns(args, checkpoint)
        source = str(Path(args.data))
        where = {"source": source, "split": None, "text_column": text_column, "label_column": label_column}
    else:
        split = args.split or "validation"
        ds, d = run_split(checkpoint, split)
        text_column, label_column = d.text_column, d.label_column
        where = {"source": d.path or d.name, "split": split, "text_column": None, "label_column": None}
        source = f"split {split!r} of {where['source']}"
    missing = [c for c in (text_column, label_column) if c not in ds.column_names]
    if missing:
        flags = {text_column: "--text-column", label_column: "--label-column"}
        raise EvalError(f"{source} has no column {' or '.join(repr(c) for c in missing)} (columns present: "
                        f"{', '.join(map(str, ds.column_names))}); name the right ones with "
                        f"{' and '.join(flags[c] for c in missing)}")
    columns = ds.select_columns([text_column, label_column])[:]  # plain lists, fast
    texts = columns[text_column]
    bad = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
    if bad:
        raise EvalError(f"{len(bad)} of {len(texts)} rows of {source} have empty or non-text values in column "
                        f"{text_column!r} (first: row {bad[0]}); drop or fill them")
    return texts, to_label_ids(columns[label_column], names, source), where


def classification_metrics(y_true: list[int], y_pred: list[int], names: list[str]) -> dict:
    """Accuracy, per-class precision/recall/F1, macro-F1 (over the classes in the labels or the predictions, as
    scikit-learn) and the confusion matrix (rows true, columns predicted)."""
    k = len(names)
    cm = [[0] * k for _ in range(k)]
    for t, p in zip(y_true, y_pred):
        cm[t][p] += 1
    per_class, f1s = [], []
    for c in range(k):
        tp = cm[c][c]
        predicted = sum(cm[r][c] for r in range(k))
        support = sum(cm[c])
        precision = tp / predicted if predicted else 0.0
        recall = tp / support if support else 0.0
        f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
        per_class.append({"label": names[c], "precision": precision, "recall": recall, "f1": f1, "support": support})
        if support or predicted:
            f1s.append(f1)
    n = len(y_true)
    return {"num_examples": n, "accuracy": sum(cm[c][c] for c in range(k)) / n if n else float("nan"),
            "macro_f1": sum(f1s) / len(f1s) if f1s else float("nan"), "per_class": per_class,
            "labels": names, "confusion_matrix": cm}


def format_table(result: dict) -> str:
    names, cm = result["labels"], result["confusion_matrix"]
    where = result["dataset"]["source"] + (f" [{result['dataset']['split']}]" if result["dataset"]["split"] else "")
    lines = [f"checkpoint: {result['checkpoint']}", f"data:       {where}, {result['num_examples']} examples", "",
             f"accuracy   {result['accuracy']:.4f}", f"macro-F1   {result['macro_f1']:.4f}",
             f"loss       {result['loss']:.4f}", "",
             "confusion matrix (rows: true label, columns: predicted label)"]
    width = max(8, *(len(n) for n in names), *(len(str(x)) for row in cm for x in row)) + 2
    lines.append(" " * width + "".join(n.rjust(width) for n in names))
    for name, row in zip(names, cm):
        lines.append(name.ljust(width) + "".join(str(x).rjust(width) for x in row))
    lines += ["", "label".ljust(width) + "".join(h.rjust(11) for h in ("precision", "recall", "f1", "support"))]
    for c in result["per_class"]:
        scores = f"{c['precision']:11.4f}{c['recall']:11.4f}{c['f1']:11.4f}{c['support']:11d}"
        lines.append(c["label"].ljust(width) + scores)
    return "\n".join(lines)


def max_length_of(model, tokenizer) -> int:
    return min(model.config.max_position_embeddings, tokenizer.model_max_length)


def score(accelerator, model, tokenizer, texts, labels, batch_size, batch_stats=False):
    """Per-example lists {"loss", "prediction", "label", "confidence"} in the order of `texts`, every example once
    across processes (confidence: the softmax probability of the predicted class)."""
    from normlab.data.batching import encode_rows, row_batches
    from normlab.train.evaluation import in_row_order, score_batches

    rows = encode_rows(tokenizer, texts, max_length_of(model, tokenizer), labels)
    loader = row_batches(rows, batch_size, tokenizer.pad_token_id, order="sorted")  # little padding
    batches = score_batches(accelerator, model, accelerator.prepare(loader), batch_stats=batch_stats)
    return {k: v.tolist() for k, v in in_row_order(batches, ("loss", "prediction", "label", "confidence")).items()}


def predict_texts(model, tokenizer, texts, names, batch_stats=False):
    """Every process predicts every text (a handful), as one batch; the main process prints them."""
    from normlab.data.batching import encode_rows, row_batches
    from normlab.train.evaluation import score_batches

    rows = encode_rows(tokenizer, texts, max_length_of(model, tokenizer))
    (scores,) = score_batches(None, model, row_batches(rows, len(rows), tokenizer.pad_token_id),
                              batch_stats=batch_stats)
    out = []
    for text, p in zip(texts, scores["probabilities"].cpu()):
        c = int(p.argmax())
        out.append({"text": text, "label": names[c], "label_id": c, "probability": float(p[c]),
                    "probabilities": {n: float(x) for n, x in zip(names, p)}})
    return out


def evaluate(args):
    """(result dict, accelerator, per-example scores or None): metrics on the requested examples and/or
    predictions for --text."""
    artifact = None
    if args.checkpoint.startswith("wandb:"):
        downloaded, artifact = fetch_artifact(args.checkpoint.removeprefix("wandb:"))
        args.checkpoint = str(downloaded)
    checkpoint = resolve_checkpoint(args.checkpoint)
    if args.data is not None and not Path(args.data).is_file():
        raise EvalError(f"data file not found: {args.data}")
    from normlab.train.accelerator import make_accelerator

    accelerator = make_accelerator()  # train.py's device setup, without a training config
    model, tokenizer = load_model(checkpoint, args.trust_remote_code)
    names = [str(model.config.id2label[i]) for i in range(len(model.config.id2label))]  # label names by class id
    if args.batch_stats:  # BN family: normalize with each batch's own statistics (the train/eval gap)
        check_batch_stats(model, checkpoint)
    model = model.to(accelerator.device).eval()
    result = {"checkpoint": str(checkpoint), "norm": getattr(model.config, "norm", None),
              "norm_placement": getattr(model.config, "norm_placement", None)}
    if artifact is not None:
        result["artifact"] = artifact.qualified_name
    examples = None
    if args.data is not None or args.split is not None or not args.text:
        texts, labels, where = labeled_examples(args, checkpoint, names)
        result["batch_size"] = batch_size_for(args, checkpoint)
        examples = score(accelerator, model, tokenizer, texts, labels, result["batch_size"], args.batch_stats)
        examples["text"] = list(texts)
        result["dataset"] = where
        result.update(classification_metrics(examples["label"], examples["prediction"], names))
        losses = examples["loss"]
        result["loss"] = sum(losses) / len(losses) if losses else float("nan")
    if args.text:
        result["predictions"] = predict_texts(model, tokenizer, args.text, names, args.batch_stats)
    result["num_processes"] = accelerator.num_processes
    return result, accelerator, examples


def log_to_wandb(result: dict, examples: dict | None, mode: str) -> dict:
    """The evaluation as a W&B run (docs/wandb.md); returns {"id", "project", "group", "mode", "dir"}."""
    import wandb

    checkpoint = Path(result["checkpoint"])
    cfg = run_config(checkpoint)
    run_dir = run_dir_of(checkpoint)  # a run's final/ or checkpoint: log next to the training run
    in_run = run_dir is not None
    trained = (run_dir.read_summary() or {}) if in_run else {}
    project = (cfg.wandb.project if cfg is not None else os.environ.get("WANDB_PROJECT")) or "normlab"
    entity = cfg.wandb.entity if cfg is not None else None  # None: wandb reads $WANDB_ENTITY
    group = (cfg.wandb.group if cfg is not None else None) or (
        f"{result['norm']}-{result['norm_placement']}" if result.get("norm") else None)
    name = (run_dir.path.name if in_run else checkpoint.name) + "-eval"
    config = {"checkpoint": str(checkpoint), "train_run_id": trained.get("wandb_run_id"),
              "model_artifact": result.get("artifact"), "dataset": result.get("dataset"),
              "norm": result["norm"], "norm_placement": result["norm_placement"]}
    if in_run and mode == "offline":
        keep_offline_files_in(run_dir)  # the predictions table stays with the run, as train.py's files
    run = wandb.init(project=project, entity=entity, group=group, job_type="eval", name=name, mode=mode, config=config,
                     tags=[t for t in (result["norm"], result["norm_placement"], "eval") if t],
                     dir=str(run_dir.path) if in_run else None, reinit="finish_previous",
                     settings=wandb.Settings(silent=True))
    if result.get("artifact") and mode == "online":
        run.use_artifact(result["artifact"])  # lineage: this evaluation used that model version
    logged = {}
    if examples is not None:
        names = result["labels"]
        logged["eval/confusion_matrix"] = wandb.plot.confusion_matrix(
            y_true=examples["label"], preds=examples["prediction"], class_names=names,
            title="Confusion matrix (rows: true label)")
        logged["eval/predictions"] = wandb.Table(
            columns=["sentence", "label", "prediction", "confidence", "correct", "loss"],
            data=[[text, names[y], names[p], c, y == p, loss] for text, y, p, c, loss in zip(
                examples["text"], examples["label"], examples["prediction"], examples["confidence"], examples["loss"])])
        run.summary.update({f"eval/{k}": result[k] for k in ("accuracy", "macro_f1", "loss", "num_examples")})
    if result.get("predictions"):
        logged["eval/text_predictions"] = wandb.Table(
            columns=["sentence", "prediction", "confidence"],
            data=[[p["text"], p["label"], p["probability"]] for p in result["predictions"]])
    run.log(logged)
    info = {"id": run.id, "project": project, "group": group, "mode": mode, "dir": str(Path(run.dir).parent)}
    run.finish()
    return info


def main(argv=None) -> int:
    parser = command_parser(__doc__)
    parser.add_argument("checkpoint", help="a run directory (uses its final/) or an HF model directory")
    parser.add_argument("--split", default=None, help="split of the run's dataset (default: validation)")
    parser.add_argument("--data", default=None, help="evaluate a parquet/csv/tsv/jsonl file instead")
    parser.add_argument("--text-column", default=None,
                        help="text column of --data (default: the run's data.text_column, else sentence)")
    parser.add_argument("--label-column", default=None,
                        help="label column of --data (default: the run's data.label_column, else label)")
    parser.add_argument("--text", action="append", default=[], help="predict this text (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"examples per batch per process (default {DEFAULT_BATCH_SIZE}; with --batch-stats the "
                             f"run's train.batch_size)")
    parser.add_argument("--batch-stats", action="store_true",
                        help="BN-family norms: use each batch's statistics instead of the running ones")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the model and norm code the checkpoint carries (a norm from a package not "
                             "installed here); by default this checkout's model code runs and the carried code never "
                             "does. Only for a checkpoint you trust")
    parser.add_argument("--wandb", action="store_true",
                        help="also log a W&B eval run: metrics, confusion matrix, per-example predictions table")
    parser.add_argument("--wandb-mode", choices=("auto", "online", "offline"), default="auto",
                        help="auto (default): $WANDB_MODE, else online when a wandb key is configured, else offline")
    args = parser.parse_args(argv)
    if args.data is not None and args.split is not None:
        parser.error("give --split (the run's dataset) or --data FILE, not both")
    if args.batch_size is not None and args.batch_size < 1:
        parser.error("--batch-size must be >= 1")
    try:
        mode = resolve_mode(args.wandb_mode) if args.wandb else "disabled"
        result, accelerator, examples = evaluate(args)
    except ValueError as err:  # EvalError, and normlab.data.sources's DataError / ConfigError
        return error_exit("evaluate.py", err)
    if accelerator.is_main_process:
        if mode != "disabled":
            result["wandb"] = log_to_wandb(result, examples, mode)
        if args.json:
            print(json.dumps(result, indent=1))
        else:
            parts = [format_table(result)] if "accuracy" in result else []
            if result.get("predictions"):
                parts.append("\n".join(["predicted\tprobability\ttext"] + [
                    f"{p['label']}\t{p['probability']:.4f}\t{p['text']}" for p in result["predictions"]]))
            if "wandb" in result:
                parts.append(where_logged(result["wandb"], "eval"))
            print("\n\n".join(parts))
    # tear the process group down before interpreter exit (as train.py does)
    accelerator.end_training()
    return 0


def exit_now(code: int) -> None:
    """Leave without the interpreter's exit-time destructors when several processes ran: a thread left joinable
    in the destroyed process group sometimes aborts a process whose results are already printed."""
    sys.stdout.flush()
    sys.stderr.flush()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    exit_now(main())
