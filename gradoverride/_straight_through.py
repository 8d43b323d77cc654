"""`straight_through`: a non-differentiable forward with a chosen backward.

Built on `custom_backward`: each form is a generated rule registered on the user's forward,
so it has the same composition (`torch.compile(fullgraph=True)`, `torch.func`, autocast,
CUDA) and the same `nn.Module` form.

Measured choices (see `benchmarks/ste.py`; figures at 4096x4096 float32, one CPU thread):

* identity: the rule names nothing, so nothing is saved, and it returns the upstream
  gradient itself (no copy): 0.32x the time of `x + (f(x) - x).detach()`;
* clip, keeping the input (the default): the eager backward is one `aten.hardtanh_backward`
  kernel with the bounds moved one step outwards in the input's dtype (it tests
  `low < x < high`), so the window is inclusive; it reads the input and the gradient and
  writes the result, with no temporary. `torch.where(mask, grad, 0)` needs the mask as a
  temporary and ran ~2x slower; `grad * mask` also converts the mask to the gradient's dtype
  (a full-size temporary: 208 vs 144 MiB peak);
* clip, keeping a mask: the forward stores one byte per element (1 where the input is inside
  the window) and the backward zeroes the gradient elsewhere: 80 instead of 128 MiB held
  between forward and backward when the input is an activation. Eagerly on the CPU both are
  computed block by block (see `window_mask`), at ~1.2x the time of keeping the input; the
  comparison ops they replace write bool tensors through a slow path and ran at 2.7x;
* compiled, both windows are arithmetic rather than comparisons (see `window_gradient`).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, Literal, TypeVar, overload

import torch
from torch import Tensor
from typing_extensions import ParamSpec

from ._backends import backend
from ._decorators import CustomBackward, custom_backward
from ._errors import GradOverrideError, GradOverrideTypeError
from ._frameworks import autograph_artifact, is_jax
from ._internals import is_tracing, transforms_active

__all__ = [
    "DEFAULT_KEEP",
    "INCLUSIVE",
    "Bounds",
    "Inclusive",
    "Keep",
    "WindowBounds",
    "check_window",
    "masked_gradient",
    "parse_clip",
    "parse_inclusive",
    "rounded",
    "straight_through",
    "window_bounds",
    "window_gradient",
    "window_mask",
]

P = ParamSpec("P")
R = TypeVar("R")

Keep = Literal["input", "mask"]

#: What a clipped straight-through keeps for backward unless told otherwise: the input. It
#: costs no memory when the input stays alive anyway (a weight, or an activation another
#: layer keeps), and the forward then does no extra work; `keep="mask"` stores one byte
#: per element instead, for inputs that would otherwise be freed.
DEFAULT_KEEP: Keep = "input"

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


# ---- the clip window ------------------------------------------------------------------------


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_clip(clip: object, where: str, argument: str = "clip") -> tuple[float, float]:
    """The window `(low, high)` from `clip`: a bound `c` (the window [-c, c]) or a pair."""
    if _is_real(clip):
        bound = float(clip)  # type: ignore[arg-type]
        if bound != bound or bound < 0:  # (NaN: not `math.isnan`, see `window_bounds`)
            msg = (
                f"{where}: `{argument}` must be a bound c >= 0 (the window [-c, c]) or a "
                f"pair (low, high); got {clip!r}. Pass a non-negative number, e.g. "
                f"`{argument}=1.0`."
            )
            raise GradOverrideError(msg)
        return (-bound, bound)
    if isinstance(clip, (tuple, list)) and len(clip) == 2 and all(map(_is_real, clip)):
        low, high = float(clip[0]), float(clip[1])
        if low != low or high != high or low > high:
            msg = (
                f"{where}: `{argument}` as a pair must be (low, high) with low <= high; "
                f"got {tuple(clip)!r}. Swap the bounds or pass a single bound c for [-c, c]."
            )
            raise GradOverrideError(msg)
        return (low, high)
    msg = (
        f"{where}: `{argument}` must be a number c (the window [-c, c]) or a pair "
        f"(low, high) of numbers; got {type(clip).__name__} {clip!r}."
    )
    raise GradOverrideTypeError(msg)


Inclusive = tuple[bool, bool]
"""Whether each end of a window, (low, high), belongs to it."""

#: Both ends inclusive: `low <= x <= high` (Courbariaux et al.'s `1{|x| <= 1}`, larq).
INCLUSIVE: Inclusive = (True, True)


def parse_inclusive(inclusive: object, where: str) -> Inclusive:
    """`(low_end, high_end)` from `inclusive`: a bool for both ends, or a pair of bools."""
    if isinstance(inclusive, bool):
        return (inclusive, inclusive)
    if (
        isinstance(inclusive, (tuple, list))
        and len(inclusive) == 2
        and all(isinstance(end, bool) for end in inclusive)
    ):
        return (inclusive[0], inclusive[1])
    msg = (
        f"{where}: `inclusive` must be True (both ends belong to the window, low <= x <= "
        f"high), False (neither: low < x < high) or a pair of bools (low end, high end); "
        f"got {type(inclusive).__name__} {inclusive!r}."
    )
    raise GradOverrideTypeError(msg)


def check_window(window: tuple[float, float], inclusive: Inclusive, where: str) -> None:
    """Refuse a window with no point in it: (c, c) with an end left out."""
    low, high = window
    if low == high and inclusive != INCLUSIVE:
        msg = (
            f"{where}: the window ({low!r}, {high!r}) with inclusive={inclusive!r} is empty, "
            "so no gradient would pass anywhere; widen the window or make both ends "
            "inclusive."
        )
        raise GradOverrideError(msg)


def _inclusive_repr(inclusive: Inclusive) -> str:
    return repr(inclusive[0]) if inclusive[0] == inclusive[1] else repr(inclusive)


# The window reaches the functions below as `WindowBounds` (`window_bounds`), a dict of plain
# floats rather than an object: dynamo cannot wrap a user object met in a closure while it
# speculates a Function's forward or backward. Everything that depends on the bounds' values
# is decided when the op or recipe is built, not while tracing: under dynamic shapes dynamo
# may trace each bound as a symbolic float, known only when the graph runs, so nothing can
# round it at trace time, and comparing two such floats (`low == -high`) makes dynamo
# specialise them and restart its analysis, over and over (torch 2.13).
#
# Eager and compiled code use different forms of the same window, each the fastest measured
# (benchmarks/ste.py). Eager: one `hardtanh_backward` kernel, or a bool mask. Compiled: the
# window as arithmetic, sign(1 - sign(x - high)) (1 inside, bounds included; 0 outside),
# because Inductor's CPU kernels that write bool tensors ran ~3x slower than eager, and a
# comparison in the backward let the partitioner save a bool mask in place of the input
# (the arithmetic form took 0.25x the time of `torch.where` at 4096x4096; the symmetric
# form, on |x|, ~5% less than testing both bounds).

Bounds = tuple[float | None, float]
"""A window's bounds `(low, high)`; `low` is None for the symmetric window [-high, high]."""

