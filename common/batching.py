"""Rows to padded batches: training's samplers (random or length-grouped), one padding function (pad_rows) and one
path from rows to padded batches (row_batches) that every evaluation uses: training's, scripts/evaluate.py's, the
study's and the benchmark's."""

import functools

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from .data import DataError, column

MLM_PROBABILITY = 0.15

# Mega-batches of MEGA_BATCH_MULT batches are sorted by length. The pad fraction falls like 1/MEGA_BATCH_MULT
# (measured in docs/architecture.md); 100 still leaves ~20 mega-batches per SST-2 epoch to shuffle.
MEGA_BATCH_MULT = 100


def encode_rows(tokenizer, texts, max_length: int, labels=None) -> list[dict]:
    """One row per text: its input_ids (truncated to max_length), its `index` in `texts` (scores computed in
    another order go back to this one by it) and, given `labels`, its label. No token_type_ids: one sentence per
    row is type 0 throughout, which the model assumes when they are absent."""
    ids = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    rows = [{"input_ids": row, "index": i} for i, row in enumerate(ids)]
    for row, label in zip(rows, labels if labels is not None else []):
        row["labels"] = int(label)
    return rows


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
    lengths = [len(ids) for ids in (column(rows, "input_ids") if is_dataset else (r["input_ids"] for r in rows))]
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
    lengths = column(tokenized[d["train_split"]], "length")
    if d["group_by_length"]:
        batch_sampler = LengthGroupedBatchSampler(lengths, bs, seed=seed)
    else:
        batch_sampler = RandomBatchSampler(len(lengths), bs, seed=seed)
    collate = _collator(cfg, tokenizer, pad_to_multiple_of)
    train_loader = DataLoader(train, batch_sampler=batch_sampler, collate_fn=collate)
    eval_loader = row_batches(evals, bs, tokenizer.pad_token_id, order="sorted", collate=collate)
    return train_loader, eval_loader



__all__ = [
    "encode_rows", "RandomBatchSampler", "LengthGroupedBatchSampler", "build_dataloaders", "pad_fraction",
    "ROW_ORDERS", "pad_rows", "row_order", "row_batches", "MLM_PROBABILITY", "MEGA_BATCH_MULT",
]
