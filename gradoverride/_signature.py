"""Reading a forward function's signature once, binding calls to it fast, and calling it back.

Every forward parameter is one *slot*. A call is bound to a tuple of values, one per slot, in
the order the forward declares them: a `*args` parameter holds a tuple, a `**kwargs`
parameter a dict. Rules name slots; gradients are returned per slot.

Builtins whose signature Python cannot read (`torch.sign`, `torch.sum`, ...) are read from
their docstring (`_signature_forms`), which for torch functions documents the signature, one
line per form, so a rule names their inputs as the torch docs do (`input`, `other`). The
keyword-only `out` of those forms is not a slot: writing into `out=` cannot carry a
gradient, and a call with `out=` is refused. A callable with neither signature nor
documented form is treated as `(*args, **kwargs)`. `custom_backward(fn, signature="(input,
dim=None)")` gives the forms explicitly instead.

A function with several forms has one slot per parameter of any form (the union, in the
order the forms list them). A call binds to the first form that takes it, as Python would
bind it to that signature; the slots that form lacks hold None (`()` for a `*args` slot,
`{}` for a `**kwargs` one). A call that two forms take with different names for the same
positional argument (`torch.max(x, 1)`: `dim` or `other`?) is refused with the fix: pass it
by keyword, or give the signature.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import GradOverrideTypeError

__all__ = ["ForwardSignature", "describe", "listing"]

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VAR_POSITIONAL = inspect.Parameter.VAR_POSITIONAL
_VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD
_KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY



def describe(fn: object) -> str:
    """The name messages use for a user's function: its qualified name, else its repr.

    torch's functions live on a private class (`_VariableFunctionsClass.sum`); they are
    named as users call them, `torch.sum`.
    """
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if not name:
        return repr(fn)
    name = str(name)
    if name.startswith("_VariableFunctionsClass."):
        return "torch." + name[len("_VariableFunctionsClass.") :]
    return name


def listing(names: Sequence[str] | Any) -> str:
    """`a`, `b` or `c`: names for a message."""
    quoted = [f"`{n}`" for n in names]
    if not quoted:
        return "nothing"
    if len(quoted) == 1:
        return quoted[0]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]


def _merge_names(forms: Sequence[inspect.Signature]) -> list[str]:
    """Every form's parameter names, each once, in the order the forms list them: a name
    only a later form has goes just before the next of that form's names already placed."""
    names: list[str] = []
    for form in forms:
        own = list(form.parameters)
        for i, name in enumerate(own):
            if name in names:
                continue
            later = next((n for n in own[i + 1 :] if n in names), None)
            names.insert(len(names) if later is None else names.index(later), name)
    return names


# ---- one form, for binding among several ---------------------------------------------------


