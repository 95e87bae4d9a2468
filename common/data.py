"""Data: find the dataset, check it, train (or fetch) the tokenizer, tokenize, and batch with little padding.

    resolve_dataset(cfg)            data.path -> local mirror -> Hub; checked; first N rows if asked
    get_tokenizer(cfg, texts)       BPE trained on the training text (cached on disk), or a Hub tokenizer
    tokenize_splits(dsd, tok, cfg)  input_ids, attention_mask, token_type_ids, labels, length
    load_tokenized(cfg)             the three above in order: what training and scripts/bench.py batch from
    build_dataloaders(cfg, tok, t)  length-grouped shuffled training batches, length-sorted eval batches
    encode_rows(tok, texts, n)      texts (and labels) -> rows that remember their index
    row_batches(rows, bs, pad_id)   rows -> padded batches: as given, length-sorted or in a fixed shuffled order;
                                    padded to each batch's longest row or to a fixed width (every evaluation)

Every problem with the data is a DataError (a ValueError) whose one-line message names the problem and the fix.
"""

import functools
import hashlib
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from .cache import cached_folder, cached_map
from .config import REPO_ROOT

# file extension -> (datasets builder, extra builder kwargs)
FORMATS = {
    ".parquet": ("parquet", {}),
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
}
# file-name stems that mean a split (HF's own conventions)
SPLIT_ALIASES = {"validation": ("validation", "valid", "val", "dev"), "test": ("test", "eval"), "train": ("train",)}
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]  # [PAD] = 0: the model's default pad_token_id
TOKENIZER_RECIPE = "bpe-metaspace-bert-v1"  # bump when the recipe below changes: it is part of the cache key
MLM_PROBABILITY = 0.15
# Mega-batches of MEGA_BATCH_MULT batches are sorted by length. The pad fraction falls like 1/MEGA_BATCH_MULT
# (measured in docs/architecture.md); 100 still leaves ~20 mega-batches per SST-2 epoch to shuffle.
MEGA_BATCH_MULT = 100


class DataError(ValueError):
    """A problem with the data (missing, empty, wrong columns or labels); the message says how to fix it."""


def _column(ds, col: str) -> list:
    """One column as a Python list, fast (iterating `ds[col]` row by row decodes one row at a time)."""
    return ds.select_columns([col])[:][col]


def _data_cfg(cfg: dict) -> tuple[dict, str]:
    """Accept the whole config or just its `data` section."""
    if "data" in cfg and isinstance(cfg["data"], dict):
        return cfg["data"], cfg.get("task", "classification")
    return cfg, "classification"


def cache_dir() -> Path:
    """$NORMLAB_CACHE or REPO_ROOT/.cache (tokenizers go in its tokenizers/ folder)."""
    return Path(os.environ.get("NORMLAB_CACHE") or REPO_ROOT / ".cache")


# ----------------------------------------------------------------------------------------------------------
# finding the data


def _split_of(file: Path, splits) -> str | None:
    """Which of `splits` a data file belongs to, from its name: train.parquet, train-00000-of-00001.parquet,
    dev.tsv (-> validation), ..."""
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


def _load_local(path: Path, train_split: str, eval_split: str):
    """A DatasetDict from a folder of split files, a `save_to_disk` folder, or one file (split 90/10)."""
    import datasets

    if path.is_file():
        full = read_data_file(path)
        if len(full) < 2:
            raise DataError(f"data file {path} has {len(full)} rows; a single file is split 90/10 into "
                            f"{train_split}/{eval_split}, so it needs at least 2 rows")
        # a fixed seed: the split must not change with the training seed
        parts = full.train_test_split(test_size=0.1, seed=0, shuffle=True)
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
        return _load_local(files[0], train_split, eval_split)
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
    places = []
    if os.environ.get("NORMLAB_DATA_DIR"):
        places.append(Path(os.environ["NORMLAB_DATA_DIR"]) / tail)
    places.append(REPO_ROOT.parent / "shared" / "datasets" / tail)
    return places


