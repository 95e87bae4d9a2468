"""What a user sees while the C++ kernels build (minutes on a small machine, silent otherwise): one line before,
the elapsed time every so often, one line at the end. A cached build loads silently. Only the first process of a
machine speaks (LOCAL_RANK 0 or unset)."""

import os
import sys
import threading
import time

# The measured range (docs/kernels.md, with how each was measured)
INTRO = ("normlab.kernels: building NormLab's C++ CPU kernels (LayerNorm, dropout, attention) once for this "
         "machine: they make CPU training faster than the reference PyTorch code. Measured on 2 cores: 30 s with "
         "the cores idle, 60 s beside another build, more under heavier load (needs g++ and ninja); later runs load "
         "the cached build. To skip it: train.kernels=reference")
_seconds_building = 0.0  # this process's builds so far (BuildProgress adds each)


def seconds_building() -> float:
    """Seconds this process has spent building the C++ kernels (or waiting for another process's build) so far; a
    cached build's load adds nothing. A run takes the difference around its setup to tell build from training."""
    return _seconds_building


def build_dir(name: str) -> str:
    """Where torch.utils.cpp_extension keeps the build of `name` (its own helper for this creates the folder)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        import torch
        from torch.utils.cpp_extension import get_default_build_root

        if torch.version.hip is not None:
            accelerator = f"rocm{torch.version.hip.replace('.', '')}"
        elif torch.version.cuda is not None:
            accelerator = f"cu{torch.version.cuda.replace('.', '')}"
        else:
            accelerator = "cpu"
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accelerator}")
    return os.path.join(root, name)


def is_cached(name: str) -> bool:
    """Whether torch.utils.cpp_extension already has a built `name` (then loading takes about a second)."""
    return os.path.exists(os.path.join(build_dir(name), f"{name}.so"))


def _speaks() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


class BuildProgress:
    """Context manager around a build. `announce_now`: say so at once (no cached build); otherwise only if loading
    takes longer than `grace` seconds (a source changed: torch rebuilds). Elapsed time every `every` seconds."""

    def __init__(self, announce_now: bool, stream=None, grace: float = 5.0, every: float = 20.0, lock=None):
        self.announce_now, self.grace, self.every = announce_now, grace, every
        # torch's build lock, already there before this load: another process builds (this one waits its turn),
        # or one that was killed while building left it behind (build_cache.loading removes it)
        self.waits_on = lock if lock is not None and os.path.exists(lock) else None
        self.stream = stream or sys.stderr
        self.announced = False
        self._done = threading.Event()
        self._thread = None
        self._start = 0.0

    def _say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _elapsed(self) -> float:
        return time.monotonic() - self._start

    def _announce(self) -> None:
        self.announced = True
        self._say(INTRO)

    def _tick(self) -> None:
        if not self.announce_now:
            if self._done.wait(self.grace):
                return
            self._announce()
        while not self._done.wait(self.every):
            if self.waits_on and os.path.exists(self.waits_on):
                self._say(f"normlab.kernels: waiting {self._elapsed():.0f} s for another process's build (its lock "
                          f"file {self.waits_on})")
            else:
                self._say(f"normlab.kernels: still building ({self._elapsed():.0f} s)")

    def __enter__(self):
        self._start = time.monotonic()
        if not _speaks():
            return self
        if self.announce_now:
            self._announce()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        global _seconds_building
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        if self.announce_now or self._elapsed() > self.grace:  # a build (or a wait for one), whoever speaks
            _seconds_building += self._elapsed()
        if self.announced:
            if exc_type is None:
                self._say(f"normlab.kernels: C++ kernels built in {self._elapsed():.0f} s (cached for later runs)")
            else:
                self._say(f"normlab.kernels: the build failed after {self._elapsed():.0f} s; falling back to the "
                          f"reference PyTorch code (the warning below says why)")
        return False
