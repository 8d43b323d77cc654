"""Discrete choices with straight-through gradients: argmax as a one-hot, and the
straight-through Gumbel-softmax.

The forward is a hard one-hot (in the input's dtype); the backward is the gradient of a
softmax at a temperature, which is what the `y_hard - y_soft.detach() + y_soft` idiom gives,
without computing the soft value in the forward graph or keeping two graphs alive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .._decorators import custom_backward
from .._errors import GradOverrideError, GradOverrideTypeError
from .._frameworks import is_tensorflow
from ._base import Recipe, positive_number, tensorflow_call

__all__ = ["gumbel_softmax", "ste_argmax"]


def _softmax_grad(grad: Tensor, soft: Tensor, dim: int, temperature: float) -> Tensor:
    """d/dz of softmax(z / T) applied to `grad`: soft * (grad - sum(grad * soft)) / T.

    Multiplied before dividing by T, so a one-hot `soft` at a tiny T gives 0, not 0 * inf.
    """
    grad = grad.to(soft.dtype)
    # The fused kernel softmax's own backward uses; the same formula written out otherwise.
    out: Tensor
    if not torch.compiler.is_compiling() and _SOFTMAX_BACKWARD is not None:
        out = _SOFTMAX_BACKWARD(grad, soft, dim, soft.dtype)
    else:
        out = soft * (grad - (grad * soft).sum(dim, keepdim=True))
    return out if temperature == 1 else out / temperature


_SOFTMAX_BACKWARD: Any = getattr(torch.ops.aten, "_softmax_backward_data", None)


def _one_hot_argmax(scores: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """one_hot(argmax(scores, dim)) in `dtype`, by comparing positions with the index
    (`scatter_` has no `vmap` batching rule)."""
    if scores.dim() == 0:
        return torch.ones_like(scores, dtype=dtype)
    index = scores.argmax(dim, keepdim=True)
    d = dim % scores.dim()
    positions = torch.arange(scores.shape[d], device=scores.device)
    return (positions.view([-1] + [1] * (scores.dim() - d - 1)) == index).to(dtype)


def _check_temperature(recipe: str, value: object) -> float:
    return positive_number(
        recipe, "temperature", value,
        "Use a small positive value (say 0.1) for samples close to one-hot.",
    )


def _check_dim(recipe: str, dim: object) -> int:
    if not isinstance(dim, int) or isinstance(dim, bool):
        msg = f"{recipe}: `dim` must be an integer; got {type(dim).__name__} {dim!r}."
        raise GradOverrideTypeError(msg)
    return dim


def _check_input(recipe: Recipe, x: object) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = f"a {x.dtype} tensor" if isinstance(x, Tensor) else type(x).__name__
        msg = f"{recipe!r} takes a floating-point tensor of scores; got {got}."
        raise GradOverrideTypeError(msg)
    dim = recipe.dim  # type: ignore[attr-defined]
    if not -max(x.dim(), 1) <= dim < max(x.dim(), 1):
        msg = (
            f"{recipe!r} got a tensor with {x.dim()} dimensions (shape {tuple(x.shape)}), so "
            f"`dim={dim}` is out of range; pass a dim in [{-max(x.dim(), 1)}, "
            f"{max(x.dim(), 1) - 1}]."
        )
        raise GradOverrideError(msg)
    if x.dim() > 0 and x.shape[dim] == 0:
        msg = (
            f"{recipe!r} got a tensor with no entries along dim {dim} (shape "
            f"{tuple(x.shape)}); there is nothing to choose from."
        )
        raise GradOverrideError(msg)
    return x


# ---- straight-through argmax -----------------------------------------------------------------


@custom_backward
def _ste_argmax(x: Tensor, recipe: ste_argmax) -> Tensor:
    return _one_hot_argmax(x, recipe.dim, x.dtype)


@_ste_argmax.backward
def _(grad: Tensor, *, x: Tensor, recipe: ste_argmax) -> Tensor:
    if recipe.backward == "identity":
        return grad
    # As in gumbel_softmax: in float32 for half inputs, shifted so the largest logit is 0
    # before dividing by T, so a tiny T or large logits give -inf and 0, never inf - inf.
    work = x.to(_compute_dtype(x.dtype))
    shifted = work - work.amax(recipe.dim, keepdim=True)
    temperature = recipe.temperature
    soft = torch.softmax(shifted / temperature if temperature != 1 else shifted, recipe.dim)
    return _softmax_grad(grad, soft, recipe.dim, temperature).to(x.dtype)


@dataclass(frozen=True, repr=False)
class ste_argmax(Recipe):
    """Straight-through argmax: the one-hot of argmax forward, a softmax gradient backward.

    Forward: y = one_hot(argmax(x, dim)) in x's dtype (ties go to the first index, as
    `torch.argmax`). Backward, `backward="softmax"` (default; Bengio et al. 2013, the
    straight-through softmax): with p = softmax(x / T, dim),
    dL/dx = p * (dL/dy - sum(dL/dy * p, dim)) / T, the gradient of p: exactly what
    `y - p.detach() + p` gives. `backward="identity"`: dL/dx = dL/dy. Only x is kept for
    backward; p is recomputed there. Example::

        choice = go.recipes.ste_argmax(dim=-1)(logits)   # one-hot, differentiable
    """

    dim: int = -1
    backward: Literal["softmax", "identity"] = "softmax"
    temperature: float = 1.0

    def __post_init__(self) -> None:
        _check_dim("ste_argmax", self.dim)
        if self.backward not in ("softmax", "identity"):
            msg = (
                "ste_argmax: `backward` must be 'softmax' (the softmax's gradient) or "
                f"'identity' (the upstream gradient unchanged); got {self.backward!r}."
            )
            raise GradOverrideError(msg)
        object.__setattr__(
            self, "temperature", _check_temperature("ste_argmax", self.temperature)
        )

    def __call__(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and is_tensorflow(x):
            return tensorflow_call(self, x)
        return _ste_argmax(_check_input(self, x), self)


# ---- straight-through Gumbel-softmax ---------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def gumbel_noise(
    shape: torch.Size | tuple[int, ...],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Standard Gumbel samples, always finite: -log(-log(u)) for u uniform on
    [tiny, 1 - eps/2] (`torch.rand` clamped; tiny and eps of `dtype`)."""
    info = torch.finfo(dtype)
    u = torch.rand(shape, dtype=dtype, device=device, generator=generator)
    u = u.clamp_(info.tiny, 1 - info.eps / 2)
    return -torch.log(-torch.log(u))


