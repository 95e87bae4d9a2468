"""Rows to padded batches: training's samplers (random or length-grouped), the padding (pad_rows) and the one path
from rows to padded batches that every evaluation uses (row_batches)."""

import functools

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from normlab.data.sources import DEV_SPLIT, DataError, column

MLM_PROBABILITY = 0.15

# Batches per length-sorted mega-batch: padding falls like 1/MEGA_BATCH_MULT (docs/architecture.md)
MEGA_BATCH_MULT = 100


def encode_rows(tokenizer, texts, max_length: int, labels=None) -> list[dict]:
    """One row per text: its input_ids (truncated to max_length), its `index` in `texts` and, given `labels`, its
    label. No token_type_ids: one sentence per row is type 0 throughout, the model's default."""
    ids = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    rows = [{"input_ids": row, "index": i} for i, row in enumerate(ids)]
    for row, label in zip(rows, labels if labels is not None else []):
        row["labels"] = int(label)
    return rows


class _EpochPermutation(Sampler):
    """A seeded permutation of range(n) that changes with `set_epoch`: the batch samplers' `.sampler`, where
    accelerate's DataLoaderShard.set_epoch looks."""

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
    """Shuffled batches of indices, each index once per epoch, deterministic for (seed, epoch). A partial batch
    comes last: accelerate's sharding expects every batch but the last to be full."""

    def __init__(self, num_samples: int, batch_size: int, seed: int = 0, drop_last: bool = False):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.num_samples, self.batch_size, self.drop_last = num_samples, batch_size, drop_last
        self.sampler = _EpochPermutation(num_samples, seed)

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int):
        self.sampler.set_epoch(epoch)

    def _batches(self, perm: np.ndarray) -> list[list[int]]:
        return [perm[i : i + self.batch_size].tolist() for i in range(0, len(perm), self.batch_size)]

    def __iter__(self):
        rng = self.sampler.rng()
        batches = self._batches(rng.permutation(self.num_samples))
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
    """Shuffled batches of similar lengths: a random permutation cut into mega-batches of `mega_batch_mult`
    batches, each sorted by length and cut into batches, which are shuffled (docs/architecture.md)."""

    def __init__(self, lengths, batch_size: int, seed: int = 0, drop_last: bool = False,
                 mega_batch_mult: int = MEGA_BATCH_MULT):
        self.lengths = np.asarray(lengths)
        self.mega_batch_mult = mega_batch_mult
        super().__init__(len(self.lengths), batch_size, seed, drop_last)

    def _batches(self, perm):
        mega = self.mega_batch_mult * self.batch_size
        batches = []
        for start in range(0, len(perm), mega):
            chunk = perm[start : start + mega]
            # sorted longest first: a full batch leads
            batches += super()._batches(chunk[np.argsort(-self.lengths[chunk], kind="stable")])
        return batches


def pad_fraction(attention_mask) -> float:
    """Share of padded positions in a batch (0 = no padding)."""
    mask = torch.as_tensor(attention_mask)
    return 1.0 - float(mask.sum()) / max(mask.numel(), 1)


ROW_ORDERS = ("given", "sorted", "shuffled")


def pad_rows(rows, pad_id: int, width: int | None = None, multiple_of: int | None = None) -> dict:
    """Rows as right-padded (B, width) tensors: input_ids, attention_mask and token_type_ids (when the rows have
    them); `labels` and `index` as (B,) when present; other keys dropped. width: default the longest row, rounded
    up to a multiple of `multiple_of` if given."""
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
    """Row indices in the order batches take them: `given`, `sorted` by length (stable), or `shuffled` by `seed`."""
    if order not in ROW_ORDERS:
        raise ValueError(f"order={order!r} is not valid; choose one of: {', '.join(ROW_ORDERS)}")
    if order == "sorted":
        return np.argsort(lengths, kind="stable").tolist()
    if order == "shuffled":
        return np.random.default_rng(seed).permutation(len(lengths)).tolist()
    return list(range(len(lengths)))


def row_batches(rows, batch_size: int, pad_id: int, order: str = "given", width: int | None = None,
                multiple_of: int | None = None, seed: int = 0, collate=None) -> DataLoader:
    """A DataLoader of `rows` (encode_rows' dicts, or a tokenized Dataset) in `order` (row_order), `batch_size` at
    a time, padded by pad_rows (to `width`, else each batch's longest row) or by `collate` (the MLM collator)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    is_dataset = hasattr(rows, "column_names")
    lengths = [len(ids) for ids in (column(rows, "input_ids") if is_dataset else (r["input_ids"] for r in rows))]
    idx = row_order(lengths, order, seed)
    ordered = rows.select(idx) if is_dataset else [rows[i] for i in idx]
    collate = collate or functools.partial(pad_rows, pad_id=pad_id, width=width, multiple_of=multiple_of)
    return DataLoader(ordered, batch_size=batch_size, shuffle=False, collate_fn=collate)


def _collator(task: str, tokenizer, pad_to_multiple_of):
    """pad_rows for classification; for mlm HF's collator, which pads the same way and masks 15% of the tokens."""
    from transformers import DataCollatorForLanguageModeling

    if task == "mlm":
        if tokenizer.mask_token is None:
            raise DataError(f"task=mlm needs a tokenizer with a mask token; {tokenizer.name_or_path!r} has none "
                            f"(set data.tokenizer=null to train one)")
        return DataCollatorForLanguageModeling(tokenizer, mlm=True, mlm_probability=MLM_PROBABILITY,
                                               pad_to_multiple_of=pad_to_multiple_of)
    return functools.partial(pad_rows, pad_id=tokenizer.pad_token_id, multiple_of=pad_to_multiple_of)


def build_dataloaders(cfg, tokenizer, tokenized, pad_to_multiple_of: int | None = None):
    """(train_loader, {"eval": eval_split's loader, "dev": the dev rows' (data.dev_rows)}), ready for
    accelerator.prepare; the keys are the evaluations' metric prefixes. Train: LengthGroupedBatchSampler
    (data.group_by_length) or RandomBatchSampler, seeded by cfg.seed, reshuffled by `set_epoch` (the prepared
    loader's, or an unprepared one's `batch_sampler.set_epoch`). Eval: row_batches sorted by length. Padded per
    batch (to a multiple of pad_to_multiple_of under mixed precision)."""
    d = cfg.data
    bs, seed = cfg.train.batch_size, cfg.seed
    # `length` only serves the samplers; the model must not receive it
    train = tokenized[d.train_split].remove_columns("length")
    splits = {"eval": d.eval_split, **({"dev": DEV_SPLIT} if d.dev_rows else {})}
    lengths = column(tokenized[d.train_split], "length")
    batch_sampler = (LengthGroupedBatchSampler(lengths, bs, seed=seed) if d.group_by_length
                     else RandomBatchSampler(len(lengths), bs, seed=seed))
    collate = _collator(cfg.task, tokenizer, pad_to_multiple_of)
    train_loader = DataLoader(train, batch_sampler=batch_sampler, collate_fn=collate)
    eval_loaders = {prefix: row_batches(tokenized[split].remove_columns("length"), bs, tokenizer.pad_token_id,
                                        order="sorted", collate=collate) for prefix, split in splits.items()}
    return train_loader, eval_loaders
