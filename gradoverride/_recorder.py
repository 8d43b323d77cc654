"""Seeing every override of a model run: which ran where, and the gradients each one got and
gave back. What `go.monitor` and `go.overrides` (with example inputs) are built on.

While a recorder is started:

* every op call (each `custom_backward` / `straight_through` op, the recipes' ops, the ops
  of `go.Module` and `override_backward`) consults the recorder (`RECORDERS`, read by the
  ops' entries), which registers a hook on the backward node of the op's output (autograd's
  `Node.register_hook`): it hands what that node got and returned to the recorder, exactly
  the override's own gradients, whatever else reads its inputs, with no identity op added
  and no tensor copied;
* the row of an op called in a module's forward is that module's path, read from the call
  stack (the nearest frame whose `self` is one of the model's modules);
* each `grad_hook` transform in the model is wrapped, in place (the module hook's attribute,
  or the parameter's hook dict, which keeps its order among other hooks).

Nothing is registered on the model itself, so a model saved or copied while recorded carries
none of it. A step is one backward pass that reaches an override of the model: the
gradients of a pass (autograd's graph task, so that two threads' passes running at once
stay apart) are handed to the recorder's `sink` at its end (`queue_callback`), grouped by
override; a pass that fails is handed on when autograd drops its callback, and a reentrant
checkpoint's nested pass is part of the pass that recomputed it. With `every=N`, the ops
of an unrecorded step only mark one node, whose backward counts the pass.

Stopping restores every transform and leaves the list the ops consult: afterwards nothing
of the recorder is left and an op call costs what it did before.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.compiler import is_dynamo_compiling

from ._decorators import CustomBackward
from ._errors import GradOverrideError
from ._function import RECORDERS
from ._internals import graph_task_id, transforms_active
from ._module import Module
from ._signature import describe
from ._table import one_line

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


# How many frames up from an op call to look for the module calling it.
_FRAMES = 12
_MARK: Any = object()  # a node of an unrecorded step: its backward only counts the pass


def queue_callback(callback: Callable[[], None]) -> None:
    """Run `callback` when the backward pass running now ends (what DDP uses)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def current_pass() -> int:
    """The id of the backward pass (autograd's graph task) running in this thread, -1
    outside one (and always, on a torch that does not say: passes then share one id)."""
    task = graph_task_id()
    return -1 if task is None else task

Sink = Callable[[dict[tuple[Site, int], Gradients]], None]


def model_paths(model: nn.Module) -> dict[int, str]:
    """Each module of `model` by id, with its path (a module reached twice: its first)."""
    return {id(m): name for name, m in model.named_modules()}


