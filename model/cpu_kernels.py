"""NormLab's C++ CPU kernels (model/cpu_kernels.cpp): CustomLayerNorm's "cpp" path and the dropout of
`modeling_normlab.Dropout`, each with its autograd node in C++, and the stability probe's weight snapshot.
The dropout is also registered as the torch op `normlab::dropout` (bottom of this file) for torch.compile.

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

import torch

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


@torch.compiler.assume_constant_result  # torch.compile evaluates it once while tracing (it cannot trace a build)
def kernels_built() -> bool:
    """Whether the C++ kernels are available (building them on first use)."""
    return cpu_kernels() is not None


# torch.compile cannot trace into a pybind function, and Inductor's own CPU dropout draws its random numbers
# element by element (~20 ms of a 40 ms training step here). As a custom op with a fake (shape-only) kernel the
# C++ dropout stays in the compiled graph as one opaque call. The seed is an input, drawn with torch.randint (which
# torch.compile seeds from torch's generator): the op is a pure function, so the backward -- the same op on the
# gradient -- regenerates the same mask even if the compiler chooses to recompute rather than save the forward.


def _dropout_impl(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """x * mask(seed) / (1 - p) on CPU; seed a 0-dim int64 tensor."""
    return cpu_kernels().dropout_with_seed(x.contiguous(), int(seed), p)


def _dropout_fake(x, seed, p):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, like the kernel's output


def _dropout_setup_context(ctx, inputs, output):
    _, seed, p = inputs
    ctx.save_for_backward(seed)
    ctx.p = p


def _dropout_backward(ctx, grad):
    (seed,) = ctx.saved_tensors
    return torch.ops.normlab.dropout(grad, seed, ctx.p), None, None


if not hasattr(torch.ops.normlab, "dropout"):  # (a checkpoint's copy of this file may be imported beside it)
    _op = torch.library.custom_op("normlab::dropout", _dropout_impl, mutates_args=())
    _op.register_fake(_dropout_fake)
    _op.register_autograd(_dropout_backward, setup_context=_dropout_setup_context)
dropout_op = torch.ops.normlab.dropout  # dropout_op(x, seed, p), differentiable: Dropout's kernel under compile


def draw_dropout_seed() -> torch.Tensor:
    """A 0-dim int64 seed for dropout_op from torch's RNG (inside torch.compile, the compiled graph's RNG)."""
    return torch.randint(0, 2**62, (), dtype=torch.int64)
