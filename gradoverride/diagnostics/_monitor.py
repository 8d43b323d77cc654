"""`go.monitor`: per override and per step, the gradients each override got and gave back."""

from __future__ import annotations

import math
import re
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from matplotlib.figure import Figure

from .._errors import GradOverrideError, GradOverrideTypeError
from .._internals import is_grad_scaler, loss_scale_value
from .._table import format_table
from ._recorder import Gradients, Recorder, Site
from ._statistics import GradientStatistics

__all__ = ["Monitor", "MonitorSummary", "StepRecord", "SummaryRow", "monitor"]

@dataclass(frozen=True)
class StepRecord:
    """What one override got and gave back in one recorded step, over all its calls.

    Attributes:
        step: the step: the index of the backward pass under the monitor (0 for the first
            one that reached an override of the model).
        calls: how many times the override ran backward in the step.
        grad_in: the norm of the gradient arriving at the override (at its outputs), over
            all its calls (the square root of the sum of squares).
        grad_out: the norm of the gradient it returned, for its inputs and (a module's
            rule) its parameters.
        zeroed: of the elements whose arriving gradient was not zero, the fraction the
            override returned as exactly zero (a window or clip at work), pairing the
            gradient at its one output with each returned gradient of that shape; None for
            several outputs, or when no returned gradient has the output's shape.
        nan_in, inf_in: NaN and infinite elements in the arriving gradients.
        nan_out, inf_out: NaN and infinite elements in the returned gradients.
    """

    step: int
    calls: int
    grad_in: float
    grad_out: float
    zeroed: float | None
    nan_in: int
    inf_in: int
    nan_out: int
    inf_out: int


