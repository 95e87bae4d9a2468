"""STUDY/selection.json, the one format and its one reader: {selection key: choice}, each choice with its LR (and,
from two swept LRs, `runner_up`, `near_tie`, `gap`, `seed_sd`) and `by_lr`, one row per swept LR sorted by LR:
{"lr": float, "dev_loss": mean, "dev_loss_by_seed": [...], "runs": [run names]}. Files written before `by_lr`
(docs/study-v3's and docs/study-v4's committed ones) keyed those tables by the LR as text ({"0.001": ...}); the
reader turns them into rows in memory and never rewrites them, so the committed reports regenerate unchanged.
"""

from pathlib import Path

from normlab.files.formats import read_json

TEXT_KEYED = ("dev_loss", "dev_loss_by_seed", "runs")  # the per-LR tables of the older files, in row order


def lr_rows(tables: dict) -> list[dict]:
    """{field: {lr: value}} -> [{"lr": lr, field: value, ...}] sorted by LR, the LR as a float whether the tables
    key it by a number or by its text; a field an LR has no value for is left out of its row."""
    tables = {field: {float(lr): v for lr, v in table.items()} for field, table in tables.items()}
    lrs = sorted({lr for table in tables.values() for lr in table})
    return [{"lr": lr, **{f: table[lr] for f, table in tables.items() if lr in table}} for lr in lrs]


def upgrade(choice: dict) -> dict:
    """One choice in the present format: an older file's text-keyed tables become `by_lr` rows; a choice that has
    `by_lr` already, or no per-LR tables at all (only its LRs), comes back as it is."""
    tables = {field: choice[field] for field in TEXT_KEYED if field in choice}
    if not tables:
        return dict(choice)
    return {**{k: v for k, v in choice.items() if k not in TEXT_KEYED}, "by_lr": lr_rows(tables)}


def read_selection(path: Path) -> dict:
    """A study's selection.json in the present format ({} when the file is missing or unreadable)."""
    return {key: upgrade(choice) for key, choice in (read_json(path, {}) or {}).items()}
