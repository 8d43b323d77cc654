"""Reading a forward function's signature once, binding calls to it fast, and calling it back.

Every forward parameter is one *slot*. A call is bound to a tuple of values, one per slot, in
the order the forward declares them: a `*args` parameter holds a tuple, a `**kwargs`
parameter a dict. Rules name slots; gradients are returned per slot.

Builtins whose signature Python cannot read (`torch.sign`, `torch.matmul`, ...) are read from
the first line of their docstring, which for torch functions is the documented signature
(`sign(input, *, out=None) -> Tensor`), so a rule names their inputs as the torch docs do
(`input`, `other`). A callable with neither is treated as `(*args, **kwargs)`.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import GradOverrideTypeError

__all__ = ["ForwardSignature", "describe"]

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def describe(fn: object) -> str:
    """The name messages use for a user's function: its qualified name, else its repr."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return str(name) if name else repr(fn)


def _signature_from_doc(fn: Callable[..., Any]) -> inspect.Signature | None:
    """Read `name(params) -> ...` from the first line of a builtin's docstring."""
    doc = getattr(fn, "__doc__", None)
    name = getattr(fn, "__name__", None)
    if not doc or not name:
        return None
    for line in doc.strip().splitlines()[:3]:
        line = line.strip()
        if not line.startswith(name + "("):
            continue
        head = line.split("->")[0].strip()
        try:
            tree = ast.parse(f"def _{head[len(name):]}: pass")
            func = tree.body[0]
            assert isinstance(func, ast.FunctionDef)
            args = func.args
            params: list[inspect.Parameter] = []
            positional = [*args.posonlyargs, *args.args]
            pos_defaults: list[Any] = [_EMPTY] * (len(positional) - len(args.defaults))
            pos_defaults += [ast.literal_eval(d) for d in args.defaults]
            for i, (arg, default) in enumerate(zip(positional, pos_defaults, strict=True)):
                kind = (
                    inspect.Parameter.POSITIONAL_ONLY
                    if i < len(args.posonlyargs)
                    else inspect.Parameter.POSITIONAL_OR_KEYWORD
                )
                params.append(inspect.Parameter(arg.arg, kind, default=default))
            if args.vararg is not None:
                params.append(inspect.Parameter(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
            for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
                value = _EMPTY if kw_default is None else ast.literal_eval(kw_default)
                params.append(
                    inspect.Parameter(arg.arg, inspect.Parameter.KEYWORD_ONLY, default=value)
                )
            if args.kwarg is not None:
                params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
            return inspect.Signature(params)
        except (SyntaxError, ValueError, TypeError, AssertionError):
            return None
    return None


def read_signature(fn: Callable[..., Any]) -> tuple[inspect.Signature, bool]:
    """The forward's signature, and whether it was read from a docstring (a builtin)."""
    try:
        return inspect.signature(fn), False
    except (TypeError, ValueError):
        pass
    from_doc = _signature_from_doc(fn)
    if from_doc is not None:
        return from_doc, True
    generic = inspect.Signature(
        [
            inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
            inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
        ]
    )
    return generic, True


class ForwardSignature:
    """The slots of a forward function, with a fast `bind` and the matching `call`.

    `bind` turns `(args, kwargs)` into one value per slot, defaults applied. For the common
    forward (positional-or-keyword parameters only, called positionally) it does no more than
    pad `args` with defaults; anything else goes through `inspect.Signature.bind`.
    """

    __slots__ = (
        "_defaults",
        "_omit_defaults",
        "_required",
        "fn",
        "index",
        "is_plain",
        "kinds",
        "name",
        "names",
        "signature",
        "var_keyword",
        "var_positional",
    )

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn = fn
        self.name = name
        self.signature, self._omit_defaults = read_signature(fn)
        params = list(self.signature.parameters.values())
        self.names: tuple[str, ...] = tuple(p.name for p in params)
        self.kinds = tuple(p.kind for p in params)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.var_positional = next(
            (i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_POSITIONAL), None
        )
        self.var_keyword = next(
            (i for i, p in enumerate(params) if p.kind is inspect.Parameter.VAR_KEYWORD), None
        )
        # A "plain" forward takes positional-or-keyword parameters only: binding a positional
        # call is then a tuple pad, and calling back is `fn(*values)`.
        self.is_plain = all(p.kind in _POSITIONAL for p in params) and not self._omit_defaults
        self._required = sum(1 for p in params if p.default is _EMPTY)
        self._defaults = tuple(p.default for p in params)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """One value per slot for the call `fn(*args, **kwargs)`, defaults applied."""
        if self.is_plain and not kwargs:
            n = len(args)
            if n == len(self.names):
                return args
            if self._required <= n < len(self.names):
                return args + self._defaults[n:]
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            msg = (
                f"`{self.name}` was called with arguments its signature does not take: {exc}. "
                f"Call it as `{self.name}{self.signature}`."
            )
            raise GradOverrideTypeError(msg) from None
        bound.apply_defaults()
        arguments = bound.arguments
        return tuple(arguments[n] for n in self.names)

    def call(self, values: Sequence[Any]) -> Any:
        """Call the forward with one value per slot."""
        if self.is_plain:
            return self.fn(*values)
        positional: list[Any] = []
        keywords: dict[str, Any] = {}
        slots = zip(self.names, self.kinds, values, self._defaults, strict=True)
        for name, kind, value, default in slots:
            if kind in _POSITIONAL:
                positional.append(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(value)
            elif kind is inspect.Parameter.KEYWORD_ONLY:
                # Builtins read from their docs may reject a default passed explicitly
                # (`out=None`), so leave defaults out for them.
                if not (self._omit_defaults and value is default):
                    keywords[name] = value
            else:
                keywords.update(value)
        if self._omit_defaults:
            while (
                positional
                and len(positional) <= len(self._defaults)
                and positional[-1] is self._defaults[len(positional) - 1]
            ):
                positional.pop()
        return self.fn(*positional, **keywords)

    def __repr__(self) -> str:
        return f"{self.name}{self.signature}"
