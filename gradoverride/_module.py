"""`go.Module`: an `nn.Module` whose subclass defines `backward` next to `forward`.

The class's `forward` is its rule's op (see `_module_op`): a call binds the forward's
arguments, reads the module's parameters, and runs the op, whose forward is the class's own
`forward`. The rule is the `backward` the module has at the call: the class's, one
assigned to the class later (or patched, as `unittest.mock.patch.object` does), or a
function assigned on the instance (called as a plain function, not bound, as Python
calls any function held by an instance).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.compiler import is_dynamo_compiling

from ._errors import GradOverrideError, GradOverrideTypeError
from ._function import RECORDERS, exporting_onnx
from ._internals import tracing_state, transforms_active
from ._jit import jit_message, refuse_scripting
from ._module_op import (
    CHECKED,
    ModuleRule,
    call_state,
    compiled_inplace_message,
    mark_checked,
    parameters_of,
    reads_inplace,
    refuse_inplace_views,
)
from ._rule import normalize_names

__all__ = ["Module", "require_backward"]


class _ModuleMeta(type):
    """Checks a rule's parameter names once an instance has its parameters (after __init__),
    and builds the op for them then, so the first call may be a compiled one."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        instance = super().__call__(*args, **kwargs)
        rule = getattr(cls, "_gradoverride_rule", None)
        if rule is not None:
            rule.check(instance)
        return instance


def require_backward(cls: type, abstract: bool, *, base: str, plain: str) -> Any:
    """`cls.backward`, or None for an abstract base; a subclass of `base` (go.Module,
    gradoverride.keras.Layer) without one, or with a misspelled one, is refused: it would
    silently train with its ordinary gradient. `plain` is the class to subclass instead."""
    misspelled = _close_names(cls, "backward") if "backward" not in cls.__dict__ else []
    backward = getattr(cls, "backward", None)
    if misspelled or (backward is None and not abstract):
        guess = f" (did you mean `{misspelled[0]}`? name it `backward`)" if misspelled else ""
        what = "overrides nothing" if backward is not None else "defines no `backward`"
        msg = (
            f"`{cls.__qualname__}` subclasses {base} but {what}{guess}; without a "
            "`backward` it would silently train with its ordinary gradient. Define "
            "`def backward(self, grad, *, x): ...` returning the gradients by name, "
            f"subclass `{plain}` if it needs no rule of its own, or declare "
            f"`class {cls.__name__}({base}, abstract=True)` for a base class meant to "
            "be subclassed."
        )
        raise GradOverrideTypeError(msg)
    return backward


def _close_names(cls: type, target: str) -> list[str]:
    """Attributes defined on `cls` that look like a misspelling of `target`."""
    candidates = [n for n in cls.__dict__ if n != target and not n.startswith("__")]
    lowered = {n.lower(): n for n in candidates}
    close = difflib.get_close_matches(target, list(lowered), n=3, cutoff=0.75)
    return [lowered[n] for n in close]