class Monitor:
    """Made by `go.monitor`; see there. Use as a context manager."""

    def __init__(self, model: nn.Module, every: int, max_steps: int | None = None,
                 scaler: Any = None) -> None:
        self._model = model
        self._scaler = scaler
        self._every = every
        self._max_steps = max_steps
        self._recorder = Recorder(model, self._take, every=every,
                                  purpose=f"go.monitor of {type(model).__name__}")
        # Per override: its records (the last `max_steps`), and running totals over every
        # recorded step for the summary.
        self._records: dict[Site, deque[StepRecord]] = {}
        self._totals: dict[Site, _Totals] = {}
        self._last_step = -1
        self._labels: dict[Site, str] = {}  # see `_labelled`, kept while no override is new
        self._keys: dict[Site, str] = {}  # see `scalars`
        self._statistics = GradientStatistics()
        # Two threads' passes end at once: one reduction at a time (the statistics keep
        # scratch buffers), and records in step order.
        self._taking = threading.Lock()
        self._entered = False

    def __enter__(self) -> Monitor:
        if self._entered:
            msg = (
                f"this monitor of {type(self._model).__name__} is already in use; a monitor "
                "is entered once. Make a new one with `go.monitor(model)`."
            )
            raise GradOverrideError(msg)
        for other in _ACTIVE:
            if other._model is self._model:
                msg = (
                    f"{type(self._model).__name__} already has an active go.monitor; leave "
                    "it before starting another on the same model."
                )
                raise GradOverrideError(msg)
        self._recorder.start()
        self._entered = True
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._recorder.stop()
        self._statistics.release()
        _ACTIVE.remove(self)

    @property
    def recording(self) -> bool:
        """Whether the monitor records now (inside its `with` block)."""
        return self._recorder.started

    @property
    def steps(self) -> int:
        """How many steps ran under the monitor: backward passes that reached an override
        of the model."""
        return self._recorder.passes

    # -- recording ------------------------------------------------------------------------

    def _take(self, groups: dict[tuple[Site, int], Gradients]) -> None:
        # Under a GradScaler every gradient of the pass is the true one times its scale
        # (read now, at the pass's end: `scaler.update()` comes after the optimizer step).
        scale = 1.0 if self._scaler is None else loss_scale_value(self._scaler)
        with self._taking:
            for (site, step), numbers in self._statistics(groups).items():
                record = _record(step, numbers, scale)
                records = self._records.get(site)
                if records is None:
                    records = self._records[site] = deque(maxlen=self._max_steps)
                    self._totals[site] = _Totals()
                _insert(records, record)
                self._totals[site].add(record)
                self._last_step = max(self._last_step, step)

    # -- reading ---------------------------------------------------------------------------

    @property
    def history(self) -> dict[str, list[StepRecord]]:
        """Per override (by its label, `path: name`), the records of the recorded steps
        kept (all, or the last `max_steps`), in step order. Each read copies them: to log
        while training, read `latest()`, `since(step)` or `scalars()`, which cost what the
        new steps hold."""
        return {label: list(self._records[site]) for site, label in self._labelled()}

    def latest(self) -> dict[str, StepRecord]:
        """The records of the most recent recorded step, by label (the overrides that ran
        backward in it); {} before the first."""
        step = self._last_step
        return {
            label: records[-1]
            for site, label in self._labelled()
            if (records := self._records[site]) and records[-1].step == step
        }

    def since(self, step: int) -> dict[str, list[StepRecord]]:
        """The records of the recorded steps from `step` on (among those kept), by label:
        what a loop logging every N steps reads each time."""
        if isinstance(step, bool) or not isinstance(step, int):
            msg = f"Monitor.since needs a step number (an int); got {step!r}."
            raise GradOverrideTypeError(msg)
        out = {}
        for site, label in self._labelled():
            records = self._records[site]
            new: list[StepRecord] = []
            for record in reversed(records):
                if record.step < step:
                    break
                new.append(record)
            if new:
                out[label] = new[::-1]
        return out

    def scalars(self, prefix: str = "gradoverride") -> dict[str, float]:
        """The latest recorded step as flat metrics, ready for a logger:
        `{"gradoverride/encoder.0.act/grad_in": 0.12, ...}`.

        Per override, `grad_in`, `grad_out`, `calls`, `nonfinite` (NaN and infinite
        elements, both sides) and `zeroed` (when it has one). A key's middle part is the
        override's module path (`_model` for the model itself), made of letters, digits,
        `_`, `.` and `-` only; a second override at one path adds its name
        (`encoder.0.grad_hook_reverse_grad_scale_1.0_at_parameters`). Keys are stable over
        training. `writer.add_scalar(k, v, step)` for each item (TensorBoard), or
        `wandb.log(monitor.scalars())`."""
        out: dict[str, float] = {}
        head = f"{prefix}/" if prefix else ""
        step = self._last_step
        for site, _ in self._labelled():
            records = self._records[site]
            if not records or records[-1].step != step:
                continue
            record = records[-1]
            key = f"{head}{self._key_of(site)}"
            out[f"{key}/grad_in"] = record.grad_in
            out[f"{key}/grad_out"] = record.grad_out
            out[f"{key}/calls"] = float(record.calls)
            out[f"{key}/nonfinite"] = float(
                record.nan_in + record.inf_in + record.nan_out + record.inf_out
            )
            if record.zeroed is not None:
                out[f"{key}/zeroed"] = record.zeroed
        return out

    def summary(self) -> MonitorSummary:
        """A table with one row per override: calls, the mean norms of the gradient arriving
        and returned per recorded step, the last step's zeroed fraction, and NaN/inf
        elements over all steps (all recorded steps, also with `max_steps`).
        `print(monitor.summary())`; `.rows` has the numbers."""
        rows = []
        for site, label in self._labelled():
            totals = self._totals[site]
            rows.append(SummaryRow(
                label=label,
                kind=site.kind,
                steps=totals.steps,
                calls=totals.calls,
                grad_in=totals.grad_in / totals.steps,
                grad_out=totals.grad_out / totals.steps,
                zeroed=totals.zeroed,
                nonfinite=totals.nonfinite,
            ))
        return MonitorSummary(type(self._model).__name__, rows, self.steps, self._every)

    def plot(self, path: str | Path | None = None) -> Figure:
        """Draw the gradient flow through the overrides over the steps kept: the norm
        returned by each override (and, dashed, the norm arriving), and below, the zeroed
        fraction. Returns the matplotlib `Figure` (`writer.add_figure(...)`,
        `wandb.Image(figure)`); given a path, also writes it there as a PNG. Needs
        matplotlib (`pip install gradoverride[plot]`)."""
        from ._plot import plot_history

        return plot_history(self.history, None if path is None else Path(path),
                            type(self._model).__name__)

    def _labelled(self) -> list[tuple[Site, str]]:
        """Per override, in the order of their modules in the model: its site and its
        label. A label met again (two ops of one name in one module) gets `#2`, `#3`, ...,
        so none hides another. Worked out again only when an override is new."""
        if len(self._labels) != len(self._records):
            labels = {}
            used: dict[str, int] = {}
            for site in sorted(self._records, key=self._recorder.position):
                label = site.label
                used[label] = used.get(label, 0) + 1
                labels[site] = label if used[label] == 1 else f"{label} #{used[label]}"
            self._labels = labels
        return list(self._labels.items())

    def _key_of(self, site: Site) -> str:
        key = self._keys.get(site)
        if key is None:
            taken = set(self._keys.values())
            # The model itself: a key no module path gives (none starts with `_`).
            key = _metric_safe(site.path) or "_model"
            if key in taken:
                key = f"{key}.{_metric_safe(site.name)}"
            base, n = key, 2
            while key in taken:
                key, n = f"{base}_{n}", n + 1
            self._keys[site] = key
        return key

    def __repr__(self) -> str:
        state = "recording" if self._recorder.started else "stopped"
        return (f"<go.monitor of {type(self._model).__name__} ({state}, every={self._every}, "
                f"{self.steps} steps, {len(self._records)} overrides seen)>")


