"""Discrete choices with straight-through gradients: argmax as a one-hot, the
straight-through Gumbel-softmax, and the rotation trick for vector quantization.

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
from .._ops import TORCH, foreign
from .._ops._torch import _SOFTMAX_BACKWARD as _TORCH_SOFTMAX_BACKWARD
from ._base import Recipe, positive_number, tensorflow_call
from ._formulas import discrete

__all__ = ["gumbel_softmax", "rotation_trick", "ste_argmax"]


def _softmax_grad(grad: Tensor, soft: Tensor, dim: int, temperature: float) -> Tensor:
    """d/dz of softmax(z / T) applied to `grad`: soft * (grad - sum(grad * soft)) / T.

    Multiplied before dividing by T, so a one-hot `soft` at a tiny T gives 0, not 0 * inf.
    """
    out: Tensor = discrete.softmax_grad(TORCH, grad, soft, dim, temperature)
    return out


#: The fused kernel of softmax's own backward that `TORCH.softmax_backward` runs (None in a
#: build without it, where the formula is written out).
_SOFTMAX_BACKWARD: Any = _TORCH_SOFTMAX_BACKWARD


def _one_hot_argmax(scores: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """one_hot(argmax(scores, dim)) in `dtype`, by comparing positions with the index
    (`scatter_` has no `vmap` batching rule)."""
    one_hot: Tensor = discrete.one_hot_argmax(TORCH, scores, dim, dtype)
    return one_hot


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
    temperature = recipe.temperature
    soft = discrete.tempered_softmax(
        TORCH, x.to(_compute_dtype(x.dtype)), recipe.dim, temperature
    )
    return _softmax_grad(grad, soft, recipe.dim, temperature).to(x.dtype)


@dataclass(frozen=True, repr=False)
class ste_argmax(Recipe):
    """Straight-through argmax: the one-hot of argmax forward, a softmax gradient backward.

    Forward: y = one_hot(argmax(x, dim)) in x's dtype (ties go to the first index, as
    `torch.argmax`). Backward, `backward="softmax"` (default; Bengio et al. 2013, the
    straight-through softmax): with p = softmax(x / T, dim),
    dL/dx = p * (dL/dy - sum(dL/dy * p, dim)) / T, the gradient of p: exactly what
    `y - p.detach() + p` gives. `backward="identity"`: dL/dx = dL/dy. Only x is kept for
    backward; p is recomputed there.

    ```python
    import torch
    import gradoverride as go

    logits = torch.tensor([[1.0, 3.0, 0.5]], requires_grad=True)
    choice = go.recipes.ste_argmax(dim=-1)(logits)  # one-hot, differentiable
    choice[0, 1].backward()
    print(choice.tolist(), [round(g, 3) for g in logits.grad[0].tolist()])
    #> [[0.0, 1.0, 0.0]] [-0.091, 0.147, -0.055]
    ```
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
        if not isinstance(x, Tensor) and foreign(x):
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
    draw_dtype: torch.dtype | None = None,
) -> Tensor:
    """Standard Gumbel samples in `dtype`, drawn as `torch.nn.functional.gumbel_softmax`
    draws them (`-log(E)`, E exponential, in `draw_dtype`, default `dtype`), so that the
    same seed gives the same draws; always finite (E clamped at the smallest normal number
    of its dtype, where the exponential can round to 0)."""
    draw = dtype if draw_dtype is None else draw_dtype
    e = torch.empty(shape, dtype=draw, device=device).exponential_(generator=generator)
    return e.clamp_(min=torch.finfo(draw).tiny).log_().neg_().to(dtype)


@custom_backward(residuals=("soft",))
def _gumbel_softmax(
    x: Tensor, recipe: gumbel_softmax, generator: torch.Generator | None, noise: Tensor | None
) -> Any:
    dim = recipe.dim
    work = _compute_dtype(x.dtype)
    if noise is None:  # drawn in x's dtype, as torch's gumbel_softmax draws
        noise = gumbel_noise(x.shape, dtype=work, device=x.device, generator=generator,
                             draw_dtype=x.dtype)
    scores = x.to(work) + noise.to(work)
    # In place where that is safe: `scores` is this function's own.
    soft = discrete.tempered_softmax(TORCH, scores, dim, recipe.temperature, temporary=True)
    # A fresh tensor for the soft output: the residual itself is not differentiable.
    out = _one_hot_argmax(soft, dim, x.dtype) if recipe.hard else soft.to(x.dtype, copy=True)
    return out, {"soft": soft}


