"""The one route of an op: from a call to its Function, and from backward to its rule.

Every op (`custom_backward`, `straight_through`, the recipes, and the op built around a
module's forward for `go.Module` and `override_backward`) is built here from an `OpPlan`,
once, when its rule is registered. A call goes one way:

1. `run(args, kwargs)` binds the call to one value per slot (`run_bound` starts here for a
   module, whose values are its forward's inputs and its parameters); containers of
   tensors are spread into their leaves (`CallState.layout`);
2. when no gradient can be computed (grad mode off, `inference_mode`; while compiling, no
   tensor that requires grad; while `torch.onnx.export`'s TorchScript-based exporter
   traces, which records an inference graph), the plain forward runs and nothing else:
   compiled inference, `torch.jit.trace` and the ONNX exporters see the forward alone;
3. otherwise a Function runs the forward and keeps what the rule names. Two shapes, chosen
   by what the rule owns:

   * the rule owns every input (the default): the forward runs inside `Function.forward`,
     where autograd records nothing, and the rule supplies every gradient;
   * the rule owns some inputs: the forward runs outside, on the ordinary graph, with the
     owned inputs detached, so the others get their ordinary autograd gradient; an
     "attach" Function then passes the outputs through unchanged and adds the rule's
     gradients for the owned inputs. Nothing is recomputed in backward, which keeps this
     form traceable by `torch.compile` and usable under `torch.func`. A module's forward
     hooks (`override_backward`) use it too, with the forward run by the module itself.

   Each shape has one Function in the `forward` + `setup_context` form, which
   `torch.compile` and `torch.func` need (with `generate_vmap_rule = True`), and the owning
   shape has an eager twin in the classic `forward(ctx, ...)` form, generated for its
   parameter count (`_generate`): `Function.apply` binds its signature on every call for
   the `setup_context` form (about 1.5x a classic Function on small tensors), so an eager
   call without a `torch.func` transform takes the twin through `_C._FunctionBase.apply`;
4. `backward` calls `run_rule`, the one place that calls a rule: under the forward's
   autocast state, with the names it asks for, with a module's parameters as the forward
   saw them; what the rule returned becomes checked gradients in `_gradients`.

The Functions are named after the user's function (`CustomBackward_quantize`), so `grad_fn`
reprs, tracebacks and profiles say where they come from. Each call passes a `CallState` as
the first, non-tensor argument: how the inputs were flattened and, written by the forward,
how to rebuild the outputs.
"""

from __future__ import annotations

import itertools
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.compiler import is_dynamo_compiling
from torch.utils import _pytree as pytree

from ._errors import GradOverrideError, GradOverrideTypeError
from ._frameworks import any_jax, any_tensorflow
from ._gradients import (
    SKIP,
    ModuleForm,
    check_gradient,
    flat_gradients,
    slot_ranges,
    takes_gradient,
)
from ._internals import (
    FAST_APPLY,
    any_autocast_enabled,
    in_compiled_autograd,
    raw_apply,
    tracing_state,
    transforms_active,
)
from ._jit import jit_message
from ._passthrough import AUDITS, as_output, related, shows_input
from ._rule import RuleSpec

__all__ = [
    "RECORDED_CALL",
    "RECORDERS",
    "RECORDING",
    "CallState",
    "OpPlan",
    "Route",
    "any_other_framework",
    "backward_recorded",
    "build_route",
    "check_output_count",
    "current_parameter",
    "exporting_onnx",
    "flatten_inputs",
    "parameters_as",
    "saved_for",
    "unflatten_inputs",
    "unpack_residuals",
]

_CONTAINERS = (tuple, list, dict)

#: The diagnostics recorder started now, if any (`go.monitor`, `go.overrides` with inputs,
#: `gradient_report`): every backward of an op's Function reads it (see
#: `backward_recorded`). It and `RECORDERS` are read in one step, `for recorder in
#: RECORDING:` or `RECORDING[0]` catching IndexError, never `RECORDING[0]` after a look:
#: another thread may empty the list in between (leaving the monitor's block, or, for
#: `RECORDERS`, a monitor recording one step in N deciding a forward).
RECORDING: list[Any] = []

#: The same recorder while the forwards running now are recorded: every op and module call
#: consults it, in eager mode. A monitor recording one step in N leaves it empty during the
#: forwards of the steps it does not record, so that their calls cost what they cost
#: without a monitor.
RECORDERS: list[Any] = []

#: The attribute of an op's backward node (its `ctx`) where a recorder leaves what the node's
#: backward hands it (see `backward_recorded`).
RECORDED_CALL = "gradoverride_recorded"


def backward_recorded(ctx: Any, body: Callable[..., Any], grads: tuple[Any, ...],
                      span: int | None = None) -> Any:
    """The backward of an op's Function while a recorder records: `body(ctx, *grads)`, the
    backward itself, and then, if the recorder left something on the node at the op's call,
    that is handed what the backward returned for the rule's inputs (its first `span`
    entries; all when None) and the gradients it got. Every Function gradoverride makes
    whose node holds a record comes here, from the head of its backward (one read of
    `RECORDING` when nothing records, and of the node's attributes while a recorder
    runs; a node holding none is told to the recorder, `met`, which counts the backward
    passes running the calls of forwards it did not record): it is how a recorder sees an
    override's gradients, with no hook registered on each node at each call."""
    if is_dynamo_compiling():
        return body(ctx, *grads)  # (a compiled call is not recorded: it left nothing)
    returned = body(ctx, *grads)
    recorded = ctx.__dict__.get(RECORDED_CALL)
    if recorded is not None:
        recorded(returned if span is None else returned[:span], grads)
    return returned


class CallState:
    """Per-call bookkeeping shared by the entry, the forward and backward.

    Class attributes are the defaults, so the common call allocates an empty object. It holds
    no tensors, but for a module op's floating buffers (`buffers`), which the rule reads as
    the forward left them and which get no gradient; their version counters are read when
    the forward ends (`buffer_versions`: a forward updating its running statistics in place
    does not trip them, a later call updating them again does, where the rule reads one).
    """

    layout: Any = None  # None, or per parameter: None | (treespec, n_leaves)
    out_spec: Any = None  # None: the output is one tensor; else how to rebuild it
    n_out = 1  # flat output leaves
    n_top = 1  # outputs as the rule counts them (elements of a plain tuple)
    # per declared residual: index into the residual tensors | _Static | _OutputRef | _InputRef
    residuals: tuple[Any, ...] = ()
    n_in = 0  # flat inputs (set by the attach form)
    n_tensor_in = 0  # of which tensors (the attach form)
    dirty: tuple[int, ...] = ()  # flat inputs the forward changed in place (tracked ops only)
    input_views: tuple[int, ...] = ()  # outputs showing an input (the attach form)
    buffers: dict[str, Tensor] | None = None  # a module op's floating buffers
    buffer_versions: tuple[int, ...] | None = None  # theirs when the forward ended
    # Copies of inputs the rule reads, taken before a forward that changes its inputs in
    # place (by flat index): saved instead of the inputs.
    copies: dict[int, Tensor] | None = None
    # The attach form, for a forward the module ran itself: the inputs' version counters
    # before it, and the outputs that are inputs it changed in place (marked dirty).
    versions: tuple[int | None, ...] | None = None
    dirty_outputs: tuple[int, ...] = ()
    eager = False  # applied through the eager entry (see `setup`'s `held`)
    # A checked call's watch on its rule (see `_audit`): `watch(op, parameters)` is a
    # context manager under which writing a parameter's `.grad` raises.
    watch: Callable[[str, dict[str, Tensor]], Any] | None = None
    # A checked call's look at what its op's rule returns (see `_audit.RuleResultCheck`).
    rule_check: Any = None

    def __repr__(self) -> str:
        # The same text for every call: torch.jit.trace compares the graphs of two calls,
        # and prints this object (a constant argument of the recorded op) in them.
        return "CallState()"