# The recorder started now, if any: one at a time (see `Recorder.start`).
_STARTED: list[Recorder] = []


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
        # Places seen before (see `_seen_before`): (op, calling code) -> [(the codes of the
        # frames up to the module's, the recipe argument's index or -1, the frame holding
        # the recipe or -1)], and (op, module) -> (the recipe of the last call, its site).
        # Ids of ops and modules, which stay alive.
        self._known: dict[tuple[int, Any], list[tuple[tuple[Any, ...], int, int]]] = {}
        self._by_owner: dict[tuple[int, int], tuple[Any, Site]] = {}
        self._positions: dict[str, int] = {}
        self._outside: set[int] = set()  # ids of modules met that are not in the model
        self._count = 0
        self._sites: dict[tuple[Any, ...], Site] = {}
        # Per backward pass (autograd's graph task id): (site, span), returned,
        # needs_input_grad, arriving, one per backward call (appended from autograd's
        # threads; list.append is atomic). Two threads' passes, running at once, stay apart.
        self._pending: dict[int, list[tuple[Any, tuple[Any, ...], tuple[Any, ...]]]] = {}
        self._counting = threading.Lock()  # `passes += 1` from two threads' flushes
        self.started = False

    # -- starting and stopping ------------------------------------------------------------

    def start(self) -> None:
        if _STARTED:
            # A second recorder would see the ops' calls the first one sees, and one node's
            # gradients would be recorded twice.
            msg = (
                f"{self.purpose} cannot start while {_STARTED[0].purpose} is recording: one "
                "model is recorded at a time (a second recorder would silently record "
                "nothing). To watch several models at once, monitor one container holding "
                "them (`go.monitor(nn.ModuleList([generator, discriminator]))`); to list a "
                "model's overrides during a monitored run, call `go.overrides(model)` "
                "without example inputs, or with them outside the monitor's `with` block."
            )
            raise GradOverrideError(msg)
        _STARTED.append(self)
        self.paths = model_paths(self.model)
        self._positions = {path: k for k, path in enumerate(self.paths.values())}
        self._wrap_hook_transforms()
        RECORDERS.append(self)
        self.started = True

    def stop(self) -> None:
        if self in RECORDERS:
            RECORDERS.remove(self)
        for task in sorted(self._pending):
            self._flush(task)  # a backward pass still running in another thread
        for hook, transform in self._retransformed:
            hook.transform = transform
        self._retransformed = []
        self.started = False
        if self in _STARTED:
            _STARTED.remove(self)

    # -- the ops' consult point ---------------------------------------------------------------

    def op_call(self, op: CustomBackward[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], run: Callable[[], Any]) -> Any:
        """An op called while recording (eager): `run()` makes the call."""
        if self.substitute is not None:
            site = self._site_of(op, args, 5)  # above _caller_path, _site_of, here, the op's two
            if site is not None:
                return self.substitute(site, op, args, kwargs)
        out = run()
        if torch.is_grad_enabled() and not transforms_active():
            self._observe(op, args, out, None)
        if self.on_call is not None:
            self._called(op, args)
        return out

    def module_call(self, module: nn.Module, op: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any], run: Callable[[], Any]) -> Any:
        """A module's rule called while recording (eager): `run()` makes the call."""
        site = self._module_site(module)
        if site is not None and self.substitute is not None:
            return self.substitute(site, op, (module, *args), kwargs)
        out = run()
        if site is not None and torch.is_grad_enabled() and not transforms_active():
            self._observe(op, args, out, site)
        return out

    def module_output(self, module: nn.Module, op: Any, out: Any) -> None:
        """A module's rule attached to `out` by its forward hooks (`override_backward`)."""
        site = self._module_site(module)
        if site is not None and not transforms_active():
            self._observe(op, (), out, site)

    def _wrap_hook_transforms(self) -> None:
        """Each grad_hook in the model records what its transform gets and gives."""
        hooks_module = sys.modules.get("gradoverride._hooks")
        if hooks_module is None:
            return  # no grad_hook was ever made
        for module in self.model.modules():
            path = self.paths[id(module)]
            for place, hook in hooks_module.grad_hooks_on(module):
                if isinstance(hook.transform, _MeasuredTransform):
                    continue
                site = self._make_site(path, hook.transform, "grad_hook", f" at {place}")
                # Every grad_hook reads its `transform` when it applies it.
                self._retransformed.append((hook, hook.transform))
                hook.transform = _MeasuredTransform(hook.transform, site, self)

    # -- during forward ---------------------------------------------------------------------

    @property
    def recording(self) -> bool:
        """Whether the backward pass about to run (or running) is a recorded step."""
        return self.passes % self.every == 0

    def _observe(self, op: Any, args: tuple[Any, ...], out: Any, site: Site | None) -> None:
        node: Any = out.grad_fn if isinstance(out, Tensor) else _node_of(out)
        if node is None or getattr(node, "gradoverride", None) is None:
            return  # no gradient flows here, or not one of our Functions' nodes
        # A forward inside a backward pass (a reentrant checkpoint recomputing a segment,
        # whose backward then runs as a pass of its own): the nodes belong to the outer pass.
        outer = current_pass()
        if outer >= 0 and outer not in self._pending:
            self._open(outer)  # (the outer pass is the one running: queued at its end)
        if site is None:
            site = self._seen_before(op, args)
        if site is None:
            site = self._site_of(op, args)
            if site is None:
                return  # called outside the model
        if self.passes % self.every != 0:
            # Not a recorded step: the hook only counts the backward pass when it runs.
            node.register_hook(_NodeHook(self, _MARK, (), outer))
            return
        # One gradient per tensor input, None where the input needs none; an attaching
        # Function (a rule owning some inputs) then passes its outputs' gradients on into
        # the ordinary graph, which are not the rule's.
        needs = tuple(fn is not None for fn, _ in node.next_functions)
        if getattr(getattr(node, "_forward_cls", None), "_gradoverride_attaches", False):
            needs = needs[: node.gradoverride[0].n_tensor_in]
        node.register_hook(_NodeHook(self, site, needs, outer))

    def _seen_before(self, op: CustomBackward[..., Any], args: tuple[Any, ...]) -> Site | None:
        """The site of a call from a place seen before: the same op, the same chain of
        calling code up to the module's frame (compared frame by frame, so a helper called
        from two modules, or a child's `forward` called directly, are told apart), the same
        module and the same recipe argument; what `_site_of` found then, with one frame's
        locals read. None for anything else, which `_site_of` resolves."""
        start = sys._getframe(5)  # the op's caller (above this, _observe, op_call, the op's two)
        places = self._known.get((id(op), start.f_code))
        if places is None:
            return None
        for chain, at, at_frame in places:
            frame: Any = start
            recipe = None
            for k, code in enumerate(chain):
                if frame is None or frame.f_code is not code:
                    break
                if k == at_frame:
                    recipe = frame.f_locals.get("self")
                if k < len(chain) - 1:
                    frame = frame.f_back
            else:
                entry = self._by_owner.get((id(op), id(frame.f_locals.get("self"))))
                if entry is None:
                    return None
                subject, site = entry
                if at_frame >= 0:
                    return site if recipe is subject else None
                if at < 0 or (at < len(args) and args[at] is subject):
                    return site
                return None  # another recipe object than last time (one made each call)
        return None

    def _called(self, op: CustomBackward[..., Any], args: tuple[Any, ...]) -> None:
        if self.on_call is None:
            return
        found = self._caller_path(5)  # above _caller_path, _called, op_call and the op's two
        if found is None:
            return
        subject, kind = _subject(op, args)
        if kind == "op" and found[3] is not None:  # a recipe whose __call__ called the op
            subject, kind = found[3][0], "recipe"
        if kind != "grad_hook":  # hooks: listed from the modules
            self.on_call(found[0], subject)

    def _caller_path(self, depth: int) -> tuple[str, Any, int, tuple[Any, int] | None] | None:
        """The innermost module of the model whose forward (or hook) is running in this
        thread: the nearest frame whose `self` is one of the model's modules, read off the
        call stack (`depth` frames up is the op's caller); its path, the module, how many
        frames above the caller it is, and the nearest recipe on the way (a frame whose
        `self` is a recipe, with its distance: the recipe whose `__call__` called the op).
        A hook on every module to track this would cost more than the override itself in a
        small recurrent layer."""
        paths = self.paths
        recipe_type = _recipe_type()
        recipe: tuple[Any, int] | None = None
        frame: Any = sys._getframe(depth)
        for distance in range(_FRAMES):
            if frame is None:
                return None
            if frame.f_code.co_argcount:
                owner = frame.f_locals.get("self")
                path = paths.get(id(owner)) if owner is not None else None
                if path is None and isinstance(owner, nn.Module):
                    path = self._path_of_new(owner)
                    paths = self.paths
                if path is not None:
                    return path, owner, distance, recipe
                if recipe is None and isinstance(owner, recipe_type):
                    recipe = (owner, distance)
            frame = frame.f_back
        return None

    def _path_of_new(self, module: nn.Module) -> str | None:
        """The path of a module added to the model after the recorder started (the paths
        are read again), or None for a module outside the model (remembered)."""
        if id(module) in self._outside:
            return None
        self.paths = model_paths(self.model)
        self._positions = {path: k for k, path in enumerate(self.paths.values())}
        path = self.paths.get(id(module))
        if path is None:
            self._outside.add(id(module))
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
        if site is None:
            site = self._sites[key] = Site(path, type(module).__name__, kind,
                                           index=self._next_index())
        return site

    def _site_of(self, op: CustomBackward[..., Any], args: tuple[Any, ...],
                 depth: int = 6) -> Site | None:
        """The row of a call of `op` with `args`; `depth` frames up is the op's caller (6:
        above _caller_path, _site_of, _observe, op_call and the op's two)."""
        found = self._caller_path(depth)
        if found is None:
            return None  # called outside the model's forward
        path, owner, distance, caller = found
        subject, kind = _subject(op, args)
        at_frame = -1
        if kind == "op" and caller is not None:  # a recipe whose __call__ called the op
            subject, kind = caller[0], "recipe"
            at_frame = caller[1]
        if isinstance(subject, _MeasuredTransform):
            return None  # a grad_hook's transform, which records itself
        # A recipe by its settings (its repr): one made at each call is still one row.
        key = (id(op), path, repr(subject) if kind == "recipe" else id(subject))
        site = self._sites.get(key)
        if site is None:
            site = self._sites[key] = self._make_site(path, subject, kind)
        if depth == 6:  # from _observe: remember the place for `_seen_before`
            at = -1 if subject is op or at_frame >= 0 else next(
                (k for k, a in enumerate(args) if a is subject), len(args)
            )
            frame: Any = sys._getframe(depth - 1)  # the op's caller
            chain = []
            for _ in range(distance + 1):  # the codes up to the module's frame, included
                chain.append(frame.f_code)
                frame = frame.f_back
            places = self._known.setdefault((id(op), chain[0]), [])
            place = (tuple(chain), at, at_frame)
            if place not in places:
                places.append(place)
            self._by_owner[(id(op), id(owner))] = (subject, site)
        return site

    def _next_index(self) -> int:
        self._count += 1
        return self._count

    def position(self, site: Site) -> tuple[int, int]:
        """Where `site` sorts: its module's place in the model, then the order met."""
        return self._positions.get(site.path, len(self._positions)), site.index

    def _make_site(self, path: str, subject: Any, kind: str, suffix: str = "") -> Site:
        if isinstance(subject, CustomBackward):
            name = getattr(subject, "__name__", subject._name)
        elif kind == "grad_hook":
            name = f"grad_hook({describe_transform(subject)}){suffix}"
        else:
            name = one_line(repr(subject))
        return Site(path, name, kind, subject, index=self._next_index())

    # -- during backward --------------------------------------------------------------------

    def record_transform(self, site: Site, arriving: Tensor, returned: Tensor) -> None:
        """A grad_hook's transform ran (see `_MeasuredTransform`)."""
        task = current_pass()
        entries = self._pending.get(task)
        if entries is None:
            entries = self._open(task)
        entries.append((site, (returned,), (arriving,)))

    def _open(self, task: int) -> list[Any]:
        """The entries of backward pass `task`, handed to the sink at its end. A pass that
        fails (an error in a backward) never runs its callbacks; autograd then drops them,
        and the entries are handed on as that pass's step when `_PassEnd` is freed, so
        that the next passes are steps of their own and nothing is kept."""
        fresh: list[Any] = []
        entries = self._pending.setdefault(task, fresh)  # (atomic: two threads of one pass)
        if entries is fresh:
            queue_callback(_PassEnd(self, task))
        return entries

    def _flush(self, task: int) -> None:
        pending = self._pending.pop(task, None)
        if pending is None:
            return  # flushed already (by `stop`)
        groups: dict[tuple[Site, int], Gradients] = {}
        with self._counting:
            step = self.passes
            self.passes += 1
        for site, returned, arriving in pending:
            gave = [g for g in returned if g is not None]
            got = [g for g in arriving if g is not None]
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


