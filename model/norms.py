"""Every normalization layer NormLab can put in a block, behind one interface (`Norm`) and one registry.

Every norm is called as `norm(x, mask=None)`: x (B, L, D) or any (*, D), mask (B, L) with 1/True at real tokens.
Per-token norms ignore the mask; the batch-statistics family (`BatchStatNorm`) uses it, except the naive
`batchnorm`, whose point is that padding enters its statistics. The registry at the end (`register_norm`) holds
each name's class and preset arguments, NormLab's own and those registered from outside (a decorator, or a
`module:Class` name in the config); the valid `config.norm` names, `build_norm` and the one answer to "is this a
batch-statistics norm?" (each class's `batch_stats`: `uses_batch_statistics(name)`, `batch_statistics_norms(module)`)
derive from it. The interface is base_norm.py's; the batch-statistics family lives in batch_norms.py and
powernorm.py. This file defines the per-token norms, holds the registry and re-exports the others' names: every
norm name is importable from here. docs/model.md explains the norms and how to plug in your own.
"""

import importlib
import inspect
from collections.abc import Sequence

import torch
import torch.nn as nn

from .base_norm import Norm, real_token_mask
from .batch_norms import (
    BatchCentering,
    BatchStandardization,
    BatchStatNorm,
    MaskedBatchNorm,
    NaiveBatchNorm,
    PopulationMoments,
    batch_statistics_norms,
    ghost_groups,
    group_moments,
    population_statistics,
    sentence_groups,
    set_batch_stats_in_eval,
)
from .layer_norm_op import layer_norm
from .powernorm import PowerNorm

# --- LayerNorm, torch's and ours -------------------------------------------------------------------------------


class LayerNorm(Norm, nn.LayerNorm):
    """torch.nn.LayerNorm that accepts (and ignores) the padding mask: its statistics are per token."""

    name = "layernorm"

    def forward(self, x, mask=None):
        return super().forward(x)


class CustomLayerNorm(Norm, nn.LayerNorm):
    """The project's own LayerNorm: torch.nn.LayerNorm's constructor and parameters, its forward the operator
    `normlab::layer_norm` (layer_norm_op.py; a kernel package may register a faster one). Half-precision inputs
    are normalized in float32. No double backward. docs/model.md, "CustomLayerNorm", has the math."""

    name = "custom_layernorm"

    def forward(self, x, mask=None):
        nd = len(self.normalized_shape)
        if tuple(x.shape[x.dim() - nd:]) != self.normalized_shape:
            raise ValueError(f"CustomLayerNorm expects input (*, {self.normalized_shape}), got {tuple(x.shape)}")
        if nd == 1:  # the usual case: the op normalizes the last dim, no reshapes
            return layer_norm(x, self.weight, self.bias, self.eps)[0]
        flat = lambda t: t.reshape(-1) if t is not None else None  # noqa: E731 - (M,) parameters for the op
        y, _, _ = layer_norm(x.flatten(-nd), flat(self.weight), flat(self.bias), self.eps)
        return y.view(x.shape)


# --- Per-token norms without mean subtraction, and no norm ------------------------------------------------------


class RMSNorm(Norm, nn.RMSNorm):
    """torch.nn.RMSNorm (x / sqrt(mean(x^2) + eps) * weight) accepting (and ignoring) the padding mask."""

    name = "rmsnorm"

    def forward(self, x, mask=None):
        return super().forward(x)


class DyT(Norm, nn.Module):
    """Dynamic Tanh (Zhu et al., 2025, "Transformers without Normalization"): weight * tanh(alpha * x) + bias.
    No statistics at all; a learnable scalar alpha sets how early tanh squashes outliers."""

    name = "dyt"

    @classmethod
    def from_config(cls, config, dim, **preset):
        return cls(dim, **{"alpha_init": config.dyt_alpha_init, **preset})

    def __init__(self, dim, alpha_init=0.5):
        super().__init__()
        self.alpha_init = float(alpha_init)
        self.alpha = nn.Parameter(torch.tensor(self.alpha_init))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def initial_values(self):
        return {"alpha": self.alpha_init, "weight": 1.0, "bias": 0.0}

    def forward(self, x, mask=None):
        return self.weight * torch.tanh(self.alpha * x) + self.bias


class Identity(Norm, nn.Module):
    """No normalization: the ablation."""

    name = "none"

    @classmethod
    def from_config(cls, config, dim, **preset):
        return cls(**preset)

    def initial_values(self):
        return {}

    def forward(self, x, mask=None):
        return x


# --- Registry ----------------------------------------------------------------------------------------------------

NORM_REGISTRY: dict[str, type] = {}  # name -> class, in registration order (the order of error messages and docs)
NORM_PRESETS: dict[str, dict] = {}  # name -> the constructor arguments its entry fixes (empty for a plain class)


