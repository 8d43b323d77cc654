"""`grad_hook`: transform the gradient at a module's inputs, outputs or parameters.

Built on tensor hooks (`Tensor.register_hook`), not on `register_full_backward_hook`:

* an in-place op right after the module (`nn.ReLU(inplace=True)`) is fine: a hook on the
  module's output sees the gradient with respect to the value the module returned;
* keyword-argument inputs and any number of inputs and outputs (nested in tuples, lists,
  dicts) are covered;
* it traces under `torch.compile(fullgraph=True)` with no graph break and without compiled
  autograd (full backward hooks are skipped there).

Order: transforms at the same place compose in registration order, the first registered
receiving the incoming gradient first.
"""

from __future__ import annotations

import secrets
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import Tensor, nn
from torch.compiler import is_dynamo_compiling
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from ._backends import backend
from ._errors import GradOverrideError, GradOverrideTypeError
from ._frameworks import autograph_artifact, is_keras_layer, require_tensorflow_keras
from ._function import RECORDING, break_compiled_transform, exporting_onnx
from ._internals import add_tensor_hook, is_tracing, tracing_state, transforms_active
from ._jit import RefuseScripting, jit_message
from ._passthrough import related, shows_input
from ._signature import describe

if TYPE_CHECKING:
    from .recipes._base import GradientTransform

__all__ = ["HookHandle", "grad_hook"]

Place = Literal["inputs", "outputs", "parameters"]
# `Tensor.register_hook` is untyped in torch; this names its type once.
_register_hook: Callable[[Tensor, Callable[[Tensor], Tensor | None]], RemovableHandle] = (
    Tensor.register_hook
)
_PLACES = ("inputs", "outputs", "parameters")
_MARK = "_gradoverride_hooked"  # on a parameter: the tokens of the grad_hooks hooking it


class _Removable(Protocol):
    def remove(self) -> None: ...


class HookHandle:
    """Returned by `grad_hook`; `.remove()` takes the transform away (twice is a no-op)."""

    def __init__(
        self, description: str, handles: list[_Removable], module: nn.Module | None = None
    ) -> None:
        self._description = description
        self._handles = handles
        self._module = module
        self.active = True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.active = False
        if self._module is not None and not _hook_entries(self._module):
            _allow_scripting(self._module)

    @classmethod
    def of(cls, module: nn.Module) -> HookHandle:
        """A handle for every `grad_hook` on `module` (after `torch.load` or a copy, where
        the handle returned at registration does not reach the new module)."""
        entries = _hook_entries(module)
        if not entries:
            msg = (
                f"this {type(module).__name__} has no `go.grad_hook`, so there is no handle "
                "to give; call `HookHandle.of` on the module the hook was registered on."
            )
            raise GradOverrideError(msg)
        return cls(f"the grad_hooks of {type(module).__name__}", entries, module)

    def __enter__(self) -> HookHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<HookHandle {self._description} ({'active' if self.active else 'removed'})>"


def _as_transform(fn: Any) -> Callable[[Tensor], Tensor | None]:
    # Imported here: `import gradoverride` does not load the recipes.
    from .recipes._base import GradientTransform, RecipeModule

    if isinstance(fn, RecipeModule):
        fn = fn.recipe
    if isinstance(fn, GradientTransform):
        transform: Callable[[Tensor], Tensor | None] = fn.transform
        return transform
    if isinstance(fn, nn.Module):
        # A recipe's module form (with its own state, such as a schedule's step count) maps
        # gradients with `.transform`; its forward is the identity, so calling it would not.
        module_transform = getattr(fn, "transform", None)
        if callable(module_transform):
            return module_transform  # type: ignore[no-any-return]
        msg = (
            f"grad_hook got the module {type(fn).__name__} as its transform; a module's "
            "forward is not a gradient map. Pass a function `fn(grad) -> grad` or a gradient "
            "recipe (or a recipe module, which has `.transform`)."
        )
        raise GradOverrideTypeError(msg)
    if not callable(fn):
        msg = (
            f"grad_hook needs a transform `fn(grad) -> grad` (a function or a gradient recipe "
            f"such as `go.recipes.reverse_grad()`), got {type(fn).__name__} {fn!r}."
        )
        raise GradOverrideTypeError(msg)
    return fn  # type: ignore[no-any-return]


