"""torch's `Backend`: the primitives as torch ops, with the fused kernels and in-place
temporaries that make the recipes' backwards as fast as hand-written ones.

A composition reuses its own temporaries (`t.mul_(g)` instead of `t * g`) only where that is
safe: not while compiling (functionalized anyway), not under a `torch.func` transform (an
unbatched temporary cannot take a batched gradient in place), and not while recording a
graph for a second derivative.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._internals import tracing_state, transforms_active
from ._protocol import Backend

__all__ = ["TORCH", "TorchBackend"]

_HALF = (torch.float16, torch.bfloat16)

#: Where sigmoid(t) rounds to 1 in each dtype while exp(t) is still finite: above it
#: softplus_backward passes its gradient unchanged (float16 and bfloat16: 10).
_SATURATION = {torch.float64: 40.0, torch.float32: 20.0}

_COMPARE: dict[str, Callable[..., Tensor]] = {
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq,
}

#: The fused kernel of softmax's own backward (absent from some builds).
_SOFTMAX_BACKWARD: Any = getattr(torch.ops.aten, "_softmax_backward_data", None)


def in_place() -> bool:
    """Whether a backward may reuse its own temporaries (see the module's docstring)."""
    if torch.compiler.is_compiling():
        return False
    return not torch.is_grad_enabled() and not transforms_active()


def _scalar(x: Tensor, value: float) -> Tensor:
    """`value` as a 0-d tensor of x's dtype and device: an operand of torch's fused ops."""
    return x.new_full((), value)


class TorchBackend(Backend):
    name = "torch"

    # ---- values -------------------------------------------------------------------------

    def asarray(self, x: Any) -> Any:
        return x

    def cast(self, x: Any, dtype: Any) -> Any:
        return x if x.dtype == dtype else x.to(dtype)

    def constant(self, value: float, dtype: Any) -> Any:
        return torch.tensor(value, dtype=dtype)

    def zeros_like(self, x: Any) -> Any:
        return torch.zeros_like(x)

    def is_half(self, dtype: Any) -> bool:
        return dtype in _HALF

    def compute_dtype(self, dtype: Any) -> Any:
        return torch.float32 if dtype in _HALF else dtype

    # ---- elementwise --------------------------------------------------------------------

    def abs(self, x: Any) -> Any:
        return torch.abs(x)

    def exp(self, x: Any) -> Any:
        return torch.exp(x)

    def sigmoid(self, x: Any) -> Any:
        return torch.sigmoid(x)

    def relu(self, x: Any) -> Any:
        return torch.relu(x)

    def where(self, condition: Any, x: Any, y: Any) -> Any:
        return torch.where(condition, x, y)

    def maximum(self, x: Any, y: Any) -> Any:
        return torch.maximum(x, y)

    def minimum(self, x: Any, y: Any) -> Any:
        return torch.minimum(x, y)

    # ---- reductions and shapes ----------------------------------------------------------

    def sum_to_shape(self, grad: Any, like: Any) -> Any:
        return grad.sum_to_size(like.shape) if grad.shape != like.shape else grad

    # ---- compositions: fused kernels, temporaries reused when safe -------------------------

    def times(self, t: Any, g: Any) -> Any:
        return t.mul_(g) if in_place() else t * g

    def divide(self, g: Any, d: Any) -> Any:
        if g.dtype == d.dtype and in_place():
            return torch.div(g, d, out=d)
        return g / d

    def addcmul(self, k: float, a: Any, b: Any, value: float) -> Any:
        return torch.addcmul(_scalar(a, k), a, b, value=value)

    def minus(self, k: float, t: Any, alpha: float) -> Any:
        if in_place():
            return torch.sub(_scalar(t, k), t, alpha=alpha, out=t)
        return torch.sub(_scalar(t, k), t, alpha=alpha)

    def indicator(self, compare: str, a: Any, b: Any) -> Any:
        """Written straight into a tensor of a's dtype: one pass, where `(a > b).to(dtype)`
        takes two and its bool-to-float copy is the slow one (and `torch.where` on the CPU
        is slower still, so the formulas blend with these 0/1 factors instead). Not while
        `torch.jit.trace` records: the TorchScript-based ONNX exporter cannot translate an
        `out=` write."""
        op = _COMPARE[compare]
        if torch.compiler.is_compiling() or transforms_active() or tracing_state() is not None:
            return op(a, b).to(a.dtype)  # no out= there; the compiler fuses it anyway
        return op(a, b, out=torch.empty_like(a))

    def blend(self, mask: Any, on: Any, off: Any) -> Any:
        """`mask` is the caller's temporary (an `indicator`): reused for the result when
        that is safe."""
        rest = 1 - mask
        first = mask if isinstance(on, float) and on == 1 else self.times(mask, on)
        if isinstance(off, float):
            if in_place():
                return torch.add(first, rest, alpha=off, out=first)
            return torch.add(first, rest, alpha=off)
        rest = self.times(rest, off)
        return first.add_(rest) if in_place() else first + rest

    def apply(self, t: Any, name: str) -> Any:
        result: Tensor = getattr(t, f"{name}_")() if in_place() else getattr(t, name)()
        return result

    def sigmoid_product(self, g: Any, x: Any, a: float, k: float) -> Any:
        """softplus_backward(g, x, beta, t) is g * sigmoid(beta x) in one fused pass
        (exp(beta x) stays finite below the threshold t, above which sigmoid is 1 in the
        dtype), so the product takes two passes where sigmoid, its mirror and the products
        take five; and no 1 - sigmoid cancels to 0 in bfloat16."""
        if g.dtype == x.dtype:
            threshold = _SATURATION.get(x.dtype, 10.0)
            once = torch.ops.aten.softplus_backward(g, x, a, threshold)
            out = torch.ops.aten.softplus_backward(once, x, -a, threshold)
        else:
            ax = x * a
            out = torch.sigmoid(ax) * torch.sigmoid(-ax) * g
        return out if k == 1 else self.times(out, k)

    # ---- more elementwise ops, random draws, shapes ------------------------------------------

    def atan(self, x: Any) -> Any:
        return torch.atan(x)

    def erfc(self, x: Any) -> Any:
        return torch.erfc(x)

    def cos(self, x: Any) -> Any:
        return torch.cos(x)

    def rsqrt(self, x: Any) -> Any:
        return torch.rsqrt(x)

    def reciprocal(self, x: Any) -> Any:
        return torch.reciprocal(x)

    def sign(self, x: Any) -> Any:
        return torch.sign(x)

    def plus(self, t: Any, u: Any) -> Any:
        return t.add_(u) if in_place() else t + u

    def square(self, t: Any) -> Any:
        return t.square_() if in_place() else t * t

    def power(self, t: Any, p: float) -> Any:
        return t.pow_(p) if in_place() else t.pow(p)

    def clamp_min(self, t: Any, low: float) -> Any:
        return t.clamp_min_(low) if in_place() else t.clamp(min=low)

    def affine(self, k: float, t: Any, alpha: float) -> Any:
        return torch.add(_scalar(t, k), t, alpha=alpha)

    def select(self, condition: Any, x: Any, y: Any) -> Any:
        return torch.where(condition, x, y)  # takes a Python number for either branch

    # ---- limits, reductions along an axis, checks, the identity with a gradient --------------

    def finfo(self, dtype: Any) -> Any:
        return torch.finfo(dtype)


    def size(self, x: Any) -> int:
        return int(x.numel())

    def log(self, x: Any) -> Any:
        return torch.log(x)


    def isnan(self, x: Any) -> Any:
        return torch.isnan(x)

    def isinf(self, x: Any) -> Any:
        return torch.isinf(x)

    def isfinite(self, x: Any) -> Any:
        return torch.isfinite(x)

    def ones_like(self, x: Any, dtype: Any) -> Any:
        return torch.ones_like(x, dtype=dtype)

    def clamp(self, x: Any, low: Any, high: Any) -> Any:
        return torch.clamp(x, low, high)

    def true_divide(self, x: Any, number: float, *, temporary: bool = False) -> Any:
        return x.div_(number) if temporary and in_place() else x / number

    def difference(self, t: Any, u: Any, *, temporary: bool = False) -> Any:
        return t.sub_(u) if temporary and in_place() else t - u

    def amax_along(self, x: Any, axis: Any) -> Any:
        return x.amax(() if axis is None else axis, keepdim=True)

    def amin_along(self, x: Any, axis: Any) -> Any:
        return x.amin(() if axis is None else axis, keepdim=True)

    def sum_along(self, x: Any, axis: Any) -> Any:
        return x.sum(axis, keepdim=True)

    def all_true(self, x: Any) -> Any:
        return x.all()

    def number_true(self, x: Any) -> int:
        return int(x.sum())

    def argmax(self, x: Any, dim: int) -> Any:
        return x.argmax(dim, keepdim=True)

    def positions(self, x: Any, dim: int) -> Any:
        d = dim % x.dim()
        return torch.arange(x.shape[d], device=x.device).view([-1] + [1] * (x.dim() - d - 1))

    def softmax(self, x: Any, dim: int) -> Any:
        return torch.softmax(x, dim)

    def integer_array(self, value: Any) -> Any:
        return torch.as_tensor(value)

    def concrete(self, x: Any) -> bool:
        return not torch.compiler.is_compiling()

    def runtime_assert(self, condition: Any, message: str, x: Any) -> Any:
        torch._assert_async(condition, message)  # no graph break under torch.compile
        return x


    def vector_norm(self, x: Any, order: float, axis: Any, dtype: Any) -> Any:
        return torch.linalg.vector_norm(x, ord=order, dim=axis, keepdim=True, dtype=dtype)

    def nan_to_num(self, x: Any, nan: float, posinf: float, neginf: float) -> Any:
        return torch.nan_to_num(x, nan=nan, posinf=posinf, neginf=neginf)

    def softmax_backward(self, grad: Any, soft: Any, dim: int) -> Any:
        """The fused kernel softmax's own backward uses (not while compiling: the compiler
        fuses the written-out formula)."""
        if not torch.compiler.is_compiling() and _SOFTMAX_BACKWARD is not None:
            return _SOFTMAX_BACKWARD(grad, soft, dim, soft.dtype)
        return soft * (grad - (grad * soft).sum(dim, keepdim=True))

    # ---- rounding, whole-array reductions, torch's dtype rules -------------------------------

    def round(self, x: Any) -> Any:
        return torch.round(x)

    def floor(self, x: Any) -> Any:
        return torch.floor(x)

    def ceil(self, x: Any) -> Any:
        return torch.ceil(x)

    def sqrt(self, x: Any) -> Any:
        return torch.sqrt(x)

    def amax(self, x: Any) -> Any:
        return x.max()

    def amin(self, x: Any) -> Any:
        return x.min()

    def sum(self, x: Any) -> Any:
        return x.sum()

    def mean(self, x: Any) -> Any:
        return x.mean()

    def count_true(self, mask: Any, dtype: Any) -> Any:
        return mask.sum().to(dtype)

    def dynamic_size(self, x: Any) -> Any:
        return torch.tensor(x.numel(), dtype=torch.float64)

    def divide_by_number(self, x: Any, number: Any) -> Any:
        return x / number

    def times_number(self, x: Any, number: Any) -> Any:
        return x * number

    def div(self, a: Any, c: Any) -> Any:
        return a / c

    def mul(self, a: Any, c: Any) -> Any:
        return a * c


#: The one torch backend.
TORCH = TorchBackend()
