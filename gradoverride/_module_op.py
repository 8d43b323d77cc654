"""The op around a module's forward: what `go.Module` and `go.override_backward` build.

A module's rule is an ordinary op's rule over the slots `(self, *inputs, *parameters)`:
slot 0 holds the module (never named, owned or given a gradient), then the forward's own
parameters, then the module's parameters by the names `named_parameters()` gives
(`"weight"`, `"inner.weight"`). So:

* parameter gradients flow through autograd (they accumulate, fire hooks, reach DDP), never
  by writing `.grad`;
* the parameters the rule does not own keep their ordinary gradient, through the forward's
  own graph (the core's partial override);
* the rule reads `self.<parameter>` (or `module.<parameter>`) as the forward saw it: under
  `torch.func.functional_call`, the tensors passed in, not the module's own.

One op is built per parameter layout (the names, in order) and per in-place flag, the first
time a module with that layout is met (at construction for `go.Module`, when overriding for
`override_backward`, so a first call may be compiled). A call reads the module's parameters:
a module without submodules, of a class that reads its parameters the standard way (checked
once per class), from its `_parameters`; any other by `named_parameters()`.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.compiler import is_dynamo_compiling
from torch.nn.parameter import UninitializedParameter

from ._decorators import ON_ARM
from ._errors import GradOverrideError
from ._function import CallState, OpPlan, Route, build_route, current_parameter, parameters_as
from ._gradients import ModuleForm
from ._internals import is_transformed, transforms_active
from ._rule import RESERVED_NAMES, RuleSpec, normalize_names, refuse_named_positionals
from ._signature import ForwardSignature, describe, listing

__all__ = [
    "CHECKED",
    "ModuleOp",
    "ModuleRule",
    "call_state",
    "compiled_inplace_message",
    "floating_buffers",
    "mark_checked",
    "parameters_of",
    "reads_inplace",
    "refuse_inplace_views",
]

#: The ids of the modules whose first eager call with grad enabled has been checked (see
#: `_audit`): each instance once, a copy included. An id leaves the set when its module is
#: freed (so a new module given the same id is checked too); nothing is kept alive.
CHECKED: set[int] = set()
ON_ARM.append(CHECKED.clear)  # `arm_all`: every module is checked again


def mark_checked(module: nn.Module) -> None:
    key = id(module)
    if key not in CHECKED:
        CHECKED.add(key)
        weakref.finalize(module, CHECKED.discard, key)


class _Slots:
    """The slots of a module's op, as `RuleSpec` reads them (see the module docstring)."""

    is_module = True

    def __init__(self, where: str, forward: ForwardSignature, params: tuple[str, ...],
                 module: nn.Module | None) -> None:
        self.module = module  # the module met with these parameters (for messages only)
        self.name = where.strip("`")
        self.where = where
        self.inputs = forward.names[1:]
        self.params = params
        clash = [n for n in params if n in self.inputs]
        if clash:
            msg = (
                f"{where}'s forward takes an argument named `{clash[0]}`, and the module has a "
                f"parameter of that name: a rule naming `{clash[0]}`, or returning a gradient "
                f"by that name, could mean either. Rename the forward's argument (say "
                f"`{clash[0]}_in`) or the parameter."
            )
            raise GradOverrideError(msg)
        self.names = (*forward.names, *params)
        self.index = {n: i for i, n in enumerate(self.names)}

    def unknown_name_message(self, where: str, name: str, available: list[str]) -> str:
        if self.module is not None:
            became = _became(self.module, name)
            if became:
                return (
                    f"the backward of {self.where} names `{name}`, which is {became}; its "
                    f"parameters are {listing(self.params)}."
                )
        valid = [*self.inputs, *self.params]
        return (
            f"the backward of {self.where} names `{name}`, which is neither an input of its "
            f"forward nor one of its parameters; it may name "
            f"{', '.join(f'`{n}`' for n in valid)}, or `output` / `needs_grad`."
        )

    def unknown_owned_message(self, where: str, owned: tuple[str, ...], name: str) -> str:
        valid = [*self.inputs, *self.params]
        return (
            f"{self.where} declares owns={owned!r}, but `{name}` is neither an input nor a "
            f"parameter; valid names are {', '.join(f'`{n}`' for n in valid)}."
        )