def _hook_tensors(tree: Any, transform: Callable[[Tensor], Tensor | None], avoid: Any) -> Any:
    """`transform` on the gradient of each tensor of `tree` (a module's output) that requires
    grad, once each.

    One plain output (made by the module, not a view, not a leaf) gets a tensor hook, which
    fires with the gradient of the value the module returned even when an in-place op
    changes it afterwards: the common case, and the cheapest. Anything else goes through one
    identity Function for all the outputs, which transforms each output's gradient once
    (outputs that alias or derive from one another, where tensor hooks would transform a
    gradient twice, and a parameter returned as-is, which a tensor hook would change for
    good). Its outputs are views where they show one of the module's inputs (`avoid`), a
    leaf or another output, so an in-place op on them is PyTorch's error for views, and
    otherwise tensors an in-place op may change.
    """
    leaves, spec = pytree.tree_flatten(tree)
    places = [
        k for k, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad
    ]
    if not places:
        return tree
    inputs = _tensors(avoid)
    if len(places) == 1:
        t = leaves[places[0]]
        if t._base is None and not t.is_leaf and not shows_input(t, inputs):
            _register_hook(t, transform)
            return tree
    from ._transform import transformed_all

    tensors = [leaves[k] for k in places]
    keep_view = tuple(
        t.is_leaf
        or (t._base is not None and t._base.is_leaf)
        or shows_input(t, inputs)
        or any(related(t, o) for j, o in enumerate(tensors) if j != i)
        for i, t in enumerate(tensors)
    )
    outs = transformed_all(transform, keep_view, *tensors)
    for k, out in zip(places, outs, strict=True):
        leaves[k] = out
    return pytree.tree_unflatten(leaves, spec)


def _tensors(tree: Any) -> tuple[Tensor, ...]:
    return tuple(t for t in pytree.tree_leaves(tree) if isinstance(t, Tensor))


# Values the eager fast paths read as they are: pytree leaves that are tensors of a built-in
# type (a tensor subclass may be registered as a pytree node) or Python scalars.
_PLAIN = frozenset({Tensor, nn.Parameter, int, float, bool, complex, str, type(None)})


def _plain(values: Any) -> bool:
    """Whether every value is one `pytree.tree_leaves` would give back as itself."""
    return _PLAIN.issuperset(map(type, values))


def _plain_tensor(value: object) -> bool:
    t = type(value)
    return t is Tensor or t is nn.Parameter


@autograph_artifact
def grad_hook(
    module: nn.Module,
    fn: Callable[[Tensor], Tensor | None] | GradientTransform,
    *,
    at: Place = "outputs",
) -> HookHandle:
    """Transform the gradient flowing at a module's inputs, outputs or parameters.

    ```python
    import torch
    from torch import nn
    import gradoverride as go

    encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True))
    clip = go.grad_hook(encoder[0], lambda g: g.clamp(-0.01, 0.01), at="inputs")
    reverse = go.grad_hook(encoder[0], go.recipes.reverse_grad(), at="outputs")
    x = torch.randn(4, 8, requires_grad=True)
    encoder(x).sum().backward()
    print(bool(x.grad.abs().max() <= 0.01))
    #> True
    ```

    Args:
        module: any `nn.Module` instance, or a Keras 3 layer (`at="variables"` there for
            its variables; a `gradoverride.keras.LayerHandle` is returned).
        fn: `fn(grad) -> grad` (returning None keeps the gradient), or a gradient recipe
            (`GradientTransform`), whose `transform` is used.
        at: `"outputs"` — the gradient with respect to what the module returned, before it
            flows into the module's backward; `"inputs"` — the gradient the module sends to
            its tensor inputs (positional and keyword), on this path only; `"parameters"` —
            each parameter's gradient, before it is accumulated into `.grad` (so hooks,
            optimizers and DDP see the transformed gradient).

    Returns:
        A `HookHandle`; `.remove()` takes the transform away.
    """
    if is_keras_layer(module):  # first: on Keras' torch backend, a layer is an nn.Module
        require_tensorflow_keras(module, "grad_hook")
        # The Keras layer's handle (a LayerHandle).
        return backend("tensorflow").hook_layer(module, fn, at)  # type: ignore[no-any-return]
    if not isinstance(module, nn.Module):
        msg = (
            f"grad_hook needs an nn.Module instance, got {type(module).__name__} {module!r}; "
            "for a tensor, use `tensor.register_hook(fn)`."
        )
        raise GradOverrideTypeError(msg)
    if at not in _PLACES:
        msg = (
            f"grad_hook got at={at!r}; expected one of {', '.join(repr(p) for p in _PLACES)}."
        )
        raise GradOverrideError(msg)
    transform = _as_transform(fn)
    description = f"{fn!r} at the {at} of {type(module).__name__}"

    if at == "parameters":
        _prepare_eager_hook()
        hooks = _ParameterHooks(transform, type(module).__name__)
        pre = hooks.install(module)
        _refuse_scripting(module)
        _tell_recorder()
        return HookHandle(description, [pre, hooks], module)

    if at == "inputs":
        # prepend=True: a later transform then sits further from the module, so the first
        # registered receives the gradient first, as at the outputs.
        hook = _AtInputs(transform)
        pre = module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
        post = module.register_forward_hook(hook.after, always_call=True)
        _refuse_scripting(module)
        _tell_recorder()
        return HookHandle(description, [pre, post], module)

    handle = module.register_forward_hook(_AtOutputs(transform), with_kwargs=True)
    _refuse_scripting(module)
    _tell_recorder()
    return HookHandle(description, [handle], module)


