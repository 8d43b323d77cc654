"""Straight-through estimators: round, floor, ceil, sign, clamp, binarize, ternarize, n-bit
quantize, and the learned-step quantizer of LSQ.

Every recipe's forward is the non-differentiable op, computed in the input's dtype; its
backward is the formula in its docstring. "Straight-through" means the upstream gradient
passes unchanged; a "window" zeroes it where the input is outside `[low, high]` (both ends
inclusive, compared in the input's dtype). Windows keep the input for backward by default
(`keep="input"`, free when the input stays alive anyway, as a weight does) or one byte per
element (`keep="mask"`); see `go.straight_through`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from .._decorators import custom_backward
from .._errors import GradOverrideError, GradOverrideTypeError
from .._internals import is_tracing
from .._jit import refuse_scripting
from .._ops import TORCH, foreign
from .._straight_through import (
    DEFAULT_KEEP,
    Inclusive,
    Keep,
    WindowBounds,
    check_window,
    masked_gradient,
    parse_clip,
    parse_inclusive,
    straight_through,
    window_bounds,
    window_gradient,
    window_mask,
)
from ._base import Recipe, array_call, finite, positive_number
from ._formulas import ste as F
from ._int8_export import exporting, fake_quantize, int8_range

__all__ = [
    "BINARIZE_PRESETS",
    "CLAMP_PRESETS",
    "LearnedStepQuantizer",
    "abs_subgradient",
    "binarize",
    "lsq",
    "quantize",
    "ste_ceil",
    "ste_clamp",
    "ste_floor",
    "ste_round",
    "ste_sign",
    "ternarize",
]


# ---- shared ops ------------------------------------------------------------------------------


@straight_through
def _ste_round(x: Tensor) -> Tensor:
    result: Tensor = TORCH.round(x)
    return result


@straight_through
def _ste_floor(x: Tensor) -> Tensor:
    result: Tensor = TORCH.floor(x)
    return result


@straight_through
def _ste_ceil(x: Tensor) -> Tensor:
    result: Tensor = TORCH.ceil(x)
    return result


@straight_through
def _ste_sign(x: Tensor) -> Tensor:
    result: Tensor = TORCH.sign(x)
    return result


@custom_backward
def _ste(x: Tensor, forward: Callable[[Tensor], Tensor]) -> Tensor:
    """Straight-through: `forward(x)`, backward the upstream gradient itself."""
    return forward(x)


@_ste.backward
def _(grad: Tensor) -> Tensor:
    return grad


class _Windowed(Protocol):
    """A recipe whose gradient passes inside a window: `ste_clamp`, `binarize`."""

    @property
    def _bounds(self) -> WindowBounds | None: ...

    @property
    def keep(self) -> Keep: ...

    def _forward(self, x: Tensor) -> Tensor: ...


# The recipe itself is the argument, not its bounds: the op's argument check would visit
# every bound of the table, and dynamo then traces each as a symbolic float under dynamic
# shapes and restarts its analysis to fix those the graph does not use.


@custom_backward
def _ste_window(x: Tensor, recipe: _Windowed) -> Tensor:
    """`recipe._forward(x)`; backward the upstream gradient inside the window (keeps x)."""
    return recipe._forward(x)


@_ste_window.backward
def _(grad: Tensor, *, x: Tensor, recipe: _Windowed) -> Tensor:
    return window_gradient(grad, x, _bounds_of(recipe))


@custom_backward(residuals=("mask",))
def _ste_window_mask(x: Tensor, recipe: _Windowed) -> Any:
    """As `_ste_window`, keeping a one-byte mask of the window instead of x."""
    return recipe._forward(x), {"mask": window_mask(x, _bounds_of(recipe))}


@_ste_window_mask.backward
def _(grad: Tensor, *, mask: Tensor) -> Tensor:
    return masked_gradient(grad, mask)


def _bounds_of(recipe: _Windowed) -> WindowBounds:
    bounds = recipe._bounds
    if bounds is None:  # pragma: no cover - `_windowed` calls the windowed ops with a window only
        msg = f"{recipe!r} has no window to test its input against."
        raise GradOverrideError(msg)
    return bounds


def _windowed(x: Tensor, recipe: _Windowed) -> Tensor:
    if recipe._bounds is None:
        return _ste(x, recipe._forward)
    if recipe.keep == "mask":
        result: Tensor = _ste_window_mask(x, recipe)
        return result
    return _ste_window(x, recipe)


def _check_input(recipe: object, x: object, argument: str = "x") -> None:
    """Refuse an input a straight-through recipe cannot pass a gradient to: every recipe
    here exists for its backward, and an integer or bool tensor never gets a gradient."""
    if isinstance(x, Tensor) and x.dtype.is_floating_point:
        return
    if not isinstance(x, Tensor):
        got, fix = type(x).__name__, f"torch.as_tensor({argument}, dtype=torch.float32)"
    elif x.dtype.is_complex:
        got, fix = f"a {x.dtype} tensor (the recipes are defined on real numbers)", ""
    else:
        got, fix = f"a {x.dtype} tensor, which gets no gradient", f"{argument}.float()"
    msg = (
        f"{recipe!r}: `{argument}` must be a floating-point tensor (float16, bfloat16, "
        f"float32 or float64); got {got}."
    )
    if fix:
        msg += f" Convert it first: `{fix}`."
    raise GradOverrideTypeError(msg)


def _check_keep(recipe: Recipe, keep: object) -> None:
    if keep not in ("input", "mask"):
        msg = (
            f"{type(recipe).__name__}: `keep` must be 'input' (save the input for backward; "
            f"free when it stays alive anyway) or 'mask' (one byte per element); got {keep!r}."
        )
        raise GradOverrideError(msg)


def _check_int(recipe: str, name: str, value: object, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        msg = (
            f"{recipe}: `{name}` must be an integer from {low} to {high}; got "
            f"{type(value).__name__} {value!r}."
        )
        raise GradOverrideError(msg)
    return value


def _set(obj: object, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclasses: derived fields in __post_init__


# ---- rounding and sign ---------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class ste_round(Recipe):
    """Straight-through round: `torch.round(x)` forward, the upstream gradient backward.

    Formula: y = round(x), halves to even (0.5 -> 0, 1.5 -> 2, -0.5 -> -0), as `torch.round`;
    dL/dx = dL/dy. Matches brevitas `round_ste`.

    ```python
    import torch
    import gradoverride as go

    x = torch.tensor([0.4, 1.6], requires_grad=True)
    y = go.recipes.ste_round()(x)
    y.sum().backward()
    print(y.tolist(), x.grad.tolist())
    #> [0.0, 2.0] [1.0, 1.0]
    ```
    """

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x)
        _check_input(self, x)
        return _ste_round(x)


@dataclass(frozen=True, repr=False)
class ste_floor(Recipe):
    """Straight-through floor: y = floor(x); dL/dx = dL/dy. Matches brevitas `floor_ste`."""

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x)
        _check_input(self, x)
        return _ste_floor(x)


@dataclass(frozen=True, repr=False)
class ste_ceil(Recipe):
    """Straight-through ceil: y = ceil(x); dL/dx = dL/dy. Matches brevitas `ceil_ste`."""

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x)
        _check_input(self, x)
        return _ste_ceil(x)


@dataclass(frozen=True, repr=False)
class ste_sign(Recipe):
    """Straight-through sign: y = sign(x) with sign(0) = 0 (`torch.sign`); dL/dx = dL/dy.

    Three-valued, as brevitas `ternary_sign_ste`. For the two-valued sign of binary networks
    (0 -> +1) with a clipped window, use `binarize`.
    """

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x)
        _check_input(self, x)
        return _ste_sign(x)


# ---- clamp and binarize --------------------------------------------------------------------

Bound = float | Tensor
"""A bound of `ste_clamp`: a number, or a tensor broadcast against the input."""


def _check_ends(recipe: str, inclusive: object) -> Inclusive:
    return parse_inclusive(inclusive, recipe)


def _check_tensor_bound(name: str, value: Tensor) -> None:
    if not value.dtype.is_floating_point:
        msg = (
            f"ste_clamp: `{name}` as a tensor must be floating-point (it is compared with the "
            f"input in the input's dtype); got a {value.dtype} tensor. Convert it first: "
            f"`{name}.float()`."
        )
        raise GradOverrideTypeError(msg)


def _same(a: object, b: object) -> bool:
    """Equality of recipe fields, tensors by identity (their `==` is elementwise)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return a is b
    return a == b


