"""Running a function forward and backward in eager mode, with chosen upstream gradients.

The upstream gradient (what `backward` receives for each output) is by default random normal
from a seeded generator, not ones: a rule that forgets to multiply by `grad` gives the right
answer for an upstream gradient of ones, and the wrong one for any other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor

from .._decorators import arm_all
from .._errors import GradOverrideError
from ._inputs import Call, floating_leaves

__all__ = ["GradOutputs", "Outputs", "backward", "describe_upstream", "forward", "upstream"]

#: What `backward` receives for each output: `"random"` (seeded normal), `"ones"` (the
#: gradient of `output.sum()`), a tensor (one output), or one tensor per output.
GradOutputs: TypeAlias = Literal["random", "ones"] | Tensor | Sequence[Tensor]


class Outputs:
    """The floating-point tensors a call returned, named (`output`, `output[0]`, ...)."""

    def __init__(self, fn_name: str, result: Any) -> None:
        found = floating_leaves(result, "output")
        if not found:
            msg = (
                f"`{fn_name}` returned {type(result).__name__}, which holds no floating-point "
                "tensor to take a gradient of; the function checked must return a tensor, or "
                "a tuple, list or dict of tensors."
            )
            raise GradOverrideError(msg)
        self.names: tuple[str, ...] = tuple(name for name, _ in found)
        self.tensors: tuple[Tensor, ...] = tuple(t for _, t in found)


def forward(call: Call, leaves: Sequence[Tensor]) -> Outputs:
    """Call the function on `leaves` (in place of the call's named tensors).

    Every gradoverride op checks its next eager call for a tensor its forward reads without
    being given it and for inputs changed in place (`GradOverrideError`), however many
    calls it made before."""
    arm_all()
    return Outputs(call.fn_name, call(leaves))


def upstream(
    outputs: Outputs, grad_outputs: GradOutputs, seed: int, fn_name: str
) -> tuple[Tensor, ...]:
    """One upstream gradient per output, in the output's shape, dtype and device."""
    if isinstance(grad_outputs, str):
        if grad_outputs == "ones":
            return tuple(torch.ones_like(t) for t in outputs.tensors)
        if grad_outputs == "random":
            gen = torch.Generator().manual_seed(seed)
            return tuple(
                torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device, t.dtype)
                for t in outputs.tensors
            )
        msg = (
            f"`grad_outputs` for `{fn_name}` must be 'random', 'ones', a tensor or one tensor "
            f"per output, got the string {grad_outputs!r}."
        )
        raise GradOverrideError(msg)
    if isinstance(grad_outputs, Tensor):
        given: tuple[Any, ...] = (grad_outputs,)
    elif isinstance(grad_outputs, Sequence):
        given = tuple(grad_outputs)
    else:
        given = (grad_outputs,)
    for i, grad in enumerate(given):
        if not isinstance(grad, Tensor):
            single = given[0] is grad_outputs
            where = "`grad_outputs`" if single else f"`grad_outputs[{i}]`"
            msg = (
                f"{where} for `{fn_name}` must be 'random', 'ones', a tensor (one output) or a "
                f"sequence of one tensor per output, got {type(grad).__name__} {grad!r}; for "
                "an upstream gradient of ones pass 'ones', for another value a tensor in the "
                "output's shape (`torch.full_like(output, value)`)."
            )
            raise GradOverrideError(msg)
    if len(given) != len(outputs.tensors):
        msg = (
            f"`grad_outputs` for `{fn_name}` has {len(given)} tensor(s), but `{fn_name}` "
            f"returned {len(outputs.tensors)} floating-point output(s) "
            f"({', '.join(outputs.names)}); pass one upstream gradient per output."
        )
        raise GradOverrideError(msg)
    result: list[Tensor] = []
    for name, out, grad in zip(outputs.names, outputs.tensors, given, strict=True):
        if grad.shape != out.shape:
            msg = (
                f"`grad_outputs` for `{name}` of `{fn_name}` has shape {tuple(grad.shape)}, "
                f"but `{name}` has shape {tuple(out.shape)}; pass an upstream gradient of "
                "the output's shape."
            )
            raise GradOverrideError(msg)
        result.append(grad.detach().to(out.device, out.dtype))
    return tuple(result)


def describe_upstream(grad_outputs: GradOutputs, seed: int) -> str:
    """How a report names the upstream gradient it used."""
    if isinstance(grad_outputs, str):
        return f"random normal (seed {seed})" if grad_outputs == "random" else "ones"
    return "given"


def backward(
    fn_name: str, outputs: Outputs, leaves: Sequence[Tensor], grads_out: Sequence[Tensor]
) -> tuple[Tensor | None, ...]:
    """The gradient for each leaf (None where none flows), by `torch.autograd.grad`.

    Outputs that do not require grad (a detached or constant output) are left out.
    """
    pairs = [(o, g) for o, g in zip(outputs.tensors, grads_out, strict=True) if o.requires_grad]
    if not pairs:
        msg = (
            f"no output of `{fn_name}` requires grad, so there is no backward to check; "
            "make the forward return a result computed from its floating-point inputs "
            "(not detached, not integer-valued)."
        )
        raise GradOverrideError(msg)
    grads = torch.autograd.grad(
        [o for o, _ in pairs], list(leaves), [g for _, g in pairs], allow_unused=True
    )
    return tuple(grads)
