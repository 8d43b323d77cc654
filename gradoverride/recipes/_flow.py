"""Gradient flow: reversal, scaling, clipping and NaN/inf sanitizing of the gradient that
passes through a point of the graph.

Each recipe is a `GradientTransform`: its forward is the identity (the value passes through
untouched, as a view) and its backward maps the upstream gradient. So each one works three
ways: called on a tensor (`reverse_grad()(features)`), as a module (`.module()`, for
`nn.Sequential`), and as a `go.grad_hook` transform (`.transform(grad)`).

Every backward here is branch-free (no Python `if` on tensor values: `torch.clamp`,
`torch.where` and `torch._assert_async` instead), so each recipe compiles with
`torch.compile(fullgraph=True)`; a backward such as `if norm > max_norm: ...` fails there
with "Data-dependent branching". The gradient keeps the input's dtype.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor
from torch.compiler import is_dynamo_compiling

from .._decorators import custom_backward
from .._errors import GradOverrideError, GradOverrideTypeError, GradOverrideWarning
from .._internals import (
    is_grad_scaler,
    is_keras_loss_scaler,
    is_keras_optimizer,
    loss_scale,
)
from .._ops import TORCH, foreign
from .._passthrough import passthrough
from ._base import (
    GradientTransform,
    RecipeModule,
    finite,
    tensorflow_call,
    tensorflow_transform,
)
from ._formulas import flow

__all__ = [
    "ScaledGradientModule",
    "clip_grad_norm",
    "clip_grad_value",
    "ganin_ramp",
    "reverse_grad",
    "sanitize_grad",
    "scale_grad",
]

#: A scale: a number, a tensor (0-d, or broadcastable to the input), or a schedule, that is a
#: callable from a step counter (a 0-d int64 tensor) to a number or tensor.
Scale = float | Tensor | Callable[[Tensor], float | Tensor]


# ---- schedules ------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class ganin_ramp:
    """The gradient-reversal ramp of Ganin et al. (2016), a schedule for `reverse_grad`.

    Formula: ``scale(step) = max_scale * (2 / (1 + exp(-gamma * p)) - 1)`` with the training
    progress ``p = clamp(step / total_steps, 0, 1)``. It is 0 at step 0 (the domain classifier
    cannot disturb the features early on), rises smoothly, and tends to `max_scale` (0.9999
    of it at the end with the paper's gamma = 10).

    ```python
    import torch
    from gradoverride.recipes import ganin_ramp, reverse_grad

    grl = reverse_grad(scale=ganin_ramp(total_steps=1000)).module()
    features = torch.ones(2, requires_grad=True)
    for _ in range(500):
        grl.step()  # once per training step, after backward
    grl(features).sum().backward()
    print(f"{float(grl.scale()):.4f}", [round(g, 4) for g in features.grad.tolist()])
    #> 0.9866 [-0.9866, -0.9866]
    ```

    Args:
        total_steps: the number of training steps over which `p` goes from 0 to 1.
        gamma: the ramp's steepness; 10 in the paper (DANN, Ganin et al., JMLR 2016).
        max_scale: the scale the ramp tends to; 1 in the paper.

    Returns (when called with a step): a 0-d floating tensor, computed with torch ops so a
    schedule driven by a step buffer compiles with `fullgraph=True`.
    """

    total_steps: int
    gamma: float = 10.0
    max_scale: float = 1.0

    def __post_init__(self) -> None:
        if not (
            isinstance(self.total_steps, int)
            and not isinstance(self.total_steps, bool)
            and self.total_steps > 0
        ):
            msg = (
                f"ganin_ramp needs `total_steps` to be a positive int (the steps over which the "
                f"progress p goes from 0 to 1), got {self.total_steps!r}."
            )
            raise GradOverrideError(msg)

    def __call__(self, step: Tensor | int) -> Tensor:
        ramp: Tensor = flow.ganin_ramp(
            TORCH, torch.as_tensor(step), self.total_steps, self.gamma, self.max_scale
        )
        return ramp

    def __repr__(self) -> str:
        return (
            f"ganin_ramp(total_steps={self.total_steps!r}, gamma={self.gamma!r}, "
            f"max_scale={self.max_scale!r})"
        )


# ---- reversal and scaling -------------------------------------------------------------------


def _multiplied(grad: Tensor, *, factor: float | Tensor) -> Tensor | tuple[Tensor, None]:
    if isinstance(factor, Tensor):
        # A tensor factor gets no gradient: it is a setting, not a model input.
        return flow.multiply(TORCH, grad, factor), None
    # The default reversal, -1, is a negation: the cheapest kernel.
    result: Tensor = flow.multiply(TORCH, grad, factor)
    return result


@custom_backward(backward=_multiplied)
def _multiply_gradient(x: Tensor, factor: float | Tensor) -> Tensor:
    """Identity forward (a view of `x`: see `passthrough`); the backward multiplies the
    upstream gradient by `factor`."""
    return passthrough(x)


@custom_backward(backward=_multiplied)
def _multiply_gradient_copy(x: Tensor, factor: float | Tensor) -> Tensor:
    """`_multiply_gradient` returning a copy (the module form: an in-place op may follow)."""
    return passthrough(x, fresh=True)


def _is_schedule(scale: object) -> bool:
    return callable(scale) and not isinstance(scale, Tensor)


class _ScaledGradient(GradientTransform):
    """Shared by `reverse_grad` and `scale_grad`: a gradient multiplied by a (signed) scale."""

    scale: Scale
    _sign = 1.0
    _constant: float | None

    def __post_init__(self) -> None:
        scale = self.scale
        if isinstance(scale, bool) or not (
            isinstance(scale, int | float | Tensor) or _is_schedule(scale)
        ):
            msg = (
                f"{type(self).__name__} needs `scale` to be a number, a tensor or a schedule "
                f"(a callable from the step count to a scale, such as ganin_ramp(...)), got "
                f"{type(scale).__name__} {scale!r}."
            )
            raise GradOverrideTypeError(msg)
        if isinstance(scale, Tensor) and not scale.is_floating_point():
            msg = (
                f"{type(self).__name__} needs a floating-point `scale` tensor, got dtype "
                f"{scale.dtype}; pass `scale.float()` or a Python number."
            )
            raise GradOverrideTypeError(msg)
        # The common call (a constant number) skips `factor()`: reversal is often applied to
        # small tensors, where a Python frame is a measurable share of the cost.
        constant = self._sign * scale if isinstance(scale, int | float) else None
        object.__setattr__(self, "_constant", constant)

    @property
    def scheduled(self) -> bool:
        """Whether the scale is a schedule (then calls need the step count)."""
        return _is_schedule(self.scale)

    def factor(self, step: Tensor | int | None = None) -> float | Tensor:
        """The signed multiplier for the gradient: the scale (at `step`, for a schedule)."""
        scale = self.scale
        if _is_schedule(scale):
            if step is None:
                msg = (
                    f"{self!r} has a schedule for its scale, so it needs the step count: call "
                    "it as `recipe(x, step=step)` or `recipe.transform(grad, step=step)`, or "
                    "use its module form `recipe.module()`, which keeps the step count in its "
                    "state_dict (advance it with `module.step()`)."
                )
                raise GradOverrideError(msg)
            assert callable(scale)
            scale = scale(torch.as_tensor(step))
        elif step is not None:
            msg = (
                f"{self!r} has a constant scale, so it takes no `step`; give it a schedule "
                "(`scale=ganin_ramp(total_steps=...)`) for a scale that changes with the step."
            )
            raise GradOverrideTypeError(msg)
        if self._sign < 0:
            return -scale  # type: ignore[operator]
        return scale  # type: ignore[return-value]

    def transform(self, grad: Tensor, *, step: Tensor | int | None = None) -> Tensor:
        """The gradient passed on: `grad` times the signed scale, in `grad`'s dtype."""
        if not isinstance(grad, Tensor) and foreign(grad):
            return tensorflow_transform(self, grad, step=step)
        result: Tensor = flow.multiply(TORCH, grad, self.factor(step))
        return result

    def __call__(self, x: Tensor, /, *, step: Tensor | int | None = None) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return tensorflow_call(self, x, step=step)
        constant = self._constant
        if constant is not None and step is None:
            return _multiply_gradient(x, constant)
        return _multiply_gradient(x, self.factor(step))

    def _fresh(self, x: Tensor, step: Tensor | int | None = None) -> Tensor:
        """What the module form returns: a copy (an in-place op may follow it)."""
        constant = self._constant
        factor = constant if constant is not None and step is None else self.factor(step)
        return _multiply_gradient_copy(x, factor)

    def module(self) -> ScaledGradientModule:
        """This recipe as an `nn.Module`; with a schedule, it keeps the step count in a
        `steps` buffer (saved in `state_dict`) and `module.step()` advances it."""
        return ScaledGradientModule(self)


@dataclass(frozen=True, repr=False)
class reverse_grad(_ScaledGradient):
    """Gradient reversal: identity forward, ``-scale * grad`` backward (Ganin & Lempitsky).

    From "Unsupervised Domain Adaptation by Backpropagation" (ICML 2015). Put between a
    feature extractor and a domain classifier, it makes the features maximise the domain loss
    that the classifier minimises (domain-adversarial training, DANN). Same formula as
    pytorch-revgrad's `RevGrad(alpha)` and the `GradientReversal` layers of domain-adaptation
    libraries, with one kernel in backward instead of two (a negation for the default scale,
    else one multiply; pytorch-revgrad negates, then multiplies).

    ```python
    import torch
    from gradoverride.recipes import reverse_grad

    features = torch.ones(3, requires_grad=True)
    domain_logits = 2 * reverse_grad(scale=0.1)(features)  # identity forward
    domain_logits.sum().backward()
    print([round(g, 4) for g in features.grad.tolist()])  # -0.1 * 2
    #> [-0.2, -0.2, -0.2]
    ```

    Args:
        scale: a number (default 1.0), a tensor (0-d, or broadcastable to the input, on the
            input's device; the value it holds when the recipe is called is used; it gets no
            gradient), or a schedule: a callable from the step count to the scale, such as
            `ganin_ramp(total_steps=...)`. A scheduled recipe needs the step:
            `recipe(x, step=step)`, or its module form, which keeps the count.

    Returns (when called): the input unchanged (a view), whose gradient is
    ``-scale * grad``, in the input's dtype. ``scale=0`` blocks the gradient.
    """

    scale: Scale = 1.0
    _sign = -1.0


@dataclass(frozen=True, repr=False)
class scale_grad(_ScaledGradient):
    """Gradient scaling: identity forward, ``scale * grad`` backward.

    Slows down or speeds up learning below this point without touching the forward (a
    smaller learning rate for a pretrained backbone, a loss-balancing weight for a shared
    trunk). ``scale_grad(-s)`` is ``reverse_grad(s)``.

    ```python
    import torch
    from gradoverride.recipes import scale_grad

    backbone_out = torch.ones(2, requires_grad=True)
    scale_grad(scale=0.1)(backbone_out).sum().backward()  # the backbone learns 10x slower
    print([round(g, 4) for g in backbone_out.grad.tolist()])
    #> [0.1, 0.1]
    ```

    Args:
        scale: a number (default 1.0), a tensor (0-d or broadcastable to the input) or a
            schedule, as for `reverse_grad`.

    Returns (when called): the input unchanged (a view), whose gradient is
    ``scale * grad``, in the input's dtype.
    """

    scale: Scale = 1.0


class ScaledGradientModule(RecipeModule):
    """The module form of `reverse_grad` / `scale_grad`.

    With a schedule, the module keeps the step count in a 0-d int64 buffer `steps` (so it is
    saved in `state_dict` and restored by `load_state_dict`), evaluates the schedule at it in
    `forward`, and `step()` advances it, like an LR scheduler's `step()`. The count does not
    advance by itself in `forward`: a model may call the layer several times per training
    step, and a buffer mutated inside a compiled forward is read back after the mutation when
    the backward recomputes from it (torch's partitioner, pytorch/pytorch#197039), which gives
    wrong gradients. Call `step()` after `backward()`.
    """

    recipe: _ScaledGradient
    steps: Tensor

    #: Training calls without a `step()` after which a schedule never stepped is warned about
    #: (its scale is still the schedule's at step 0: 0 for `ganin_ramp`).
    UNSTEPPED_CALLS = 1000

    def __init__(self, recipe: _ScaledGradient) -> None:
        super().__init__(recipe)
        self.scheduled = recipe.scheduled
        self._unstepped = 0  # training calls since the last step() (see UNSTEPPED_CALLS)
        if self.scheduled:
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, x: Tensor) -> Tensor:
        if not isinstance(x, Tensor) and foreign(x):
            return tensorflow_call(self, x)
        constant = self.recipe._constant
        if constant is not None:  # the common call, one frame shorter
            return _multiply_gradient_copy(x, constant)
        if (
            self.scheduled and self.training and torch.is_grad_enabled()
            and not is_dynamo_compiling()
        ):
            # (getattr: a module pickled before this count existed)
            self._unstepped = getattr(self, "_unstepped", 0) + 1
            if self._unstepped == self.UNSTEPPED_CALLS:
                self._warn_unstepped()
        return self.recipe._fresh(x, self.steps if self.scheduled else None)

    def _warn_unstepped(self) -> None:
        if int(self.steps) != 0:
            return  # stepped before: several calls per step, or steps between epochs
        msg = (
            f"{self.recipe!r} (module form) ran {self.UNSTEPPED_CALLS} training calls and its "
            f"schedule never stepped: its scale is still {float(self.scale()):g}, the "
            "schedule's at step 0 (for ganin_ramp, 0: no gradient passes). Call its `step()` "
            "once per training step, after `backward()`."
        )
        warnings.warn(msg, GradOverrideWarning, stacklevel=3)

    def transform(self, grad: Tensor) -> Tensor:
        """The recipe's gradient map at the current step (for `go.grad_hook`)."""
        if not isinstance(grad, Tensor) and foreign(grad):
            return tensorflow_transform(self, grad)
        if self.scheduled:
            return self.recipe.transform(grad, step=self.steps)
        return self.recipe.transform(grad)

    def scale(self) -> float | Tensor:
        """The current (unsigned) scale: the schedule evaluated at `steps`, or the constant."""
        factor = self.recipe.factor(self.steps if self.scheduled else None)
        return -factor if self.recipe._sign < 0 else factor

    @torch.no_grad()
    def step(self, n: int = 1) -> None:
        """Advance the schedule by `n` steps (does nothing for a constant scale)."""
        if self.scheduled:
            self.steps.add_(n)
            self._unstepped = 0


