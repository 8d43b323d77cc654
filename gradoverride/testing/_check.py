"""`check_backward`: run a function forward and backward, and check each input's gradient."""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from .._errors import GradOverrideError
from .._frameworks import any_jax
from ._compare import compare, difference_problems, format_index, tolerances
from ._inputs import Call, function_name
from ._reference import FINITE_DIFFERENCES, Reference, reference_gradients
from ._report import BackwardReport, GradientRow, mismatch_message
from ._vjp import GradOutputs, backward, describe_upstream, forward, upstream

if TYPE_CHECKING:
    from ._jax_check import JaxGradOutputs, JaxReference

__all__ = ["check_backward"]

# gradcheck's tolerances: central differences are only so accurate.
_FINITE_DIFFERENCE_TOLERANCES = (1e-3, 1e-5)


def check_backward(
    fn: Callable[..., Any],
    *inputs: Any,
    reference: Reference | JaxReference | None = None,
    grad_outputs: GradOutputs | JaxGradOutputs | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    min_cosine: float | None = None,
    allow_nonfinite: bool = False,
    step: float = 1e-6,
    seed: int = 0,
    raise_on_mismatch: bool = True,
) -> BackwardReport:
    """Run `fn(*inputs)` forward and backward, and check the gradient of each input.

    ```python
    import torch
    from gradoverride import recipes
    from gradoverride.testing import check_backward

    spike = recipes.spike(surrogate="fast_sigmoid", alpha=1.0)  # sg(x) = (1/2) / (1 + |x|)^2
    x = torch.linspace(-2, 2, 9)
    report = check_backward(spike, x, reference=lambda x: x / (2 * (1 + x.abs())))
    print(report.ok, f"{report['x'].difference.cosine:.4f}")
    #> True 1.0000
    ```

    Every floating-point tensor among `inputs` (also inside tuples, lists and dicts) gets a
    gradient, named as `fn`'s signature names it (`x`, `xs[0]`). Each gradient must have the
    input's shape, dtype and device and be finite; with a `reference`, it must also be close
    to the reference's gradient: `|got - expected| <= atol + rtol * |expected|` element-wise.
    `gradcheck` cannot check a straight-through or surrogate rule, whose backward is on
    purpose not the derivative of its forward; a proxy reference states what it stands for.

    With JAX arrays among `inputs` (also inside any JAX pytree: a `register_dataclass`
    class, named by its path, `params.w`) the same checks run on JAX (imported only then):
    the gradients are `jax.vjp`'s, a proxy is written in JAX ops, expected and upstream
    gradients are JAX or numpy arrays, a floating-point numpy input is differentiated as a
    JAX array, and finite differences run in float64 inside `jax.enable_x64(True)`, leaving
    your JAX setting as it was. A torch module or torch tensors given with JAX inputs raise
    `GradOverrideError`, as does a forward that is not the same function in float64 (a
    `jax.random` draw) or fails there.

    Args:
        fn: the function to check: a `go.custom_backward` op, or any function calling one.
        *inputs: its positional inputs. Bind keyword arguments with `functools.partial`.
        reference: what the gradients should be:
            a **proxy**, a differentiable function of the same inputs whose autograd gradient
            the rule stands for (`torch.tanh` for a tanh surrogate);
            `"finite_differences"`, central differences of `fn`'s own forward in float64,
            for a rule meant to be the exact derivative (costs two calls per element);
            or the **expected gradients**: a tensor (one input), a sequence in input order,
            or a dict by input name (inputs left out are not compared; None = no gradient).
        grad_outputs: the upstream gradient for each output: `"random"` (seeded normal), or
            `"ones"` (the gradient of `output.sum()`), or tensors. Default: `"ones"` when the
            reference is given tensors (the gradients of `output.sum()` you wrote down),
            else `"random"`, which catches a rule that forgets to multiply by `grad` (refused
            with given gradients: they hold for one upstream gradient only). The outputs of
            `fn` and of a proxy pair by position, dict outputs by key.
        rtol: the relative tolerance; default `torch.testing.assert_close`'s for the
            input's dtype, and with finite differences at least gradcheck's 1e-3.
        atol: the absolute tolerance; default as for `rtol` (gradcheck's 1e-5 at least
            with finite differences).
        min_cosine: also require this cosine similarity with the reference (set `rtol` and
            `atol` to `float("inf")`, which accepts any value, to check only the direction).
        allow_nonfinite: accept NaN or infinite gradients.
        step: the finite-difference step, a finite number greater than 0.
        seed: the seed of the random upstream gradient.
        raise_on_mismatch: raise on a failed check (default); False only reports.

    Returns:
        A `BackwardReport`: one row per input (gradient shape, dtype, device, finite, and
        with a reference the max abs/rel difference and cosine similarity); `repr` prints it.

    Raises:
        GradOverrideError: naming the input whose gradient failed, with the report.
    """
    given = reference is not None and not callable(reference) and not isinstance(reference, str)
    _check_options(fn, given=given, grad_outputs=grad_outputs, step=step)
    if grad_outputs is None:
        grad_outputs = "ones" if given else "random"
    if _any_jax(inputs):  # JAX arrays: checked by JAX, imported only now
        from ._jax_check import check_backward_jax

        return check_backward_jax(
            fn, inputs, reference=cast("JaxReference | None", reference),
            grad_outputs=cast("JaxGradOutputs", grad_outputs), rtol=rtol, atol=atol,
            min_cosine=min_cosine, allow_nonfinite=allow_nonfinite, step=step, seed=seed,
            raise_on_mismatch=raise_on_mismatch,
        )
    reference = cast("Reference | None", reference)  # torch values from here on
    grad_outputs = cast("GradOutputs", grad_outputs)
    call = Call(fn, inputs)
    leaves = call.leaves()
    outputs = forward(call, leaves)
    grads_out = upstream(outputs, grad_outputs, seed, call.fn_name)
    try:
        grads = backward(call.fn_name, outputs, leaves, grads_out)
    except Exception as exc:
        exc.add_note(f"(raised in the backward of `{call.fn_name}` run by check_backward)")
        raise

    expected: dict[str, Tensor | None] = {}
    description: str | None = None
    if reference is not None:
        description, expected = reference_gradients(reference, call, outputs, grads_out, step=step)
    by_differences = isinstance(reference, str) and reference == FINITE_DIFFERENCES
    at_least = _FINITE_DIFFERENCE_TOLERANCES if by_differences else (0.0, 0.0)

    rows: list[GradientRow] = []
    for name, tensor, grad in zip(call.names, call.tensors, grads, strict=True):
        # Autograd itself gives each gradient its input's shape, dtype and device (the rule's
        # own mistakes there are GradOverrideErrors from the op); the report shows them.
        problems = [] if grad is None or allow_nonfinite else _finiteness_problems(grad)
        difference = None
        if description is not None and name in expected and not problems:
            want = expected[name]
            rtol_, atol_ = tolerances(tensor.dtype, rtol, atol, at_least=at_least)
            got = torch.zeros_like(tensor) if grad is None else grad
            difference = compare(
                got, torch.zeros_like(tensor) if want is None else want, rtol_, atol_
            )
            problems += difference_problems(difference, description, atol_, rtol_, min_cosine)
        rows.append(GradientRow(name, grad, expected.get(name), difference, tuple(problems)))

    report = BackwardReport(
        call.fn_name, rows, reference=description, upstream=describe_upstream(grad_outputs, seed)
    )
    if raise_on_mismatch and not report.ok:
        raise GradOverrideError(mismatch_message(report, reference, "`torch.where`, `clamp`"))
    return report