@custom_backward(residuals=("soft",))
def _gumbel_softmax(
    x: Tensor, recipe: gumbel_softmax, generator: torch.Generator | None
) -> Any:
    dim = recipe.dim
    work = _compute_dtype(x.dtype)
    scores = x.to(work) + gumbel_noise(x.shape, dtype=work, device=x.device, generator=generator)
    # Shifted so the largest score is 0 before dividing by T: a tiny T then gives -inf and 0,
    # never inf - inf.
    shifted = scores - scores.amax(dim, keepdim=True)
    soft = torch.softmax(shifted / recipe.temperature, dim)
    # A fresh tensor for the soft output: the residual itself is not differentiable.
    out = _one_hot_argmax(soft, dim, x.dtype) if recipe.hard else soft.to(x.dtype, copy=True)
    return out, {"soft": soft}


@_gumbel_softmax.backward
def _(grad: Tensor, *, soft: Tensor, recipe: gumbel_softmax) -> Any:
    return _softmax_grad(grad, soft, recipe.dim, recipe.temperature), None, None


@dataclass(frozen=True, repr=False)
class gumbel_softmax(Recipe):
    """Gumbel-softmax sampling (Jang et al. 2017; Maddison et al. 2017), straight-through
    when `hard=True` (default).

    Forward: y_soft = softmax((x + G) / T, dim) with G standard Gumbel noise; the output is
    one_hot(argmax(y_soft)) when `hard`, else y_soft, in x's dtype. Backward (either way):
    the gradient of y_soft, dL/dx = y_soft * (dL/dy - sum(dL/dy * y_soft, dim)) / T.
    As `torch.nn.functional.gumbel_softmax`, but: the temperature is checked (positive and
    finite); the noise and softmax are computed in float32 for float16/bfloat16 inputs, the
    noise is always finite and the scores are shifted before dividing by T, so no NaN
    appears in float16 or at tiny temperatures; `generator=` makes the noise reproducible.
    Keeps y_soft (float32 for half inputs) for backward. Under `torch.compile`, leave
    `generator` unset and seed with `torch.manual_seed`: dynamo cannot trace an explicit
    `torch.Generator`. Example::

        sample = go.recipes.gumbel_softmax(temperature=0.5)(logits, generator=g)
    """

    temperature: float = 1.0
    dim: int = -1
    hard: bool = True

    def __post_init__(self) -> None:
        _check_dim("gumbel_softmax", self.dim)
        object.__setattr__(
            self, "temperature", _check_temperature("gumbel_softmax", self.temperature)
        )

    def __call__(
        self, x: Tensor, *, generator: torch.Generator | None = None
    ) -> Tensor:
        if not isinstance(x, Tensor) and is_tensorflow(x):
            return tensorflow_call(self, x, generator=generator)
        if generator is not None and not isinstance(generator, torch.Generator):
            msg = (
                f"{self!r}: `generator` must be a torch.Generator (or None); got "
                f"{type(generator).__name__} {generator!r}."
            )
            raise GradOverrideTypeError(msg)
        result: Tensor = _gumbel_softmax(_check_input(self, x), self, generator)
        return result