# ---- clipping -------------------------------------------------------------------------------


class _WithScaler:
    """What the clipping recipes holding a loss scaler (torch's GradScaler, Keras'
    LossScaleOptimizer) do when copied or saved: a deep copy (a model's EMA copy) shares the
    scaler, which scales the loss of the whole training; a saved recipe would hold a copy of
    it, which scales nothing, so saving one is refused."""

    scaler: Any

    def __copy__(self) -> Any:
        return self  # (frozen)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        values = {f.name: copy.deepcopy(getattr(self, f.name), memo)
                  for f in dataclasses.fields(self) if f.name != "scaler"}  # type: ignore[arg-type]
        cls: Any = type(self)
        return cls(**values, scaler=self.scaler)

    def __reduce_ex__(self, protocol: Any) -> Any:
        if self.scaler is not None:
            msg = (
                f"{self!r} holds a {type(self.scaler).__name__} and cannot be saved with it: "
                "loaded, it would hold a copy that scales no loss, and clip the scaled "
                "gradients at the unscaled bound. Save the model without it (set "
                "`scaler=None`, as `dataclasses.replace(recipe, scaler=None)`), and give the "
                "scaler again after loading."
            )
            raise GradOverrideError(msg)
        return super().__reduce_ex__(protocol)


@dataclass(frozen=True, repr=False)
class clip_grad_value(_WithScaler, GradientTransform):
    """Clipping by value: identity forward, ``clamp(grad, -clip_value, clip_value)`` backward.

    The per-tensor, inside-the-graph form of `torch.nn.utils.clip_grad_value_` (same
    formula), for a gradient that should be bounded where it flows rather than where it
    lands. NaN stays NaN (as in `torch.clamp`); see `sanitize_grad`.

    ```python
    import torch
    from gradoverride.recipes import clip_grad_value

    logits = torch.zeros(3, requires_grad=True)
    clip_grad_value(clip_value=1.0)(logits).backward(torch.tensor([-5.0, 0.5, 5.0]))
    print(logits.grad.tolist())
    #> [-1.0, 0.5, 1.0]
    ```

    Args:
        clip_value: the bound, at least 0.
        scaler: what scales the loss, if anything (keyword only): the `torch.amp.GradScaler`
            for torch tensors, or for TensorFlow ones the Keras `LossScaleOptimizer`
            (`model.optimizer` after `model.compile` under the `mixed_float16` policy). The
            gradients arrive multiplied by the loss scale; with the scaler, the bound applies
            to the true (unscaled) gradient: ``clip_value`` times the current scale (read
            in the graph, without a synchronization) on the scaled one.

    Returns (when called): the input unchanged, whose gradient is the upstream gradient
    clamped elementwise to ``[-clip_value, clip_value]``, in the input's dtype.
    """

    clip_value: float
    scaler: Any = dataclasses.field(default=None, repr=False, compare=False, kw_only=True)

    def __post_init__(self) -> None:
        if not (isinstance(self.clip_value, int | float) and self.clip_value >= 0):
            msg = (
                f"clip_grad_value needs `clip_value` to be a number >= 0 (gradients are "
                f"clamped to [-clip_value, clip_value]), got {self.clip_value!r}."
            )
            raise GradOverrideError(msg)
        _check_scaler("clip_grad_value", self.scaler)

    def transform(self, grad: Tensor) -> Tensor:
        """The upstream gradient clamped to ``[-clip_value, clip_value]``."""
        if not isinstance(grad, Tensor) and foreign(grad):
            return tensorflow_transform(self, grad)
        # (torch.clamp refuses a scalar bound the dtype cannot hold, 1e6 for float16: the
        # formula's bound never exceeds the dtype's largest value.)
        scale = None if self.scaler is None else _torch_loss_scale(self, grad)
        result: Tensor = flow.clip_by_value(TORCH, grad, self.clip_value, scale)
        return result