@custom_backward
def _clamp_pass(x: Tensor, low: Tensor, high: Tensor, recipe: ste_clamp) -> Tensor:
    """Clamp to tensor bounds; backward the upstream gradient (the bounds get none)."""
    return torch.clamp(x, low, high)


@_clamp_pass.backward
def _(grad: Tensor) -> Any:
    return grad, None, None, None


@custom_backward
def _clamp_zero(x: Tensor, low: Tensor, high: Tensor, recipe: ste_clamp) -> Tensor:
    """Clamp to tensor bounds; backward the gradient inside them (keeps x and the bounds)."""
    return torch.clamp(x, low, high)


@_clamp_zero.backward
def _(grad: Tensor, *, x: Tensor, low: Tensor, high: Tensor, recipe: ste_clamp) -> Any:
    inside = _inside_tensor_bounds(x, low, high, recipe._ends)
    if torch.compiler.is_compiling():
        return grad * inside, None, None, None
    return torch.where(inside, grad, 0), None, None, None


@custom_backward
def _clamp_zero_closed(x: Tensor, low: Tensor, high: Tensor, recipe: ste_clamp) -> Tensor:
    """`_clamp_zero` with both ends inclusive: x is inside exactly where the clamp left it
    unchanged, so the rule needs x and the output only."""
    return torch.clamp(x, low, high)


@_clamp_zero_closed.backward
def _(grad: Tensor, *, x: Tensor, output: Tensor) -> Any:
    # output - x is 0 exactly where x is inside (a float difference is 0 only between equal
    # numbers); hardtanh_backward passes the gradient where it is strictly between the
    # nearest nonzero numbers, ±(the smallest subnormal): ~8x faster than comparing with
    # both bounds (bool kernels) and `where`.
    moved = output - x
    if torch.compiler.is_compiling() or moved.dtype not in _SMALLEST:
        return grad * (1 - torch.sign(moved.abs())), None, None, None
    tiny = _SMALLEST[moved.dtype]
    return torch.ops.aten.hardtanh_backward(grad, moved, -tiny, tiny), None, None, None


#: The smallest positive (subnormal) number of each floating dtype.
_SMALLEST = {
    dtype: float(torch.nextafter(torch.zeros((), dtype=dtype), torch.ones((), dtype=dtype)))
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
}


@custom_backward(residuals=("mask",))
def _clamp_zero_mask(x: Tensor, low: Tensor, high: Tensor, recipe: ste_clamp) -> Any:
    """As `_clamp_zero`, keeping a one-byte mask of the window instead."""
    inside = _inside_tensor_bounds(x, low, high, recipe._ends)
    y = torch.clamp(x, low, high)
    return y, {"mask": inside.to(torch.uint8)}


