"""Generated source for the common call of a module rule (`go.Module`, `override_backward`).

The op `_ModuleRule` builds around a module's forward takes the module, the parameter ids,
one slot per parameter and the forward's inputs; its rule, `_module._call_module_rule`, is
the reference for what a backward does. Through the core's generic machinery a call costs
several microseconds more than a hand-written Function, a large share of a small layer's
step, so for a rule that owns every input and parameter (no in-place copies, residuals,
`needs_grad`, `once_differentiable`, one upstream gradient) three pieces are generated:

* `rule`: the op's rule with its keywords spelled out (the op's own path, taken under
  `torch.compile`, `torch.func`, `functional_call` and for calls the others do not cover);
* a *twin* of the op's eager Function, in the classic `forward(ctx, ...)` form, with the
  op's inputs (a leading None where the op has its per-call state): its forward calls the
  module's forward directly and saves what the rule reads, its backward calls the user's
  rule directly;
* an *entry* per module structure (`generate_entry`): it checks, reading the module's own
  dicts, that the module still has exactly that structure (the same parameter and buffer
  names, None where None was, no parameter shared, no submodule, a plain `nn.Parameter`
  each, not in-place) and that the call is an eager positional one, then applies the twin.
  Anything else returns `_module.MISS`, and the caller takes the op's path.

Each fast path hands what it does not cover, unchanged, to the reference: the twin's
forward to the core's general setup for an output that is not one tensor (its backward then
to the core's general backward), the twin's backward to the op's rule and the core's
checks, when the module no longer holds what its forward saw, buffers were passed in,
autocast was on, or the rule returned anything but a dict naming every input and parameter.

Only identifiers, reprs of names and small integers are put into the source. Every global
and local the source uses starts with `_go_`, so that no forward parameter (a keyword of the
generated rule) shadows one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ._errors import GradOverrideError
from ._fastpath import compile_source
from ._frameworks import any_tensorflow
from ._function import CallState, saved_for
from ._function import _autocast_state as autocast_state
from ._function import _call_rule as call_rule
from ._gradients import check_gradient, flat_gradients
from ._internals import any_autocast_enabled, raw_apply, tracing_state, transforms_active
from ._passthrough import as_output

__all__ = ["generate_entry", "generate_rule", "generate_twin"]

_CONTAINERS = (tuple, list, dict)

#: The first item of a record the twin's forward leaves for its backward.
_TWIN: Any = object()


def _builtins() -> dict[str, Any]:
    return {
        "_go_Tensor": Tensor, "_go_check_gradient": check_gradient, "_go_len": len,
        "_go_type": type, "_go_dict": dict, "_go_tuple": tuple, "_go_isinstance": isinstance,
        "_go_KeyError": KeyError, "_go_RuntimeError": RuntimeError,
        "_go_Exception": Exception, "_go_GradOverrideError": GradOverrideError,
    }


def _other_device(g: str, t: str) -> str:
    """Source: whether tensor `g` is on another device than tensor `t`. Reading `.device`
    makes two device objects; for a CPU tensor, `is_cpu` says it without them."""
    return f"((not {g}.is_cpu) if {t}.is_cpu else {g}.device != {t}.device)"


def _tuple(items: list[str]) -> str:
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _user_call(
    requested: tuple[str, ...], parameter_names: tuple[str, ...], rule_is_method: bool,
    grads: str, module: str, value_of: dict[str, str],
) -> str:
    """The call of the user's rule: `value_of` gives the source for each requested name that
    is neither a parameter nor `module`."""
    args = [module] if rule_is_method else []
    args.append(grads)
    for n in requested:
        if n in parameter_names:
            args.append(f"{n}={value_of['param:' + n]}")
        elif n == "module" and not rule_is_method:
            args.append(f"module={module}")
        else:
            args.append(f"{n}={value_of[n]}")
    return f"_go_user_rule({', '.join(args)})"


def _holds(names: tuple[str, ...], params: list[str], module: str) -> str:
    """Source: the module still holds each parameter its forward saw."""
    tests = []
    for name, p in zip(names, params, strict=True):
        if "." in name:
            tests.append(f"_go_current({module}, {name!r}) is {p}")
        else:
            tests.append(f"{module}._parameters.get({name!r}) is {p}")
    return " and ".join(tests) or "True"


def _rule_body(
    *, label: str, names: tuple[str, ...], inputs: tuple[str, ...], params: list[str],
    call: str, note: bool, finish: Callable[[list[str], list[str]], list[str]],
) -> list[str]:
    """The user's rule called (`note`: an exception it raises gets the core's note), `.grad`
    left alone, a full dict translated: lines that `return` the gradients
    (`finish(param_grads, input_grads)`), or fall through."""
    body = [f"_go_b{i} = {p}.grad" for i, p in enumerate(params)]
    if note:
        body += [
            "try:",
            f"    _go_result = {call}",
            "except _go_GradOverrideError:",
            "    raise",
            "except _go_Exception as _go_exc:",
            "    _go_exc.add_note(_go_NOTE)",
            "    raise",
        ]
    else:
        body.append(f"_go_result = {call}")
    for i, (name, p) in enumerate(zip(names, params, strict=True)):
        body += [f"if {p}.grad is not _go_b{i}:", f"    _go_wrote_grad({name!r})"]
    pg = [f"_go_pg{i}" for i in range(len(names))]
    ig = [f"_go_ig{i}" for i in range(len(inputs))]
    body += [
        "if _go_type(_go_result) is _go_dict and "
        f"_go_len(_go_result) == {len(inputs) + len(names)}:",
        "    try:",
        *(f"        {g} = _go_result[{n!r}]" for g, n in zip(pg, names, strict=True)),
        *(f"        {g} = _go_result[{n!r}]" for g, n in zip(ig, inputs, strict=True)),
        "    except _go_KeyError:",
        "        pass",
        "    else:",
    ]
    for g, name, p in zip(pg, names, params, strict=True):
        body += [
            f"        if {g} is not None and (not _go_isinstance({g}, _go_Tensor) or "
            f"{g}.shape != {p}.shape or {g}.dtype is not {p}.dtype or {_other_device(g, p)}):",
            f"            {g} = _go_check_gradient({g}, ({p}.shape, {p}.dtype, {p}.device), "
            f"{label!r}, {name!r})",
        ]
    body += ["        " + line for line in finish(pg, ig)]
    return body


def generate_rule(
    *,
    label: str,
    inputs: tuple[str, ...],
    names: tuple[str, ...],
    slots: tuple[str, ...],
    rule_names: tuple[str, ...],
    requested: tuple[str, ...],
    parameter_names: tuple[str, ...],
    rule_is_method: bool,
    n_grads: int | None,
    module_kw: str,
    ids_kw: str,
    namespace: dict[str, Any],
) -> Callable[..., Any]:
    """The op's rule, taking `*grads` and the keywords `rule_names` (the op's path).

    `namespace` provides: user_rule, CONFIG (the reference's config), general (the reference,
    `general(CONFIG, grads, named)`), translate (`_translate`), current (a parameter by
    dotted name), wrote_grad (raises for a rule that wrote `.grad`)."""
    signature = ", ".join(["*_go_grads", *rule_names])
    named = "{" + ", ".join(f"{n!r}: {n}" for n in rule_names) + "}"
    conditions = [f"not {ids_kw}.buffers"]
    if n_grads is not None:
        conditions.insert(0, f"_go_len(_go_grads) == {n_grads}")
    value_of = {n: n for n in requested}
    value_of.update({f"param:{n}": s for n, s in zip(names, slots, strict=True)})
    call = _user_call(requested, parameter_names, rule_is_method, "*_go_grads", "_go_module",
                      value_of)

    def finish(pg: list[str], ig: list[str]) -> list[str]:
        # The core checks the inputs' gradients (and the parameters' again, at no cost).
        return [f"return {_tuple(['None', 'None', *pg, *ig])}"]

    lines = [
        f"def rule({signature}):",
        f"    _go_module = {module_kw}",
        f"    if {' and '.join(conditions)} and {_holds(names, list(slots), '_go_module')}:",
    ]
    body = _rule_body(label=label, names=names, inputs=inputs, params=list(slots), call=call,
                      note=False, finish=finish)
    body.append(
        "return _go_translate(_go_CONFIG, _go_result, "
        + "{" + ", ".join(f"{n!r}: {s}" for n, s in zip(names, slots, strict=True)) + "}, {})"
    )
    lines += ["        " + line for line in body]
    lines.append(f"    return _go_general(_go_CONFIG, _go_grads, {named})")
    space = {f"_go_{key}": value for key, value in namespace.items()}
    space.update(_builtins())
    generated = compile_source("\n".join(lines) + "\n", f"{label}.backward", space, owner="rule")
    rule: Callable[..., Any] = generated["rule"]
    return rule


def generate_twin(
    *,
    label: str,
    kind: str,
    module_name: str,
    forward: Callable[..., Any],
    inputs: tuple[str, ...],
    names: tuple[str, ...],
    op_names: tuple[str, ...],
    requested: tuple[str, ...],
    parameter_names: tuple[str, ...],
    rule_is_method: bool,
    n_grads: int | None,
    materialize: bool,
    op_function: type[torch.autograd.Function],
    op_rule: Callable[..., Any],
    rule_label: str,
    labels: dict[str, str],
    namespace: dict[str, Any],
) -> Callable[..., Any]:
    """The twin of the op's eager Function; returns its raw apply (`_internals.raw_apply`),
    taking `(None, module, ids, *parameters, *inputs)`.

    `op_names` are the op's parameter names (module, ids, slots, inputs), in order;
    `op_rule` the op's rule (the reference); `namespace` provides user_rule, current,
    wrote_grad, CONFIG and translate as for `generate_rule`."""
    k, n = len(names), len(inputs)
    ps = [f"_go_p{i}" for i in range(k)]
    xs = [f"_go_a{i}" for i in range(n)]
    flat = ["_go_module", "_go_ids", *ps, *xs]
    req_inputs = [i for i, name in enumerate(inputs) if name in requested]
    wants_output = "output" in requested
    general: tuple[Any, ...] = op_function._gradoverride_general  # type: ignore[attr-defined]
    shape_output, setup_general, backward_general, _ = general
    note = f"(raised in backward rule `{rule_label}` of `{label}`)"

    def differentiable(v: str) -> str:
        # (A tensor that requires grad is floating-point or complex: read first, cheapest.)
        return (
            f"_go_isinstance({v}, _go_Tensor) and ({v}.requires_grad or {v}.is_floating_point() "
            f"or {v}.is_complex())"
        )

    # forward ------------------------------------------------------------------------------
    lines = [
        f"def forward(ctx, _go_state, {', '.join(flat)}):",
        f"    _go_out = _go_forward(_go_module{''.join(', ' + x for x in xs)})",
        f"    if {' or '.join(f'_go_out is {v}' for v in (*ps, *xs))}:",
        "        _go_out = _go_out.view_as(_go_out)",
        "    elif _go_isinstance(_go_out, _go_Tensor):",
        "        if _go_out._base is not None:",
        f"            _go_out = _go_as_output(_go_out, {_tuple(flat)})",
        "    else:",
        # Not one tensor: the core's general setup, and its general backward.
        "        _go_st = _go_CallState()",
        f"        _go_out = _go_shape_output(_go_out, _go_st, {_tuple(flat)})",
        f"        _go_setup_general(ctx, {_tuple(['_go_st', *flat])}, _go_out)",
        "        return (*_go_out, _go_st)",
    ]
    # An input the rule names is saved, its metadata read from it in backward; the others'
    # metadata is kept (None: it takes no gradient).
    for i, x in enumerate(xs):
        if i in req_inputs:
            lines.append(f"    _go_m{i} = True if {differentiable(x)} else None")
        else:
            lines.append(
                f"    _go_m{i} = ({x}.shape, {x}.dtype, {x}.device) if {differentiable(x)} "
                "else None"
            )
    saved = [*ps, *(f"{xs[i]} if _go_isinstance({xs[i]}, _go_Tensor) else None"
                    for i in req_inputs)]
    statics = [f"None if _go_isinstance({xs[i]}, _go_Tensor) else {xs[i]}" for i in req_inputs]
    if wants_output:
        saved.append("_go_out")
    lines.append(f"    ctx.save_for_backward({', '.join(saved)})")
    if not materialize:
        lines.append("    ctx.set_materialize_grads(False)")
    lines += [
        f"    _go_ac = _go_autocast_state({_tuple(flat)}) if _go_any_autocast_enabled() "
        "else None",
        # One flat tuple, its first item this twin's mark (the core's general record has its
        # CallState there).
        "    ctx.gradoverride = "
        + _tuple(["_go_TWIN", "_go_module", "_go_ids", "_go_ac",
                  *(f"_go_m{i}" for i in range(n)), *statics]),
        "    return _go_out",
    ]

    # backward -----------------------------------------------------------------------------
    saved_names = [*ps, *(f"_go_s{i}" for i in req_inputs)]
    if wants_output:
        saved_names.append("_go_output")
    read = [labels.get(f, f) for f in op_names[2 : 2 + k]]
    read += [inputs[i] for i in req_inputs] + (["output"] if wants_output else [])
    lines += [
        "",
        "def backward(ctx, _go_g0, *_go_rest):",
        "    _go_record = ctx.gradoverride",
        "    if _go_record[0] is not _go_TWIN:  # recorded by the core's general setup",
        "        return _go_backward_general(ctx, (_go_g0, *_go_rest))",
        "    "
        + ", ".join(["_go_mark", "_go_module", "_go_ids", "_go_ac",
                     *(f"_go_m{i}" for i in range(n)), *(f"_go_t{i}" for i in req_inputs)])
        + " = _go_record",
        "    try:",
        f"        {_tuple(saved_names)} = ctx.saved_tensors",
        "    except _go_RuntimeError:",
        f"        _go_saved_for(ctx, {label!r}, {tuple(read)!r})",
        "        raise",
    ]
    value: dict[str, str] = {}
    for i in req_inputs:
        lines.append(f"    _go_k{i} = _go_s{i} if _go_s{i} is not None else _go_t{i}")
        value[inputs[i]] = f"_go_k{i}"
    if wants_output:
        value["output"] = "_go_output"
    value.update({f"param:{nm}": p for nm, p in zip(names, ps, strict=True)})

    def input_meta(i: int) -> str:
        if i in req_inputs:
            return f"(_go_k{i}.shape, _go_k{i}.dtype, _go_k{i}.device)"
        return f"_go_m{i}"

    def full_meta(i: int) -> str:
        return f"(None if _go_m{i} is None else {input_meta(i)})" if i in req_inputs else (
            f"_go_m{i}"
        )

    def finish_lines(pg: list[str], ig: list[str]) -> list[str]:
        out = []
        for g, p, name in zip(pg, ps, names, strict=True):
            # A parameter that takes no gradient (not floating-point), as the core says it.
            # (A parameter that requires grad is floating-point or complex.)
            out += [
                f"if {g} is not None and not {p}.requires_grad and not "
                f"({p}.is_floating_point() or {p}.is_complex()):",
                f"    _go_check_gradient({g}, None, {label!r}, {name!r})",
            ]
        for i, g in enumerate(ig):
            meta = input_meta(i)
            mismatch = (
                f"{g}.shape != {meta}[0] or {g}.dtype is not {meta}[1] or {g}.device != {meta}[2]"
                if i not in req_inputs else
                f"{g}.shape != _go_k{i}.shape or {g}.dtype is not _go_k{i}.dtype or "
                f"{_other_device(g, f'_go_k{i}')}"
            )
            out += [
                f"if {g} is not None:",
                f"    if _go_m{i} is None or not _go_isinstance({g}, _go_Tensor) or {mismatch}:",
                f"        {g} = _go_check_gradient({g}, {full_meta(i)}, {label!r}, "
                f"{inputs[i]!r})",
            ]
        out.append(f"return {_tuple(['None', 'None', 'None', *pg, *ig])}")
        return out

    # The reference: the op's rule with the keywords it names, and the core's checks.
    named = {op_names[0]: "_go_module", op_names[1]: "_go_ids"}
    named.update(dict(zip(op_names[2 : 2 + k], ps, strict=True)))
    named.update({inputs[i]: f"_go_k{i}" for i in req_inputs})
    if wants_output:
        named["output"] = "_go_output"
    rule_kwargs = "{" + ", ".join(f"{key!r}: {v}" for key, v in named.items()) + "}"
    reference = (
        f"_go_result = _go_call_rule(_go_op_rule, (_go_g0, *_go_rest), {rule_kwargs}, "
        "_go_ac, False, _go_NOTE)"
    )
    if n_grads in (None, 1):
        call = _user_call(requested, parameter_names, rule_is_method, "_go_g0", "_go_module",
                          value)
        lines.append(
            f"    if _go_ac is None and not _go_ids.buffers and {_holds(names, ps, '_go_module')}:"
        )
        body = _rule_body(label=label, names=names, inputs=inputs, params=ps, call=call,
                          note=True, finish=finish_lines)
        # Any other return value: the reference's translation of it (the rule ran once).
        body.append(
            "_go_result = _go_translate(_go_CONFIG, _go_result, "
            + "{" + ", ".join(f"{nm!r}: {p}" for nm, p in zip(names, ps, strict=True))
            + "}, {})"
        )
        lines += ["        " + line for line in body]
        lines += ["    else:", "        " + reference]
    else:
        lines.append("    " + reference)
    metas = ["None", "None", *(f"({p}.shape, {p}.dtype, {p}.device) if "
                               f"({p}.is_floating_point() or {p}.is_complex()) else None"
                               for p in ps),
             *(full_meta(i) for i in range(n))]
    lines.append(
        "    return (None, *_go_flat_gradients(_go_result, op=_go_OP, names=_go_OP_NAMES, "
        f"owned=_go_OWNED, layout=None, meta={_tuple(metas)}))"
    )

    space = {f"_go_{key}": value for key, value in namespace.items()}
    space.update(_builtins())
    space.update(
        _go_forward=forward, _go_as_output=as_output, _go_CallState=CallState, _go_TWIN=_TWIN,
        _go_shape_output=shape_output, _go_setup_general=setup_general,
        _go_backward_general=backward_general, _go_autocast_state=autocast_state,
        _go_any_autocast_enabled=any_autocast_enabled, _go_saved_for=saved_for,
        _go_call_rule=call_rule, _go_op_rule=op_rule, _go_flat_gradients=flat_gradients,
        _go_OP=label, _go_OP_NAMES=op_names, _go_OWNED=(True,) * len(op_names),
        _go_NOTE=note,
    )
    generated = compile_source("\n".join(lines) + "\n", f"{label} (eager)", space)
    name = f"{kind}_{''.join(c if c.isalnum() else '_' for c in label)}"
    twin = type(name, (torch.autograd.Function,), {
        "forward": staticmethod(generated["forward"]),
        "backward": staticmethod(generated["backward"]),
        "__module__": module_name,
        "__qualname__": name,
        "__doc__": f"The autograd.Function gradoverride generated for `{label}` (eager form).",
    })
    return raw_apply(twin)


#: A module structure an entry covers: per `_parameters` entry and per `_buffers` entry, in
#: dict order, its name and whether it holds None.
Pattern = tuple[tuple[tuple[str, bool], ...], tuple[tuple[str, bool], ...]]


def generate_entry(
    *,
    label: str,
    cls: type,
    pattern: Pattern,
    n_inputs: int,
    inplace_in_dict: bool,
    namespace: dict[str, Any],
) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]:
    """`entry(module, args, kwargs)`: the twin applied when `module` has the structure
    `pattern` and the call is one the twin covers (eager, with grad enabled, no
    torch.jit.trace recording, no torch.func transform), else `MISS`. Called in eager mode
    only (not while dynamo traces).

    `namespace` provides: op (the op, whose class says whether its next call is checked),
    fast_class (its class when it is not), apply (the twin's raw apply), finish (the core's,
    for an output that is not one tensor), ParameterIds, NO_BUFFERS (the ids object for a
    call without floating buffers), MISS (`_module.MISS`)."""
    params, buffers = pattern
    xs = [f"_go_a{i}" for i in range(n_inputs)]
    lines = [
        "def entry(_go_module, _go_args, _go_kwargs):",
        f"    if (_go_kwargs or _go_len(_go_args) != {n_inputs} or _go_type(_go_module) is not "
        "_go_CLS or _go_op.__class__ is not _go_fast_class or not _go_is_grad_enabled() "
        "or _go_tracing_state() is not None or _go_transforms_active()):",
        "        return _go_MISS",
    ]
    if xs:
        lines.append(f"    {_tuple(xs)} = _go_args")
        lines += [
            f"    if {' or '.join(f'_go_isinstance({x}, _go_CONTAINERS)' for x in xs)}:",
            "        return _go_MISS",
        ]
    lines += [
        "    if 'tensorflow' in _go_modules and _go_any_tensorflow(_go_args):",
        "        return _go_MISS",
        "    if _go_module._modules:",
        "        return _go_MISS",
    ]

    def entries(table: str, items: tuple[tuple[str, bool], ...], prefix: str) -> list[str]:
        """Source: `table` holds exactly `items` (None where None), distinct tensors."""
        out = [
            f"    _go_{table} = _go_module._{table}",
            f"    if _go_len(_go_{table}) != {len(items)}:",
            "        return _go_MISS",
        ]
        held = []
        for j, (key, is_none) in enumerate(items):
            if is_none:
                out += [
                    f"    if _go_{table}.get({key!r}, _go_MISS) is not None:",
                    "        return _go_MISS",
                ]
            else:
                out.append(f"    {prefix}{j} = _go_{table}.get({key!r})")
                held.append(f"{prefix}{j}")
        tests = []
        for v in held:
            # Parameters: a plain nn.Parameter each (a tensor functional_call put in place,
            # a lazy one, a subclass: the op's path); buffers: tensors.
            tests.append(
                f"_go_type({v}) is not _go_Parameter" if table == "parameters"
                else f"{v} is None"
            )
        tests += [f"{a} is {b}" for i, a in enumerate(held) for b in held[i + 1 :]]
        if tests:
            out += [f"    if {' or '.join(tests)}:", "        return _go_MISS"]
        return out

    lines += entries("parameters", params, "_go_p")
    lines += entries("buffers", buffers, "_go_q")
    held_buffers = [(key, f"_go_q{j}") for j, (key, is_none) in enumerate(buffers) if not is_none]
    if held_buffers:
        lines.append("    _go_fb = {}")
        for key, v in held_buffers:
            lines += [
                f"    if {v}.is_floating_point() or {v}.is_complex():",
                f"        _go_fb[{key!r}] = {v}",
            ]
        lines.append("    _go_ids = _go_ParameterIds((), _go_fb) if _go_fb else _go_NO_BUFFERS")
    else:
        lines.append("    _go_ids = _go_NO_BUFFERS")
    if inplace_in_dict:
        lines.append("    if _go_module.__dict__.get('inplace', False) is True:")
    else:
        lines.append("    if _go_getattr(_go_module, 'inplace', False) is True:")
    lines.append("        return _go_MISS")
    ps = [f"_go_p{j}" for j, (_, is_none) in enumerate(params) if not is_none]
    call = ", ".join(["None", "_go_module", "_go_ids", *ps, *xs])
    lines += [
        f"    _go_out = _go_apply({call})",
        "    if _go_type(_go_out) is _go_tuple:  # not one tensor: the state is appended",
        "        return _go_finish(_go_out[:-1], _go_out[-1])",
        "    return _go_out",
    ]
    space = {f"_go_{key}": value for key, value in namespace.items()}
    space.update(_builtins())
    space.update(
        _go_CLS=cls, _go_CONTAINERS=_CONTAINERS, _go_modules=sys.modules,
        _go_Parameter=nn.Parameter, _go_getattr=getattr,
        _go_transforms_active=transforms_active, _go_any_tensorflow=any_tensorflow,
        _go_is_grad_enabled=torch.is_grad_enabled, _go_tracing_state=tracing_state,
    )
    generated = compile_source("\n".join(lines) + "\n", f"{label} (entry)", space, owner="entry")
    entry: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any] = generated["entry"]
    return entry