class _Totals:
    """An override's numbers over every recorded step (what the summary shows)."""

    __slots__ = ("calls", "grad_in", "grad_out", "nonfinite", "steps", "zeroed")

    def __init__(self) -> None:
        self.steps = self.calls = self.nonfinite = 0
        self.grad_in = self.grad_out = 0.0
        self.zeroed: float | None = None

    def add(self, r: StepRecord) -> None:
        self.steps += 1
        self.calls += r.calls
        self.grad_in += r.grad_in
        self.grad_out += r.grad_out
        self.zeroed = r.zeroed
        self.nonfinite += r.nan_in + r.inf_in + r.nan_out + r.inf_out


def _insert(records: deque[StepRecord], record: StepRecord) -> None:
    """`record` appended to `records`, in step order (a thread's pass may end after a later
    one's)."""
    if not records or records[-1].step <= record.step:
        records.append(record)
        return
    k = len(records)
    while k and records[k - 1].step > record.step:
        k -= 1
    if records.maxlen is not None and len(records) == records.maxlen:
        if k == 0:
            return  # older than everything kept
        records.popleft()
        k -= 1
    records.insert(k, record)


def _metric_safe(text: str) -> str:
    """`text` with every run of characters other than letters, digits, `_`, `.` and `-`
    as one `_` (none at either end): what metric loggers take in a key."""
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", text).strip("_")


_ACTIVE: list[Monitor] = []


@dataclass(frozen=True)
class SummaryRow:
    """One override's line of a monitor's summary (see `Monitor.summary`)."""

    label: str
    kind: str
    steps: int
    calls: int
    grad_in: float
    grad_out: float
    zeroed: float | None
    nonfinite: int


class MonitorSummary:
    """What `Monitor.summary()` returns: prints as a table; `.rows` are `SummaryRow`s."""

    def __init__(self, model: str, rows: Sequence[SummaryRow], steps: int, every: int) -> None:
        self.model = model
        self.rows = list(rows)
        self.steps = steps
        self.every = every

    def __str__(self) -> str:
        if not self.rows:
            return (f"go.monitor of {self.model}: nothing recorded (no gradient override of "
                    f"{self.model} ran backward in eager mode; steps compiled with "
                    "torch.compile and torch.func transforms are not recorded)")
        headers = ("override", "kind", "steps", "calls", "|grad in|", "|grad out|",
                   "zeroed", "nan/inf")
        body = [
            (r.label, r.kind, str(r.steps), str(r.calls), _number(r.grad_in),
             _number(r.grad_out), "-" if r.zeroed is None else f"{r.zeroed:.1%}",
             str(r.nonfinite))
            for r in self.rows
        ]
        right = (False, False, True, True, True, True, True, True)
        every = "" if self.every == 1 else f", every {self.every}"
        title = f"go.monitor of {self.model}: {self.steps} steps{every}; norms are means per step"
        return f"{title}\n{format_table(headers, body, right)}"

    __repr__ = __str__


def _record(step: int, numbers: list[float], scale: float = 1.0) -> StepRecord:
    # (in the order of FIELDS)
    calls, in_sq, out_sq, zeroed, paired, nan_in, inf_in, nan_out, inf_out = numbers
    return StepRecord(
        step=step,
        calls=int(calls),
        grad_in=math.sqrt(in_sq) / scale,
        grad_out=math.sqrt(out_sq) / scale,
        zeroed=zeroed / paired if paired else None,
        nan_in=int(nan_in),
        inf_in=int(inf_in),
        nan_out=int(nan_out),
        inf_out=int(inf_out),
    )


def _number(value: float) -> str:
    return f"{value:.4g}"


