"""The smooth proxies `gradient_report` puts in an override's place: one function per
override whose true (autograd) derivative is what the override's rule stands for.

Where a proxy comes from, first match first:

1. `gradient_report(..., proxies={key: fn})`: `fn(*inputs)` for the overrides `key` names
   (a label `"path: name"`, a name, or a module path); `None` leaves them out;
2. the recipe's own `proxy` method, called on the input: `spike.proxy(x)` (the smooth step
   whose derivative is the surrogate), and any `Recipe` subclass of yours that defines one;
3. the table below, for the library's other recipes.

* `binarize(clip=c)`: `clamp(x, -c, c)`, its window's ends counted in as the recipe's
  `inclusive` says (`hardtanh` for `inclusive=False`); `x` for `clip=None`;
* `ste_clamp(low, high, outside="zero")`: `clamp(x, low, high)`, ends as `inclusive`;
* `ste_clamp(..., outside="pass")`, `ste_round`, `ste_floor`, `ste_ceil`, `ste_sign`,
  `ternarize`: `x`;
* `quantize(...)`: `clamp(x, lo, hi)` to the inputs whose codes are kept;
* `abs_subgradient()`: `abs(x)`;
* `ste_argmax(temperature=T)`: `softmax(x / T, dim)` (`x` for `backward="identity"`);
* the gradient transforms (`reverse_grad`, `scale_grad`, `clip_grad_value`, ...): `x`,
  their forward.

Each is the function whose derivative the rule is: a window's gradient is clamp's (1 inside,
0 outside, the ends as the recipe counts them), a straight-through pass is the identity's.
A gradient transform is the exception: it changes the true gradient on purpose, so its
proxy is its own forward, and its row shows how far it moves the gradient (a reversal has
cosine -1).
The others (`lsq`, `gumbel_softmax`, `rotation_trick`, the solvers, your own ops and
modules) have no proxy unless you pass one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._decorators import CustomBackward
from .._straight_through import Inclusive
from ..diagnostics._recorder import Site
from ._inputs import function_name

__all__ = ["Proxy", "builtin_proxy", "recipe_of"]

#: A proxy as the report calls it: the override's inputs (the tensors it differentiates)
#: and the op call's arguments (for bounds held in them) -> what the override returns.
ProxyCall = Callable[[list[Tensor], tuple[Any, ...]], Any]


@dataclass(frozen=True)
class Proxy:
    """A site's proxy: how to call it, and how the report names it."""

    call: ProxyCall
    description: str


def user_proxy(fn: Callable[..., Any]) -> Proxy:
    """A proxy passed in `proxies=`: called on the override's inputs."""
    return Proxy(lambda inputs, args: fn(*inputs), function_name(fn))


def recipe_of(site: Site, args: tuple[Any, ...]) -> Any:
    """The recipe a site's call runs, if any: the site's subject, a recipe among the op's
    arguments, or the owner of a bound method among them (`_ste(x, recipe._forward)`)."""
    from ..recipes import Recipe

    if isinstance(site.keep, Recipe):
        return site.keep
    for arg in args:
        if isinstance(arg, Recipe):
            return arg
        owner = getattr(arg, "__self__", None)
        if isinstance(owner, Recipe):
            return owner
    return None


def builtin_proxy(site: Site, args: tuple[Any, ...]) -> Proxy | None:
    """The proxy the recipe itself declares (its `proxy` method), or the table's entry for
    the library's recipes and straight-through ops; None when there is none."""
    recipe = recipe_of(site, args)
    if recipe is not None:
        own = getattr(recipe, "proxy", None)
        if callable(own):
            return Proxy(lambda inputs, args: own(*inputs), f"{type(recipe).__name__}.proxy")
        return _recipe_proxy(recipe)
    from ..recipes import _flow, _ste

    # Ops called without their recipe among the arguments: straight-through passes, and
    # the multiplied gradient of reverse_grad and scale_grad (an identity forward).
    if site.keep in (_ste._ste_round, _ste._ste_floor, _ste._ste_ceil, _ste._ste_sign,
                     _flow._multiply_gradient, _flow._multiply_gradient_copy):
        return _IDENTITY
    return None


def _identity(inputs: list[Tensor], args: tuple[Any, ...]) -> Tensor:
    return inputs[0]


_IDENTITY = Proxy(_identity, "x")


def window(x: Tensor, low: float | Tensor, high: float | Tensor, ends: Inclusive) -> Tensor:
    """clamp(x, low, high), whose autograd gradient is 1 inside the window (an end counted
    in where `ends` says so) and 0 outside: `torch.clamp` counts both ends in, `hardtanh`
    neither, and a recipe's window may count either."""
    below = x < low if ends[0] else x <= low
    above = x > high if ends[1] else x >= high
    low_t = low if isinstance(low, Tensor) else x.new_full((), low)
    high_t = high if isinstance(high, Tensor) else x.new_full((), high)
    return torch.where(below, low_t, torch.where(above, high_t, x))