class Module(nn.Module, metaclass=_ModuleMeta):
    """An `nn.Module` whose subclass defines `backward` next to `forward`.

    ```python
    import torch
    from torch import nn
    import gradoverride as go

    class LayerWithCustomGrad(go.Module):
        def __init__(self):
            super().__init__()
            self.weights = nn.Parameter(torch.ones(3))

        def forward(self, x):
            return x * self.weights

        def backward(self, grad, *, x):  # names what it needs: here the input x
            return {"x": grad * self.weights, "weights": grad * x}

    layer = LayerWithCustomGrad()
    layer(torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    print(layer.weights.grad)
    #> tensor([1., 2., 3.])
    ```

    `backward(self, *upstream_grads, *, names...)` follows the `custom_backward` contract; it
    returns gradients for inputs and parameters by name (`named_parameters()` names). By
    default it owns every input and parameter; `class Layer(go.Module, owns=("x",))` makes
    it own only `x`, the rest keeping their ordinary autograd gradients. Class keywords
    `once_differentiable`, `materialize_grads` and `residuals` are those of
    `custom_backward`.

    In `backward`, `self.<parameter>` is the tensor the forward used, owned or not: under
    `torch.func.functional_call(layer, params, ...)`, the one in `params`; a parameter
    changed in place between forward and backward (an optimizer step in between) raises
    when the rule reads it. Buffers are read as the forward saw them too.

    The rule is the `backward` the module has when it is called: assigning another to the
    class (or patching it) or to the instance takes effect at the next call. One assigned
    on the instance is called as a plain function, without `self`.

    A subclass must define `backward` (a missing or misspelled one is an error when the class
    is created, since the module would silently train with its ordinary gradient); a base
    class meant only to be subclassed says so with `class Base(go.Module, abstract=True)`.

    When no gradient can be computed (`torch.no_grad()`, `inference_mode`, nothing requiring
    grad), the module runs its own forward directly: the rule cannot matter (also the dry
    run that lazy modules need). A module built with `inplace=True` (changing its input in
    place) gets a copy of each input its rule names, taken before the forward. TorchScript
    (`torch.jit.script`, and `torch.jit.trace` with grad enabled) cannot keep the rule and
    raises `GradOverrideError`; `torch.compile` keeps it.

    What backward may return:
        - a dict by name: forward parameters (`"x"`) and the module's parameters as
          `named_parameters()` names them (`"weights"`, `"inner.weight"`), every owned one
          that holds a tensor present (None for no gradient);
        - a tuple with one gradient per input of the forward, when no parameter it owns
          needs a gradient;
        - a tensor (or None) when exactly one owned input or parameter needs a gradient.

        Each gradient must have its tensor's shape, or one the tensor broadcasts to (summed
        down to it); another floating-point precision is cast. Any other shape, dtype kind
        or device, a gradient for something the rule does not own, or writing `.grad`
        yourself raises `GradOverrideError`. Parameter gradients flow through autograd:
        they accumulate, fire hooks and reach DDP.
    """

    _gradoverride_rule: ModuleRule | None = None

    def __init_subclass__(
        cls,
        *,
        owns: str | Iterable[str] | None = None,
        once_differentiable: bool = False,
        materialize_grads: bool = True,
        residuals: str | Iterable[str] | None = None,
        abstract: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        backward = require_backward(cls, abstract, base="go.Module", plain="nn.Module")
        if backward is None:
            return
        if "forward" not in cls.__dict__ and "backward" not in cls.__dict__:
            return  # inherits a wrapped forward and its rule unchanged
        forward = cls.__dict__.get("forward", None)
        if forward is None:
            forward = getattr(cls, "_gradoverride_forward", None) or cls.forward
        if forward is nn.Module.forward:
            msg = f"`{cls.__qualname__}` defines `backward` but no `forward`; define both."
            raise GradOverrideTypeError(msg)
        options: dict[str, Any] = {
            "owns": owns,
            "residuals": normalize_names(residuals, "residuals", cls.__qualname__),
            "once_differentiable": once_differentiable,
            "materialize_grads": materialize_grads,
        }
        cls._gradoverride_forward = forward  # type: ignore[attr-defined]
        cls._gradoverride_options = options  # type: ignore[attr-defined]
        # The rule of each `backward` met, by function (the class's, and any assigned later).
        cls._gradoverride_rules = {}  # type: ignore[attr-defined]
        cls._gradoverride_rule = _rule_of(cls, backward, method=True)

        def forward_with_rule(self: Module, *args: Any, **kwargs: Any) -> Any:
            if type(self)._gradoverride_forward is not forward:  # type: ignore[attr-defined]
                # A subclass's forward calling this one (`super().forward(x)`), inside the
                # subclass's rule: this class's forward, as a step of it.
                return forward(self, *args, **kwargs)
            return _call(self, args, kwargs)

        functools.update_wrapper(forward_with_rule, forward)
        # No `__wrapped__`: TorchScript would compile the original forward through it, and
        # the rule would be silently dropped (`__prepare_scriptable__` refuses instead).
        del forward_with_rule.__wrapped__  # type: ignore[attr-defined]
        forward_with_rule.__qualname__ = f"{cls.__qualname__}.forward"
        cls.forward = forward_with_rule

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script calls this on every module it scripts.
        refuse_scripting(f"`{type(self).__qualname__}`")


def _rule_of(cls: type, backward: Callable[..., Any], method: bool,
             compiling: bool = False) -> ModuleRule:
    """The rule `backward` read for `cls` (once per function; eagerly: reading a rule is
    more Python than torch.compile traces)."""
    rules: dict[Callable[..., Any], ModuleRule] = cls._gradoverride_rules  # type: ignore[attr-defined]
    rule = rules.get(backward)
    if rule is None and compiling:
        msg = (
            f"`{cls.__qualname__}` has a `backward` assigned after its rule was read (on the "
            "class or the instance), and torch.compile cannot read a rule while tracing. "
            "Call the module once outside torch.compile after assigning it (torch.compile "
            "then uses the new rule)."
        )
        raise GradOverrideError(msg)
    if rule is None:
        options = cls._gradoverride_options  # type: ignore[attr-defined]
        rule = rules[backward] = ModuleRule(
            where=f"`{cls.__qualname__}`",
            forward=cls._gradoverride_forward,  # type: ignore[attr-defined]
            rule=backward,
            method=method,
            runs_forward=True,
            **options,
        )
    return rule


def _call(module: Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A call of a go.Module: its rule's op, or its plain forward where no gradient can be
    computed."""
    cls = type(module)
    rule = cls._gradoverride_rule
    assert rule is not None
    if not torch.is_grad_enabled():
        return rule.forward(module, *args, **kwargs)
    if tracing_state() is not None:
        if exporting_onnx():  # an inference graph: the forward alone, as under no_grad
            return rule.forward(module, *args, **kwargs)
        raise GradOverrideError(jit_message(rule.where, "torch.jit.trace"))
    compiling = is_dynamo_compiling()
    # The `backward` the module has now (see the module docstring).
    assigned = module.__dict__.get("backward")
    if assigned is not None:
        rule = _rule_of(cls, assigned, method=False, compiling=compiling)
    elif cls.backward is not rule.user_rule:  # type: ignore[attr-defined]
        rule = _rule_of(cls, cls.backward, method=True, compiling=compiling)  # type: ignore[attr-defined]
    if not compiling:
        last = rule.last
        if last is not None:
            # The layout of the last call (a module tree of the same classes and parameter
            # names, without buffers), read by the op's generated reader: plain values, no
            # per-call state.
            values = last[0](module, args, kwargs)
            if values is not None:
                op = last[1]
                eager = op._route.eager
                if (
                    eager is not None and id(module) in CHECKED and not RECORDERS
                    and not transforms_active()
                ):
                    return eager(values)
                return _through_route(module, op, values, None, args, kwargs, False)
    names, params = parameters_of(module)
    inplace = reads_inplace(module)
    op = rule.op_for(names, inplace, module)
    values = rule.values(module, args, kwargs, params)
    state = call_state(module, rule.where)
    if inplace:
        if compiling:
            raise GradOverrideError(compiled_inplace_message(rule.where))
        refuse_inplace_views(rule.where, values[1 : len(values) - len(params)])
    elif not compiling:
        reader = op.reader(module)
        if reader is not None:
            rule.last = (reader, op)
    return _through_route(module, op, values, state, args, kwargs, compiling)


def _through_route(module: Module, op: Any, values: tuple[Any, ...], state: Any,
                   args: tuple[Any, ...], kwargs: dict[str, Any], compiling: bool) -> Any:
    """The op's route for a call of `module`; its first eager call checked (see `_audit`),
    each call recorded while a recorder runs."""
    if compiling or transforms_active() or (id(module) in CHECKED and not RECORDERS):
        return op._route.run_bound(values, state)
    run: Callable[[], Any]
    if id(module) in CHECKED:
        run = functools.partial(op._route.run_bound, values, state)
    else:
        # The first eager call of each instance (a copy included) is checked.
        from ._audit import audit_module_call  # imported at the first check

        def run() -> Any:  # (the check, then the call)
            result = audit_module_call(op, values, state)
            mark_checked(module)
            return result

    for recorder in RECORDERS:
        return recorder.module_call(module, op, args, kwargs, run)
    return run()