def _any_jax(inputs: tuple[Any, ...]) -> bool:
    """Whether the inputs hold a JAX array, also inside a registered JAX pytree (a
    `register_dataclass` class, say); free when JAX was never imported."""
    if any_jax(inputs):
        return True
    jax: Any = sys.modules.get("jax")
    if jax is None:
        return False
    try:
        leaves = jax.tree_util.tree_leaves(inputs)
    except Exception:  # not a pytree JAX can flatten (a dict with keys it cannot sort)
        return False
    return any(isinstance(leaf, jax.Array) for leaf in leaves)


def _check_options(fn: Callable[..., Any], *, given: bool, grad_outputs: Any, step: Any) -> None:
    """A `GradOverrideError` for option values that cannot mean anything."""
    name = function_name(fn)
    if (
        isinstance(step, bool)
        or not isinstance(step, numbers.Real)
        or not math.isfinite(step)
        or step <= 0
    ):
        msg = (
            f"check_backward(`{name}`): `step` must be a finite number greater than 0 (the "
            f"finite-difference step, default 1e-6), got {step!r}; pass e.g. `step=1e-6`."
        )
        raise GradOverrideError(msg)
    if given and isinstance(grad_outputs, str) and grad_outputs == "random":
        msg = (
            f"check_backward(`{name}`): the reference is given as gradients, but "
            "`grad_outputs='random'`: given gradients are the backward's result for one "
            "upstream gradient, ones (the gradients of `output.sum()`) or the arrays passed "
            "as `grad_outputs`, never for a random draw. Pass `grad_outputs='ones'` (the "
            "default with given gradients) or the upstream gradients they are the VJP for, "
            "or give a proxy function as `reference` to check with a random upstream gradient."
        )
        raise GradOverrideError(msg)


def _finiteness_problems(grad: Tensor) -> list[str]:
    bad = ~torch.isfinite(grad)
    count = int(bad.sum())
    if not count:
        return []
    first = tuple(int(i) for i in bad.nonzero()[0]) if grad.dim() else ()
    return [
        f"its gradient is not finite: {count} of {grad.numel()} values are NaN or infinite "
        f"(the first{format_index(first)}: {float(grad[first]):g})."
    ]