Dims = int | tuple[int, ...] | None


@dataclass(frozen=True, repr=False)
class clip_grad_norm(_WithScaler, GradientTransform):
    """Clipping by norm: identity forward; the gradient rescaled to norm at most `max_norm`.

    Formula (that of `torch.nn.utils.clip_grad_norm_`, per tensor or per slice):

    ```text
    norm = vector_norm(grad, ord=norm_type, dim=dim, keepdim=True)
    grad * clamp(max_norm / (norm + eps), max=1)
    ```

    A gradient whose norm is at most `max_norm` passes (almost) unchanged; a larger one keeps
    its direction and gets norm `max_norm` (up to `eps`). With `dim`, each slice is clipped on
    its own: for a `(batch, ...)` gradient, `dim=tuple(range(1, ndim))` clips per sample, as
    DP-SGD does. The norm is computed in at least float32, so a float16 gradient with a large
    sum of squares is not zeroed by overflow. A non-finite norm zeroes (inf) or poisons (NaN)
    the slice, as in torch; put `sanitize_grad` first when that can happen.

    ```python
    import torch
    from gradoverride.recipes import clip_grad_norm

    h = torch.zeros(2, 3, 4, requires_grad=True)  # (batch, time, channels)
    upstream = torch.ones(2, 3, 4)
    upstream[1] *= 10
    clip_grad_norm(max_norm=1.0, dim=(1, 2))(h).backward(upstream)  # per sample
    print([round(float(g.norm()), 4) for g in h.grad])
    #> [1.0, 1.0]
    ```

    Args:
        max_norm: the largest norm passed on, at least 0.
        dim: the dimensions the norm is taken over (as in `torch.linalg.vector_norm`);
            None (default) means the whole tensor.
        norm_type: the order of the norm (default 2; `math.inf` for the max-abs norm).
        eps: added to the norm before dividing, as in torch (default 1e-6).
        scaler: what scales the loss, if anything (keyword only): the `torch.amp.GradScaler`
            for torch tensors, or for TensorFlow ones the Keras `LossScaleOptimizer`
            (`model.optimizer` after `model.compile` under the `mixed_float16` policy). The
            gradients arrive multiplied by the loss scale s; with the scaler, `max_norm` (and
            `eps`) apply to the true (unscaled) gradient:
            ``clamp(max_norm * s / (norm + eps * s), max=1)``.

    Returns (when called): the input unchanged, with the clipped gradient, in its dtype.
    """

    max_norm: float
    dim: Dims = None
    norm_type: float = 2.0
    eps: float = 1e-6
    scaler: Any = dataclasses.field(default=None, repr=False, compare=False, kw_only=True)

    def __post_init__(self) -> None:
        if not (isinstance(self.max_norm, int | float) and self.max_norm >= 0):
            msg = (
                f"clip_grad_norm needs `max_norm` to be a number >= 0, got {self.max_norm!r}."
            )
            raise GradOverrideError(msg)
        dim = self.dim
        if not (
            dim is None
            or isinstance(dim, int)
            or (isinstance(dim, tuple) and all(isinstance(d, int) for d in dim))
        ):
            msg = (
                f"clip_grad_norm needs `dim` to be None (the whole tensor), an int or a tuple "
                f"of ints (the dimensions the norm is taken over), got {dim!r}."
            )
            raise GradOverrideTypeError(msg)
        _check_scaler("clip_grad_norm", self.scaler)

    def transform(self, grad: Tensor) -> Tensor:
        """The upstream gradient rescaled to norm at most `max_norm` (over `dim`)."""
        if not isinstance(grad, Tensor) and foreign(grad):
            return tensorflow_transform(self, grad)
        scale = None if self.scaler is None else _torch_loss_scale(self, grad)
        result: Tensor = flow.clip_by_norm(
            TORCH, grad, self.max_norm, self.dim, self.norm_type, self.eps, scale
        )
        return result


