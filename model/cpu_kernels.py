"""NormLab's C++ CPU kernels (model/cpu_kernels.cpp): CustomLayerNorm's "cpp" path and the dropout of
`modeling_normlab.Dropout`, each with its autograd node in C++.

Why C++: at this project's training shapes (~1000 tokens x 128 features per batch) an op is so small that the
Python around a kernel costs as much as the kernel, and CPU dropout spends most of its time in torch's
sequential Mersenne-Twister Bernoulli draws (~1.3 ms per hidden-state dropout, ~14% of a training step).

torch.utils.cpp_extension builds the file once per machine (about a minute on 2 cores; cached under
TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions) and reloads it in well under a second afterwards.
-march=native tunes the loops to this CPU, so the extension's name carries a digest of the CPU's model and flags:
a cache shared by different machines never hands one of them the other's build. -ffp-contract=off keeps each
multiply and add separately rounded, as in the reference ops (fused multiply-adds made the exactly-zero gradient
of a one-element LayerNorm row come out as rounding noise).

A failed build (no compiler, no ninja, or a checkpoint's copied code without the .cpp next to it) warns once;
callers then take their pure-PyTorch paths. `cpu_kernels()` returns None in that case.
"""

import hashlib
import os
import platform
import warnings

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cpp")
_STATE = {"module": None, "broken": None}


def _cpu_digest() -> str:
    ident = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            ident += "".join(line for line in f if line.startswith(("model name", "flags")))[:4096]
    except OSError:
        pass
    return hashlib.sha1(ident.encode()).hexdigest()[:10]


def cpu_kernels():
    """The built extension module (building it on first use), or None where it cannot be built."""
    if _STATE["module"] is None and _STATE["broken"] is None:
        try:
            if not os.path.exists(_SOURCE):
                raise FileNotFoundError(f"{_SOURCE} is missing")
            from torch.utils.cpp_extension import load

            _STATE["module"] = load(name=f"normlab_cpu_kernels_{_cpu_digest()}", sources=[_SOURCE],
                                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"])
        except Exception as err:  # noqa: BLE001 - no compiler/ninja etc.: the PyTorch paths still work
            _STATE["broken"] = repr(err)
            warnings.warn(f"NormLab: the C++ CPU kernels are unavailable ({err!r}); using the PyTorch paths")
    return _STATE["module"]