class OpPlan(NamedTuple):
    """Everything an op's route needs, read once when its rule is registered."""

    op: str  # the name messages use
    module: str  # `__module__` of the generated classes
    names: tuple[str, ...]  # one per slot
    labels: Mapping[str, str]  # names shown in messages where they differ
    bind: Callable[[tuple[Any, ...], dict[str, Any]], tuple[Any, ...]]
    call: Callable[[Sequence[Any]], Any]  # the forward, given one value per slot
    plain: Callable[..., Any] | None  # the forward as `fn(*values)`, where it takes that
    rule: RuleSpec
    residuals: tuple[str, ...]
    track_inplace: bool  # the forward may change its inputs in place (marked dirty)
    form: ModuleForm | None  # a module's op
    run_tensorflow: Callable[[tuple[Any, ...], dict[str, Any]], Any]
    # False: the forward runs outside the route, and only `attach` is used (a module's
    # forward hooks run it, under no_grad when the rule owns everything).
    runs_forward: bool = True
    # The forward as `fn(v0, v1, ...)` when it takes one positional value per slot (a
    # module's: its forward's own slots), for the generated twin; and each slot's default
    # (`inspect.Parameter.empty`: none), for a user's positional call.
    plain_signature: Callable[..., Any] | None = None
    defaults: tuple[Any, ...] = ()
    # A call with JAX arrays (a module's op has none: modules call `run_bound`).
    run_jax: Callable[[tuple[Any, ...], dict[str, Any]], Any] = lambda args, kwargs: _no_jax()


class Route:
    """An op's built route: the entries a call takes, and the Function behind them.

    * `run(args, kwargs)`: a user's call;
    * `run_bound(values, state)`: a call bound to one value per slot (a module's);
    * `eager(values)`: `run_bound`'s eager step itself, the generated twin (None where the
      op has none), for a caller that has checked what `run_bound` checks first: eager
      mode (no dynamo, no torch.func transform, no `torch.jit.trace`), grad enabled, the
      values plain (no containers), no per-call state;
    * `attach(values, state, out, seen)`: a forward run outside the route (a module's
      hooks), `seen` the detached tensors it saw instead of the owned inputs;
    * `given(values, out)`: `attach`'s eager step itself, the generated twin (None where the
      op has none), for a caller that has checked what `eager` needs, a rule owning every
      input and parameter, the forward run under no_grad and `out` one tensor.
    """

    __slots__ = ("attach", "eager", "function", "given", "run", "run_bound")

    def __init__(
        self,
        run: Callable[[tuple[Any, ...], dict[str, Any]], Any],
        run_bound: Callable[[tuple[Any, ...], CallState | None], Any],
        attach: Callable[..., Any] | None,
        function: type[torch.autograd.Function],
        eager: Callable[[tuple[Any, ...]], Any] | None = None,
        given: Callable[[tuple[Any, ...], Any], Any] | None = None,
    ) -> None:
        self.run = run
        self.run_bound = run_bound
        self.attach = attach
        self.function = function
        self.eager = eager
        self.given = given