def _find_dataset(d: dict):
    """(DatasetDict, description of where it came from), trying data.path, the mirrors, then the Hub."""
    import datasets

    train_split, eval_split = d["train_split"], d["eval_split"]
    if d.get("path"):
        path = Path(d["path"]).expanduser()
        if not path.exists():
            raise DataError(f"data.path={d['path']!r} does not exist; give an existing folder or file "
                            f"({', '.join(e[1:] for e in FORMATS)}) or set data.path=null to use data.name")
        return _load_local(path, train_split, eval_split), str(path)

    tried = []
    for place in mirror_candidates(d["name"]):
        if place.exists():
            return _load_local(place, train_split, eval_split), str(place)
        tried.append(f"{place} (missing)")
    if _hub_offline():
        try:  # offline mode still finds a copy in the local HF cache, without touching the network
            return datasets.load_dataset(d["name"]), f"{d['name']} (HF cache)"
        except Exception as e:
            tried.append(f"Hub {d['name']} (HF_HUB_OFFLINE is set and it is not cached: {type(e).__name__})")
    elif not _hub_reachable():
        tried.append(f"Hub {d['name']} (huggingface.co unreachable; with HF_HUB_OFFLINE=1 a copy in the HF "
                     f"cache would be used)")
    else:
        try:
            return datasets.load_dataset(d["name"]), f"Hub {d['name']}"
        except Exception as e:
            tried.append(f"Hub {d['name']} ({type(e).__name__}: {' '.join(str(e).split())[:150]})")
    raise DataError(f"dataset {d['name']!r} not found; tried: {'; '.join(tried)}. Set data.path=<folder or file> "
                    f"(parquet/tsv/csv/jsonl), put a copy in $NORMLAB_DATA_DIR/{d['name'].split('/')[-1]}, "
                    f"or go online")


# ----------------------------------------------------------------------------------------------------------
# checking the data


def _text_columns(ds) -> list[str]:
    from datasets import Value

    return [c for c, f in ds.features.items() if isinstance(f, Value) and f.dtype in ("string", "large_string")]


def _check_text(ds, split: str, col: str, source: str):
    from datasets import Value

    if col not in ds.column_names:
        text_cols = _text_columns(ds)
        fix = f"set data.text_column={text_cols[0]}" if text_cols else "set data.text_column to the text column"
        raise DataError(f"text column {col!r} not in split {split!r} of {source} (columns: "
                        f"{', '.join(ds.column_names)}); {fix}")
    feature = ds.features[col]
    if col not in _text_columns(ds):
        kind = feature.dtype if isinstance(feature, Value) else type(feature).__name__
        if kind == "null":  # what a reader infers for a column with nothing in it
            raise DataError(f"every row of split {split!r} of {source} has empty text in column {col!r}; "
                            f"fill the column or set data.text_column to the text column")
        text_cols = _text_columns(ds)
        fix = f"set data.text_column to one of: {', '.join(text_cols)}" if text_cols else "give a column of strings"
        raise DataError(f"data.text_column={col!r} holds {kind}, not text, in split {split!r} of {source}; {fix}")
    bad = [i for i, t in enumerate(_column(ds, col)) if t is None or not t.strip()]
    if bad:
        raise DataError(f"{len(bad)} of {len(ds)} rows in split {split!r} of {source} have empty or missing text in "
                        f"column {col!r} (first: row {bad[0]}); drop or fill those rows")


