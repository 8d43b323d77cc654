"""The recipes on another framework's arrays (TensorFlow tensors, JAX arrays), written once
over the backend protocol (`gradoverride._ops`).

A recipe object (`go.recipes.ste_round()`, `go.recipes.spike("erf")`, ...) is the same for
every framework. Its call (and a gradient transform's `transform`) sends an argument that is
not a torch tensor but another framework's array here, which finds the implementation by the
recipe's class and runs it with that framework's backend `b`: the formula is the torch
recipe's (`gradoverride.recipes._formulas`), the custom gradient `b.custom_gradient`
(TensorFlow's `tf.custom_gradient`, JAX's `jax.custom_gradient`). The backend is imported
with its framework, at the first such array, so `import gradoverride` imports neither.

What every framework shares with torch: the formula and its order of operations, the
defaults, the windows (both ends inclusive unless the recipe says, compared in the input's
dtype), the value at 0, the reduction dtypes (float32 for float16/bfloat16 inputs where
torch does so) and the output and gradient dtype (the input's). Where a framework's op
differs from torch's at an edge, the backend writes torch's out (`sign(NaN)` is 0; a Python
number times a half-precision gradient is applied in float32 and rounded once; a division
by a Python number stays a correctly rounded division where TensorFlow's graph optimizer,
XLA and TFLite would multiply by the reciprocal). Every forward and backward is the
framework's ops only, with no Python branch on a value, so each recipe runs eagerly, under
`tf.function`, XLA and `jax.jit`; settings are Python values closed over by the custom
gradient, never its arguments; variables are read before it (so they still get their
gradient through the read); an `IndexedSlices` upstream gradient is made dense first.

What cannot be the same, each documented where it applies: TensorFlow's and JAX's `exp`,
`sigmoid` and reductions are not torch's kernels, so surrogate gradients and norms agree to
a few float32 ulps, not to the bit (XLA on the CPU also fuses multiply-adds, flushes
subnormal results to zero, and turns a product with a 0/1 mask into a select, so a NaN
input can get a 0 gradient under `jax.jit` or `jit_compile=True`); TensorFlow and
JAX have no global generator torch's `torch.Generator` could drive (JAX has none at all:
stochastic recipes take their draws as `noise=` there); under XLA `reduce_max`/`reduce_min`
skip NaN; `sanitize_grad(mode="raise")` cannot check inside XLA (`jit_compile=True`,
`jax.jit`), where it is refused. The recipes that call a Python solver, `rotation_trick` and
the torch-state module forms are torch-only (`unsupported` names the alternative).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._errors import GradOverrideTypeError
from ..._ops import Backend, backend_for
from .._discrete import rotation_trick
from .._flow import ScaledGradientModule
from .._solvers import blackbox_solver, perturbed_optimizer
from .._ste import (
    LearnedStepQuantizer,
    abs_subgradient,
    binarize,
    lsq,
    quantize,
    ste_ceil,
    ste_clamp,
    ste_floor,
    ste_round,
    ste_sign,
    ternarize,
)
from . import _discrete, _flow, _ste, _surrogate

__all__ = ["SUPPORTED", "call", "transform"]

#: The public recipes that take TensorFlow tensors and JAX arrays (named in the
#: unsupported-recipe error).
SUPPORTED: tuple[str, ...] = (
    "abs_subgradient",
    "binarize",
    "clip_grad_norm",
    "clip_grad_value",
    "gumbel_softmax",
    "lsq",
    "quantize",
    "reverse_grad",
    "sanitize_grad",
    "scale_grad",
    "spike",
    "ste_argmax",
    "ste_ceil",
    "ste_clamp",
    "ste_floor",
    "ste_round",
    "ste_sign",
    "ternarize",
)

#: `recipe(x, ...)` by recipe class (looked up along the class's MRO, so `reverse_grad`
#: and `scale_grad` share `_ScaledGradient`'s, and a user's own `GradientTransform` gets
#: the identity whose gradient is its `transform`).
_CALLS: dict[type, Callable[..., Any]] = {
    **_ste.CALLS, **_surrogate.CALLS, **_flow.CALLS, **_discrete.CALLS,
}
#: `recipe.transform(grad, ...)` by recipe class.
_TRANSFORMS: dict[type, Callable[..., Any]] = {
    **_ste.TRANSFORMS, **_surrogate.TRANSFORMS, **_flow.TRANSFORMS, **_discrete.TRANSFORMS,
}

#: What to do instead, for each recipe or module with no form on these arrays.
_INSTEAD: dict[type, str] = {
    rotation_trick: "its rotation has no form on these arrays yet",
    blackbox_solver: (
        "it calls a Python solver between the forward and the backward, which tf.function, "
        "XLA and jax.jit cannot trace"
    ),
    perturbed_optimizer: (
        "it calls a Python solver between the forward and the backward, which tf.function, "
        "XLA and jax.jit cannot trace"
    ),
    LearnedStepQuantizer: (
        "its step is a torch parameter; call the recipe itself, `lsq(bits)(x, step)`, with "
        "the step in a variable of your framework (a `tf.Variable`, a JAX array)"
    ),
    ScaledGradientModule: (
        "it keeps its step count in a torch buffer, which a traced TensorFlow or JAX "
        "function would freeze; call the recipe itself with a step counter, "
        "`recipe(x, step=step)`"
    ),
}

#: The recipes that exist for their backward and so refuse an input that gets no gradient.
_FLOATING_ONLY = (
    ste_round, ste_floor, ste_ceil, ste_sign, ste_clamp, binarize, ternarize, quantize, lsq,
    abs_subgradient,
)


def _lookup(table: dict[type, Callable[..., Any]], recipe: object) -> Callable[..., Any] | None:
    for cls in type(recipe).__mro__:
        found = table.get(cls)
        if found is not None:
            return found
    return None


def unsupported(b: Backend, recipe: object, x: Any, name: str | None = None
                ) -> GradOverrideTypeError:
    """The error for a recipe (or module) with no form on `b`'s arrays."""
    name = name or type(recipe).__name__
    why = next((v for k, v in _INSTEAD.items() if isinstance(recipe, k)), "")
    msg = (
        f"{name} supports torch tensors only; got a {b.name} {type(x).__name__} as its "
        f"input{f' ({why})' if why else ''}. The recipes that support TensorFlow tensors and "
        f"JAX arrays are: {', '.join(SUPPORTED)}. Use one of them, or run {name} on torch "
        "tensors."
    )
    return GradOverrideTypeError(msg)