def _tell_recorder() -> None:
    """A model being recorded (go.monitor) records a grad_hook registered meanwhile."""
    for recorder in RECORDING:
        recorder.hooks_changed()


def grad_hooks_on(module: nn.Module) -> list[tuple[Place, _Transforming | _ParameterHooks]]:
    """The grad_hooks on `module` with their places: at inputs, at outputs, then at
    parameters, each in the order they were registered (what `go.overrides` lists and
    `go.monitor` wraps)."""
    found: list[tuple[Place, _Transforming | _ParameterHooks]] = []
    found += [("inputs", h) for h in module._forward_pre_hooks.values()
              if isinstance(h, _AtInputs)]
    found += [("outputs", h) for h in module._forward_hooks.values()
              if isinstance(h, _AtOutputs)]
    for hook in module._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", None)  # its before_root, a bound method
        if isinstance(owner, _ParameterHooks) and _is_root_hook(hook):
            found.append(("parameters", owner))
    return found


def _is_root_hook(hook: Any) -> bool:
    """Whether `hook` is a parameters hook's own, on the module grad_hook was given."""
    return getattr(hook, "__func__", None) is _ParameterHooks.before_root


def _hook_entries(module: nn.Module) -> list[_Removable]:
    """Every grad_hook on `module`, as removable entries."""
    entries: list[_Removable] = []
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in list(hooks.items()):
            owner = getattr(hook, "__self__", hook)  # bound methods of _ParameterHooks
            if isinstance(owner, _ParameterHooks) and not _is_root_hook(hook):
                continue  # a submodule's, removed with the hook of the module it was given
            if isinstance(owner, _Transforming | _ParameterHooks):
                entries.append(_HookEntry(module, key))
                if isinstance(owner, _ParameterHooks) and owner not in entries:
                    entries.append(owner)
    return entries


def _refuse_scripting(module: nn.Module) -> None:
    """TorchScript cannot run the hooks (Python objects): scripting the module raises."""
    if "__prepare_scriptable__" not in module.__dict__:
        module.__dict__["__prepare_scriptable__"] = RefuseScripting(
            f"`{type(module).__name__}` (it has a go.grad_hook)"
        )


def _allow_scripting(module: nn.Module) -> None:
    if isinstance(module.__dict__.get("__prepare_scriptable__"), RefuseScripting):
        del module.__dict__["__prepare_scriptable__"]


class _HookEntry:
    """One module hook, removable by its key (what a RemovableHandle does, for a hook whose
    handle was not kept: one that came back with the module from `torch.load`)."""

    def __init__(self, module: nn.Module, key: int) -> None:
        self.module = module
        self.key = key

    def remove(self) -> None:
        m = self.module
        for hooks in (
            m._forward_pre_hooks, m._forward_hooks, m._forward_pre_hooks_with_kwargs,
            m._forward_hooks_with_kwargs, m._forward_hooks_always_called,
        ):
            hooks.pop(self.key, None)


