"""Fast implementations of NormLab's operators, registered on them with torch.library; model/ never imports this.

`use(model, mode, device)` is the one switch (train.py passes `train.kernels`): "auto" registers the fast backend
of the device's type (C++ on CPU, Triton on CUDA) when it can be had, else warns once and the reference runs;
"reference" runs the reference. It returns {operator: backend}. Which backend implements which operator, and why
the dropout and the attention are swapped into the model: docs/kernels.md.
"""

import importlib
import warnings

import torch
import torch.nn as nn

from model.ops import KERNEL_MODES as MODES  # named where the run config can read them without importing this

OPS = ("normlab::layer_norm", "normlab::layer_norm_backward", "normlab::dropout", "normlab::attention",
       "normlab::attention_backward")
DROPOUT = "normlab::dropout"
ATTENTION = "normlab::attention"
SWAPPED_IN = (DROPOUT, ATTENTION, "normlab::attention_backward")  # run only in a model `use` swapped them into
# device type -> (backend name, module); each module's register() puts its kernels on the operators for that
# device type (raising if it cannot: no compiler, no triton) and unregister() takes them off again
FAST_BACKENDS = {"cpu": ("cpp", "normlab.kernels.cpu"), "cuda": ("triton", "normlab.kernels.triton_layer_norm")}
# device type -> the fast backend that also implements the SWAPPED_IN operators (elsewhere the model keeps
# nn.Dropout and SDPA)
FAST_SWAPPED_IN = {"cpu": "cpp"}

_registered = {}  # device type -> the fast backend registered for it now (absent: none, the reference runs)
_unavailable = {}  # device type -> why its fast backend cannot be had (warned once per process)


def use(model: nn.Module, mode: str = "auto", device="cpu") -> dict:
    """Register the implementations `mode` asks for on `device`'s type, and give `model` the matching dropout and
    attention (in place); returns {operator: backend}. Everything that can fail (a build, an import) happens
    here, before training; a kernel that fails while it runs raises like any torch op."""
    backends = enable(mode, device)
    _swap_in(model, backends)
    return backends


def enable(mode: str = "auto", device="cpu") -> dict:
    """`use` without a model: the operators' implementations only; returns {operator: backend}."""
    if mode not in MODES:
        raise ValueError(f"kernels mode {mode!r} is not valid; choose one of: {', '.join(MODES)}")
    device_type = torch.device(device).type
    import model.layer_norm_op  # noqa: F401 - kernels can only be registered on operators that exist

    wanted = FAST_BACKENDS[device_type][0] if mode == "auto" and device_type in FAST_BACKENDS else "reference"
    if wanted != _registered.get(device_type, "reference"):
        if device_type in _registered:
            _backend_module(device_type).unregister()
            del _registered[device_type]
        if wanted != "reference" and _register(device_type):
            _registered[device_type] = wanted
    return backends(device)


def backends(device="cpu") -> dict:
    """{operator: backend} that runs now for tensors on `device` (for the dropout and the attention: in a model
    after `use`)."""
    device_type = torch.device(device).type
    backend = _registered.get(device_type, "reference")
    swapped_in = backend if backend == FAST_SWAPPED_IN.get(device_type) else "torch"
    return {op: swapped_in if op in SWAPPED_IN else backend for op in OPS}


def unavailable(device="cpu") -> str | None:
    """Why the fast backend of `device`'s type could not be had in this process (None: it could, or was not
    tried, or there is none)."""
    return _unavailable.get(torch.device(device).type)


def _swap_in(model: nn.Module, backends: dict) -> None:
    """"cpp": every nn.Dropout becomes normlab.kernels.dropout.Dropout and a model on "sdpa" attention moves to
    normlab::attention's; anything else swaps both back (a model on "eager" keeps it). Neither holds state, and
    transformers does not save the attention implementation: state dicts and save_pretrained are unchanged."""
    from .attention import ATTN_IMPLEMENTATION, register_attention_function
    from .dropout import Dropout

    fast_dropout, fast_attention = backends.get(DROPOUT) == "cpp", backends.get(ATTENTION) == "cpp"
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is (nn.Dropout if fast_dropout else Dropout)]
    for parent, name, child in swaps:
        new = (Dropout if fast_dropout else nn.Dropout)(child.p, child.inplace)
        setattr(parent, name, new.train(child.training))
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if fast_attention and current == "sdpa":
        register_attention_function()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    elif not fast_attention and current == ATTN_IMPLEMENTATION:
        model.set_attn_implementation("sdpa")


def _backend_module(device_type: str):
    return importlib.import_module(FAST_BACKENDS[device_type][1])


def _register(device_type: str) -> bool:
    """Register the device type's fast backend; False (warned once) if it cannot be had."""
    if device_type in _unavailable:
        return False
    try:
        _backend_module(device_type).register()
        return True
    except Exception as err:  # noqa: BLE001 - no compiler or ninja, no triton: the reference implementation runs
        detail = " ".join(str(err).split())  # a failed build's message ends with the compiler's errors
        _unavailable[device_type] = f"{type(err).__name__}: {detail if len(detail) <= 300 else '...' + detail[-300:]}"
        warnings.warn(f"normlab.kernels: the {FAST_BACKENDS[device_type][0]} backend for {device_type} is "
                      f"unavailable ({_unavailable[device_type]}); NormLab's operators run their reference PyTorch "
                      f"implementation (train.kernels=reference chooses it without this warning)", stacklevel=3)
        return False


__all__ = ["MODES", "OPS", "DROPOUT", "ATTENTION", "SWAPPED_IN", "FAST_BACKENDS", "FAST_SWAPPED_IN", "use", "enable",
           "backends", "unavailable"]
