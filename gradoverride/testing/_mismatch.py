"""`gradient_report`: per override in a model, how far the gradient it produces is from a
reference gradient at the same place (the "gradient mismatch" of straight-through and
surrogate-gradient papers)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn

from .._errors import GradOverrideError, GradOverrideTypeError
from ..diagnostics._recorder import Site, model_paths
from ._mismatch_report import GradientReport, MismatchRow
from ._mismatch_runs import (
    CallRecord,
    Op,
    Position,
    Runner,
    SiteRecord,
    differentiated,
    output_shapes,
    read,
    replaced,
)
from ._proxies import Proxy, builtin_proxy, is_override_object, lookup, user_proxy

__all__ = ["REFERENCES", "Reference", "gradient_report"]

F64 = torch.float64

_SAMPLES = 32  # directions per override, by default

#: The references `gradient_report` computes itself.
REFERENCES = ("proxy", "finite_differences", "spsa")

#: What `gradient_report(reference=...)` accepts: one of `REFERENCES`, or the expected
#: gradients by override label.
Reference: TypeAlias = Literal["proxy", "finite_differences", "spsa"] | Mapping[str, Tensor]


def gradient_report(
    model: nn.Module,
    loss_fn: Callable[..., Tensor],
    batch: Any,
    *,
    reference: Reference = "proxy",
    proxies: Mapping[str, Callable[..., Any] | None] | None = None,
    samples: int | None = None,
    step: float | None = None,
    seed: int = 0,
) -> GradientReport:
    """Per override in `model`, how far its gradient is from a reference: the cosine
    similarity and the norm ratio, the "gradient mismatch" that straight-through and
    surrogate-gradient papers measure by hand.

    ```python
    import torch
    from torch import nn
    from gradoverride import recipes
    from gradoverride.testing import gradient_report

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), recipes.binarize().module(), nn.Linear(8, 1))
    batch = (torch.randn(16, 4), torch.randn(16, 1))
    report = gradient_report(model, nn.functional.mse_loss, batch)  # against clamp(x, -1, 1)
    row = report["1"]
    print(row.label, row.reference)
    #> 1: binarize(clip=1.0, inclusive=True, keep='input') clamp(x, -1, 1)
    print(f"cosine {row.cosine:.3f}, norm ratio {row.norm_ratio:.3f}")
    #> cosine 0.931, norm ratio 1.001
    ```

    The loss is `loss_fn(model(inputs), *targets)` for a batch `(inputs, *targets)` (a
    tuple or list: `(x, y)`, as a training loop unpacks it); `inputs` may be a tuple (the
    model's positional inputs) or a dict (its keyword inputs). A batch that is not a tuple
    or list is the model's one input, and the loss `loss_fn(model(batch))`. `loss_fn`
    returns a scalar tensor (`nn.CrossEntropyLoss()`, `nn.functional.mse_loss`, or
    `lambda out: out.sum()`).

    The override's gradient, for each override the forward calls (a recipe, a
    `custom_backward` / `straight_through` op, a `go.Module` or `override_backward`
    module), is the gradient of the loss at its input as training gets it: the gradient it
    returned for its input, through the rules of the overrides after it. Its input is the
    first floating-point tensor the call takes, and every other one that requires grad
    (for a module's rule: its inputs, not its parameters); an override called several
    times in the forward (a neuron at each time step) is one row, over all its calls.
    Because the gradient at an override passes through the overrides after it (closer to
    the loss), a row measures what reaches that place, the later overrides' mismatch
    included. A `grad_hook` is listed but not compared: it changes gradients only, with no
    forward of its own to replace or input to perturb.

    References:

    * `"proxy"` (the default): the true gradient of the same loss at the same place in
      the model where every override with a proxy runs the proxy instead, forward and
      backward by autograd. A proxy is the function whose derivative the rule stands
      for: a spike's `spike.proxy` (the smooth step whose derivative is the surrogate);
      clamp to a straight-through window (`clamp(x, -c, c)` for `binarize(clip=c)`,
      `ste_clamp` and `quantize` to theirs, each end counted in as the recipe counts it);
      `x` for a plain straight-through pass (`ste_round`, `ste_sign`, `ternarize`, ...);
      `softmax(x / T)` for `ste_argmax`, at its temperature; `abs(x)` for
      `abs_subgradient`. A gradient transform (`reverse_grad`, `scale_grad`, ...) has its
      forward, `x`, as proxy, so its row shows how far it moves the true gradient. A
      `Recipe` subclass of yours with a `proxy(x)` method has that one. `proxies={key: fn}`
      gives or replaces one: `fn` takes the override's input(s) and returns what the
      override returns; `key` is a row's label, a name (every override of that name) or a
      module path; `None` leaves an override out. An override with no proxy (`lsq`,
      `gumbel_softmax`, the solvers, your own ops and modules) keeps running as itself,
      and its row says it was not compared.
    * `"finite_differences"`: the true loss's derivatives along `samples` coordinates of
      each override's input (drawn at random, all of them when there are fewer), by central
      differences `(L(x + h e) - L(x - h e)) / 2h` of the model's real forward (each
      override's own forward is the true function). Compared with the override's gradient
      at the same coordinates.
    * `"spsa"`: the same along `samples` random ±1 directions `d` over all of the input's
      elements at once (simultaneous perturbation), compared with `gradient . d`.
    * a dict `{label: gradient}`: the gradients you expect at those overrides' inputs, in
      the shape of the input (`(calls, *shape)` for an override called several times;
      flat for several inputs). Overrides left out are not compared.

    A straight-through forward is piecewise constant: its true loss does not change along
    most small steps, so finite differences and SPSA give a zero or spiky reference there
    (the row's note says so). They are meant for smooth parts of a model and for checking
    that a rule is the exact derivative; compare a straight-through or surrogate rule
    with its proxy.

    Reproducible: every forward starts from the random state `seed` gives (dropout draws
    the same mask in each) and from the model's state as it was, which is put back
    afterwards: its buffers (the batch-norm statistics do not move) and what its modules
    keep in plain attributes (a neuron's membrane `self.v`, None until its first call, or a
    dict of them); the directions are drawn from `seed` too. Randomness not drawn from
    torch's generators (numpy's, Python's `random`) differs from run to run: the rows
    then include it. Gradients are computed with `torch.autograd.grad`: no parameter's `.grad`
    changes. The model runs in its current mode (`train()` or `eval()`), eagerly (not a
    `torch.compile`d module). Finite differences and SPSA are as accurate as the loss's
    dtype allows: in float32 the relative error is about 1e-7 / step; use a float64 model
    and batch for tight checks.

    Cost: `"proxy"`, 2 forwards and 2 backward passes; a dict, 1 and 1;
    `"finite_differences"` and `"spsa"`, 1 forward and backward plus `2 * samples`
    forwards per override (fewer for finite differences on an input with fewer elements),
    none of them followed by a backward. `report.forwards` and `report.backwards` say what
    was run.

    Args:
        model: the `nn.Module` whose forward runs the overrides.
        loss_fn: `loss_fn(output, *targets)`, a scalar tensor.
        batch: `(inputs, *targets)`, or the model's single input.
        reference: `"proxy"`, `"finite_differences"`, `"spsa"`, or `{label: gradient}`.
        proxies: with `reference="proxy"`, proxies by label, name or module path, or by
            the recipe or op itself (a recipe matches the recipes of its settings); None
            leaves that override out.
        samples: with finite differences or SPSA, the directions per override (default 32);
            refused with the other references, which it does not apply to.
        step: the finite-difference step h, in the input's units (default: the cube root
            of the input dtype's machine epsilon: 4.9e-3 for float32, 6.1e-6 for float64);
            with finite differences or SPSA only.
        seed: seeds the random state of every forward and the directions.

    Returns:
        A `GradientReport`: `print(report)` shows the table; `report.rows` (or
        `report[label]`) has each override's `MismatchRow` (cosine, norm ratio, the
        vectors compared).

    Raises:
        GradOverrideError: an unknown `reference`, a given gradient for no override or of
            the wrong shape, a proxy returning the wrong shape, a loss that is not a
            scalar, or a forward whose override calls change from run to run.
    """
    mode = _check_reference(reference)
    _check_arguments(model, loss_fn, mode, proxies, samples, step, seed)
    runner = Runner(model, _loss_call(model, loss_fn, batch), seed, batch)
    with runner.active():
        found = _override_run(runner)
        labels = _labels(found.records)
        if mode == "proxy":
            rows = _against_proxies(runner, found, labels, proxies or {})
            description = "their proxies"
        elif mode == "given":
            assert isinstance(reference, Mapping)
            rows = _against_given(found, labels, reference)
            description = "the given gradients"
        else:
            rows = _against_directions(runner, found, labels, mode,
                                       _SAMPLES if samples is None else samples, step, seed)
            description = ("finite differences of the true loss" if mode == "finite_differences"
                           else "SPSA directional derivatives of the true loss")
    rows += _hook_rows(model)
    order = {path: k for k, path in enumerate(model_paths(model).values())}
    rows.sort(key=lambda pair: (order.get(pair[0][0], len(order)), pair[0][1]))
    return GradientReport(type(model).__name__, mode, description, [r for _, r in rows],
                          found.loss, runner.forwards, runner.backwards)


# ---- checking what was passed ----------------------------------------------------------------


def _check_reference(reference: object) -> str:
    if isinstance(reference, str):
        if reference not in REFERENCES:
            msg = (
                f"gradient_report: unknown reference={reference!r}; the references are "
                f"{', '.join(repr(r) for r in REFERENCES)}, or a dict {{label: gradient}} of "
                "the gradients you expect at those overrides' inputs."
            )
            raise GradOverrideError(msg)
        return reference
    if isinstance(reference, Mapping):
        for key, value in reference.items():
            if not isinstance(key, str) or not isinstance(value, Tensor):
                msg = (
                    "gradient_report: reference= as a dict maps override labels (str) to "
                    f"gradient tensors; got {type(key).__name__} {key!r} -> "
                    f"{type(value).__name__}."
                )
                raise GradOverrideTypeError(msg)
        return "given"
    msg = (
        f"gradient_report: reference= must be one of {', '.join(repr(r) for r in REFERENCES)} "
        f"or a dict {{label: gradient}}; got {type(reference).__name__} {reference!r:.60}."
    )
    raise GradOverrideTypeError(msg)


def _check_arguments(model: object, loss_fn: object, mode: str, proxies: object,
                     samples: object, step: object, seed: object) -> None:
    if not isinstance(model, nn.Module):
        msg = (
            f"gradient_report needs the model as an nn.Module; got {type(model).__name__} "
            f"{model!r:.60}. Pass the module whose forward runs the overrides."
        )
        raise GradOverrideTypeError(msg)
    if hasattr(model, "_orig_mod"):
        msg = (
            f"gradient_report runs the model eagerly; got the torch.compile'd "
            f"{type(model._orig_mod).__name__}. Pass the module itself: `model._orig_mod`."
        )
        raise GradOverrideError(msg)
    _refuse_compiled_parts(model)
    if not callable(loss_fn):
        msg = (
            f"gradient_report: `loss_fn` must be callable as loss_fn(output, *targets); got "
            f"{type(loss_fn).__name__} {loss_fn!r:.60}."
        )
        raise GradOverrideTypeError(msg)
    if proxies is not None:
        if mode != "proxy":
            msg = (
                f"gradient_report: `proxies=` applies to reference='proxy'; the reference "
                f"here is {mode!r}. Drop `proxies=`, or pass reference='proxy'."
            )
            raise GradOverrideError(msg)
        if not isinstance(proxies, Mapping) or not all(
            (isinstance(k, str) or is_override_object(k)) and (v is None or callable(v))
            for k, v in proxies.items()
        ):
            msg = (
                "gradient_report: `proxies` maps overrides (a label, name or module path, or "
                "the recipe or op itself) to functions of the override's input(s), or None; "
                f"got {proxies!r:.80}."
            )
            raise GradOverrideTypeError(msg)
    directional = mode in ("finite_differences", "spsa")
    for name, value in (("samples", samples), ("step", step)):
        if value is not None and not directional:
            msg = (
                f"gradient_report: `{name}=` applies to reference='finite_differences' or "
                f"'spsa'; the reference here is {mode!r}. Drop `{name}=`, or pass one of those."
            )
            raise GradOverrideError(msg)
    if samples is not None and (
        isinstance(samples, bool) or not isinstance(samples, int) or samples < 1
    ):
        msg = f"gradient_report: `samples` must be a positive integer; got {samples!r}."
        raise GradOverrideError(msg)
    if step is not None and (
        isinstance(step, bool) or not isinstance(step, int | float) or not math.isfinite(step)
        or step <= 0
    ):
        msg = f"gradient_report: `step` must be a positive finite number or None; got {step!r}."
        raise GradOverrideError(msg)
    if isinstance(seed, bool) or not isinstance(seed, int):
        msg = f"gradient_report: `seed` must be an integer; got {type(seed).__name__} {seed!r}."
        raise GradOverrideTypeError(msg)
    if not -(2**63) <= seed < 2**64:  # what torch's generators take
        msg = f"gradient_report: `seed` must be in [-2**63, 2**64); got {seed!r}."
        raise GradOverrideError(msg)


def _refuse_compiled_parts(model: nn.Module) -> None:
    """A compiled module inside the model (`torch.compile(child)`, `module.compile()`) runs
    its overrides inside compiled code, where the report cannot replace or probe them: its
    rows would be missing, silently."""
    for path, module in model.named_modules():
        compiled = hasattr(module, "_orig_mod") or getattr(
            module, "_compiled_call_impl", None) is not None
        if compiled:
            where = f"`{path}`" if path else "the model itself"
            msg = (
                f"gradient_report runs the model eagerly, but {where} "
                f"({type(module).__name__}) is torch.compile'd (`torch.compile(module)` or "
                "`module.compile()`): the overrides inside it would not be seen. Pass an "
                "uncompiled copy of the model."
            )
            raise GradOverrideError(msg)


def _loss_call(model: nn.Module, loss_fn: Callable[..., Any], batch: Any) -> Callable[[], Any]:
    """loss_fn(model(inputs), *targets) for a batch (inputs, *targets), else
    loss_fn(model(batch))."""
    if isinstance(batch, tuple | list):
        if not batch:
            msg = (
                "gradient_report: `batch` is empty; pass (inputs, *targets), such as (x, y), "
                "or the model's single input."
            )
            raise GradOverrideError(msg)
        inputs, targets = batch[0], tuple(batch[1:])
    else:
        inputs, targets = batch, ()

    def loss_of() -> Any:
        if isinstance(inputs, tuple | list):
            output = model(*inputs)
        elif isinstance(inputs, Mapping):
            output = model(**inputs)
        else:
            output = model(inputs)
        return loss_fn(output, *targets)

    return loss_of


def _check_loss(loss: object) -> Tensor:
    if isinstance(loss, Tensor) and loss.is_floating_point() and loss.numel() == 1:
        return loss
    got = (f"a {loss.dtype} tensor of shape {tuple(loss.shape)}" if isinstance(loss, Tensor)
           else f"{type(loss).__name__} {loss!r:.60}")
    msg = (
        f"gradient_report: `loss_fn` must return the loss as a scalar floating-point tensor; "
        f"got {got}. Reduce it (`.mean()`, or a loss with reduction='mean')."
    )
    raise GradOverrideError(msg)


# ---- the override run ------------------------------------------------------------------------


class _Found:
    """What the override run found: each override's calls and its gradient."""

    def __init__(self) -> None:
        self.records: dict[Site, SiteRecord] = {}
        self.gradients: dict[Site, Tensor] = {}  # flat, float64
        self.loss = math.nan


def _probed(args: tuple[Any, ...], kwargs: dict[str, Any], positions: tuple[Position, ...]
            ) -> tuple[tuple[Any, ...], dict[str, Any], list[Tensor], list[Tensor]]:
    """The call with each input at `positions` plus a probe: (args, kwargs, inputs, probes)."""
    probes, values = [], {}
    for where in positions:
        x = read(args, kwargs, where)
        probe = torch.full_like(x, -0.0, requires_grad=True)  # x + (-0.0) is x exactly
        probes.append(probe)
        values[where] = x + probe
    new_args, new_kwargs = replaced(args, kwargs, values)
    return new_args, new_kwargs, [values[w] for w in positions], probes


def _probe_gradients(runner: Runner, loss: Tensor,
                     calls: Mapping[Site, list[list[Tensor]]]) -> dict[Site, Tensor]:
    """Each site's gradient, flat in float64: the loss's gradient at its probes."""
    probes = [p for site in calls for call in calls[site] for p in call]
    grads: tuple[Tensor | None, ...] = (None,) * len(probes)
    if probes and loss.requires_grad:
        grads = torch.autograd.grad(loss, probes, allow_unused=True)
        runner.backwards += 1
    out: dict[Site, Tensor] = {}
    k = 0
    for site in calls:
        parts = []
        for call in calls[site]:
            for probe in call:
                grad = grads[k]
                k += 1
                parts.append((torch.zeros_like(probe) if grad is None else grad).reshape(-1))
        out[site] = torch.cat(parts).double() if parts else torch.zeros(0, dtype=torch.float64)
    return out


def _override_run(runner: Runner) -> _Found:
    found = _Found()
    probes: dict[Site, list[list[Tensor]]] = {}

    def substitute(site: Site, op: Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        record = found.records.get(site)
        if record is None:
            record = found.records[site] = SiteRecord(site)
            probes[site] = []
        positions = differentiated(site, args, kwargs)
        if isinstance(positions, str):
            record.problem = positions
            out = runner.call(op, *args, **kwargs)
            record.calls.append(CallRecord((), (), (), output_shapes(out)))
            return out
        new_args, new_kwargs, inputs, call_probes = _probed(args, kwargs, positions)
        out = runner.call(op, *new_args, **new_kwargs)
        record.calls.append(CallRecord(positions, tuple(x.shape for x in inputs),
                                       tuple(x.dtype for x in inputs), output_shapes(out)))
        probes[site].append(call_probes)
        return out

    loss = _check_loss(runner.loss(substitute))
    found.loss = float(loss.detach())
    usable = {k: p for k, p in probes.items() if found.records[k].problem is None}
    found.gradients = _probe_gradients(runner, loss, usable)
    return found


def _labels(records: Mapping[Site, SiteRecord]) -> dict[Site, str]:
    """Each site's label; a label two sites share gets `#2`, `#3` after the first."""
    labels: dict[Site, str] = {}
    seen: dict[str, int] = {}
    for site, record in records.items():
        label = record.site.label
        count = seen[label] = seen.get(label, 0) + 1
        labels[site] = label if count == 1 else f"{label} #{count}"
    return labels


# ---- rows ------------------------------------------------------------------------------------

_Row = tuple[tuple[str, int], MismatchRow]  # (where it sorts, the row)


def _row(record: SiteRecord, label: str, *, reference: str = "-", note: str = "",
         got: Tensor | None = None, expected: Tensor | None = None) -> _Row:
    site = record.site
    cosine = ratio = got_norm = expected_norm = None
    if got is not None and expected is not None:
        got_norm, expected_norm = float(got.norm()), float(expected.norm())
        if got_norm == 0 or expected_norm == 0:
            cosine = math.nan
            ratio = math.nan if got_norm == expected_norm else math.inf if expected_norm == 0 \
                else 0.0
        else:
            cosine = float(torch.dot(got, expected)) / (got_norm * expected_norm)
            ratio = got_norm / expected_norm
        if not note:
            note = _zero_note(got_norm, expected_norm)
    row = MismatchRow(label, site.kind, len(record.calls), record.elements, reference, cosine,
                      ratio, got_norm, expected_norm, note, got, expected)
    return (site.path, site.index), row


def _zero_note(got_norm: float, expected_norm: float) -> str:
    if got_norm == 0 and expected_norm == 0:
        return "no gradient reached it, nor the reference"
    if got_norm == 0:
        return "no gradient reached it"
    if expected_norm == 0:
        return "the reference is zero"
    return ""


def _comparable(found: _Found, labels: Mapping[Site, str],
                rows: list[_Row]) -> Iterator[tuple[Site, SiteRecord, str]]:
    """Each site found, with its record and label, for a reference to compare; a site that
    cannot be compared gets its "not compared" row in `rows` instead."""
    for site, record in found.records.items():
        label = labels[site]
        if record.problem is not None:
            rows.append(_row(record, label, note=f"not compared: {record.problem}"))
        else:
            yield site, record, label


def _hook_rows(model: nn.Module) -> list[_Row]:
    """A row for each grad_hook: it changes gradients only (no forward of its own to
    replace, no input of its own to perturb), so it is listed, not compared."""
    from ..diagnostics._inventory import _hook_records

    rows: list[_Row] = []
    for path, module in model.named_modules():
        for k, hook in enumerate(_hook_records(path, module)):
            label = f"{path or '(model)'}: grad_hook({hook.name}) {hook.settings}"
            row = MismatchRow(
                label, "grad_hook", 0, 0, "-", None, None, None, None,
                "not compared: a grad_hook changes gradients only; call its transform in the "
                "forward (`recipe(x)`) to compare it", None, None,
            )
            rows.append(((path, -1 - k), row))
    return rows


# ---- against proxies -------------------------------------------------------------------------


def _against_proxies(runner: Runner, found: _Found, labels: Mapping[Site, str],
                     proxies: Mapping[str, Callable[..., Any] | None]) -> list[_Row]:
    _refuse_unknown_keys("proxies", proxies, found.records, labels)
    chosen: dict[Site, Proxy | str] = {}  # a string: why it has none
    calls: dict[Site, list[list[Tensor]]] = {}

    def choose(site: Site, args: tuple[Any, ...]) -> Proxy | str:
        choice = chosen.get(site)
        if choice is None:
            given, fn = lookup(proxies, site, labels[site])
            if given:
                choice = "left out by proxies=" if fn is None else user_proxy(fn)
            else:
                choice = builtin_proxy(site, args) or (
                    "no proxy declared; pass one: proxies={label: fn}")
            chosen[site] = choice
        return choice

    def substitute(site: Site, op: Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        record = found.records.get(site)
        positions = differentiated(site, args, kwargs)
        if record is None or record.problem is not None or isinstance(positions, str):
            return runner.call(op, *args, **kwargs)
        new_args, new_kwargs, inputs, call_probes = _probed(args, kwargs, positions)
        made = calls.setdefault(site, [])
        made.append(call_probes)
        proxy = choose(site, args)
        if isinstance(proxy, str):
            return runner.call(op, *new_args, **new_kwargs)
        try:
            out = runner.call(proxy.call, inputs, new_args)
        except Exception as error:
            error.add_note(f"(raised by the proxy `{proxy.description}` of `{labels[site]}`, "
                           "called by gradient_report)")
            raise
        if len(made) <= len(record.calls):
            _check_proxy_output(proxy, labels[site], out, record.calls[len(made) - 1])
        return out

    loss = _check_loss(runner.loss(substitute))
    usable = {k: c for k, c in calls.items() if not isinstance(chosen.get(k), str)}
    references = _probe_gradients(runner, loss, usable)

    rows: list[_Row] = []
    for site, record, label in _comparable(found, labels, rows):
        choice = chosen.get(site, "the model with proxies did not call it")
        made = [tuple(t.shape) for call in calls.get(site, []) for t in call]
        if isinstance(choice, str):
            rows.append(_row(record, label, note=f"not compared: {choice}"))
        elif made != [tuple(s) for call in record.calls for s in call.shapes]:
            rows.append(_row(record, label, note=(
                f"not compared: with proxies the model called it {len(calls.get(site, []))} "
                f"times, or with inputs of other shapes, than its {len(record.calls)} calls")))
        else:
            rows.append(_row(record, label, reference=choice.description,
                             got=found.gradients[site], expected=references[site]))
    return rows


def _check_proxy_output(proxy: Proxy, label: str, out: Any, call: CallRecord) -> None:
    got = output_shapes(out)
    if got != call.outputs:
        msg = (
            f"gradient_report: the proxy `{proxy.description}` of `{label}` returned "
            f"{_shapes(got)}, but the override returned {_shapes(call.outputs)}; a proxy "
            "takes the override's input(s) and returns what the override returns, in the "
            "same shapes."
        )
        raise GradOverrideError(msg)


def _shapes(shapes: tuple[torch.Size, ...]) -> str:
    if not shapes:
        return "no tensor"
    if len(shapes) == 1:
        return f"a tensor of shape {tuple(shapes[0])}"
    return f"tensors of shapes {[tuple(s) for s in shapes]}"


def _refuse_unknown_keys(argument: str, table: Mapping[str, Any],
                         records: Mapping[Site, SiteRecord], labels: Mapping[Site, str],
                         *, single: bool = False) -> None:
    """Every key must name an override the forward called (exactly one, if `single`)."""
    for name in table:
        matches = [k for k, r in records.items() if lookup({name: None}, r.site, labels[k])[0]]
        if matches and not (single and len(matches) > 1):
            continue
        if matches:
            msg = (
                f"gradient_report: {argument} key {name!r} names {len(matches)} overrides "
                f"({', '.join(repr(labels[k]) for k in matches)}); use one's full label."
            )
        else:
            listed = ", ".join(repr(label) for label in labels.values()) or (
                "none (no override ran)")
            msg = (
                f"gradient_report: {argument} names {name!r}, which is no override the "
                f"forward called; the overrides are {listed} (a label, a name or a module "
                "path)."
            )
        raise GradOverrideError(msg)


# ---- against given gradients -----------------------------------------------------------------


def gradient_shape(record: SiteRecord) -> tuple[int, ...]:
    """The shape of an override's gradient as a given reference must have it: its input's
    shape; (calls, *shape) for one input per call, all of one shape; else flat."""
    shapes = [s for call in record.calls for s in call.shapes]
    if len(shapes) == 1:
        return tuple(shapes[0])
    if all(len(call.shapes) == 1 for call in record.calls) and len(set(shapes)) == 1:
        return (len(record.calls), *shapes[0])
    return (record.elements,)


def _against_given(found: _Found, labels: Mapping[Site, str],
                   given: Mapping[str, Tensor]) -> list[_Row]:
    _refuse_unknown_keys("reference", given, found.records, labels, single=True)
    rows: list[_Row] = []
    for site, record, label in _comparable(found, labels, rows):
        present, expected = lookup(given, record.site, label)
        if not present:
            rows.append(_row(record, label, note="not compared: no gradient given"))
            continue
        shape = gradient_shape(record)
        if tuple(expected.shape) != shape:
            msg = (
                f"gradient_report: the given gradient for `{label}` has shape "
                f"{tuple(expected.shape)}, but the gradient at its input has shape {shape} "
                f"({_how_shaped(record)}); give the expected gradient in that shape."
            )
            raise GradOverrideError(msg)
        if not expected.is_floating_point():
            msg = (
                f"gradient_report: the given gradient for `{label}` must be a floating-point "
                f"tensor; got a {expected.dtype} tensor."
            )
            raise GradOverrideTypeError(msg)
        gradient = found.gradients[site]
        rows.append(_row(record, label, reference="given", got=gradient,
                         expected=expected.detach().reshape(-1).to(gradient.device, F64)))
    return rows


def _how_shaped(record: SiteRecord) -> str:
    calls = len(record.calls)
    inputs = sum(len(call.shapes) for call in record.calls)
    if inputs == 1:
        return "its input's shape"
    if inputs == calls:
        return f"its {calls} calls' inputs, stacked"
    return f"its {inputs} inputs over {calls} calls, flattened and concatenated"


# ---- against finite differences and SPSA -----------------------------------------------------


def _against_directions(runner: Runner, found: _Found, labels: Mapping[Site, str],
                        mode: str, samples: int, step: float | None, seed: int) -> list[_Row]:
    generator = torch.Generator().manual_seed(seed)
    rows: list[_Row] = []
    for site, record, label in _comparable(found, labels, rows):
        gradient = found.gradients[site]
        n = record.elements
        h = step if step is not None else _default_step(record)
        directions: list[Tensor]
        if mode == "finite_differences":
            count = min(samples, n)
            chosen = torch.randperm(n, generator=generator)[:count].sort().values
            directions = [_one_hot(n, int(i)) for i in chosen]
            reference = f"{count} coordinate{'s' if count != 1 else ''}"
            got = gradient[chosen.to(gradient.device)]
        else:
            count = samples
            signs = torch.randint(0, 2, (count, n), generator=generator).to(F64) * 2 - 1
            directions = list(signs)
            reference = f"{count} ±1 direction{'s' if count != 1 else ''}"
            got = signs.to(gradient.device) @ gradient
        derivatives = [_directional(runner, record, label, d, h) for d in directions]
        expected = torch.tensor(derivatives, dtype=F64, device=gradient.device)
        note = ""
        if float(expected.abs().max()) == 0:
            note = (f"the true loss did not change along these steps of {h:.2g} (a "
                    "piecewise-constant forward?)")
        rows.append(_row(record, label, reference=f"{reference}, step {h:.2g}", note=note,
                         got=got, expected=expected))
    return rows


def _default_step(record: SiteRecord) -> float:
    """The cube root of the machine epsilon of the site's (first) input dtype: where
    central differences balance truncation against rounding."""
    return math.pow(torch.finfo(record.dtypes[0]).eps, 1 / 3)


def _one_hot(n: int, i: int) -> Tensor:
    d = torch.zeros(n, dtype=F64)
    d[i] = 1
    return d


def _directional(runner: Runner, record: SiteRecord, label: str, direction: Tensor,
                 h: float) -> float:
    """(L(x + h d) - L(x - h d)) / 2h, the true loss's derivative along d at the site's
    inputs (every call's), by two forwards of the model (no backward)."""
    values = []
    for sign in (1.0, -1.0):
        perturbed = _Perturbed(runner, record, label, direction * (sign * h))
        loss = _check_loss(runner.loss(perturbed))
        perturbed.finish()
        values.append(float(loss.detach()))
    return (values[0] - values[1]) / (2 * h)


class _Perturbed:
    """A substitute adding `delta` (flat over the site's calls and inputs) to the inputs of
    one site, and running every override as it is."""

    def __init__(self, runner: Runner, record: SiteRecord, label: str, delta: Tensor) -> None:
        self.runner, self.record, self.label = runner, record, label
        self.delta = delta
        self.calls = 0

    def __call__(self, site: Site, op: Op, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        runner, record = self.runner, self.record
        if site is not record.site:
            return runner.call(op, *args, **kwargs)
        j = self.calls
        self.calls += 1
        if j >= len(record.calls):
            raise GradOverrideError(_unstable(
                f"the forward called `{self.label}` {len(record.calls)} time(s) in its first "
                "run and more in a perturbed run"))
        call = record.calls[j]
        start = sum(s.numel() for c in record.calls[:j] for s in c.shapes)
        values = {}
        for where, shape in zip(call.positions, call.shapes, strict=True):
            x = read(args, kwargs, where) if _present(args, kwargs, where) else None
            if not isinstance(x, Tensor) or x.shape != shape:
                raise GradOverrideError(_unstable(
                    f"call {j + 1} of `{self.label}` took inputs of other shapes in a "
                    "perturbed run than in the first"))
            piece = self.delta[start:start + shape.numel()].view(shape)
            start += shape.numel()
            values[where] = x + piece.to(device=x.device, dtype=x.dtype)
        new_args, new_kwargs = replaced(args, kwargs, values)
        return runner.call(op, *new_args, **new_kwargs)

    def finish(self) -> None:
        """A forward that called the site fewer times than the first cannot be compared."""
        if self.calls != len(self.record.calls):
            raise GradOverrideError(_unstable(
                f"the forward called `{self.label}` {len(self.record.calls)} time(s) in its "
                f"first run and {self.calls} in a perturbed run"))


def _present(args: tuple[Any, ...], kwargs: Mapping[str, Any], where: Position) -> bool:
    return where < len(args) if isinstance(where, int) else where in kwargs


def _unstable(what: str) -> str:
    return (
        f"gradient_report: {what}; finite differences and SPSA need a forward whose "
        "override calls do not change with a small step of their input (compare with "
        "reference='proxy' instead)."
    )
