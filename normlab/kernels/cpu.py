"""Builds and loads the C++ CPU backend (layer_norm_cpu.cpp, dropout_cpu.cpp, attention_cpu.cpp: the CPU
implementations of normlab::layer_norm(_backward), normlab::dropout and normlab::attention(_backward)), cached per
machine and checkout; why C++, the build's flags and cache: docs/kernels.md. `register()` raises when the extension
cannot be built (no compiler, no ninja); normlab.kernels.enable decides what that means.
"""

import hashlib
import os
import platform

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(_HERE, name) for name in ("cpu_module.cpp", "layer_norm_cpu.cpp", "dropout_cpu.cpp",
                                                     "attention_cpu.cpp")]
# -ffp-contract=off: every multiply and add rounded on its own, as in the reference ops
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]


def _cpu_digest() -> str:
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            ident += "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha1(ident.encode()).hexdigest()[:10]


def extension_name() -> str:
    """The extension's cache name: this CPU (-march=native) and this checkout (docs/kernels.md)."""
    return f"normlab_cpu_{_cpu_digest()}_{hashlib.sha1(_HERE.encode()).hexdigest()[:8]}"


_extension = None  # the loaded module, once built


def load():
    """The built extension module (building it if this machine has no cached build); the build leaves torch's RNG
    state and thread count as it found them."""
    global _extension
    if _extension is None:
        from torch.utils.cpp_extension import load as build_and_load

        from .build_cache import load_checked
        from .build_progress import BuildProgress, build_dir, is_cached

        name, threads = extension_name(), torch.get_num_threads()
        try:
            progress = BuildProgress(announce_now=not is_cached(name), lock=os.path.join(build_dir(name), "lock"))
            with torch.random.fork_rng(devices=[]), progress:
                # (fork_rng: no CUDA state is touched by a CPU build); a damaged cached build is rebuilt
                _extension = load_checked(build_and_load, name=name, sources=SOURCES, extra_cflags=FLAGS)
        finally:
            torch.set_num_threads(threads)
    return _extension


def register():
    """The C++ kernels become the CPU implementation of NormLab's five operators."""
    import model.layer_norm_op  # noqa: F401 - kernels can only be registered on operators that exist
    import normlab.kernels.attention  # noqa: F401 - (it defines normlab::dropout too)

    extension = load()
    extension.register_layer_norm()
    extension.register_dropout()
    extension.register_attention()


def unregister():
    """Back to the operators' reference implementation on CPU."""
    if _extension is not None:
        _extension.unregister_attention()
        _extension.unregister_dropout()
        _extension.unregister_layer_norm()