WindowBounds = dict[torch.dtype | None, Bounds]
"""A window's bounds rounded to each floating dtype (key None: as given, for other dtypes)."""

_ROUNDED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def window_bounds(window: tuple[float, float], inclusive: Inclusive = INCLUSIVE) -> WindowBounds:
    """The window `(low, high)` as the functions below take it: its bounds rounded to each
    floating dtype, as eager mode's `x <= high` rounds them, so that comparing an input with
    them needs no rounding. Inductor computes float16 and bfloat16 arithmetic in float32 and
    would otherwise compare with the bound unrounded, putting an input equal to the rounded
    bound (0.3 rounds up in float16) outside the window.

    An end left out of the window (`inclusive`) is moved one step inwards in each dtype
    after rounding: `x < high` is `x <= nextafter(high, -inf)` for every x of that dtype, so
    every form below tests an inclusive window and keeps its speed."""
    low, high = window
    if inclusive == INCLUSIVE:
        given: Bounds = (None, high) if low == -high else (low, high)
    else:  # as float64 compares them: the closest to "as given" a moved bound can be
        given = _symmetric(*_moved_in(low, high, inclusive, torch.float64))
    bounds: WindowBounds = {None: given}
    for dtype in _ROUNDED_DTYPES:
        moved = _moved_in(rounded(low, dtype), rounded(high, dtype), inclusive, dtype)
        bounds[dtype] = _symmetric(*moved)
    return bounds


