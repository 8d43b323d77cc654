"""Seeing every override of a model run: which ran where, and the gradients each one got and
gave back. What `go.monitor` and `go.overrides` (with example inputs) are built on.

While a recorder is started:

* every op call (each `custom_backward` / `straight_through` op, the recipes' ops, the ops
  of `go.Module` and `override_backward`) consults the recorder (`RECORDERS`, read by the
  ops' entries), which leaves an object on the backward node of the op's output (an
  attribute of the Function's `ctx`); the node's backward, which reads `RECORDING` first,
  hands it what the rule returned and what the node got (`backward_recorded`): exactly the
  override's own gradients, whatever else reads its inputs, with no identity op added, no
  tensor copied, and no hook registered on each node (torch's node hooks cost about as
  much as the rest of a recorded call together);
* the row of an op called in a module's forward is that module's path: module forward
  hooks, registered only while recording, keep each thread's stack of running module
  calls, and the recipes and their module forms push themselves on it (`recipe_call`,
  so a recipe's module form needs no hooks), so the row is the
  innermost module of the model on it and the recipe that made the call, however deep
  below the module's forward the op is called. They are hooks on the model and on those of
  its modules whose own code may call an override (all but torch's plain layers and
  containers, see `_own_hooks`; modules added to the model later are hooked as torch
  registers them), and, during the first forward, torch's global hooks for every other
  module call (a compiled wrapper of the model's, a module not in it yet); once it ended,
  torch calls those on its fast path, as without the recorder (the model's modules keep
  the hooks they had all along, so that a forward another thread starts meanwhile is seen
  whole); the model's own hooks are what give an
  override called by code it gained later (a hook added to a layer, a module inserted
  without torch's registration) a row, the model's; a call leaves a snapshot of the stack
  (`_Call`), read only when a recorded pass reaches its node, once per pass for the calls
  of one op with the same arguments and stack (a spiking neuron's, at each time step), and
  taken from the last recorded pass where it read the same (until the model's paths are
  read again); a node reached by a pass that is not recorded returns at once;
* each `grad_hook` transform in the model is wrapped, in place (the module hook's attribute,
  or the parameter's hook dict, which keeps its order among other hooks).

The hooks on the model's modules are removed when recording stops; a module copied or saved
while recorded carries, in their place, hooks that do nothing (see `_OwnHook`). A step
is one backward pass that reaches an override of the model: the gradients of a pass
(autograd's graph task, so that two threads' passes running at once stay apart) are handed
to the recorder's `sink` at its end (`queue_callback`), grouped by override; a pass that
fails is handed on when autograd drops its callback, and a reentrant checkpoint's nested
pass is part of the pass that recomputed it. With `every=N`, a pass is counted when it first
reaches a node of the model's overrides, and recorded if its count is a multiple of N (a
forward may be followed by several passes, each a step). The forwards of the steps not to
be recorded run with the ops' consult off (`RECORDERS` empty: `RECORDING`, which the
backwards read, keeps the recorder), decided at each forward's start from the passes
expected to follow it (see `Recorder._arm`); the autograd sequence numbers of the nodes
such a forward made are kept, and the backward of an op's node holding no record tells the
recorder (`Recorder.met`), which counts the pass if the node is one of those.

Stopping restores every transform and leaves the list the ops consult: afterwards nothing
of the recorder is left and an op call costs what it did before.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count, filterfalse
from typing import Any, ClassVar, cast

import torch
from torch import Tensor, nn
from torch.compiler import is_dynamo_compiling
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
    register_module_module_registration_hook,
)

from .._decorators import CustomBackward
from .._errors import GradOverrideError, GradOverrideWarning
from .._function import RECORDED_CALL, RECORDERS, RECORDING
from .._internals import graph_task_id, graph_task_reader, transforms_active
from .._module import Module
from .._signature import describe
from .._table import one_line

__all__ = ["Gradients", "Recorder", "Site", "model_paths"]


@dataclass(eq=False)
class Site:
    """One override in the model: where it runs and what it is."""

    path: str  # the module's path in the model ("" for the model itself)
    name: str  # the recipe's repr, the op's name, the module's class
    kind: str  # "op", "recipe", "go.Module", "override_backward", "grad_hook"
    keep: Any = None  # the recipe or transform the name was read from (kept alive)
    index: int = 0  # the order in which the recorder first met it

    @property
    def label(self) -> str:
        return f"{self.path or '(model)'}: {self.name}"


@dataclass
class Gradients:
    """What one override got and gave in one backward pass, over all its calls in a step."""

    calls: int = 0
    arriving: list[Tensor] = field(default_factory=list)  # at the override's outputs
    returned: list[Tensor] = field(default_factory=list)  # for its inputs (and parameters)
    # (returned, arriving) of the same shape in a call with one output: what "zeroed" reads.
    pairs: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    # Whether every call had one gradient in and one out, all of one shape and dtype (then
    # `pairs` is `zip(returned, arriving)` and the lists can be stacked).
    aligned: bool = True




#: `queue_callback(callback)` runs `callback` when the backward pass running now ends (what
#: DDP uses): the engine's own method, called from each pass's first node.
queue_callback: Callable[[Callable[[], None]], None] = (
    torch.autograd.Variable._execution_engine.queue_callback)


def current_pass() -> int:
    """The id of the backward pass (autograd's graph task) running in this thread, -1
    outside one (and always, on a torch that does not say: passes then share one id)."""
    task = graph_task_id()
    return -1 if task is None else task


# `current_pass` as one call of torch's own (what every op call and recorded backward reads).
_pass_now: Callable[[], int] = graph_task_reader() or current_pass

Sink = Callable[[dict[tuple[Site, int], Gradients]], None]


def model_paths(model: nn.Module) -> dict[int, str]:
    """Each module of `model` by id, with its path (a module reached twice: its first)."""
    for _ in range(_PATH_READS - 1):
        try:
            return {id(m): name for name, m in model.named_modules()}
        except RuntimeError as e:
            # (another thread added a module to the model meanwhile: read again)
            if "changed size during iteration" not in str(e):
                raise
    return {id(m): name for name, m in model.named_modules()}


_PATH_READS = 8


# Each recorder's arming changes get a number of their own (see `Recorder.new_forward`).
_ARMINGS = count(1)


class Recorder:
    """See the module docstring. `sink` receives each backward pass's gradients."""

    def __init__(self, model: nn.Module, sink: Sink, *, every: int = 1,
                 on_call: Callable[[str, Any], None] | None = None,
                 purpose: str = "a recorder") -> None:
        self.model = model
        # What started it, as an error message names it ("go.monitor of Net").
        self.purpose = purpose
        self.sink = sink
        # Told of every op call inside the model's forward, in any grad mode, with the path
        # and what the call's row names (what go.overrides lists from an example forward).
        self.on_call = on_call
        # When set, each op call inside the model's forward is replaced by
        # `substitute(site, op, args, kwargs)` (what gradient_report uses to put a smooth
        # proxy or a perturbed input in an override's place). Not for grad_hook transforms,
        # which are not op calls in eager mode.
        self.substitute: Callable[[Site, CustomBackward[..., Any], tuple[Any, ...],
                                   dict[str, Any]], Any] | None = None
        self.every = every
        # Backward passes that reached an override of the model so far: the index of the
        # next one is the step being recorded.
        self.passes = 0
        self.paths: dict[int, str] = {}
        self._retransformed: list[tuple[Any, Any]] = []
        # The row of each op's (and recipe setting's) last call in a forward: the row of a
        # call recomputing a checkpointed function inside a backward pass.
        self._last: dict[tuple[Any, Any], Site] = {}
        # See `_settings`: by the ids of the recipes and ops met, while they live.
        self._settings: dict[int, Any] = {}
        # The module hooks keeping each thread's call stack (see `_place`): hooks on the
        # model's modules that may call an override (see `_own_hooks`), by module id, and,
        # during the first forward, torch's global ones for every other module call.
        self._handles: list[Any] = []
        self._global_handles: list[Any] = []
        self._own: dict[int, tuple[nn.Module, Any, Any]] = {}  # (module, its hooks' handles)
        self._global = False  # whether the global hooks are on
        self._forwards = 0  # outermost calls running under the global hooks, all threads
        self._paths_stale = False  # a module was added to the model (see `_registered`)
        self._switching = threading.Lock()
        self._warned_compiled = False
        self.model_name = type(model).__name__
        self._positions: dict[str, int] = {}
        self._outside: set[int] = set()  # ids of modules met that are not in the model
        self._count = 0
        self._sites: dict[tuple[Any, ...], Site] = {}
        # The rows read in the last recorded pass (see `_Pass.row_of`), by what they were read
        # from; each keeps the objects of its key alive until the next recorded pass. Valid
        # while `places` is what it was then: it counts the times a row's module may have
        # moved (the paths read again; a module met outside the model looked up again).
        self.places = 0
        self.rows_before: tuple[int, dict[tuple[int, ...], tuple[Site | None, Any, _Call]]] = (
            0, {})
        # Per backward pass (autograd's graph task id) running: its step, and (site,
        # returned, arriving), one per backward call (appended from autograd's threads;
        # list.append is atomic). Two threads' passes, running at once, stay apart.
        self._pending: dict[int, _Pass] = {}
        self._counting = threading.Lock()  # a pass's step from two threads at once
        self._skipped: deque[int] = deque()  # the last passes not recorded (see `_open`)
        # With `every=N`, the forwards of a step that is not recorded run with the ops'
        # consult off, `RECORDERS` empty (see `_arm`): whether it is on (`armed`), and the
        # number of that state (see `_ARMINGS`; 0 while it changes), which a forward
        # compares at its end. The changes are made one at a time (`_changing`).
        self.armed = False
        self.arming = 0
        self._changing = threading.Lock()
        self._span = 1  # backward passes per forward, as last seen
        self._passes_seen = 0  # `passes` when the ops' consult was last decided
        self._waiting = 0  # forwards decided since `passes` last changed (with grad)
        self._forwards_per_step = 1  # forwards between the last two changes
        # How many steps early the forwards are recorded, up to `every - 1`: as many as a
        # step met a forward made before (a GAN's generator, whose forward the second
        # backward pass after it reaches; see `met` and `_flush`).
        self._ahead = 0
        self._calm = 0  # recorded steps in a row that needed `_ahead` lower
        self._always = False  # every forward recorded (see `met`, `new_forward`)
        self._always_for_lag = False  # (as `met` found passes reaching old forwards)
        # With `every=N`, per thread running a forward of the model: what `new_forward` read
        # at its start (sequence number, passes, backward pass or -1, arming or 0), for
        # `forward_ended`; also which threads run one now.
        self._began: dict[int, tuple[int, int, int, int]] = {}
        # The threads (by `_thread_number`) that ran forwards of it, and those seen calling
        # overrides outside the model.
        self._forward_threads: set[int] = set()
        self._foreign: set[int] = set()
        self._warned_unrecordable = False
        # A step to record could not be (see `met`): the next one is recorded in its place.
        self.owed = 0
        # The autograd sequence numbers of the nodes made by the last forwards not recorded,
        # one `_Range` a forward (see `met`).
        self._ranges: deque[_Range] = deque(maxlen=_RANGES_KEPT)
        self._met = -1  # the backward pass `met` counted last
        self.started = False

    # -- starting and stopping ------------------------------------------------------------

    def start(self) -> None:
        for other in RECORDING:
            # A second recorder would see the ops' calls the first one sees, and one node's
            # gradients would be recorded twice.
            msg = (
                f"{self.purpose} cannot start while {other.purpose} is recording: one "
                "model is recorded at a time (a second recorder would silently record "
                "nothing). To watch several models at once, monitor one container holding "
                "them (`go.monitor(nn.ModuleList([generator, discriminator]))`); to list a "
                "model's overrides during a monitored run, call `go.overrides(model)` "
                "without example inputs, or with them outside the monitor's `with` block."
            )
            raise GradOverrideError(msg)
        RECORDING.append(self)
        try:
            self._start()
        except BaseException:
            self.stop()  # (a warning made an error, say: nothing of it stays behind)
            raise

    def _start(self) -> None:
        self._began.clear()  # (a forward stopped by an interrupt left its thread's)
        _forget_stacks()  # every thread's call stack starts empty (see `_stack`)
        self._read_paths()
        self._wrap_hook_transforms()
        self._warn_compiled_in_place()
        # The model's modules whose own code may call an override keep this thread's call
        # stack (see `_own_hooks`): the path of an op's row is the innermost module of the
        # model on it, however deep the op is called. During the first forward every other
        # module call, in the model or not (a compiled wrapper of the model, a helper it
        # calls), keeps it too; once it ended, torch calls those on its fast path again (a
        # global hook sends each call of every module down the slow one).
        self._hook_own(self.model.modules())
        self._handles = [register_module_module_registration_hook(self._registered)]
        self._global = True
        self._global_handles = [
            register_module_forward_pre_hook(_entered),
            register_module_forward_hook(_left_global, always_call=True),
        ]
        self._forwards = 0
        RECORDERS.append(self)
        self.armed, self.arming = True, next(_ARMINGS)
        self.started = True

    def stop(self) -> None:
        with self._changing:  # (a forward deciding in another thread leaves it out)
            self.started = False
            if self in RECORDERS:
                RECORDERS.remove(self)
        # (one at a time with another thread's forward ending the first one, or a module
        # added in another thread, which hook the model's modules: none is hooked after)
        with self._switching:
            for handle in (*self._handles, *self._global_handles):
                handle.remove()
            self._handles = []
            self._global_handles = []
            self._global = False
            for _, pre, post in self._own.values():
                pre.remove()
                post.remove()
            self._own = {}
        _LeftLate.remove_all()  # those of calls that never ended (a KeyboardInterrupt)
        _forget_stacks()
        for task in sorted(self._pending):
            self._flush(task)  # a backward pass still running in another thread
        self._skipped.clear()
        for hook, transform in self._retransformed:
            hook.transform = transform
        self._retransformed = []
        self.rows_before = (0, {})
        if self in RECORDING:
            RECORDING.remove(self)

    def _read_paths(self) -> None:
        """Read the model's module paths (again): the rows read in the last recorded pass
        are read again too, as a module may have moved."""
        self.paths = model_paths(self.model)
        self._positions = {path: k for k, path in enumerate(self.paths.values())}
        self.places += 1

    # -- which module calls keep the call stack ----------------------------------------------

    def forward_began(self) -> bool:
        """An outermost module call began in this thread while the global hooks were on:
        counted, so that they stay on until it ends, and True, if they still are (else
        they went meanwhile, and run nothing at its end)."""
        with self._switching:
            if not self._global:
                return False
            self._forwards += 1
            for module, pre, _ in list(self._own.values()):  # (others add to it)
                _put_first(module, pre)
            return True

    def runs_model(self, module: nn.Module) -> bool:
        """Whether an outermost call of `module` under the global hooks is a forward of the
        model: the model's own call, one of its modules called alone, or a call of a module
        holding it (a compiled wrapper, a data-parallel one). Another model's forward, in
        another thread, is not one: its forwards are not the model's steps, as they are not
        once the global hooks are gone (only the model's modules keep hooks then)."""
        if module is self.model or id(module) in self.paths:
            return True
        return any(inner is self.model for inner in module.modules())

    def forward_ended(self) -> None:
        """An outermost module call ended in this thread. If its op calls were not all
        recorded (see `_arm`), the sequence numbers of the backward nodes it made are kept
        (see `met`). Under the global hooks, when no such call runs in any thread, they
        give way to the model's own (a call still running when they went would keep its
        entry on its thread's stack: a module on torch's fast path runs no hook at its
        end; the model's own modules keep theirs)."""
        if self.every > 1:
            thread = _get_ident()
            began = self._began.pop(thread, None)
            if began is not None:
                start, at, outer, arming = began
                end = _sequence_now()
                if end > start and (arming == 0 or arming != self.arming):
                    # (a forward under no_grad makes no node: it keeps none)
                    self._ranges.append(
                        (start, end, at, outer, getattr(_THREAD, "number", 0) or _thread_number()))
        if not self._global:
            return
        with self._switching:
            self._forwards = max(self._forwards - 1, 0)
            if self._forwards or not self._global or not self.started:
                return
            if self.on_call is not None or self.substitute is not None:
                return  # go.overrides and gradient_report: a forward or two, kept as is
            self._global = False
            for handle in self._global_handles:
                handle.remove()
            self._global_handles = []
            self._read_paths()
            self._hook_own(self.model.modules())

    def _hook_own(self, modules: Iterator[nn.Module]) -> None:
        """Hooks on those of `modules` whose calls may have an override called with them
        the innermost module on the stack (see `_own_hooks`): the pre-hook first among the
        module's, as the global one runs before them; the forward hook after those there
        (a forward hook of the module's registered later leaves the stack as under the
        global hooks: see `_LeftLate`)."""
        for module in modules:
            hooked = self._own.get(id(module))
            if hooked is not None and hooked[0] is module:
                _put_first(module, hooked[1])
                continue
            if not (module is self.model or _own_hooks(module)):
                continue
            self._own[id(module)] = (
                module,
                module.register_forward_pre_hook(_ENTERED_OWN, prepend=True),
                module.register_forward_hook(_LEFT_OWN, always_call=True),
            )

    def _registered(self, parent: nn.Module, name: str, module: Any) -> None:
        """A module was set on a module (torch's registration hook): one of the model's
        gets its new modules hooked (modules added to the model while recording)."""
        if not self.started or not isinstance(module, nn.Module):
            return
        if id(parent) not in self.paths:
            self._read_paths()  # (added since the paths were read?)
            if id(parent) not in self.paths:
                return  # not the model's (or added to it without torch's registration)
        # (called before the module is set: the paths, and the grad_hooks' transforms, are
        # read again at the model's next call, see `new_forward`)
        self._paths_stale = True
        with self._switching:
            if self.started:  # (else stopped meanwhile, by another thread)
                self._hook_own(module.modules())

    # -- the ops' consult point ---------------------------------------------------------------

    def op_call(self, op: CustomBackward[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any],
                run: Callable[[tuple[Any, ...], dict[str, Any]], Any]) -> Any:
        """An op called while recording (eager): `run(args, kwargs)` makes the call."""
        if self.every > 1:  # (`_consulted_throughout`, inline: every op call reads it)
            began = self._began.get(_get_ident())
            if began is not None and (began[3] == 0 or began[3] != self.arming):
                return run(args, kwargs)
        if self.substitute is not None:
            site = self._site_of(op, args)
            if site is not None:
                return self.substitute(site, op, args, kwargs)
        out = run(args, kwargs)
        if not transforms_active():
            if not torch.is_grad_enabled():
                if _stack():
                    # Under no_grad (a checkpoint's first forward): the row its
                    # recomputation, inside the backward pass, will belong to.
                    self._site_of(op, args)
            elif _pass_now() >= 0:
                self._observe(op, args, out, None)  # a forward inside a backward pass
            else:
                # What each op call of a recorded model's forward leaves on its node (one
                # of our Functions'), read when a recorded pass reaches the node (`_Call`):
                # the op, its arguments other than tensors (picked out in C; the tensors are
                # not kept), the call stack, the call's order.
                node: Any = out.grad_fn if isinstance(out, Tensor) else _node_of(out)
                if node is not None and getattr(node, "gradoverride", None) is not None:
                    thread = _THREAD  # (`_stack()`, inline)
                    stack = (thread.stack if getattr(thread, "generation", -1) == _GENERATION
                             else _stack())
                    if stack:  # (else called outside any module call: not the model's)
                        if (self.every > 1 and stack[0] is not self.model
                                and self._place(stack)[0] is None):
                            # A thread calling overrides outside the model: its nodes'
                            # numbers say nothing of the model's forwards (see `met`).
                            self._foreign.add(_thread_number())
                        self._count += 1
                        extras = (() if len(args) == 1 and isinstance(args[0], Tensor)
                                  else tuple(filterfalse(_is_tensor, args)))
                        node.__dict__[RECORDED_CALL] = _Call(
                            (self, op, extras, tuple(stack), self._count, self.passes))
                    elif self.every > 1:
                        self._foreign.add(_thread_number())  # (as above)
        if self.on_call is not None:
            self._called(op, args)
        return out

    def recipe_call(self, recipe: Any, call: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
        """A recipe, or a recipe's module form, called while recording (eager): its ops'
        rows name it (and the module form's path)."""
        thread = _THREAD  # (`_stack()`, inline: every recipe call reads it)
        stack = thread.stack if getattr(thread, "generation", -1) == _GENERATION else _stack()
        if stack and stack[-1] is recipe:
            # (a module form the global hooks of a first forward put there already: its
            # calls' stacks, and so their rows, are those of the next forwards)
            return call(recipe, *args, **kwargs)
        stack.append(recipe)
        try:
            return call(recipe, *args, **kwargs)
        finally:
            if stack and stack[-1] is recipe:
                stack.pop()

    def module_form_call(self, module: Any, args: tuple[Any, ...],
                         kwargs: dict[str, Any]) -> Any:
        """A recipe's module form called while started (eager). Inside a module call it
        is a recipe's call (see `recipe_call`) when the forward is recorded; called on its
        own, outside any (a part of the model called alone, not hooked: see `_own_hooks`),
        it is a forward of its own, decided and counted as a hooked module's (see
        `new_forward`)."""
        run = type(module)._run
        thread = _THREAD
        stack = thread.stack if getattr(thread, "generation", -1) == _GENERATION else _stack()
        # (not inside a module call, every forward not recorded, and the model's)
        alone = not stack and self.every > 1 and id(module) in self.paths
        if alone:
            self.new_forward()
        try:
            if RECORDERS:
                return self.recipe_call(module, run, args, kwargs)
            return run(module, *args, **kwargs)
        finally:
            if alone:
                self.forward_ended()

    def module_call(self, module: nn.Module, op: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any], run: Callable[[], Any]) -> Any:
        """A module's rule called while recording (eager): `run()` makes the call."""
        if self.every > 1 and not self._consulted_throughout():
            return run()
        site = self._module_site(module)
        if site is not None and self.substitute is not None:
            return self.substitute(site, op, (module, *args), kwargs)
        out = run()
        if site is not None and torch.is_grad_enabled() and not transforms_active():
            self._observe(op, args, out, site)
        return out

    def module_output(self, module: nn.Module, op: Any, out: Any) -> None:
        """A module's rule attached to `out` by its forward hooks (`override_backward`)."""
        if self.every > 1 and not self._consulted_throughout():
            return
        site = self._module_site(module)
        if site is not None and not transforms_active():
            self._observe(op, (), out, site)

    def new_forward(self) -> None:
        """A module's call starts with none running in this thread: the modules met
        outside the model are looked up again (one may have been added to it since)."""
        if self._outside:
            self._outside = set()
            self.places += 1  # (a row read with one of them on the stack is read again)
        if self._paths_stale:
            self._paths_stale = False
            self._read_paths()
            self._wrap_hook_transforms()
        if self.every > 1:
            outer = _pass_now()
            thread = _get_ident()
            if outer < 0:  # (else a checkpoint's recomputation, in that backward pass)
                # (there before the look at the others: of two forwards starting at once,
                # one sees the other)
                self._began[thread] = _STARTING
                self._forward_threads.add(getattr(_THREAD, "number", 0) or _thread_number())
                if len(self._began) > 1 and not self._always and self._another_running(thread):
                    # Forwards of the model in two threads at once: the steps to come
                    # cannot be told from one forward; every forward is recorded, as with
                    # every=1 (the steps recorded stay one in N).
                    self._always = True
                self._arm()
            # (what `forward_ended` reads. The arming number is read before `RECORDERS`:
            # if the consult was on then and the number is the same at the forward's end,
            # no change of it began meanwhile, so every op call consulted the recorder;
            # otherwise 0, read as "some may not have")
            arming = self.arming
            self._began[thread] = (
                _sequence_now(), self.passes, outer, arming if RECORDERS else 0)

    def _consulted_throughout(self) -> bool:
        """With `every=N`: whether the forward this thread runs, if any, has had the ops'
        consult on since it began. One that began with it off, or saw it change (another
        thread's forward deciding otherwise), records none of its calls: a recipe called
        before the change was not put on the call stack, so a call after it would be
        recorded under the wrong row. Its nodes' range is kept instead (see
        `forward_ended`), and a step reaching them is dropped whole (see `met`)."""
        began = self._began.get(_get_ident())
        return began is None or (began[3] != 0 and began[3] == self.arming)

    def _another_running(self, thread: int) -> bool:
        """Whether a thread other than `thread` runs a forward of the model (not a
        checkpoint's recomputation). A thread that ended inside a forward, by an exception
        its forward hooks do not see (SystemExit), ran none to its end: its entry goes."""
        alive = {t.ident for t in threading.enumerate()}
        running = False
        for other, (_, _, outer, _) in list(self._began.items()):  # (others change it)
            if other == thread:
                continue
            if other not in alive:
                self._began.pop(other, None)
            elif outer < 0:
                running = True
        return running

    def _arm(self) -> None:
        """Whether the forward starting now has its op calls recorded: when the backward
        passes that follow it, as many as followed the last forward (a forward with two
        `backward` calls is two steps), include a step to record. The forwards of the
        steps not recorded run with the ops' consult off: their calls cost what they cost
        without a recorder; a backward pass reaching one of their overrides' nodes counts as
        a step (see `met`). Two forwards before one backward pass (a siamese step, a
        GAN's) are decided alike. If no backward pass was counted for twice `every` steps'
        worth of forwards (the nodes of a checkpointed function recomputed outside any
        module call), the next forward is recorded, and its first backward pass too."""
        passes = self.passes
        if passes > self._passes_seen:
            self._span = passes - self._passes_seen
            self._passes_seen = passes
            self._forwards_per_step, self._waiting = max(self._waiting, 1), 1
        elif torch.is_grad_enabled():
            self._waiting += 1
            if passes and self._waiting > 2 * self.every * self._forwards_per_step:
                self.owed = 1
        armed = (
            -passes % self.every < self._span + self._ahead
            or self.owed > 0
            or self._always
            or self._global
            or self.on_call is not None
            or self.substitute is not None
        )
        if armed is not self.armed:
            with self._changing:
                if not self.started:
                    return  # (stopped meanwhile, by another thread: the ops consult none)
                # (the number is 0 while the consult changes, and a new one once it has: a
                # forward in another thread that read the old number, or 0, at its start
                # keeps its nodes' range, see `forward_ended`)
                self.arming = 0
                RECORDERS[:] = [self] if armed else []  # (one step, for other threads' reads)
                self.armed = armed
                self.arming = next(_ARMINGS)

    def compiled_call(self, module: nn.Module) -> None:
        """A `torch.compile`d module (dynamo's wrapper, whose `_orig_mod` is the module it
        compiles) was called: if it compiles the model or a part of it, the overrides it
        runs are not recorded; warned once."""
        inner = module._modules["_orig_mod"]
        if self._warned_compiled or inner is None:
            return
        path = self.paths.get(id(inner))
        if path is None:
            path = self._path_of_new(inner)
        if path is None:
            return
        self._warn_compiled(
            path, "runs compiled (torch.compile)", "`model`, not `torch.compile(model)`; a "
            "warning from torch about global module hooks comes from this recorder's hooks, "
            "removed when it stops")

    def _warn_compiled_in_place(self) -> None:
        """A module of the model compiled in place (`module.compile()`) runs its calls
        compiled, unseen by the module hooks: warned once, as a compiled call is."""
        for module in self.model.modules():
            if getattr(module, "_compiled_call_impl", None) is not None:
                path = self.paths.get(id(module), "")
                self._warn_compiled(path, "is compiled in place (module.compile())",
                                    "the module itself (a copy that is not compiled)")
                return

    def _warn_compiled(self, path: str, how: str, fix: str) -> None:
        if self._warned_compiled:
            return
        self._warned_compiled = True
        where = f"`{path}` of {self.model_name}" if path else self.model_name
        msg = (
            f"{self.purpose}: {where} {how}, and the overrides inside a compiled call are "
            "not recorded: its backward is one compiled graph. To see them, call the eager "
            f"module in the steps you want recorded ({fix}; for example every N steps, "
            "inside the monitor)."
        )
        warnings.warn(msg, GradOverrideWarning, stacklevel=3)

    def hooks_changed(self) -> None:
        """A grad_hook was registered while recording: recorded from now on."""
        self._wrap_hook_transforms()

    def _wrap_hook_transforms(self) -> None:
        """Each grad_hook in the model records what its transform gets and gives."""
        hooks_module = sys.modules.get("gradoverride._hooks")
        if hooks_module is None:
            return  # no grad_hook was ever made
        for module in self.model.modules():
            path = self.paths.get(id(module))
            if path is None:  # added since the paths were read
                self._read_paths()
                path = self.paths[id(module)]
            for place, hook in hooks_module.grad_hooks_on(module):
                if isinstance(hook.transform, _MeasuredTransform):
                    continue
                site = self._make_site(path, hook.transform, "grad_hook", f" at {place}")
                # Every grad_hook reads its `transform` when it applies it.
                self._retransformed.append((hook, hook.transform))
                hook.transform = _MeasuredTransform(hook.transform, site, self)

    # -- during forward ---------------------------------------------------------------------

    def _observe(self, op: Any, args: tuple[Any, ...], out: Any, site: Any) -> None:
        node: Any = out.grad_fn if isinstance(out, Tensor) else _node_of(out)
        if node is None or getattr(node, "gradoverride", None) is None:
            return  # no gradient flows here, or not one of our Functions' nodes
        # A forward inside a backward pass (a reentrant checkpoint recomputing a segment,
        # whose backward then runs as a pass of its own): the nodes belong to the outer pass.
        outer = _pass_now()
        if outer >= 0 and outer not in self._pending:
            self._open(outer)  # (the outer pass is the one running: queued at its end)
        # Whether the pass running the node is a recorded step is decided when the pass
        # reaches it (see `_open`): a forward can be followed by several passes.
        if site is None:  # (an op called inside a backward pass: see `op_call`)
            site = self._site_of(op, args)  # (found now, as `_last` says)
            if site is None:
                return  # called outside the model
        # (The node's backward hands it what the rule returned: see `backward_recorded`.)
        node.__dict__[RECORDED_CALL] = _NodeRecord(self, site, outer)

    def _place(self, stack: Sequence[Any] | None = None) -> tuple[str | None, list[Any]]:
        """Where an op called now runs: the path of the innermost module of the model whose
        call runs in this thread (None outside the model), and the recipes whose calls run
        inside it, innermost first (a recipe's module form counts as its recipe). Read off
        this thread's call stack, which the recorder's module hooks and the recipes keep
        (or off `stack`, what it was at a call)."""
        recipes: list[Any] = []
        for entry in reversed(_stack() if stack is None else stack):
            if isinstance(entry, _Late):
                entry = entry.module
            if isinstance(entry, nn.Module):
                if isinstance(entry, _recipe_module_type()):
                    recipes.append(entry.recipe)
                path = self.paths.get(id(entry))
                if path is None:
                    path = self._path_of_new(entry)
                if path is not None:
                    return path, recipes
            else:
                recipes.append(entry)
        return None, recipes

    def _called(self, op: CustomBackward[..., Any], args: tuple[Any, ...]) -> None:
        if self.on_call is None:
            return
        path, recipes = self._place()
        if path is None:
            return
        subject, kind = _subject(op, args)
        if kind == "grad_hook":
            return  # hooks: listed from the modules
        if kind == "op" and recipes:  # recipes whose calls called the op: each ran
            for recipe in recipes:
                self.on_call(path, recipe)
            return
        self.on_call(path, subject)

    def _path_of_new(self, module: nn.Module) -> str | None:
        """The path of a module added to the model after the recorder started (the paths
        are read again), or None for a module outside the model (remembered until the
        next forward: it may be added to the model by then)."""
        if id(module) in self._outside:
            return None
        self._read_paths()
        path = self.paths.get(id(module))
        if path is None:
            self._outside.add(id(module))
        else:
            self._wrap_hook_transforms()  # the grad_hooks of what was added
        return path

    def _module_site(self, module: nn.Module) -> Site | None:
        """The row of a module's rule: the module's path (None outside the model)."""
        path = self.paths.get(id(module))
        if path is None:
            path = self._path_of_new(module)
        if path is None:
            return None  # a module outside the model
        kind = "go.Module" if isinstance(module, Module) else "override_backward"
        key: tuple[Any, ...] = (kind, path)
        site = self._sites.get(key)
        if site is None:  # (`setdefault`: two threads' first calls make one row)
            site = self._sites.setdefault(
                key, Site(path, type(module).__name__, kind, index=self._next_index()))
        return site

    def _site_of(self, op: CustomBackward[..., Any], args: tuple[Any, ...]) -> Site | None:
        """The row of a call of `op` with `args` made now (see `_site_from`)."""
        path, recipes = self._place()
        return self._site_from(op, args, path, recipes)

    def _site_from(self, op: CustomBackward[..., Any], args: tuple[Any, ...],
                   path: str | None, recipes: list[Any], index: int = 0) -> Site | None:
        """The row of a call of `op` with `args` (its tensors may be left out) made at
        `path` by `recipes`, or None for a call outside the model.

        Rows are told apart by settings, so that they and what they keep stay bounded
        however many recipes and ops a forward makes: a recipe by its repr, an op by its
        function and the values its function closes over and defaults to (see
        `_settings`). A call inside a backward pass with no module of the model running (a
        checkpointed function recomputing its forward) belongs to the row of the same
        override's last call in a forward."""
        if path is None and current_pass() < 0:
            return None
        return self._row(op, args, path, recipes, index)[0]

    def _row(self, op: CustomBackward[..., Any], args: tuple[Any, ...], path: str | None,
             recipes: list[Any], index: int = 0) -> tuple[Site | None, Any]:
        """`_site_from`'s row, and the key of `_last` it was kept under (None if not)."""
        subject, kind = _subject(op, args)
        if kind == "op" and recipes:  # a recipe whose call called the op
            subject, kind = recipes[0], "recipe"
        if isinstance(subject, _MeasuredTransform):
            return None, None  # a grad_hook's transform, which records itself
        code = _code_of(op)
        what: Any = self._settings_of(subject) if kind in ("recipe", "op") else id(subject)
        late = (code, what)
        if path is None:
            return self._last.get(late), None
        key = (code, path, what)
        site = self._sites.get(key)
        if site is None:
            # (sorted among the rows by `index`: the order of the call that made it;
            # `setdefault`: two threads' first calls at once make one row)
            site = self._sites.setdefault(key, self._make_site(path, subject, kind, index=index))
        self._last[late] = site
        return site, late

    def _settings_of(self, subject: Any) -> Any:
        """What tells one recipe or op from another of the same code: a recipe's repr (a
        recipe is frozen), an op's closure values and defaults (see `_op_settings`); read
        once per object while it lives."""
        settings = self._settings.get(id(subject))
        if settings is None:
            settings = repr(subject) if isinstance(subject, _recipe_type()) else _op_settings(
                subject)
            try:
                weakref.finalize(subject, self._settings.pop, id(subject), None)
            except TypeError:
                return settings  # not weakly referenceable: read at each call
            self._settings[id(subject)] = settings
        return settings

    def _next_index(self) -> int:
        self._count += 1
        return self._count

    def position(self, site: Site) -> tuple[int, int]:
        """Where `site` sorts: its module's place in the model, then the order met."""
        return self._positions.get(site.path, len(self._positions)), site.index

    def _make_site(self, path: str, subject: Any, kind: str, suffix: str = "",
                   index: int = 0) -> Site:
        if isinstance(subject, CustomBackward):
            name = getattr(subject, "__name__", subject._name)
        elif kind == "grad_hook":
            name = f"grad_hook({describe_transform(subject)}){suffix}"
        else:
            name = one_line(repr(subject))
        return Site(path, name, kind, subject, index=index or self._next_index())

    # -- during backward --------------------------------------------------------------------

    def met(self, ctx: Any) -> None:
        """A backward pass runs the node `ctx` of an op call that left no record: a call of
        a forward not recorded (with `every=N`), or one outside the model. If a forward not
        recorded made it (its sequence number is in one of `_ranges`), the pass is a step;
        if that step is one to record, it cannot be (some of its overrides' calls left no
        record): its gradients are dropped whole, and the next step is recorded in its
        place, the forwards from then on decided that many steps earlier (see `_arm`)."""
        if self.every == 1 or is_dynamo_compiling():
            return
        task = _pass_now()
        if task == self._met:
            return  # (the pass's first such node counted it)
        number = ctx._sequence_nr()
        thread = getattr(_THREAD, "number", 0) or _thread_number()
        try:
            newest = self._ranges[-1]  # (a training step's: its forward, in this thread)
        except IndexError:
            return
        made = (newest if newest[0] <= number < newest[1] and newest[4] == thread
                else self._range_of(number, thread))
        if made is None:
            return  # not made by a forward of the model (or too long ago)
        _, _, at, outer, _ = made
        self._met = task
        if outer >= 0:
            task = outer  # (made by a checkpoint's recomputation inside pass `outer`)
        run = self._pending.get(task)
        if run is None:
            run = self._open(task)
        if run.recorded:
            run.recorded = False
            run.entries.clear()
            self.owed = 1  # (one at most: a run of steps dropped is not made up for)
            needed = run.step - at - self._span + 1
            if self._always:
                if self._always_for_lag:
                    self._warn_unrecordable(run.step)
            elif needed > self.every - 1:
                # Its passes reach forwards made too long before (a recurrent state never
                # detached, as in truncated backpropagation through time): every forward
                # is recorded from now on, as with every=1 (the steps recorded stay one
                # in N).
                self._always = self._always_for_lag = True
            self._ahead = min(max(self._ahead, needed), self.every - 1)

    def _range_of(self, number: int, thread: int) -> _Range | None:
        """The range of a forward not recorded that made the node `number` that a pass
        reaches in `thread`, the newest first; None if there is none."""
        # Sequence numbers are counted per thread: a node is one of a range's if that thread
        # made it, or if this thread cannot have made it (a backward run in a thread of its
        # own, or on an accelerator's autograd thread, whose count has not reached the
        # node's number; not another model's training, whose numbers would be taken for
        # the model's).
        alone = (thread not in self._forward_threads and thread not in self._foreign
                 and _sequence_now() <= number)
        for made in reversed(tuple(self._ranges)):  # (a copy: others append meanwhile)
            if made[0] <= number < made[1] and (made[4] == thread or alone):
                return made
        return None

    def _warn_unrecordable(self, step: int) -> None:
        """A step to record reached forwards made before every forward was recorded."""
        if self._warned_unrecordable:
            return
        self._warned_unrecordable = True
        msg = (
            f"{self.purpose} (every={self.every}): step {step} is not recorded, nor are the "
            "steps after it whose backward pass reaches forwards of steps it did not "
            "record (a recurrent state carried from step to step and never detached): "
            "some of their override calls left nothing to record. Every forward is "
            "recorded from now on, so the steps are recorded again once their passes "
            "reach only forwards made since. To record them all, use every=1, or detach "
            "the carried state every few steps (`h = h.detach()`)."
        )
        warnings.warn(msg, GradOverrideWarning, stacklevel=2)

    def record_transform(self, site: Site, arriving: Tensor, returned: Tensor) -> None:
        """A grad_hook's transform ran (see `_MeasuredTransform`)."""
        task = current_pass()
        run = self._pending.get(task)
        if run is None:
            run = self._open(task)
        if run.recorded:
            run.entries.append((site, (returned,), (arriving,)))

    def _open(self, task: int) -> _Pass:
        """Backward pass `task`, met for the first time: its step is the next one, recorded
        one in `every`; its entries are handed to the sink at its end. A pass that fails
        (an error in a backward) never runs its callbacks; autograd then drops them, and
        the entries are handed on as that pass's step when `_PassEnd` is freed, so that
        the next passes are steps of their own and nothing is kept."""
        with self._counting:
            run = self._pending.get(task)
            if run is not None:
                return run  # (two threads of one pass)
            step = self.passes
            self.passes += 1
            due = step % self.every == 0
            if not due and not self.owed:
                # A step not recorded: counted, with nothing to hand on at its end (no
                # callback); its id is kept among the last few such passes' (ids are never
                # reused), so that its other nodes do not count it again.
                self._pending[task] = _SKIPPED
                skipped = self._skipped
                skipped.append(task)
                if len(skipped) > _SKIPPED_KEPT:
                    self._pending.pop(skipped.popleft(), None)
                return _SKIPPED
            if not due:
                self.owed -= 1  # (in place of one that could not be)
            run = self._pending[task] = _Pass(step, True, self.places)
        queue_callback(_PassEnd(self, task))
        return run

    def _flush(self, task: int) -> None:
        run = self._pending.pop(task, None)
        if run is None or not run.recorded:
            return  # flushed already (by `stop`), or not a recorded step
        if self.started and run.places == self.places:  # (else some may be stale)
            self.rows_before = (run.places, run.rows)
        if self.every > 1:
            # How many steps early its oldest forward had to be recorded (see `_arm`): more
            # at once, fewer after `_CALM` recorded steps in a row that needed fewer (a
            # GAN's steps that reach its generator alternate with steps that do not).
            needed = run.lag - self._span + 1
            if needed >= self._ahead and needed > 0:
                self._ahead, self._calm = min(needed, self.every - 1), 0
            else:
                self._calm += 1
                if self._calm >= _CALM:
                    self._ahead, self._calm = max(self._ahead - 1, 0), 0
        groups: dict[tuple[Site, int], Gradients] = {}
        step = run.step
        for site, returned, arriving in run.entries:
            # (loops, not comprehensions: no Python call per entry)
            gave: list[Tensor] = []
            for g in returned:
                if g is not None:
                    gave.append(g)
            got: list[Tensor] = []
            for g in arriving:
                if g is not None:
                    got.append(g)
            if len(got) > 1:
                # Several outputs: one that got no gradient arrives as the zeros the rule
                # is given (`materialize_grads`); an output whose gradient is all zeros is
                # left out of what the zeroed fraction pairs (it has no element to zero).
                got = [g for g in got if g.layout != torch.strided or bool(g.any())]
            group = groups.get((site, step))
            if group is None:
                group = groups[(site, step)] = Gradients()
            group.calls += 1
            if len(got) == 1 and len(gave) == 1 and gave[0].shape == got[0].shape:
                if group.aligned and group.arriving and not (
                    got[0].shape == group.arriving[0].shape
                    and got[0].dtype == group.arriving[0].dtype
                    and gave[0].dtype == group.returned[0].dtype
                ):
                    group.aligned = False
                group.pairs.append((gave[0], got[0]))
            else:
                group.aligned = False
                if len(got) == 1:
                    shape = got[0].shape
                    group.pairs += [(g, got[0]) for g in gave if g.shape == shape]
            group.arriving += got
            group.returned += gave
        self.sink(groups)


class _NodeRecord:
    """Left on an op's backward node while recording, with the node's row known at the
    call (a module's rule, a call inside a backward pass): the node's backward hands it
    what the rule returned (None where an input is no tensor or needs no gradient) and
    what the node got, which it adds to the entries of the backward pass running."""

    __slots__ = ("recorder", "site", "task")

    def __init__(self, recorder: Recorder, site: Site, task: int) -> None:
        self.recorder = recorder
        self.site = site
        self.task = task

    def __call__(self, returned: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        recorder = self.recorder
        if not recorder.started:
            return  # a graph built while recording, run backward after
        task = self.task
        if task < 0:
            task = _pass_now()
        # (else: a node made by a forward inside a backward pass, a reentrant checkpoint's
        # recomputation, which belongs to that outer pass)
        run = recorder._pending.get(task)
        if run is None:
            run = recorder._open(task)
        if run.recorded:
            run.entries.append((self.site, returned, grad_outputs))


class _Call(tuple[Any, ...]):
    """What an op call in a forward leaves on its node, for its row to be found when a
    recorded pass reaches the node: `(recorder, op, extras, stack, index, passes)`, the op,
    its arguments other than tensors (the tensors are not kept), the call stack then, the
    order of the call, and the recorder's `passes` then. A tuple, made by one call of C:
    what each op call of a recorded forward pays (made in `Recorder.op_call`). The node's
    backward hands it what the rule returned and what the node got, as to a `_NodeRecord`."""

    __slots__ = ()

    def __call__(self, returned: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        recorder: Recorder = self[0]
        if not recorder.started:
            return  # a graph built while recording, run backward after
        task = _pass_now()
        run = recorder._pending.get(task)
        if run is None:
            stack = self[3]  # (the model outermost on it: called inside the model's call)
            if stack[0] is not recorder.model and recorder._place(stack)[0] is None:
                return  # called outside the model: not one of its passes
            run = recorder._open(task)
        if not run.recorded:
            return  # a step not recorded: what most nodes meet with every=N
        lag = run.step - self[5]  # (steps since its forward: see `Recorder._arm`)
        if lag > run.lag:
            run.lag = lag
        row = run.row_of(self, recorder)
        if row is not None:  # (None: called outside the model, or a grad_hook's transform)
            run.entries.append((row, returned, grad_outputs))

    def row(self, recorder: Recorder) -> tuple[Site | None, Any]:
        path, recipes = recorder._place(self[3])
        if path is None:
            return None, None
        return recorder._row(self[1], self[2], path, recipes, self[4])


# `isinstance(value, Tensor)` as one callable of C's.
_is_tensor: Callable[[Any], bool] = Tensor.__instancecheck__


class _Pass:
    """A backward pass while it runs: its step, whether it is recorded, what it recorded."""

    __slots__ = ("entries", "lag", "places", "recorded", "rows", "step")

    def __init__(self, step: int, recorded: bool, places: int) -> None:
        self.step = step
        self.recorded = recorded
        self.places = places  # the recorder's `places` when it began
        self.lag = 0  # the most steps between a call it met and its forward's decision
        self.entries: list[tuple[Any, tuple[Any, ...], tuple[Any, ...]]] = []
        # The rows of the calls met in this pass, by what they are read from (see `row_of`;
        # many calls share one: a spiking neuron's at each time step). Each holds the call
        # read, which keeps the objects of its key alive (their ids stay theirs) until the
        # pass ends.
        self.rows: dict[tuple[int, ...], tuple[Site | None, Any, _Call]] = {}

    def row_of(self, call: _Call, recorder: Recorder) -> Site | None:
        # What its row is read from, by identity: the op, the arguments, the stack; read in
        # this pass, or in the last recorded one (a training step's calls are the last's).
        _, op, extras, stack, _, _ = call
        key = (id(op), len(extras), *map(id, extras), *map(id, stack))
        known = self.rows.get(key)
        if known is None:
            places, before = recorder.rows_before
            known = before.get(key) if places == recorder.places else None
            if known is None or known[0] is None:  # (outside the model then: read again)
                site, late = call.row(recorder)
                self.rows[key] = (site, late, call)
                return site
            self.rows[key] = known
        known_site, late, _ = known
        if late is not None and known_site is not None:
            recorder._last[late] = known_site  # (as reading it again would)
        return known_site


# (start, end, passes, outer, thread): the autograd sequence numbers [start, end) of the
# nodes made by a forward not recorded, the recorder's `passes` when it began, the backward
# pass it ran in (a checkpoint's recomputation) or -1, and its thread's `_thread_number`
# (sequence numbers are counted per thread, from zero in each).
_Range = tuple[int, int, int, int, int]
_RANGES_KEPT = 64
_CALM = 4

# The sequence number the next backward node made in this thread gets.
_sequence_now: Callable[[], int] = torch._C._autograd._get_sequence_nr
_get_ident = threading.get_ident
_THREAD_NUMBERS = count(1)


def _thread_number() -> int:
    """This thread's number: unlike its id, which the system gives again to a thread started
    after it ended (whose nodes' sequence numbers, counted from zero again, would be taken
    for the ended one's), never another thread's."""
    number: int | None = getattr(_THREAD, "number", None)
    if number is None:
        number = _THREAD.number = next(_THREAD_NUMBERS)
    return number


# A forward's entry in `Recorder._began` while its start is decided.
_STARTING = (0, 0, -1, 0)


# Every pass not recorded, while it is one of the last `_SKIPPED_KEPT` such passes to begin:
# the passes running at once, in any thread, are far fewer.
_SKIPPED = _Pass(-1, False, 0)
_SKIPPED_KEPT = 64


class _PassEnd:
    """Queued at a backward pass's end: hands the pass's entries to the recorder; if the
    pass failed, autograd frees it without calling it, and it hands them on then."""

    __slots__ = ("done", "recorder", "task")

    def __init__(self, recorder: Recorder, task: int) -> None:
        self.recorder = recorder
        self.task = task
        self.done = False

    def __call__(self) -> None:
        self.done = True
        self.recorder._flush(self.task)

    def __del__(self) -> None:
        if not self.done:
            self.recorder._flush(self.task)


class _MeasuredTransform:
    """A grad_hook's transform, recording what it got and gave while its recorder records.
    Saved or copied (with its module), it is the transform itself again."""

    __slots__ = ("monitored_transform", "recorder", "site")

    def __init__(self, transform: Callable[[Tensor], Tensor | None], site: Site,
                 recorder: Recorder) -> None:
        self.monitored_transform = transform
        self.site = site
        self.recorder = recorder

    def __call__(self, grad: Tensor) -> Tensor | None:
        out = self.monitored_transform(grad)
        recorder = self.recorder
        if recorder.started and not is_dynamo_compiling():
            recorder.record_transform(self.site, grad, grad if out is None else out)
        return out

    def __reduce__(self) -> Any:
        return (_unwrapped, (self.monitored_transform,))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return self.monitored_transform


def _unwrapped(transform: Any) -> Any:
    """Unpickling a monitored transform: the transform."""
    return transform


def _node_of(out: Any) -> Any:
    """The backward node of an op's output (its first tensor output needing grad)."""
    if isinstance(out, Tensor):
        return out.grad_fn
    for leaf in _leaves(out):
        if isinstance(leaf, Tensor) and leaf.grad_fn is not None:
            return leaf.grad_fn
    return None


def _leaves(out: Any) -> Iterator[Any]:
    from torch.utils import _pytree as pytree

    yield from pytree.tree_leaves(out)


def _recipe_module_type() -> type:
    """The recipes' module form, or a class nothing is an instance of before any recipe was
    imported."""
    base = _recipes_base()
    return base.RecipeModule if base is not None else _Never


_RECIPES_BASE: list[Any] = []  # the recipes' base module, once imported


def _recipes_base() -> Any:
    if _RECIPES_BASE:
        return _RECIPES_BASE[0]
    base = sys.modules.get("gradoverride.recipes._base")
    if base is not None:
        _RECIPES_BASE.append(base)
    return base


def _code_of(op: Any) -> Any:
    """What one op's calls share with the ops made from the same function: its code."""
    return getattr(getattr(op, "__wrapped__", None), "__code__", op)


def _recipe_type() -> type:
    """The recipes' base class, or a class nothing is an instance of before any recipe was
    imported."""
    base = _recipes_base()
    return base.Recipe if base is not None else _Never


def _op_settings(op: Any) -> tuple[Any, ...]:
    """What tells an op from others made from the same function: the values its forward
    and its rule close over and default to (`make(2.0)` and `make(10.0)` differ; the ops a
    forward makes anew at each call from the same values do not). Numbers and strings by
    value, recipes by repr, modules and ops by identity; other values (tensors) do not
    count."""
    forward = getattr(op, "__wrapped__", None)
    if forward is None:
        return (id(op),)
    spec = getattr(op, "_rule", None)
    rule = getattr(spec, "rule", None)
    values: list[Any] = [getattr(getattr(rule, "__code__", None), "co_firstlineno", None)]
    for fn in (forward, rule):
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                values.append(cell.cell_contents)
            except ValueError:  # an empty cell
                values.append(None)
        values += list(getattr(fn, "__defaults__", None) or ())
        values += list((getattr(fn, "__kwdefaults__", None) or {}).values())
    return tuple(_setting(v) for v in values)


def _setting(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | complex | str):
        return value
    if isinstance(value, _recipe_type()):
        return repr(value)
    if isinstance(value, nn.Module | CustomBackward):
        return id(value)
    if isinstance(value, tuple):
        return tuple(_setting(v) for v in value)
    return type(value).__name__


# -- each thread's call stack while recording ---------------------------------------------

_THREAD = threading.local()
# Bumped at each recorder's start: a thread's stack from before (a call that never ended,
# as under a KeyboardInterrupt, which skips torch's always-called hooks) is dropped.
_GENERATION = 0


# The modules of torch.nn whose calls run no code of a user's but the modules they hold:
# an override is never called with one of them the innermost module (unless a hook of its
# own calls it). The transformer layers are not among them: they call the `activation`
# they are given, which may be an override.
_TORCH_LAYERS = "torch.nn.modules."
_CALLS_GIVEN = "torch.nn.modules.transformer"


def _own_hooks(module: nn.Module) -> bool:
    """Whether the module's calls keep the call stack through hooks of the recorder's on
    the module itself (every other module's keep it during the first forward only, through
    torch's global hooks): the model itself, and every module whose own code (its forward, or
    its hooks) may call an override, that is every module but torch's plain layers and
    containers, and but a recipe's module form, whose forward keeps itself on the stack
    (see `Recorder.recipe_call`)."""
    if module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__:
        return True  # (hooks, or a forward set on the module itself)
    if type(module) is _recipe_module_type():
        return False
    where = type(module).__module__
    return not where.startswith(_TORCH_LAYERS) or where == _CALLS_GIVEN


def _stack() -> list[Any]:
    """This thread's running module and recipe calls, outermost first."""
    thread = _THREAD
    if getattr(thread, "generation", -1) == _GENERATION:
        return thread.stack  # type: ignore[no-any-return]
    stack: list[Any] = []
    thread.stack, thread.generation = stack, _GENERATION
    return stack


def _forget_stacks() -> None:
    """Drop the call stacks (a call that never ended leaves its entries, holding modules):
    this thread's now, the others' at their next module call."""
    global _GENERATION
    _GENERATION += 1
    _THREAD.__dict__.pop("stack", None)


def _entered(module: nn.Module, args: Any) -> None:
    """A module call under the global hooks (the first forward): the model's modules
    hooked on their own are left to those (see `_entered_own`)."""
    if is_dynamo_compiling():
        return  # compiled calls are not recorded (and a compiled graph keeps no stack)
    try:
        recorder = RECORDING[0]
    except IndexError:  # (none, or gone meanwhile: see `RECORDING`)
        recorder = None
    if recorder is None or not recorder._global or _hooked_own(recorder, module):
        # (`_global` is off once the global hooks start going: a call met then belongs
        # to a forward that began after, which they never counted, and may find them gone
        # at its end)
        return
    stack = _stack()
    if not stack:  # an outermost call
        if not recorder.forward_began():
            return  # (the global hooks went meanwhile: none runs at its end)
        if recorder.runs_model(module):
            recorder.new_forward()
    if "_orig_mod" in module._modules:
        recorder.compiled_call(module)
    if (module._forward_pre_hooks or module._forward_hooks) and id(module) not in recorder.paths:
        recorder._path_of_new(module)  # added to the model since? its grad_hooks
    if module._forward_hooks:
        # torch runs the global forward hooks before the module's own: the module leaves
        # the stack after its own forward hooks instead (ops they call are its rows).
        stack.append(_LeftLate(module))
    else:
        stack.append(module)


def _entered_own(module: nn.Module, args: Any) -> None:
    """`_entered`, as a hook of the module itself (see `Recorder._hook_own`)."""
    if is_dynamo_compiling():
        return
    thread = _THREAD  # (`_stack()`, inline: every hooked module call reads it twice)
    stack = thread.stack if getattr(thread, "generation", -1) == _GENERATION else _stack()
    try:
        recorder = RECORDING[0]
    except IndexError:  # (none, or gone meanwhile: see `RECORDING`)
        recorder = None
    if recorder is not None:
        if not stack:
            if recorder._global:
                recorder.forward_began()  # (the first forward's end removes the global hooks)
            recorder.new_forward()
        if "_orig_mod" in module._modules:
            recorder.compiled_call(module)
        if id(module) not in recorder.paths:
            recorder._path_of_new(module)  # added to the model since? its grad_hooks
    hooks = module._forward_hooks
    if len(hooks) > 1 and next(reversed(hooks.values())) is not _LEFT_OWN:
        stack.append(_LeftLate(module))  # hooks of its own run after this recorder's
    else:
        stack.append(module)


def _put_first(module: nn.Module, handle: Any) -> None:
    """The recorder's pre-hook `handle` on `module` first among the module's again, in
    place, if a pre-hook of its own was prepended since (as the global one ran before it:
    an override the other calls is the module's)."""
    hooks = cast("OrderedDict[int, Any]", module._forward_pre_hooks)  # (torch's kind)
    # (KeyError: removed meanwhile, the recorder stopped; RuntimeError: another thread
    # registered a hook on the module as this one read them)
    with contextlib.suppress(KeyError, RuntimeError):
        if next(iter(hooks.values()), None) is not _ENTERED_OWN:
            hooks.move_to_end(handle.id, last=False)


def _hooked_own(recorder: Recorder, module: nn.Module) -> bool:
    """Whether `module` has the recorder's own hooks (which keep the stack for it)."""
    own = recorder._own.get(id(module))
    return own is not None and own[0] is module


def _left_global(module: nn.Module, args: Any, out: Any) -> None:
    """`_left` under the global hooks: the model's modules hooked on their own are left
    to those."""
    try:
        recorder = RECORDING[0]
    except IndexError:  # (none, or gone meanwhile: see `RECORDING`)
        recorder = None
    if recorder is not None and recorder._global and not _hooked_own(recorder, module):
        _left(module, args, out)


def _left(module: nn.Module, args: Any, out: Any) -> None:
    if is_dynamo_compiling():
        return
    thread = _THREAD
    stack = thread.stack if getattr(thread, "generation", -1) == _GENERATION else _stack()
    if stack and stack[-1] is module:
        stack.pop()  # (what nearly every call meets: its own entry on top)
        if not stack:
            for recorder in RECORDING:
                recorder.forward_ended()
        return
    if stack and isinstance(stack[-1], _Late) and stack[-1].module is module:
        return  # its own forward hooks run next, then its `_LeftLate`
    running = bool(stack)
    _pop(stack, module)
    if running and not stack:
        for recorder in RECORDING:
            recorder.forward_ended()


def _inert_hook(*args: Any) -> None:
    """What a recorder's module hook is in a copy of the module (deepcopy, pickle)."""


class _OwnHook:
    """A recorder's hook on one of the model's modules: a module copied or saved while
    recorded carries a hook that does nothing instead (one that kept a call stack, with no
    recorder to remove it)."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        return (_make_inert, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return _inert_hook


def _make_inert() -> Any:
    return _inert_hook


class _EnteredOwn(_OwnHook):
    __slots__ = ()
    __call__ = staticmethod(_entered_own)


class _LeftOwn(_OwnHook):
    __slots__ = ()
    __call__ = staticmethod(_left)


_ENTERED_OWN = _EnteredOwn()
_LEFT_OWN = _LeftOwn()


class _Late:
    """A stack entry whose module leaves after its own forward hooks."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module) -> None:
        self.module = module


class _LeftLate(_Late):
    """The stack entry of a call of a module with forward hooks of its own, and a forward
    hook registered on the module as the call starts, so that it runs after them: takes
    this call's entry off the stack (not another call's: a recursive call, or another
    thread's), and itself off the module."""

    __slots__ = ("handle", "thread")

    _ALL: ClassVar[set[_LeftLate]] = set()  # registered and not run yet (`remove_all`)

    def __init__(self, module: nn.Module) -> None:
        super().__init__(module)
        self.thread = threading.get_ident()
        self.handle = module.register_forward_hook(self, always_call=True)
        _LeftLate._ALL.add(self)

    def __call__(self, module: nn.Module, args: Any, out: Any) -> None:
        if threading.get_ident() != self.thread:
            return  # another thread's call of the module
        stack = _stack()
        if not (stack and stack[-1] is self):
            return  # an outer call's (a recursive call ends first)
        stack.pop()
        self.handle.remove()
        _LeftLate._ALL.discard(self)
        if not stack:
            for recorder in RECORDING:
                recorder.forward_ended()

    @staticmethod
    def remove_all() -> None:
        """Take off the modules every one left (calls that never ended)."""
        for late in list(_LeftLate._ALL):
            late.handle.remove()
        _LeftLate._ALL.clear()


def _pop(stack: list[Any], module: nn.Module) -> None:
    # Down to this module's entry: a hook that raised after ours ran leaves nothing behind.
    # (Not there: the recorder started while this module's forward ran.)
    for k in range(len(stack) - 1, -1, -1):
        entry = stack[k]
        if entry is module or (isinstance(entry, _Late) and entry.module is module):
            del stack[k:]
            break


class _Never:
    pass


def _subject(op: CustomBackward[..., Any], args: tuple[Any, ...]) -> tuple[Any, str]:
    """What a row names for a call of `op` (`args`: all its arguments, or those that are not
    tensors): the recipe among its arguments, the transform of a grad_hook's op (its first
    argument that is not a tensor), else the op itself."""
    transform = sys.modules.get("gradoverride._transform")
    if transform is not None and op in (
        transform.transformed, transform.transformed_private, transform.transformed_all
    ):
        return next(a for a in args if not isinstance(a, Tensor)), "grad_hook"
    base = _recipes_base()
    if base is not None:
        recipe = base.Recipe
        for arg in args:
            if isinstance(arg, recipe):
                return arg, "recipe"
    return op, "op"


def describe_transform(fn: Any) -> str:
    """A grad_hook's transform as a row names it: a recipe's repr, else the function's name."""
    if isinstance(fn, _MeasuredTransform):
        fn = fn.monitored_transform
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type):
        base = sys.modules.get("gradoverride.recipes._base")
        if base is not None and isinstance(owner, base.Recipe | nn.Module):
            return one_line(repr(owner))
    return describe(fn)