def _check_scaler(recipe: str, scaler: Any) -> None:
    if scaler is None or is_grad_scaler(scaler) or is_keras_loss_scaler(scaler):
        return
    if is_keras_optimizer(scaler):
        msg = (
            f"{recipe} needs `scaler` to be the Keras LossScaleOptimizer scaling the loss (or "
            f"None), got the Keras optimizer {type(scaler).__name__}, which scales no loss. "
            "`model.optimizer` is a LossScaleOptimizer after `model.compile` under the "
            "`mixed_float16` policy (`keras.mixed_precision.set_global_policy(...)` before "
            "building the model); without loss scaling, give no scaler."
        )
        raise GradOverrideTypeError(msg)
    msg = (
        f"{recipe} needs `scaler` to be the torch.amp.GradScaler scaling the loss (for "
        "TensorFlow gradients, the Keras LossScaleOptimizer), or None; got "
        f"{type(scaler).__name__} {scaler!r:.60}. Pass the scaler whose "
        "`scaler.scale(loss).backward()` runs the backward, or under Keras mixed precision "
        "`model.optimizer`."
    )
    raise GradOverrideTypeError(msg)


def _torch_loss_scale(recipe: clip_grad_value | clip_grad_norm, grad: Tensor) -> Tensor | float:
    """The GradScaler's current scale for a torch gradient; a Keras optimizer scales the
    losses of TensorFlow models, whose scale means nothing for this gradient."""
    scaler = recipe.scaler
    if is_keras_loss_scaler(scaler):
        name = type(recipe).__name__
        msg = (
            f"{name}(scaler=...) got a Keras {type(scaler).__name__}, and this gradient is a "
            "torch tensor: a Keras optimizer scales the loss of a Keras model on TensorFlow, "
            "not this one. For torch's mixed precision give the `torch.amp.GradScaler` whose "
            "`scaler.scale(loss).backward()` runs the backward, or no scaler."
        )
        raise GradOverrideError(msg)
    return loss_scale(scaler, grad)