def _symmetric(low: float, high: float) -> Bounds:
    return (None, high) if low == -high else (low, high)


def _moved_in(
    low: float, high: float, inclusive: Inclusive, dtype: torch.dtype
) -> tuple[float, float]:
    """`(low, high)` with each end that is left out moved to its inner neighbour in `dtype`."""
    if not inclusive[0]:
        low = _step(low, math.inf, dtype)
    if not inclusive[1]:
        high = _step(high, -math.inf, dtype)
    return low, high


def _step(value: float, towards: float, dtype: torch.dtype) -> float:
    """The neighbour of `value` (a number of `dtype`) in `dtype`, towards `towards`."""
    step = torch.nextafter(torch.tensor(value, dtype=dtype), torch.tensor(towards, dtype=dtype))
    return float(step.item())


def rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` (through float32 for narrower dtypes, as torch converts a
    Python number), as a Python float."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).item())


def _bounds_for(bounds: WindowBounds, dtype: torch.dtype) -> Bounds:
    return bounds.get(dtype) or bounds[None]


def window_gradient(grad: Tensor, x: Tensor, bounds: WindowBounds) -> Tensor:
    """`grad` inside the window (`window_bounds`), zero outside. The gradient at a NaN input
    is not specified: torch's `hardtanh_backward` gives 0 or the upstream gradient depending
    on where the element falls in its vectorized loop (the input is NaN either way)."""
    low, high = _bounds_for(bounds, x.dtype)
    if torch.compiler.is_compiling():
        return grad * _inside(x, low, high)
    if grad.dtype == x.dtype:
        open_bounds = _open_bounds(-high if low is None else low, high, x.dtype)
        if open_bounds is not None:
            result: Tensor = torch.ops.aten.hardtanh_backward(grad, x, *open_bounds)
            return result
    return torch.where(_outside(x, low, high), 0, grad)


def _outside(x: Tensor, low: float | None, high: float) -> Tensor:
    if low is None:
        return x.abs() > high
    return (x < low) | (x > high)


def _inside(x: Tensor, low: float | None, high: float) -> Tensor:
    """1 where x is inside the window, else 0, in x's dtype, without comparisons.

    Each bound is subtracted from a tensor (`x - high`, not `high - x`): dynamo turns a
    symbolic float into a tensor for `tensor - float`, and for `float - tensor` specialises
    it and restarts its analysis."""
    if low is None:
        return torch.sign(1 - torch.sign(x.abs() - high))
    inside = torch.sign(1 - torch.sign(x - high))
    if low > -math.inf:  # not `math.isinf`, which dynamo cannot apply to a symbolic float
        inside = inside * torch.sign(torch.sign(x - low) + 1)
    return inside


# ---- keep="mask": one byte per element ----------------------------------------------------
#
# The mask is a uint8 tensor, 1 where the input is inside the window and 0 outside, in every
# mode. While compiling it is the arithmetic window converted to bytes (Inductor fuses it).
# Eagerly, torch's comparison ops write bool tensors through a slow path on the CPU (1.4 ns
# per element for `x > c`, 0.24 for `hardtanh_backward`), and `masked_fill` and `where`
# with a bool mask are slower still (5 and 4 ns): keep="mask" built on them took 2.7x the
# time of keep="input" at 4096x4096. So both ends are written with `hardtanh_backward`, the
# kernel keep="input" uses:
#
# * forward: `hardtanh_backward(marker, x, low, high)` selects `marker` inside the window and
#   0 outside, bit for bit; `marker` is a number whose bits' low byte is 1, so narrowing its
#   bits to a byte (an integer copy, 0.1 ns per element) gives the mask;
# * backward: the mask as the gradient's dtype (1.0 or 0.0) in place of the input, tested
#   against the window (0.5, 1.5): the gradient inside, +0 outside, exactly what keep="input"
#   gives, an infinite upstream gradient outside included (`grad * mask` would make it NaN).
#
# On the CPU the float temporary of each step is made block by block (`_BLOCK` elements),
# so it stays in cache instead of being a full-size tensor written to memory and read back.

#: Elements per block of the eager CPU mask: the float temporary (1 MiB in float32) stays in
#: cache, and the loop's Python costs < 1 ms at 4096x4096 (2^16 to 2^19 measured: 2^18 and
#: 2^19 fastest).
_BLOCK = 1 << 18

_HARDTANH_BACKWARD: Any = torch.ops.aten.hardtanh_backward.default
_HARDTANH_BACKWARD_OUT: Any = torch.ops.aten.hardtanh_backward.grad_input

#: For each floating dtype: the integer dtype of its size (to read its bits), and the marker.
_BITS: dict[torch.dtype, torch.dtype] = {
    torch.float16: torch.int16, torch.bfloat16: torch.int16,
    torch.float32: torch.int32, torch.float64: torch.int64,
}


@functools.lru_cache(maxsize=8)
def _marker(dtype: torch.dtype) -> Tensor:
    """A normal number of `dtype` whose bits' low byte is 1: 1.0's bits with the low byte set
    to 1 (1.0000001 in float32, 0.50390625 in bfloat16). Normal, so that flushing denormals
    to zero cannot change it."""
    bits = torch.ones((), dtype=dtype).view(_BITS[dtype])
    return ((bits & ~0xFF) | 1).view(dtype)


def window_mask(x: Tensor, bounds: WindowBounds) -> Tensor:
    """What `keep="mask"` saves, one byte per element: 1 where x is inside the window, 0
    outside (uint8)."""
    low, high = _bounds_for(bounds, x.dtype)
    if torch.compiler.is_compiling():
        return _inside(x, low, high).to(torch.uint8)
    open_bounds = None
    if x.dtype in _BITS and not transforms_active():
        open_bounds = _open_bounds(-high if low is None else low, high, x.dtype)
    if open_bounds is None:  # a transform's wrapped tensors, an infinite bound, ...
        return (~_outside(x, low, high)).to(torch.uint8)
    marker = _marker(x.dtype).to(x.device)
    if not _blockwise(x):
        picked: Tensor = _HARDTANH_BACKWARD(marker.expand(x.shape), x, *open_bounds)
        return picked.view(_BITS[x.dtype]).to(torch.uint8)
    mask = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    picked = torch.empty(_BLOCK, dtype=x.dtype, device=x.device)
    bits = picked.view(_BITS[x.dtype])
    markers = marker.expand(_BLOCK)
    blocks = zip(torch.split(x.view(-1), _BLOCK), torch.split(mask.view(-1), _BLOCK), strict=True)
    for block, out in blocks:
        size = block.numel()
        _HARDTANH_BACKWARD_OUT(markers[:size], block, *open_bounds, grad_input=picked[:size])
        out.copy_(bits[:size])
    return mask


def masked_gradient(grad: Tensor, mask: Tensor) -> Tensor:
    """The gradient through a mask made by `window_mask`: `grad` where the mask is 1, +0
    where it is 0."""
    if torch.compiler.is_compiling() or grad.dtype not in _BITS:
        return grad * mask
    if not (_blockwise(grad) and mask.is_contiguous() and mask.shape == grad.shape):
        result: Tensor = _HARDTANH_BACKWARD(grad, mask.to(grad.dtype), 0.5, 1.5)
        return result
    out = torch.empty_like(grad)
    inside = torch.empty(_BLOCK, dtype=grad.dtype, device=grad.device)
    blocks = zip(torch.split(grad.view(-1), _BLOCK), torch.split(mask.view(-1), _BLOCK),
                 torch.split(out.view(-1), _BLOCK), strict=True)
    for block, mask_block, out_block in blocks:
        size = block.numel()
        inside[:size].copy_(mask_block)
        _HARDTANH_BACKWARD_OUT(block, inside[:size], 0.5, 1.5, grad_input=out_block)
    return out


def _blockwise(t: Tensor) -> bool:
    """Whether `t` gets the block-by-block eager form: a large contiguous CPU tensor, outside
    any transform, trace or recorded graph (`out=` ops are none of theirs)."""
    return (
        t.device.type == "cpu"
        and t.numel() >= 2 * _BLOCK
        and type(t) in (Tensor, torch.nn.Parameter)
        and t.is_contiguous()
        and not transforms_active()
        and not is_tracing()
        and not (t.requires_grad and torch.is_grad_enabled())
    )


def _window_repr(window: tuple[float, float]) -> str:
    low, high = window
    return repr(high) if low == -high else repr(window)


@functools.lru_cache(maxsize=256)
def _open_bounds(low: float, high: float, dtype: torch.dtype) -> tuple[float, float] | None:
    """Bounds `(b_low, b_high)` for the strict test `b_low < x < b_high` that
    `hardtanh_backward` makes, equal to `low <= x <= high` for every x of `dtype`, the
    bounds being rounded to that dtype first (as `x <= high` does): the neighbours of the
    rounded bounds, outwards. None when there are none to give (an infinite bound, a dtype
    without `nextafter`): the caller then uses `torch.where`."""
    if not dtype.is_floating_point or math.isinf(low) or math.isinf(high):
        return None
    try:
        inf = torch.tensor(math.inf, dtype=dtype)
        b_low = torch.nextafter(torch.tensor(low, dtype=torch.float64).to(dtype), -inf)
        b_high = torch.nextafter(torch.tensor(high, dtype=torch.float64).to(dtype), inf)
    except (RuntimeError, TypeError):  # pragma: no cover - dtypes without nextafter
        return None
    return float(b_low.item()), float(b_high.item())


# ---- the decorator ---------------------------------------------------------------------------



def _first_parameter(op: CustomBackward[..., Any], where: str) -> str:
    sig = op._signature
    if not sig.names or sig.kinds[0] not in _POSITIONAL:
        msg = (
            f"{where}: the gradient goes to the forward's first argument, so the forward must "
            f"take the tensor first, as a positional parameter; `{sig.name}` has the "
            f"signature {sig.signature}. Write it as `def {sig.name.split('.')[-1]}(x, ...)`."
        )
        raise GradOverrideTypeError(msg)
    return sig.names[0]


def _rule(
    body: Callable[..., Tensor], first: str, n_params: int, requested: tuple[str, ...], name: str
) -> Callable[..., Any]:
    """A rule `rule(grad, /, *, <requested>)` returning `body(grad, **saved)` for the first
    parameter and no gradient for the others."""
    if n_params == 1 and body is _identity:

        def rule(upstream: Tensor, /, **saved: Any) -> Any:
            return upstream

    elif n_params == 1:

        def rule(upstream: Tensor, /, **saved: Any) -> Any:
            return body(upstream, **saved)

    else:
        rest = (None,) * (n_params - 1)

        def rule(upstream: Tensor, /, **saved: Any) -> Any:
            return (body(upstream, **saved), *rest)

    params = [inspect.Parameter("upstream", inspect.Parameter.POSITIONAL_ONLY)]
    params += [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in requested]
    rule.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    rule.__name__ = rule.__qualname__ = name
    return rule


def _identity(upstream: Tensor, **saved: Any) -> Tensor:
    return upstream


def _options_repr(**options: Any) -> str:
    parts = []
    for key, value in options.items():
        if value is None:
            continue
        text = value if key in ("clip", "inclusive") else (
            getattr(value, "__name__", None) or repr(value)
        )
        parts.append(f"{key}={text}")
    return f"straight_through({', '.join(parts)})"


def _build(
    fn: Callable[..., Any],
    *,
    clip: object,
    inclusive: object,
    keep: Any,
    surrogate: Callable[..., Any] | None,
    derivative: Callable[..., Any] | None,
) -> CustomBackward[..., Any]:
    where = "straight_through"
    if not callable(fn):
        msg = (
            f"straight_through needs a forward function to decorate, got "
            f"{type(fn).__name__} {fn!r}."
        )
        raise GradOverrideTypeError(msg)
    if surrogate is not None and derivative is not None:
        msg = (
            "straight_through got both `surrogate=` and `derivative=`; pass one: "
            "`surrogate=f` takes the derivative of `f` by autograd, `derivative=df` gives it "
            "directly."
        )
        raise GradOverrideError(msg)
    for argument, value in (("surrogate", surrogate), ("derivative", derivative)):
        if value is not None and not callable(value):
            msg = (
                f"straight_through: `{argument}` must be a function of the input tensor, "
                f"got {type(value).__name__} {value!r}."
            )
            raise GradOverrideTypeError(msg)
    window = None if clip is None else parse_clip(clip, where)
    ends = parse_inclusive(inclusive, where)
    if window is None and ends != INCLUSIVE:
        msg = (
            f"straight_through got inclusive={inclusive!r} without `clip=`; `inclusive` "
            "chooses which ends belong to the clip window. Add `clip=` or drop `inclusive`."
        )
        raise GradOverrideError(msg)
    if window is not None:
        check_window(window, ends, where)
    if window is None and keep != DEFAULT_KEEP:
        msg = (
            f"straight_through got keep={keep!r} without `clip=`; `keep` chooses what a "
            "clipped straight-through saves for backward. Add `clip=` or drop `keep`."
        )
        raise GradOverrideError(msg)
    if keep not in ("input", "mask"):
        msg = (
            f"straight_through: `keep` must be 'input' (save the input: no extra memory when "
            f"it stays alive anyway) or 'mask' (save one byte per element); got {keep!r}."
        )
        raise GradOverrideError(msg)
    if keep == "mask" and (surrogate is not None or derivative is not None):
        msg = (
            "straight_through: keep='mask' does not apply with a surrogate or derivative, "
            "whose backward needs the input itself; drop `keep` (the window is then tested "
            "on the saved input)."
        )
        raise GradOverrideError(msg)
    name = _options_repr(
        clip=None if window is None else _window_repr(window),
        inclusive=None if ends == INCLUSIVE else _inclusive_repr(ends),
        keep=keep if window is not None else None,
        surrogate=surrogate,
        derivative=derivative,
    )

    if window is not None and keep == "mask" and surrogate is None and derivative is None:
        return _build_mask(fn, window, ends, name)

    op: CustomBackward[..., Any] = custom_backward(fn)
    first = _first_parameter(op, where)
    n_params = len(op.parameters)
    bounds = None if window is None else window_bounds(window, ends)

    if surrogate is not None:
        sur = surrogate
        # Plain values only in the rule's closure: dynamo, tracing it, cannot wrap the op.
        op_name = op._name

        def body(upstream: Tensor, **saved: Any) -> Tensor:
            x = saved[first]
            value, vjp = torch.func.vjp(sur, x)[:2]
            if not isinstance(value, Tensor) or value.shape != upstream.shape:
                got = getattr(value, "shape", type(value).__name__)
                msg = (
                    f"the surrogate `{getattr(sur, '__name__', sur)}` of `{op_name}` "
                    f"returned {tuple(got) if isinstance(got, torch.Size) else got}, but "
                    f"the forward's output has shape {tuple(upstream.shape)}; a surrogate "
                    "maps the input to a tensor shaped like the forward's output."
                )
                raise GradOverrideError(msg)
            (grad,) = vjp(upstream.to(value.dtype))
            return grad if bounds is None else window_gradient(grad, x, bounds)

        requested: tuple[str, ...] = (first,)
    elif derivative is not None:
        deriv = derivative

        def body(upstream: Tensor, **saved: Any) -> Tensor:
            x = saved[first]
            grad = upstream * deriv(x)
            return grad if bounds is None else window_gradient(grad, x, bounds)

        requested = (first,)
    elif bounds is not None:
        clip_bounds = bounds

        def body(upstream: Tensor, **saved: Any) -> Tensor:
            return window_gradient(upstream, saved[first], clip_bounds)

        requested = (first,)
    else:
        body = _identity
        requested = ()
    op.backward(_rule(body, first, n_params, requested, name))
    op._tensorflow_rule, op._jax_rule = (
        _backend_rule(
            framework, op._name, first, n_params, window=window, inclusive=ends,
            surrogate=surrogate, derivative=derivative,
        )
        for framework in ("tensorflow", "jax")
    )
    return op


def _backend_rule(
    framework: str,
    op: str,
    first: str,
    n_params: int,
    *,
    window: tuple[float, float] | None,
    inclusive: Inclusive,
    surrogate: Callable[..., Any] | None,
    derivative: Callable[..., Any] | None,
) -> Callable[..., Any]:
    """The rule for `framework`'s inputs (TensorFlow's, JAX's): the same backward in its
    ops. It takes what the torch rule names (its signature is the torch rule's) and imports
    the framework only when called, which only happens once one of its values has arrived."""
    rest = (None,) * (n_params - 1)

    def rule(upstream: Any, /, **saved: Any) -> Any:
        grad = backend(framework).straight_through_gradient(
            upstream, saved, first=first, window=window, inclusive=inclusive,
            surrogate=surrogate, derivative=derivative, op=op,
        )
        return grad if not rest else (grad, *rest)

    return rule


def _build_mask(
    fn: Callable[..., Any], window: tuple[float, float], inclusive: Inclusive, name: str
) -> CustomBackward[..., Any]:
    """keep='mask': the forward also returns where its input is inside the window."""
    bounds = window_bounds(window, inclusive)

    @functools.wraps(fn)
    def forward(*args: Any, **kwargs: Any) -> Any:
        x = args[0]
        if isinstance(x, Tensor):
            mask = window_mask(x, bounds)
        else:  # TensorFlow's or JAX's: only then is that side imported
            mask = backend("jax" if is_jax(x) else "tensorflow").window_mask(
                x, *window, inclusive
            )
        return fn(*args, **kwargs), {"mask": mask}

    op: CustomBackward[..., Any] = custom_backward(forward, residuals=("mask",))
    op.__wrapped__ = fn
    _first_parameter(op, "straight_through")  # the mask is taken from the first argument

    op.backward(_rule(masked_gradient, "mask", len(op.parameters), ("mask",), name))
    op._tensorflow_rule, op._jax_rule = (
        _backend_rule(
            framework, op._name, "mask", len(op.parameters), window=window,
            inclusive=inclusive, surrogate=None, derivative=None,
        )
        for framework in ("tensorflow", "jax")
    )
    return op


@overload
def straight_through(fn: Callable[P, R], /) -> CustomBackward[P, R]: ...


@overload
def straight_through(
    fn: Callable[P, R],
    /,
    *,
    clip: float | tuple[float, float] | None = ...,
    inclusive: bool | tuple[bool, bool] = ...,
    keep: Keep = ...,
    surrogate: Callable[[Tensor], Tensor] | None = ...,
    derivative: Callable[[Tensor], Tensor] | None = ...,
) -> CustomBackward[P, R]: ...


@overload
def straight_through(
    fn: None = None,
    /,
    *,
    clip: float | tuple[float, float] | None = ...,
    inclusive: bool | tuple[bool, bool] = ...,
    keep: Keep = ...,
    surrogate: Callable[[Tensor], Tensor] | None = ...,
    derivative: Callable[[Tensor], Tensor] | None = ...,
) -> Callable[[Callable[P, R]], CustomBackward[P, R]]: ...


@autograph_artifact
def straight_through(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    clip: float | tuple[float, float] | None = None,
    inclusive: bool | tuple[bool, bool] = True,
    keep: Keep = DEFAULT_KEEP,
    surrogate: Callable[[Tensor], Tensor] | None = None,
    derivative: Callable[[Tensor], Tensor] | None = None,
) -> Any:
    """Keep a non-differentiable forward; choose its backward.

    ```python
    import torch
    import gradoverride as go

    @go.straight_through  # backward: the upstream gradient
    def binarize(x):
        return torch.sign(x)

    @go.straight_through(clip=1.0)  # grad where |x| <= 1, else 0
    def binarize_clipped(x):
        return torch.sign(x)

    @go.straight_through(surrogate=torch.tanh)  # grad * tanh'(x), by autograd
    def spike(x):
        return (x > 0).to(x.dtype)

    x = torch.tensor([-2.0, 0.5], requires_grad=True)
    for op in (binarize, binarize_clipped, spike):
        x.grad = None
        op(x).sum().backward()
        print(op.__name__, [round(g, 3) for g in x.grad.tolist()])
        #> binarize [1.0, 1.0]
        #> binarize_clipped [0.0, 1.0]
        #> spike [0.071, 0.786]
    ```

    The gradient goes to the first argument; further arguments (a bit width, a threshold)
    are passed to the forward and get no gradient. The result is a `custom_backward` op:
    same name, signature and `nn.Module` form (`op.module(...)`), and the same composition
    with `torch.compile(fullgraph=True)`, `torch.func`, autocast and CUDA.

    Args:
        fn: the forward; its first parameter takes the tensor that gets the gradient.
        clip: zero the gradient outside a window: a bound `c` for `-c <= x <= c`, or a pair
            `(low, high)` for `low <= x <= high`. The bounds are compared in the input's
            dtype (rounded to it, as `x <= c` does); the gradient at a NaN input is not
            specified.
        inclusive: which ends belong to the window: True (the default: `low <= x <= high`,
            the gradient at `x == c` passes, as in Courbariaux et al. 2016 and larq), False
            (`low < x < high`: torch's `hardtanh` gradient, XNOR-Net's and STBP's code), or
            a pair `(low_end, high_end)` of bools. Needs `clip`.
        keep: what a clipped backward keeps: `"input"` (the default, `DEFAULT_KEEP`; no
            extra memory when the input stays alive anyway, as a weight does, and the
            fastest) or `"mask"` (one byte per element, computed in forward; less memory
            held for an input that would otherwise be freed, at ~1.2x the eager time).
            `"mask"` needs `clip` (without a window there is nothing to mask).
        surrogate: a differentiable function whose derivative shapes the backward: the
            gradient is the vector-Jacobian product of `surrogate` at the input (by
            `torch.func.vjp`, so it composes with `torch.compile` and `torch.func`).
        derivative: the surrogate's derivative given directly, `derivative(x)`; the gradient
            is `grad * derivative(x)`. Faster than `surrogate=` (no autograd in backward).

    Without `surrogate`/`derivative` the backward is the identity: the upstream gradient,
    returned without a copy, and nothing is saved.
    """
    def decorate(forward: Callable[P, R]) -> CustomBackward[P, R]:
        op: CustomBackward[P, R] = _build(  # type: ignore[assignment]
            forward, clip=clip, inclusive=inclusive, keep=keep, surrogate=surrogate,
            derivative=derivative,
        )
        # Pickled by value (when not found under its own name, as an op made from a builtin
        # is not), it is made again by this call: its rule is generated, not importable.
        options: dict[str, Any] = {
            "clip": clip, "inclusive": inclusive, "keep": keep, "surrogate": surrogate,
            "derivative": derivative,
        }
        op._rebuild = (straight_through, (forward,), options)
        return op

    if fn is None:
        return autograph_artifact(decorate)
    return decorate(fn)
