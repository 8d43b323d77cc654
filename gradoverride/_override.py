"""`go.override_backward`: a backward rule given to an existing module instance, in place.

The module keeps its identity, class, `forward`, parameters and `state_dict` keys: the
override is a pair of forward hooks (PyTorch's own mechanism for acting around a module's
call), which attach the op `_module_op` builds for the module's forward to what the forward
returns:

* the pre-hook binds the call and reads the module's parameters; where the rule owns every
  input and parameter, it turns grad mode off for the forward (which then records no graph,
  as inside an autograd Function), and where it owns some, it hands the forward the owned
  inputs detached and the owned parameters swapped for detached ones;
* the forward hook restores the grad mode and attaches the rule to the outputs.

Hooks receive the module being called, so a copy (`copy.copy`, `deepcopy`) or a replica
(`nn.DataParallel`) runs itself, with the override. The hooks are objects that pickle as
what installs them again (the rule by reference), so a saved model loads back with its
override.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.compiler import is_dynamo_compiling
from torch.utils.hooks import RemovableHandle

from ._backends import backend
from ._errors import GradOverrideError, GradOverrideTypeError
from ._frameworks import autograph_artifact, is_keras_layer, require_tensorflow_keras
from ._function import RECORDERS, CallState, break_compiled_transform, exporting_onnx
from ._internals import set_grad_enabled as _set_grad_enabled
from ._internals import tracing_state, transforms_active
from ._jit import RefuseScripting, jit_message
from ._module import Module
from ._module_op import (
    CHECKED,
    ModuleOp,
    ModuleRule,
    call_state,
    compiled_inplace_message,
    mark_checked,
    parameters_of,
    reads_inplace,
    refuse_inplace_views,
)
from ._signature import describe

__all__ = ["OverrideHandle", "override_backward"]

class _Frame:
    """What the pre-hook leaves for the forward hook of the same call."""

    __slots__ = ("attach", "audit", "grad_off", "op", "seen", "state", "swapped", "values")

    def __init__(self, op: ModuleOp, values: tuple[Any, ...], state: CallState) -> None:
        self.attach = True  # False: the forward alone (see `_Override.before`)
        self.op = op
        self.values = values
        self.state = state
        self.grad_off = False
        self.swapped: Any = None  # the reparametrization to leave (owned parameters)
        self.audit: Any = None  # the first-call check in progress
        self.seen: tuple[Any, ...] = ()  # the detached tensors the forward sees instead


class _Given:
    """The pre-hook's frame for a call the generated twin attaches (see `_Override.before`)."""

    __slots__ = ("op", "values")

    def __init__(self, op: ModuleOp, values: tuple[Any, ...]) -> None:
        self.op = op
        self.values = values


class _Calls(threading.local):
    """Per thread, the calls in progress (a module may call itself, or another overridden
    module, inside its forward)."""

    def __init__(self) -> None:
        self.frames: list[_Frame | _Given | None] = []


#: `_Override.after`'s output when it is called without keyword arguments.
_NO_OUTPUT: Any = object()


