"""Generated source for the common call of an op whose rule owns every input.

The performance contract (forward+backward at most 1.05x a hand-written classic
`autograd.Function` on small tensors) leaves a few microseconds for everything gradoverride
does per call. A general loop over parameters, building lists of metadata and saved values,
costs more than that, so for each registered rule we generate `run`, `setup_context` and
`backward` specialised to its parameter count and the names the rule asks for, unrolled, as
attrs does for `__init__`. Each generated function handles only the common call (one value
per parameter, no containers, one tensor output) and hands anything else to the general
functions in `_function.py`, which remain the reference behaviour.

Only identifiers read from signatures and small integers are put into the source, and the
source is registered with `linecache`, so tracebacks through it show real lines.
"""

from __future__ import annotations

import linecache
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["compile_source", "generate"]

# Up to this many parameters the lone-tensor return is matched by written-out conditions;
# beyond it the general `flat_gradients` does it (still correct, a little slower).
_UNROLL = 6

_counter = 0


def _compile(
    source: str, name: str, namespace: dict[str, Any], owner: str = "backward"
) -> Any:
    """Run `source` in `namespace`; its source lines live as long as the function `owner`."""
    global _counter
    _counter += 1
    filename = f"<gradoverride generated {name} #{_counter}>"
    code = compile(source, filename, "exec")
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(code, namespace)
    # The source stays readable for tracebacks while the generated code lives, and no
    # longer: `linecache` never drops an entry without a file on its own, so ops made and
    # dropped in a loop (override/remove cycles) would keep every source forever.
    weakref.finalize(namespace[owner], linecache.cache.pop, filename, None)
    return namespace


compile_source = _compile


