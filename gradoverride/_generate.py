"""The one generator: source for an op's eager twin, built from the templates below.

The performance contract (an op at most 1.05x a hand-written classic `autograd.Function` on
small tensors; a module at most 1.1x a hand-written layer) leaves a few microseconds for all
that gradoverride does per call; the route's general steps (`_function`), loops over slots
building lists and dicts, cost more (1.4x for an op, 2.5x for a module, measured by
`benchmarks/overhead.py` and `benchmarks/modules.py`). So for each op whose rule owns every
input, with one upstream gradient, no residuals, `needs_grad` or `once_differentiable`, and
a forward taking one positional value per slot, this module writes the common call out,
specialised to the op's slot count and the names its rule asks for:

* `forward(ctx, state, v0, ...)`: the eager twin's forward (the classic form, run through
  `_C._FunctionBase.apply`): calls the forward, keeps what the rule names, and leaves a
  short record for backward. An output that is not one tensor takes the route's general
  steps, with the same twin;
* `backward(ctx, g0, *rest)`: shared by the twin and the route's `setup_context` Function;
  a general record goes to the general backward. It calls the rule, and checks what it
  returns where that is a tensor, a tuple or a dict naming every slot (each entry against
  its input's shape, dtype and device, by comparisons written out: `check_gradient` runs
  only for a gradient that needs fixing or reporting), anything else through
  `flat_gradients`. For a module's op it also gives the rule the module holding the
  parameters its forward saw (the general steps do it when they are not the module's
  now, or one was changed in place), and refuses a rule that wrote a parameter's `.grad`.
  A call a diagnostics recorder recorded (it left its record on the node) runs as
  `backward_body` (the same source) through the route's `backward_recorded`, which hands
  the recorder the gradients;
* `run(args, kwargs)`: an op's entry for a positional call (padded with defaults), which
  hands anything else (keywords, containers, TensorFlow tensors) to the route's general
  entry.

Only identifiers read from signatures, reprs of names and small integers go into the
source; every name the source reads from its namespace or binds as a local starts with
`_go_` (the values are `v0`, `v1`, ...), so no forward parameter (a keyword of the rule call)
shadows one; the functions are named `forward`, `backward` and `run`, as tracebacks and
profiles show them. The source is registered with
`linecache`, so tracebacks through it show real lines.
"""

from __future__ import annotations

import inspect
import linecache
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

__all__ = ["ModuleTwin", "TreeNode", "Twin", "compile_source", "generate", "generate_reader"]

_counter = 0


def compile_source(
    source: str, name: str, namespace: dict[str, Any], owner: str = "backward"
) -> dict[str, Any]:
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


class ModuleTwin(NamedTuple):
    """What a module op's twin adds: slot 0 holds the module; `params` are (slot, name) of
    its parameters; `method`: the rule takes the module first; `owned_inputs`: the slots of
    the inputs its rule owns; `attach`: the rule owns some inputs only (see
    `_FORWARD_ATTACH`)."""

    method: bool
    params: tuple[tuple[int, str], ...]
    owned_params: tuple[str, ...]
    owned_inputs: tuple[int, ...]
    attach: bool = False


class Twin(NamedTuple):
    """The generated functions, and the namespace they read (set `_go_raw` there: the twin
    Function's raw apply, made from `forward` and `backward`)."""

    forward: Callable[..., Any]
    backward: Callable[..., Any]
    run: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None
    namespace: dict[str, Any]
    # A module op's forward given the output the module computed (see `_FORWARD_GIVEN` and
    # `_FORWARD_ATTACH`).
    forward_given: Callable[..., Any] | None


def _tuple(items: Sequence[str]) -> str:
    if not items:
        return "()"
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def _differentiable(v: str) -> str:
    return (
        f"_go_isinstance({v}, _go_Tensor) and ({v}.requires_grad or {v}.is_floating_point() "
        f"or {v}.is_complex())"
    )