@_gumbel_softmax.backward
def _(grad: Tensor, *, soft: Tensor, recipe: gumbel_softmax, needs_grad: Any) -> Any:
    grad_x = _softmax_grad(grad, soft, recipe.dim, recipe.temperature)
    # The scores are x + noise, so given noise gets x's gradient (in its own dtype).
    return grad_x, None, None, grad_x if needs_grad["noise"] else None


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
    appears in float16 or at tiny temperatures. Keeps y_soft (float32 for half inputs) for
    backward.

    The noise G: drawn by the recipe as `torch.nn.functional.gumbel_softmax` draws it
    (`-log(Exponential(1))` in x's dtype, clamped so that G is finite), from `generator=`
    when given, so that with the same seed a swap for torch's function gives the same
    samples; or given as `noise=`, a floating-point tensor of x's shape holding the draws,
    so that a run can be reproduced and compared exactly.
    Given noise gets the same gradient as x (the scores are x + G); it is used as given,
    in float32 for half inputs. Under `torch.compile`, leave `generator` unset and seed with
    `torch.manual_seed`, or pass `noise=`: dynamo cannot trace an explicit
    `torch.Generator`.

    ```python
    import torch
    import gradoverride as go

    logits = torch.tensor([[1.0, 3.0, 0.5]], requires_grad=True)
    g = torch.Generator().manual_seed(0)
    sample = go.recipes.gumbel_softmax(temperature=0.5)(logits, generator=g)
    draws = -torch.empty(1, 3).exponential_(generator=torch.Generator().manual_seed(1)).log()
    same = go.recipes.gumbel_softmax(temperature=0.5)(logits, noise=draws)
    print(sample.tolist(), torch.equal(same, go.recipes.gumbel_softmax(0.5)(logits, noise=draws)))
    #> [[0.0, 1.0, 0.0]] True
    ```
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
        self,
        x: Tensor,
        *,
        generator: torch.Generator | None = None,
        noise: Tensor | None = None,
    ) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return tensorflow_call(self, x, generator=generator, noise=noise)
        if generator is not None and not isinstance(generator, torch.Generator):
            msg = (
                f"{self!r}: `generator` must be a torch.Generator (or None); got "
                f"{type(generator).__name__} {generator!r}."
            )
            raise GradOverrideTypeError(msg)
        x = _check_input(self, x)
        if noise is not None:
            self._check_noise(x, noise, generator)
        result: Tensor = _gumbel_softmax(x, self, generator, noise)
        return result

    def _check_noise(
        self, x: Tensor, noise: object, generator: torch.Generator | None
    ) -> None:
        if generator is not None:
            msg = (
                f"{self!r} got both `generator=` and `noise=`; pass one: `generator` draws "
                "the noise, `noise` gives the draws."
            )
            raise GradOverrideError(msg)
        if not isinstance(noise, Tensor) or not noise.is_floating_point():
            got = f"a {noise.dtype} tensor" if isinstance(noise, Tensor) else (
                f"{type(noise).__name__} {noise!r}"
            )
            msg = (
                f"{self!r}: `noise` must be a floating-point tensor of Gumbel draws shaped "
                f"like the scores; got {got}."
            )
            raise GradOverrideTypeError(msg)
        if noise.shape != x.shape or noise.device != x.device:
            msg = (
                f"{self!r}: `noise` must have the scores' shape and device, "
                f"{tuple(x.shape)} on {x.device}; got {tuple(noise.shape)} on "
                f"{noise.device}. Draw one value per score, e.g. "
                "`-torch.log(-torch.log(torch.rand_like(scores)))`."
            )
            raise GradOverrideError(msg)


# ---- the rotation trick (vector quantization) ------------------------------------------------


def _norm(v: Tensor, dim: int, squares_fit: bool) -> Tensor:
    """The 2-norm of each vector along `dim` (keepdim), as `vector_norm` computes it (so that
    u and v are bit for bit vector-quantize-pytorch's: where x and q are nearly opposite, w
    is the direction of their rounding), except where the squares overflow (a float32 x of
    1e20): there it is taken on the vector scaled by its largest magnitude. `squares_fit`:
    v is a float16 input in float32, whose squares cannot overflow."""
    norm: Tensor = torch.linalg.vector_norm(v, dim=dim, keepdim=True)
    if squares_fit:
        return norm
    scale = v.abs().amax(dim, keepdim=True)
    scaled = torch.linalg.vector_norm(v / torch.where(scale > 0, scale, 1), dim=dim,
                                      keepdim=True) * scale
    return torch.where(torch.isinf(norm), scaled, norm)


@custom_backward
def _rotation_trick(x: Tensor, q: Tensor, recipe: rotation_trick) -> Tensor:
    # A fresh tensor: the output replaces x in the network, where an in-place op may follow
    # (a view of q would refuse it).
    return q.to(x.dtype, copy=True)


@_rotation_trick.backward
def _(grad: Tensor, *, x: Tensor, q: Tensor, recipe: rotation_trick) -> Any:
    return recipe.gradient(grad, x, q), None, None


