"""Writes the filesystem refuses (a full disk, no permission, a read-only filesystem) as one WriteError naming
what could not be written where, why, and what to do (docs/architecture.md, "Checkpoints and refused writes")."""

import errno
import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path

from normlab.errors import ConfigError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
NO_PERMISSION = (errno.EACCES, errno.EPERM, errno.EROFS)
# torch's zip writer reports a short write as "unexpected pos N vs M", without the errno: a probe of this size
# next to the failed file finds out whether the disk is the cause.
PROBE_BYTES = 8 << 20
_RUST_OS_ERROR = re.compile(r"Os \{ code: (\d+)")  # how safetensors (Rust) words an OSError


class WriteError(Exception):
    """A write the filesystem refused. `kept`: the last complete checkpoint, when the caller knows it."""

    def __init__(self, what: str, path, os_error: OSError, then: str = "continue the run with train.resume=auto",
                 action: str | None = None):
        super().__init__(what, str(path), os_error)
        self.what, self.path, self.os_error, self.then = what, Path(path), os_error, then
        self.action = action or f"write {what} to {path}"
        self.kept = None

    @property
    def reason(self) -> str:
        name = errno.errorcode.get(self.os_error.errno, "")
        text = self.os_error.strerror or str(self.os_error)
        return f"{text} ({name})" if name else text

    def advice(self) -> str:
        folder = nearest_existing(self.path)
        folder = folder if folder.is_dir() else folder.parent
        if self.os_error.errno in NO_SPACE:
            return f"free space on the filesystem of {folder}"
        if self.os_error.errno in NO_PERMISSION:
            return f"make {folder} writable"
        return "fix that"

    def __str__(self) -> str:
        kept = f"the last complete checkpoint, {self.kept}, is intact; " if self.kept else ""
        return f"could not {self.action}: {self.reason}; {kept}{self.advice()}, then {self.then}"


def nearest_existing(path) -> Path:
    """`path`, or its nearest ancestor that exists (a broken link counts as existing)."""
    path = Path(path)
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind `exc`: itself, its cause or context, or one quoted in safetensors' message."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        found = _RUST_OS_ERROR.search(str(exc))
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
        exc = exc.__cause__ or exc.__context__
    return None


def probe(path, size: int = PROBE_BYTES) -> OSError | None:
    """Why a write next to `path` fails now (None: it does not). Writes and syncs `size` bytes to an unnamed
    temporary file, which vanishes when closed."""
    try:
        with tempfile.TemporaryFile(dir=nearest_existing(path)) as f:
            chunk = b"\0" * min(size, 1 << 20)
            for _ in range(size // len(chunk)):
                os.write(f.fileno(), chunk)
            os.fsync(f.fileno())
    except OSError as e:
        return e
    return None


@contextmanager
def guarded_write(what: str, path, cleanup=lambda: None):
    """Writes inside the block that the filesystem refuses raise WriteError(what, path) (after `cleanup()`, which
    removes the half-written files); any other error passes through unchanged (after `cleanup()` too)."""
    try:
        yield
    except WriteError:
        cleanup()
        raise
    except Exception as e:
        cause = _os_error_in(e) or probe(path)  # before cleanup: removing the partial files frees space
        cleanup()
        if cause is None:
            raise
        raise WriteError(what, path, cause) from e


def check_writable_dir(path, key: str = "output_dir") -> None:
    """Before anything is loaded: `path` is a folder this process can write in, or can create. ConfigError when a
    part of it is not a folder; WriteError when the filesystem refuses (permission, read-only, full)."""
    path = Path(path)
    existing = nearest_existing(path)
    if not existing.is_dir():
        raise ConfigError(f"{key}={path} cannot be created: {existing} is not a folder (a file, or a broken link); "
                          f"pick another {key}")
    refused = probe(existing, size=1)  # one byte, synced: a full disk refuses it too
    if refused is not None:
        action = f"write in {key}={path}" if existing == path else f"create {key}={path} in {existing}"
        raise WriteError(key, existing, refused, then=f"run again, or pick another {key}", action=action)