def check_floating(b: Backend, recipe: object, x: Any, argument: str = "x") -> None:
    """The torch recipes' refusal of integer and bool inputs, on `b`'s arrays."""
    kind = b.dtype_kind(x)
    if kind == "floating":
        return
    array = "tensor" if b.name == "TensorFlow" else "array"
    why = (" (the recipes are defined on real numbers)" if kind == "complex"
           else ", which gets no gradient")
    msg = (
        f"{recipe!r}: `{argument}` must be a floating-point {array} (float16, "
        f"bfloat16, float32 or float64); got a {b.name} {b.dtype_name(x)} {array}{why}."
    )
    if kind != "complex":
        msg += f" Convert it first: `{b.cast_hint(argument)}`."
    raise GradOverrideTypeError(msg)


def call(recipe: object, x: Any, /, *args: Any, **kwargs: Any) -> Any:
    """`recipe(x, ...)` for another framework's `x` (the recipe's call sends it here)."""
    b = backend_for(x)
    b.check_call(recipe)
    implementation = _lookup(_CALLS, recipe)
    if implementation is None:
        raise unsupported(b, recipe, x)
    if isinstance(recipe, _FLOATING_ONLY):
        check_floating(b, recipe, x)
    return implementation(b, recipe, x, *args, **kwargs)


def transform(recipe: Any, grad: Any, /, **kwargs: Any) -> Any:
    """`recipe.transform(grad, ...)` for another framework's gradient (dense or
    `IndexedSlices`). A user's own `GradientTransform` gets its own `transform`, with a
    dense gradient."""
    b = backend_for(grad)
    grad = b.asarray(grad)
    implementation = _lookup(_TRANSFORMS, recipe)
    if implementation is None:
        return recipe.transform(grad, **kwargs)
    return implementation(b, recipe, grad, **kwargs)