@_clamp_zero_mask.backward
def _(grad: Tensor, *, mask: Tensor) -> Any:
    return masked_gradient(grad, mask), None, None, None


def _inside_tensor_bounds(x: Tensor, low: Tensor, high: Tensor, ends: Inclusive) -> Tensor:
    """Where x is inside the window between tensor bounds: bool eagerly; 1.0 or 0.0 in x's
    dtype while compiling, written as arithmetic (see `_inside` in go.straight_through's
    module): each `sign(...)` is -1, 0 or 1 at a difference below, at or above 0."""
    if not torch.compiler.is_compiling():
        inside: Tensor = F.window_inside(TORCH, x, low, high, ends)
        return inside
    to_high = torch.sign(x - high)
    below = torch.sign(1 - to_high) if ends[1] else torch.relu(-to_high)
    to_low = torch.sign(x - low)
    above = torch.sign(to_low + 1) if ends[0] else torch.relu(to_low)
    return below * above


@dataclass(frozen=True, repr=False, eq=False)
class ste_clamp(Recipe):
    """Clamp to `[low, high]`, with the gradient outside the range chosen explicitly.

    Formula: y = min(max(x, low), high) (`torch.clamp`);
    `outside="pass"`: dL/dx = dL/dy everywhere (brevitas `scalar_clamp_ste`, and
    `tensor_clamp_ste` with tensor bounds);
    `outside="zero"`: dL/dx = dL/dy inside the window, else 0. With `inclusive=True` (the
    default) the window is low <= x <= high, the true gradient of `torch.clamp`, bounds
    included; with `inclusive=False` it is low < x < high, the gradient of
    `torch.nn.functional.hardtanh(x, low, high)` (0 at the bounds); a pair `(low_end,
    high_end)` chooses each end. There is no default for `outside`: libraries disagree and
    have changed it, so the choice is written at the call. `ste_clamp.preset(name, low,
    high)` gives each library's convention (see `CLAMP_PRESETS`).

    ```python
    import torch
    import gradoverride as go

    clip = go.recipes.ste_clamp(-1.0, 1.0, outside="zero")
    x = torch.tensor([-2.0, 0.5, 2.0], requires_grad=True)
    clip(x).sum().backward()
    print(clip(x).tolist(), x.grad.tolist())
    #> [-1.0, 0.5, 1.0] [0.0, 1.0, 0.0]
    ```

    Bounds may be tensors (per channel, say), broadcast against the input as `torch.clamp`
    broadcasts them and compared in the input's dtype (rounded to it, as number bounds are):
    `ste_clamp(low_t, high_t, outside="pass")(x)` is brevitas's `tensor_clamp_ste(x, low_t,
    high_t)`. The bounds get no gradient, as in brevitas (for the gradients `torch.clamp`
    gives tensor bounds, call `torch.clamp` itself). Where a tensor `low` exceeds `high` the
    output is `high`, as `torch.clamp` gives (brevitas gives `low`). Recipes with tensor
    bounds compare equal only when they hold the same tensor objects.
    """

    low: Bound
    high: Bound
    outside: Literal["pass", "zero"]
    inclusive: bool | tuple[bool, bool] = True
    keep: Keep = DEFAULT_KEEP
    _ends: Inclusive = field(init=False, repr=False, compare=False)
    _window: tuple[float, float] | None = field(init=False, repr=False, compare=False)
    _bounds: WindowBounds | None = field(init=False, repr=False, compare=False)
    _hardtanh: tuple[float, float] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _set(self, "_hardtanh", None)
        if self.outside not in ("pass", "zero"):
            msg = (
                f"ste_clamp: `outside` must be 'pass' (the gradient passes outside the range) "
                f"or 'zero' (zeroed outside, as torch.clamp); got {self.outside!r}."
            )
            raise GradOverrideError(msg)
        _check_keep(self, self.keep)
        ends = _check_ends("ste_clamp", self.inclusive)
        if isinstance(self.inclusive, list):  # hashable, as the recipe is
            _set(self, "inclusive", tuple(self.inclusive))
        _set(self, "_ends", ends)
        if _is_tensor(self.low) or _is_tensor(self.high):
            self._check_tensor_bounds()
            _set(self, "_window", None)
            _set(self, "_bounds", None)
            return
        window = parse_clip((self.low, self.high), "ste_clamp", "(low, high)")
        if self.outside == "zero":
            check_window(window, ends, "ste_clamp")
        _set(self, "_window", window)
        _set(self, "_bounds", window_bounds(window, ends) if self.outside == "zero" else None)
        if self.outside == "zero" and ends == (False, False) and self.keep == "input":
            # Exactly torch's hardtanh, forward and backward, at every value and in every
            # dtype (torch compares a half-precision input with the bound as given): its own
            # op is also the fastest form (no Function around it).
            _set(self, "_hardtanh", window)

    def _check_tensor_bounds(self) -> None:
        shapes = []
        for name in ("low", "high"):
            value = getattr(self, name)
            if isinstance(value, Tensor):
                _check_tensor_bound(name, value)
                shapes.append(value.shape)
            elif _is_tensor(value):  # a TensorFlow tensor or JAX array: checked when called
                shapes.append(torch.Size(value.shape))
            elif not _is_number(value) or value != value:
                msg = (
                    f"ste_clamp: `{name}` must be a number or a floating-point tensor; got "
                    f"{type(value).__name__} {value!r}."
                )
                raise GradOverrideTypeError(msg)
        if not _broadcastable(*shapes):
            msg = (
                "ste_clamp: the tensor bounds must broadcast together; got bounds of shapes "
                f"{[tuple(shape) for shape in shapes]}."
            )
            raise GradOverrideError(msg)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return all(
            _same(getattr(self, name), getattr(other, name))
            for name in ("low", "high", "outside", "inclusive", "keep")
        )

    def __hash__(self) -> int:
        return hash((type(self), self.low, self.high, self.outside, self.inclusive, self.keep))

    @classmethod
    def preset(
        cls, name: str, /, low: Bound, high: Bound, *, keep: Keep = DEFAULT_KEEP
    ) -> ste_clamp:
        """The `ste_clamp` with a library's gradient at and beyond the bounds:
        `ste_clamp.preset("torch.nn.functional.hardtanh", -1.0, 1.0)`. See `CLAMP_PRESETS`."""
        options = _lookup_preset("ste_clamp", _CLAMP_PRESETS, name)[0]
        return cls(low, high, keep=keep, **options)

    def _forward(self, x: Tensor) -> Tensor:
        result: Tensor = TORCH.clamp(x, self.low, self.high)
        return result

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x)
        _check_input(self, x)
        if self._window is None:
            return self._clamp_tensor_bounds(x)
        if self._hardtanh is not None and x.is_floating_point():
            return nn.functional.hardtanh(x, *self._hardtanh)
        return _windowed(x, self)

    def _clamp_tensor_bounds(self, x: Tensor) -> Tensor:
        low, high = self._bound_for("low", x), self._bound_for("high", x)
        shapes = [low.shape, high.shape]
        if not _broadcastable(x.shape, *shapes):
            msg = (
                f"{self!r}: the bounds must broadcast against the input; got an input of shape "
                f"{tuple(x.shape)} and bounds of shapes {[tuple(s) for s in shapes]}."
            )
            raise GradOverrideError(msg)
        if self.outside == "pass":
            op = _clamp_pass
        elif self.keep == "mask":
            op = _clamp_zero_mask
        else:
            op = _clamp_zero_closed if self._ends == (True, True) else _clamp_zero
        result: Tensor = op(x, low, high, self)
        return result

    def _bound_for(self, name: str, x: Tensor) -> Tensor:
        """A bound as a tensor in x's dtype (rounded to it) on x's device: a number too, so
        that a compiled float16 window compares with the rounded bound, as eager does."""
        value = getattr(self, name)
        if isinstance(value, Tensor):
            return value.to(device=x.device, dtype=x.dtype)
        if _is_number(value):
            return torch.full((), value, dtype=x.dtype, device=x.device)
        # What is left is a TensorFlow tensor or a JAX array (anything else was refused
        # when made).
        kind = "TensorFlow tensor" if foreign(value) == "tensorflow" else "JAX array"
        msg = (
            f"{self!r}: `{name}` is a {kind}, and the input a torch tensor; "
            f"give torch tensors (or numbers) as the bounds of a torch input."
        )
        raise GradOverrideTypeError(msg)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _broadcastable(*shapes: Sequence[int]) -> bool:
    """Whether the shapes broadcast together (each size, from the right, 1 or shared)."""
    for sizes in itertools.zip_longest(*(reversed(shape) for shape in shapes), fillvalue=1):
        if len({size for size in sizes if size != 1}) > 1:
            return False
    return True