def _other_device(g: str, t: str) -> str:
    """Source: whether tensor `g` is on another device than tensor `t`. Reading `.device`
    makes two device objects; for a CPU tensor, `is_cpu` says it without them."""
    return f"((not {g}.is_cpu) if {t}.is_cpu else {g}.device != {t}.device)"


_FORWARD = """
def forward(ctx, _go_state, {values}):
    _go_out = _go_fn({forward_args})
    if {returned_input}:
        _go_out = _go_out.view_as(_go_out)
    elif _go_isinstance(_go_out, _go_Tensor):
        if _go_out._base is not None:
            _go_out = _go_as_output(_go_out, {all_values})
    else:
        # Not one tensor: the route's general steps (its backward takes the general record),
        # with a state of its own when the caller passed none (an op's common call does not
        # make one), returned last.
        _go_fresh = _go_state is None
        if _go_fresh:
            _go_state = _go_CallState()
            _go_state.eager = True
        _go_out = _go_shape_output(_go_out, _go_state, {all_values})
        _go_n = _go_state.n_out
        _go_setup(ctx, _go_state, {all_values}, _go_out[:_go_n], _go_out[_go_n:])
        return (*_go_out, _go_state) if _go_fresh else _go_out
{record}
    return _go_out
"""

# A module's op whose forward the module ran itself (its forward hooks: `override_backward`):
# the output, one tensor, comes in a 1-tuple (no input of the Function), as if the forward
# had run here.
_FORWARD_GIVEN = """
def forward_given(ctx, _go_state, {values}, _go_given):
    _go_out = _go_given[0]
    if {returned_input}:
        _go_out = _go_out.view_as(_go_out)
    elif _go_out._base is not None:
        _go_out = _go_as_output(_go_out, {all_values})
{record}
    return _go_out
"""

# A module's op whose rule owns some inputs only: the forward ran on the ordinary graph (the
# owned inputs detached), and its output, one tensor that shows no input, comes as the last
# input of the Function; the Function returns a new tensor sharing its memory, and its
# backward passes the upstream gradient on into that graph (see `_results`).
_FORWARD_ATTACH = """
def forward_given(ctx, _go_state, {values}, _go_out):
{record}
    return _go_out.detach()
"""

_BACKWARD_HEAD = """
def {name}(ctx, _go_g0, *_go_rest):{check}
    _go_record = ctx.gradoverride
    if _go_record[0] is not _go_FAST:  # recorded by the route's general steps
        return _go_backward_general(ctx, (_go_g0, *_go_rest))
    {unpack} = _go_record
"""

# While a recorder records, a backward whose call it recorded (which left RECORDED_CALL on the
# node) runs as `backward_body` (the same function without this check) through
# `backward_recorded`, which hands the recorder what it returned for the rule's inputs (the
# first `span` entries); another is told to the recorder (`met`: a call of a forward it did
# not record counts its backward pass as a step).
_BACKWARD_CHECK = """
    if _go_RECORDING:
        if _go_RECORDED_CALL in ctx.__dict__:
            return _go_backward_recorded(ctx, backward_body, (_go_g0, *_go_rest), {span})
        for _go_recorder in _go_RECORDING:
            _go_recorder.met(ctx)"""

_SAVED = """
    try:
        {saved} = ctx.saved_tensors
    except _go_RuntimeError:
        _go_saved_for(ctx, _go_OP, {read!r})
        raise
"""

# The rule's call, its errors but ours noted with the rule and the op.
_TRY_RULE = """
        try:
            _go_result = _go_rule({call})
        except _go_GradOverrideError:
            raise
        except _go_Exception as _go_exc:
            _go_exc.add_note(_go_NOTE)
            raise"""

_CALL = """
    if _go_autocast is None:{try_rule}
    else:
        _go_result = _go_call_rule(_go_rule, {call_args}, {call_kwargs}, _go_autocast, False,
                                   _go_NOTE)
"""