def _window_proxy(low: float, high: float, ends: Inclusive) -> Proxy:
    name = f"clamp(x, {low:g}, {high:g})"
    if ends != (True, True):
        name += f" {'[' if ends[0] else '('}ends{']' if ends[1] else ')'}"
    return Proxy(lambda inputs, args: window(inputs[0], low, high, ends), name)


def _recipe_proxy(recipe: Any) -> Proxy | None:
    from ..recipes import (
        GradientTransform,
        abs_subgradient,
        binarize,
        quantize,
        ste_argmax,
        ste_ceil,
        ste_clamp,
        ste_floor,
        ste_round,
        ste_sign,
        ternarize,
    )

    if isinstance(recipe, GradientTransform | ternarize | ste_round | ste_floor | ste_ceil
                  | ste_sign):
        return _IDENTITY
    if isinstance(recipe, binarize):
        if recipe._window is None:
            return _IDENTITY
        low, high = recipe._window
        return _window_proxy(low, high, recipe._ends)
    if isinstance(recipe, ste_clamp):
        return _clamp_proxy(recipe)
    if isinstance(recipe, quantize):
        return Proxy(lambda inputs, args: _quantize_window(recipe, inputs[0]),
                     "clamp(x) to the kept codes' range")
    if isinstance(recipe, abs_subgradient):
        # x * s(x) is |x|, and autograd gives s(x) (sign and its variants have derivative
        # 0): the recipe's subgradient at 0 too, where torch.abs gives 0.
        return Proxy(lambda inputs, args: inputs[0] * recipe._slope(inputs[0]), "abs(x)")
    if isinstance(recipe, ste_argmax):
        if recipe.backward == "identity":
            return _IDENTITY
        t, dim = recipe.temperature, recipe.dim
        return Proxy(lambda inputs, args: torch.softmax(inputs[0] / t, dim),
                     f"softmax(x / {t:g}, dim={dim})")
    return None


def _clamp_proxy(recipe: Any) -> Proxy:
    if recipe.outside == "pass":
        return _IDENTITY
    ends = recipe._ends
    if recipe._window is not None:
        low, high = recipe._window
        return _window_proxy(low, high, ends)

    def tensor_bounds(inputs: list[Tensor], args: tuple[Any, ...]) -> Tensor:
        # The op's call is (x, low, high, recipe): the bounds in x's dtype and device. The
        # rule gives the bounds no gradient (learned bounds included), so neither does this.
        low, high = args[1], args[2]
        return window(inputs[0], low.detach(), high.detach(), ends)

    return Proxy(tensor_bounds, "clamp(x, low, high)")


def _quantize_window(recipe: Any, x: Tensor) -> Tensor:
    """clamp to the inputs whose code round(x / s) + z the recipe keeps, about
    (qmin - z - 1/2) s <= x <= (qmax - z + 1/2) s: the recipe's own test of the code decides
    which inputs pass (round halves to even, so an end at an odd code is counted out), so
    that the gradient is exactly the rule's window."""
    qmin, qmax = recipe._codes
    s, z = recipe.scale_and_zero_point(x.float() if x.dtype in (torch.float16, torch.bfloat16)
                                       else x)
    low = torch.as_tensor((qmin - z - 0.5) * s, device=x.device).to(x.dtype)
    high = torch.as_tensor((qmax - z + 0.5) * s, device=x.device).to(x.dtype)
    clamped = torch.clamp(x.detach(), low, high)
    return torch.where(recipe._outside(x.detach()), clamped, x)


def lookup(table: Mapping[Any, Any], site: Site, label: str) -> tuple[bool, Any]:
    """(found, value): the entry of `table` for a site, by its label, then its name, then its
    module path, then the recipe (one of the same settings) or op it runs."""
    for key in (label, site.name, site.path):
        if key in table:
            return True, table[key]
    keep = site.keep
    if keep is not None:
        from ..recipes import Recipe

        for key, value in table.items():
            if isinstance(key, str):
                continue
            if key is keep or (
                isinstance(key, Recipe) and isinstance(keep, Recipe) and repr(key) == repr(keep)
            ):
                return True, value
    return False, None


def is_override_object(key: object) -> bool:
    """Whether `key` is a recipe or an op (a `proxies=` key naming the override itself)."""
    from ..recipes import Recipe

    return isinstance(key, Recipe | CustomBackward)
