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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from ._errors import GradOverrideError, GradOverrideTypeError

if TYPE_CHECKING:
    from .recipes._base import GradientTransform

__all__ = ["HookHandle", "grad_hook"]

Place = Literal["inputs", "outputs", "parameters"]
# `Tensor.register_hook` is untyped in torch; this names its type once.
_register_hook: Callable[[Tensor, Callable[[Tensor], Tensor | None]], RemovableHandle] = (
    Tensor.register_hook
)
_PLACES = ("inputs", "outputs", "parameters")


class HookHandle:
    """Returned by `grad_hook`; `.remove()` takes the transform away (twice is a no-op)."""

    def __init__(self, description: str, handles: list[RemovableHandle]) -> None:
        self._description = description
        self._handles = handles
        self.active = True

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.active = False

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
    """Register `transform` on every tensor of `tree` that requires grad; a tensor that is also
    in `avoid` (an input returned as-is) gets a view first, so only this path is changed."""
    avoided = {id(t) for t in pytree.tree_leaves(avoid) if isinstance(t, Tensor)}

    def hook(t: Any) -> Any:
        if not isinstance(t, Tensor) or not t.requires_grad:
            return t
        if id(t) in avoided:
            t = t.view_as(t)
        t.register_hook(transform)
        return t

    return pytree.tree_map(hook, tree)


def grad_hook(
    module: nn.Module,
    fn: Callable[[Tensor], Tensor | None] | GradientTransform,
    *,
    at: Place = "outputs",
) -> HookHandle:
    """Transform the gradient flowing at a module's inputs, outputs or parameters.

    Example::

        encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True))
        handle = go.grad_hook(encoder[0], lambda g: g.clamp(-1, 1), at="inputs")
        handle = go.grad_hook(encoder[0], go.recipes.reverse_grad(), at="outputs")

    Args:
        module: any `nn.Module` instance.
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
        handles: list[RemovableHandle] = [
            _register_hook(p, transform) for p in module.parameters() if p.requires_grad
        ]
        return HookHandle(description, handles)

    if at == "inputs":

        def pre_hook(
            mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            if not torch.is_grad_enabled():
                return None
            # A view per input: the hook then changes only the gradient this module sends
            # back, not the input's other uses.
            def view(t: Any) -> Any:
                if isinstance(t, Tensor) and t.requires_grad:
                    t = t.view_as(t)
                    t.register_hook(transform)
                return t

            return pytree.tree_map(view, args), pytree.tree_map(view, kwargs)

        # prepend=True: a later transform then sits further from the module, so the first
        # registered receives the gradient first, as at the outputs.
        handle = module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)
        return HookHandle(description, [handle])

    def forward_hook(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        if not torch.is_grad_enabled():
            return None
        return _hook_tensors(output, transform, (args, kwargs))

    handle = module.register_forward_hook(forward_hook, with_kwargs=True)
    return HookHandle(description, [handle])