# A module's op: the rule runs with the module holding what its forward saw (the general
# steps swap that in when it is not so now); a `.grad` it writes is refused unless another
# thread's backward ran through a module op's rule meanwhile (it may have accumulated into
# that `.grad`; see `_function._single_thread`; the first-call check sees a rule's writes
# exactly); a `.grad` found None after the rule was cleared by another thread's `zero_grad`.
_MODULE_CALL = """
    if _go_autocast is None and {holds}:{enter}
        _go_before = {grads_before}{try_rule}
{grad_checks}
    else:
        _go_result = _go_module_rule(_go_module, _go_held, _go_versions, _go_CallState(),
                                     (_go_g0,), {call_kwargs}, _go_autocast)
"""

_RUN = """
def run(_go_args, _go_kwargs):
    _go_n = _go_len(_go_args)
    if _go_kwargs or _go_n > {n} or _go_n < {required}:
        return _go_run_general(_go_args, _go_kwargs)
    if _go_n < {n}:
        _go_args = _go_args + _go_DEFAULTS[_go_n:]
    {values} = _go_args
    if {containers}:
        return _go_run_general(_go_args, _go_kwargs)
    # A TensorFlow tensor takes the TensorFlow backend (checked only when the first value
    # is not a torch tensor, so a torch call pays one isinstance).
    if not _go_isinstance(v0, _go_Tensor) and _go_any_tensorflow(_go_args):
        return _go_run_tensorflow(_go_args, _go_kwargs)
    if not _go_is_grad_enabled() or _go_tracing_state() is not None:
        return _go_run_bound(_go_args, None)
    if _go_FAST_APPLY and not _go_is_dynamo_compiling() and not _go_transforms_active():
        _go_out = _go_raw(None, {values})
        if _go_type(_go_out) is _go_tuple:  # not one tensor: its state is last
            return _go_finish(_go_out[:-1], _go_out[-1])
        return _go_out
    return _go_run_bound(_go_args, None)
"""