def register_norm(cls=None, *, name: str | None = None, **preset):
    """Register a norm class under `name` (default: its `name` attribute), built with the constructor arguments
    `preset` on top of what `from_config` reads from the config: a variant is an entry, not a new class (as HF's
    ACT2CLS). Works as a decorator, plain (`@register_norm`) or with arguments (`@register_norm(name=...)`), and
    from outside NormLab; a saved model carries the code of the entries it uses (norm_code.py). Returns `cls`."""
    if cls is None:
        return lambda c: register_norm(c, name=name, **preset)
    if not (isinstance(cls, type) and issubclass(cls, Norm) and issubclass(cls, nn.Module)):
        what = _origin(cls) if isinstance(cls, type) else repr(cls)
        raise ValueError(f"register_norm: {what} is not a norm class; subclass model.norms.Norm and torch.nn.Module")
    name = getattr(cls, "name", None) if name is None else name
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_norm: {cls.__qualname__} has no registry name; set `name = ...` or pass name=")
    try:  # a misspelt argument fails here, not when a model is first built
        inspect.signature(cls).bind_partial(**preset)
    except TypeError as e:
        raise ValueError(f"register_norm: {name!r} presets {sorted(preset)}, but {cls.__qualname__} says: {e}") \
            from None
    old = NORM_REGISTRY.get(name)
    if old is not None and (_origin(old), NORM_PRESETS[name]) != (_origin(cls), preset):
        raise ValueError(f"register_norm: the norm name {name!r} is taken by {_origin(old)}; choose another name")
    NORM_REGISTRY[name], NORM_PRESETS[name] = cls, dict(preset)  # the same origin again: a reloaded module
    return cls


def _origin(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class RegisteredNames(Sequence):
    """The registered names (only the batch-statistics family's with `batch_stats_only`), read from the registry at
    each use: a norm registered after import (register_norm, a `module:Class` name) is a valid name from then on."""

    def __init__(self, batch_stats_only: bool = False):
        self.batch_stats_only = batch_stats_only

    def _names(self) -> tuple[str, ...]:
        return tuple(name for name, cls in NORM_REGISTRY.items() if cls.batch_stats or not self.batch_stats_only)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __eq__(self, other):
        return isinstance(other, Sequence) and self._names() == tuple(other)

    def __repr__(self) -> str:
        return repr(self._names())


for _cls in (LayerNorm, CustomLayerNorm, RMSNorm, NaiveBatchNorm, MaskedBatchNorm, PowerNorm, DyT, Identity):
    register_norm(_cls)
# Variants: a registered class with preset constructor arguments.
register_norm(RMSNorm, name="rmsnorm_noweight", elementwise_affine=False)  # x / rms(x): no per-feature gain
register_norm(LayerNorm, name="layernorm_nobias", bias=False)  # gain, no shift (PaLM, nanoGPT's LayerNorm option)

BUILTIN_NORMS = frozenset(NORM_REGISTRY)  # the names this file defines: a checkpoint's own norms.py has them
NORM_TYPES = RegisteredNames()  # every valid `config.norm` name, at the time it is asked
BATCH_STAT_NORMS = RegisteredNames(batch_stats_only=True)  # to enumerate, not to ask


def _import_norm(path: str, key: str) -> type:
    """The class a `module:Class` name points to, imported (the module must be importable here) and registered
    under that name."""
    module_name, _, qualname = path.partition(":")
    try:
        obj = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return register_norm(obj, name=path)
    except (ImportError, AttributeError, ValueError) as e:
        problem = f"cannot import it ({e})" if not isinstance(e, ValueError) else str(e).removeprefix("register_norm: ")
        raise ValueError(f"{key}={path!r}: {problem}; give an importable module:Class of a norm (installed, or on "
                         f"PYTHONPATH) or one of: {', '.join(NORM_TYPES)}") from None


def norm_class(name: str, key: str = "norm") -> type:
    """The class registered as `name`; a `module:Class` name is imported and registered first. ValueError naming
    `key` and the valid names otherwise."""
    if name in NORM_REGISTRY:
        return NORM_REGISTRY[name]
    if isinstance(name, str) and ":" in name:
        return _import_norm(name, key)
    raise ValueError(f"{key}={name!r} is not valid; choose one of: {', '.join(NORM_TYPES)}, or give module:Class "
                     f"of a norm of your own")


def uses_batch_statistics(norm: str) -> bool:
    """Does the norm named `norm` (a `config.norm` name) normalize with batch statistics (running statistics, a
    train/eval gap, `bn/*` metrics)? What to ask where there is a config but no model yet."""
    return norm_class(norm).batch_stats


def build_norm(config, dim=None, norm: str | None = None) -> nn.Module:
    """The norm named `norm` (default config.norm) over the last dim `dim` (default config.hidden_size), with its
    registry entry's preset arguments."""
    name = norm or config.norm
    cls = norm_class(name)  # registers a module:Class name, and so its (empty) presets
    return cls.from_config(config, config.hidden_size if dim is None else dim, **NORM_PRESETS[name])


__all__ = [
    "NORM_REGISTRY", "NORM_PRESETS", "NORM_TYPES", "BATCH_STAT_NORMS", "BUILTIN_NORMS", "Norm", "register_norm",
    "norm_class", "build_norm", "BatchStatNorm",
    "uses_batch_statistics", "batch_statistics_norms", "set_batch_stats_in_eval", "real_token_mask", "CustomLayerNorm",
    "ghost_groups", "sentence_groups", "group_moments", "population_statistics", "PopulationMoments",
    "LayerNorm", "RMSNorm", "NaiveBatchNorm", "MaskedBatchNorm", "PowerNorm", "DyT", "Identity", "BatchCentering",
    "BatchStandardization",
]
