"""Building the `torch.autograd.Function` for a forward and its rule, once per registration.

Two shapes, chosen by what the rule owns:

* the rule owns every input (the default): the forward runs inside `Function.forward`, where
  autograd records nothing, and the rule supplies every gradient;
* the rule owns some inputs: the forward runs outside, on the ordinary graph, with the owned
  inputs detached, so the others get their ordinary autograd gradient; an "attach" Function
  then passes the outputs through unchanged and adds the rule's gradients for the owned
  inputs. Nothing is recomputed in backward, which keeps this form traceable by
  `torch.compile` and usable under `torch.func`.

Both are written in the `forward` + `setup_context` form with `generate_vmap_rule = True`, as
`torch.func` requires, and are named after the user's function (`CustomBackward_quantize`), so
`grad_fn` reprs, tracebacks and profiles say where they come from.

Each call passes a `CallState` as the first, non-tensor argument: how the inputs were
flattened and, written by the forward, how to rebuild the outputs. It holds no tensors.

The common call (plain tensor and non-tensor arguments, one tensor output, no residuals) has
a fast path in `setup_context` and `backward`; the performance contract (at most 1.05x a
hand-written classic Function on small tensors) is measured by `benchmarks/overhead.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.compiler import is_dynamo_compiling
from torch.utils import _pytree as pytree

from ._errors import GradOverrideError, GradOverrideTypeError
from ._fastpath import generate
from ._frameworks import any_tensorflow
from ._gradients import SKIP, check_gradient, flat_gradients, slot_ranges, takes_gradient
from ._internals import (
    FAST_APPLY,
    any_autocast_enabled,
    raw_apply,
    transforms_active,
)
from ._passthrough import as_output, related, shows_input
from ._rule import RuleSpec
from ._signature import ForwardSignature

__all__ = [
    "CallState",
    "build_call",
    "check_output_count",
    "flatten_inputs",
    "unflatten_inputs",
    "unpack_residuals",
]

_CONTAINERS = (tuple, list, dict)


class CallState:
    """Per-call, tensor-free bookkeeping shared by the wrapper, forward and backward.

    Class attributes are the defaults, so the common call allocates an empty object.
    """

    layout: Any = None  # None, or per parameter: None | (treespec, n_leaves)
    out_spec: Any = None  # None: the output is one tensor; else how to rebuild it
    n_out = 1  # flat output leaves
    n_top = 1  # outputs as the rule counts them (elements of a plain tuple)
    # per declared residual: index into the residual tensors | _Static | _OutputRef | _InputRef
    residuals: tuple[Any, ...] = ()
    n_in = 0  # flat inputs (set by the attach form)
    dirty: tuple[int, ...] = ()  # flat inputs the forward changed in place (tracked ops only)
    input_views: tuple[int, ...] = ()  # outputs showing an input (the attach form)

    def __repr__(self) -> str:
        # The same text for every call: torch.jit.trace compares the graphs of two calls,
        # and prints this object (a constant argument of the recorded op) in them.
        return "CallState()"


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


def unflatten_inputs(flat: tuple[Any, ...], layout: Any) -> tuple[Any, ...]:
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


def _leaf_ranges(layout: Any, n_params: int) -> list[tuple[int, int]]:
    """Per parameter, the range of flat inputs holding it."""
    return [(start, stop) for start, stop, _ in slot_ranges(layout, n_params)]


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


def _short_repr(value: object) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def check_output_count(n_grads: int | None, n_top: int, rule_name: str, op: str) -> None:
    """A rule takes one upstream gradient per output (any number with `*grads`)."""
    if n_grads is not None and n_grads != n_top:
        msg = (
            f"backward rule `{rule_name}` of `{op}` takes {n_grads} upstream "
            f"gradient(s), but `{op}` returned {n_top} output(s); give the rule "
            "one positional parameter per output (or `*grads`)."
        )
        raise GradOverrideTypeError(msg)


def _identifier(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.split(".")[-1]) or "op"


# What the general `setup` leaves on `ctx.gradoverride` for backward, as a tuple (built on
# every call, so no class): (state, meta, plan, out_meta, autocast), where
#   meta     per flat input: None (not a tensor) | SKIP | (shape, dtype, device);
#   plan     per named value: (name, None | treespec, entries), an entry being an index
#            into saved_tensors or a _Static;
#   out_meta output metadata, when we materialize zero gradients ourselves, else None;
#   autocast (device_type, dtype, enabled) the forward ran under, else None.
# The generated fast path leaves a 3-tuple instead (see _fastpath). Tensors go through
# save_for_backward, never here.


def build_call(
    op: str,
    module: str,
    sig: ForwardSignature,
    rule: RuleSpec,
    residuals: tuple[str, ...],
    run_tensorflow: Callable[[tuple[Any, ...], dict[str, Any]], Any],
    *,
    track_inplace: bool = False,
    labels: Mapping[str, str] | None = None,
) -> tuple[Callable[..., Any], type[torch.autograd.Function]]:
    """The per-call entry point and the Function class behind it.

    `labels` name the op's parameters in messages where they differ from the forward's own
    names (a module's op has slots for its parameters; an empty label hides a slot).

    The entry point is `run(op_object, *args, **kwargs)`: it becomes the `__call__` method of
    the op's class (`op_object` is the op itself and is not used). A call with TensorFlow
    tensors goes to `run_tensorflow(args, kwargs)` instead.
    """
    names = sig.names
    n_params = len(names)
    owned = rule.owned
    user_rule = rule.rule
    requested_slots = rule.requested_slots
    wants_output = rule.wants_output
    wants_needs_grad = rule.wants_needs_grad
    materialize = rule.materialize_grads
    once = rule.once_differentiable
    # Plain values only in these closures: dynamo cannot wrap a RuleSpec object met while
    # speculating a Function's forward.
    n_grads = rule.n_grads
    rule_name = rule.name
    requested_residuals = rule.requested_residuals
    note = f"(raised in backward rule `{rule_name}` of `{op}`)"

    # ---- forward-side bookkeeping ---------------------------------------------------------

    def check_outputs(state: CallState) -> None:
        check_output_count(n_grads, state.n_top, rule_name, op)

    def setup(
        ctx: Any,
        state: CallState,
        flat: tuple[Any, ...],
        outputs: tuple[Any, ...],
        residual_tensors: tuple[Any, ...],
    ) -> None:
        check_outputs(state)
        needs = ctx.needs_input_grad  # [0] is the CallState
        ranges = _leaf_ranges(state.layout, n_params)
        meta: list[Any] = []
        # Inputs that need a gradient the rule does not give (not owned): their metadata, for
        # the zeros a compiled backward returns instead of None (see `_fill_none`). Owned
        # ones have theirs in `meta`.
        unowned: list[tuple[int, Any, Any, Any]] = []
        for slot, (start, stop) in enumerate(ranges):
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
        plan: list[tuple[str, Any, tuple[Any, ...]]] = []

        def keep(name: str, spec: Any, leaves: tuple[Any, ...]) -> None:
            entries: list[Any] = []
            for leaf in leaves:
                if isinstance(leaf, Tensor):
                    entries.append(len(to_save))
                    to_save.append(leaf)
                else:
                    entries.append(_Static(leaf))
            plan.append((name, spec, tuple(entries)))

        layout = state.layout
        for name, slot in requested_slots:
            start, stop = ranges[slot]
            spec = None if layout is None or layout[slot] is None else layout[slot][0]
            keep(name, spec, flat[start:stop])
        if wants_output:
            keep("output", state.out_spec, outputs)
        for name, index in requested_residuals:
            entry = state.residuals[index]
            if isinstance(entry, _Static):
                plan.append((name, None, (entry,)))
            elif isinstance(entry, _OutputRef):
                keep(name, None, (outputs[entry.index],))
            elif isinstance(entry, _InputRef):
                keep(name, None, (flat[entry.index],))
            else:
                keep(name, None, (residual_tensors[entry],))
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
        ctx.gradoverride = (state, meta, plan, out_meta, autocast, tuple(unowned))

    # ---- backward -------------------------------------------------------------------------

    def needs_grad_map(needs: tuple[bool, ...], state: CallState) -> dict[str, bool]:
        ranges = _leaf_ranges(state.layout, n_params)
        return {
            name: owned[slot] and any(needs[start + 1 : stop + 1])
            for slot, (name, (start, stop)) in enumerate(zip(names, ranges, strict=True))
        }

    def run_rule(ctx: Any, grads: tuple[Any, ...]) -> list[Tensor | None]:
        """Call the rule; one checked gradient per flat input."""
        state, meta, plan, out_meta, autocast, _ = ctx.gradoverride
        kwargs: dict[str, Any] = {}
        saved_tensors: tuple[Tensor, ...] = ()
        if plan:
            saved_tensors = saved_for(ctx, op, tuple(name for name, _, _ in plan), labels)
            for name, spec, entries in plan:
                leaves = [saved_tensors[e] if type(e) is int else e.value for e in entries]
                kwargs[name] = leaves[0] if spec is None else pytree.tree_unflatten(leaves, spec)
        if wants_needs_grad:
            kwargs["needs_grad"] = needs_grad_map(ctx.needs_input_grad, state)

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

        result = _call_rule(user_rule, rule_grads, kwargs, autocast, once, note)
        flat_grads = flat_gradients(
            result, op=op, names=names, owned=owned, layout=state.layout, meta=meta
        )
        if once and torch.is_grad_enabled():
            flat_grads = _guard(op, flat_grads, rule_grads, saved_tensors)
        return flat_grads

    kind = "CustomBackward"
    if rule.owns_all:
        return _build_owning(
            op, module, kind, sig, rule, residuals, setup, run_rule, run_tensorflow,
            track_inplace, labels,
        )
    return _build_attaching(
        op, module, kind, sig, residuals, owned, setup, run_rule, run_tensorflow
    )


def _build_owning(
    op: str,
    module: str,
    kind: str,
    sig: ForwardSignature,
    rule: RuleSpec,
    residuals: tuple[str, ...],
    setup: Callable[..., None],
    run_rule: Callable[[Any, tuple[Any, ...]], list[Tensor | None]],
    run_tensorflow: Callable[[tuple[Any, ...], dict[str, Any]], Any],
    track_inplace: bool,
    labels: Mapping[str, str] | None,
) -> tuple[Callable[..., Any], type[torch.autograd.Function]]:
    """The forward runs inside the Function; the rule gives every gradient.

    With `track_inplace`, the forward's changes to its inputs are detected (version
    counters) and marked dirty, as PyTorch requires of a Function that changes an input."""
    fn = sig.fn
    call = sig.call
    bind = sig.bind
    plain = sig.is_plain
    names = sig.names
    n_params = len(names)
    # The fast path covers the common call: one value per parameter, one tensor output, no
    # residuals, a rule of one upstream gradient without once_differentiable or needs_grad.
    # Everything else takes the general path (`setup` / `run_rule`), which is the reference.
    fast = (
        n_params > 0
        and not track_inplace
        and not residuals
        and rule.n_grads in (None, 1)
        and not rule.once_differentiable
        and not rule.wants_needs_grad
    )

    def shape_output(out: Any, state: CallState, flat: tuple[Any, ...] = ()) -> Any:
        """The Function's output for what the forward returned: a tensor, or flat leaves
        (the residual tensors after them). `flat` are the inputs the forward saw."""
        dirty = state.dirty
        if residuals:
            out, given = unpack_residuals(out, residuals, op)
            leaves = _flatten_output(out, state, op)
            res = _place_residuals(given, residuals, leaves, flat, state)
            return (*(as_output(leaf, flat, dirty, leaves) for leaf in leaves), *res)
        if isinstance(out, Tensor):
            return as_output(out, flat, dirty)
        leaves = _flatten_output(out, state, op)
        return tuple(as_output(leaf, flat, dirty, leaves) for leaf in leaves)

    def forward(state: CallState, *flat: Any) -> Any:
        # Version counters are not traceable (dynamo would guard on their values): while
        # compiling, an input returned as-is by an op that changes its inputs in place is
        # taken as changed.
        versions = _versions(flat) if track_inplace and not is_dynamo_compiling() else None
        if state.layout is None:
            out = fn(*flat) if plain else call(flat)
        else:
            out = call(unflatten_inputs(flat, state.layout))
        if versions is not None:
            state.dirty = _changed(flat, versions)
        elif track_inplace:
            state.dirty = _returned(flat, out)
        return shape_output(out, state, flat)

    def setup_general(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        state = inputs[0]
        if state.out_spec is None:
            setup(ctx, state, inputs[1:], (output,), ())
        else:
            n_out = state.n_out
            setup(ctx, state, inputs[1:], output[:n_out], output[n_out:])

    def backward_general(ctx: Any, grads: tuple[Any, ...]) -> Any:
        state = ctx.gradoverride[0]
        if residuals and not torch.compiler.is_compiling():
            _refuse_residual_gradients(op, residuals, state, grads[state.n_out :])
        record = ctx.gradoverride
        return (None, *_fill_none(run_rule(ctx, grads), record[1], record[5]))

    def finish(out: Any, state: CallState) -> Any:
        return pytree.tree_unflatten(list(out[: state.n_out]), state.out_spec)

    # Set once the Function class exists (it needs setup_context and backward first).
    raw: Callable[..., Any]
    apply: Callable[..., Any]

    def run_general(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if any_tensorflow(args, kwargs):
            return run_tensorflow(args, kwargs)
        values = bind(args, kwargs)
        state = CallState()
        for value in values:
            if isinstance(value, _CONTAINERS):
                values, state.layout = flatten_inputs(values)
                break
        if FAST_APPLY and not is_dynamo_compiling() and not transforms_active():
            # Eager, no torch.func transform: skip Function.apply's per-call signature
            # binding (see _internals). Dynamo folds `is_dynamo_compiling` to True and so
            # traces `cls.apply`, which it understands, and none of the private calls.
            out = raw(state, *values)
        else:
            out = apply(state, *values)
        if state.out_spec is None:
            return out
        return finish(out, state)

    if fast:
        generated = generate(
            op=op,
            names=names,
            requested=rule.requested_slots,
            wants_output=rule.wants_output,
            materialize=rule.materialize_grads,
            plain=plain,
            namespace={
                "Tensor": Tensor,
                "CallState": CallState,
                "CONTAINERS": _CONTAINERS,
                "forward_general": forward,
                "shape_output": shape_output,
                "as_output": as_output,
                "fn": fn,
                "call": call,
                "setup_general": setup_general,
                "backward_general": backward_general,
                "run_general": run_general,
                "finish": finish,
                "any_autocast_enabled": any_autocast_enabled,
                "any_tensorflow": any_tensorflow,
                "run_tensorflow": run_tensorflow,
                "autocast_state": _autocast_state,
                "call_rule": _call_rule,
                "saved_for": saved_for,
                "labels": labels,
                "check_gradient": check_gradient,
                "flat_gradients": flat_gradients,
                "GradOverrideError": GradOverrideError,
                "rule": rule.rule,
                "rule_name": rule.name,
                "names": names,
                "owned": rule.owned,
                "op": op,
                "is_dynamo_compiling": is_dynamo_compiling,
                "transforms_active": transforms_active,
                "FAST_APPLY": FAST_APPLY,
            },
        )
        setup_context = generated["setup_context"]
        backward = generated["backward"]
        fast_forward = generated["forward"]
    else:

        def backward(ctx: Any, *grads: Any) -> Any:
            return backward_general(ctx, grads)

        setup_context = setup_general
        fast_forward = forward

    cls = _function_class(op, module, kind, fast_forward, setup_context, backward)
    # For another eager twin of this Function (a module op's, see `_module_fastpath`): the
    # general steps, which it takes for what its own fast path does not cover.
    cls._gradoverride_general = (  # type: ignore[attr-defined]
        shape_output, setup_general, backward_general, finish
    )
    apply = cls.apply
    raw = raw_apply(cls)
    if fast and generated["forward_eager"] is not None:
        eager_cls = _classic_function_class(
            op, module, kind, generated["forward_eager"], backward
        )
        run = generated["make_run"](raw_apply(eager_cls), apply)
    elif fast:
        run = generated["make_run"](raw, apply)
    else:

        def run(op_object: Any, *args: Any, **kwargs: Any) -> Any:
            return run_general(args, kwargs)

    return run, cls


def _build_attaching(
    op: str,
    module: str,
    kind: str,
    sig: ForwardSignature,
    residuals: tuple[str, ...],
    owned_params: tuple[bool, ...],
    setup: Callable[..., None],
    run_rule: Callable[[Any, tuple[Any, ...]], list[Tensor | None]],
    run_tensorflow: Callable[[tuple[Any, ...], dict[str, Any]], Any],
) -> tuple[Callable[..., Any], type[torch.autograd.Function]]:
    """The forward runs on the ordinary graph; the Function attaches the owned gradients."""
    call = sig.call
    bind = sig.bind

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
        setup(ctx, state, inputs[1 : 1 + n_in], outs, inputs[1 + n_in + state.n_out :])

    def backward(ctx: Any, *grads: Any) -> Any:
        state = ctx.gradoverride[0]
        n_res = sum(1 for r in state.residuals if type(r) is int)
        # The outputs' upstream gradients continue, unchanged, into the ordinary graph of
        # the inputs the rule does not own.
        record = ctx.gradoverride
        rule_grads = _fill_none(run_rule(ctx, grads), record[1], record[5])
        return (None, *rule_grads, *grads[: state.n_out], *([None] * n_res))

    cls = _function_class(op, module, kind, forward, setup_context, backward)
    # Its backward also returns the outputs' gradients, passed on into the ordinary graph:
    # what `go.monitor` leaves out of the gradients the rule returned.
    cls._gradoverride_attaches = True  # type: ignore[attr-defined]
    apply: Callable[..., Any] = cls.apply
    raw = raw_apply(cls)

    def run(op_object: Any, *args: Any, **kwargs: Any) -> Any:
        if any_tensorflow(args, kwargs):
            return run_tensorflow(args, kwargs)
        state = CallState()
        flat, layout = flatten_inputs(bind(args, kwargs))
        state.layout = layout
        state.n_in = len(flat)
        owned = owned_params
        if layout is not None:
            owned = tuple(
                o for o, entry in zip(owned_params, layout, strict=True)
                for _ in range(1 if entry is None else entry[1])
            )
        detached = tuple(
            value.detach() if is_owned and isinstance(value, Tensor) else value
            for value, is_owned in zip(flat, owned, strict=True)
        )
        out = call(detached if layout is None else unflatten_inputs(detached, layout))
        res: tuple[Tensor, ...] = ()
        given = None
        if residuals:
            out, given = unpack_residuals(out, residuals, op)
        if given is None and isinstance(out, Tensor):
            leaves: tuple[Any, ...] = (out,)
        else:
            leaves = _flatten_output(out, state, op)
        if given is not None:
            res = _place_residuals(given, residuals, leaves, detached, state)
        # An output that shows an input (the input itself, its detached copy, or a view of
        # either) is returned as a view, so an in-place op on the result is refused as on any
        # view, instead of changing the caller's tensor behind autograd's back.
        seen = (*flat, *detached)
        state.input_views = tuple(
            k for k, leaf in enumerate(leaves)
            if isinstance(leaf, Tensor)
            and (
                shows_input(leaf, seen)
                or any(
                    isinstance(other, Tensor) and related(leaf, other)
                    for j, other in enumerate(leaves) if j != k
                )
            )
        )
        if FAST_APPLY and not is_dynamo_compiling() and not transforms_active():
            result = raw(state, *flat, *leaves, *res)
        else:
            result = apply(state, *flat, *leaves, *res)
        if state.out_spec is None:
            return result
        return pytree.tree_unflatten(list(result), state.out_spec)

    return run, cls


def saved_for(
    ctx: Any, op: str, names: tuple[str, ...], labels: Mapping[str, str] | None = None
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


def _attached(value: Any, k: int, state: CallState) -> Any:
    """The attach form's output `k`: the forward's result passed through, as a new tensor
    sharing its memory (an in-place op may follow: nothing else sees the forward's own
    intermediates), or as a view when it shows an input or another output (changing it
    stays an error)."""
    if not isinstance(value, Tensor):
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


def _fill_none(
    grads: list[Tensor | None], meta: list[Any], unowned: tuple[Any, ...]
) -> list[Tensor | None]:
    """Zeros instead of None for inputs that need a gradient, in a compiled backward only.

    Compiled autograd adds the gradients an input receives from several nodes without
    skipping a None (eager autograd skips it), and fails with "add(): argument 'input' must
    be Tensor, not NoneType"; an explicit zero is the same gradient. Eager backward keeps
    None, which costs nothing. `meta` holds the owned inputs' metadata (a tuple where the
    gradient is needed), `unowned` the others'."""
    if not torch.compiler.is_compiling():
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