class _Static:
    """A saved non-tensor value, told apart from an index into `saved_tensors`."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _OutputRef:
    """A residual that is one of the forward's outputs (`return y, {"y": y}`): it is saved as
    that output, not returned twice (which would make the output itself non-differentiable)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _InputRef:
    """A residual that is one of the forward's (flat) inputs: it is saved as that input."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _is_torch_tensor(value: object) -> bool:
    return isinstance(value, Tensor)


def flatten_inputs(
    values: tuple[Any, ...], is_tensor: Callable[[object], bool] = _is_torch_tensor
) -> tuple[tuple[Any, ...], Any]:
    """Containers holding tensors (as `is_tensor` tells them: the TensorFlow backend passes
    its own) are spread into their leaves; the layout says how, per parameter: None, or
    (treespec, number of leaves)."""
    flat: list[Any] = []
    layout: list[Any] = []
    any_container = False
    for value in values:
        if isinstance(value, _CONTAINERS):
            leaves, spec = pytree.tree_flatten(value)
            if any(is_tensor(leaf) for leaf in leaves):
                flat.extend(leaves)
                layout.append((spec, len(leaves)))
                any_container = True
                continue
        flat.append(value)
        layout.append(None)
    if not any_container:
        return values, None
    return tuple(flat), tuple(layout)


def unflatten_inputs(flat: Sequence[Any], layout: Any) -> tuple[Any, ...]:
    values: list[Any] = []
    i = 0
    for entry in layout:
        if entry is None:
            values.append(flat[i])
            i += 1
        else:
            spec, n = entry
            values.append(pytree.tree_unflatten(list(flat[i : i + n]), spec))
            i += n
    return tuple(values)


def unpack_residuals(result: Any, names: tuple[str, ...], op: str) -> tuple[Any, dict[str, Any]]:
    """`(output, {name: value})` from a forward that declares residuals, checked."""
    if not (type(result) is tuple and len(result) == 2 and isinstance(result[1], dict)):
        msg = (
            f"`{op}` declares residuals={names!r}, so its forward must return "
            f"`(output, {{{', '.join(repr(n) + ': ...' for n in names)}}})`, "
            f"got {type(result).__name__}."
        )
        raise GradOverrideError(msg)
    output, given = result
    if set(given) != set(names):
        msg = (
            f"the forward of `{op}` returned residuals {sorted(given)!r}, but it declares "
            f"residuals={names!r}; return exactly the declared names."
        )
        raise GradOverrideError(msg)
    return output, given


def check_output_count(n_grads: int | None, n_top: int, rule_name: str, op: str) -> None:
    """A rule takes one upstream gradient per output (any number with `*grads`)."""
    if n_grads is not None and n_grads != n_top:
        msg = (
            f"backward rule `{rule_name}` of `{op}` takes {n_grads} upstream "
            f"gradient(s), but `{op}` returned {n_top} output(s); give the rule "
            "one positional parameter per output (or `*grads`)."
        )
        raise GradOverrideTypeError(msg)


def saved_for(
    ctx: Any, op: str, names: Sequence[str], labels: Mapping[str, str] | None = None
) -> tuple[Tensor, ...]:
    """`ctx.saved_tensors`, with PyTorch's error for a saved tensor changed in place since
    the forward said in the op's terms: which values the rule reads, and the fix. (Any other
    error is raised as is.)"""
    try:
        saved: tuple[Tensor, ...] = ctx.saved_tensors
    except RuntimeError as exc:
        if "modified by an inplace operation" not in str(exc):
            raise
        shown = [(labels or {}).get(n, n) for n in names]
        listed = ", ".join(f"`{n}`" for n in shown if n)
        msg = (
            f"the backward rule of `{op}` reads {listed}, and one of them was changed in "
            "place after the forward (an in-place op such as `relu_()` on the result or on "
            "an input), so the rule would read a value the forward never saw. Make that op "
            "out of place (`y = torch.relu(y)`), or apply it to a copy (`y.clone()`)."
        )
        raise GradOverrideError(msg) from exc
    return saved


# ---- a module's parameters, as the forward or the rule sees them ----------------------------

try:  # the context manager `torch.func.functional_call` is built on
    from torch.nn.utils.stateless import _reparametrize_module as _reparametrize
except ImportError:  # pragma: no cover - depends on torch version
    _reparametrize = None  # type: ignore[assignment]


def current_parameter(module: nn.Module, name: str) -> Tensor | None:
    """The tensor `module` holds as parameter `name` now (a dotted name for a submodule's):
    a Parameter, or what stands for it (`torch.func.functional_call` swaps plain tensors
    in); None where it holds none by that name."""
    if "." not in name:
        found: Any = module._parameters.get(name)
        if found is None and module.__dict__.get("_is_replica", False):
            found = module.__dict__.get(name)  # (see `parameter_at`)
        return found  # type: ignore[no-any-return]
    *path, leaf = name.split(".")
    return parameter_at(module, tuple(path), leaf)


def parameter_at(module: nn.Module, path: tuple[str, ...], leaf: str) -> Tensor | None:
    """`current_parameter` for the name `path` + `leaf`, split once (generated code)."""
    node: Any = module
    for part in path:
        node = node._modules.get(part)
        if node is None:
            return None
    found: Any = node._parameters.get(leaf)
    if found is None and node.__dict__.get("_is_replica", False):
        # A replica `nn.DataParallel` made holds its parameters' copies as plain attributes.
        found = node.__dict__.get(leaf)
    return found  # type: ignore[no-any-return]


@contextmanager
def parameters_as(module: nn.Module, values: Mapping[str, Tensor]) -> Iterator[None]:
    """Run with `module`'s parameters and buffers (by dotted name) replaced by `values`
    where they differ (what `torch.func.functional_call` does for a call)."""
    swap = {name: v for name, v in values.items() if _held(module, name) is not v}
    if not swap:
        yield
        return
    if _reparametrize is None:  # pragma: no cover
        msg = (
            "this torch has no `torch.nn.utils.stateless._reparametrize_module`, which a module "
            "rule needs to see the parameters its forward saw; call the module directly, "
            "not through functional_call."
        )
        raise GradOverrideError(msg)
    with _reparametrize(module, swap):
        yield


def _held(module: nn.Module, name: str) -> Any:
    prefix, _, leaf = name.rpartition(".")
    owner: Any = module.get_submodule(prefix) if prefix else module
    if leaf in owner._parameters:
        return owner._parameters[leaf]
    if leaf in owner._buffers:
        return owner._buffers[leaf]
    return parameter_at(owner, (), leaf)  # (a replica's copy)


class _StaleParameter(Tensor):
    """What a rule reads for a parameter changed in place between its forward and backward:
    any use beyond its metadata raises, naming the parameter (a rule that never reads it runs,
    as plain autograd runs when no saved tensor was changed)."""

    _gradoverride_stale: tuple[str, str, str]  # (op, name, "parameter" | "buffer")

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        name = getattr(func, "__name__", "")
        if name == "__get__":
            prop = getattr(getattr(func, "__self__", None), "__name__", "")
            if prop in ("shape", "dtype", "device", "layout", "requires_grad", "ndim"):
                with torch._C.DisableTorchFunctionSubclass():
                    return func(*args, **(kwargs or {}))
        if name in ("size", "dim", "numel", "__repr__", "__format__", "is_floating_point"):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        stale = next(
            a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, _StaleParameter)
        )
        op, name, kind = stale._gradoverride_stale
        when = (
            "(an optimizer step, or an in-place update such as `.mul_()` or `.copy_()`, "
            "between forward and backward)" if kind == "parameter"
            else "(another call of the module updating it, a running statistic, before this "
            "call's backward)"
        )
        msg = (
            f"the backward rule of `{op}` reads the {kind} `{name}`, which was changed in "
            f"place after the forward {when}, so it would compute with a value the forward "
            f"never used. Run backward before changing the {kind}, or change it out of place."
        )
        raise GradOverrideError(msg)


def _stale(p: Tensor, op: str, name: str, kind: str = "parameter") -> Tensor:
    # `.data`: the new tensor's version counter is its own, so saving it trips nothing.
    stale = torch.Tensor._make_subclass(_StaleParameter, p.data, False)
    stale._gradoverride_stale = (op, name, kind)
    return stale


# ---- building an op's route ------------------------------------------------------------------


def _identifier(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.split(".")[-1]) or "op"


# What `setup` leaves on `ctx.gradoverride` for backward, as a tuple (built on every call,
# so no class): (state, meta, plan, out_meta, autocast, unowned, held), where
#   meta     per flat input: None (not a tensor) | SKIP | (shape, dtype, device);
#   plan     per named value: (name, None | treespec, entries), an entry being an index
#            into saved_tensors or a _Static;
#   out_meta output metadata, when we materialize zero gradients ourselves, else None;
#   autocast (device_type, dtype, enabled) the forward ran under, else None;
#   unowned  (flat index, shape, dtype, device) of inputs needing a gradient the rule does
#            not give (for the zeros a compiled backward needs, see `_fill_none`);
#   held     a module op's (module, parameters, versions): the parameters the forward saw,
#            as tensors (the eager twin, where the module holds them anyway) or as indices
#            into saved_tensors, and their version counters then (or None).
# The generated eager twin leaves its own, shorter record (see `_generate`). Tensors go
# through save_for_backward, but for a module's parameters in the eager twin (see `held`).


def build_route(plan: OpPlan) -> Route:
    """The route of the op `plan` describes (see the module docstring)."""
    op, names, rule = plan.op, plan.names, plan.rule
    labels = plan.labels
    n_params = len(names)
    owned = rule.owned
    form = plan.form
    residuals = plan.residuals
    requested_slots = rule.requested_slots
    wants_output = rule.wants_output
    wants_needs_grad = rule.wants_needs_grad
    materialize = rule.materialize_grads
    once = rule.once_differentiable
    # Plain values only in these closures: dynamo cannot wrap a RuleSpec object met while
    # speculating a Function's forward.
    n_grads = rule.n_grads
    rule_name = rule.name
    user_rule = rule.rule
    method = rule.method
    requested_residuals = rule.requested_residuals
    note = f"(raised in backward rule `{rule_name}` of `{op}`)"
    param_slots = () if form is None else form.params
    param_names = tuple(names[i] for i in param_slots)
    owned_params = tuple(names[i] for i in param_slots if owned[i])

    # ---- forward-side bookkeeping ---------------------------------------------------------

    def setup(
        ctx: Any,
        state: CallState,
        flat: tuple[Any, ...],
        outputs: tuple[Any, ...],
        residual_tensors: tuple[Any, ...],
    ) -> None:
        check_output_count(n_grads, state.n_top, rule_name, op)
        needs = ctx.needs_input_grad  # [0] is the CallState
        ranges = slot_ranges(state.layout, n_params)
        meta: list[Any] = []
        # Inputs that need a gradient the rule does not give (not owned): their metadata, for
        # the zeros a compiled backward returns instead of None (see `_fill_none`). Owned
        # ones have theirs in `meta`.
        unowned: list[tuple[int, Any, Any, Any]] = []
        for slot, (start, stop, _) in enumerate(ranges):
            for i in range(start, stop):
                value = flat[i]
                if not takes_gradient(value):
                    # Not a tensor, or an integer/bool tensor (an index): never owned, so a
                    # lone returned tensor belongs to the one floating input.
                    meta.append(None)
                elif needs[i + 1]:
                    if owned[slot]:
                        meta.append((value.shape, value.dtype, value.device))
                    else:
                        meta.append(SKIP)
                        unowned.append((i, value.shape, value.dtype, value.device))
                else:
                    meta.append(SKIP)

        to_save: list[Tensor] = []
        plan_: list[tuple[str, Any, tuple[Any, ...]]] = []

        def keep(name: str, spec: Any, leaves: Sequence[Any]) -> None:
            entries: list[Any] = []
            for leaf in leaves:
                if isinstance(leaf, Tensor):
                    entries.append(len(to_save))
                    to_save.append(leaf)
                else:
                    entries.append(_Static(leaf))
            plan_.append((name, spec, tuple(entries)))

        copies = state.copies
        for name, slot in requested_slots:
            start, stop, spec = ranges[slot]
            values = flat[start:stop]
            if copies:
                values = tuple(copies.get(start + k, v) for k, v in enumerate(values))
            keep(name, spec, values)
        if wants_output:
            keep("output", state.out_spec, outputs)
        for name, index in requested_residuals:
            entry = state.residuals[index]
            if isinstance(entry, _Static):
                plan_.append((name, None, (entry,)))
            elif isinstance(entry, _OutputRef):
                keep(name, None, (outputs[entry.index],))
            elif isinstance(entry, _InputRef):
                keep(name, None, (flat[entry.index],))
            else:
                keep(name, None, (residual_tensors[entry],))
        held: tuple[Any, tuple[Any, ...], tuple[int, ...] | None] | None = None
        if form is not None:
            # The parameters the forward saw, for the rule (under functional_call the module
            # holds others by then): in the eager twin by reference, with their version
            # counters (the module holds them anyway; a rule reading one changed in place
            # since gets an error, one that does not read it runs); else saved.
            module = flat[0]
            params = tuple(flat[ranges[i][0]] for i in param_slots)
            if state.buffers and not is_dynamo_compiling():
                state.buffer_versions = tuple(b._version for b in state.buffers.values())
            if state.eager:
                held = (module, params, tuple(p._version for p in params))
            else:
                held = (module, tuple(range(len(to_save), len(to_save) + len(params))), None)
                to_save.extend(params)
        if state.dirty:
            dirty = [flat[i] for i in state.dirty]
            if not all(any(t is o for o in outputs) for t in dirty):
                msg = (
                    f"the forward of `{op}` changed one of its tensor inputs in place but did "
                    "not return it; an input changed in place must be returned as an output "
                    "(as `x.relu_()` returns `x`), or changed out of place."
                )
                raise GradOverrideError(msg)
            ctx.mark_dirty(*dirty)
        if to_save:
            ctx.save_for_backward(*to_save)

        out_meta = None
        # Residual tensors are extra outputs and stay differentiable: a second
        # differentiation that reaches one arrives in backward as a gradient for it, and is
        # refused there (a residual is a constant to autograd: silently wrong otherwise).
        if residual_tensors or not materialize:
            # Residual outputs would get materialized zero gradients; when the rule wants
            # materialized gradients we make zeros for the real outputs only.
            ctx.set_materialize_grads(False)
            if residual_tensors and materialize:
                out_meta = tuple(
                    (o.shape, o.dtype, o.device) if isinstance(o, Tensor) else None
                    for o in outputs
                )
        autocast = _autocast_state(flat) if any_autocast_enabled() else None
        ctx.gradoverride = (state, meta, tuple(plan_), out_meta, autocast, tuple(unowned), held)

    # ---- backward: the one place that calls the rule ----------------------------------------

    def run_rule(ctx: Any, grads: tuple[Any, ...]) -> list[Tensor | None]:
        """Call the rule; one checked gradient per flat input."""
        state, meta, plan_, out_meta, autocast, _, held = ctx.gradoverride
        kwargs: dict[str, Any] = {}
        saved: tuple[Tensor, ...] = ()
        if plan_ or (held is not None and held[2] is None):
            read = [name for name, _, _ in plan_]
            if held is not None and held[2] is None:
                read += list(param_names)
            saved = saved_for(ctx, op, read, labels)
        for name, spec, entries in plan_:
            leaves = [saved[e] if type(e) is int else e.value for e in entries]
            kwargs[name] = leaves[0] if spec is None else pytree.tree_unflatten(leaves, spec)
        if wants_needs_grad:
            kwargs["needs_grad"] = _needs_grad_map(ctx.needs_input_grad, state)

        if state.out_spec is None:
            rule_grads = grads[:1]
        else:
            upstream = grads[: state.n_out]
            if out_meta is not None:
                upstream = tuple(
                    torch.zeros(m[0], dtype=m[1], device=m[2]) if g is None and m else g
                    for g, m in zip(upstream, out_meta, strict=True)
                )
            tree = pytree.tree_unflatten(list(upstream), state.out_spec)
            rule_grads = tuple(tree) if state.n_top > 1 or type(tree) is tuple else (tree,)

        if held is None and state.rule_check is not None and not is_dynamo_compiling():
            with state.rule_check.watching(rule_grads):
                result = call_rule(user_rule, rule_grads, kwargs, autocast, once, note)
        elif held is None:
            result = call_rule(user_rule, rule_grads, kwargs, autocast, once, note)
        else:
            module, params, versions = held
            if versions is None:
                params = tuple(saved[i] for i in params)
            result = _call_module_rule(
                module, params, versions, state, rule_grads, kwargs, autocast
            )
        flat_grads = flat_gradients(
            result, op=op, names=names, owned=owned, layout=state.layout, meta=meta,
            module=form,
        )
        if held is None and state.rule_check is not None:  # (after the refusals above)
            state.rule_check.inspect(op, names, result)
        if once and torch.is_grad_enabled():
            flat_grads = _guard(op, flat_grads, rule_grads, saved)
        return flat_grads

    def _needs_grad_map(needs: tuple[bool, ...], state: CallState) -> dict[str, bool]:
        ranges = slot_ranges(state.layout, n_params)
        shown = range(n_params) if form is None else range(1, n_params)
        return {
            names[slot]: owned[slot] and any(needs[ranges[slot][0] + 1 : ranges[slot][1] + 1])
            for slot in shown
        }

    def _call_module_rule(
        module: nn.Module,
        params: tuple[Tensor, ...],
        versions: tuple[int, ...] | None,
        state: CallState,
        grads: tuple[Any, ...],
        kwargs: dict[str, Any],
        autocast: tuple[str, Any, bool] | None,
    ) -> Any:
        """The rule of a module's op, with the module holding what its forward saw."""
        args = (module, *grads) if method else grads
        seen: dict[str, Tensor] = {}
        for name, p, version in zip(
            param_names, params, versions or (None,) * len(params), strict=True
        ):
            seen[name] = p if version is None or p._version == version else _stale(p, op, name)
        if state.buffers:
            for (name, b), version in zip(
                state.buffers.items(),
                state.buffer_versions or (None,) * len(state.buffers), strict=True,
            ):
                seen[name] = (
                    b if version is None or b._version == version
                    else _stale(b, op, name, "buffer")
                )
        # The `.grad` a rule might write: read before it runs (see `_wrote_grad`).
        watch = owned_params if not is_dynamo_compiling() else ()
        mark = in_backward() if watch else -1
        current = [current_parameter(module, n) for n in watch]
        # (`.grad` of a tensor that is not a leaf, a replica's parameter, is never written.)
        before = [None if p is None or not p.is_leaf else p.grad for p in current]
        if state.watch is not None and not is_dynamo_compiling():
            with state.watch(op, dict(zip(param_names, params, strict=True))), \
                    parameters_as(module, seen):
                result = call_rule(user_rule, args, kwargs, autocast, once, note)
        else:
            with parameters_as(module, seen):
                result = call_rule(user_rule, args, kwargs, autocast, once, note)
        for name, held_now, grad in zip(watch, current, before, strict=True):
            # (a `.grad` set to None meanwhile: another thread's `zero_grad`)
            if (
                held_now is not None and held_now.is_leaf and held_now.grad is not grad
                and held_now.grad is not None and _single_thread(mark)
            ):
                raise GradOverrideError(wrote_grad_message(op, name))
        return result

    def backward_general(ctx: Any, grads: tuple[Any, ...]) -> Any:
        state = ctx.gradoverride[0]
        if residuals and not torch.compiler.is_compiling():
            _refuse_residual_gradients(op, residuals, state, grads[state.n_out :])
        record = ctx.gradoverride
        return (None, *_fill_none(run_rule(ctx, grads), record[1], record[5]))

    common = _Common(plan, setup, run_rule, backward_general, _call_module_rule)
    if rule.owns_all and plan.runs_forward:
        return _build_owning(plan, common)
    return _build_attaching(plan, common)


class _Common(NamedTuple):
    plan: OpPlan
    setup: Callable[..., None]
    run_rule: Callable[[Any, tuple[Any, ...]], list[Tensor | None]]
    backward_general: Callable[[Any, tuple[Any, ...]], Any]
    call_module_rule: Callable[..., Any]


def _plain_call(plan: OpPlan, values: tuple[Any, ...], owning: bool) -> Any:
    """The forward alone, where no gradient can be computed (see `_no_gradient`); run as the
    route would run it: without recording where the rule owns every input (a captured
    tensor that requires grad gets no gradient, in every mode alike), on the ordinary graph
    where it owns some."""
    if owning:
        with torch.no_grad():
            out = plan.call(values)
    else:
        out = plan.call(values)
    if plan.residuals:
        out, _ = unpack_residuals(out, plan.residuals, plan.op)
    if AUDITS:
        # Inside another op's checked forward: this op's rule passes gradient from its
        # inputs to its result, whatever its forward's own calls are.
        AUDITS[-1].carry(values, out)
    return out


def exporting_onnx() -> bool:
    """Whether `torch.onnx.export` runs now (asked only while `torch.jit.trace` records: the
    TorchScript-based exporter, `dynamo=False`, traces the model with grad enabled). What it
    records is an inference graph, which no backward rule can be part of, so the forward
    runs alone there, as under `no_grad`."""
    onnx = sys.modules.get("torch.onnx")  # imported by the exporter; never imported here
    return onnx is not None and bool(onnx.is_in_onnx_export())


def _no_gradient(flat: Sequence[Any]) -> bool:
    """Whether this call can compute no gradient, so the plain forward runs: grad mode is
    off (`no_grad`, `inference_mode`: compiled inference, `torch.jit.trace` for
    deployment), the TorchScript-based ONNX exporter traces (`exporting_onnx`), or, while
    compiling, no tensor input requires grad (a frozen model; dynamo cannot trace a
    `setup_context` Function none of whose inputs requires grad). Eager, such a call takes
    the Function, whose output requires no grad either; `torch.jit.trace` with grad
    enabled is refused by the caller (the traced graph could be called later with inputs
    that require grad, and would silently drop the rule)."""
    if not torch.is_grad_enabled():
        return True
    if not is_dynamo_compiling():
        return tracing_state() is not None and exporting_onnx()
    return not any(isinstance(value, Tensor) and value.requires_grad for value in flat)


def _build_owning(plan: OpPlan, common: _Common) -> Route:
    """The forward runs inside the Function; the rule gives every gradient.

    With `track_inplace`, the forward's changes to its inputs are detected (version
    counters) and marked dirty, as PyTorch requires of a Function that changes an input."""
    op, residuals, track_inplace = plan.op, plan.residuals, plan.track_inplace
    call, bind = plan.call, plan.bind
    plain = plan.plain
    run_tensorflow = plan.run_tensorflow
    run_jax = plan.run_jax
    setup, backward_general = common.setup, common.backward_general
    module_buffers = plan.form is not None

    def shape_output(out: Any, state: CallState, flat: tuple[Any, ...]) -> Any:
        """The Function's output for what the forward returned: a tensor, or flat leaves
        (the residual tensors after them). `flat` are the inputs the forward saw."""
        dirty = state.dirty
        if residuals:
            out, given = unpack_residuals(out, residuals, op)
            leaves = _flatten_output(out, state, op)
            res = _place_residuals(given, residuals, leaves, flat, state)
            return (*(_as_output(leaf, flat, dirty, leaves, state) for leaf in leaves), *res)
        if isinstance(out, Tensor):
            return _as_output(out, flat, dirty, (), state)
        leaves = _repeats_as_views(_flatten_output(out, state, op))
        return tuple(_as_output(leaf, flat, dirty, leaves, state) for leaf in leaves)

    def _as_output(t: Any, flat: tuple[Any, ...], dirty: tuple[int, ...],
                   leaves: tuple[Any, ...], state: CallState) -> Any:
        if module_buffers and state.buffers and isinstance(t, Tensor) and any(
            t is b for b in state.buffers.values()
        ):
            # A module's buffer returned as-is: the output is a new tensor sharing its
            # memory, so that the buffer itself never becomes a node of the graph.
            return t.detach()
        return as_output(t, flat, dirty, leaves)

    def forward_impl(state: CallState, flat: tuple[Any, ...]) -> Any:
        # Version counters are not traceable (dynamo would guard on their values): while
        # compiling, an input returned as-is by an op that changes its inputs in place is
        # taken as changed.
        versions = _versions(flat) if track_inplace and not is_dynamo_compiling() else None
        if track_inplace:
            # The rule reads the inputs as they were called with: copies, taken now.
            state.copies = {
                i: flat[i].clone() for i in requested_flat(state)
                if isinstance(flat[i], Tensor)
            }
        if state.layout is None:
            out = plain(*flat) if plain is not None else call(flat)
        else:
            out = call(unflatten_inputs(flat, state.layout))
        if versions is not None:
            state.dirty = _changed(flat, versions)
        elif track_inplace:
            state.dirty = _returned(flat, out)
        return shape_output(out, state, flat)

    def forward(state: CallState, *flat: Any) -> Any:
        return forward_impl(state, flat)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        state = inputs[0]
        if state.out_spec is None:
            setup(ctx, state, inputs[1:], (output,), ())
        else:
            n_out = state.n_out
            setup(ctx, state, inputs[1:], output[:n_out], output[n_out:])

    def forward_eager(ctx: Any, state: CallState, *flat: Any) -> Any:
        output = forward_impl(state, flat)
        if state.out_spec is None:
            setup(ctx, state, flat, (output,), ())
        else:
            n_out = state.n_out
            setup(ctx, state, flat, output[:n_out], output[n_out:])
        return output

    requested = tuple(slot for _, slot in plan.rule.requested_slots)

    def requested_flat(state: CallState) -> list[int]:
        """The flat inputs the rule names (a container slot: its leaves)."""
        ranges = slot_ranges(state.layout, len(plan.names))
        return [i for slot in requested for i in range(ranges[slot][0], ranges[slot][1])]

    def backward(ctx: Any, *grads: Any) -> Any:
        if RECORDING:
            if RECORDED_CALL in ctx.__dict__:
                return backward_recorded(ctx, backward_body, grads)
            for recorder in RECORDING:
                recorder.met(ctx)  # (a call it did not record: see `backward_recorded`)
        return backward_general(ctx, grads)

    def backward_body(ctx: Any, *grads: Any) -> Any:
        return backward_general(ctx, grads)

    def finish(out: Any, state: CallState) -> Any:
        if state.out_spec is None:
            return out
        return pytree.tree_unflatten(list(out[: state.n_out]), state.out_spec)

    # Set once the classes exist: the generated code reads them.
    raw: Callable[..., Any]
    apply: Callable[..., Any]
    twin_raw: Callable[..., Any] | None = None

    def run_bound(values: tuple[Any, ...], state: CallState | None) -> Any:
        """A call bound to one value per slot; `state` may be None (a fresh one is made
        where it is needed)."""
        if is_dynamo_compiling() and transforms_active():
            return _outside_compile(op, run_bound, values, state)
        if (
            twin_raw is not None and FAST_APPLY and not is_dynamo_compiling()
            and torch.is_grad_enabled() and not transforms_active() and tracing_state() is None
            and (state is None or (state.buffers is None and state.watch is None
                                   and state.rule_check is None))
        ):
            # Eager, no torch.func transform: the generated twin, without Function.apply's
            # per-call signature binding (see _internals). Dynamo folds `is_dynamo_compiling`
            # to True and so traces `cls.apply`, which it understands.
            for value in values:
                if isinstance(value, _CONTAINERS):
                    break
            else:
                if state is not None:
                    state.eager = True
                out = twin_raw(state, *values)
                if type(out) is not tuple:
                    return out
                if state is None:  # not one tensor: the twin's fresh state is last
                    return finish(out[:-1], out[-1])
                return finish(out, state)
        if state is None:
            state = CallState()
        for value in values:
            if isinstance(value, _CONTAINERS):
                flat, state.layout = flatten_inputs(values)
                break
        else:
            flat = values
        if _no_gradient(flat):
            return _plain_call(plan, values, True)
        if tracing_state() is not None:
            raise GradOverrideError(jit_message(f"`{op}`", "torch.jit.trace"))
        if FAST_APPLY and not is_dynamo_compiling() and not transforms_active():
            # Eager, no torch.func transform: the classic twin (see above).
            state.eager = True
            return finish(raw(state, *flat), state)
        return finish(_apply_general(op, apply, state, *flat), state)

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if any_tensorflow(args, kwargs):
            return run_tensorflow(args, kwargs)
        if any_jax(args, kwargs):
            return run_jax(args, kwargs)
        return run_bound(bind(args, kwargs), CallState())

    twin = _twin(plan, common, {
        "setup": setup, "shape_output": shape_output, "run_general": run,
        "run_bound": run_bound, "run_tensorflow": run_tensorflow, "finish": finish,
    })
    if twin is not None:
        backward = twin.backward
        if twin.run is not None:
            run = twin.run
    name = f"CustomBackward_{_identifier(op)}"
    cls = _function_class(name, plan.module, op, forward, setup_context, backward)
    apply = cls.apply
    raw = raw_apply(_classic_function_class(name, plan.module, op, forward_eager, backward))
    eager = None
    if twin is not None:
        twin_cls = _classic_function_class(name, plan.module, op, twin.forward, backward)
        twin_raw = raw_apply(twin_cls)
        twin.namespace.update(_go_raw=twin_raw)

        def eager(values: tuple[Any, ...]) -> Any:
            out = twin_raw(None, *values)
            if type(out) is tuple:  # not one tensor: the twin's fresh state is last
                return finish(out[:-1], out[-1])
            return out

    return Route(run, run_bound, None, cls, eager)


def _twin(plan: OpPlan, common: _Common, pieces: dict[str, Any], attach: bool = False) -> Any:
    """The generated eager twin (`_generate`) of an op, where it covers the rule; `attach`:
    of a module's op whose rule owns some inputs only."""
    rule, form = plan.rule, plan.form
    if (
        plan.track_inplace or plan.residuals or rule.n_grads not in (None, 1)
        or rule.once_differentiable or rule.wants_needs_grad or len(plan.names) == 0
        or plan.plain_signature is None or not FAST_APPLY
    ):
        return None
    from ._generate import ModuleTwin, generate  # (compiling its source costs ms: at first use)

    module = None
    n_forward = len(plan.names)
    if form is not None:
        n_forward = form.params[0] if form.params else len(plan.names)
        module = ModuleTwin(
            method=rule.method,
            params=tuple((i, plan.names[i]) for i in form.params),
            owned_params=tuple(plan.names[i] for i in form.params if rule.owned[i]),
            owned_inputs=tuple(i for i in form.inputs if rule.owned[i]),
            attach=attach,
        )
    namespace = {
        "fn": plan.plain_signature, "rule": rule.rule, "rule_name": rule.name,
        "Tensor": Tensor, "CallState": CallState, "as_output": as_output,
        "shape_output": pieces["shape_output"], "setup": pieces["setup"],
        "backward_general": common.backward_general, "saved_for": saved_for,
        "RECORDING": RECORDING, "RECORDED_CALL": RECORDED_CALL,
        "backward_recorded": backward_recorded,
        "call_rule": call_rule, "check_gradient": check_gradient,
        "flat_gradients": flat_gradients, "GradOverrideError": GradOverrideError,
        "SKIP": SKIP, "FORM": form, "OWNED": rule.owned, "autocast_state": _autocast_state,
        "any_autocast_enabled": any_autocast_enabled,
        "module_rule": common.call_module_rule, "parameter_at": parameter_at,
        "single_thread": _single_thread, "in_backward": in_backward,
        "wrote_grad": lambda name: _raise(wrote_grad_message(plan.op, name)),
        "run_general": pieces["run_general"], "run_bound": pieces["run_bound"],
        # The twin looks for another framework's values only when its first value is not a
        # torch tensor, and hands such a call to the general `run`, which tells them apart.
        "run_tensorflow": pieces["run_general"], "any_tensorflow": any_other_framework,
        "finish": pieces["finish"], "is_grad_enabled": torch.is_grad_enabled,
        "tracing_state": tracing_state, "is_dynamo_compiling": is_dynamo_compiling,
        "transforms_active": transforms_active, "FAST_APPLY": FAST_APPLY,
    }
    twin = generate(
        op=plan.op, names=plan.names, n_forward=n_forward,
        requested=rule.requested_slots, wants_output=rule.wants_output,
        materialize=rule.materialize_grads, module=module,
        defaults=plan.defaults if form is None else None, namespace=namespace,
    )
    return twin


def _raise(message: str) -> None:
    raise GradOverrideError(message)


def any_other_framework(args: Sequence[Any], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether any argument is TensorFlow's or JAX's (free when neither was imported)."""
    return any_tensorflow(args, kwargs) or any_jax(args, kwargs)


def _no_jax() -> Any:
    raise AssertionError("a module's op has no JAX call")  # pragma: no cover


def _build_attaching(plan: OpPlan, common: _Common) -> Route:
    """The forward runs on the ordinary graph (the owned inputs detached), or, for a forward
    run outside the route that the rule owns whole, under no_grad; the Function attaches
    the rule's gradients to its outputs."""
    op, residuals = plan.op, plan.residuals
    call, bind = plan.call, plan.bind
    owned_params = plan.rule.owned
    run_tensorflow = plan.run_tensorflow
    run_jax = plan.run_jax
    setup, run_rule = common.setup, common.run_rule
    # The outputs' upstream gradients continue, unchanged, into the ordinary graph of the
    # inputs the rule does not own; a rule owning everything has no such graph (its forward
    # ran under no_grad), where an output that is an input changed in place still has the
    # input's old history, which the rule's gradient reaches through the input itself.
    pass_on = not plan.rule.owns_all

    def forward(state: CallState, *args: Any) -> Any:
        # New tensors sharing the outputs' memory, not the outputs themselves: the
        # setup_context form may not save an input returned as-is (a rule may name
        # `output`), and an in-place op right after (`nn.ReLU(inplace=True)`) may not change
        # a view made inside a Function.
        n_in = state.n_in
        if state.out_spec is None:
            return _attached(args[n_in], 0, state)
        return tuple(_attached(a, k, state) for k, a in enumerate(args[n_in : n_in + state.n_out]))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        state = inputs[0]
        n_in = state.n_in
        outs = (output,) if state.out_spec is None else tuple(output)
        if state.dirty_outputs:
            ctx.mark_dirty(*(outs[k] for k in state.dirty_outputs))
        setup(ctx, state, inputs[1 : 1 + n_in], outs, inputs[1 + n_in + state.n_out :])

    def backward(ctx: Any, *grads: Any) -> Any:
        if RECORDING:
            if RECORDED_CALL not in ctx.__dict__:
                for recorder in RECORDING:
                    recorder.met(ctx)  # (a call it did not record: see `backward_recorded`)
                return backward_body(ctx, *grads)
            # (what the rule returned: the gradients for the Function's first inputs, the
            # call's; the outputs' passed on after them are not the rule's)
            return backward_recorded(ctx, backward_body, grads,
                                     1 + ctx.gradoverride[0].n_in)
        return backward_body(ctx, *grads)

    def backward_body(ctx: Any, *grads: Any) -> Any:
        state = ctx.gradoverride[0]
        n_res = sum(1 for r in state.residuals if type(r) is int)
        record = ctx.gradoverride
        rule_grads = _fill_none(run_rule(ctx, grads), record[1], record[5])
        passed = grads[: state.n_out] if pass_on else (None,) * state.n_out
        return (None, *rule_grads, *passed, *([None] * n_res))

    name = f"CustomBackward_{_identifier(op)}"
    cls = _function_class(name, plan.module, op, forward, setup_context, backward)
    apply: Callable[..., Any] = cls.apply
    raw = raw_apply(cls)

    def owned_leaves(layout: Any) -> tuple[bool, ...]:
        if layout is None:
            return owned_params
        return tuple(
            o for o, entry in zip(owned_params, layout, strict=True)
            for _ in range(1 if entry is None else entry[1])
        )

    fast = None
    if plan.form is not None and not plan.rule.owns_all:
        # A module's rule owning some inputs only: the generated twin, given an output that
        # is one tensor showing no input.
        twin = _twin(plan, common, {
            "setup": setup, "shape_output": None, "run_general": None, "run_bound": None,
            "run_tensorflow": None, "finish": None,
        }, attach=True)
        if twin is not None and twin.forward_given is not None:
            fast_cls = _classic_function_class(name, plan.module, op, twin.forward_given,
                                               twin.backward)
            fast = raw_apply(fast_cls)

    def attach(values: tuple[Any, ...], state: CallState, out: Any,
               seen: tuple[Any, ...] = ()) -> Any:
        """Attach the rule to `out`, what the forward returned for `values` (as the caller
        holds them; the forward saw the owned ones detached, `seen`, or ran under
        no_grad)."""
        if (
            fast is not None and type(out) is Tensor and out._base is None
            and state.layout is None and state.versions is None and not AUDITS
            and FAST_APPLY and not is_dynamo_compiling()
            and not transforms_active()
            and not any(out is v for v in values) and not any(out is v for v in seen)
        ):
            return fast(state, *values, out)
        if is_dynamo_compiling() and transforms_active():
            return _outside_compile(op, attach, values, state, out, seen)
        flat = values if state.layout is None else flatten_inputs(values)[0]
        state.n_in = len(flat)
        state.n_tensor_in = sum(1 for v in flat if isinstance(v, Tensor))
        res: tuple[Tensor, ...] = ()
        given = None
        if residuals:
            out, given = unpack_residuals(out, residuals, op)
        if given is None and isinstance(out, Tensor):
            leaves: tuple[Any, ...] = (out,)
        else:
            leaves = _flatten_output(out, state, op)
        if given is not None:
            res = _place_residuals(given, residuals, leaves, flat, state)
        if state.versions is not None:
            changed = _changed(flat, state.versions)
            state.dirty_outputs = tuple(
                k for k, leaf in enumerate(leaves) if any(leaf is flat[i] for i in changed)
            )
            if len(state.dirty_outputs) < len(changed):
                msg = (
                    f"the forward of `{op}` changed one of its tensor inputs in place but did "
                    "not return it; an input changed in place must be returned as an output "
                    "(as `x.relu_()` returns `x`), or changed out of place."
                )
                raise GradOverrideError(msg)
        # An input returned as it is (not changed in place), or a tensor returned twice, goes
        # in as a view of it: a Function's inputs are distinct tensors under dynamo.
        leaves = _repeats_as_views(tuple(
            leaf.view_as(leaf)
            if isinstance(leaf, Tensor) and k not in state.dirty_outputs
            and any(leaf is v for v in flat) else leaf
            for k, leaf in enumerate(leaves)
        ))
        # An output that shows an input (the input itself, its detached copy, or a view of
        # either) is returned as a view, so an in-place op on the result is refused as on any
        # view, instead of changing the caller's tensor behind autograd's back.
        shown = (*flat, *seen)
        state.input_views = tuple(
            k for k, leaf in enumerate(leaves)
            if isinstance(leaf, Tensor)
            and (
                shows_input(leaf, shown)
                or any(
                    isinstance(other, Tensor) and related(leaf, other)
                    for j, other in enumerate(leaves) if j != k
                )
            )
        )
        if FAST_APPLY and not is_dynamo_compiling() and not transforms_active():
            state.eager = True
            result = raw(state, *flat, *leaves, *res)
        else:
            result = _apply_general(op, apply, state, *flat, *leaves, *res)
        if state.out_spec is None:
            return result
        return pytree.tree_unflatten(list(result), state.out_spec)

    def run_bound(values: tuple[Any, ...], state: CallState | None) -> Any:
        if is_dynamo_compiling() and transforms_active():
            return _outside_compile(op, run_bound, values, state)
        if state is None:
            state = CallState()
        flat, layout = flatten_inputs(values)
        state.layout = layout
        if _no_gradient(flat):
            return _plain_call(plan, values, False)
        if tracing_state() is not None:
            raise GradOverrideError(jit_message(f"`{op}`", "torch.jit.trace"))
        owned = owned_leaves(layout)
        detached = tuple(
            value.detach() if is_owned and isinstance(value, Tensor) else value
            for value, is_owned in zip(flat, owned, strict=True)
        )
        out = call(detached if layout is None else unflatten_inputs(detached, layout))
        return attach(values, state, out, detached)

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if any_tensorflow(args, kwargs):
            return run_tensorflow(args, kwargs)
        if any_jax(args, kwargs):
            return run_jax(args, kwargs)
        return run_bound(bind(args, kwargs), CallState())

    eager = None
    if fast is not None and plan.runs_forward:

        def eager(values: tuple[Any, ...]) -> Any:
            detached = tuple(
                v.detach() if is_owned and isinstance(v, Tensor) else v
                for v, is_owned in zip(values, owned_params, strict=True)
            )
            out = call(detached)
            if (
                type(out) is Tensor and out._base is None and not AUDITS
                and not any(out is v for v in values) and not any(out is v for v in detached)
            ):
                return fast(None, *values, out)
            return attach(values, CallState(), out, detached)

    given = None
    if plan.rule.owns_all and not plan.runs_forward:
        # A module's rule owning everything, its forward run by the module (under no_grad):
        # the generated twin, given the forward's output.
        twin = _twin(plan, common, {
            "setup": setup, "shape_output": None, "run_general": None, "run_bound": None,
            "run_tensorflow": None, "finish": None,
        })
        if twin is not None and twin.forward_given is not None:
            given_raw = raw_apply(
                _classic_function_class(name, plan.module, op, twin.forward_given, twin.backward)
            )

            def given(values: tuple[Any, ...], out: Any) -> Any:
                return given_raw(None, *values, (out,))

    return Route(run, run_bound, attach, cls, eager=eager, given=given)


# ---- helpers of the forward side ------------------------------------------------------------


def _place_residuals(
    given: dict[str, Any],
    names: tuple[str, ...],
    leaves: tuple[Any, ...],
    seen: tuple[Any, ...],
    state: CallState,
) -> tuple[Tensor, ...]:
    """The residual tensors to return as extra outputs, their places recorded on `state`.

    A residual that is an output leaf or one of the inputs the forward saw (`seen`) is
    recorded as a reference to it instead: returned a second time, it would be a second
    output aliasing the first (marking one non-differentiable marks both)."""
    tensors: list[Tensor] = []
    slots: list[Any] = []
    for name in names:
        value = given[name]
        if not isinstance(value, Tensor):
            slots.append(_Static(value))
            continue
        ref = _reference(value, leaves, seen)
        if ref is not None:
            slots.append(ref)
            continue
        slots.append(len(tensors))
        tensors.append(value)
    state.residuals = tuple(slots)
    return tuple(tensors)


def _reference(value: Tensor, leaves: tuple[Any, ...], seen: tuple[Any, ...]) -> Any:
    for k, leaf in enumerate(leaves):
        if leaf is value:
            return _OutputRef(k)
    for i, item in enumerate(seen):
        if item is value:
            return _InputRef(i)
    return None


def _flatten_output(out: Any, state: CallState, op: str) -> tuple[Any, ...]:
    leaves, spec = pytree.tree_flatten(out)
    if any_tensorflow(leaves):
        # The call came here because no argument was a TensorFlow tensor where gradoverride
        # looks (Python numbers, a forward reading variables only, a torch tensor first):
        # torch ran the forward, so the rule could never run.
        msg = (
            f"`{op}` returned a TensorFlow tensor from a call gradoverride ran as a torch "
            "call (no TensorFlow tensor among its arguments, or a torch tensor first); pass "
            "the values as TensorFlow tensors (`tf.constant(3.0)`, not `3.0` or a torch "
            "tensor) so that the TensorFlow backend runs the call and the rule applies."
        )
        raise GradOverrideTypeError(msg)
    if not any(isinstance(leaf, Tensor) for leaf in leaves):
        shown = type(out).__name__
        msg = (
            f"the forward of `{op}` returned {shown} {_short_repr(out)}, which holds no "
            "tensor, so there is nothing for a gradient to flow through; return a tensor, a "
            "tuple of tensors, or a container (tuple, list, dict) of tensors."
        )
        raise GradOverrideError(msg)
    state.out_spec = spec
    state.n_out = len(leaves)
    state.n_top = len(out) if type(out) is tuple else 1
    return tuple(leaves)


def _repeats_as_views(leaves: tuple[Any, ...]) -> tuple[Any, ...]:
    """`leaves` with a tensor met again (`return y, y`) as a view of it: a Function's outputs
    are distinct tensors (dynamo cannot trace one returned twice); an in-place op on either
    stays an error, as on any two outputs sharing memory."""
    if sum(1 for leaf in leaves if isinstance(leaf, Tensor)) < 2:
        return leaves
    out: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, Tensor) and any(leaf is earlier for earlier in out):
            leaf = leaf.view_as(leaf)
        out.append(leaf)
    return tuple(out)


def _short_repr(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _attached(value: Any, k: int, state: CallState) -> Any:
    """The attach form's output `k`: the forward's result passed through, as a new tensor
    sharing its memory (an in-place op may follow: nothing else sees the forward's own
    intermediates), as a view when it shows an input or another output (changing it stays
    an error), or as itself when it is an input the forward changed in place (marked
    dirty: it takes the rule's history)."""
    if not isinstance(value, Tensor) or k in state.dirty_outputs:
        return value
    return value.view_as(value) if k in state.input_views else value.detach()


def _versions(flat: tuple[Any, ...]) -> tuple[int | None, ...]:
    return tuple(v._version if isinstance(v, Tensor) else None for v in flat)


def _changed(flat: tuple[Any, ...], versions: tuple[int | None, ...]) -> tuple[int, ...]:
    """The flat inputs whose version counter moved: changed in place."""
    return tuple(
        i
        for i, (v, version) in enumerate(zip(flat, versions, strict=True))
        if version is not None and v._version != version
    )


def _returned(flat: tuple[Any, ...], out: Any) -> tuple[int, ...]:
    """The flat inputs that are, as-is, among the forward's results."""
    leaves = pytree.tree_leaves(out)
    return tuple(
        i for i, v in enumerate(flat)
        if isinstance(v, Tensor) and any(leaf is v for leaf in leaves)
    )


def _autocast_state(inputs: Sequence[Any]) -> tuple[str, Any, bool] | None:
    """(device_type, dtype, enabled) of autocast for the first tensor input's device."""
    for value in inputs:
        if isinstance(value, Tensor):
            device_type = value.device.type
            if torch.is_autocast_enabled(device_type):
                return (device_type, torch.get_autocast_dtype(device_type), True)
            return (device_type, None, False)
    return None


# ---- helpers of the backward side -----------------------------------------------------------


def _fill_none(
    grads: list[Tensor | None], meta: Sequence[Any], unowned: tuple[Any, ...]
) -> list[Tensor | None]:
    """Zeros instead of None for inputs that need a gradient, under compiled autograd only.

    Compiled autograd adds the gradients an input receives from several nodes without
    skipping a None (eager autograd skips it), and fails with "add(): argument 'input' must
    be Tensor, not NoneType"; an explicit zero is the same gradient there. Elsewhere None
    stays None (eagerly and in a plain compiled backward): a parameter the rule gives no
    gradient keeps `.grad` None, which an optimizer treats otherwise than zeros (weight
    decay). `meta` holds the owned inputs' metadata (a tuple where the gradient is needed),
    `unowned` the others'."""
    if not torch.compiler.is_compiling() or not in_compiled_autograd():
        return grads
    out = list(grads)
    needed = [(i, *m) for i, m in enumerate(meta) if type(m) is tuple]
    for i, shape, dtype, device in (*needed, *unowned):
        if out[i] is None:
            out[i] = torch.zeros(shape, dtype=dtype, device=device)
    return out


def _refuse_residual_gradients(
    op: str, names: tuple[str, ...], state: CallState, grads: tuple[Any, ...]
) -> None:
    """A second differentiation reached a residual: refuse rather than treat it as constant."""
    name_of = {entry: name for name, entry in zip(names, state.residuals, strict=True)
               if type(entry) is int}
    reached = [name_of[k] for k, g in enumerate(grads) if g is not None and k in name_of]
    if not reached:
        return
    listed = ", ".join(f"`{n}`" for n in reached)
    msg = (
        f"a second differentiation of `{op}` reached its residual {listed}: a residual is "
        "computed in forward, and how it depends on the inputs is not recorded, so the "
        "second derivative would silently leave that dependence out. Compute it inside the "
        "rule from the inputs the rule names (in torch ops, so it is differentiated too), "
        "or register the rule with once_differentiable=True if it is first-order only."
    )
    raise GradOverrideError(msg)


def call_rule(
    rule: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    autocast: tuple[str, Any, bool] | None,
    once: bool,
    note: str,
) -> Any:
    """Call a rule under the forward's autocast state (as `torch.amp.custom_bwd` does), without
    recording a graph when it is once-differentiable; a failure gets `note` and propagates."""
    # Plain `with` statements, not an ExitStack: dynamo traces these, not ExitStack.
    try:
        if autocast is None:
            if once:
                with torch.no_grad():
                    return rule(*args, **kwargs)
            return rule(*args, **kwargs)
        device_type, dtype, enabled = autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            if once:
                with torch.no_grad():
                    return rule(*args, **kwargs)
            return rule(*args, **kwargs)
    except GradOverrideError:
        raise
    except Exception as exc:
        exc.add_note(note)
        raise


#: The Python threads whose backward pass runs through a module op's rule now, registered
#: by `in_backward` while more than one thread runs (until the pass ends), each with its
#: registration's number.
_IN_BACKWARD: dict[int, int] = {}
#: The number of the latest such registration (see `_single_thread`): one that begins and
#: ends while a rule runs leaves no entry, but a new number.
_REGISTERED = [0]
_REGISTRATIONS = itertools.count(1)


def in_backward() -> int:
    """Note that this thread's backward pass runs through a module op's rule (see
    `_single_thread`; a no-op while this process runs one Python thread), and return what
    `_single_thread` compares after the rule: the latest registration's number while no
    other thread's pass runs through one, else -1."""
    if threading.active_count() != 1:
        ident = threading.get_ident()
        if ident not in _IN_BACKWARD:
            number = next(_REGISTRATIONS)
            _IN_BACKWARD[ident] = number
            # (the number seen after the entry is made: a rule that began without seeing
            # the entry sees the new number at its end)
            _REGISTERED[0] = number
            torch.autograd.Variable._execution_engine.queue_callback(
                _PassEnded(ident, number))
    return _REGISTERED[0] if len(_IN_BACKWARD) <= 1 else -1


class _PassEnded:
    """Forgets a thread's entry in `_IN_BACKWARD` when its backward pass ends, its gradients
    accumulated; or, if the pass fails (autograd then drops its callbacks without calling
    them), when autograd frees it. Only its own registration's: the thread may hold a later
    one by then (an accelerator's autograd thread runs several callers' passes)."""

    __slots__ = ("ident", "number")

    def __init__(self, ident: int, number: int) -> None:
        self.ident = ident
        self.number = number

    def __call__(self) -> None:
        if _IN_BACKWARD.get(self.ident) == self.number:
            _IN_BACKWARD.pop(self.ident, None)

    def __del__(self) -> None:
        self()


def _single_thread(mark: int) -> bool:
    """Whether no other thread's backward pass ran through a module op's rule while this
    thread's rule ran, since `in_backward` returned `mark`: then a parameter's `.grad` that
    changed meanwhile was written by the rule (another thread training the same module
    may have accumulated into it, even in a pass that began and ended meanwhile; threads
    doing anything else do not count). The first-call check sees a rule's writes exactly."""
    return mark == _REGISTERED[0] and len(_IN_BACKWARD) <= 1


def compiled_transform_message(op: str) -> str:
    return (
        f"`{op}` is called inside a torch.func transform (grad, vmap, jacrev, ...) that "
        "torch.compile traces: torch.compile cannot keep a custom backward there (a "
        "PyTorch limitation a hand-written autograd.Function shares: its gradient would "
        "silently be the forward's own derivative), so the call runs eagerly. Compile the "
        "model and take gradients with `loss.backward()` or `torch.autograd.grad` (the "
        "rule is kept), or run the torch.func transform outside torch.compile."
    )


def _outside_compile(op: str, entry: Callable[..., Any], *args: Any) -> Any:
    """`entry(*args)` after a graph break whose message (what `fullgraph=True`'s error shows)
    says why: dynamo would trace the call wrongly, so it runs eagerly. (Only called while
    dynamo traces, which has imported it.)"""
    break_compiled_transform(op)
    return entry(*args)


def break_compiled_transform(what: str) -> None:
    """A graph break: `what` is called inside a torch.func transform dynamo traces, where
    dynamo would drop its custom backward or hook (it does not see the transform's
    gradient tracking: `requires_grad` reads False), so what follows runs eagerly."""
    import torch._dynamo

    torch._dynamo.graph_break(msg=compiled_transform_message(what))


def wrote_grad_message(op: str, name: str) -> str:
    return (
        f"the backward of `{op}` wrote `{name}.grad` itself; return the "
        f"gradient instead, e.g. `return {{..., '{name}': grad_{name.replace('.', '_')}}}`, "
        "and autograd accumulates it (hooks and DDP see it too)."
    )


def _function_class(
    name: str,
    module: str,
    op: str,
    forward: Callable[..., Any],
    setup_context: Callable[..., None],
    backward: Callable[..., Any],
) -> type[torch.autograd.Function]:
    namespace: dict[str, Any] = {
        "generate_vmap_rule": True,
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "__module__": module,
        "__qualname__": name,
        "__doc__": f"The autograd.Function gradoverride generated for `{op}`.",
    }
    # (No `jvp` here: dynamo refuses to trace a Function that defines one; see
    # `_apply_general`.)
    return type(name, (torch.autograd.Function,), namespace)


def _apply_general(op: str, apply: Callable[..., Any], *args: Any) -> Any:
    """`apply(*args)` of an op's general Function, forward-mode differentiation refused
    naming the op (PyTorch's own error names neither it nor the fix)."""
    if is_dynamo_compiling() or not transforms_active():
        return apply(*args)
    try:
        return apply(*args)
    except NotImplementedError as exc:
        if "jvp" in str(exc):
            raise GradOverrideError(_forward_mode_message(op)) from exc
        raise


def _forward_mode_message(op: str) -> str:
    return (
        f"`{op}` has a backward (reverse-mode) rule only, which forward-mode differentiation "
        "(torch.func.jvp, jacfwd, hessian, torch.autograd.forward_ad) cannot use. Use "
        "reverse mode: torch.func.jacrev, torch.func.vjp, or jacrev(jacrev(f)) for a "
        "Hessian."
    )


def _no_forward_mode(op: str) -> Callable[..., Any]:
    """The eager Function's `jvp`: forward-mode differentiation, refused naming the op."""

    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise GradOverrideError(_forward_mode_message(op))

    return jvp


def _classic_function_class(
    name: str,
    module: str,
    op: str,
    forward: Callable[..., Any],
    backward: Callable[..., Any],
) -> type[torch.autograd.Function]:
    """The eager-only twin of an op's Function, in the classic `forward(ctx, ...)` form.

    Same name and backward; used only through `raw_apply` in eager mode with no transform,
    where nothing needs the `setup_context` form.
    """
    namespace: dict[str, Any] = {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
        "jvp": staticmethod(_no_forward_mode(op)),
        "__module__": module,
        "__qualname__": name,
        "__doc__": f"The autograd.Function gradoverride generated for `{op}` (eager form).",
    }
    return type(name, (torch.autograd.Function,), namespace)


def _guard(
    op: str,
    flat_grads: list[Tensor | None],
    upstream: tuple[Any, ...],
    saved: tuple[Any, ...],
) -> list[Tensor | None]:
    deps = [
        t
        for t in (*pytree.tree_leaves(upstream), *saved)
        if isinstance(t, Tensor) and t.requires_grad
    ]
    if not deps:
        return flat_grads
    guard: Callable[..., Tensor] = _OnceDifferentiableGuard.apply
    return [g if g is None else guard(op, g, *deps) for g in flat_grads]


class _OnceDifferentiableGuard(torch.autograd.Function):
    """Passes a gradient through; differentiating it raises instead of returning zeros.

    Its inputs include the upstream gradients and the saved tensors, so its output requires
    grad exactly when a second differentiation could reach the rule, in eager mode and under
    `torch.func` alike (torch's own `@once_differentiable` returns zeros under
    `torch.func.grad(torch.func.grad(...))`).
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(op: str, grad: Tensor, *deps: Tensor) -> Tensor:
        return grad.view_as(grad)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.op = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        msg = (
            f"backward of `{ctx.op}` runs without recording a graph (once_differentiable=True; "
            "a go.bridge always is) and cannot be differentiated again; for higher-order "
            "gradients, write the rule in differentiable ops without once_differentiable."
        )
        raise GradOverrideError(msg)
