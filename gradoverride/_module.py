"""Backward rules for modules: `go.Module` subclasses, and the op both it and
`go.override_backward` (`_override.py`) build around a module's own forward.

Both build a `custom_backward` op around the module's own `forward`, with the module's
parameters as two extra container inputs (the ones the rule owns, and the others), so:

* parameter gradients flow through autograd (they accumulate, fire hooks, reach DDP), never
  by writing `.grad`;
* the parameters the rule does not own keep their ordinary gradient, through the forward's
  own graph (the core's partial override);
* the rule reads `self.<parameter>` (or `module.<parameter>`) as the forward saw it: under
  `torch.func.functional_call`, the parameters passed in, not the module's own.

The rule contract is `custom_backward`'s, with the module's parameters added to the names:
a rule may return a gradient for a parameter by its `named_parameters()` name (dotted names
of submodules included), and may name top-level parameters as keyword-only parameters to
receive them (nested ones are reached through `self`).
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.compiler import is_dynamo_compiling
from torch.nn.parameter import UninitializedParameter

from ._decorators import CustomBackward
from ._errors import GradOverrideError, GradOverrideTypeError
from ._gradients import check_gradient
from ._internals import FAST_APPLY, is_transformed, tracing_state, transforms_active
from ._jit import jit_message, refuse_scripting
from ._rule import RESERVED_NAMES, normalize_names

if TYPE_CHECKING:
    from ._layout import Layout

__all__ = ["Module"]

# `_layout` and `_module_fastpath` are imported where first needed (a module rule's first op,
# its first call): compiling their source would add ~7 ms to `import gradoverride`.

#: Where a module's layout is kept (see `_layout`): a key of the module's `__dict__`
#: (go.Module) or of an override's own cache (override_backward).
KEY = "_gradoverride_layout"

#: What a generated entry (see `_module_fastpath`) returns for a call it does not cover.
MISS: Any = object()

#: (where, inputs, owned_inputs, n_grads, user_rule, rule_is_method, parameter_names,
#:  requested, parameter names of this layout, their op slots, owned parameter names,
#:  the op slots of the copied inputs of an in-place module)
_RuleConfig = tuple[
    str, tuple[str, ...], tuple[str, ...], "int | None", Callable[..., Any], bool,
    tuple[str, ...], tuple[str, ...], tuple[str, ...], dict[str, str], tuple[str, ...],
    tuple[str, ...],
]

_PARAM = "_gradoverride_p"
_ORIGINAL = "_gradoverride_input_"  # residuals: copies of an in-place module's inputs
_IDS = "_gradoverride_parameter_ids"
_MODULE = "_gradoverride_module"

try:  # the context manager `torch.func.functional_call` is built on
    from torch.nn.utils.stateless import _reparametrize_module as _reparametrize
except ImportError:  # pragma: no cover - depends on torch version
    _reparametrize = None  # type: ignore[assignment]


@contextmanager
def _parameters_as(
    module: nn.Module, params: dict[str, Tensor], current: dict[str, Tensor]
) -> Iterator[None]:
    """Run with `module`'s parameters (`current`) replaced by `params` where they differ."""
    swap = {name: p for name, p in params.items() if current.get(name) is not p}
    if not swap:
        yield
        return
    if _reparametrize is None:  # pragma: no cover
        msg = (
            "this torch has no `torch.nn.utils.stateless._reparametrize_module`, which a module "
            "rule that owns some parameters but not all needs; own all parameters or none."
        )
        raise GradOverrideError(msg)
    with _reparametrize(module, swap):
        yield


class _ParameterIds:
    """The identities of the parameters a call passed in, and the buffers the forward saw
    (not a tuple, so the op does not treat it as a container to flatten). The buffers are
    kept by reference, not saved for backward: they get no gradient, and a buffer the
    forward itself updates in place (running statistics) must not trip autograd's version
    check of saved tensors when the module runs again before backward."""

    __slots__ = ("buffers", "ids")

    def __init__(self, ids: tuple[int, ...], buffers: dict[str, Tensor] | None) -> None:
        self.ids = ids
        self.buffers = buffers


#: The ids object of a call without floating buffers (its ids are read only by the op's
#: own path, which computes them).
_NO_BUFFERS = _ParameterIds((), None)