def _check_labels(dsd, splits, col: str, num_labels: int | None, source: str, given_names=None):
    """Labels present, integer, not null, in [0, num_labels). Returns the DatasetDict with the label column cast
    to ClassLabel, so the number of classes and their names travel with the data (see `label_names`). The names
    are the dataset's own (a ClassLabel feature), else `given_names` (data.label_names), else "0", "1", ..."""
    from datasets import ClassLabel, Value

    names = None
    for split in splits:
        ds = dsd[split]
        if col not in ds.column_names:
            ints = [c for c, f in ds.features.items()
                    if isinstance(f, ClassLabel) or (isinstance(f, Value) and f.dtype.startswith("int"))]
            fix = f"set data.label_column to one of: {', '.join(ints)}" if ints else "add a label column"
            raise DataError(f"label column {col!r} not in split {split!r} of {source} (columns: "
                            f"{', '.join(ds.column_names)}); {fix}, or use task=mlm for unlabeled text")
        feature = ds.features[col]
        if isinstance(feature, ClassLabel):
            names = names or list(feature.names)
            continue
        values = _column(ds, col)
        missing = [i for i, v in enumerate(values) if v is None]
        if missing:
            raise DataError(f"{len(missing)} rows in split {split!r} of {source} have no label in column {col!r} "
                            f"(first: row {missing[0]}); drop those rows or fill in their labels")
        if isinstance(feature, Value) and feature.dtype in ("string", "large_string"):
            raise DataError(f"labels in column {col!r} of {source} are strings (e.g. {values[0]!r}), not class ids; "
                            f"map them to 0..num_labels-1 in the file")
        if not (isinstance(feature, Value) and feature.dtype.startswith(("int", "uint", "float"))):
            kind = feature.dtype if isinstance(feature, Value) else type(feature).__name__
            raise DataError(f"labels in column {col!r} of split {split!r} of {source} are {kind}, not integer class "
                            f"ids 0..num_labels-1; fix the column or set data.label_column")
        if not all(float(v).is_integer() for v in values):
            bad = next(i for i, v in enumerate(values) if not float(v).is_integer())
            raise DataError(f"label {values[bad]!r} in row {bad} of split {split!r} of {source} is not an integer "
                            f"class id; labels must be 0..num_labels-1 (regression is not supported)")
    if names is not None and num_labels is None:
        num_labels = len(names)
    if num_labels is None:  # inferred from the training labels
        num_labels = int(max(_column(dsd[splits[0]], col))) + 1
        if num_labels < 2:
            raise DataError(f"the training labels of {source} are all 0, so the number of classes cannot be inferred; "
                            f"set data.num_labels")
    for split in splits:
        values = np.asarray(_column(dsd[split], col))
        bad = np.flatnonzero((values < 0) | (values >= num_labels))
        if bad.size:
            raise DataError(f"{bad.size} rows in split {split!r} of {source} have labels outside [0, {num_labels}) "
                            f"(first: row {bad[0]}, label {values[bad[0]]}); fix the labels, set data.num_labels, "
                            f"or pick a labeled data.eval_split")
    if names is None or len(names) != num_labels:
        names = _given_label_names(given_names, num_labels, source)
    label_feature = ClassLabel(names=names)
    for split in splits:
        if dsd[split].features[col] != label_feature:
            dsd[split] = dsd[split].cast_column(col, label_feature)
    return dsd


def _given_label_names(given, num_labels: int, source: str) -> list[str]:
    """data.label_names for a dataset that does not name its classes; "0", "1", ... when it is null, or (with a
    warning: the default names SST-2's two classes, and other data must still train) when it does not fit."""
    ids = [str(i) for i in range(num_labels)]
    if not given:
        return ids
    if len(given) != num_labels or len(set(given)) != len(given):
        import warnings

        warnings.warn(f"data.label_names={list(given)} does not name the {num_labels} classes of {source} (one "
                      f"distinct name per class id); the classes are named {', '.join(ids)}. Set data.label_names "
                      f"to {num_labels} names, or to null", stacklevel=2)
        return ids
    return [str(name) for name in given]


def resolve_dataset(cfg: dict, task: str | None = None):
    """The train and eval splits (keys: data.train_split, data.eval_split), checked, first N rows if asked.

    `cfg` is the whole config or its `data` section. For classification the label column becomes a ClassLabel
    with data.num_labels classes (or max label + 1): `label_names(dsd, cfg)` gives them."""
    import datasets

    d, default_task = _data_cfg(cfg)
    task = task or default_task
    # No "Generating train split" bars: loading local files takes a second, and a bad file must end in exactly
    # one error line on stderr, not bars first.
    bars_were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        dsd, source = _find_dataset(d)
    finally:
        if not bars_were_off:
            datasets.enable_progress_bars()
    splits = [d["train_split"], d["eval_split"]]
    for split in splits:
        if split not in dsd:
            raise DataError(f"split {split!r} not in {source} (splits: {', '.join(dsd)}); set "
                            f"data.{'train' if split == splits[0] else 'eval'}_split to one of them")
    out = datasets.DatasetDict()
    for split, limit in zip(splits, (d.get("max_train_samples"), d.get("max_eval_samples"))):
        ds = dsd[split]
        if limit is not None and limit < len(ds):
            ds = ds.select(range(limit))  # the first N rows: reproducible, and cheap (a contiguous slice)
        if len(ds) == 0:
            raise DataError(f"split {split!r} of {source} is empty (0 rows); give data with rows in it")
        _check_text(ds, split, d["text_column"], source)
        out[split] = ds
    if task == "classification":
        out = _check_labels(out, splits, d["label_column"], d.get("num_labels"), source, d.get("label_names"))
    return out