def _is_tensor(value: object) -> bool:
    """A torch or TensorFlow tensor or a JAX array (a bound given as a tensor). A number is
    decided first: `foreign` reads the type's module name, which dynamo cannot trace."""
    if isinstance(value, Tensor):
        return True
    return not _is_number(value) and foreign(value) is not None


#: ste_clamp's presets: name -> (the options, what the library's clamp does).
_CLAMP_PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "torch.clamp": (
        {"outside": "zero", "inclusive": True},
        "torch.clamp(x, low, high): dL/dx = dL/dy where low <= x <= high, else 0",
    ),
    "torch.nn.functional.hardtanh": (
        {"outside": "zero", "inclusive": False},
        "torch.nn.functional.hardtanh(x, low, high): dL/dx = dL/dy where low < x < high, "
        "else 0",
    ),
    "brevitas.scalar_clamp_ste": (
        {"outside": "pass"},
        "brevitas.function.ops_ste.scalar_clamp_ste(x, low, high): dL/dx = dL/dy",
    ),
    "brevitas.tensor_clamp_ste": (
        {"outside": "pass"},
        "brevitas.function.ops_ste.tensor_clamp_ste(x, low, high), tensor bounds: dL/dx = "
        "dL/dy, no gradient to the bounds",
    ),
}

#: Each `ste_clamp.preset` name, with what the library's clamp does.
CLAMP_PRESETS: Mapping[str, str] = MappingProxyType(
    {name: entry[1] for name, entry in _CLAMP_PRESETS.items()}
)


def _lookup_preset(
    recipe: str, presets: dict[str, tuple[dict[str, Any], str]], name: object
) -> tuple[dict[str, Any], str]:
    entry = presets.get(name) if isinstance(name, str) else None
    if entry is None:
        msg = (
            f"{recipe}.preset: unknown preset {name!r}; the presets are "
            f"{', '.join(repr(n) for n in presets)}."
        )
        raise GradOverrideError(msg)
    return entry


def _binary_sign(x: Tensor) -> Tensor:
    # sign(sign(x) + 0.5): one fresh tensor and two in-place passes where that is safe,
    # ~8x faster than `torch.where(x >= 0, 1, -1)` on CPU.
    result: Tensor = F.binary_sign(TORCH, x)
    return result