# An entry checks each parameter and buffer in written-out source: up to this many each.
_MAX_ENTRY = 8


class _ModuleRule:
    """A module rule read once: its calling convention, the names it asks for, what it owns."""

    def __init__(
        self,
        *,
        where: str,
        forward: Callable[..., Any],
        rule: Callable[..., Any],
        rule_is_method: bool,
        owns: str | Iterable[str] | None,
        residuals: tuple[str, ...],
        once_differentiable: bool,
        materialize_grads: bool,
    ) -> None:
        self.where = where
        self.user_rule = rule
        self.rule_is_method = rule_is_method
        forward_params = list(inspect.signature(forward).parameters.values())[1:]  # drop self
        self.inputs = tuple(p.name for p in forward_params)
        self.input_position = {p.name: i for i, p in enumerate(forward_params)}
        self.input_default = {
            p.name: None if p.default is p.empty else p.default for p in forward_params
        }
        self.residuals = residuals
        self.owns = None if owns is None else normalize_names(owns, "owns", where)

        rule_params = list(inspect.signature(rule).parameters.values())
        if rule_is_method:
            rule_params = rule_params[1:]
        self.n_grads: int | None = 0
        requested: list[str] = []
        for p in rule_params:
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and self.n_grads is not None:
                self.n_grads += 1
            elif p.kind is p.VAR_POSITIONAL:
                self.n_grads = None
            elif p.kind is p.KEYWORD_ONLY:
                requested.append(p.name)
            elif p.kind is p.VAR_KEYWORD:
                msg = (
                    f"the backward of {where} takes `**{p.name}`; name each value it needs as a "
                    "keyword-only parameter, e.g. `def backward(self, grad, *, x): ...`."
                )
                raise GradOverrideTypeError(msg)
        if self.n_grads == 0:
            msg = (
                f"the backward of {where} has no positional parameter for the upstream "
                "gradient; write it as `def backward(self, grad, *, ...)`."
            )
            raise GradOverrideTypeError(msg)
        reserved = {*RESERVED_NAMES, *(() if rule_is_method else ("module",))}
        self.requested = tuple(requested)
        # The inputs a module built with inplace=True gets copied for the rule.
        self.copied_inputs = tuple(n for n in requested if n in self.inputs)
        # Names that are neither inputs, residuals nor reserved must be parameters; they are
        # checked against the instance's parameters once __init__ has run (_ModuleMeta).
        known = {*self.inputs, *residuals, *reserved}
        self.parameter_names = tuple(n for n in requested if n not in known)

        self.forward = forward
        self.once_differentiable = once_differentiable
        self.materialize_grads = materialize_grads
        self.ops: dict[tuple[tuple[str, ...], bool], CustomBackward[..., Any]] = {}
        # Per parameter names, the raw apply of the op's eager twin (see `_module_fastpath`),
        # for rules it covers; per module structure, the generated entry that applies it.
        self.twins: dict[tuple[str, ...], Callable[..., Any]] = {}
        self.entries: dict[tuple[Any, ...], Callable[..., Any]] = {}

    # ---- the op around the module's forward, one per parameter layout ------------------

    def op_for(self, names: tuple[str, ...], inplace: bool = False) -> CustomBackward[..., Any]:
        """The op for a module whose parameters are `names` (built once per layout).

        `inplace`: the op for a module that changes its input in place (built with
        `inplace=True`, as `nn.ReLU(inplace=True)`): the inputs the rule reads are copied
        before the forward, and the changed input is marked dirty, as PyTorch requires."""
        key = (names, inplace)
        op = self.ops.get(key)
        if op is None:
            op = self.ops[key] = self._build(names, inplace)
        return op

    def _build(self, names: tuple[str, ...], inplace: bool) -> CustomBackward[..., Any]:
        # Each parameter is its own input of the op (slot `_gradoverride_p<i>`), so the common
        # call has plain tensor arguments and takes the core's generated fast path.
        forward = self.forward
        k = len(names)
        slots = tuple(f"{_PARAM}{i}" for i in range(k))
        slot_of = dict(zip(names, slots, strict=True))
        forward_params = list(inspect.signature(forward).parameters.values())[1:]
        # For an in-place module, the inputs the rule reads reach it as copies made before
        # the call (inputs of the op, after the parameters): the forward changes the inputs.
        copied = self.copied_inputs if inplace else ()
        copies = tuple(f"{_ORIGINAL}{n}" for n in copied)
        c = len(copies)
        positional = inspect.Parameter.POSITIONAL_ONLY
        signature = inspect.Signature(
            [
                inspect.Parameter(_MODULE, positional),
                inspect.Parameter(_IDS, positional),
                *(inspect.Parameter(slot, positional) for slot in (*slots, *copies)),
                *forward_params,
            ]
        )

        def module_forward(
            module: nn.Module, ids: _ParameterIds, *rest: Any, **kwargs: Any
        ) -> Any:
            params, args = rest[:k], rest[k + c :]
            if tuple(map(id, params)) == ids.ids:
                return forward(module, *args, **kwargs)  # the module's own parameters
            # Owned parameters arrive detached (partial override), or others under a
            # transform: the forward must see these.
            swap = dict(zip(names, params, strict=True))
            with _parameters_as(module, swap, dict(module.named_parameters())):
                return forward(module, *args, **kwargs)

        module_forward.__signature__ = signature  # type: ignore[attr-defined]
        module_forward.__name__ = self.where.strip("`")
        module_forward.__qualname__ = module_forward.__name__

        owns = self.owns
        owned_inputs = tuple(n for n in self.inputs if owns is None or n in owns)
        owned_names = tuple(n for n in names if owns is None or n in owns)
        # The wrapper asks for the module and every parameter (saved: they are alive anyway,
        # so this costs no memory): the rule then reads each parameter as the forward saw it,
        # the ones passed to `torch.func.functional_call` included, owned or not. It asks for
        # `needs_grad` only when a lone returned tensor could belong to more than one input.
        wants_needs = len(owned_inputs) > 1 or "needs_grad" in self.requested
        rule_names = [_MODULE, _IDS, *slots]
        rule_names += [
            n for n in self.requested
            if (n in self.inputs and n not in copied) or n in self.residuals
        ]
        rule_names += list(copies)
        rule_names += ["output"] if "output" in self.requested else []
        rule_names += ["needs_grad"] if wants_needs else []

        # Plain values only: dynamo, tracing the backward, cannot wrap a _ModuleRule object.
        config: _RuleConfig = (
            self.where,
            self.inputs,
            owned_inputs,
            self.n_grads,
            self.user_rule,
            self.rule_is_method,
            self.parameter_names,
            self.requested,
            names,
            slot_of,
            owned_names,
            copies,
        )

        def general_rule(*grads: Any, **named: Any) -> Any:
            for name, original in zip(copied, copies, strict=True):
                named[name] = named.pop(original)
            return _call_module_rule(config, grads, named)

        rule: Callable[..., Any] = general_rule
        owns_everything = len(owned_inputs) == len(self.inputs) and owned_names == names
        if owns_everything and not copies and not wants_needs:
            from ._module_fastpath import generate_rule

            rule = generate_rule(
                label=self.where.strip("`"),
                inputs=self.inputs,
                names=names,
                slots=slots,
                rule_names=tuple(rule_names),
                requested=self.requested,
                parameter_names=self.parameter_names,
                rule_is_method=self.rule_is_method,
                n_grads=self.n_grads,
                module_kw=_MODULE,
                ids_kw=_IDS,
                namespace={
                    "user_rule": self.user_rule,
                    "CONFIG": config,
                    "general": _call_module_rule,
                    "translate": _translate,
                    "current": _current_parameter,
                    "wrote_grad": functools.partial(_refuse_written_grad, self.where),
                },
            )

        rule.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter("grads", inspect.Parameter.VAR_POSITIONAL)]
            + [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in rule_names]
        )
        rule.__name__ = rule.__qualname__ = f"{self.where.strip('`')}.backward"
        if inplace and owns is not None:
            msg = (
                f"{self.where} changes its input in place (it was built with inplace=True), "
                f"and its rule declares owns={owns!r}; a rule for an in-place module must own "
                "every input and parameter. Drop `owns`, or build the module with "
                "inplace=False."
            )
            raise GradOverrideError(msg)
        # Messages name the parameters, not the op's slots for them.
        labels = {_MODULE: "", _IDS: "", **{slot_of[n]: n for n in names}}
        labels.update({slot: slot[len(_ORIGINAL):] for slot in copies})
        op: CustomBackward[..., Any] = CustomBackward(
            module_forward,
            residuals=self.residuals,
            rule_options={"track_inplace": inplace, "labels": labels},
        )
        op.backward(
            rule,
            owns=None if owns is None else (
                _MODULE, _IDS, *(slot_of[n] for n in owned_names), *owned_inputs
            ),
            once_differentiable=self.once_differentiable,
            materialize_grads=self.materialize_grads,
        )
        if rule is not general_rule and self._twin_covers():
            from ._module_fastpath import generate_twin

            self.twins[names] = generate_twin(
                label=self.where.strip("`"),
                kind="CustomBackward",
                module_name=getattr(forward, "__module__", None) or __name__,
                forward=forward,
                inputs=self.inputs,
                names=names,
                op_names=(_MODULE, _IDS, *slots, *self.inputs),
                requested=self.requested,
                parameter_names=self.parameter_names,
                rule_is_method=self.rule_is_method,
                n_grads=self.n_grads,
                materialize=self.materialize_grads,
                op_function=op.function,
                op_rule=rule,
                rule_label=rule.__qualname__,
                labels=labels,
                namespace={
                    "user_rule": self.user_rule,
                    "current": _current_parameter,
                    "wrote_grad": functools.partial(_refuse_written_grad, self.where),
                    "CONFIG": config,
                    "translate": _translate,
                },
            )
        return op

    def _twin_covers(self) -> bool:
        """Whether an eager twin can take this rule's common call: no residuals, no
        once_differentiable, one upstream gradient, a forward of positional parameters."""
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        forward_params = list(inspect.signature(self.forward).parameters.values())[1:]
        return (
            FAST_APPLY
            and not self.residuals
            and not self.once_differentiable
            and self.n_grads in (None, 1)
            and all(p.kind in positional for p in forward_params)
        )

    def call(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
        cache: dict[str, Any],
    ) -> Any:
        """A call of `module` with this rule. `cache` keeps the module's layout between calls
        (see `_layout`): the module's `__dict__` for a `go.Module`, the override's own dict
        for `override_backward`. Its callers (go.Module's forward, an override's) try the
        layout's generated entry first, which covers the common call."""
        if not torch.is_grad_enabled():
            # No gradient is computed, so the rule cannot matter: the module's own forward,
            # without a Function around it (also the dry run that lazy modules need).
            return self.forward(module, *args, **kwargs)
        if tracing_state() is not None:
            raise GradOverrideError(jit_message(self.where, "torch.jit.trace"))
        if is_dynamo_compiling():
            # Traced code keeps no per-call objects: the walks, which dynamo folds.
            return self._call_walked(module, args, kwargs)
        from ._layout import make_layout, snapshot

        layout = cache.get(KEY)
        snap = snapshot(module)
        if layout is None or layout.key != snap[0] or layout.owner is not self:
            layout = make_layout(self, module, snap)
            if layout is None:  # a lazy parameter, or walks the snapshot cannot follow
                return self._call_walked(module, args, kwargs)
            layout.extra = (
                self.op_for(layout.names, False), _ParameterIds(layout.parameter_ids, None)
            )
            layout.entry = self._entry_for(module, layout)
            cache[KEY] = layout
        values = layout.parameters(snap[1])
        buffers = layout.floating_buffers(snap[2])
        if buffers is None:
            op, ids = layout.extra
        else:
            self._refuse_wrapped_buffers(buffers)
            op, ids = layout.extra[0], _ParameterIds(layout.parameter_ids, buffers)
        if not layout.inplace(module):
            return op(module, ids, *values, *args, **kwargs)
        return self._call_inplace(module, layout.names, values, ids, args, kwargs)

    def _entry_for(self, module: nn.Module, layout: Layout) -> Callable[..., Any] | None:
        """The generated entry for `module`'s structure (see `_module_fastpath`): for a
        module without submodules whose op has an eager twin, with few parameters."""
        apply = self.twins.get(layout.names)
        if apply is None or module._modules:
            return None
        params = tuple((k, v is None) for k, v in module._parameters.items())
        buffers = tuple((k, v is None) for k, v in module._buffers.items())
        if len(params) > _MAX_ENTRY or len(buffers) > _MAX_ENTRY:
            return None
        key = (type(module), params, buffers, layout.inplace_in_dict)
        entry = self.entries.get(key)
        if entry is None:
            from ._module_fastpath import generate_entry

            op = self.op_for(layout.names, False)
            entry = self.entries[key] = generate_entry(
                label=self.where.strip("`"),
                cls=type(module),
                pattern=(params, buffers),
                n_inputs=len(self.inputs),
                inplace_in_dict=layout.inplace_in_dict,
                namespace={
                    "op": op,
                    "fast_class": op._fast_class,
                    "apply": apply,
                    "finish": op.function._gradoverride_general[3],  # type: ignore[attr-defined]
                    "ParameterIds": _ParameterIds,
                    "NO_BUFFERS": _NO_BUFFERS,
                    "MISS": MISS,
                },
            )
        return entry

    def _call_walked(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """`call` with the parameters and buffers walked at this call (the reference)."""
        params = dict(module.named_parameters())
        values = tuple(params.values())
        for name, p in params.items():
            if isinstance(p, UninitializedParameter):
                raise GradOverrideError(_lazy_message(self.where, name))
        ids = _ParameterIds(tuple(map(id, values)), self._buffers(module))
        if getattr(module, "inplace", False) is not True:
            op = self.op_for(tuple(params), False)
            return op(module, ids, *values, *args, **kwargs)
        return self._call_inplace(module, tuple(params), values, ids, args, kwargs)

    def _call_inplace(
        self, module: nn.Module, names: tuple[str, ...], values: tuple[Tensor, ...],
        ids: _ParameterIds, args: tuple[Any, ...], kwargs: dict[str, Any],
    ) -> Any:
        """`call` for a module built with inplace=True."""
        if is_dynamo_compiling():
            raise GradOverrideError(_compiled_inplace_message(self.where))
        for value in (*args, *kwargs.values()):
            if isinstance(value, Tensor) and value._base is not None and value.requires_grad:
                # PyTorch gives a Function that changes a view in place (through CopySlices)
                # the right gradient only when the view is the Function's first input; here
                # it is not, so the gradient around the view would be silently wrong.
                raise GradOverrideError(_inplace_view_message(self.where))
        # Copies of the inputs the rule reads, made before the forward changes them.
        originals = []
        for name in self.copied_inputs:
            i = self.input_position[name]
            value = args[i] if i < len(args) else kwargs.get(name, self.input_default[name])
            originals.append(value.detach().clone() if isinstance(value, Tensor) else value)
        op = self.op_for(names, True)
        return op(module, ids, *values, *originals, *args, **kwargs)

    def _buffers(self, module: nn.Module) -> dict[str, Tensor] | None:
        """The module's floating buffers at this call, for the rule; refused when a
        torch.func transform wraps them (they would reach the forward as captured)."""
        if is_dynamo_compiling():
            return None  # traced code keeps no per-call objects holding tensors
        buffers = {
            n: b for n, b in module.named_buffers() if b.is_floating_point() or b.is_complex()
        }
        if not buffers:
            return None
        self._refuse_wrapped_buffers(buffers)
        return buffers

    def _refuse_wrapped_buffers(self, buffers: dict[str, Tensor]) -> None:
        """Buffers a torch.func transform wraps would reach the forward as captured."""
        if transforms_active():
            wrapped = [n for n, b in buffers.items() if is_transformed(b)]
            if wrapped:
                raise GradOverrideError(_wrapped_buffers_message(self.where, wrapped[0]))

    def check_names(self, module: nn.Module) -> None:
        """Check the names the rule uses against `module`'s parameters (once it has them)."""
        params = dict(module.named_parameters())
        valid = [*self.inputs, *params]
        for name in self.parameter_names:
            if name not in params:
                msg = (
                    f"the backward of {self.where} names `{name}`, which is neither an input of "
                    f"its forward nor one of its parameters; it may name "
                    f"{', '.join(f'`{n}`' for n in valid)}, or `output` / `needs_grad`."
                )
                raise GradOverrideTypeError(msg)
        for name in self.owns or ():
            if name not in params and name not in self.inputs:
                msg = (
                    f"{self.where} declares owns={self.owns!r}, but `{name}` is neither an input "
                    f"nor a parameter; valid names are {', '.join(f'`{n}`' for n in valid)}."
                )
                raise GradOverrideError(msg)

def _call_module_rule(spec: _RuleConfig, grads: tuple[Any, ...], named: dict[str, Any]) -> Any:
    """Call the user's rule for a module op and translate what it returns."""
    (where, inputs, _, n_grads, user_rule, rule_is_method, parameter_names,
     requested, names, slot_of, owned_names, _) = spec
    module: nn.Module = named.pop(_MODULE)
    ids: _ParameterIds = named.pop(_IDS)
    if n_grads is not None and n_grads != len(grads):
        msg = (
            f"the backward of {where} takes {n_grads} upstream gradient(s), but "
            f"the forward returned {len(grads)} output(s); give it one positional "
            "parameter per output (or `*grads`)."
        )
        raise GradOverrideTypeError(msg)
    # Every parameter as the forward saw it, by name.
    seen = {n: named.pop(slot_of[n]) for n in names}
    owned = seen if len(owned_names) == len(names) else {n: seen[n] for n in owned_names}
    for name in parameter_names:
        named[name] = seen[name]
    needs_inputs: dict[str, bool] = named.pop("needs_grad", None) or {}
    if "module" in requested and not rule_is_method:
        named["module"] = module
    if "needs_grad" in requested:
        named["needs_grad"] = {
            **{n: needs_inputs.get(n, False) for n in inputs},
            **{n: n in owned and owned[n].requires_grad for n in names},
        }
    current = {n: _current_parameter(module, n) for n in names}
    before = [current[n].grad for n in owned_names]
    if not ids.buffers and all(current[n] is seen[n] for n in names):
        # The module holds what its forward saw (no functional_call): nothing to swap in.
        if rule_is_method:
            result = user_rule(module, *grads, **named)
        else:
            result = user_rule(*grads, **named)
    else:
        swap: dict[str, Tensor] = dict(seen)
        if ids.buffers:
            # The buffers the forward saw (those passed to functional_call), for the rule.
            current.update(module.named_buffers())
            swap.update(ids.buffers)
        with _parameters_as(module, swap, current):
            if rule_is_method:
                result = user_rule(module, *grads, **named)
            else:
                result = user_rule(*grads, **named)
    for name, grad in zip(owned_names, before, strict=True):
        if current[name].grad is not grad:
            _refuse_written_grad(where, name)
    return _translate(spec, result, owned, needs_inputs)


def _refuse_written_grad(where: str, name: str) -> None:
    msg = (
        f"the backward of {where} wrote `{name}.grad` itself; return the "
        f"gradient instead, e.g. `return {{..., '{name}': grad_{_ident(name)}}}`, "
        "and autograd accumulates it (hooks and DDP see it too)."
    )
    raise GradOverrideError(msg)


def _current_parameter(module: nn.Module, name: str) -> Tensor:
    if "." not in name:
        return module._parameters[name]  # type: ignore[return-value]
    return module.get_parameter(name)


def _translate(
    spec: _RuleConfig, result: Any, owned: dict[str, Tensor], needs_inputs: dict[str, bool]
) -> Any:
    """The user's return value in the op's terms: inputs by name, parameters by their slot,
    each parameter gradient checked under its own name."""
    where, inputs, owned_inputs = spec[0], spec[1], spec[2]
    names, slot_of, copies = spec[8], spec[9], spec[11]
    if isinstance(result, dict):
        by_name = result
    elif isinstance(result, tuple):
        if len(result) != len(inputs):
            msg = (
                f"the backward of {where} returned {len(result)} gradients, but the "
                f"forward takes {len(inputs)} inputs ({', '.join(inputs)}); return "
                "a tuple with one entry per input, or a dict by input and parameter name."
            )
            raise GradOverrideError(msg)
        by_name = dict(zip(inputs, result, strict=True))
    else:
        # A lone tensor: for the one owned input or parameter that needs a gradient.
        if len(owned_inputs) > 1:
            wanted = [n for n in owned_inputs if needs_inputs.get(n, False)]
        else:
            wanted = list(owned_inputs)
        wanted += [n for n, p in owned.items() if p.requires_grad]
        if result is not None and len(wanted) > 1:
            msg = (
                f"the backward of {where} returned a single "
                f"{type(result).__name__}, but {len(wanted)} owned inputs and parameters "
                f"need a gradient ({', '.join(f'`{n}`' for n in wanted)}); return a dict "
                f"by name, e.g. {{{', '.join(repr(n) + ': ...' for n in wanted)}}}."
            )
            raise GradOverrideError(msg)
        by_name = {wanted[0]: result} if wanted and result is not None else {}
        by_name.update({n: None for n in owned_inputs if n not in by_name})
    valid = [*inputs, *owned]
    out: dict[str, Any] = {}
    for key, grad in by_name.items():
        if key in inputs:
            out[key] = grad
        elif key in owned:
            p = owned[key]
            out[slot_of[key]] = None if grad is None else check_gradient(
                grad, (p.shape, p.dtype, p.device), where.strip("`"), key
            )
        else:
            reason = (
                "a parameter the rule does not own (it keeps its ordinary gradient); "
                "return None for it or add it to `owns`"
                if key in names
                else "neither an input nor a parameter"
            )
            msg = (
                f"the backward of {where} returned a gradient for `{key}`, which is "
                f"{reason}; the names it can return are {', '.join(f'`{n}`' for n in valid)}."
            )
            raise GradOverrideError(msg)
    for name, p in owned.items():
        if name not in by_name:
            if not p.requires_grad:
                continue
            raise GradOverrideError(_missing_parameter_message(where, name, result, inputs))
        out.setdefault(slot_of[name], None)
    if all(name in out for name in owned_inputs):
        # A tuple aligned with the op's parameters takes the core's fast checks.
        return (
            None, None, *(out.get(slot_of[n]) for n in names), *(None for _ in copies),
            *(out.get(n) for n in inputs),
        )
    # Inputs left out of a dict stay out, so the core reports an owned one by name.
    out.update(dict.fromkeys(copies))
    return out


def _missing_parameter_message(
    where: str, name: str, result: Any, inputs: tuple[str, ...]
) -> str:
    """An owned parameter with no gradient in what the rule returned, said for its form."""
    fix = (
        f"return {{'{name}': None, ...}} if it gets no gradient, or leave `{name}` out of "
        f"`owns` so it keeps its ordinary autograd gradient."
    )
    if isinstance(result, dict):
        return f"the backward of {where} returned a dict without `{name}`, which it owns; {fix}"
    if isinstance(result, tuple):
        form = (
            f"a tuple, which holds one gradient per input of the forward "
            f"({', '.join(f'`{n}`' for n in inputs)}) and none for parameters"
        )
    elif result is None:
        form = "None"
    else:
        form = f"a single {type(result).__name__} (the gradient of its input)"
    example = ", ".join(f"'{n}': grad_{_ident(n)}" for n in (*inputs, name))
    return (
        f"the backward of {where} returned {form}, but it owns the parameter `{name}`, "
        f"which needs a gradient; a module rule returns parameter gradients in a dict by "
        f"name, e.g. {{{example}}}; or {fix}"
    )


def _compiled_inplace_message(where: str) -> str:
    return (
        f"{where} changes its input in place (it was built with inplace=True), and its rule "
        "needs the input as it was called with, which gradoverride keeps by marking the "
        "input changed: torch.compile cannot trace that. Build the module with "
        "inplace=False under torch.compile (the compiled graph saves the memory anyway), "
        "or call it eagerly."
    )


def _inplace_view_message(where: str) -> str:
    return (
        f"{where} changes its input in place (it was built with inplace=True), and its input "
        "here is a view of another tensor (a slice, a reshape); gradoverride cannot give "
        "that base tensor the right gradient through an overridden in-place call. Pass a "
        "copy (`x[1:3].clone()`), or build the module with inplace=False."
    )


def _wrapped_buffers_message(where: str, name: str) -> str:
    return (
        f"{where} holds the buffer `{name}`, which a torch.func transform wraps here (a "
        "buffer passed to functional_call under vmap, as `torch.func.stack_module_state` "
        "gives them); the module's forward runs inside an autograd Function, which receives "
        "only its inputs and parameters unwrapped, so the buffer cannot reach it. Pass only "
        "the parameters to functional_call (the module then uses its own buffers), or make "
        "the buffer's value an argument of the forward."
    )


def _lazy_message(where: str, name: str) -> str:
    return (
        f"{where} holds the parameter `{name}` that is not initialized yet (a lazy module's, "
        "such as nn.LazyLinear); its shape is known only after a first forward, and the "
        "rule's gradients could not be checked against it. Run one forward without "
        "gradients first, as PyTorch recommends for lazy modules before creating the "
        "optimizer: `with torch.no_grad(): model(example_input)`."
    )


def _ident(name: str) -> str:
    return name.replace(".", "_")


class _ModuleMeta(type):
    """Checks a rule's parameter names once an instance has its parameters (after __init__),
    and builds the op for them then, so the first call may be a compiled one."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        instance = super().__call__(*args, **kwargs)
        rule = getattr(cls, "_gradoverride_rule", None)
        if rule is not None:
            rule.check_names(instance)
            rule.op_for(_parameter_names(instance), getattr(instance, "inplace", False) is True)
        return instance


def _parameter_names(module: nn.Module) -> tuple[str, ...]:
    return tuple(name for name, _ in module.named_parameters())


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
    `torch.func.functional_call(layer, params, ...)`, the one in `params`. (Buffers are read
    as they are when backward runs.)

    A subclass must define `backward` (a missing or misspelled one is an error when the class
    is created, since the module would silently train with its ordinary gradient); a base
    class meant only to be subclassed says so with `class Base(go.Module, abstract=True)`.

    Under `torch.no_grad()` the module runs its own forward directly: no gradient is computed,
    so the rule cannot matter. A module built with `inplace=True` (changing its input in place)
    gets a copy of each input its rule names, taken before the forward. TorchScript
    (`torch.jit.script`, `torch.jit.trace`) cannot keep the rule and raises
    `GradOverrideError`; `torch.compile` keeps it.

    What backward may return:
        - a dict by name: forward parameters (`"x"`) and the module's parameters as
          `named_parameters()` names them (`"weights"`, `"inner.weight"`), every owned one
          that holds a tensor present (None for no gradient);
        - a tensor (or None) when exactly one owned input or parameter holds a tensor.

        Each gradient must have its tensor's shape, or one the tensor broadcasts to (summed
        down to it); another floating-point precision is cast. Any other shape, dtype kind
        or device, a gradient for something the rule does not own, or writing `.grad`
        yourself raises `GradOverrideError`. Parameter gradients flow through autograd:
        they accumulate, fire hooks and reach DDP.
    """

    _gradoverride_rule: _ModuleRule | None = None

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
        rule = _ModuleRule(
            where=f"`{cls.__qualname__}`",
            forward=forward,
            rule=backward,
            rule_is_method=True,
            owns=owns,
            residuals=normalize_names(residuals, "residuals", cls.__qualname__),
            once_differentiable=once_differentiable,
            materialize_grads=materialize_grads,
        )
        cls._gradoverride_rule = rule
        cls._gradoverride_forward = forward  # type: ignore[attr-defined]

        def wrapped_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # The generated entry for this module's structure first (see `enter`).
            if not is_dynamo_compiling():
                layout = self.__dict__.get(KEY)
                if layout is not None and layout.entry is not None:
                    out = layout.entry(self, args, kwargs)
                    if out is not MISS:
                        return out
            return rule.call(self, args, kwargs, self.__dict__)

        functools.update_wrapper(wrapped_forward, forward)
        # No `__wrapped__`: TorchScript would compile the original forward through it, and
        # the rule would be silently dropped (`__prepare_scriptable__` refuses instead).
        del wrapped_forward.__wrapped__  # type: ignore[attr-defined]
        wrapped_forward.__qualname__ = f"{cls.__qualname__}.forward"
        cls.forward = wrapped_forward

    def __getstate__(self) -> dict[str, Any]:
        # The cached layout (see `_layout`) is not state: a copy or a loaded module makes
        # its own at its first call.
        getstate: Callable[[], dict[str, Any]] = super().__getstate__
        state = getstate()
        state.pop(KEY, None)
        return state

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script calls this on every module it scripts.
        refuse_scripting(f"`{type(self).__qualname__}`")