def generate(
    *,
    op: str,
    names: tuple[str, ...],
    n_forward: int,
    requested: tuple[tuple[str, int], ...],
    wants_output: bool,
    materialize: bool,
    module: ModuleTwin | None,
    defaults: tuple[Any, ...] | None,
    namespace: dict[str, Any],
) -> Twin:
    """The twin of an op with these slots and rule (see the module docstring).

    `n_forward`: the forward takes the first `n_forward` values (a module op's parameters
    stay in the module); `defaults`: every slot's default, `inspect.Parameter.empty` where
    it has none (`run` is generated for an op called by users, not for a module's).
    `namespace` provides, without the `_go_` prefix: fn, rule, rule_name, Tensor,
    CallState, as_output, shape_output, setup, backward_general, RECORDING, RECORDED_CALL,
    backward_recorded, saved_for, call_rule, check_gradient, flat_gradients,
    GradOverrideError, SKIP, FORM (the op's ModuleForm or None), OWNED, autocast_state,
    any_autocast_enabled; for a module op module_rule, parameter_at, single_thread,
    in_backward, wrote_grad; for `run` run_general, run_bound, run_tensorflow,
    any_tensorflow, finish, is_grad_enabled, tracing_state, is_dynamo_compiling,
    transforms_active, FAST_APPLY (and `_go_raw`, set afterwards: see `Twin`).
    """
    n = len(names)
    values = [f"v{i}" for i in range(n)]
    metas = [f"_go_m{i}" for i in range(n)]
    # An input the rule names is saved, so its metadata is read from the saved tensor in
    # backward; its `m` is then just a flag (True: a differentiable tensor) or None.
    saved_slot: dict[int, int] = {}  # requested slot -> its index among the saved tensors
    for k, (_, slot) in enumerate(requested):
        saved_slot.setdefault(slot, k)
    param_slots = {} if module is None else dict(module.params)

    # ---- forward --------------------------------------------------------------------------
    record = [
        f"_go_m{i} = True if {_differentiable(f'v{i}')} else None"
        if i in saved_slot
        else f"_go_m{i} = ({f'v{i}'}.shape, v{i}.dtype, v{i}.device) "
        f"if {_differentiable(f'v{i}')} else None"
        for i in range(n) if i not in param_slots and (module is None or i != 0)
    ]
    saved = [f"v{slot} if _go_isinstance(v{slot}, _go_Tensor) else None" for _, slot in requested]
    statics = [
        f"None if _go_isinstance(v{slot}, _go_Tensor) else v{slot}" for _, slot in requested
    ]
    if wants_output:
        saved.append("_go_out")
    if saved:
        record.append(f"ctx.save_for_backward({', '.join(saved)})")
    if not materialize:
        record.append("ctx.set_materialize_grads(False)")
    record.append(
        f"_go_autocast = _go_autocast_state({_tuple(values)}) if _go_any_autocast_enabled() "
        "else None"
    )
    fields = ["_go_FAST", *(m for i, m in enumerate(metas) if _has_meta(i, module)),
              _tuple(statics), "_go_autocast"]
    if module is not None:
        held = [f"v{slot}" for slot, _ in module.params]
        # The parameters the forward saw, held by reference (the module holds them anyway;
        # see the route's `setup`), with their version counters.
        fields += ["v0", _tuple(held), _tuple([f"{h}._version" for h in held])]
    record.append(f"ctx.gradoverride = {_tuple(fields)}")
    source = _FORWARD.format(
        values=", ".join(values),
        forward_args=", ".join(values[:n_forward]),
        returned_input=" or ".join(f"_go_out is {v}" for v in values),
        all_values=_tuple(values),
        record="\n".join("    " + line for line in record),
    )
    if module is not None:
        source += (_FORWARD_ATTACH if module.attach else _FORWARD_GIVEN).format(
            values=", ".join(values),
            returned_input=" or ".join(f"_go_out is {v}" for v in values),
            all_values=_tuple(values),
            record="\n".join("    " + line for line in record),
        )

    # ---- backward -------------------------------------------------------------------------
    unpack = ["_", *(m for i, m in enumerate(metas) if _has_meta(i, module)), "_go_statics",
              "_go_autocast"]
    if module is not None:
        unpack += ["_go_module", "_go_held", "_go_versions"]
    # (The body is written twice: as `backward`, after its check for a recorder, and as
    # `backward_body`; the attaching form's last gradient is passed on, not the rule's.)
    body = ""
    if saved:
        read = [name for name, _ in requested] + (["output"] if wants_output else [])
        body += _SAVED.format(saved=_tuple([f"_go_s{k}" for k in range(len(saved))]),
                              read=tuple(read))
    lines: list[str] = []
    keywords: list[tuple[str, str]] = []  # (rule keyword, local holding its value)
    for k, (name, _) in enumerate(requested):
        lines.append(f"_go_k{k} = _go_s{k} if _go_s{k} is not None else _go_statics[{k}]")
        keywords.append((name, f"_go_k{k}"))
    if wants_output:
        keywords.append(("output", f"_go_s{len(saved) - 1}"))
    if module is not None:
        for j, (slot, _) in enumerate(module.params):
            lines.append(f"v{slot} = _go_held[{j}]")
    body += "".join(f"    {line}\n" for line in lines)

    first = ["_go_module"] if module is not None and module.method else []
    call = ", ".join([*first, "_go_g0", *(f"{kw}={local}" for kw, local in keywords)])
    call_args = _tuple([*first, "_go_g0"])
    call_kwargs = "{" + ", ".join(f"{kw!r}: {local}" for kw, local in keywords) + "}"
    if module is None:
        body += _CALL.format(try_rule=_TRY_RULE.format(call=call), call_args=call_args,
                             call_kwargs=call_kwargs)
    else:
        holds = " and ".join(
            [_holds(slot, name) for slot, name in module.params]
            + [f"v{slot}._version == _go_versions[{j}]"
               for j, (slot, _) in enumerate(module.params)]
        ) or "True"
        owned = [(slot, name) for slot, name in module.params if name in module.owned_params]
        # (`.grad` of a tensor that is not a leaf, a replica's parameter, is never written.)
        grads_before = _tuple([f"v{slot}.grad if v{slot}.is_leaf else None" for slot, _ in owned])
        grad_checks = "".join(
            f"        if (v{slot}.grad is not _go_before[{j}] and v{slot}.grad is not None\n"
            f"                and _go_single_thread(_go_mark)):\n"
            f"            _go_wrote_grad({name!r})\n"
            for j, (slot, name) in enumerate(owned)
        )
        body += _MODULE_CALL.format(
            holds=holds, try_rule=_TRY_RULE.format(call=call), call_kwargs=call_kwargs,
            enter="\n        _go_mark = _go_in_backward()" if owned else "",
            grads_before=grads_before, grad_checks=grad_checks,
        )
    body += _results(names, saved_slot, module)
    span = -1 if module is not None and module.attach else None
    for name, check in (("backward", _BACKWARD_CHECK.format(span=span)), ("backward_body", "")):
        source += _BACKWARD_HEAD.format(name=name, check=check, unpack=", ".join(unpack))
        source += body

    # ---- run ------------------------------------------------------------------------------
    if defaults is not None:
        required = sum(1 for d in defaults if d is inspect.Parameter.empty)
        source += _RUN.format(
            n=n, required=required, values=", ".join(values) + ("," if n == 1 else ""),
            containers=" or ".join(f"_go_isinstance({v}, _go_CONTAINERS)" for v in values)
            or "False",
        )

    space = {f"_go_{key}": value for key, value in namespace.items()}
    space.update(
        _go_isinstance=isinstance, _go_len=len, _go_type=type, _go_dict=dict,
        _go_tuple=tuple, _go_KeyError=KeyError, _go_RuntimeError=RuntimeError,
        _go_Exception=Exception, _go_FAST=_FAST, _go_OP=op, _go_NAMES=names,
        _go_NOTE=f"(raised in backward rule `{namespace['rule_name']}` of `{op}`)",
        _go_CONTAINERS=(tuple, list, dict), _go_DEFAULTS=defaults,
    )
    generated = compile_source(source, op, space)
    return Twin(generated["forward"], generated["backward"], generated.get("run"), generated,
                generated.get("forward_given"))