class _NodeHook:
    """On an op's backward node while recording: hands what the node got and returned (for
    its tensor inputs; the first `span` of them for an attaching Function, whose others are
    its outputs' gradients passed on) to the entries of the backward pass running."""

    __slots__ = ("needs", "recorder", "site", "task")

    def __init__(self, recorder: Recorder, site: Any, needs: tuple[bool, ...],
                 task: int) -> None:
        self.recorder = recorder
        self.site = site
        self.needs = needs  # per tensor input: whether its gradient is the rule's, and needed
        self.task = task

    def __call__(self, grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> None:
        recorder = self.recorder
        task = self.task
        if task < 0:
            task = current_pass()
        # (else: a node made by a forward inside a backward pass, a reentrant checkpoint's
        # recomputation, which belongs to that outer pass)
        entries = recorder._pending.get(task)
        if entries is None:
            entries = recorder._open(task)
        if self.site is _MARK:
            return
        needed = zip(grad_inputs, self.needs, strict=False)
        returned = tuple(g for g, needs in needed if needs)
        entries.append((self.site, returned, tuple(grad_outputs)))


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
        if recorder.started and recorder.recording and not is_dynamo_compiling():
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


def _recipe_type() -> type:
    """The recipes' base class, or a class nothing is an instance of before any recipe was
    imported."""
    base = sys.modules.get("gradoverride.recipes._base")
    return base.Recipe if base is not None else _Never


class _Never:
    pass


def _subject(op: CustomBackward[..., Any], args: tuple[Any, ...]) -> tuple[Any, str]:
    """What a row names for a call of `op`: the recipe among its arguments, the transform
    of a grad_hook's op, else the op itself."""
    transform = sys.modules.get("gradoverride._transform")
    if transform is not None and op in (transform.transformed, transform.transformed_private):
        return args[1], "grad_hook"
    if transform is not None and op is transform.transformed_all:
        return args[0], "grad_hook"
    base = sys.modules.get("gradoverride.recipes._base")
    if base is not None:
        for arg in args:
            if isinstance(arg, base.Recipe):
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