def label_names(dsd, cfg: dict) -> list[str]:
    """Class names of a resolved classification dataset (len = number of labels), for id2label."""
    d, _ = _data_cfg(cfg)
    return list(dsd[d["train_split"]].features[d["label_column"]].names)


# ----------------------------------------------------------------------------------------------------------
# tokenizer


def _train_tokenizer(texts: list[str], vocab_size: int):
    """A BPE tokenizer with BERT's text handling: lowercase, strip accents, split on whitespace and punctuation.
    Pieces that start a word carry a leading "▁" (Metaspace, as in SentencePiece) instead of WordPiece's "##"
    on the pieces that continue one. Why not WordPiece: its trainer in `tokenizers` numbers the "##" pieces in
    hash-map order, which changes from process to process, and merges of equal count are ordered by those
    numbers, so every fresh cache got a different vocabulary and runs differed between clones from the first
    step. BPE over a sorted alphabet gives the same vocabulary, ids included, every time (tested)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)  # clean text, split CJK, strip accents, lowercase
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.BertPreTokenizer(), pre_tokenizers.Metaspace()])
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )
    return tok


def tokenizer_cache_key(texts: list[str], vocab_size: int, text_column: str) -> str:
    """Hash of everything the trained tokenizer depends on: the recipe, vocab size, column and the text itself
    (so a different dataset, a different max_train_samples or an edited file never reuses a stale tokenizer)."""
    h = hashlib.sha256(f"{TOKENIZER_RECIPE}|{vocab_size}|{text_column}|{len(texts)}".encode())
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\x00")
    return h.hexdigest()[:20]


def _as_texts(train_texts, text_column: str) -> list[str]:
    """A list of strings from a list, a datasets Column (`ds[col]`), or a Dataset (its text column), fast."""
    if isinstance(train_texts, list):
        return train_texts
    if hasattr(train_texts, "column_names"):
        return _column(train_texts, text_column)
    if hasattr(train_texts, "source"):  # datasets.Column: slicing reads it in one go, iterating row by row is slow
        return train_texts[:]
    return list(train_texts)


def get_tokenizer(cfg: dict, train_texts):
    """data.tokenizer null: a BPE tokenizer trained on `train_texts` (a list of strings, `ds[text_column]`,
    or the training Dataset itself) with model.vocab_size tokens, or fewer when the text has fewer distinct
    pieces (so give the model vocab_size=len(tokenizer)); cached on disk.
    Otherwise AutoTokenizer.from_pretrained(data.tokenizer). model_max_length = data.max_length."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    d = cfg["data"]
    if d.get("tokenizer"):
        try:
            tokenizer = AutoTokenizer.from_pretrained(d["tokenizer"])
        except Exception as e:
            raise DataError(f"tokenizer {d['tokenizer']!r} could not be loaded ({type(e).__name__}); give a local "
                            f"tokenizer folder or Hub id, or set data.tokenizer=null to train a BPE "
                            f"tokenizer") from None
        if tokenizer.pad_token is None:  # e.g. GPT-2: padding needs some token; it is masked out anyway
            tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
        tokenizer.model_max_length = d["max_length"]
        return _forget_load_arguments(tokenizer)

    texts = _as_texts(train_texts, d["text_column"])
    vocab_size = cfg["model"]["vocab_size"]
    key = tokenizer_cache_key(texts, vocab_size, d["text_column"])

    def train():
        return PreTrainedTokenizerFast(
            tokenizer_object=_train_tokenizer(texts, vocab_size), unk_token="[UNK]", pad_token="[PAD]",
            cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", model_max_length=d["max_length"],
        )

    # written atomically (a kill mid-save, or a second process doing the same, never leaves half a tokenizer),
    # checked when read, rebuilt when damaged; every process loads the same files
    tokenizer = cached_folder(cache_dir() / "tokenizers" / key, make=train,
                              save=lambda tok, folder: tok.save_pretrained(str(folder)),
                              load=lambda folder: PreTrainedTokenizerFast.from_pretrained(str(folder)),
                              what="the cached tokenizer")
    tokenizer.model_max_length = d["max_length"]
    return _forget_load_arguments(tokenizer)