#: The first item of a record the twin's forward leaves (the general record has its
#: CallState there).
_FAST: Any = object()


# (A reader's values are plain: no argument is a container, which the route would flatten.)


#: One module of a tree a reader reads, in `named_modules()` order: (its path, as a prefix of
#: its parameters' names, "" for the root; its class; its parameters' names; its
#: submodules' names).
TreeNode = tuple[str, type, tuple[str, ...], tuple[str, ...]]


def generate_reader(
    *, label: str, tree: tuple[TreeNode, ...], n_args: int, inplace_in_dict: bool,
    namespace: dict[str, Any],
) -> Callable[[Any, tuple[Any, ...], dict[str, Any]], tuple[Any, ...] | None]:
    """`read(module, args, kwargs)`: the values of a call, with `n_args` positional
    arguments, of a module whose tree is `tree` (each module of the class it names, with
    exactly those parameters, plain tensors each held once, and submodules, and no
    buffers); None for any other module or call (the caller then walks). What
    `parameters_of` and binding give, read from the modules' own dicts with the layout
    written out. `namespace` provides UninitializedParameter."""
    lines = [
        "def read(_go_module, _go_args, _go_kwargs):",
        f"    if _go_kwargs or _go_len(_go_args) != {n_args}"
        + (" or _go_module.__dict__.get('inplace', False) is True" if inplace_in_dict
           else " or _go_getattr(_go_module, 'inplace', False) is True") + ":",
        "        return None",
    ]
    var = {"": "_go_module"}
    space: dict[str, Any] = {}
    params: list[str] = []
    for j, (path, cls, names, children) in enumerate(tree):
        node = var[path]
        space[f"_go_T{j}"] = cls
        lines += [
            f"    if (_go_type({node}) is not _go_T{j} or _go_len({node}._modules) != "
            f"{len(children)} or {node}._buffers or _go_len({node}._parameters) != "
            f"{len(names)}):",
            "        return None",
        ]
        for k, child in enumerate(children):
            var[f"{path}{child}."] = f"_go_n{j}_{k}"
            lines.append(f"    _go_n{j}_{k} = {node}._modules.get({child!r})")
        for name in names:
            p = f"_go_p{len(params)}"
            params.append(p)
            lines.append(f"    {p} = {node}._parameters.get({name!r})")
    refuse = [f"{p} is None or _go_type({p}) is _go_UninitializedParameter" for p in params]
    refuse += [f"{a} is {b}" for i, a in enumerate(params) for b in params[i + 1 :]]
    refuse += [f"_go_isinstance(_go_args[{i}], _go_CONTAINERS)" for i in range(n_args)]
    lines += [
        f"    if {' or '.join(refuse) or 'False'}:",
        "        return None",
        f"    return {_tuple(['_go_module', *(f'_go_args[{i}]' for i in range(n_args)), *params])}",
    ]
    space.update({f"_go_{key}": value for key, value in namespace.items()})
    space.update(_go_len=len, _go_type=type, _go_getattr=getattr,
                 _go_isinstance=isinstance, _go_CONTAINERS=(tuple, list, dict))
    reader: Callable[[Any, tuple[Any, ...], dict[str, Any]], tuple[Any, ...] | None] = (
        compile_source("\n".join(lines) + "\n", f"{label} (reader)", space,
                       owner="read")["read"]
    )
    return reader