@dataclass(frozen=True, repr=False)
class binarize(Recipe):
    """Binarize to ±1 with a windowed straight-through gradient.

    Formula: y = -1 if x < 0 else +1 (0 and NaN -> +1; BinaryConnect's deterministic
    binarization);
    dL/dx = dL/dy inside the window, else 0. With the defaults, `clip=1.0, inclusive=True`,
    the window is -1 <= x <= 1, both ends included: the `1{|x| <= 1}` of Courbariaux et al.
    (2016) and larq's `ste_sign`. `inclusive=False` leaves the ends out, -1 < x < 1: the
    gradient of torch's `hardtanh` (0 at exactly ±1) and XNOR-Net's code (Rastegari et
    al., 2016; the scaling factor is not applied); a pair `(low_end, high_end)` chooses each
    end. `clip` is a bound c (the window [-c, c]) or a pair (low, high); `clip=None` passes
    the gradient everywhere (brevitas `binary_sign_ste`). `binarize.preset(name)` gives each
    library's convention (see `BINARIZE_PRESETS`).

    ```python
    import torch
    import gradoverride as go

    weight = torch.tensor([-1.5, -0.2, 0.0, 0.7], requires_grad=True)
    w_b = go.recipes.binarize()(weight)
    w_b.sum().backward()
    print(w_b.tolist(), weight.grad.tolist())
    #> [-1.0, -1.0, 1.0, 1.0] [0.0, 1.0, 1.0, 1.0]
    ```
    """

    clip: float | tuple[float, float] | None = 1.0
    inclusive: bool | tuple[bool, bool] = True
    keep: Keep = DEFAULT_KEEP
    _ends: Inclusive = field(init=False, repr=False, compare=False)
    _window: tuple[float, float] | None = field(init=False, repr=False, compare=False)
    _bounds: WindowBounds | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_keep(self, self.keep)
        ends = _check_ends("binarize", self.inclusive)
        if isinstance(self.inclusive, list):  # hashable, as the recipe is
            _set(self, "inclusive", tuple(self.inclusive))
        if isinstance(self.clip, list):
            _set(self, "clip", tuple(self.clip))
        _set(self, "_ends", ends)
        window = None if self.clip is None else parse_clip(self.clip, "binarize")
        if window is not None:
            check_window(window, ends, "binarize")
        _set(self, "_window", window)
        _set(self, "_bounds", None if window is None else window_bounds(window, ends))

    @classmethod
    def preset(cls, name: str, /, *, keep: Keep = DEFAULT_KEEP) -> binarize:
        """The `binarize` with a library's window: `binarize.preset("xnor_net")`. See
        `BINARIZE_PRESETS`."""
        options = _lookup_preset("binarize", _BINARIZE_PRESETS, name)[0]
        return cls(keep=keep, **options)

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x)
        _check_input(self, x)
        return _windowed(x, self)

    def _forward(self, x: Tensor) -> Tensor:
        return _binary_sign(x)


#: binarize's presets: name -> (the options, what the library's binarization does).
_BINARIZE_PRESETS: dict[str, tuple[dict[str, Any], str]] = {
    "binarynet": (
        {"clip": 1.0, "inclusive": True},
        "Courbariaux et al. (2016), BinaryNet: y = +1 if x >= 0 else -1; dL/dx = dL/dy "
        "where |x| <= 1",
    ),
    "larq.ste_sign": (
        {"clip": 1.0, "inclusive": True},
        "larq.quantizers.ste_sign(clip_value=1.0): y = +1 if x >= 0 else -1; dL/dx = dL/dy "
        "where |x| <= 1",
    ),
    "xnor_net": (
        {"clip": 1.0, "inclusive": False},
        "XNOR-Net (Rastegari et al. 2016), its PyTorch code's BinActive: dL/dx = dL/dy "
        "where |x| < 1 (its forward, torch.sign, gives 0 at 0; binarize gives +1)",
    ),
    "brevitas.binary_sign_ste": (
        {"clip": None},
        "brevitas.function.ops_ste.binary_sign_ste: y = +1 if x >= 0 else -1; dL/dx = dL/dy",
    ),
}

#: Each `binarize.preset` name, with what the library's binarization does.
BINARIZE_PRESETS: Mapping[str, str] = MappingProxyType(
    {name: entry[1] for name, entry in _BINARIZE_PRESETS.items()}
)


# ---- abs with a chosen subgradient at 0 ----------------------------------------------------


@custom_backward
def _abs(x: Tensor, recipe: abs_subgradient) -> Tensor:
    return torch.abs(x)


@_abs.backward
def _(grad: Tensor, *, x: Tensor, recipe: abs_subgradient) -> Tensor:
    return grad * recipe._slope(x)


@dataclass(frozen=True, repr=False)
class abs_subgradient(Recipe):
    """Absolute value with a chosen subgradient at 0.

    Formula: y = |x|; dL/dx = dL/dy * s(x) with s(x) = sign(x) for x != 0 and
    s(0) = s(-0) = `at_zero`. The default, `at_zero=1.0`, is brevitas's
    `abs_binary_sign_grad` (the binary sign, +1 at 0, so a scale or weight at exactly 0
    still gets a gradient); `at_zero=0.0` is torch's own `abs`. The gradient at a NaN input
    is not specified. Keeps the input for backward (as torch's `abs` does).

    ```python
    import torch
    import gradoverride as go

    scale = torch.tensor([-2.0, 0.0, 3.0], requires_grad=True)
    magnitude = go.recipes.abs_subgradient()(scale)
    magnitude.sum().backward()
    print(magnitude.tolist(), scale.grad.tolist())  # +1 at 0, as brevitas gives it
    #> [2.0, 0.0, 3.0] [-1.0, 1.0, 1.0]
    ```
    """

    at_zero: float = 1.0

    def __post_init__(self) -> None:
        if not _is_number(self.at_zero) or not finite(self.at_zero):
            msg = (
                "abs_subgradient: `at_zero` must be a finite number (the subgradient at 0, "
                f"1.0 as brevitas's abs_binary_sign_grad); got {type(self.at_zero).__name__} "
                f"{self.at_zero!r}."
            )
            raise GradOverrideError(msg)

    def _slope(self, x: Tensor) -> Tensor:
        """s(x): sign(x), `at_zero` at ±0, in x's dtype."""
        result: Tensor = F.slope(TORCH, x, self.at_zero)
        return result

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x)
        _check_input(self, x)
        result: Tensor = _abs(x, self)
        return result