def _forget_load_arguments(tokenizer):
    """transformers 5 keeps from_pretrained's `local_files_only` and `is_local` among the tokenizer's init
    arguments, so save_pretrained writes them into tokenizer_config.json and whoever loads the saved tokenizer
    (from another machine, or the Hub) inherits this load's offline settings. Drop them."""
    for key in ("local_files_only", "is_local"):
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


# ----------------------------------------------------------------------------------------------------------
# tokenizing


def _tokenizer_id(tokenizer) -> str:
    return hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]


def tokenize_splits(dsd, tokenizer, cfg: dict):
    """Tokenized splits: input_ids, attention_mask, token_type_ids (if the tokenizer makes them), `length`
    (tokens, for length grouping), and `labels` (classification) or `special_tokens_mask` (mlm). Truncated to
    data.max_length. Cached by datasets under a fingerprint of (data, tokenizer, max_length, task); a damaged
    cache file is rebuilt (common.cache.cached_map)."""
    d, task = cfg["data"], cfg["task"]
    max_length, text_col, label_col = d["max_length"], d["text_column"], d["label_column"]
    tok_id = _tokenizer_id(tokenizer)

    def encode(batch):
        enc = tokenizer(batch[text_col], truncation=True, max_length=max_length,
                        return_special_tokens_mask=task == "mlm")
        enc["length"] = [len(ids) for ids in enc["input_ids"]]
        if task == "classification":
            enc["labels"] = batch[label_col]
        return enc

    out = {}
    for split, ds in dsd.items():
        fingerprint = hashlib.sha256(
            f"{ds._fingerprint}|{tok_id}|{max_length}|{task}|{text_col}|{label_col}".encode()).hexdigest()[:16]
        out[split] = cached_map(ds, encode, fingerprint, f"the cached tokenized split {split!r}", batched=True,
                                remove_columns=ds.column_names, desc=f"tokenizing {split}")
    import datasets

    return datasets.DatasetDict(out)


def load_tokenized(cfg: dict):
    """(raw DatasetDict, tokenizer, tokenized splits) of a run config: resolve, tokenizer, tokenize."""
    d = cfg["data"]
    dsd = resolve_dataset(cfg)
    tokenizer = get_tokenizer(cfg, dsd[d["train_split"]][d["text_column"]])
    return dsd, tokenizer, tokenize_splits(dsd, tokenizer, cfg)


def encode_rows(tokenizer, texts, max_length: int, labels=None) -> list[dict]:
    """One row per text: its input_ids (truncated to max_length), its `index` in `texts` (scores computed in
    another order go back to this one by it) and, given `labels`, its label. No token_type_ids: one sentence per
    row is type 0 throughout, which the model assumes when they are absent."""
    ids = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    rows = [{"input_ids": row, "index": i} for i, row in enumerate(ids)]
    for row, label in zip(rows, labels if labels is not None else []):
        row["labels"] = int(label)
    return rows


# ----------------------------------------------------------------------------------------------------------
# batching