class _Form:
    """One of several documented forms: its parameters as slot indices, for binding."""

    __slots__ = (
        "keyword_only",
        "positional",
        "positional_names",
        "signature",
        "slots",
        "var_keyword",
        "var_positional",
    )

    def __init__(self, signature: inspect.Signature, index: dict[str, int]) -> None:
        self.signature = signature
        params = list(signature.parameters.values())
        # (name, slot, default, positional_only) per positional parameter, in order.
        self.positional = tuple(
            (p.name, index[p.name], p.default, p.kind is inspect.Parameter.POSITIONAL_ONLY)
            for p in params
            if p.kind in _POSITIONAL
        )
        self.positional_names = {
            name: i for i, (name, _, _, only) in enumerate(self.positional) if not only
        }
        self.keyword_only = {
            p.name: (index[p.name], p.default) for p in params if p.kind is _KEYWORD_ONLY
        }
        self.var_positional = next(
            (index[p.name] for p in params if p.kind is _VAR_POSITIONAL), None
        )
        self.var_keyword = next((index[p.name] for p in params if p.kind is _VAR_KEYWORD), None)
        self.slots = frozenset(index[p.name] for p in params)

    def accepts(self, n_args: int, keywords: Sequence[str]) -> bool:
        """Whether `fn(<n_args positional>, **{k: ... for k in keywords})` binds to this form."""
        n_positional = len(self.positional)
        if n_args > n_positional and self.var_positional is None:
            return False
        for key in keywords:
            at = self.positional_names.get(key)
            if at is not None:
                if at < n_args:
                    return False  # given twice
            elif key not in self.keyword_only and self.var_keyword is None:
                return False
        for i in range(n_args, n_positional):
            name, _, default, only = self.positional[i]
            if default is _EMPTY and (only or name not in keywords):
                return False
        return all(
            default is not _EMPTY or name in keywords
            for name, (_, default) in self.keyword_only.items()
        )

    def argument_name(self, position: int) -> str:
        """The parameter that receives the positional argument at `position`."""
        if position < len(self.positional):
            return self.positional[position][0]
        params = self.signature.parameters.values()
        return "*" + next(p.name for p in params if p.kind is _VAR_POSITIONAL)

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any], values: list[Any]) -> list[Any]:
        """Fill `values` (one per slot of all forms, each holding what an absent slot holds)
        for a call this form accepts."""
        n_args = len(args)
        for i, (name, slot, default, only) in enumerate(self.positional):
            if i < n_args:
                values[slot] = args[i]
            elif not only and name in kwargs:
                values[slot] = kwargs[name]
            else:
                values[slot] = default
        if self.var_positional is not None:
            values[self.var_positional] = args[len(self.positional) :]
        extra: dict[str, Any] = {}
        for key, value in kwargs.items():
            if key in self.keyword_only:
                values[self.keyword_only[key][0]] = value
            elif key not in self.positional_names:
                extra[key] = value
        for name, (slot, default) in self.keyword_only.items():
            if name not in kwargs:
                values[slot] = default
        if self.var_keyword is not None:
            values[self.var_keyword] = extra
        return values