def _has_meta(i: int, module: ModuleTwin | None) -> bool:
    """Whether slot `i` has an `m` in the record (a module's slot 0 and its parameters do
    not: the module is no tensor, the parameters are held)."""
    return module is None or (i != 0 and i not in dict(module.params))


def _holds(slot: int, name: str) -> str:
    """Source: the module holds, as parameter `name`, the tensor its forward saw."""
    if "." in name:
        *path, leaf = name.split(".")
        return f"_go_parameter_at(_go_module, {tuple(path)!r}, {leaf!r}) is v{slot}"
    return f"_go_module._parameters.get({name!r}) is v{slot}"


def _results(names: tuple[str, ...], saved_slot: dict[int, int],
             module: ModuleTwin | None) -> str:
    """Source turning `_go_result` into the gradients `backward` returns."""
    n = len(names)
    param_slots = {} if module is None else dict(module.params)

    def meta(i: int) -> str:
        """Slot i's (shape, dtype, device), given it holds a differentiable tensor."""
        if i in param_slots:
            return f"(v{i}.shape, v{i}.dtype, v{i}.device)"
        if i in saved_slot:
            s = f"_go_s{saved_slot[i]}"
            return f"({s}.shape, {s}.dtype, {s}.device)"
        return f"_go_m{i}"

    def holds(i: int) -> str:
        """Source: whether slot i holds a differentiable tensor."""
        if module is not None and i == 0:
            return "False"
        if i in param_slots:  # (a parameter is a tensor)
            return f"(v{i}.requires_grad or v{i}.is_floating_point() or v{i}.is_complex())"
        return f"_go_m{i} is not None"

    def full_meta(i: int) -> str:
        """Slot i's meta entry as the route's general steps give it."""
        if module is not None and i == 0:
            return "None"
        return (
            f"(({meta(i)} if ctx.needs_input_grad[{i + 1}] else _go_SKIP) "
            f"if {holds(i)} else None)"
        )

    def mismatch(g: str, i: int) -> str:
        if i in param_slots or i in saved_slot:
            t = f"v{i}" if i in param_slots else f"_go_s{saved_slot[i]}"
            return (
                f"{g}.shape != {t}.shape or {g}.dtype is not {t}.dtype or "
                f"{_other_device(g, t)}"
            )
        m = f"_go_m{i}"
        return f"{g}.shape != {m}[0] or {g}.dtype is not {m}[1] or {g}.device != {m}[2]"

    def checked(g: str, i: int) -> list[str]:
        """Lines checking gradient `g` for slot i (None stays None); a gradient of the
        input's own shape, dtype and device passes as it is (autograd drops it where the
        input needs none), any other is for `check_gradient` to fix or report."""
        return [
            f"if {g} is not None:",
            f"    if not ({holds(i)}):",
            f"        {g} = _go_check_gradient({g}, None, _go_OP, {names[i]!r})",
            f"    elif not _go_isinstance({g}, _go_Tensor) or {mismatch(g, i)}:",
            f"        {g} = _go_check_gradient({g}, {meta(i)} if ctx.needs_input_grad"
            f"[{i + 1}] else _go_SKIP, _go_OP, {names[i]!r})",
        ]

    slots = list(range(1, n)) if module is not None else list(range(n))
    lines: list[str] = []
    gs = [f"_go_r{i}" for i in range(n)]
    # (A module op's backward gives one more value, for `forward_given`'s output: None where
    # an owning call does not pass it, autograd taking a trailing None beyond the inputs;
    # the upstream gradient where the rule owns some inputs only.)
    extra = [] if module is None else ["_go_g0"] if module.attach else ["None"]
    owned_inputs = () if module is None else module.owned_inputs
    if module is not None and not module.owned_params and 0 < len(owned_inputs) <= _UNROLL:
        # A lone tensor, for the one owned input holding a differentiable tensor (a module
        # owning no parameter; see `_module_result`): others take `flat_gradients`.
        lines.append("if _go_isinstance(_go_result, _go_Tensor):")
        for i in owned_inputs:
            others = " and ".join(f"_go_m{j} is None" for j in owned_inputs if j != i)
            ret = ["None"] * (n + 1) + extra
            ret[i + 1] = "_go_result"
            lines += [
                f"    if _go_m{i} is not None{' and ' + others if others else ''}:",
                *("        " + line for line in checked("_go_result", i)),
                f"        return {_tuple(ret)}",
            ]
    if module is None and n <= _UNROLL:
        # A lone tensor, for the one slot holding a differentiable tensor (first: the
        # commonest return of an op's rule).
        lines.append("if _go_isinstance(_go_result, _go_Tensor):")
        for i in range(n):
            others = " and ".join(f"_go_m{j} is None" for j in range(n) if j != i)
            ret = ["None"] * (n + 1)
            ret[i + 1] = "_go_result"
            lines += [
                f"    if _go_m{i} is not None{' and ' + others if others else ''}:",
                *("        " + line for line in checked("_go_result", i)),
                f"        return {_tuple(ret)}",
            ]
    # A dict naming every slot.
    lines += [
        f"if _go_type(_go_result) is _go_dict and _go_len(_go_result) == {len(slots)}:",
        "    try:",
        *(f"        {gs[i]} = _go_result[{names[i]!r}]" for i in slots),
        "    except _go_KeyError:",
        "        pass",
        "    else:",
    ]
    for i in slots:
        lines += ["        " + line for line in checked(gs[i], i)]
    out = ["None" if module is not None and i == 0 else gs[i] for i in range(n)]
    lines.append(f"        return {_tuple(['None', *out, *extra])}")
    if module is None:
        # A tuple with one entry per slot.
        lines += [
            f"if _go_type(_go_result) is _go_tuple and _go_len(_go_result) == {n}:",
            f"    {_tuple(gs)} = _go_result",
        ]
        for i in range(n):
            lines += ["    " + line for line in checked(gs[i], i)]
        lines.append(f"    return {_tuple(['None', *gs])}")
    metas = _tuple([full_meta(i) for i in range(n)])
    lines.append(
        "return (None, *_go_flat_gradients(_go_result, op=_go_OP, names=_go_NAMES, "
        f"owned=_go_OWNED, layout=None, meta={metas}, module=_go_FORM)"
        f"{''.join(', ' + e for e in extra)})"
    )
    return "".join(f"    {line}\n" for line in lines)


# Up to this many slots the lone-tensor return is matched by written-out conditions; beyond
# it `flat_gradients` does it (still correct, a little slower).
_UNROLL = 6