class _EpochPermutation(Sampler):
    """A seeded permutation of range(n) that changes with `set_epoch`. It is the `.sampler` of the batch samplers
    below, which is where accelerate's DataLoaderShard.set_epoch looks once it has wrapped them for sharding."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int):
        self.epoch = epoch

    def rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.epoch])  # independent streams per (seed, epoch)

    def __iter__(self):
        return iter(self.rng().permutation(self.n).tolist())

    def __len__(self):
        return self.n


class RandomBatchSampler(Sampler):
    """Shuffled batches of indices, deterministic for (seed, epoch). Every index appears once per epoch. A
    partial batch (when batch_size does not divide n and drop_last is False) always comes last: accelerate's
    sharding (BatchSamplerShard) expects every batch but the last to be full."""

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0, drop_last: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.num_samples, self.batch_size, self.drop_last = num_samples, batch_size, drop_last
        self.sampler = _EpochPermutation(num_samples, seed)

    @property
    def seed(self) -> int:
        return self.sampler.seed

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int):
        self.sampler.set_epoch(epoch)

    def _batches(self, perm: np.ndarray, rng: np.random.Generator) -> list[list[int]]:
        bs = self.batch_size
        return [perm[i : i + bs].tolist() for i in range(0, len(perm), bs)]

    def __iter__(self):
        rng = self.sampler.rng()
        perm = rng.permutation(self.num_samples)
        batches = self._batches(perm, rng)
        full = [b for b in batches if len(b) == self.batch_size]
        partial = [] if self.drop_last else [b for b in batches if len(b) < self.batch_size]
        order = rng.permutation(len(full))
        yield from (full[i] for i in order)
        yield from partial

    def __len__(self):
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)


class LengthGroupedBatchSampler(RandomBatchSampler):
    """Shuffled batches of similar lengths: a random permutation is cut into mega-batches of
    `mega_batch_mult * batch_size` indices, each sorted by length and cut into batches, and the batches are
    shuffled. Padding then almost vanishes (docs/architecture.md measures it on SST-2), while the
    batch order, and which examples share a batch, stay random. Deterministic for (seed, epoch)."""

    def __init__(self, lengths, batch_size: int, seed: int = 0, drop_last: bool = False,
                 mega_batch_mult: int = MEGA_BATCH_MULT):
        self.lengths = np.asarray(lengths)
        self.mega_batch_mult = mega_batch_mult
        super().__init__(len(self.lengths), batch_size, seed, drop_last)

    def _batches(self, perm, rng):
        mega, bs = self.mega_batch_mult * self.batch_size, self.batch_size
        batches = []
        for start in range(0, len(perm), mega):
            chunk = perm[start : start + mega]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]  # longest first: a full batch leads
            batches += [chunk[i : i + bs].tolist() for i in range(0, len(chunk), bs)]
        return batches


def pad_fraction(attention_mask) -> float:
    """Share of padded positions in a batch (0 = no padding)."""
    mask = torch.as_tensor(attention_mask)
    return 1.0 - float(mask.sum()) / max(mask.numel(), 1)


ROW_ORDERS = ("given", "sorted", "shuffled")


def pad_rows(rows, pad_id: int, width: int | None = None, multiple_of: int | None = None) -> dict:
    """Collate rows into right-padded (B, width) tensors: input_ids (pad_id at pads), attention_mask (1 = real
    token) and token_type_ids (0 at pads) when the rows have them; `labels` and `index` as (B,) when present; any
    other key is dropped. width: default the longest row, rounded up to a multiple of `multiple_of` if given."""
    longest = max(len(row["input_ids"]) for row in rows)
    if width is None:
        width = -(-longest // multiple_of) * multiple_of if multiple_of else longest
    if width < longest:
        raise ValueError(f"cannot pad to width {width}: a row has {longest} tokens")
    batch = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long)}
    if "token_type_ids" in rows[0]:
        batch["token_type_ids"] = torch.zeros(len(rows), width, dtype=torch.long)
    batch["attention_mask"] = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        batch["input_ids"][i, :n] = torch.tensor(row["input_ids"])
        batch["attention_mask"][i, :n] = 1
        if "token_type_ids" in batch:
            batch["token_type_ids"][i, :n] = torch.tensor(row["token_type_ids"])
    for key in ("labels", "index"):
        if key in rows[0]:
            batch[key] = torch.tensor([row[key] for row in rows])
    return batch


def row_order(lengths, order: str, seed: int = 0) -> list[int]:
    """Row indices in the order batches take them: `given`; `sorted` by length (stable: equal lengths keep their
    order), which leaves little padding; `shuffled`, one permutation fixed by `seed`."""
    if order not in ROW_ORDERS:
        raise ValueError(f"order={order!r} is not valid; choose one of: {', '.join(ROW_ORDERS)}")
    if order == "sorted":
        return np.argsort(lengths, kind="stable").tolist()
    if order == "shuffled":
        return np.random.default_rng(seed).permutation(len(lengths)).tolist()
    return list(range(len(lengths)))


def row_batches(rows, batch_size: int, pad_id: int, order: str = "given", width: int | None = None,
                multiple_of: int | None = None, seed: int = 0, collate=None) -> DataLoader:
    """A DataLoader of padded batches of `rows` (dicts with input_ids, as encode_rows makes them, or a tokenized
    Dataset) taken in `order` (row_order) `batch_size` at a time and collated by pad_rows (to `width`, else each
    batch's longest row); `collate` replaces pad_rows (the MLM collator, which also masks). Ready for
    accelerator.prepare, which shards the batches over processes."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    is_dataset = hasattr(rows, "column_names")
    lengths = [len(ids) for ids in (_column(rows, "input_ids") if is_dataset else (r["input_ids"] for r in rows))]
    idx = row_order(lengths, order, seed)
    ordered = rows.select(idx) if is_dataset else [rows[i] for i in idx]
    collate = collate or functools.partial(pad_rows, pad_id=pad_id, width=width, multiple_of=multiple_of)
    return DataLoader(ordered, batch_size=batch_size, shuffle=False, collate_fn=collate)


def _collator(cfg: dict, tokenizer, pad_to_multiple_of):
    """pad_rows for classification; for mlm HF's collator, which pads the same way and masks 15% of the tokens."""
    from transformers import DataCollatorForLanguageModeling

    if cfg["task"] == "mlm":
        if tokenizer.mask_token is None:
            raise DataError(f"task=mlm needs a tokenizer with a mask token; {tokenizer.name_or_path!r} has none "
                            f"(set data.tokenizer=null to train one)")
        return DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=MLM_PROBABILITY,
                                               pad_to_multiple_of=pad_to_multiple_of)
    return functools.partial(pad_rows, pad_id=tokenizer.pad_token_id, multiple_of=pad_to_multiple_of)


