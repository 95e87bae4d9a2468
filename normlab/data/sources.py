"""Data: find the dataset (data.path, a local mirror, the Hub) and check it; normlab/data/tokenizer.py tokenizes it and
normlab/data/batching.py batches it. Every problem is a DataError whose one-line message names the problem and the fix.
"""

import math
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from normlab.data.common import DataError, check_text, column
from normlab.paths import REPO_ROOT

# file extension -> (datasets builder, extra builder kwargs)
FORMATS = {".parquet": ("parquet", {}), ".csv": ("csv", {}), ".tsv": ("csv", {"delimiter": "\t"}),
           ".jsonl": ("json", {}), ".json": ("json", {})}
# file-name stems that mean a split (HF's own conventions)
SPLIT_ALIASES = {"validation": ("validation", "valid", "val", "dev"), "test": ("test", "eval"), "train": ("train",)}
DEV_SPLIT = "dev"  # the rows data.dev_rows holds out of the training split
STRING_LABELS = "strings"  # a split whose labels are class names (data.label_names), not ids


def _split_of(file: Path, splits) -> str | None:
    """Which of `splits` a data file belongs to, by its name (train.parquet, dev.tsv, ...)."""
    stem = file.name.split(".")[0].lower()
    for split in splits:
        for alias in SPLIT_ALIASES.get(split, (split,)) + (split.lower(),):
            if stem == alias or stem.startswith(alias + "-") or stem.startswith(alias + "_"):
                return split
    return None


def _parquet_rows(path: Path) -> int | None:
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # not parquet after all: let the reader below say so
        return None


def _load_files(files: dict[str, list[Path]]):
    import datasets

    exts = {f.suffix.lower() for fs in files.values() for f in fs}
    if len(exts) != 1:
        raise DataError(f"data files mix formats ({', '.join(sorted(exts))}); keep one of: {', '.join(FORMATS)}")
    for f in (f for fs in files.values() for f in fs):
        size = f.stat().st_size
        if size == 0:
            raise DataError(f"data file {f} is empty (0 bytes); give a file with a header row and data rows")
        if f.suffix.lower() != ".parquet" and size < 4096 and not f.read_text(errors="replace").strip():
            raise DataError(f"data file {f} is empty (only whitespace); give a file with a header row and data rows")
        if f.suffix.lower() == ".parquet" and _parquet_rows(f) == 0:  # datasets' parquet reader fails on these
            raise DataError(f"data file {f} is empty (0 rows); give a file with data rows")
    builder, kwargs = FORMATS[exts.pop()]
    try:
        return datasets.load_dataset(builder, data_files={k: [str(f) for f in v] for k, v in files.items()}, **kwargs)
    except Exception as e:  # parser errors from pyarrow/pandas: say which files and why, in one line
        msg = " ".join(str(e).split())[:300]
        empty = re.search(r'Instruction "([^"]+)" corresponds to no data', msg)  # e.g. a csv with only a header
        if empty:
            split = empty.group(1)
            where = ", ".join(str(f) for f in files.get(split, []))
            raise DataError(f"split {split!r} of {where} is empty (0 rows); give data with rows in it") from None
        names = ", ".join(str(f) for fs in files.values() for f in fs)
        raise DataError(f"could not read {names} as {builder}: {msg}") from None


def read_data_file(path):
    """One parquet/csv/tsv/jsonl/json file as a Dataset: how training reads data.path, and evaluate.py --data."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    if path.suffix.lower() not in FORMATS:
        raise DataError(f"data file {path} has an unsupported extension; use one of: {', '.join(FORMATS)}")
    return _load_files({"train": [path]})["train"]


def _load_local(path: Path, train_split: str, eval_split: str, eval_fraction: float):
    """A DatasetDict from a folder of split files, a `save_to_disk` folder, or one file: a shuffled `eval_fraction`
    of its rows (data.eval_fraction, rounded up, as HF's train_test_split) is eval_split, the rest train_split."""
    import datasets

    if path.is_file():
        full = read_data_file(path)
        held_out = math.ceil(eval_fraction * len(full))
        if held_out >= len(full):
            raise DataError(f"data file {path} has {len(full)} rows; data.eval_fraction={eval_fraction:g} of them "
                            f"would leave none for {train_split}; give a file with more rows, or a folder with "
                            f"{train_split} and {eval_split} files")
        # a fixed seed: the split must not change with the training seed
        parts = full.train_test_split(test_size=held_out, seed=0, shuffle=True)
        return datasets.DatasetDict({train_split: parts["train"], eval_split: parts["test"]})
    if (path / "dataset_dict.json").exists():
        return datasets.load_from_disk(str(path))
    files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in FORMATS)
    if not files:
        raise DataError(f"folder {path} holds no data files; expected {train_split}.<ext> and {eval_split}.<ext> "
                        f"with <ext> one of: {', '.join(e[1:] for e in FORMATS)}")
    by_split: dict[str, list[Path]] = {}
    for f in files:
        split = _split_of(f, (train_split, eval_split, "train", "validation", "test"))
        if split is not None:
            by_split.setdefault(split, []).append(f)
    if not by_split and len(files) == 1:
        return _load_local(files[0], train_split, eval_split, eval_fraction)
    if not by_split:
        raise DataError(f"folder {path} has files ({', '.join(f.name for f in files[:5])}) but none is named after a "
                        f"split; name them {train_split}.<ext> and {eval_split}.<ext>, or point data.path at one file")
    return _load_files(by_split)


