"""Naming a call's inputs, and the floating-point tensors in them, by the function's signature.

`check_backward(quantize, x, 4)` calls its first input `x`, as the forward does, so reports
and errors say "the gradient for `x`". Tensors inside containers are named by their place
(`xs[0]`, `params['w']`), values of a `*args` parameter by position (`args[1]`), and inputs
beyond what the signature names as `inputs[2]`.

Every floating-point tensor among the inputs is differentiated; integer and bool tensors and
non-tensor values are passed through unchanged. Containers are tuples (named tuples too),
lists and dicts, nested.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._decorators import CustomBackward
from .._errors import GradOverrideError
from .._signature import describe

__all__ = ["Call", "floating_leaves", "function_name", "input_names"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def function_name(fn: object) -> str:
    """The name messages use for a checked function, a proxy or a builtin (`torch.tanh`)."""
    if isinstance(fn, functools.partial):
        return function_name(fn.func)
    # torch's builtins live on a private class; `torch.tanh` is how users write them.
    return describe(fn)


def _module_forward(module: nn.Module) -> Callable[..., Any]:
    """The forward a module's call runs, bound (a go.Module's as written: its call takes
    `*args`)."""
    written = getattr(type(module), "_gradoverride_forward", None)
    return types.MethodType(written, module) if written is not None else module.forward


def module_of(fn: Callable[..., Any]) -> nn.Module | None:
    """The module `fn` calls: `fn` itself, or the module a `functools.partial` binds."""
    if isinstance(fn, nn.Module):
        return fn
    if isinstance(fn, functools.partial) and isinstance(fn.func, nn.Module):
        return fn.func
    return None


def _parameters(fn: Callable[..., Any]) -> list[inspect.Parameter]:
    if isinstance(fn, nn.Module):
        fn = _module_forward(fn)
    elif isinstance(fn, functools.partial) and isinstance(fn.func, nn.Module):
        fn = functools.partial(_module_forward(fn.func), *fn.args, **fn.keywords)
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        pass
    # An op over a builtin (`go.custom_backward(torch.sign, ...)`) has no Python signature,
    # but knows the names it read from the builtin's documented one.
    if isinstance(fn, CustomBackward):
        return [
            inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in fn.parameters
        ]
    return []


def input_names(fn: Callable[..., Any], count: int) -> tuple[str, ...]:
    """The names of `count` positional inputs of `fn`, as its signature calls them.

    ```python
    from gradoverride.testing._inputs import input_names

    print(input_names(lambda x, *rest: x, 3))
    #> ('x', 'rest[0]', 'rest[1]')
    ```
    """
    names: list[str] = []
    for param in _parameters(fn):
        if len(names) == count:
            break
        if param.kind in _POSITIONAL:
            names.append(param.name)
        elif param.kind is inspect.Parameter.VAR_POSITIONAL:
            start = len(names)
            names.extend(f"{param.name}[{i - start}]" for i in range(start, count))
        else:
            break
    names.extend(f"inputs[{i}]" for i in range(len(names), count))
    return tuple(names)


def _map_floating(value: Any, path: str, fn: Callable[[str, Tensor], Any]) -> Any:
    """`value` with each floating-point tensor `t` at `path` replaced by `fn(path, t)`.

    Visits tuples, lists and dicts in order, so two walks over equal structures meet the
    tensors in the same order.
    """
    if isinstance(value, Tensor):
        return fn(path, value) if value.is_floating_point() else value
    if isinstance(value, tuple):
        items = [_map_floating(v, f"{path}[{i}]", fn) for i, v in enumerate(value)]
        if type(value) is tuple:
            return tuple(items)
        if hasattr(value, "_fields"):  # a named tuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, list):
        return [_map_floating(v, f"{path}[{i}]", fn) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _map_floating(v, f"{path}[{k!r}]", fn) for k, v in value.items()}
    return value


def floating_leaves(value: Any, name: str) -> list[tuple[str, Tensor]]:
    """The floating-point tensors in `value` (a tensor or nested containers), named."""
    found: list[tuple[str, Tensor]] = []

    def record(path: str, tensor: Tensor) -> Tensor:
        found.append((path, tensor))
        return tensor

    _map_floating(value, name, record)
    return found


def _holds_numpy(value: Any) -> bool:
    """Whether `value` is or holds (tuples, lists, dicts) a numpy array."""
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        return True
    if isinstance(value, tuple | list):
        return any(_holds_numpy(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_numpy(v) for v in value.values())
    return False


class Call:
    """A call's positional inputs, with each floating-point tensor in them named, and, when
    the function is a module, its parameters that require grad after them (named as
    `named_parameters()` names them).

    `leaves()` gives fresh tensors that require grad and `rebuild(tensors)` the inputs with
    those tensors in place, so the caller's tensors are never modified or given a `.grad`;
    a module runs with the parameters' leaves in place of its parameters
    (`torch.func.functional_call`).
    """

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> None:
        self.fn = fn
        self.fn_name = function_name(fn)
        self.inputs = tuple(inputs)
        found: list[tuple[str, Tensor]] = []
        for name, value in zip(input_names(fn, len(self.inputs)), self.inputs, strict=True):
            found.extend(floating_leaves(value, name))
        if not found:
            numpy = (
                " numpy arrays are not differentiated: pass torch tensors "
                "(`torch.from_numpy(a)`), or JAX arrays (`jnp.asarray(a)`) to check JAX code."
                if _holds_numpy(self.inputs) else ""
            )
            msg = (
                f"`{self.fn_name}` was given no floating-point tensor to differentiate "
                f"(inputs: {', '.join(type(v).__name__ for v in self.inputs) or 'none'}); "
                f"pass the tensors whose gradients the rule computes as positional inputs.{numpy}"
            )
            raise GradOverrideError(msg)
        self.n_inputs = len(found)
        self.input_names: tuple[str, ...] = tuple(name for name, _ in found)
        self.parameter_names: tuple[str, ...] = ()
        # The module's other state (frozen parameters, buffers): copies are swapped in at
        # each call, so that a forward updating a buffer (batch norm's running statistics)
        # leaves the module as it was, and finite differences see it in float64 too.
        self.state: tuple[tuple[str, Tensor], ...] = ()
        module = module_of(fn)
        self.module = module
        if module is not None:
            params = [(n, p) for n, p in module.named_parameters()
                      if p.requires_grad and p.is_floating_point()]
            self.parameter_names = tuple(n for n, _ in params)
            found += params
            checked = {id(p) for _, p in params}
            self.state = tuple(
                (n, t) for n, t in (*module.named_parameters(), *module.named_buffers())
                if id(t) not in checked
            )
        self.names: tuple[str, ...] = tuple(name for name, _ in found)
        self.tensors: tuple[Tensor, ...] = tuple(t for _, t in found)

    def leaves(self, dtype: torch.dtype | None = None) -> tuple[Tensor, ...]:
        """Fresh leaf tensors that require grad, one per named tensor, with the same strides.

        With `dtype`, copies in that dtype instead (for finite differences in float64).
        """
        if dtype is not None:
            return tuple(t.detach().to(dtype, copy=True) for t in self.tensors)
        return tuple(t.detach().requires_grad_() for t in self.tensors)

    def rebuild(self, tensors: Sequence[Tensor]) -> tuple[Any, ...]:
        """The inputs with the named tensors replaced by `tensors`, in order."""
        replacements: Iterator[Tensor] = iter(tensors[: self.n_inputs])
        return tuple(
            _map_floating(value, "", lambda _path, _old: next(replacements))
            for value in self.inputs
        )

    def __call__(self, tensors: Sequence[Tensor]) -> Any:
        """Call the function with the named tensors replaced by `tensors`."""
        args = self.rebuild(tensors)
        return self.with_parameters(tensors, lambda: self.fn(*args))

    def with_parameters(self, tensors: Sequence[Tensor], run: Callable[[], Any]) -> Any:
        """`run()`, with a module's parameters replaced by the last of `tensors` (so that a
        proxy reading the module's parameters reads them too)."""
        if self.module is None:
            return run()
        holder = _Running(self.module, run)
        values = {
            f"module.{name}": t
            for name, t in zip(self.parameter_names, tensors[self.n_inputs :], strict=True)
        }
        # In float64 where the checked tensors are (finite differences).
        wide = any(t.dtype == torch.float64 != o.dtype
                   for t, o in zip(tensors, self.tensors, strict=True))
        for name, t in self.state:
            copy = t.detach().clone()
            if wide and copy.is_floating_point():
                copy = copy.to(torch.float64)
            values[f"module.{name}"] = copy
        return torch.func.functional_call(holder, values, ())


class _Running(nn.Module):
    """Holds the checked module, so that `functional_call` swaps its parameters while a
    function (the module's call, or a proxy reading its parameters) runs."""

    def __init__(self, module: Any, run: Callable[[], Any]) -> None:
        super().__init__()
        self.module = module
        self.run = run

    def forward(self) -> Any:
        return self.run()