def build_dataloaders(cfg: dict, tokenizer, tokenized, pad_to_multiple_of: int | None = None):
    """(train_loader, eval_loader), ready for accelerator.prepare.

    Train: batches of train.batch_size from LengthGroupedBatchSampler (data.group_by_length) or
    RandomBatchSampler, seeded by cfg.seed. Each epoch reshuffles once told its number: accelerate's prepared
    loader does it (`loader.set_epoch(e)`, also called by its own iteration count); an unprepared loader needs
    `train_loader.batch_sampler.set_epoch(e)`. Eval: row_batches, sorted by length (fast, and deterministic).
    Padding is dynamic per batch (to a multiple of pad_to_multiple_of under mixed precision, e.g. 8)."""
    d = cfg["data"]
    bs, seed = cfg["train"]["batch_size"], cfg["seed"]
    # `length` only serves the samplers; the model must not receive it
    train, evals = (tokenized[d[split]].remove_columns("length") for split in ("train_split", "eval_split"))
    lengths = _column(tokenized[d["train_split"]], "length")
    if d["group_by_length"]:
        batch_sampler = LengthGroupedBatchSampler(lengths, bs, seed=seed)
    else:
        batch_sampler = RandomBatchSampler(len(lengths), bs, seed=seed)
    collate = _collator(cfg, tokenizer, pad_to_multiple_of)
    train_loader = DataLoader(train, batch_sampler=batch_sampler, collate_fn=collate)
    eval_loader = row_batches(evals, bs, tokenizer.pad_token_id, order="sorted", collate=collate)
    return train_loader, eval_loader


__all__ = [
    "DataError", "read_data_file", "resolve_dataset", "label_names", "mirror_candidates", "get_tokenizer", "tokenize_splits",
    "tokenizer_cache_key", "load_tokenized", "encode_rows", "RandomBatchSampler", "LengthGroupedBatchSampler",
    "build_dataloaders", "pad_fraction", "ROW_ORDERS", "pad_rows", "row_order", "row_batches", "cache_dir",
    "MLM_PROBABILITY",
]
