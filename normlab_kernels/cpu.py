"""Builds and loads the C++ CPU backend: the LayerNorm (layer_norm_cpu.cpp), the CPU implementation of
normlab::layer_norm and normlab::layer_norm_backward; the dropout (dropout_cpu.cpp), that of normlab::dropout; and
the attention (attention_cpu.cpp), that of normlab::attention and normlab::attention_backward.

Why C++: at this project's training shapes (~1000 tokens x 128 features per batch) a LayerNorm is so small that
the ~10 separate eager ops of the reference (and their temporaries) cost more than the arithmetic; one pass per
row in C++ measures at parity with torch.nn.LayerNorm's own kernel (docs/performance.md). The dropout's and the
attention's reasons are in normlab_kernels/dropout.py and attention.py.

torch.utils.cpp_extension builds the file once per machine (cached under TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions) and loads the cached build afterwards; build_cache.py checks a cached build before
loading it and rebuilds a damaged one; build_progress.py says on stderr that a build runs, and for how long so far.
-march=native tunes the loops to this CPU, so the extension's name carries a digest of the CPU's model and flags:
a cache shared by different machines never hands one of them the other's build. The name also carries a digest of
this checkout's folder: torch's build file names the sources by absolute path, so two checkouts sharing one name
would each rebuild the other's build on every switch. -ffp-contract=off keeps each
multiply and add separately rounded, as in the reference ops (fused multiply-adds made the exactly-zero gradient
of a one-element LayerNorm row come out as rounding noise).

`register()` builds (or loads) the extension and registers its kernels on the operators for the CPU dispatch key
from C++ (layer_norm_cpu.cpp says why from C++); `unregister()` takes them off again. `register()` raises when the
extension cannot be built (no compiler, no ninja); normlab_kernels.enable decides what that means. The build
leaves the process as it found it: torch's RNG state and thread count are restored, so a run that had to build
first trains exactly like one that found the build cached.
"""

import hashlib
import os
import platform

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
SOURCES = [os.path.join(_HERE, name) for name in ("cpu_module.cpp", "layer_norm_cpu.cpp", "dropout_cpu.cpp",
                                                     "attention_cpu.cpp")]
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
    """The extension's cache name: this CPU and this checkout (see the module's docstring)."""
    return f"normlab_cpu_{_cpu_digest()}_{hashlib.sha1(_HERE.encode()).hexdigest()[:8]}"


_extension = None  # the loaded module, once built


def load():
    """The built extension module (building it if this machine has no cached build)."""
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
    """The C++ kernels become the CPU implementation of normlab::layer_norm, normlab::layer_norm_backward,
    normlab::dropout, normlab::attention and normlab::attention_backward."""
    import model.layer_norm_op  # noqa: F401 - kernels can only be registered on operators that exist
    import normlab_kernels.attention  # noqa: F401 - (it defines normlab::dropout too)

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
