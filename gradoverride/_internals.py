"""The few private torch pieces gradoverride relies on, each with a public fallback.

`tests/test_internals.py` checks that each piece is found on the tested torch (so a silent
fallback after an upgrade fails a test instead of slowing users down) and that the fallback
path gives the same gradients.

* `raw_apply(cls)`: `torch.autograd.Function.apply` runs `inspect.signature(...).bind()` on
  every call when a Function defines `setup_context` (the form `torch.func` needs), which
  makes it ~1.6x slower than a classic Function on small tensors. In eager mode with no
  `torch.func` transform active, `Function.apply` ends in `_C._FunctionBase.apply` after that
  bind and after unwrapping "dead" functorch wrappers (tensors from a finished transform);
  callers use `raw_apply(cls)` for that last step. We skip the unwrapping: the case it exists
  for (a rule that calls another op on tensors saved under `torch.func.vjp`, run from the
  returned `vjp_fn`) gives the right gradients without it, which
  `tests/test_internals.py` checks. While compiling or under a transform callers use
  `cls.apply`, so dynamo and functorch see exactly what they expect.
* `any_autocast_enabled()`: one C call instead of one per device type (dynamo folds it).
* `add_tensor_hook(t, fn)`: what `Tensor.register_hook` does for a tensor with no hooks yet
  (a dict of hooks set as `t._backward_hooks` and handed to `t.grad_fn._register_hook_dict`),
  without the `RemovableHandle` it builds and its other Python steps, which cost ~4 us a
  call, a few percent of a small layer's step: `grad_hook` hooks a fresh tensor on every
  call, and never removes that hook (it lives as long as the tensor). Any other tensor, one
  a `__torch_function__` override or mode would see, or a torch without these pieces, takes
  `Tensor.register_hook`.

Private torch pieces used elsewhere, each with a test that fails if it goes missing:

* `torch.nn.utils.stateless._reparametrize_module` (`_module.py`): what
  `torch.func.functional_call` is built on; lets a module rule see the parameters the forward
  saw. Without it, only partial ownership of parameters is refused, with a clear error.
* `torch.ops.aten._softmax_backward_data` (`recipes/_discrete.py`), with a written-out fallback.
* `torch._assert_async` (`recipes/_flow.py`, `sanitize_grad(mode="raise")` under compile).
* `torch.utils._pytree`: flattening container inputs and outputs (also used by torch.func).
* `torch._C._functorch` (`_bridge.py`): telling a transform's wrapped tensors (which numpy
  cannot read) from real ones, to refuse a bridge under `torch.func` by name.
* `torch._C._get_tracing_state` (`is_tracing`): whether `torch.jit.trace` is recording (the
  C call under `torch.jit.is_tracing`, which mypy sees untyped).
* `torch.autograd.Variable._execution_engine.queue_callback` (`diagnostics/_recorder.py`): run
  a function when the backward pass ends (what DDP's reducer uses); and
  `torch._C._current_graph_task_id` (`graph_task_id`), which backward pass is running, so that
  the monitor keeps each pass's gradients apart (two threads' passes, a failed pass; without
  it they would share a step).
* `torch._foreach_norm`, `_foreach_sign`, `_foreach_mul` (`diagnostics/_statistics.py`): the
  multi-tensor calls the monitor reduces gradients with.
* `torch._C._set_grad_enabled` (`set_grad_enabled`, `_override.py`): what
  `torch.set_grad_enabled(mode)` does, without making the context-manager object (the
  forward hooks of an override turn grad mode off and on around every call); dynamo traces
  it as a grad-mode change.
* `GradScaler._scale` (`loss_scale`): the scale a `torch.amp.GradScaler` multiplies the loss
  by, as the tensor on its device, so that a clipping recipe reads it in backward without a
  synchronization (`get_scale()` reads it back to the host); `get_scale()` where it is absent.

Not torch, but beside it: `is_keras_loss_scaler` tells Keras' `LossScaleOptimizer` (the other
`scaler=` the clipping recipes take) by its class, looked up only when Keras is already in
`sys.modules`, so checking a recipe's arguments never imports Keras.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "FAST_APPLY",
    "FAST_TENSOR_HOOKS",
    "add_tensor_hook",
    "any_autocast_enabled",
    "graph_task_id",
    "in_compiled_autograd",
    "is_batched",
    "is_grad_scaler",
    "is_keras_loss_scaler",
    "is_keras_optimizer",
    "is_tracing",
    "is_transformed",
    "loss_scale",
    "loss_scale_value",
    "raw_apply",
    "set_grad_enabled",
    "tracing_state",
    "transforms_active",
]


try:
    _function_base_apply: Any = torch._C._FunctionBase.__dict__["apply"]
    transforms_active: Callable[[], bool] = torch._C._are_functorch_transforms_active
    FAST_APPLY = True
except (AttributeError, ImportError, KeyError):  # pragma: no cover - depends on torch version
    FAST_APPLY = False

    def transforms_active() -> bool:
        return True


def raw_apply(cls: type[torch.autograd.Function]) -> Callable[..., Any]:
    """`cls.apply` without its per-call signature binding (eager, no transform only)."""
    if not FAST_APPLY:  # pragma: no cover
        return cls.apply
    raw: Callable[..., Any] = _function_base_apply.__get__(None, cls)
    return raw


try:
    any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled
except AttributeError:  # pragma: no cover - depends on torch version

    def any_autocast_enabled() -> bool:
        return any(
            torch.is_autocast_enabled(device)
            for device in ("cpu", "cuda", "xpu", "mps", "hpu")
            if torch.amp.is_autocast_available(device)
        )


_has_torch_function_unary: Callable[[Any], bool] = torch._C._has_torch_function_unary
try:
    from torch.utils.hooks import RemovableHandle as _RemovableHandle

    FAST_TENSOR_HOOKS = hasattr(_RemovableHandle, "next_id") and hasattr(
        Tensor, "_backward_hooks"
    )
except ImportError:  # pragma: no cover - depends on torch version
    FAST_TENSOR_HOOKS = False


def add_tensor_hook(t: Tensor, fn: Callable[[Tensor], Tensor | None]) -> None:
    """`t.register_hook(fn)`, with no handle returned: for a tensor that requires grad."""
    if FAST_TENSOR_HOOKS and t._backward_hooks is None and not _has_torch_function_unary(t):
        grad_fn = t.grad_fn
        register = getattr(grad_fn, "_register_hook_dict", None)
        if register is not None:
            hooks: OrderedDict[int, Any] = OrderedDict()
            t._backward_hooks = hooks
            register(t)
            # A key from the handles' own counter, so a later `register_hook` on `t` does
            # not reuse it.
            key = _RemovableHandle.next_id
            _RemovableHandle.next_id = key + 1
            hooks[key] = fn
            return
    register_hook: Callable[..., Any] = t.register_hook
    register_hook(fn)


def is_batched(value: Any) -> bool:
    """Whether `value` is a tensor batched by torch.func.vmap, at any level of the transforms
    (`vmap(grad(f))` wraps it in a grad-tracking tensor first): numpy would get its
    unbatched storage-less inside."""
    functorch = torch._C._functorch
    while isinstance(value, Tensor):
        if functorch.is_batchedtensor(value):
            return True
        if not functorch.is_functorch_wrapped_tensor(value):
            return False
        value = functorch.get_unwrapped(value)
    return False


def is_transformed(value: Any) -> bool:
    """Whether `value` is a tensor wrapped by a torch.func transform: batched (vmap) or
    grad-tracking (grad, jacrev, ...); neither has storage numpy could read."""
    return is_batched(value) or (
        isinstance(value, Tensor) and bool(torch._C._functorch.is_gradtrackingtensor(value))
    )


#: `torch.set_grad_enabled(mode)` as a plain call (see the module docstring).
def _set_grad_enabled_fallback(mode: bool) -> None:  # pragma: no cover - torch version
    torch.set_grad_enabled(mode)


set_grad_enabled: Callable[[bool], None] = getattr(
    torch._C, "_set_grad_enabled", _set_grad_enabled_fallback
)

#: The C call under `torch.jit.is_tracing` (mypy sees it untyped): not None while
#: torch.jit.trace records.
tracing_state: Callable[[], Any] = torch._C._get_tracing_state


def is_tracing() -> bool:
    """Whether torch.jit.trace is recording."""
    return tracing_state() is not None


_CURRENT_GRAPH_TASK: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)


def graph_task_reader() -> Callable[[], int] | None:
    """torch's own reader of the running backward pass's id (-1 outside one), for callers
    that read it on every op call; None where this torch has none."""
    return _CURRENT_GRAPH_TASK


def graph_task_id() -> int | None:
    """The id of the backward pass running in this thread (-1 outside one); None where this
    torch does not say."""
    current = _CURRENT_GRAPH_TASK
    return None if current is None else current()


def in_compiled_autograd() -> bool:
    """Whether compiled autograd is tracing the backward now (a plain compiled backward,
    traced by AOTAutograd, is not): read from its module, never imported here."""
    import sys

    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return module is not None and bool(getattr(module, "in_compiled_autograd_region", False))


def is_grad_scaler(value: Any) -> bool:
    """Whether `value` works as a `torch.amp.GradScaler` (what `scaler=` arguments take)."""
    return callable(getattr(value, "get_scale", None)) and callable(
        getattr(value, "is_enabled", None)
    )


def _keras_optimizer_class(name: str) -> type | None:
    """`keras.optimizers.<name>` if Keras is already imported, else None: gradoverride never
    imports Keras itself (a user with a Keras optimizer in hand has imported it)."""
    import sys

    keras = sys.modules.get("keras")
    found = getattr(getattr(keras, "optimizers", None), name, None)
    return found if isinstance(found, type) else None


def is_keras_loss_scaler(value: Any) -> bool:
    """Whether `value` is a Keras `LossScaleOptimizer` (what `model.optimizer` is after
    `model.compile` under the `mixed_float16` policy), which the clipping recipes' `scaler=`
    takes for TensorFlow gradients."""
    cls = _keras_optimizer_class("LossScaleOptimizer")
    return cls is not None and isinstance(value, cls)


def is_keras_optimizer(value: Any) -> bool:
    """Whether `value` is any Keras optimizer (for the error naming a plain one)."""
    cls = _keras_optimizer_class("Optimizer")
    return cls is not None and isinstance(value, cls)


def loss_scale_value(scaler: Any) -> float:
    """`loss_scale` read back as a number (one synchronization with the device)."""
    if not scaler.is_enabled() or getattr(scaler, "_scale", True) is None:
        return 1.0  # disabled, or no loss scaled yet: the gradients are the true ones
    return float(scaler.get_scale())


def loss_scale(scaler: Any, like: Tensor) -> Tensor | float:
    """The scale `scaler` (a `torch.amp.GradScaler`) multiplies the loss by now: a tensor
    on `like`'s device, or 1.0 when it is disabled or has not scaled a loss yet."""
    if not scaler.is_enabled():
        return 1.0
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, Tensor):
        return scale.to(like.device, torch.promote_types(like.dtype, torch.float32))
    return float(scaler.get_scale()) if scale is not None else 1.0