class ModuleOp:
    """The op of one module rule for one parameter layout: what the audit, the recorder and
    `gradoverride.testing` see of it (its name, rule and route)."""

    def __init__(self, rule: ModuleRule, route: Route, spec: RuleSpec, slots: _Slots,
                 inplace: bool) -> None:
        self._name = rule.where.strip("`")
        self.module_rule = rule
        self._route = route
        self._rule = spec
        self.slots = slots
        self.inplace = inplace
        self._tracks_inplace = inplace
        self._labels: dict[str, str] = {}
        self.forward = rule.forward
        # The generated readers of this op's layout, per module tree (see `reader`).
        self.readers: dict[tuple[Any, ...], Any] = {}

    @property
    def function(self) -> type[torch.autograd.Function]:
        return self._route.function

    def reader(self, module: nn.Module) -> Any:
        """`read(module, args, kwargs)` for modules shaped as `module` (see
        `_generate.generate_reader`), or None where this op has none: a forward taking
        keywords or `*args`, an in-place module, a tree `_tree` cannot read."""
        signature = self.module_rule.signature
        if not signature.is_plain or self.inplace:
            return None
        tree = _tree(module)
        if tree is None:
            return None
        found = self.readers.get(tree, False)
        if found is False:
            found = None
            if tuple(f"{path}{name}" for path, _, names, _ in tree for name in names) == (
                self.slots.params
            ):
                from ._generate import generate_reader

                found = generate_reader(
                    label=self._name, tree=tree, n_args=len(signature.names) - 1,
                    inplace_in_dict=_class_facts(type(module))[1],
                    namespace={"UninitializedParameter": UninitializedParameter},
                )
            self.readers[tree] = found
        return found

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        """`module(*args, **kwargs)` through this op, without the module's hooks (what
        `gradient_report` calls in an override's place)."""
        _, params = parameters_of(module)
        values = self.module_rule.values(module, args, kwargs, params)
        return self._route.run_bound(values, call_state(module, self.module_rule.where))

    def __repr__(self) -> str:
        return f"<module op {self._name} ({', '.join(self.slots.params)})>"


class ModuleRule:
    """A module's rule, read once: the forward's signature, the rule's options, and the op
    for each parameter layout met.

    `runs_forward`: the op runs the module's forward itself (`go.Module`, whose forward it
    is), or the module's call does and the op attaches to what it returned (the forward
    hooks of `override_backward`)."""

    def __init__(
        self,
        *,
        where: str,
        forward: Callable[..., Any],
        rule: Callable[..., Any],
        method: bool,
        owns: str | Iterable[str] | None,
        residuals: tuple[str, ...],
        once_differentiable: bool,
        materialize_grads: bool,
        runs_forward: bool,
    ) -> None:
        self.where = where
        self.forward = forward
        self.user_rule = rule
        self.method = method
        self.signature = ForwardSignature(forward, where.strip("`"))
        self.inputs = self.signature.names[1:]
        self.owns = None if owns is None else normalize_names(owns, "owns", where)
        self.residuals = residuals
        self.once_differentiable = once_differentiable
        self.materialize_grads = materialize_grads
        self.runs_forward = runs_forward
        self.ops: dict[tuple[tuple[str, ...], bool], ModuleOp] = {}
        # (reader, op) of the last call that had a reader: tried first at the next call.
        self.last: tuple[Any, ModuleOp] | None = None
        self._refuse_forgotten_star()

    def _refuse_forgotten_star(self) -> None:
        """`def backward(self, grad, x)`: said when the rule is read (class creation for a
        go.Module), not at the first backward with a count message."""
        try:
            signature = inspect.signature(self.user_rule)
        except (TypeError, ValueError):
            return  # RuleSpec says so, with the op
        if self.method:
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        aliases = () if self.method else ("module",)
        refuse_named_positionals(
            signature, self.where.strip("`"),
            (*self.inputs, *self.residuals, *RESERVED_NAMES, *aliases),
            f"backward rule `{describe(self.user_rule)}` of `{self.where.strip('`')}`",
            describe(self.user_rule), ("self",) if self.method else (),
        )

    def op_for(
        self, names: tuple[str, ...], inplace: bool, module: nn.Module | None = None
    ) -> ModuleOp:
        """The op for a module whose parameters are `names` (built once per layout;
        `module`, the module met with them, only for messages)."""
        key = (names, inplace)
        op = self.ops.get(key)
        if op is None:
            op = self.ops[key] = self._build(names, inplace, module)
        return op

    def _build(self, names: tuple[str, ...], inplace: bool, module: nn.Module | None) -> ModuleOp:
        slots = _Slots(self.where, self.signature, names, module)
        if inplace and self.owns is not None:
            msg = (
                f"{self.where} changes its input in place (it was built with inplace=True), "
                f"and its rule declares owns={self.owns!r}; a rule for an in-place module must "
                "own every input and parameter. Drop `owns`, or build the module with "
                "inplace=False."
            )
            raise GradOverrideError(msg)
        spec = RuleSpec(
            self.user_rule, slots, owns=self.owns, residuals=self.residuals,
            once_differentiable=self.once_differentiable,
            materialize_grads=self.materialize_grads, method=self.method,
            aliases=None if self.method else {"module": 0},
        )
        n_forward = len(self.signature.names)
        call_forward = self.signature.caller()

        def call(values: Any) -> Any:
            # The parameters as given: the module's own (a direct call) or others (detached
            # for a partial override, unwrapped under a torch.func transform).
            module = values[0]
            swap = {
                name: p for name, p in zip(names, values[n_forward:], strict=True)
                if current_parameter(module, name) is not p
            }
            if not swap:
                return call_forward(values[:n_forward])
            with parameters_as(module, swap):
                return call_forward(values[:n_forward])

        route = build_route(OpPlan(
            op=self.where.strip("`"),
            module=getattr(self.forward, "__module__", None) or __name__,
            names=slots.names, labels={}, bind=_no_bind, call=call, plain=None, rule=spec,
            residuals=self.residuals, track_inplace=inplace,
            form=ModuleForm(
                self.where, tuple(range(1, n_forward)),
                tuple(range(n_forward, n_forward + len(names))),
            ),
            run_tensorflow=_no_tensorflow, runs_forward=self.runs_forward,
            plain_signature=self.forward if self.signature.is_plain else None,
        ))
        return ModuleOp(self, route, spec, slots, inplace)

    def check(self, module: nn.Module) -> None:
        """Check the rule against `module`'s parameters once it has them (construction, or
        overriding), building its op then, so that a first call may be a compiled one."""
        names, _ = parameters_of(module, lazy_ok=True)
        self.op_for(names, reads_inplace(module), module)

    def values(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
               params: tuple[Tensor, ...]) -> tuple[Any, ...]:
        """One value per slot for the call `module(*args, **kwargs)`."""
        return (*self.signature.bind((module, *args), kwargs), *params)