@dataclass(frozen=True, repr=False)
class rotation_trick(Recipe):
    """The rotation trick for vector quantization (Fifty et al., 2024, "Restructuring Vector
    Quantization with the Rotation Trick"): `rotation_trick()(x, q)`, with x the encoder's
    output and q its codebook vector (the same shape; vectors along `dim`).

    Forward: y = q, exactly, in x's dtype (a new tensor, so an in-place op may follow).
    Backward: q is treated as `lambda * R x` with the rotation R and the scale lambda held
    constant, so dL/dx = lambda * R^T dL/dy, where, along `dim`, u = x / max(|x|, eps),
    v = q / max(|q|, eps), w = (u + v) / max(|u + v|, eps), R = I - 2 w w^T + 2 v u^T (the
    rotation taking u to v) and lambda = |q| / max(|x|, eps):
    dL/dx = lambda * (g - 2 (g . w) w + 2 (g . v) u), g = dL/dy.
    q gets no gradient (the codebook learns from its own loss, as in the paper). Where x and
    q point the same way R is the identity and this is the plain straight-through
    `x + (q - x).detach()` times lambda; where they are opposite, u + v = 0, w = 0 and R is
    the reflection I - 2 v v^T; at x = 0, lambda = |q| / eps. The gradient is computed in
    float32 for float16/bfloat16 inputs and returned in x's dtype; the norms are taken on
    each vector scaled by its largest entry, so they do not overflow where they are finite
    (a float32 x of 1e20). It is finite wherever the formula is, up to the dtype's range:
    lambda = |q| / |x| for a small x can exceed float16's.

    The defaults are vector-quantize-pytorch's `rotate_to(x, q)` (`eps=1e-6` in its norms
    and divisions, vectors along the last dimension): the same gradient; its forward
    computes `lambda * R x`, which is q up to rounding where |x| >= eps but not below (0 at
    x = 0), where this recipe gives q.
    ```python
    import torch
    import gradoverride as go

    codebook = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    z_e = torch.tensor([[0.9, 0.2]], requires_grad=True)  # the encoder's output
    indices = (z_e @ codebook.T).argmax(-1)
    y = go.recipes.rotation_trick()(z_e, codebook[indices])
    y.sum().backward()
    print(y.tolist(), z_e.grad.shape)  # the code forward; a rotated gradient to z_e
    #> [[1.0, 0.0]] torch.Size([1, 2])
    ```
    """

    dim: int = -1
    eps: float = 1e-6

    def __post_init__(self) -> None:
        _check_dim("rotation_trick", self.dim)
        object.__setattr__(
            self, "eps", positive_number(
                "rotation_trick", "eps", self.eps,
                "It floors the norms it divides by (vector-quantize-pytorch uses 1e-6).",
            ),
        )

    def gradient(self, grad: Tensor, x: Tensor, q: Tensor) -> Tensor:
        """dL/dx given dL/dy = `grad` (the formula above), in x's dtype."""
        work = _compute_dtype(x.dtype)
        g, x_, q_ = grad.to(work), x.to(work), q.to(work)
        dim, eps = self.dim, self.eps
        x_norm = _norm(x_, dim, x.dtype == torch.float16).clamp_min(eps)
        q_norm = _norm(q_, dim, q.dtype == torch.float16)
        u = x_ / x_norm
        v = q_ / q_norm.clamp_min(eps)
        w = u + v
        w = w / torch.linalg.vector_norm(w, dim=dim, keepdim=True).clamp_min(eps)
        g_w = (g * w).sum(dim, keepdim=True)
        g_v = (g * v).sum(dim, keepdim=True)
        rotated = g - 2 * g_w * w + 2 * g_v * u  # R^T g
        result: Tensor = (rotated * (q_norm / x_norm)).to(x.dtype)
        return result

    def __call__(self, x: Tensor, q: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return tensorflow_call(self, x, q)
        for name, value in (("x", x), ("q", q)):
            if not isinstance(value, Tensor) or not value.is_floating_point():
                got = f"a {value.dtype} tensor" if isinstance(value, Tensor) else (
                    type(value).__name__
                )
                msg = f"{self!r}: `{name}` must be a floating-point tensor; got {got}."
                raise GradOverrideTypeError(msg)
        if x.shape != q.shape:
            msg = (
                f"{self!r}: `x` and its codebook vector `q` must have the same shape; got "
                f"{tuple(x.shape)} and {tuple(q.shape)}. Gather one code per vector first "
                "(`codebook[indices]`)."
            )
            raise GradOverrideError(msg)
        if x.dim() == 0 or not -x.dim() <= self.dim < x.dim():
            msg = (
                f"{self!r} got tensors of shape {tuple(x.shape)}, with no dimension "
                f"{self.dim} to hold the vectors; pass a dim in [{-max(x.dim(), 1)}, "
                f"{max(x.dim() - 1, 0)}]."
            )
            raise GradOverrideError(msg)
        result: Tensor = _rotation_trick(x, q, self)
        return result