# ---- NaN / inf ------------------------------------------------------------------------------

_MODES = ("replace", "raise")


@dataclass(frozen=True, repr=False)
class sanitize_grad(GradientTransform):
    """NaN/inf sanitizing: identity forward; non-finite gradient values replaced, or an error.

    ``mode="replace"`` (default) is `torch.nan_to_num(grad, nan, posinf, neginf)`: NaN becomes
    `nan` (0.0), +inf becomes `posinf` and -inf `neginf` (default: the dtype's largest and
    lowest finite values, as in `torch.nan_to_num`). ``mode="raise"`` stops the backward with
    `GradOverrideError` naming `name` and counting the NaN and infinite values; under
    `torch.compile` the check is `torch._assert_async` (no graph break), which raises a
    `RuntimeError` with the same message.

    ```python
    import torch
    from gradoverride.recipes import sanitize_grad

    logits = torch.zeros(3, requires_grad=True)
    sanitize_grad()(logits).backward(torch.tensor([1.0, float("nan"), float("inf")]))
    print(logits.grad.tolist())  # NaN -> 0, inf -> the largest float32
    #> [1.0, 0.0, 3.4028234663852886e+38]
    h = torch.zeros(2, requires_grad=True)
    check = sanitize_grad(mode="raise", name="encoder output")  # where do they start?
    try:
        check(h).backward(torch.tensor([1.0, float("nan")]))
    except Exception as error:
        print(type(error).__name__)
        #> GradOverrideError
    ```

    Args:
        mode: ``"replace"`` or ``"raise"``.
        nan: the value NaN becomes (replace mode).
        posinf: the value +inf becomes; None: the dtype's largest finite value.
        neginf: the value -inf becomes; None: the dtype's lowest finite value.
        name: the tensor's name in the error (raise mode); None: "a gradient".

    Returns (when called): the input unchanged, with the sanitized (or checked) gradient.
    """

    mode: Literal["replace", "raise"] = "replace"
    nan: float = 0.0
    posinf: float | None = None
    neginf: float | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            msg = (
                f"sanitize_grad got mode={self.mode!r}; the modes are "
                f"{', '.join(repr(m) for m in _MODES)}."
            )
            raise GradOverrideError(msg)
        for field in ("nan", "posinf", "neginf"):
            value = getattr(self, field)
            if value is not None and not (
                isinstance(value, int | float) and finite(value)
            ):
                msg = f"sanitize_grad needs `{field}` to be a finite number, got {value!r}."
                raise GradOverrideError(msg)

    def _message(self, grad: Tensor | None) -> str:
        counts = "" if grad is None else flow.non_finite_counts(TORCH, grad)
        return flow.non_finite_message(TORCH, self, counts)

    def transform(self, grad: Tensor) -> Tensor:
        """The upstream gradient with NaN/inf replaced, or checked (raise mode)."""
        if not isinstance(grad, Tensor) and foreign(grad):
            return tensorflow_transform(self, grad)
        if self.mode == "replace":
            result: Tensor = flow.replace_non_finite(
                TORCH, grad, self.nan, self.posinf, self.neginf
            )
            return result
        finite = torch.isfinite(grad).all()
        if torch.compiler.is_compiling():
            torch._assert_async(finite, self._message(None))
        elif not finite:
            raise GradOverrideError(self._message(grad))
        return grad