# ---- ternarize -----------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class ternarize(Recipe):
    """Ternarize as in Ternary Weight Networks (Li, Zhang & Liu, 2016).

    Formula: threshold delta = delta_factor * mean(|x|) (0.7 in the paper), over the whole
    tensor; t = sign(x) where |x| > delta, else 0 (|x| == delta gives 0); with `scaled=True`
    the output is alpha * t where alpha = mean(|x_i|) over the i with |x_i| > delta (0 when
    there are none), TWN's W = alpha * T. delta and alpha are constants for the gradient:
    dL/dx = dL/dy (straight-through).
    """

    delta_factor: float = 0.7
    scaled: bool = True

    def __post_init__(self) -> None:
        if (
            not isinstance(self.delta_factor, (int, float))
            or isinstance(self.delta_factor, bool)
            or not finite(self.delta_factor)
            or self.delta_factor < 0
        ):
            msg = (
                "ternarize: `delta_factor` must be a finite number >= 0 (TWN uses 0.7); got "
                f"{self.delta_factor!r}."
            )
            raise GradOverrideError(msg)

    def _forward(self, x: Tensor) -> Tensor:
        if not is_tracing() and x.numel() == 0:  # (see quantize's)
            return x.clone()
        result: Tensor = F.ternary(TORCH, x, self.delta_factor, self.scaled)
        return result

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x)
        _check_input(self, x)
        return _ste(x, self._forward)


# ---- uniform n-bit quantize ----------------------------------------------------------------


@custom_backward
def _quantize(x: Tensor, recipe: quantize) -> Tensor:
    return recipe._forward(x)[0]


@_quantize.backward
def _(grad: Tensor, *, x: Tensor, recipe: quantize) -> Tensor:
    return grad.masked_fill(recipe._outside(x), 0)


@custom_backward(residuals=("outside",))
def _quantize_mask(x: Tensor, recipe: quantize) -> Any:
    out, outside = recipe._forward(x, mask=True)
    return out, {"outside": outside}


@_quantize_mask.backward
def _(grad: Tensor, *, outside: Tensor) -> Tensor:
    return grad.masked_fill(outside, 0)