class _Override:
    """The hooks of one `override_backward`: `before` (forward pre-hook) and `after`
    (forward hook), for whichever module they are called with."""

    def __init__(self, cls: type[nn.Module], rule: Callable[..., Any],
                 options: dict[str, Any]) -> None:
        self.cls = cls
        self.rule = rule
        self.options = options
        self.module_rule = ModuleRule(
            where=f"`{cls.__name__}`", forward=cls.forward, rule=rule, method=False,
            residuals=(), runs_forward=False, **options,
        )
        self.calls = _Calls()

    def rule_for(self, module: nn.Module) -> ModuleRule:
        # A copy of another class (rare: a module whose class was swapped, as
        # `register_parametrization` does) reads its own forward.
        rule = self.module_rule
        if type(module).forward is not rule.forward:
            rule = self.module_rule = ModuleRule(
                where=f"`{type(module).__name__}`", forward=type(module).forward,
                rule=self.rule, method=False, residuals=(), runs_forward=False,
                **self.options,
            )
        return rule

    def before(self, module: nn.Module, args: tuple[Any, ...],
               kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            # Registered again without its keyword arguments (torch.ao.quantization's module
            # swap copies a module's hooks that way): the same, giving the inputs alone.
            given = self.before(module, args, {})
            return None if given is None else given[0]
        frames = self.calls.frames
        # A place for this call's frame first: the forward hook runs even when this one
        # raises, and takes it.
        frames.append(None)
        if not torch.is_grad_enabled():
            return None  # no gradient can be computed: the plain forward
        if tracing_state() is not None:
            if exporting_onnx():
                return None  # an inference graph (see `exporting_onnx`): the plain forward
            raise GradOverrideError(jit_message(self.module_rule.where, "torch.jit.trace"))
        compiling = is_dynamo_compiling()
        if not compiling:
            self._check_order(module)
        if compiling and transforms_active():
            break_compiled_transform(self.module_rule.where.strip("`"))
        rule = self.rule_for(module)
        last = rule.last
        if last is not None and not compiling:
            # The layout of the last call, read by the op's generated reader (see
            # `go.Module`'s call): the generated twin attaches the rule to the output.
            values = last[0](module, args, kwargs)
            if (
                values is not None and last[1]._route.given is not None
                and id(module) in CHECKED and not transforms_active()
            ):
                frames[-1] = _Given(last[1], values)
                _set_grad_enabled(False)
                return None
        names, params = parameters_of(module)
        inplace = reads_inplace(module)
        op = rule.op_for(names, inplace, module)
        values = rule.values(module, args, kwargs, params)
        state = call_state(module, rule.where) or CallState()
        frame = _Frame(op, values, state)
        owns_all = op._rule.owns_all
        if is_dynamo_compiling() and not any(
            isinstance(v, Tensor) and v.requires_grad for v in _leaves(values)
        ):
            # No gradient can be computed (a frozen model, compiled): the forward alone, as
            # the rule's forward would run (dynamo cannot trace an autograd Function none of
            # whose inputs requires grad).
            frame.attach = False
        if inplace:
            if is_dynamo_compiling():
                raise GradOverrideError(compiled_inplace_message(rule.where))
            refuse_inplace_views(rule.where, values[1 : len(values) - len(params)])
            # The inputs the rule reads, as they were called with; the inputs' version
            # counters, to mark the ones the forward changes.
            requested = {slot for _, slot in op._rule.requested_slots}
            state.copies = {
                i: v.detach().clone() for i, v in enumerate(values)
                if i in requested and isinstance(v, Tensor)
            }
            state.versions = tuple(v._version if isinstance(v, Tensor) else None
                                   for v in values)
        frames[-1] = frame
        if not inplace and not compiling:
            reader = op.reader(module)
            if reader is not None:
                rule.last = (reader, op)
        if not is_dynamo_compiling() and id(module) not in CHECKED and not transforms_active():
            from ._audit import ModuleAudit  # imported at the first check

            frame.audit = ModuleAudit(op, values, state)
            frame.audit.begin()
        if owns_all:
            # The forward records no graph, as inside an autograd Function: the rule gives
            # every gradient.
            _set_grad_enabled(False)
            frame.grad_off = True
            return None
        if not frame.attach:
            return None
        return self._detach_owned(module, op, rule, args, kwargs, params, frame)

    def _check_order(self, module: nn.Module) -> None:
        """The override's pre-hook must run last and its forward hook first: a pre-hook
        registered after it would change the inputs after the rule took them (and with
        grad off), a forward hook prepended after it would see the output before the rule
        is attached; either would silently lose a gradient."""
        if len(module._forward_pre_hooks) == 1 and len(module._forward_hooks) == 1:
            return  # the override's own two (the common case)
        last = next(reversed(module._forward_pre_hooks.values()))
        first = next(iter(module._forward_hooks.values()))
        if getattr(last, "__self__", None) is self and getattr(first, "__self__", None) is self:
            return
        which = (
            "a forward pre-hook registered after it runs after the override took the inputs "
            "(grad off where its rule owns them all), so the rule would not see what the hook "
            "changes and the hook's gradient would be lost"
            if getattr(last, "__self__", None) is not self
            else "a forward hook registered after it with prepend=True runs before the override "
            "attaches its rule, so it would see an output without the rule's gradient"
        )
        msg = (
            f"{self.module_rule.where} has an override_backward, and {which}. Register that "
            "hook before calling override_backward (or remove the override, register the "
            "hook, and override again)."
        )
        raise GradOverrideError(msg)

    def _detach_owned(
        self, module: nn.Module, op: ModuleOp, rule: ModuleRule, args: tuple[Any, ...],
        kwargs: dict[str, Any], params: tuple[Tensor, ...], frame: _Frame,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The forward sees the owned inputs and parameters detached: the others keep their
        ordinary gradient through its graph."""
        owned = op._rule.owned
        n_forward = len(rule.signature.names)
        owned_names = {rule.signature.names[i] for i in range(1, n_forward) if owned[i]}
        swap = {
            name: p.detach() for name, p, is_owned in zip(
                op.slots.params, params, owned[n_forward:], strict=True
            ) if is_owned
        }
        if swap:
            if is_dynamo_compiling():
                import torch._dynamo  # (imported: dynamo is tracing)

                torch._dynamo.graph_break(msg=(
                    f"override_backward of {self.module_rule.where} owns some of its "
                    "parameters but not all, and swaps the owned ones for detached copies "
                    "around its forward, which torch.compile cannot trace whole (a graph "
                    "break). Own every parameter or none, or subclass go.Module with `owns=` "
                    "to compile it with fullgraph=True."
                ))
            frame.swapped = _swap_parameters(module, swap)
        bound = rule.signature.bind((module, *args), kwargs)
        detached = {
            name: _detached(value) for name, value in zip(rule.signature.names, bound,
                                                          strict=True)
            if name in owned_names
        }
        positional = _positional(rule.signature, args)
        new_args = tuple(
            detached.get(name, value) if name is not None else value
            for name, value in zip(positional, args, strict=False)
        )
        new_kwargs = {k: detached.get(k, v) for k, v in kwargs.items()}
        frame.seen = (*swap.values(), *_leaves(tuple(detached.values())))
        return new_args, new_kwargs

    def after(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              output: Any = _NO_OUTPUT) -> Any:
        if output is _NO_OUTPUT:
            # Registered again without its keyword arguments (see `before`): the third
            # argument is the output.
            return self.after(module, args, {}, kwargs)
        frames = self.calls.frames
        popped = frames.pop() if frames else None
        if popped is None:
            return None
        if isinstance(popped, _Given):
            _set_grad_enabled(True)
            given = popped.op._route.given
            if type(output) is Tensor and given is not None:
                result = given(popped.values, output)
                for recorder in RECORDERS:
                    recorder.module_output(module, popped.op, result)
                return result
            if output is None:  # the forward raised (this hook is called anyway)
                return None
            # Not one tensor: the general attach.
            frame = _Frame(popped.op, popped.values, CallState())
        else:
            frame = popped
        if frame.grad_off:
            _set_grad_enabled(True)
        if frame.swapped is not None:
            _restore_parameters(frame.swapped)
        audit = frame.audit
        if output is None or not frame.attach:
            # The forward raised (this hook is called anyway), or runs alone.
            if audit is not None:
                audit.end()
            return None
        attach = frame.op._route.attach
        assert attach is not None  # (a module's op attaches)
        if audit is None:
            result = attach(frame.values, frame.state, output, frame.seen)
        else:
            try:
                result = attach(frame.values, frame.state, output, frame.seen)
            finally:
                audit.end()
            audit.finish(result)
            mark_checked(module)
        if RECORDERS and not is_dynamo_compiling():
            for recorder in RECORDERS:
                recorder.module_output(module, frame.op, result)
        return result

    def __reduce__(self) -> tuple[Any, ...]:
        from ._pickling import require_importable

        require_importable(
            self.rule, f"`{self.module_rule.where.strip('`')}` (overridden)", "its backward rule"
        )
        return (_Override, (self.cls, self.rule, self.options))

    def __deepcopy__(self, memo: dict[int, Any]) -> _Override:
        # A copy shares the rule, as PyTorch's copy of a module shares its hooks' functions.
        copy = _Override.__new__(_Override)
        copy.cls, copy.rule, copy.options = self.cls, self.rule, self.options
        copy.module_rule = self.module_rule
        copy.calls = _Calls()
        return copy

    def __repr__(self) -> str:
        return f"<override of {self.module_rule.where} with backward {describe(self.rule)}>"


def _swap_parameters(
    module: nn.Module, swap: dict[str, Tensor]
) -> list[tuple[nn.Module, str, Any]]:
    """Hold `swap` (tensors by parameter name) in `module`'s parameters' places for its
    forward, as `torch.func.functional_call` does (plain dict writes, which torch.compile
    traces); what `_restore_parameters` puts back."""
    held: list[tuple[nn.Module, str, Any]] = []
    for name, tensor in swap.items():
        prefix, _, leaf = name.rpartition(".")
        owner = module.get_submodule(prefix) if prefix else module
        held.append((owner, leaf, owner._parameters[leaf]))
        owner._parameters[leaf] = tensor  # type: ignore[assignment]
    return held


def _restore_parameters(held: list[tuple[nn.Module, str, Any]]) -> None:
    for owner, leaf, original in held:
        owner._parameters[leaf] = original


def _leaves(values: tuple[Any, ...]) -> list[Any]:
    from torch.utils import _pytree as pytree

    return pytree.tree_leaves(values)


def _detached(value: Any) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda v: v.detach() if isinstance(v, Tensor) else v, value)


def _positional(signature: Any, args: tuple[Any, ...]) -> list[str | None]:
    """The forward's parameter that receives each positional argument (None: `*args`)."""
    import inspect

    params = list(signature.signature.parameters.values())[1:]
    names: list[str | None] = []
    for p in params:
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
    return names + [None] * max(0, len(args) - len(names))


def _hooks_of(module: nn.Module) -> list[tuple[int, _Override]]:
    """The override hooks on `module`: (key, override) for each hook of either kind."""
    found = []
    for table in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in table.items():
            owner = getattr(hook, "__self__", None)
            if isinstance(owner, _Override):
                found.append((key, owner))
    return found


def overrides_of(module: nn.Module) -> list[_Override]:
    """The `override_backward`s installed on `module` (one at most)."""
    found: list[_Override] = []
    for _, override in _hooks_of(module):
        if override not in found:
            found.append(override)
    return found


class OverrideHandle:
    """Returned by `override_backward`; `.remove()` restores the module exactly.

    Removing twice is a no-op. For a module loaded with its override (`torch.load`,
    `copy.deepcopy`), `OverrideHandle.of(module)` gives the handle.
    """

    def __init__(self, module: nn.Module, override: _Override) -> None:
        self._module = module
        self._override = override

    @classmethod
    def of(cls, module: nn.Module) -> OverrideHandle:
        """The handle of the override installed on `module` (after a load or a copy)."""
        found = _hooks_of(module)
        if not found:
            msg = (
                f"this {type(module).__name__} has no override from `go.override_backward`, "
                "so there is no handle to give; check `OverrideHandle.of` is called on the "
                "overridden module itself (not its parent)."
            )
            raise GradOverrideError(msg)
        return cls(module, found[0][1])

    @property
    def active(self) -> bool:
        """Whether the override is still installed."""
        return any(hook is self._override for _, hook in _hooks_of(self._module))

    def remove(self) -> None:
        module = self._module
        for key, hook in _hooks_of(module):
            if hook is self._override:
                for table in (
                    module._forward_pre_hooks, module._forward_hooks,
                    module._forward_pre_hooks_with_kwargs, module._forward_hooks_with_kwargs,
                    module._forward_hooks_always_called,
                ):
                    table.pop(key, None)
        if not _hooks_of(module) and isinstance(
            module.__dict__.get("__prepare_scriptable__"), RefuseScripting
        ):
            del module.__dict__["__prepare_scriptable__"]

    def __enter__(self) -> OverrideHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "active" if self.active else "removed"
        return f"<OverrideHandle on {type(self._module).__name__} ({state})>"


@autograph_artifact
def override_backward(
    module: nn.Module,
    rule: Callable[..., Any],
    *,
    owns: str | Iterable[str] | None = None,
    once_differentiable: bool = False,
    materialize_grads: bool = True,
) -> OverrideHandle:
    """Give an existing module instance a backward rule, in place.

    ```python
    import torch
    from torch import nn
    import gradoverride as go

    linear = nn.Linear(4, 3)

    def rule(grad, *, input, module):  # `input`: nn.Linear.forward's parameter
        return {"input": grad @ module.weight, "weight": grad.T @ input, "bias": None}

    handle = go.override_backward(linear, rule)
    linear(torch.ones(2, 4)).sum().backward()
    print(linear.bias.grad)  # the rule gave the bias no gradient
    #> None
    handle.remove()  # back to the ordinary backward
    ```

    The module keeps its identity, class, parameters and `state_dict` keys: only calls to it
    change, through a pair of forward hooks. The rule follows the `custom_backward` contract
    with the names of the module's own `forward` parameters, its parameters by
    `named_parameters()` name, and the reserved name `module` for the module being called.
    The rule reads each parameter as the forward saw it (under
    `torch.func.functional_call`, the tensors passed in). A copy of the module
    (`copy.copy`, `copy.deepcopy`) or a replica (`nn.DataParallel`) keeps the override and
    runs itself: its own parameters, buffers and mode.

    `torch.save` / `pickle` of the module (or a model holding it) store the override, with
    the rule by reference (so the rule must be a module-level function; a lambda is refused
    with a `GradOverrideError` when saving); loading installs it again, and
    `OverrideHandle.of(module)` gives its handle. A module built with `inplace=True`
    (`nn.ReLU(inplace=True)`) changes its input in place: the rule gets a copy of each input
    it names, taken before the forward, and the caller's tensor is changed as without the
    override. When no gradient can be computed (`torch.no_grad()`, `inference_mode`), the
    module runs as without the override. TorchScript cannot keep the rule:
    `torch.jit.script`, and `torch.jit.trace` with grad enabled, raise `GradOverrideError`.

    Args:
        module: the `nn.Module` instance, or a Keras 3 layer (a `LayerHandle` is returned
            then; see the TensorFlow and Keras docs page).
        rule: `rule(*upstream_grads, *, names...)`.
        owns: as for `custom_backward`, naming inputs and parameters (default: all).
        once_differentiable: as for `custom_backward`.
        materialize_grads: as for `custom_backward`.

    Returns:
        An `OverrideHandle`; `.remove()` restores the original behaviour (bitwise: the
        module's own forward and backward run again). Overriding a module that already has
        an override raises `GradOverrideError`; remove the first one before adding another.

    What the rule may return: as for `go.Module`'s `backward`, a dict by name (the forward's
    parameter names, `input` for `nn.Linear`, and `named_parameters()` names such as
    `"weight"`; every owned one that holds a tensor present, None for no gradient), or a
    tensor when exactly one owned input or parameter needs a gradient. Shapes, dtypes and
    devices are checked as for `custom_backward`.
    """
    if is_keras_layer(module):  # first: on Keras' torch backend, a layer is an nn.Module
        require_tensorflow_keras(module, "override_backward")
        # The Keras layer's handle (a LayerHandle).
        return backend("tensorflow").override_layer(  # type: ignore[no-any-return]
            module, rule, owns=owns, once_differentiable=once_differentiable,
            materialize_grads=materialize_grads,
        )
    if not isinstance(module, nn.Module):
        msg = (
            f"override_backward needs an nn.Module instance, got {type(module).__name__} "
            f"{module!r}; for a function, use `go.custom_backward(fn, backward=rule)`."
        )
        raise GradOverrideTypeError(msg)
    if _hooks_of(module):
        msg = (
            f"this {type(module).__name__} already has an override (an earlier "
            "`override_backward`); call `.remove()` on its handle before overriding again."
        )
        raise GradOverrideError(msg)
    if isinstance(module, Module) and type(module)._gradoverride_rule is not None:
        msg = (
            f"`{type(module).__qualname__}` is a `go.Module` with its own backward; change "
            "that method instead of overriding it."
        )
        raise GradOverrideError(msg)
    options = {
        "owns": owns,
        "once_differentiable": once_differentiable,
        "materialize_grads": materialize_grads,
    }
    override = _Override(type(module), rule, options)
    # Built now, so that a first call under torch.compile(fullgraph=True) finds it.
    override.module_rule.check(module)
    install(module, override)
    return OverrideHandle(module, override)


def install(module: nn.Module, override: _Override) -> None:
    """Register `override`'s hooks on `module`: the pre-hook after the others (nearest the
    forward), the forward hook first (its output is what the others see)."""
    pre: RemovableHandle = module.register_forward_pre_hook(override.before, with_kwargs=True)
    module.register_forward_hook(override.after, with_kwargs=True, always_call=True,
                                 prepend=True)
    assert pre.id is not None
    if "__prepare_scriptable__" not in module.__dict__:
        module.__dict__["__prepare_scriptable__"] = RefuseScripting(f"`{type(module).__name__}`")