class ForwardSignature:
    """The slots of a forward function, with a fast `bind` and the matching `call`.

    `bind` turns `(args, kwargs)` into one value per slot, defaults applied. For the common
    forward (positional-or-keyword parameters only, called positionally) it does no more than
    pad `args` with defaults; anything else goes through `inspect.Signature.bind`, or, for a
    function documented with several forms, through the first form that takes the call.
    """

    __slots__ = (
        "_absent",
        "_defaults",
        "_forms",
        "_omit_defaults",
        "_required",
        "defaults",
        "fn",
        "forms",
        "index",
        "is_plain",
        "kinds",
        "name",
        "names",
        "signature",
        "var_keyword",
        "var_positional",
    )

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        forms: Sequence[inspect.Signature] | None = None,
    ) -> None:
        """`forms`: the signature(s) to use instead of reading them (`signature=`)."""
        self.fn = fn
        self.name = name
        if forms:
            self.forms, self._omit_defaults = tuple(forms), True
        else:
            try:
                self.forms, self._omit_defaults = (inspect.signature(fn),), False
            except (TypeError, ValueError):
                # A builtin: its forms are read from its docstring (imported only then).
                from ._signature_forms import read_forms

                self.forms, self._omit_defaults = read_forms(fn)
        self.signature = self.forms[0]
        self.names: tuple[str, ...] = tuple(_merge_names(self.forms))
        self.index = {n: i for i, n in enumerate(self.names)}
        params = [self._first_parameter(n) for n in self.names]
        self.kinds = tuple(p.kind for p in params)
        self.var_positional = next(
            (i for i, p in enumerate(params) if p.kind is _VAR_POSITIONAL), None
        )
        self.var_keyword = next((i for i, p in enumerate(params) if p.kind is _VAR_KEYWORD), None)
        # A "plain" forward takes positional-or-keyword parameters only: binding a positional
        # call is then a tuple pad, and calling back is `fn(*values)`.
        self.is_plain = (
            len(self.forms) == 1
            and all(p.kind in _POSITIONAL for p in params)
            and not self._omit_defaults
        )
        self._required = sum(1 for p in params if p.default is _EMPTY)
        self._defaults = tuple(p.default for p in params)
        #: Each slot's default (`inspect.Parameter.empty` where it has none).
        self.defaults = self._defaults
        # Several forms: what a slot holds when the bound form lacks it.
        self._forms = tuple(_Form(form, self.index) for form in self.forms)
        self._absent: tuple[Any, ...] = tuple(
            () if kind is _VAR_POSITIONAL else None for kind in self.kinds
        )

    is_module = False  # a module op's slots say otherwise (see `_module_op`)

    def unknown_name_message(self, where: str, name: str, available: list[str]) -> str:
        return (
            f"the {where} names `{name}`, which `{self.name}` does not have; "
            f"a rule may name {listing(available)}."
        )

    def unknown_owned_message(self, where: str, owned: tuple[str, ...], name: str) -> str:
        return (
            f"the {where} declares owns={owned!r}, but `{self.name}` has no "
            f"parameter `{name}`; its parameters are {listing(self.names)}."
        )

    def _first_parameter(self, name: str) -> inspect.Parameter:
        return next(f.parameters[name] for f in self.forms if name in f.parameters)

    # ---- binding ----------------------------------------------------------------------------

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """One value per slot for the call `fn(*args, **kwargs)`, defaults applied."""
        if self.is_plain and not kwargs:
            n = len(args)
            if n == len(self.names):
                return args
            if self._required <= n < len(self.names):
                return args + self._defaults[n:]
        if kwargs and "out" in kwargs and "out" not in self.index and self._omit_defaults:
            self._refuse_out()
        if len(self._forms) > 1:
            return self._bind_forms(args, kwargs)
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

    def _bind_forms(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        keywords = tuple(kwargs)
        n_args = len(args)
        taking = [form for form in self._forms if form.accepts(n_args, keywords)]
        if not taking:
            self._refuse_call(args, kwargs)
        chosen = taking[0]
        for other in taking[1:]:
            for position in range(n_args):
                first, second = chosen.argument_name(position), other.argument_name(position)
                if first != second:
                    self._refuse_ambiguous(position, (chosen, first), (other, second))
        absent: list[Any] = list(self._absent)
        if self.var_keyword is not None:
            absent[self.var_keyword] = {}
        return tuple(chosen.bind(args, kwargs, absent))

    def _resolve(self, n_args: int, keywords: Sequence[str]) -> _Form | None:
        """The form a call of this shape binds to (the first that takes it)."""
        return next((f for f in self._forms if f.accepts(n_args, keywords)), None)

    def _show(self, form: inspect.Signature) -> str:
        return f"{self.name}{form}"

    def _refuse_out(self) -> None:
        msg = (
            f"`{self.name}` was called with `out=`, which an op with a custom backward does not "
            "support: autograd attaches the rule to a new result tensor, and writing into "
            "`out` would bypass it (torch itself refuses `out=` when an input requires grad). "
            f"Use the result instead: `y = {self.name}(...)`, or `y.copy_({self.name}(...))` "
            "outside of autograd."
        )
        raise GradOverrideTypeError(msg)

    def _refuse_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        reasons = []
        for form in self.forms:
            try:
                form.bind(*args, **kwargs)
            except TypeError as exc:
                reasons.append(f"`{self._show(form)}`: {exc}")
        msg = (
            f"`{self.name}` was called with arguments none of its documented forms takes "
            f"({'; '.join(reasons)}). Call it in one of these forms, or give the signature to "
            f'use: `custom_backward({self.name}, signature="(...)", ...)`.'
        )
        raise GradOverrideTypeError(msg)

    def _refuse_ambiguous(
        self, position: int, first: tuple[_Form, str], second: tuple[_Form, str]
    ) -> None:
        (form_a, name_a), (form_b, name_b) = first, second
        ordinal = _ordinal(position + 1)
        keyword = name_a.lstrip("*")
        msg = (
            f"`{self.name}` is documented in several forms that take this call but name its "
            f"{ordinal} positional argument differently: `{self._show(form_a.signature)}` "
            f"reads it as `{name_a}`, `{self._show(form_b.signature)}` as `{name_b}`, so the "
            "rule could not know which parameter it is. Pass it by keyword "
            f"(`{keyword}=...` or `{name_b.lstrip('*')}=...`), or give the one signature to use: "
            f'`custom_backward({self.name}, signature="{form_a.signature}", ...)`.'
        )
        raise GradOverrideTypeError(msg)

    # ---- calling back -----------------------------------------------------------------------

    def call(self, values: Sequence[Any]) -> Any:
        """Call the forward with one value per slot."""
        if self.is_plain:
            return self.fn(*values)
        if len(self._forms) > 1:
            return self._call_forms(values)
        positional: list[Any] = []
        keywords: dict[str, Any] = {}
        slots = zip(self.names, self.kinds, values, self._defaults, strict=True)
        for name, kind, value, default in slots:
            if kind in _POSITIONAL:
                positional.append(value)
            elif kind is _VAR_POSITIONAL:
                positional.extend(value)
            elif kind is _KEYWORD_ONLY:
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

    def caller(self) -> Callable[[Sequence[Any]], Any]:
        """`call` as a function closing over plain values only (the forward and its slots'
        names, kinds and defaults): what the generated Functions call, which dynamo traces
        (it cannot wrap a bound method it meets there without a source)."""
        fn = self.fn
        if self.is_plain:

            def call_plain(values: Sequence[Any]) -> Any:
                return fn(*values)

            return call_plain
        if len(self._forms) > 1:
            return self.call  # several forms: their binding objects are needed
        slots = tuple(zip(self.names, self.kinds, self._defaults, strict=True))
        omit = self._omit_defaults
        defaults = self._defaults

        def call(values: Sequence[Any]) -> Any:
            positional: list[Any] = []
            keywords: dict[str, Any] = {}
            for (name, kind, default), value in zip(slots, values, strict=True):
                if kind in _POSITIONAL:
                    positional.append(value)
                elif kind is _VAR_POSITIONAL:
                    positional.extend(value)
                elif kind is _KEYWORD_ONLY:
                    # Builtins read from their docs may reject a default passed explicitly
                    # (`out=None`), so leave defaults out for them.
                    if not (omit and value is default):
                        keywords[name] = value
                else:
                    keywords.update(value)
            if omit:
                while (
                    positional
                    and len(positional) <= len(defaults)
                    and positional[-1] is defaults[len(positional) - 1]
                ):
                    positional.pop()
            return fn(*positional, **keywords)

        return call

    def _call_forms(self, values: Sequence[Any]) -> Any:
        """Call the form the values came from, leaving out the defaults that form allows."""
        form = self._form_of(values)
        positional = [values[slot] for _, slot, _, _ in form.positional]
        keywords = {name: values[slot] for name, (slot, _) in form.keyword_only.items()}
        extra: dict[str, Any] = {} if form.var_keyword is None else values[form.var_keyword]
        varargs: tuple[Any, ...] = (
            () if form.var_positional is None else values[form.var_positional]
        )
        # Builtins may reject a default passed explicitly, so defaults are left out; but only
        # while the shorter call still binds to this form (`median(x, -1)` is not
        # `median(x)`, whose form reduces over every element).
        trimmed = {
            name: value
            for name, value in keywords.items()
            if value is not form.keyword_only[name][1]
        }
        if self._resolve(len(positional) + len(varargs), (*trimmed, *extra)) is form:
            keywords = trimmed
        if not varargs:
            while positional:
                default = form.positional[len(positional) - 1][2]
                if positional[-1] is not default:
                    break
                if self._resolve(len(positional) - 1, (*keywords, *extra)) is not form:
                    break
                positional.pop()
        return self.fn(*positional, *varargs, **keywords, **extra)

    def _form_of(self, values: Sequence[Any]) -> _Form:
        """The form with the fewest parameters among those that hold every given value.

        The bound form's missing slots hold None, so it is among them; a form with fewer
        parameters is too only when the values it lacks are None, which torch reads as not
        given.
        """
        best: _Form | None = None
        for form in self._forms:
            if best is not None and len(form.slots) >= len(best.slots):
                continue
            if all(
                slot in form.slots or _is_absent(values[slot]) for slot in range(len(values))
            ):
                best = form
        assert best is not None  # the bound form holds every value
        return best

    def __repr__(self) -> str:
        return " | ".join(self._show(form) for form in self.forms)


def _is_absent(value: Any) -> bool:
    return value is None or (type(value) in (tuple, dict) and not value)


def _ordinal(n: int) -> str:
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(n, f"{n}th")
