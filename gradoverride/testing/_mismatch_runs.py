"""The forwards `gradient_report` runs: each one the model's own, with every override call
inside it seen (and possibly replaced) through the recorder's `substitute`.

* the **override run**: each call's input gets a probe added, a tensor of -0.0 that
  requires grad (x + (-0.0) is x, bit for bit, the sign of zero included), so that the
  gradient of the loss with respect to the probe is the gradient the override returned for
  that input, through the overrides' own rules, whatever else reads the input;
* the **proxy run**: the same, with each override that has a proxy running the proxy
  instead (forward and backward by autograd);
* the **perturbed runs**: no gradient; one override's inputs get `+ h * direction` and the
  model runs its true forward (each override's own forward is the true function).

Every forward starts from the same state: the model's buffers as they were (batch-norm
statistics are put back, also after the report) and the random generators seeded with the
report's seed (dropout draws the same mask in every run); the caller's generator state is
restored afterwards.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from .._decorators import CustomBackward
from .._errors import GradOverrideError
from ..diagnostics._recorder import Recorder, Site

__all__ = ["CallRecord", "Runner", "SiteRecord"]

Op = CustomBackward[..., Any]
Substitute = Callable[[Site, Op, tuple[Any, ...], dict[str, Any]], Any]
#: Where an input sits in an op call: a position in args, or a keyword.
Position = int | str


@dataclass
class CallRecord:
    """One call of an override in the override run."""

    positions: tuple[Position, ...]  # where its differentiated inputs are
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    outputs: tuple[torch.Size, ...]  # the shapes of what it returned (its tensor leaves)


@dataclass
class SiteRecord:
    """An override as the override run met it: its calls, and why it cannot be compared."""

    site: Site
    calls: list[CallRecord] = field(default_factory=list)
    problem: str | None = None  # set when its inputs cannot be probed

    @property
    def elements(self) -> int:
        return sum(s.numel() for call in self.calls for s in call.shapes)

    @property
    def dtypes(self) -> list[torch.dtype]:
        return [d for call in self.calls for d in call.dtypes]


def _ignore(groups: Any) -> None:
    """The recorder's sink: the report reads gradients through its probes instead."""