def _tuple(items: list[str]) -> str:
    if not items:
        return "()"
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def generate(
    *,
    op: str,
    names: tuple[str, ...],
    requested: tuple[tuple[str, int], ...],
    wants_output: bool,
    materialize: bool,
    plain: bool,
    namespace: dict[str, Any],
) -> dict[str, Callable[..., Any]]:
    """Return `forward`, `setup_context`, `backward`, `forward_eager` (the classic form, for
    plain signatures) and `make_run(raw_eager, apply)`.

    `namespace` provides the helpers the source calls: Tensor, CallState, CONTAINERS,
    forward_general, setup_general, backward_general, run_general, finish, fn, call,
    shape_output, as_output, saved_for, any_autocast_enabled, any_tensorflow, run_tensorflow,
    autocast_state, call_rule, check_gradient, flat_gradients, GradOverrideError,
    rule, rule_name, names, owned, op, is_dynamo_compiling, transforms_active, FAST_APPLY.
    """
    n = len(names)
    values = [f"v{i}" for i in range(n)]
    metas = [f"m{i}" for i in range(n)]

    # The bookkeeping for backward, shared by setup_context and the eager forward: input
    # metadata, the requested values (tensors saved, others kept), the autocast state.
    # An input the rule names is saved anyway, so its metadata is read from the saved tensor
    # in backward; its `m` is then just a flag (True: a tensor, saved) or None.
    saved_slot: dict[int, int] = {}  # requested parameter's index -> its index in saved_tensors
    for k, (_, slot) in enumerate(requested):
        saved_slot.setdefault(slot, k)
    # `m` is None for a value that takes no gradient: not a tensor, or an integer or bool
    # tensor (an index), which a rule never owns.
    def differentiable(i: int) -> str:
        return (
            f"isinstance(v{i}, Tensor) and (v{i}.is_floating_point() or v{i}.is_complex())"
        )

    body = [
        f"m{i} = True if {differentiable(i)} else None"
        if i in saved_slot
        else f"m{i} = (v{i}.shape, v{i}.dtype, v{i}.device) if {differentiable(i)} else None"
        for i in range(n)
    ]
    saved = [f"v{slot} if isinstance(v{slot}, Tensor) else None" for _, slot in requested]
    statics = [f"None if isinstance(v{slot}, Tensor) else v{slot}" for _, slot in requested]
    if wants_output:
        saved.append("output")
    if saved:
        body.append(f"ctx.save_for_backward({', '.join(saved)})")
    if not materialize:
        body.append("ctx.set_materialize_grads(False)")
    body += [
        f"autocast = autocast_state({_tuple(values)}) if any_autocast_enabled() else None",
        f"ctx.gradoverride = ({_tuple(metas)}, {_tuple(statics)}, autocast)",
    ]

    def meta_of(i: int) -> str:
        """Source for parameter i's (shape, dtype, device) in backward (given it is a tensor)."""
        if i in saved_slot:
            k = saved_slot[i]
            return f"(s{k}.shape, s{k}.dtype, s{k}.device)"
        return f"m{i}"

    def full_meta(i: int) -> str:
        """Source for parameter i's meta entry as `flat_gradients` expects it."""
        if i in saved_slot:
            return f"(None if m{i} is None else {meta_of(i)})"
        return f"m{i}"

    # setup_context (torch.func and torch.compile use the setup_context form) ---------------
    lines = [
        "def setup_context(ctx, inputs, output):",
        "    state = inputs[0]",
        "    if state.layout is not None or state.out_spec is not None:",
        "        return setup_general(ctx, inputs, output)",
    ]
    lines += [f"    v{i} = inputs[{i + 1}]" for i in range(n)]
    lines += ["    " + line for line in body]

    # forward_eager: the classic `forward(ctx, ...)` form for eager calls, doing forward and
    # setup in one Python frame instead of two. It shares backward with the other form. Its
    # first input is None (no CallState is allocated for the common call); an output that is
    # not one tensor gets a CallState here, returned as an extra non-tensor output for `run`.
    if plain:
        lines += [
            "",
            f"def forward_eager(ctx, state{''.join(', ' + v for v in values)}):",
            f"    output = fn({', '.join(values)})",
            # An input returned as-is, or a view of an intermediate: see _passthrough.as_output.
            f"    if {' or '.join(f'output is {v}' for v in values)}:",
            "        output = output.view_as(output)",
            "    elif isinstance(output, Tensor):",
            "        if output._base is not None:",
            f"            output = as_output(output, {_tuple(values)})",
            "    else:",
            "        state = CallState()",
            f"        output = shape_output(output, state, {_tuple(values)})",
            f"        setup_general(ctx, (state{''.join(', ' + v for v in values)}), output)",
            "        return (*output, state)",
        ]
        lines += ["    " + line for line in body]
        lines.append("    return output")

    # backward -----------------------------------------------------------------------------
    kwargs: list[tuple[str, str]] = []  # (rule keyword, local holding its value)
    # A fast record means one tensor output, so one upstream gradient, `g0`; a general record
    # (a container output, say) may come with more, in `rest`.
    lines += [
        "",
        "def backward(ctx, g0, *rest):",
        "    record = ctx.gradoverride",
        "    if len(record) != 3:  # recorded by the general setup",
        "        return backward_general(ctx, (g0, *rest))",
        f"    {_tuple(metas)}, statics, autocast = record",
    ]
    if saved:
        read = [name for name, _ in requested] + (["output"] if wants_output else [])
        # A try block costs nothing until it catches (Python 3.11); `saved_for` then says
        # which value was changed in place, in the op's terms.
        lines += [
            "    try:",
            f"        {_tuple([f's{k}' for k in range(len(saved))])} = ctx.saved_tensors",
            "    except RuntimeError:",
            f"        saved_for(ctx, op, {tuple(read)!r}, labels)",
            "        raise",
        ]
    for k, (name, _) in enumerate(requested):
        lines.append(f"    k{k} = s{k} if s{k} is not None else statics[{k}]")
        kwargs.append((name, f"k{k}"))
    if wants_output:
        kwargs.append(("output", f"s{len(saved) - 1}"))
    call_kwargs = "".join(f", {name}={local}" for name, local in kwargs)
    kwargs_dict = "{" + ", ".join(f"{name!r}: {local}" for name, local in kwargs) + "}"
    lines += [
        "    if autocast is None:",
        "        try:",
        f"            result = rule(g0{call_kwargs})",
        "        except GradOverrideError:",
        "            raise",
        "        except Exception as exc:",
        "            exc.add_note(NOTE)",
        "            raise",
        "    else:",
        f"        result = call_rule(rule, (g0,), {kwargs_dict}, autocast, False, NOTE)",
    ]
    # The one tensor input a lone returned tensor belongs to: written out for few
    # parameters, a loop for many.
    if n <= _UNROLL:
        lines.append("    if isinstance(result, Tensor):")
        for i in range(n):
            others = " and ".join(f"m{j} is None" for j in range(n) if j != i)
            out = ["None"] * (n + 1)
            out[i + 1] = "result"
            if i in saved_slot:
                x = f"s{saved_slot[i]}"
                mismatch = (
                    f"result.shape != {x}.shape or result.dtype != {x}.dtype "
                    f"or result.device != {x}.device"
                )
            else:
                mismatch = (
                    f"result.shape != m{i}[0] or result.dtype != m{i}[1] "
                    f"or result.device != m{i}[2]"
                )
            lines += [
                f"        if m{i} is not None{' and ' + others if others else ''}:",
                f"            if {mismatch}:",
                f"                result = check_gradient(result, {meta_of(i)}, op, {names[i]!r})",
                f"            return {_tuple(out)}",
            ]
        # A tuple with one entry per parameter (`return grad_x, None`), checked entry by entry.
        entries = [f"r{i}" for i in range(n)]
        lines += [
            f"    if type(result) is tuple and len(result) == {n}:",
            f"        {_tuple(entries)} = result",
        ]
        for i in range(n):
            if i in saved_slot:
                saved_x = f"s{saved_slot[i]}"
                mismatch = (
                    f"r{i}.shape != {saved_x}.shape or r{i}.dtype != {saved_x}.dtype "
                    f"or r{i}.device != {saved_x}.device"
                )
            else:
                mismatch = (
                    f"r{i}.shape != m{i}[0] or r{i}.dtype != m{i}[1] or r{i}.device != m{i}[2]"
                )
            lines += [
                f"        if r{i} is not None:",
                f"            if m{i} is None or not isinstance(r{i}, Tensor) or {mismatch}:",
                f"                r{i} = check_gradient(r{i}, "
                f"{full_meta(i)}, op, {names[i]!r})",
            ]
        lines.append(f"        return (None, {', '.join(entries)}{',' if n == 1 else ''})")
    lines += [
        "    return (None, *flat_gradients(result, op=op, names=names, owned=owned, "
        f"layout=None, meta={_tuple([full_meta(i) for i in range(n)])}))",
    ]

    # forward: the common call passes one value per parameter straight to the user's function
    lines += [
        "",
        "def forward(state, *flat):",
        "    if state.layout is None:",
        "        out = fn(*flat)" if plain else "        out = call(flat)",
        "        if isinstance(out, Tensor):",
        "            return as_output(out, flat)",
        "        return shape_output(out, state, flat)",
        "    return forward_general(state, *flat)",
    ]

    # run ----------------------------------------------------------------------------------
    if plain:
        lines += [
            "",
            "def make_run(raw_eager, apply):",
            "    def run(op_object, *args, **kwargs):",
            f"        if kwargs or len(args) != {n}:",
            "            return run_general(args, kwargs)",
            f"        {_tuple(values)} = args",
            "        if " + (" or ".join(f"isinstance({v}, CONTAINERS)" for v in values) or "False")
            + ":",
            "            return run_general(args, kwargs)",
            # A TensorFlow tensor takes the TensorFlow backend. Checked only when the first
            # value is not a torch tensor, so a torch call pays one isinstance.
            "        if not isinstance(v0, Tensor) and any_tensorflow(args):",
            "            return run_tensorflow(args, kwargs)",
            "        if FAST_APPLY and not is_dynamo_compiling() and not transforms_active():",
            f"            out = raw_eager(None{''.join(', ' + v for v in values)})",
            "            if type(out) is tuple:  # not one tensor: the state is appended",
            "                return finish(out[:-1], out[-1])",
            "            return out",
            "        state = CallState()",
            f"        out = apply(state{''.join(', ' + v for v in values)})",
            "        if state.out_spec is None:",
            "            return out",
            "        return finish(out, state)",
            "    return run",
        ]
    else:
        lines += [
            "",
            "def make_run(raw_eager, apply):",
            "    def run(op_object, *args, **kwargs):",
            "        return run_general(args, kwargs)",
            "    return run",
        ]

    namespace = dict(namespace)
    namespace["NOTE"] = f"(raised in backward rule `{namespace['rule_name']}` of `{op}`)"
    source = "\n".join(lines) + "\n"
    result = _compile(source, op, namespace)
    return {
        "forward_eager": result.get("forward_eager"),
        "forward": result["forward"],
        "setup_context": result["setup_context"],
        "backward": result["backward"],
        "make_run": result["make_run"],
    }
