"""Caches NormLab can always rebuild (the trained tokenizer, the tokenized splits, the C++ kernel builds): written
atomically, checked when read, and a damaged entry rebuilt with one warning naming it (docs/architecture.md,
"Caches")."""

import hashlib
import os
import shutil
import sys
import tempfile
from contextlib import suppress
from pathlib import Path

from normlab.files.formats import atomic_write_json, read_json

MANIFEST = "normlab-manifest.json"


def warn_rebuilding(what: str, path, problem: str) -> None:
    print(f"warning: {what} {path} is damaged ({problem}); rebuilding it", file=sys.stderr, flush=True)


def short(exc: BaseException, limit: int = 200) -> str:
    """An exception in one line: its type and the start of its message."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


def file_digest(path) -> list:
    """[size, sha256] of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return [os.path.getsize(path), h.hexdigest()]


def folder_index(folder, skip: str, describe=file_digest) -> dict:
    """{path relative to `folder`: describe(file)} for every file under `folder` except those named `skip`."""
    return {str(p.relative_to(folder)): describe(p) for p in sorted(Path(folder).rglob("*"))
            if p.is_file() and p.name != skip}


def folder_problem(folder) -> str | None:
    """What is wrong with a folder entry (None: nothing). An older entry without a manifest (renamed into place
    whole all the same) has nothing to compare: loading it is its check."""
    folder = Path(folder)
    if not (folder / MANIFEST).exists():
        return None
    manifest = read_json(folder / MANIFEST)
    if not isinstance(manifest, dict):
        return f"{MANIFEST} is unreadable"
    for name, recorded in manifest.items():
        f = folder / name
        if not f.is_file():
            return f"{name} is missing"
        if file_digest(f) != recorded:
            return f"{name} has changed ({f.stat().st_size} bytes, {recorded[0]} written)"
    return None


def write_folder(final: Path, save) -> None:
    """save(tmp) fills a temporary folder next to `final`, which becomes `final` with its manifest; an entry
    another process renamed there first (built from the same inputs) is kept. A refused write raises its OSError,
    leaving nothing behind."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        save(tmp)
        atomic_write_json(tmp / MANIFEST, folder_index(tmp, MANIFEST))
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def discard(folder: Path) -> None:
    """Remove an entry: renamed aside first, so no reader ever sees it half-deleted."""
    aside = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-damaged-"))
    with suppress(OSError):  # another process removed it already
        os.replace(folder, aside / folder.name)
    shutil.rmtree(aside, ignore_errors=True)


def cached_folder(final, make, save, load, what: str):
    """load(final), after checking it; if it is missing or damaged (one warning), the object make() builds, saved
    there with save(obj, folder), or used uncached (one warning) when the filesystem refuses it."""
    final = Path(final)
    if final.exists():
        problem = folder_problem(final)
        if problem is None:
            try:
                obj = load(final)
            except Exception as e:  # noqa: BLE001 - whatever the files hold, the entry can be rebuilt
                problem = short(e)
            else:
                if not (final / MANIFEST).exists():  # an older entry that loads: checked from now on
                    with suppress(OSError):
                        atomic_write_json(final / MANIFEST, folder_index(final, MANIFEST))
                return obj
        warn_rebuilding(what, final, problem)
        discard(final)
    obj = make()
    try:
        write_folder(final, lambda folder: save(obj, folder))
    except OSError as e:
        print(f"warning: could not cache {what} in {final} ({e.strerror or e}); going on without the cache",
              file=sys.stderr, flush=True)
        return obj
    return load(final)


def cached_map(ds, function, fingerprint: str, what: str, **map_kwargs):
    """ds.map(function, new_fingerprint=fingerprint), whose cache file (written atomically by datasets) is rebuilt
    with one warning when it does not load or holds other than ds's rows."""
    # where ds.map keeps its result for `fingerprint` (datasets' naming of map caches); None: an in-memory dataset
    path = Path(ds._get_cache_file_path(fingerprint)) if ds.cache_files else None
    try:
        mapped = ds.map(function, new_fingerprint=fingerprint, **map_kwargs)
    except Exception as e:  # noqa: BLE001 - only when a cache file was there to read: then it is the cause
        if path is None or not path.exists():
            raise
        problem = short(e)
    else:
        if mapped.num_rows == ds.num_rows:
            return mapped
        problem = f"{mapped.num_rows} rows instead of {ds.num_rows}"
    warn_rebuilding(what, path, problem)
    return ds.map(function, new_fingerprint=fingerprint, load_from_cache_file=False, **map_kwargs)
