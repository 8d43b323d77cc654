"""The gradients a rule is checked against: a smooth proxy's, finite differences, or given.

* a **proxy**: a differentiable function that the rule stands for (`torch.tanh` for a spike
  with a tanh surrogate, `lambda x: x.clamp(-1, 1)` for a clipped straight-through rule),
  called on the same inputs and differentiated by autograd with the same upstream gradient;
* **finite differences** (`"finite_differences"`): central differences of the checked
  function's own forward, `(f(x + h) - f(x - h)) / 2h` element by element, evaluated in
  float64 for a rule meant to be the exact derivative (a faster hand-written one);
* **given tensors**: the expected gradients, one tensor (one input), a sequence in input
  order, or a dict by input name (inputs left out are not compared).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor

from .._errors import GradOverrideError
from ._inputs import Call, floating_leaves, function_name
from ._vjp import Outputs, backward

__all__ = ["FINITE_DIFFERENCES", "Reference", "reference_gradients"]

FINITE_DIFFERENCES = "finite_differences"

#: What `check_backward(reference=...)` accepts.
Reference: TypeAlias = (
    Callable[..., Any]
    | Literal["finite_differences"]
    | Tensor
    | Sequence[Tensor | None]
    | Mapping[str, Tensor | None]
)


def reference_gradients(
    reference: Reference,
    call: Call,
    outputs: Outputs,
    grads_out: Sequence[Tensor],
    *,
    step: float,
) -> tuple[str, dict[str, Tensor | None]]:
    """A description of the reference, and its gradient for each input it covers.

    None means "no gradient" (compared as zeros).
    """
    if isinstance(reference, str):
        if reference != FINITE_DIFFERENCES:
            msg = (
                f"check_backward(`{call.fn_name}`): unknown reference {reference!r}; the "
                f"string reference is {FINITE_DIFFERENCES!r}. A reference can also be a "
                "proxy function or the expected gradients as tensors."
            )
            raise GradOverrideError(msg)
        grads = _finite_differences(call, outputs, grads_out, step)
        return f"central finite differences (step {step:g}, float64)", dict(
            zip(call.names, grads, strict=True)
        )
    if isinstance(reference, Tensor | Mapping) or (
        isinstance(reference, Sequence) and not isinstance(reference, str)
    ):
        return "the given gradients", _given(reference, call)
    if callable(reference):
        by_name = _proxy(reference, call, outputs, grads_out)
        return f"the proxy `{function_name(reference)}`", by_name
    msg = (
        f"check_backward(`{call.fn_name}`): `reference` must be a proxy function, "
        f"{FINITE_DIFFERENCES!r}, or the expected gradients as tensors, got "
        f"{type(reference).__name__}."
    )
    raise GradOverrideError(msg)


def _proxy(
    proxy: Callable[..., Any], call: Call, outputs: Outputs, grads_out: Sequence[Tensor]
) -> dict[str, Tensor | None]:
    name = function_name(proxy)
    leaves = call.leaves()
    # A module's parameters are swapped in while the proxy runs: a proxy reading them (as
    # `layer.weight`) gives their gradients too.
    proxy_outputs = Outputs(name, call.with_parameters(
        leaves, lambda: proxy(*call.rebuild(leaves))))
    if proxy_outputs.names != outputs.names and sorted(proxy_outputs.names) == sorted(
        outputs.names
    ):
        # Dict outputs pair by key, whatever order each function built its dict in.
        by_output = dict(zip(proxy_outputs.names, proxy_outputs.tensors, strict=True))
        proxy_outputs.names = outputs.names
        proxy_outputs.tensors = tuple(by_output[n] for n in outputs.names)
    got = [tuple(t.shape) for t in proxy_outputs.tensors]
    want = [tuple(t.shape) for t in outputs.tensors]
    if got != want:
        msg = (
            f"check_backward(`{call.fn_name}`): the proxy `{name}` returned outputs of shapes "
            f"{got}, but `{call.fn_name}` returned {want}; a proxy must take the same inputs "
            "and return outputs of the same shapes, so the same upstream gradients apply."
        )
        raise GradOverrideError(msg)
    grads = backward(name, proxy_outputs, leaves, grads_out)
    by_name = dict(zip(call.names, grads, strict=True))
    for parameter in call.parameter_names:  # a proxy that does not read it says nothing
        if by_name[parameter] is None:
            del by_name[parameter]
    return by_name


def _finite_differences(
    call: Call, outputs: Outputs, grads_out: Sequence[Tensor], step: float
) -> tuple[Tensor, ...]:
    """Central differences of `<upstream, f(x)>` for each element of each input, in float64.

    Only outputs that required grad in the checked call count, as in its backward.
    """
    weights = [
        g.to(torch.float64) if out.requires_grad else None
        for out, g in zip(outputs.tensors, grads_out, strict=True)
    ]
    points = [t.contiguous() for t in call.leaves(torch.float64)]

    def weighted_sum() -> float:
        with torch.no_grad():
            result = call(points)
        values = [t for _, t in floating_leaves(result, "output")]
        total = 0.0
        for value, weight in zip(values, weights, strict=True):
            if weight is not None:
                total += float((value.to(torch.float64) * weight.to(value.device)).sum())
        return total

    grads: list[Tensor] = []
    for point, original in zip(points, call.tensors, strict=True):
        flat = point.view(-1)
        grad = torch.zeros(flat.numel(), dtype=torch.float64)
        for i in range(flat.numel()):
            saved = flat[i].item()
            flat[i] = saved + step
            plus = weighted_sum()
            flat[i] = saved - step
            minus = weighted_sum()
            flat[i] = saved
            grad[i] = (plus - minus) / (2 * step)
        grads.append(grad.view(original.shape).to(original.device))
    return tuple(grads)


def _given(
    reference: Tensor | Sequence[Tensor | None] | Mapping[str, Tensor | None], call: Call
) -> dict[str, Tensor | None]:
    fn = call.fn_name
    if isinstance(reference, Tensor):
        if call.n_inputs != 1:
            msg = (
                f"check_backward(`{fn}`): the reference is one tensor, but `{fn}` has "
                f"{call.n_inputs} inputs to differentiate ({', '.join(call.input_names)}); "
                "pass a dict by input name."
            )
            raise GradOverrideError(msg)
        given: dict[str, Tensor | None] = {call.names[0]: reference}
    elif isinstance(reference, Mapping):
        unknown = [k for k in reference if k not in call.names]
        if unknown:
            msg = (
                f"check_backward(`{fn}`): the reference names `{unknown[0]}`, which is not an "
                f"input of `{fn}` that gets a gradient; those are {', '.join(call.names)}."
            )
            raise GradOverrideError(msg)
        given = dict(reference)
    else:
        if len(reference) not in (call.n_inputs, len(call.names)):
            msg = (
                f"check_backward(`{fn}`): the reference has {len(reference)} gradient(s), but "
                f"`{fn}` has {len(call.names)} inputs to differentiate "
                f"({', '.join(call.names)}); pass one per input (None for none) or a dict."
            )
            raise GradOverrideError(msg)
        given = dict(zip(call.names, reference, strict=False))
    tensors = dict(zip(call.names, call.tensors, strict=True))
    for name, grad in given.items():
        if grad is None:
            continue
        if not isinstance(grad, Tensor):
            msg = (
                f"check_backward(`{fn}`): the reference gradient for `{name}` must be a tensor "
                f"or None, got {type(grad).__name__}."
            )
            raise GradOverrideError(msg)
        if grad.shape != tensors[name].shape:
            msg = (
                f"check_backward(`{fn}`): the reference gradient for `{name}` has shape "
                f"{tuple(grad.shape)}, but `{name}` has shape {tuple(tensors[name].shape)}; "
                "give the expected gradient in the input's shape."
            )
            raise GradOverrideError(msg)
    return given
