"""`go.override_backward`: a backward rule given to an existing module instance, in place.

The module keeps its identity, class, parameters and `state_dict` keys: what changes is the
`forward` found on the instance, an `_OverriddenForward` that calls the module's own forward
inside the op `_ModuleRule` builds (see `_module.py`, shared with `go.Module`). It pickles as
the call that installs it again, so a saved model loads back with its override.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.compiler import is_dynamo_compiling

from ._backends import backend
from ._errors import GradOverrideError, GradOverrideTypeError
from ._frameworks import autograph_artifact, is_keras_layer
from ._jit import RefuseScripting
from ._module import KEY, MISS, Module, _ModuleRule, _parameter_names
from ._signature import describe

__all__ = ["OverrideHandle", "override_backward"]


class _OverriddenForward:
    """What `override_backward` installs as `module.forward`.

    It pickles as the call that installs it again (the module, the rule by reference, the
    options), so a saved model loads back with its override; `copy.deepcopy` gives the copy
    an override bound to the copy."""

    __slots__ = ("_rule", "cache", "module", "options", "rule")

    def __init__(self, module: nn.Module, rule: Callable[..., Any], options: dict[str, Any],
                 module_rule: _ModuleRule | None = None) -> None:
        self.module = module
        self.rule = rule
        self.options = options
        self._rule = module_rule if module_rule is not None else _module_rule_for(
            type(module), rule, options
        )
        # The module's layout between calls (see `_layout`); a copy or a loaded override
        # starts empty.
        self.cache: dict[str, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # The generated entry for the module's structure first (see `_ModuleRule.call`).
        if not is_dynamo_compiling():
            layout = self.cache.get(KEY)
            if layout is not None and layout.entry is not None:
                out = layout.entry(self.module, args, kwargs)
                if out is not MISS:
                    return out
        return self._rule.call(self.module, args, kwargs, self.cache)

    # What tools read off a bound `forward` (torch.export reads `__code__` for the argument
    # names, `inspect.signature` the signature): the module's own forward's.
    @property
    def __code__(self) -> Any:
        return type(self.module).forward.__code__

    @property
    def __signature__(self) -> inspect.Signature:
        params = list(inspect.signature(type(self.module).forward).parameters.values())
        return inspect.Signature(params[1:])

    @property
    def __name__(self) -> str:
        return "forward"

    def __reduce__(self) -> tuple[Any, ...]:
        from ._pickling import require_importable

        require_importable(
            self.rule, f"`{type(self.module).__name__}` (overridden)", "its backward rule"
        )
        return (_reinstall, (self.module, self.rule, self.options))

    def __deepcopy__(self, memo: dict[int, Any]) -> _OverriddenForward:
        return _OverriddenForward(copy.deepcopy(self.module, memo), self.rule, self.options,
                                  self._rule)

    def __repr__(self) -> str:
        return f"<forward of {type(self.module).__name__} with backward {describe(self.rule)}>"


def _module_rule_for(
    cls: type[nn.Module], rule: Callable[..., Any], options: dict[str, Any]
) -> _ModuleRule:
    return _ModuleRule(
        where=f"`{cls.__name__}`",
        forward=cls.forward,
        rule=rule,
        rule_is_method=False,
        owns=options["owns"],
        residuals=(),
        once_differentiable=options["once_differentiable"],
        materialize_grads=options["materialize_grads"],
    )


def _reinstall(module: nn.Module, rule: Callable[..., Any],
               options: dict[str, Any]) -> _OverriddenForward:
    """Unpickling an overridden module's forward: the override, installed again. The module
    is still being rebuilt when this runs (its state comes after), so nothing reads it."""
    return _OverriddenForward(module, rule, options)


class OverrideHandle:
    """Returned by `override_backward`; `.remove()` restores the module exactly.

    Removing twice is a no-op. For a module loaded with its override (`torch.load`,
    `copy.deepcopy`), `OverrideHandle.of(module)` gives the handle.
    """

    def __init__(self, module: nn.Module, forward: Any) -> None:
        self._module = module
        self._forward = forward

    @classmethod
    def of(cls, module: nn.Module) -> OverrideHandle:
        """The handle of the override installed on `module` (after a load or a copy)."""
        forward = module.__dict__.get("forward")
        if not isinstance(forward, _OverriddenForward):
            msg = (
                f"this {type(module).__name__} has no override from `go.override_backward`, "
                "so there is no handle to give; check `OverrideHandle.of` is called on the "
                "overridden module itself (not its parent)."
            )
            raise GradOverrideError(msg)
        return cls(module, forward)

    @property
    def active(self) -> bool:
        """Whether the override is still installed."""
        return self._module.__dict__.get("forward") is self._forward

    def remove(self) -> None:
        if self.active:
            del self._module.__dict__["forward"]
            self._module.__dict__.pop("__prepare_scriptable__", None)

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
    change. The rule follows the `custom_backward` contract with the names of the module's
    own `forward` parameters, its parameters by `named_parameters()` name, and the reserved
    name `module` for the module itself. The rule reads each parameter as the forward saw
    it (under `torch.func.functional_call`, the tensors passed in).

    `torch.save` / `pickle` of the module (or a model holding it) store the override, with
    the rule by reference (so the rule must be a module-level function; a lambda is refused
    with a `GradOverrideError` when saving); loading installs it again, and
    `OverrideHandle.of(module)` gives its handle. `copy.deepcopy` copies the override too.
    A module built with `inplace=True` (`nn.ReLU(inplace=True)`) changes its input in place:
    the rule gets a copy of each input it names, taken before the forward, and the caller's
    tensor is changed as without the override. TorchScript cannot keep the rule:
    `torch.jit.script` and `torch.jit.trace` raise `GradOverrideError`.

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
    tensor when exactly one owned input or parameter holds a tensor. Shapes, dtypes and
    devices are checked as for `custom_backward`.
    """
    if not isinstance(module, nn.Module):
        if is_keras_layer(module):
            # The Keras layer's handle (a LayerHandle).
            return backend("tensorflow").override_layer(
                module, rule, owns=owns, once_differentiable=once_differentiable,
                materialize_grads=materialize_grads,
            )
        msg = (
            f"override_backward needs an nn.Module instance, got {type(module).__name__} "
            f"{module!r}; for a function, use `go.custom_backward(fn, backward=rule)`."
        )
        raise GradOverrideTypeError(msg)
    if "forward" in module.__dict__:
        msg = (
            f"this {type(module).__name__} already has an overridden forward (an earlier "
            "`override_backward`?); call `.remove()` on its handle before overriding again."
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
    module_rule = _module_rule_for(type(module), rule, options)
    module_rule.check_names(module)
    # Built now, so that a first call under torch.compile(fullgraph=True) finds it.
    module_rule.op_for(_parameter_names(module), getattr(module, "inplace", False) is True)
    forward = _OverriddenForward(module, rule, options, module_rule)
    module.__dict__["forward"] = forward
    module.__dict__["__prepare_scriptable__"] = RefuseScripting(f"`{type(module).__name__}`")
    return OverrideHandle(module, forward)