def _hub_reachable(timeout: float = 2.0) -> bool:
    """A quick TCP check, so an offline machine fails in seconds instead of waiting on HTTP retries."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # behind a proxy a direct connection says nothing; let the download try
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def _hub_offline() -> bool:
    import datasets

    env = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")
    return bool(datasets.config.HF_HUB_OFFLINE) or env


def mirror_candidates(name: str) -> list[Path]:
    """Local copies of a Hub dataset, by the tail of its id ("stanfordnlp/sst2" -> sst2)."""
    tail = name.rstrip("/").split("/")[-1]
    places = [Path(os.environ["NORMLAB_DATA_DIR"]) / tail] if os.environ.get("NORMLAB_DATA_DIR") else []
    return places + [REPO_ROOT.parent / "shared" / "datasets" / tail]


def _find_dataset(d):
    """(DatasetDict, description of where it came from), trying data.path, the mirrors, then the Hub."""
    import datasets

    train_split, eval_split = d.train_split, d.eval_split
    if d.path:
        path = Path(d.path).expanduser()
        if not path.exists():
            raise DataError(f"data.path={d.path!r} does not exist; give an existing folder or file "
                            f"({', '.join(e[1:] for e in FORMATS)}) or set data.path=null to use data.name")
        return _load_local(path, train_split, eval_split, d.eval_fraction), str(path)

    tried = []
    for place in mirror_candidates(d.name):
        if place.exists():
            return _load_local(place, train_split, eval_split, d.eval_fraction), str(place)
        tried.append(f"{place} (missing)")
    if _hub_offline():
        try:  # offline mode still finds a copy in the local HF cache, without touching the network
            return datasets.load_dataset(d.name), f"{d.name} (HF cache)"
        except Exception as e:
            tried.append(f"Hub {d.name} (HF_HUB_OFFLINE is set and it is not cached: {type(e).__name__})")
    elif not _hub_reachable():
        tried.append(f"Hub {d.name} (huggingface.co unreachable; with HF_HUB_OFFLINE=1 a copy in the HF "
                     f"cache would be used)")
    else:
        try:
            return datasets.load_dataset(d.name), f"Hub {d.name}"
        except Exception as e:
            tried.append(f"Hub {d.name} ({type(e).__name__}: {' '.join(str(e).split())[:150]})")
    raise DataError(f"dataset {d.name!r} not found; tried: {'; '.join(tried)}. Set data.path=<folder or file> "
                    f"(parquet/tsv/csv/jsonl), put a copy in $NORMLAB_DATA_DIR/{d.name.split('/')[-1]}, "
                    f"or go online")


def _split_class_names(ds, split: str, col: str, source: str, given=None) -> list[str] | str | None:
    """Check one split's labels: present, not null, integer class ids, or strings each among `given`
    (data.label_names). A ClassLabel column: its names; strings: STRING_LABELS."""
    from datasets import ClassLabel, Value

    if col not in ds.column_names:
        ints = [c for c, f in ds.features.items()
                if isinstance(f, ClassLabel) or (isinstance(f, Value) and f.dtype.startswith("int"))]
        fix = f"set data.label_column to one of: {', '.join(ints)}" if ints else "add a label column"
        raise DataError(f"label column {col!r} not in split {split!r} of {source} (columns: "
                        f"{', '.join(ds.column_names)}); {fix}, or use task=mlm for unlabeled text")
    feature = ds.features[col]
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    values = column(ds, col)
    missing = [i for i, v in enumerate(values) if v is None]
    if missing:
        raise DataError(f"{len(missing)} rows in split {split!r} of {source} have no label in column {col!r} "
                        f"(first: row {missing[0]}); drop those rows or fill in their labels")
    kind = feature.dtype if isinstance(feature, Value) else type(feature).__name__
    if kind in ("string", "large_string"):
        return _string_labels(values, split, col, source, given)
    if not kind.startswith(("int", "uint", "float")):
        raise DataError(f"labels in column {col!r} of split {split!r} of {source} are {kind}, not integer class "
                        f"ids 0..num_labels-1; fix the column or set data.label_column")
    bad = next((i for i, v in enumerate(values) if not float(v).is_integer()), None)
    if bad is not None:
        raise DataError(f"label {values[bad]!r} in row {bad} of split {split!r} of {source} is not an integer "
                        f"class id; labels must be 0..num_labels-1 (regression is not supported)")
    return None


def _string_labels(values, split: str, col: str, source: str, given) -> str:
    """STRING_LABELS when every label of the split is one of `given` (data.label_names, whose order gives the class
    ids), else DataError naming what to set."""
    if given is None:
        seen = ",".join(sorted(set(values))[:4])
        raise DataError(f"labels in column {col!r} of {source} are strings (e.g. {values[0]!r}), not class ids; name "
                        f"the classes in class-id order with data.label_names (e.g. data.label_names=[{seen}]), or "
                        f"map them to 0..num_labels-1 in the file")
    unknown = [(i, v) for i, v in enumerate(values) if v not in given]
    if unknown:
        found = sorted({repr(v) for _, v in unknown})
        raise DataError(f"{len(unknown)} rows in split {split!r} of {source} have labels that data.label_names="
                        f"[{', '.join(map(str, given))}] does not name: {', '.join(found[:5])}"
                        f"{' ...' if len(found) > 5 else ''} (first: row {unknown[0][0]}); add them to "
                        f"data.label_names or fix those rows")
    return STRING_LABELS


def _check_labels(dsd, splits, col: str, num_labels: int | None, source: str, given_names=None):
    """Labels present, integer, in [0, num_labels): the DatasetDict with the label column cast to ClassLabel, so
    the classes and their names travel with the data. The names (_class_names) are `given_names`
    (data.label_names), else the dataset's own (a ClassLabel feature); data with neither is refused. String labels
    are the names of `given_names`: the cast gives each its position there."""
    from datasets import ClassLabel

    split_names = [_split_class_names(dsd[split], split, col, source, given_names) for split in splits]
    own = next((n for n in split_names if isinstance(n, list)), None)
    if num_labels is None and own is not None:
        num_labels = len(own)
    elif num_labels is None and STRING_LABELS in split_names:
        num_labels = len(given_names)
    elif num_labels is None:  # inferred from the training labels
        num_labels = int(max(column(dsd[splits[0]], col))) + 1
        if num_labels < 2:
            raise DataError(f"the training labels of {source} are all 0, so the number of classes cannot be inferred; "
                            f"set data.num_labels")
    for split in (split for split, kind in zip(splits, split_names) if kind != STRING_LABELS):
        values = np.asarray(column(dsd[split], col))
        bad = np.flatnonzero((values < 0) | (values >= num_labels))
        if bad.size:
            raise DataError(f"{bad.size} rows in split {split!r} of {source} have labels outside [0, {num_labels}) "
                            f"(first: row {bad[0]}, label {values[bad[0]]}); fix the labels, set data.num_labels, "
                            f"or pick a labeled data.eval_split")
    label_feature = ClassLabel(names=_class_names(given_names, own, num_labels, source))
    for split in splits:
        if dsd[split].features[col] != label_feature:
            dsd[split] = dsd[split].cast_column(col, label_feature)
    return dsd


def _class_names(given, own, num_labels: int, source: str) -> list[str]:
    """The names of classes 0..num_labels-1: `given` (data.label_names) when set, else `own`, the dataset's
    ClassLabel names. Never made up: a model's id2label, its card and a pipeline's output show them, so data
    without names needs data.label_names (SST-2's come from configs/default.yaml, as its local copies have none)."""
    ids = ", ".join(map(str, range(num_labels))) if num_labels <= 6 else f"0, 1, ..., {num_labels - 1}"
    example = "neg,pos" if num_labels == 2 else ",".join(f"name{i}" for i in range(min(num_labels, 3)))
    example += ",..." if num_labels > 3 else ""
    fix = f"(one per class, in label order), e.g. data.label_names=[{example}]"
    if given is not None:
        shown = f"[{', '.join(map(str, given))}]"
        if len(given) != num_labels:
            raise DataError(f"data.label_names={shown} gives {len(given)} names but {source} has {num_labels} "
                            f"classes ({ids}); give {num_labels} names {fix}")
        repeated = next((name for name in given if list(given).count(name) > 1), None)
        if repeated is not None:
            raise DataError(f"data.label_names={shown} names two classes {repeated!r}; give {num_labels} "
                            f"distinct names {fix}")
        return [str(name) for name in given]
    if own is None:
        raise DataError(f"data.label_names is required: {source} has {num_labels} classes ({ids}) and no class names; "
                        f"set data.label_names=[{example}] (one per class, in label order)")
    if len(own) != num_labels:
        raise DataError(f"data.num_labels={num_labels} but {source} names {len(own)} classes ({', '.join(own)}); set "
                        f"data.num_labels=null to use them, or data.label_names to {num_labels} names {fix}")
    return own


def resolve_dataset(d, with_labels: bool):
    """The train and eval splits of the config's `data` section `d`, checked, first N rows if asked. With labels
    (classification) the label column becomes a ClassLabel with data.num_labels classes (or max label + 1):
    `label_names(dsd, d)` gives them; without (mlm, or text to score), the label column is not read."""
    import datasets

    # no progress bars: a bad file must end in exactly one error line on stderr
    bars_were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        dsd, source = _find_dataset(d)
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()
    splits = [d.train_split, d.eval_split]
    for split in splits:
        if split not in dsd:
            raise DataError(f"split {split!r} not in {source} (splits: {', '.join(dsd)}); set "
                            f"data.{'train' if split == splits[0] else 'eval'}_split to one of them")
    if d.doc_sizes:  # documents of the training split's sentences become both splits
        from normlab.data.documents import compose_documents

        dsd = compose_documents(dsd, d, source)
    out = datasets.DatasetDict()
    for split, limit in zip(splits, (d.max_train_samples, d.max_eval_samples)):
        ds = dsd[split]
        if split == d.train_split and d.dev_rows:
            ds, out[DEV_SPLIT] = hold_out_dev(ds, d, source)
            limit = None
        if limit is not None and limit < len(ds):
            ds = ds.select(range(limit))  # the first N rows: reproducible, and cheap (a contiguous slice)
        if len(ds) == 0:
            raise DataError(f"split {split!r} of {source} is empty (0 rows); give data with rows in it")
        check_text(ds, split, d.text_column, source)
        out[split] = ds
    splits += [DEV_SPLIT] if d.dev_rows else []
    if with_labels:
        out = _check_labels(out, splits, d.label_column, d.num_labels, source, d.label_names)
    return out


def hold_out_dev(train, d, source: str):
    """(training rows, dev rows) of the training split `train`: its last data.dev_rows rows are the dev split, never
    trained on (they choose the best evaluation, and a study's LRs); the training rows are the first
    data.max_train_samples of the others, or all of them."""
    if DEV_SPLIT in (d.train_split, d.eval_split):
        raise DataError(f"data.dev_rows holds out a split named {DEV_SPLIT!r}, which data.train_split or "
                        f"data.eval_split already names; rename that split, or set data.dev_rows=null")
    start = len(train) - d.dev_rows
    if start < 1:
        raise DataError(f"data.dev_rows={d.dev_rows} leaves no training rows: split {d.train_split!r} of {source} "
                        f"has {len(train)}; give fewer dev rows")
    if d.max_train_samples is not None and d.max_train_samples > start:
        raise DataError(f"data.max_train_samples={d.max_train_samples} overlaps the last data.dev_rows={d.dev_rows} "
                        f"rows of split {d.train_split!r} of {source} ({len(train)} rows); train on at most {start} "
                        f"rows, or hold out fewer")
    return train.select(range(d.max_train_samples or start)), train.select(range(start, len(train)))


def label_names(dsd, d) -> list[str]:
    """Class names of a resolved classification dataset (len = number of labels), for id2label; `d`: the config's
    `data` section."""
    return list(dsd[d.train_split].features[d.label_column].names)