def monitor(model: nn.Module, *, every: int = 1, max_steps: int | None = None,
            scaler: Any = None) -> Monitor:
    """Record, while training, what each gradient override in `model` gets and gives back.

    ```python
    import torch
    from torch import nn
    import gradoverride as go

    model = nn.Sequential(nn.Linear(4, 4), go.recipes.binarize().module(), nn.Linear(4, 1))
    with go.monitor(model) as mon:
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
    print(mon.summary().rows[0].label, mon.summary().rows[0].steps)
    #> 1: binarize(clip=1.0, inclusive=True, keep='input') 3
    ```

    A step is one backward pass that reaches an override of `model` (`loss.backward()`,
    or each `torch.autograd.grad`; with gradient accumulation, each micro-batch's). For
    each override that ran backward in a recorded step,
    `history` keeps the norm of the gradient arriving at it and of the gradient it
    returned (for its inputs and, for a module's rule, its parameters), the fraction of
    elements it zeroed, and NaN/inf counts (a NaN is recorded, never raised). An override
    called several times in a step (a spiking neuron at each time step) is one row: its
    norms are over all its calls.

    Args:
        model: the `nn.Module` whose forward runs the overrides: a `go.Module`, modules
            with `override_backward` or `grad_hook`, recipe modules, and any
            `custom_backward` / `straight_through` op or recipe called in a forward of
            `model` or its submodules.
        every: record one step in `every` (the first, then every `every`-th); on the
            others an override call costs a few microseconds more than outside the monitor
            (it keeps its call stack and hooks its node, so that the step is counted).

        max_steps: keep the records of the last `max_steps` recorded steps of each
            override (None: all). The summary still covers every recorded step.
        scaler: the `torch.amp.GradScaler` scaling the loss, if any. Every gradient of a
            backward pass of `scaler.scale(loss)` is the true one times the scale (65536 at
            first on CUDA); with the scaler, the norms recorded are the true ones (divided
            by the scale of their pass). Without it they are the scaled ones.

    Returns:
        A `Monitor`, to use as a context manager: `with go.monitor(model) as mon: ...`.
        Outside the `with` block nothing of it is left (no hook, no wrapper). Read it with
        `mon.summary()`, `mon.history` and `mon.plot(path)`; while training, with
        `mon.latest()`, `mon.since(step)` and `mon.scalars()` (metric keys for a logger),
        which cost what the new steps hold.

    Where it records: eager training, on any device (each recorded step reads a few numbers
    back from the device at the end of the backward pass). Under `torch.compile`, the
    compiled steps run but are not recorded, and a compiled model is refused (see the
    support matrix); steps under `torch.func` transforms are not recorded either. Under
    DistributedDataParallel each process records its own replica's gradients (the
    gradients before DDP's all-reduce, which happens on the parameters' `.grad`, not at the
    overrides). One recording at a time: a second monitor, of any model, raises.
    """
    if not isinstance(model, nn.Module):
        from .._frameworks import is_keras_layer

        if is_keras_layer(model):
            msg = (
                f"go.monitor records PyTorch models; got the Keras model {type(model).__name__}. "
                "`go.overrides(model)` lists a Keras model's overrides. `fit` runs each step "
                "as a traced graph, whose gradients the monitor cannot read step by step: to "
                "watch an override's gradient in `fit`, register a `go.grad_hook` whose "
                "transform writes `tf.summary.scalar(name, tf.norm(grad))` and returns `grad` "
                "(the diagnostics page shows it)."
            )
            raise GradOverrideError(msg)
        msg = (
            f"go.monitor needs the model as an nn.Module; got {type(model).__name__} "
            f"{model!r:.60}. Pass the module whose forward runs the overrides (wrap loose "
            "modules in an nn.ModuleList)."
        )
        raise GradOverrideTypeError(msg)
    if hasattr(model, "_orig_mod") or getattr(model, "_compiled_call_impl", None) is not None:
        name = type(getattr(model, "_orig_mod", model)).__name__
        msg = (
            f"go.monitor records eager steps, and this {name} is compiled with "
            "torch.compile: its backward runs as one compiled graph, where the overrides are "
            "not separate steps, so nothing would be recorded. Monitor the eager model for "
            "the steps you want to see: for `compiled = torch.compile(model)`, use "
            "`with go.monitor(model):` and call `model` (not `compiled`) in those steps."
        )
        raise GradOverrideError(msg)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        msg = (
            "go.monitor: `every` must be a positive integer (record one step in every "
            f"`every`); got {every!r}."
        )
        raise GradOverrideTypeError(msg)
    if max_steps is not None and (
        isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1
    ):
        msg = (
            "go.monitor: `max_steps` must be a positive integer (the recorded steps kept per "
            f"override) or None (all); got {max_steps!r}."
        )
        raise GradOverrideTypeError(msg)
    if scaler is not None and not is_grad_scaler(scaler):
        msg = (
            "go.monitor: `scaler` must be the torch.amp.GradScaler scaling the loss (or None); "
            f"got {type(scaler).__name__} {scaler!r:.60}."
        )
        raise GradOverrideTypeError(msg)
    return Monitor(model, every, max_steps, scaler)