class Runner:
    """Runs the model's forward (and the loss) with a substitute for the override calls."""

    def __init__(self, model: nn.Module, loss_of: Callable[[], Any], seed: int,
                 inputs: Any = None) -> None:
        self.model = model
        self.loss_of = loss_of  # runs model and loss_fn on the batch
        self.seed = seed
        self.recorder = Recorder(model, _ignore)
        self.forwards = 0
        self.backwards = 0
        self._buffers = [
            (module, name, buffer, buffer.detach().clone())
            for module in model.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]
        self._state = _plain_state(model)
        # The CUDA generators to reseed: of the model's tensors and of the batch's (a model
        # without parameters, or fed CUDA inputs, draws on the batch's device).
        from torch.utils import _pytree as pytree

        given = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
        self._devices = sorted({
            t.device.index or 0
            for t in (*model.parameters(), *model.buffers(), *given)
            if t.device.type == "cuda"
        })

    @contextmanager
    def active(self) -> Iterator[Runner]:
        """The recorder started, and the generators' state forked (restored at the end)."""
        _refuse_active_monitor(self.model)
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self._devices))
            self.recorder.start()
            stack.callback(self.recorder.stop)
            stack.callback(self._restore_buffers)
            yield self

    def loss(self, substitute: Substitute) -> Tensor:
        """One forward with `substitute` in every override's place, with gradients enabled
        as in training (a module's rule may skip its op when they are not)."""
        self._restore_buffers()
        self._reseed()
        recorder = self.recorder
        recorder.substitute = substitute
        try:
            with torch.enable_grad():
                loss = self.loss_of()
        finally:
            recorder.substitute = None
        self.forwards += 1
        result: Tensor = loss
        return result

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)` with no substitute: an override's own call, or a proxy
        (overrides inside a proxy or an op's forward run as they are)."""
        recorder = self.recorder
        saved, recorder.substitute = recorder.substitute, None
        try:
            return fn(*args, **kwargs)
        finally:
            recorder.substitute = saved

    def _reseed(self) -> None:
        torch.default_generator.manual_seed(self.seed)
        for index in self._devices:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(self.seed)

    def _restore_buffers(self) -> None:
        _restore_plain_state(self._state)
        with torch.no_grad():
            for module, name, original, saved in self._buffers:
                if module._buffers.get(name) is not original:
                    module._buffers[name] = original  # the forward replaced it
                original.copy_(saved)


# What every nn.Module holds in its __dict__ (hooks, flags): not the model's state.
_MODULE_OWN = frozenset(nn.Module().__dict__)

#: (module, attribute, its value, a copy of a dict value's entries, a copy of its contents:
#: a tensor's values, a generator's state, or a dict's tensors' values)
_PlainState = list[tuple[nn.Module, str, Any, dict[Any, Any] | None, Any]]


def _is_state(value: object) -> bool:
    return value is None or isinstance(value, Tensor | float | int)


def _contents(value: Any) -> Any:
    """What an attribute's value holds that a forward may change in place."""
    if isinstance(value, torch.Generator):
        return value.get_state()
    if isinstance(value, Tensor):
        return value.detach().clone()
    return None


def _plain_state(model: nn.Module) -> _PlainState:
    """The state a module keeps outside its buffers, which each forward of the report starts
    from, as from the buffers: plain attributes (a spiking neuron's membrane `self.v`, None
    until the first call, or updated in place; a dict of them, as SpikingJelly's
    `_memories`), a random generator the module holds, and frozen parameters (an EMA
    codebook updated in its forward)."""
    saved: _PlainState = []
    for module in model.modules():
        for name, value in module.__dict__.items():
            if name in _MODULE_OWN or isinstance(value, nn.Parameter):
                continue
            if isinstance(value, torch.Generator) or (
                _is_state(value) and not isinstance(value, bool)
            ):
                saved.append((module, name, value, None, _contents(value)))
            elif type(value) is dict and value and all(_is_state(v) for v in value.values()):
                entries = dict(value)
                saved.append((module, name, value, entries,
                              {k: _contents(v) for k, v in entries.items()}))
        for name, parameter in module._parameters.items():
            if parameter is not None and not parameter.requires_grad:
                saved.append((module, name, parameter, None, _contents(parameter)))
    return saved


def _restore_plain_state(saved: _PlainState) -> None:
    """Each attribute bound to what it held (the same objects) with the contents it had, a
    dict's entries too."""
    with torch.no_grad():
        for module, name, value, entries, contents in saved:
            if isinstance(value, nn.Parameter):
                if module._parameters.get(name) is not value:
                    module._parameters[name] = value
                value.copy_(contents)
                continue
            module.__dict__[name] = value
            if entries is not None:
                value.clear()
                value.update(entries)
                for key, entry in entries.items():
                    if isinstance(entry, Tensor):
                        entry.copy_(contents[key])
            elif isinstance(value, torch.Generator):
                value.set_state(contents)
            elif isinstance(value, Tensor):
                value.copy_(contents)


def _refuse_active_monitor(model: nn.Module) -> None:
    """A go.monitor recording the model has swapped the op classes: the report's recorder
    would then see no override call."""
    monitors = sys.modules.get("gradoverride.diagnostics._monitor")
    if monitors is not None and monitors._ACTIVE:
        msg = (
            f"gradient_report({type(model).__name__}, ...) cannot run while a go.monitor is "
            "recording (its recorder holds the overrides' calls); call it outside the "
            "`with go.monitor(...)` block."
        )
        raise GradOverrideError(msg)


def differentiated(site: Site, args: tuple[Any, ...],
                   kwargs: Mapping[str, Any]) -> tuple[Position, ...] | str:
    """Where the inputs the report differentiates sit in an op call: the first
    floating-point tensor argument, and every other one that requires grad; for a module's
    rule, among the module's inputs (not its parameters). A string says why there is none."""
    start = 0
    if site.kind in ("go.Module", "override_backward"):
        module = args[0]
        if getattr(module, "inplace", False) is True:
            return ("an in-place module: its inputs change during its forward, so the report "
                    "cannot perturb them")
        start = 1  # (module, *inputs)
    candidates: list[tuple[Position, Any]] = [(i, args[i]) for i in range(start, len(args))]
    candidates += list(kwargs.items())
    positions: list[Position] = []
    for where, value in candidates:
        floating = isinstance(value, Tensor) and value.is_floating_point()
        if floating and (not positions or value.requires_grad):
            positions.append(where)
    if not positions:
        return "no floating-point tensor input to differentiate"
    return tuple(positions)


def read(args: tuple[Any, ...], kwargs: Mapping[str, Any], where: Position) -> Any:
    return args[where] if isinstance(where, int) else kwargs[where]


def replaced(args: tuple[Any, ...], kwargs: dict[str, Any],
             values: Mapping[Position, Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """args and kwargs with the inputs at `values`' positions replaced."""
    new_args = tuple(values.get(i, a) for i, a in enumerate(args))
    new_kwargs = {k: values.get(k, v) for k, v in kwargs.items()}
    return new_args, new_kwargs


def output_shapes(out: Any) -> tuple[torch.Size, ...]:
    from torch.utils import _pytree as pytree

    return tuple(t.shape for t in pytree.tree_leaves(out) if isinstance(t, Tensor))