class _Transforming:
    """A module hook holding a gradient transform. An object, not a closure, so a module
    with hooks pickles (`torch.save`) and loads back with them, the transform being stored
    by reference (a module-level function or a recipe)."""

    __slots__ = ("transform",)

    def __init__(self, transform: Callable[[Tensor], Tensor | None]) -> None:
        self.transform = transform

    @property
    def own_transform(self) -> Callable[[Tensor], Tensor | None]:
        """The transform given to grad_hook (a running `go.monitor` wraps `transform`; a
        saved or copied hook holds the transform itself)."""
        return getattr(self.transform, "monitored_transform", self.transform)

    def __reduce__(self) -> tuple[Any, ...]:
        _require_picklable(self.own_transform)
        return (type(self), (self.own_transform,))

    def __deepcopy__(self, memo: dict[int, Any]) -> _Transforming:
        # A copy shares the transform, as PyTorch's copy of a module shares its hooks'
        # functions (a lambda included: nothing is pickled).
        return type(self)(self.own_transform)


class _CallStack(threading.local):
    """Per thread, one entry per call in progress (`stack`, made in each thread)."""

    def __init__(self) -> None:
        self.stack: list[list[tuple[str, Tensor, Tensor, Any]]] = []


class _AtInputs(_Transforming):
    """The transform at a module's inputs: a forward pre-hook and a forward hook.

    Only the gradient this module sends back is changed, not the input's other uses:

    * an input reaches the module as a view with a tensor hook (no copy). A module that
      changes that view in place without saying so (no `inplace=True`) would lose the hook:
      the forward hook then refuses, naming the module;
    * a module built with `inplace=True` (`nn.ReLU(inplace=True)`) gets a copy of the input,
      through an identity op whose backward is the transform, and its in-place change is
      copied back into the caller's tensor afterwards (one copy each way), as PyTorch's own
      in-place op would have changed it: the caller's tensor then has the module's output's
      history, so its later uses, which are uses of the module's output, get the transform
      too, as plain autograd gives them the module's gradient;
    * a module returning its input as-is (`nn.Identity`) returns it through an identity op
      whose output is a view: an in-place op right after it is PyTorch's error for views,
      where a hook on the view would be lost silently.

    Under torch.compile and torch.func transforms, where tensor hooks do not run as in eager
    mode, each input goes through an identity op whose output is a view (a module that
    changes its input in place then meets PyTorch's error for views made in a Function).
    """

    __slots__ = ("inplace", "local")

    def __init__(self, transform: Callable[[Tensor], Tensor | None]) -> None:
        super().__init__(transform)
        # Whether the module is, or holds, one built with inplace=True: read at its first
        # call, not on every call (a module that turns in-place later is refused by
        # `after`, never silently wrong).
        self.inplace: bool | None = None
        # Per thread, a stack with one entry per call in progress (a module may call itself),
        # pushed by the pre-hook and popped by the forward hook: what `after` finishes.
        self.local = _CallStack()

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> Any:
        if kwargs is None:
            # Registered again without its keyword arguments (torch.ao.quantization's module
            # swap copies a module's hooks that way): the same, giving the inputs alone.
            given = self(module, args, {})
            return None if given is None else given[0]
        entries: list[tuple[str, Tensor, Tensor, Any]] = []
        self.local.stack.append(entries)  # first: `after` pops once per call, whatever happens
        if not torch.is_grad_enabled():
            return None
        if is_dynamo_compiling() and transforms_active():
            break_compiled_transform(f"the go.grad_hook of `{type(module).__name__}`")
        if tracing_state() is not None:
            if exporting_onnx():
                return None  # an inference graph (see `exporting_onnx`): nothing to hook
            _refuse_tracing(module)
        transform = self.transform

        if is_dynamo_compiling() or transforms_active():
            from ._transform import transformed

            def through(t: Any) -> Any:
                if isinstance(t, Tensor) and t.requires_grad:
                    return transformed(t, transform)
                return t

            return pytree.tree_map(through, args), pytree.tree_map(through, kwargs)

        # A module built with inplace=True, or holding one (a block ending in ReLU(inplace)).
        inplace = self.inplace
        if inplace is None:
            inplace = self.inplace = any(
                getattr(m, "inplace", False) is True for m in module.modules()
            )
        if not inplace and not kwargs:
            # The common call: positional tensors, each through a hooked view (as below).
            if len(args) == 1:
                t = args[0]
                if type(t) is Tensor or type(t) is nn.Parameter:
                    if not t.requires_grad:
                        return None
                    given = t.view_as(t)
                    add_tensor_hook(given, transform)
                    entries.append(("view", t, given, (None, given.grad_fn)))
                    return (given,), kwargs
            elif _plain(args):
                given_args: list[Any] | None = None
                for i, t in enumerate(args):
                    if _plain_tensor(t) and t.requires_grad:
                        given = t.view_as(t)
                        add_tensor_hook(given, transform)
                        entries.append(("view", t, given, (None, given.grad_fn)))
                        if given_args is None:
                            given_args = list(args)
                        given_args[i] = given
                return None if given_args is None else (tuple(given_args), kwargs)

        from ._transform import transformed_private

        copies: dict[int, Tensor] = {}  # one copy per tensor, passed twice or not
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if inplace and _share_memory(tensors):
            raise GradOverrideError(_shared_inputs_message(module))

        def prepare(t: Any) -> Any:
            if not (isinstance(t, Tensor) and t.requires_grad):
                return t
            if inplace and not t.is_leaf:
                given = copies.get(id(t))
                if given is None:
                    given = copies[id(t)] = transformed_private(t.clone(), transform)
                    entries.append(("copy", t, given, (given._version, given.grad_fn)))
            else:
                given = t.view_as(t)
                add_tensor_hook(given, transform)
                entries.append(("view", t, given, (given._version, given.grad_fn)))
            return given

        return pytree.tree_map(prepare, args), pytree.tree_map(prepare, kwargs)

    def after(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """Forward hook: copy an in-place module's change back; refuse a lost transform."""
        stack = self.local.stack
        entries = stack.pop() if stack else None
        if not entries:
            return None
        if type(output) is Tensor:
            leaves: Any = (output,)
        else:
            leaves = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, Tensor)]
        replace: dict[int, Tensor] = {}
        for kind, t, given, (version, grad_fn) in entries:
            if kind == "copy":
                returned = any(leaf is given for leaf in leaves)
                if returned or given._version != version:
                    # The caller's tensor is what the module changed (or returned as-is), as
                    # the in-place op would have left it: it takes the copy's history, which
                    # carries the transform. (A plain copy when the values are equal.)
                    t.copy_(given)
                replace[id(given)] = t
            elif given.grad_fn is not grad_fn:
                # The view was changed in place with grad enabled: its history, and the
                # hook on it, were replaced.
                raise GradOverrideError(_inplace_input_message(module))
            else:
                base = given._base
                for leaf in leaves:
                    # `related(leaf, given)`, written out (the common call has one leaf):
                    # `given` is a view, so its base is never None.
                    if leaf is given or leaf is base or leaf._base is given or (
                        leaf._base is base
                    ):
                        # Returned as-is or as a view (`nn.Identity`, `nn.Flatten`): through a
                        # view op, so an in-place op right after is PyTorch's error, not a
                        # lost transform.
                        from ._transform import transformed

                        replace[id(leaf)] = transformed(leaf, _keep)
        if not replace or output is None:
            return None
        return pytree.tree_map(
            lambda leaf: replace.get(id(leaf), leaf) if isinstance(leaf, Tensor) else leaf,
            output,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> _AtInputs:
        return _AtInputs(self.own_transform)

    def __reduce__(self) -> tuple[Any, ...]:
        _require_picklable(self.own_transform)
        return (_AtInputs, (self.own_transform,))


def _keep(grad: Tensor) -> None:
    """The identity transform (a returned input's own transform is on the view it shows)."""
    return None


def _share_memory(tensors: list[Tensor]) -> bool:
    """Whether two different tensors among `tensors` share memory (one a view of another)."""
    return any(
        a is not b and related(a, b)
        for i, a in enumerate(tensors) for b in tensors[i + 1 :]
    )


def _shared_inputs_message(module: nn.Module) -> str:
    name = type(module).__name__
    return (
        f"`{name}` changes its inputs in place, and two of its inputs share memory (one is a "
        f"view of the other, as `h` and `h[0]`); go.grad_hook(at='inputs') copies each input "
        f"of such a module, which would separate them and change what the forward computes. "
        f"Pass copies (`h[0].clone()`), or build the module with inplace=False."
    )


def _inplace_input_message(module: nn.Module) -> str:
    name = type(module).__name__
    return (
        f"`{name}` (or a module inside it) changed its input in place, but none of them was "
        f"built with inplace=True, so go.grad_hook(at='inputs') could not keep its transform "
        f"on that input (an in-place op regenerates the input's history). Give the module "
        f"that does it an `inplace = True` attribute (as torch's in-place activations have), "
        f"so the hook copies the input first, or make its forward out of place."
    )


def _refuse_tracing(module: nn.Module) -> None:
    if is_tracing():
        raise GradOverrideError(
            jit_message(f"the go.grad_hook of `{type(module).__name__}`", "torch.jit.trace")
        )


#: `_AtOutputs`' output when it is called without keyword arguments.
_NO_OUTPUT: Any = object()


class _AtOutputs(_Transforming):
    """Forward hook: a tensor hook on each output (it fires with the gradient of the value
    the module returned, even when an in-place op changes the output afterwards)."""

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
        output: Any = _NO_OUTPUT,
    ) -> Any:
        if output is _NO_OUTPUT:
            # Registered again without its keyword arguments (torch.ao.quantization's module
            # swap copies a module's hooks that way): the third argument is the output.
            return self(module, args, {}, kwargs)
        if not torch.is_grad_enabled():
            return None
        if tracing_state() is not None:
            if exporting_onnx():
                return None  # an inference graph (see `exporting_onnx`): nothing to hook
            _refuse_tracing(module)
        if is_dynamo_compiling() and transforms_active():
            break_compiled_transform(f"the go.grad_hook of `{type(module).__name__}`")
        if type(output) is Tensor and not kwargs and not is_dynamo_compiling() and (
            _plain_tensor(args[0]) if len(args) == 1 else _plain(args)
        ):
            # One plain tensor output of positional inputs (the common call): what
            # `_hook_tensors` does, without its walks.
            if not output.requires_grad:
                return None
            if output._base is None and not output.is_leaf and not shows_input(output, args):
                add_tensor_hook(output, self.transform)
                return None
        return _hook_tensors(output, self.transform, (args, kwargs))