@dataclass(frozen=True, repr=False)
class quantize(Recipe):
    """Uniform n-bit fake quantization with a straight-through gradient.

    Formula, with scale s and zero point z:
    `q = round(x / s) + z`, `y = (clamp(q, qmin, qmax) - z) * s` (round halves to even);
    dL/dx = dL/dy where qmin <= q <= qmax, else 0: PyTorch's
    `fake_quantize_per_tensor_affine` convention (the rounded code decides).

    * `symmetric=True` (default): z = 0, codes -(2^(b-1) - 1) .. 2^(b-1) - 1 (the narrow,
      zero-centred range: [-127, 127] for 8 bits), s = B / (2^(b-1) - 1) with
      B = `bound`, or max|x| when `bound` is None (1 when x is all zero).
    * `symmetric=False`: codes 0 .. 2^b - 1, s = (hi - lo) / (2^b - 1),
      z = clamp(round(-lo / s), 0, 2^b - 1) with (lo, hi) = (min(low, 0), max(high, 0))
      for `bound=(low, high)`, or (min(min x, 0), max(max x, 0)) when None: either way the
      range includes 0, so that 0 is exactly representable (as PyTorch's observers do).

    A range taken from x is a constant for the gradient. Codes are computed in float32 for
    float16/bfloat16 inputs (which cannot hold every code: 65535 > float16's max), otherwise
    in the input's dtype; the output has the input's dtype.

    Export: `torch.export` and `torch.onnx.export` (either exporter) record a float32 input
    on a grid of 8 bits or fewer as torch's `fake_quantize_per_tensor_affine`, written to
    ONNX as QuantizeLinear -> DequantizeLinear (int8 for `symmetric=True`, uint8 for
    `symmetric=False`), which int8 runtimes run on integers; a grid narrower than its 8-bit
    type (the symmetric [-127, 127], fewer bits) first clips the input to the grid's ends
    (a Clip node). onnxruntime then gives the eager values exactly. 9 to 16 bits, and other
    dtypes, export as the formula above (Div, Round, Clip, Mul). Eager calls,
    `torch.compile` and `torch.jit.trace` keep the formula, bit for bit: torch's
    fake-quantize kernel rounds x * (1/s), which differs from round(x / s) at a few inputs
    within some ulps of a tie, so an `ExportedProgram` run in torch can differ there by one
    step s.
    """

    bits: int = 8
    symmetric: bool = True
    bound: float | tuple[float, float] | None = None
    keep: Keep = DEFAULT_KEEP
    _codes: tuple[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        low_bits = 2 if self.symmetric else 1
        bits = _check_int("quantize", "bits", self.bits, low_bits, 16)
        _check_keep(self, self.keep)
        if self.symmetric:
            qmax = 2 ** (bits - 1) - 1
            _set(self, "_codes", (-qmax, qmax))
            if self.bound is not None:
                if isinstance(self.bound, tuple):
                    msg = (
                        f"quantize(symmetric=True): `bound` is one number B for the range "
                        f"[-B, B]; got the pair {self.bound!r}. Pass `bound={self.bound[1]!r}`"
                        ", or `symmetric=False` for an asymmetric (low, high) range."
                    )
                    raise GradOverrideError(msg)
                positive_number("quantize", "bound", self.bound)
        else:
            _set(self, "_codes", (0, 2**bits - 1))
            if self.bound is not None:
                pair = self.bound
                if not (
                    isinstance(pair, tuple)
                    and len(pair) == 2
                    and all(isinstance(v, (int, float)) and finite(v) for v in pair)
                    and pair[0] < pair[1]
                ):
                    msg = (
                        "quantize(symmetric=False): `bound` must be a pair (low, high) of "
                        f"finite numbers with low < high; got {pair!r}."
                    )
                    raise GradOverrideError(msg)

    def scale_and_zero_point(self, x: Tensor) -> tuple[Tensor | float, Tensor | float]:
        """The scale s and zero point z used for `x`."""
        result: tuple[Tensor | float, Tensor | float] = F.scale_and_zero_point(
            TORCH, x.detach(), self._codes, self.symmetric, self.bound
        )
        return result

    def _codes_of(self, x: Tensor) -> tuple[Tensor, Tensor | float, Tensor | float]:
        result: tuple[Tensor, Tensor | float, Tensor | float] = F.codes(
            TORCH, x, self._codes, self.symmetric, self.bound
        )
        return result

    def _outside(self, x: Tensor) -> Tensor:
        """Where the code round(x / s) + z is outside [qmin, qmax]."""
        if x.numel() == 0:
            return torch.zeros_like(x, dtype=torch.bool)
        result: Tensor = F.codes_outside(TORCH, self._codes_of(x)[0], self._codes)
        return result

    def _forward(self, x: Tensor, *, mask: bool = False) -> tuple[Tensor, Tensor | None]:
        """(y, outside): the quantized value, and where the code was clamped (if `mask`)."""
        qmin, qmax = self._codes
        if x.dtype == torch.float32 and int8_range(qmin, qmax) is not None and exporting():
            # The exporter's view: QuantizeLinear/DequantizeLinear where the grid fits int8
            # or uint8 (see `_int8_export`). Before the size check, which the TorchScript-based
            # exporter would trace and warn about; the mask is for backward, which no export
            # keeps.
            s, z = self.scale_and_zero_point(x)
            y8 = fake_quantize(x, s, z, qmin, qmax)
            if y8 is not None:
                q = self._codes_of(x)[0] if mask else None
                return y8, None if q is None else F.codes_outside(TORCH, q, self._codes)
        # (Not while tracing: a traced size is a tensor, and a graph is recorded for the
        # non-empty input it was traced with.)
        if not is_tracing() and x.numel() == 0:
            return x.clone(), torch.zeros_like(x, dtype=torch.bool) if mask else None
        q, s, z = self._codes_of(x)
        outside = F.codes_outside(TORCH, q, self._codes) if mask else None
        return F.dequantize(TORCH, q, s, z, self._codes, x.dtype), outside

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x)
        _check_input(self, x)
        if self.keep == "mask":
            result: Tensor = _quantize_mask(x, self)
            return result
        return _quantize(x, self)


# ---- LSQ -----------------------------------------------------------------------------------


_LSQ_WINDOWS = ("open", "closed", "rounded")


@custom_backward
def _lsq(x: Tensor, step: Tensor, recipe: lsq) -> Tensor:
    qn, qp = recipe.code_range
    if exporting() and step.dtype == x.dtype:
        y8 = fake_quantize(x, step, 0.0, -qn, qp)  # QuantizeLinear/DequantizeLinear
        if y8 is not None:
            return y8
    result: Tensor = F.lsq_forward(TORCH, x, step, recipe.code_range)
    return result


@_lsq.backward
def _(grad: Tensor, *, x: Tensor, step: Tensor, recipe: lsq) -> Any:
    g = F.grad_scale(TORCH, x, recipe.code_range, recipe.grad_scale)
    # Esser et al. (2020), eq. 3 (the step's gradient is summed to its shape by the op).
    grad_x, grad_step = F.lsq_gradients(TORCH, grad, x, step, recipe.code_range,
                                        recipe.window, g)
    return {"x": grad_x, "step": grad_step}