def _no_bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    raise AssertionError("a module op is called with bound values")  # pragma: no cover


def _no_tensorflow(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    raise AssertionError("a torch module has no TensorFlow call")  # pragma: no cover


# ---- a module's parameters -------------------------------------------------------------------

#: Per class: whether a module of it without submodules holds exactly what
#: `named_parameters()` gives in its `_parameters` (the class changes none of the walks),
#: and whether its `inplace` attribute can be read from its `__dict__` alone.
_CLASSES: dict[type, tuple[bool, bool]] = {}


def _class_facts(cls: type) -> tuple[bool, bool]:
    facts = _CLASSES.get(cls)
    if facts is None:
        standard = all(
            getattr(cls, name) is getattr(nn.Module, name)
            for name in ("named_parameters", "_named_members", "named_modules", "parameters")
        )
        # Absent from `__dict__`, `inplace` is then False (nn.Module's `__getattr__` gives
        # parameters, buffers and modules, never True); not so when the class defines it (a
        # class attribute, a property) or has its own `__getattr__`.
        in_dict = getattr(cls, "__getattr__", None) is nn.Module.__getattr__ and not any(
            "inplace" in klass.__dict__ for klass in cls.__mro__
        )
        facts = _CLASSES[cls] = (standard, in_dict)
    return facts


def _tree(module: nn.Module) -> tuple[Any, ...] | None:
    """`module`'s tree as a reader reads it (see `_generate.TreeNode`), or None where none
    can: a buffer, a submodule held twice or as None, a parameter None or lazy, a class
    with its own way of listing parameters."""
    nodes: list[Any] = []
    seen: set[int] = set()

    def visit(path: str, node: nn.Module) -> bool:
        if id(node) in seen or node._buffers or not _class_facts(type(node))[0]:
            return False
        seen.add(id(node))
        for p in node._parameters.values():
            if p is None or isinstance(p, UninitializedParameter):
                return False
        nodes.append((path, type(node), tuple(node._parameters), tuple(node._modules)))
        return all(
            child is not None and visit(f"{path}{name}.", child)
            for name, child in node._modules.items()
        )

    return tuple(nodes) if visit("", module) else None


def reads_inplace(module: nn.Module) -> bool:
    """Whether `module` changes its input in place (built with `inplace=True`)."""
    facts = _CLASSES.get(type(module)) or _class_facts(type(module))
    if facts[1]:
        return module.__dict__.get("inplace", False) is True
    return getattr(module, "inplace", False) is True


def parameters_of(
    module: nn.Module, lazy_ok: bool = False
) -> tuple[tuple[str, ...], tuple[Tensor, ...]]:
    """`module`'s parameters as `named_parameters()` gives them: names and tensors."""
    if (
        not module._modules and (_CLASSES.get(type(module)) or _class_facts(type(module)))[0]
        and not module.__dict__.get("_is_replica", False)
    ):
        params = module._parameters
        values = tuple(params.values())
        for p in values:
            if p is None or isinstance(p, UninitializedParameter):
                break
        else:
            # (A tensor held under two names is given once, by the walk below.)
            if len(values) < 2 or len(set(map(id, values))) == len(values):
                return tuple(params), values  # type: ignore[return-value]
    found: list[tuple[str, Tensor]] = list(module.named_parameters())
    if not found and module.__dict__.get("_is_replica", False):
        found = _replica_parameters(module)
    for name, tensor in found:
        if isinstance(tensor, UninitializedParameter) and not lazy_ok:
            raise GradOverrideError(_lazy_message(f"`{type(module).__qualname__}`", name))
    return tuple(n for n, _ in found), tuple(t for _, t in found)


def _replica_parameters(module: nn.Module) -> list[tuple[str, Tensor]]:
    """The parameters of a replica `nn.DataParallel` made (`torch.nn.parallel.replicate`),
    as `named_parameters()` names the original's: a replica holds copies computed from the
    original's parameters (not leaves, so plain attributes), listed in `_former_parameters`."""
    found: list[tuple[str, Tensor]] = []
    seen: set[int] = set()
    for path, sub in module.named_modules():
        for name, p in getattr(sub, "_former_parameters", {}).items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                found.append((f"{path}.{name}" if path else name, p))
    return found


def floating_buffers(module: nn.Module, where: str) -> dict[str, Tensor] | None:
    """The module's floating buffers at this call, for the rule; refused when a torch.func
    transform wraps them (they would reach the forward as captured)."""
    if is_dynamo_compiling():
        return None  # traced code keeps no per-call objects holding tensors
    if not module._modules:
        if not module._buffers:
            return None
        items: Iterable[tuple[str, Tensor]] = module._buffers.items()  # type: ignore[assignment]
    else:
        items = module.named_buffers()
    buffers = {
        n: b for n, b in items if b is not None and (b.is_floating_point() or b.is_complex())
    }
    if not buffers:
        return None
    if transforms_active():
        wrapped = [n for n, b in buffers.items() if is_transformed(b)]
        if wrapped:
            raise GradOverrideError(_wrapped_buffers_message(where, wrapped[0]))
    return buffers


def call_state(module: nn.Module, where: str) -> CallState | None:
    """The state of a call of `module`'s op: None, unless it holds floating buffers (which
    the rule reads as the forward saw them)."""
    buffers = floating_buffers(module, where)
    if buffers is None:
        return None
    state = CallState()
    state.buffers = buffers
    return state


def refuse_inplace_views(where: str, values: Iterable[Any]) -> None:
    """PyTorch gives a Function that changes a view in place (through CopySlices) the right
    gradient only when the view is the Function's first input; here it is not, so the
    gradient around the view would be silently wrong."""
    for value in values:
        if isinstance(value, Tensor) and value._base is not None and value.requires_grad:
            raise GradOverrideError(_inplace_view_message(where))


def compiled_inplace_message(where: str) -> str:
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


def _became(module: nn.Module, name: str) -> str:
    """What `name`, once a parameter of `module`'s, is now: a buffer, a parametrized tensor
    (`register_parametrization`), or "" (neither)."""
    prefix, _, leaf = name.rpartition(".")
    try:
        owner: Any = module.get_submodule(prefix) if prefix else module
    except AttributeError:
        return ""
    if leaf in owner._buffers:
        return f"a buffer now, which gets no gradient; read it as `self.{name}` in the rule"
    parametrizations = owner._modules.get("parametrizations")
    if parametrizations is not None and leaf in parametrizations._modules:
        original = f"{prefix + '.' if prefix else ''}parametrizations.{leaf}.original"
        return (
            f"parametrized now (`register_parametrization`): the parameter behind it is "
            f"`{original}`; read the computed value as `self.{name}` in the rule, and return "
            f"the gradient for `{original}`"
        )
    return ""