def _require_picklable(transform: Any) -> None:
    from ._pickling import require_importable

    require_importable(
        transform, f"a module with `go.grad_hook({describe(transform)})`", "its transform",
        ", or use a gradient recipe",
    )


#: Bumped when any module anywhere registers a parameter or a submodule (PyTorch's global
#: registration hooks, installed with the first parameters grad_hook): a parameters hook
#: walks its module again at its next call after a change, to hook what is new there (a
#: parameter replaced, a submodule added, in a part of the model that may never be called).
_EPOCH = [0]
_WATCHING: list[bool] = []


def _bump(*_: Any) -> None:
    _EPOCH[0] += 1


def _watch_registrations() -> None:
    if not _WATCHING:
        from torch.nn.modules import module as torch_module

        torch_module.register_module_parameter_registration_hook(_bump)
        torch_module.register_module_module_registration_hook(_bump)
        _WATCHING.append(True)


class _ParameterHooks:
    """The transform at a module's parameters: each parameter's total gradient, before it
    is accumulated (all its uses, tied weights included), in every mode alike.

    Each tensor standing as a parameter anywhere in the module gets a tensor hook, once (it
    carries this object's token): an `nn.Parameter`, and any other tensor in a parameter's
    place (what `torch.func.functional_call` passes, a tensor a `torch.func` transform
    wraps), whose total gradient the hook sees just as a parameter's. The tensors are
    hooked when the hook is registered, and again by a forward pre-hook on the module and on
    each submodule holding parameters when it is called (a parameter unfrozen, replaced or
    passed in since, a container never called itself, a model used through another method
    than `forward`); a change to the model's structure makes the next call walk it whole.

    `torch.save` and `copy.deepcopy` do not keep tensor hooks; a pickled or copied module
    gets a fresh object here, which hooks the copy's tensors at its first call.
    """

    def __init__(self, transform: Callable[[Tensor], Tensor | None], where: str) -> None:
        self.transform = transform
        self.where = where
        # Each hooked tensor carries this object's token in `_gradoverride_hooked` (read
        # under dynamo too). Not `id(p)`: a replaced parameter's id can be reused by the next.
        # Random, not a counter: a loaded checkpoint's parameters carry tokens of another
        # process.
        self.token = secrets.randbits(62)
        # No references to the parameters themselves (a weak reference would stop
        # `torch.utils.swap_tensors`, which `module.to()` may use): the module, weakly.
        self.handles: list[RemovableHandle] = []
        self.handle_ids: set[int] = set()
        self.module: weakref.ref[nn.Module] | None = None
        self.epoch = -1
        # The forward pre-hooks on the submodules holding parameters, by module id (the
        # module itself has `before_root`, registered by grad_hook).
        self.holders: dict[int, _Removable] = {}

    def apply(self, grad: Tensor) -> Tensor | None:
        """The tensor hook: the transform (read at each call: `go.monitor` wraps it)."""
        return self.transform(grad)

    def install(self, module: nn.Module) -> RemovableHandle:
        """Hook `module`'s parameters; the module's own forward pre-hook, returned."""
        self.module = weakref.ref(module)
        _watch_registrations()
        handle = module.register_forward_pre_hook(self.before_root, prepend=True)
        self._walk(module)
        return handle

    def _walk(self, root: nn.Module) -> None:
        """Hook every tensor standing as a parameter, pre-hook each submodule holding one."""
        self.epoch = _EPOCH[0]
        for sub in root.modules():
            if sub is not root and sub._parameters and id(sub) not in self.holders:
                found = [key for key, hook in sub._forward_pre_hooks.items()
                         if getattr(hook, "__self__", None) is self]
                if found:  # a copied or loaded holder: its hook came with it
                    self.holders[id(sub)] = _HookEntry(sub, found[0])
                else:
                    self.holders[id(sub)] = sub.register_forward_pre_hook(
                        self.before_forward, prepend=True
                    )
            for p in sub._parameters.values():
                if p is not None and p.requires_grad:
                    self._take(p)

    def __reduce__(self) -> tuple[Any, ...]:
        _require_picklable(self.transform)
        return (_ParameterHooks, (self.own_transform, self.where))

    def __deepcopy__(self, memo: dict[int, Any]) -> _ParameterHooks:
        return _ParameterHooks(self.own_transform, self.where)

    @property
    def own_transform(self) -> Callable[[Tensor], Tensor | None]:
        """The transform given to grad_hook (a running `go.monitor` wraps `transform`)."""
        return getattr(self.transform, "monitored_transform", self.transform)

    def _hooked(self, p: Tensor) -> bool:
        """Whether `p` carries this object's hook: its token, and (a parameter, outside
        dynamo) one of its hooks in `p`'s own hook table (`torch.utils.swap_tensors`, which
        `module.to()` may use, moves a parameter's hooks to the tensor swapped out, not its
        attributes)."""
        if self.token not in getattr(p, _MARK, ()):
            return False
        if is_dynamo_compiling() or type(p) is not nn.Parameter:
            return True
        table = getattr(p, "_backward_hooks", None)
        return table is not None and any(key in self.handle_ids for key in table)

    def _take(self, p: Tensor) -> None:
        """Hook `p` if it is not hooked yet."""
        if self._hooked(p):
            return
        if p.grad_fn is not None and self._copies_hooked(p.grad_fn):
            # A copy of a parameter hooked already (a DataParallel replica's, `p * 1` for
            # functional_call): its gradient flows into that parameter, whose hook
            # transforms the total once.
            return
        if is_dynamo_compiling() and isinstance(p, nn.Parameter):
            # Dynamo cannot keep a hook handle made in one compiled frame for the next, so
            # a parameter is hooked eagerly (a graph break; with fullgraph=True the compile
            # error carries the reason below).
            _hook_eagerly(self, p)
        else:
            self._hook(p)

    def _copies_hooked(self, node: Any) -> bool:
        """Whether the backward node `node` (a tensor's `grad_fn`) passes its gradient on,
        within a few steps, only to tensors carrying this object's hook."""
        todo, steps = [node], 0
        while todo:
            steps += 1
            if steps > 8:
                return False
            current = todo.pop()
            variable = getattr(current, "variable", None)
            if variable is not None:  # an AccumulateGrad: a leaf tensor
                if self.token not in getattr(variable, _MARK, ()):
                    return False
                continue
            nexts = [n for n, _ in current.next_functions if n is not None]
            if not nexts:
                return False
            todo += nexts
        return True

    def _hook(self, p: Tensor) -> None:
        table = getattr(p, "_backward_hooks", None)
        if table is not None and any(key in self.handle_ids for key in table):
            # Our hook is in the table but our mark is gone: `torch.utils.swap_tensors`
            # swapped the parameter (its attributes went with the old tensor, its table
            # stayed, and the hooks in it no longer fire). Start a fresh table.
            p._backward_hooks = None
        handle = _register_hook(p, self.apply)
        if not is_dynamo_compiling():
            self.handles.append(handle)
            self.handle_ids.add(handle.id)
        # A tuple of ints: it is saved with the parameter, and `torch.load(weights_only=True)`
        # loads nothing else.
        marks: tuple[int, ...] = getattr(p, _MARK, ())
        if self.token not in marks:
            setattr(p, _MARK, (*marks, self.token))

    def before_root(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """The forward pre-hook of the module grad_hook was given."""
        if not torch.is_grad_enabled():
            return
        if self.module is None or self.module() is not module:
            # A loaded or copied module: it hooks its tensors now, and its holders.
            self.module = weakref.ref(module)
            self.epoch = -1
        self.before_forward(module, args)

    def before_forward(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """The forward pre-hook of a submodule holding parameters (and the module's)."""
        if not torch.is_grad_enabled():
            return
        if is_dynamo_compiling() and transforms_active():
            break_compiled_transform(f"the go.grad_hook of `{type(module).__name__}`")
        root = None if self.module is None else self.module()
        if root is not None and _EPOCH[0] != self.epoch:
            if not is_dynamo_compiling():
                self._walk(root)
            elif any(
                p is not None and p.requires_grad and not self._hooked(p)
                for sub in root.modules() for p in sub._parameters.values()
            ):
                # Something new in the model since the last eager call: hooked eagerly, a
                # graph break (see `_prepare_eager_hook`).
                _walk_eagerly(self, root)
        for p in module._parameters.values():
            if p is not None and p.requires_grad:
                self._take(p)
        if root is not None and module is not root:
            # The module's own parameters, which a method other than `forward` may use.
            for p in root._parameters.values():
                if p is not None and p.requires_grad:
                    self._take(p)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.handle_ids.clear()
        for holder in self.holders.values():
            holder.remove()
        self.holders.clear()
        module = None if self.module is None else self.module()
        if module is not None:
            for p in module.parameters():
                marks = getattr(p, _MARK, ())
                if self.token in marks:
                    setattr(p, _MARK, tuple(m for m in marks if m != self.token))


def _hook_eagerly_now(hooks: _ParameterHooks, p: Tensor) -> None:
    hooks._hook(p)


def _walk_eagerly_now(hooks: _ParameterHooks, root: nn.Module) -> None:
    hooks._walk(root)


def _hook_eagerly(hooks: _ParameterHooks, p: Tensor) -> None:
    """`hooks._hook(p)` as a graph break, made by `_prepare_eager_hook` when a parameters
    hook is registered (`torch.compiler.disable` imports dynamo, which `import
    gradoverride` must not, and it cannot be called while dynamo traces)."""
    assert _EAGER
    _EAGER[0](hooks, p)


def _walk_eagerly(hooks: _ParameterHooks, root: nn.Module) -> None:
    """`hooks._walk(root)` as a graph break (see `_hook_eagerly`)."""
    assert _EAGER
    _EAGER[1](hooks, root)


def _prepare_eager_hook() -> None:
    if not _EAGER:
        disable: Any = torch.compiler.disable
        _EAGER.append(disable(
            _hook_eagerly_now,
            reason=(
                "grad_hook(at='parameters'): a parameter began requiring grad, or was "
                "replaced, after the hook was registered, and gradoverride hooks it eagerly. "
                "Call the module once outside torch.compile after changing its parameters."
            ),
        ))
        _EAGER.append(disable(
            _walk_eagerly_now,
            reason=(
                "grad_hook(at='parameters'): a parameter or submodule was added or replaced "
                "in the model after the hook was registered, and gradoverride hooks it "
                "eagerly. Call the module once outside torch.compile after changing its "
                "structure."
            ),
        ))


#: The eager steps under dynamo, `_hook_eagerly`'s and `_walk_eagerly`'s (made once).
_EAGER: list[Callable[..., None]] = []
