"""How NormLab defines an operator (`define_op`), the dtype its operators compute in (`compute_dtype`), and the
names of the ways to choose their implementations (`KERNEL_MODES`).

Every operator has a readable reference implementation, a fake for torch.compile and an autograd formula whose
backward is an operator too, so a kernel package can register faster ones per device (docs/model.md).
"""

from typing import Callable, Optional

import torch

# A run's choice of implementation for these operators (train.kernels; a kernel package's switch takes the same
# names): auto, a kernel package's fast ones where it has them; reference, only the reference ones defined here.
KERNEL_MODES = ("auto", "reference")


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 at least (half-precision sums of squares over thousands of tokens are too coarse), float64 for
    float64 inputs: what every implementation of NormLab's operators, and the batch statistics, compute in."""
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def define_op(name: str, reference: Callable, fake: Callable, setup_context: Callable, backward: Callable,
              backward_reference: Optional[Callable] = None, backward_fake: Optional[Callable] = None):
    """Define `normlab::<name>` from its reference implementation (typed: the schema comes from its annotations)
    and fake; `setup_context` and `backward` are its autograd formula. With `backward_reference` and
    `backward_fake`, `normlab::<name>_backward` is defined too, for `backward` to call (without them, `backward`
    calls operators that exist already, e.g. the operator itself). Returns the operator, `torch.ops.normlab.<name>`.
    One that exists already is kept: a checkpoint's copy of model/ must not drop the kernels registered on it.
    """
    if not hasattr(torch.ops.normlab, name):
        op = torch.library.custom_op(f"normlab::{name}", reference, mutates_args=())
        op.register_fake(fake)
        op.register_autograd(backward, setup_context=setup_context)
        if backward_reference is not None:
            op = torch.library.custom_op(f"normlab::{name}_backward", backward_reference, mutates_args=())
            op.register_fake(backward_fake)
    return getattr(torch.ops.normlab, name)


__all__ = ["KERNEL_MODES", "compute_dtype", "define_op"]