def _autocast_state(inputs: tuple[Any, ...]) -> tuple[str, Any, bool] | None:
    """(device_type, dtype, enabled) of autocast for the first tensor input's device."""
    for value in inputs:
        if isinstance(value, Tensor):
            device_type = value.device.type
            if torch.is_autocast_enabled(device_type):
                return (device_type, torch.get_autocast_dtype(device_type), True)
            return (device_type, None, False)
    return None


def _call_rule(
    rule: Callable[..., Any],
    grads: tuple[Any, ...],
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
                    return rule(*grads, **kwargs)
            return rule(*grads, **kwargs)
        device_type, dtype, enabled = autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            if once:
                with torch.no_grad():
                    return rule(*grads, **kwargs)
            return rule(*grads, **kwargs)
    except GradOverrideError:
        raise
    except Exception as exc:
        exc.add_note(note)
        raise


def _function_class(
    op: str,
    module: str,
    kind: str,
    forward: Callable[..., Any],
    setup_context: Callable[..., None],
    backward: Callable[..., Any],
) -> type[torch.autograd.Function]:
    name = f"{kind}_{_identifier(op)}"
    namespace: dict[str, Any] = {
        "generate_vmap_rule": True,
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        "__module__": module,
        "__qualname__": name,
        "__doc__": f"The autograd.Function gradoverride generated for `{op}`.",
    }
    return type(name, (torch.autograd.Function,), namespace)


def _classic_function_class(
    op: str,
    module: str,
    kind: str,
    forward: Callable[..., Any],
    backward: Callable[..., Any],
) -> type[torch.autograd.Function]:
    """The eager-only twin of an op's Function, in the classic `forward(ctx, ...)` form.

    Same name and backward; used only through `raw_apply` in eager mode with no transform,
    where nothing needs the `setup_context` form.
    """
    name = f"{kind}_{_identifier(op)}"
    namespace: dict[str, Any] = {
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
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
