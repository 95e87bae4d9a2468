"""The C++ backend's build cache (torch.utils.cpp_extension's folder TORCH_EXTENSIONS_DIR/<name>/), checked when
read: a library that a killed link left truncated, or that changed since it last loaded, or that does not load, is
rebuilt with one warning (docs/kernels.md). A build that fails with no library cached (no compiler) raises.
torch's build lock left behind by a killed build (on which every later load would wait for good) is removed with
one warning.
"""

import contextlib
import hashlib
import shutil
import sys
from pathlib import Path

from normlab.files.cache import MANIFEST, file_digest, short, warn_rebuilding
from normlab.files.formats import atomic_write_json, read_json

from .build_progress import build_dir


def _inputs_digest(sources, flags) -> str:
    h = hashlib.sha256("\0".join(flags).encode())
    for source in sources:
        h.update(Path(source).read_bytes())
    return h.hexdigest()


def _record(folder: Path, library: Path, inputs: str) -> None:
    with contextlib.suppress(OSError):  # an unrecorded build is only checked by loading it
        atomic_write_json(folder / MANIFEST, {"inputs": inputs, "library": file_digest(library)})


def _truncated_elf(library: Path) -> str | None:
    """A truncated ELF library (its section headers, which linkers write last, past the end of the file): what
    a killed link leaves, and what dlopen would answer with a crash (SIGBUS), not an error. None: whole, or not
    ELF (then loading it is the check)."""
    size = library.stat().st_size
    with open(library, "rb") as f:
        head = f.read(64)
    if head[:4] != b"\x7fELF" or len(head) < 64:
        return f"{library.name} is cut short ({size} bytes)" if head[:4] == b"\x7fELF" else None
    order = "little" if head[5] == 1 else "big"
    wide = head[4] == 2  # 64-bit
    shoff = int.from_bytes(head[0x28:0x30] if wide else head[0x20:0x24], order)
    entsize = int.from_bytes(head[0x3A:0x3C] if wide else head[0x2E:0x30], order)
    count = int.from_bytes(head[0x3C:0x3E] if wide else head[0x30:0x32], order)
    end = shoff + entsize * count
    return f"{library.name} is cut short ({size} bytes, {end} linked)" if end > size else None


def _problem(folder: Path, library: Path, inputs: str) -> str | None:
    """What is wrong with the cached library (None: nothing, or nothing to check: no library, or one built from
    other sources, which ninja rebuilds anyway)."""
    if not library.is_file():
        return None
    record = read_json(folder / MANIFEST)
    if not isinstance(record, dict):  # not loaded yet (a killed build, an older NormLab): its structure
        return _truncated_elf(library)
    if record.get("inputs") == inputs and file_digest(library) != record.get("library"):
        return f"{library.name} has changed ({library.stat().st_size} bytes, {record['library'][0]} built)"
    return None


@contextlib.contextmanager
def loading(folder: Path):
    """Held around every load of the build in `folder`: an exclusive flock on `<folder>.loading`, so NormLab's
    loads of one build take turns (a cached build loads in about a second), and the kernel drops it when its
    process dies, however it dies. So torch's `lock` in the folder, found while holding it, was left by a killed
    build (every later load would wait on it for good): it is removed with one warning, and this load builds.
    Without fcntl (not POSIX) nothing is checked."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{folder}.loading", "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)  # waits for a live load or build; released when the file closes
        lock = folder / "lock"
        if lock.exists():
            lock.unlink(missing_ok=True)
            print(f"warning: {lock} was left by a kernel build that was killed (no process is building); removed "
                  f"it, building again", file=sys.stderr, flush=True)
        yield


def load_checked(build_and_load, name: str, sources, extra_cflags):
    """build_and_load(name=, sources=, extra_cflags=) (torch.utils.cpp_extension.load), on a checked cache, with
    a stale build lock removed first."""
    folder = Path(build_dir(name))
    library, inputs = folder / f"{name}.so", _inputs_digest(sources, extra_cflags)

    def load():
        module = build_and_load(name=name, sources=sources, extra_cflags=extra_cflags)
        _record(folder, library, inputs)
        return module

    with loading(folder):
        problem = _problem(folder, library, inputs)
        if problem is None:
            record = read_json(folder / MANIFEST)
            cached = library.is_file() and (not isinstance(record, dict) or record.get("inputs") == inputs)
            try:
                return load()
            except Exception as e:  # noqa: BLE001 - a library was cached for these sources: it is the cause
                if not cached:
                    raise
                problem = short(e)
        warn_rebuilding("the cached kernel build", folder, problem)
        library.unlink(missing_ok=True)  # relinked from the compiled objects: seconds, not minutes
        try:
            return load()
        except Exception:  # noqa: BLE001 - an object file is damaged too: build everything again
            shutil.rmtree(folder, ignore_errors=True)
            return load()


__all__ = ["build_dir", "load_checked", "loading"]