@dataclass(frozen=True, repr=False)
class lsq(Recipe):
    """Learned Step Size Quantization (Esser et al., ICLR 2020): `lsq(bits)(x, step)`.

    Formula, with v = x / s, codes -Qn .. Qp (signed: Qn = 2^(b-1), Qp = 2^(b-1) - 1;
    unsigned: Qn = 0, Qp = 2^b - 1):
    y = round(clamp(v, -Qn, Qp)) * s;
    dL/dx = dL/dy where -Qn < v < Qp, else 0;
    dL/ds = sum(dL/dy * d) * g, with d = round(v) - v where -Qn < v < Qp, -Qn where
    v <= -Qn and Qp where v >= Qp (the paper's eq. 3), and the gradient scale
    g = 1/sqrt(N * Qp), N = x.numel() (the paper's choice for weights; pass `grad_scale`
    for activations, where N is the number of features). A `step` with a broadcastable
    shape (per channel) gets its gradient summed to its shape.

    `window` says where v counts as inside the code range, the one place public LSQ code
    differs (the forward is the same in all three):

    * `"open"` (default), the paper's eq. 3: -Qn < v < Qp; at v = Qp exactly the step gets
      Qp and x nothing.
    * `"closed"`: -Qn <= v <= Qp, what `round_pass(clamp(x / s, -Qn, Qp)) * s` gives by
      autograd (the common hand-written LSQ, as in the authors' later code and most ports).
    * `"rounded"`: -Qn <= round(v) <= Qp (halves to even), torch.ao's
      `_LearnableFakeQuantize` (`torch._fake_quantize_learnable_per_tensor_affine`) and
      `recipes.quantize`'s convention: at v = 7.3 with Qp = 7, x gets its gradient and the
      step round(v) - v. Port a torch.ao LSQ model with `window="rounded"` and
      `grad_scale=1.0` (torch's `use_grad_scaling=False`; with it, torch's factor is this
      recipe's default 1/sqrt(N * Qp)).

    `lsq(bits).module()` is an `nn.Module` holding `step` as a parameter, initialised from
    the first input as 2 * mean(|x|) / sqrt(Qp) (the paper's initialisation; floored at the
    dtype's smallest normal number, so an all-zero first input does not give step 0).
    Exporting or tracing that module before its first call is refused (the graph would
    compute the step from every input): call it once on representative data, load a
    trained state_dict, or give `module(step=...)`.

    Export: as `quantize`'s, a float32 input with a float32 step on a grid of 8 bits or
    fewer exports as torch's fake-quantize op, QuantizeLinear -> DequantizeLinear in ONNX
    (int8 for `signed=True`, uint8 otherwise; per channel where `step` has one axis of
    x's size, as `step` of shape (C, 1) for a (C, K) weight); fewer than 8 bits first clip
    the input to the grid's ends; 9 to 16 bits export as the formula.
    """

    bits: int = 8
    signed: bool = True
    grad_scale: float | None = None
    window: str = "open"
    code_range: tuple[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        bits = _check_int("lsq", "bits", self.bits, 2 if self.signed else 1, 16)
        if self.window not in _LSQ_WINDOWS:
            msg = (
                f"lsq got window={self.window!r}; expected one of "
                f"{', '.join(repr(w) for w in _LSQ_WINDOWS)}: 'open' (the paper), 'closed' "
                "(clamp then round by autograd), 'rounded' (torch.ao's fake quantize)."
            )
            raise GradOverrideError(msg)
        if self.grad_scale is not None:
            positive_number("lsq", "grad_scale", self.grad_scale)
        if self.signed:
            _set(self, "code_range", (2 ** (bits - 1), 2 ** (bits - 1) - 1))
        else:
            _set(self, "code_range", (0, 2**bits - 1))

    def __call__(self, x: Tensor, step: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x, step)
        _check_input(self, x)
        if not isinstance(step, Tensor):
            msg = (
                f"{self!r}: `step` must be a tensor (a learnable parameter), got "
                f"{type(step).__name__} {step!r}; use `lsq(...).module()` to hold it."
            )
            raise GradOverrideTypeError(msg)
        _check_input(self, step, "step")
        return _lsq(x, step, self)

    def init_step(self, x: Tensor) -> Tensor:
        """The paper's initial step for `x`: 2 * mean(|x|) / sqrt(Qp), floored at the dtype's
        smallest normal number so an all-zero first input (a zero-initialised weight, an
        all-zero ReLU batch) does not give step 0, which makes x / step NaN for good."""
        _check_input(self, x)
        step = 2 * x.detach().abs().mean() / math.sqrt(self.code_range[1])
        return step.clamp_min(torch.finfo(x.dtype).tiny)

    def module(self, step: float | None = None) -> LearnedStepQuantizer:  # type: ignore[override]
        """An `nn.Module` with a learnable `step` (from the first input when None)."""
        return LearnedStepQuantizer(self, step)


class LearnedStepQuantizer(nn.Module):
    """The `nn.Module` form of `lsq`: `forward(x)` is `recipe(x, self.step)`."""

    def __init__(self, recipe: lsq, step: float | None = None) -> None:
        super().__init__()
        self.recipe = recipe
        self.step = nn.Parameter(torch.tensor(1.0 if step is None else float(step)))
        self._needs_init = step is None

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script calls this on every module it scripts.
        refuse_scripting(f"the module form of {self.recipe!r}")

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return array_call(self, x)
        _check_input(self.recipe, x)
        if self._needs_init and (exporting() or is_tracing()):
            self._refuse_uninitialised_export()
        if self._needs_init:
            with torch.no_grad():
                self.step.copy_(self.recipe.init_step(x))
            self._needs_init = False
        return self.recipe(x, self.step)

    def _refuse_uninitialised_export(self) -> None:
        # Recorded now, the first-call initialisation would become part of the graph: the
        # step worked out again from every input the exported model is given.
        msg = (
            f"{self.recipe!r}.module(): `step` is not initialised yet (it is set from the "
            "first input, 2 * mean(|x|) / sqrt(Qp)), so an export or trace now would record "
            "that initialisation into the graph. Call the module once on representative data "
            "before exporting, load a trained state_dict, or give the initial step: "
            f"`{self.recipe!r}.module(step=...)`."
        )
        raise GradOverrideError(msg)

    def _load_from_state_dict(
        self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if prefix + "step" in state_dict:
            # A loaded step is kept, not re-initialised; a checkpoint without one (a float
            # model's, loaded with strict=False) leaves it to the first input.
            self._needs_init = False

    def extra_repr(self) -> str:
        return repr(self.recipe)
