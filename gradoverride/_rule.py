"""Reading a backward rule's signature once, at registration.

The rule's signature is the contract:

* positional parameters receive the upstream gradients, one per forward output (a forward
  that returns a plain tuple has one output per element; any other return value is one
  output, and its gradient has the same structure). A `*grads` parameter takes them all;
* keyword-only parameters name what the rule needs, and only what it names is kept for
  backward. A name is a forward parameter, a declared residual, or one of `RESERVED_NAMES`.

Names are checked here, so a typo fails when the rule is registered, not in backward.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ._errors import GradOverrideError, GradOverrideTypeError
from ._signature import describe, listing

__all__ = ["RESERVED_NAMES", "RuleSpec", "Slots", "normalize_names", "refuse_named_positionals"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)

#: The names a rule may ask for besides the forward's parameters and residuals.
RESERVED_NAMES: Mapping[str, str] = {
    "output": "the forward's result, with the structure the forward returned",
    "needs_grad": (
        "a dict from each forward parameter's name to whether this backward needs its "
        "gradient (always False for a parameter the rule does not own); a rule may return "
        "None for a parameter whose entry is False"
    ),
}


class Slots(Protocol):
    """What a rule is read against: an op's slots (a `ForwardSignature`, or the slots of the
    op around a module's forward, whose slot 0 holds the module)."""

    name: str
    names: tuple[str, ...]
    index: dict[str, int]
    is_module: bool

    def unknown_name_message(self, where: str, name: str, available: list[str]) -> str: ...

    def unknown_owned_message(
        self, where: str, owned: tuple[str, ...], name: str
    ) -> str: ...


def normalize_names(value: str | Iterable[str] | None, what: str, where: str) -> tuple[str, ...]:
    """Accept `"x"`, `("x", "w")` or `None` for a list of names."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    try:
        names = tuple(value)
    except TypeError:
        msg = (
            f"{where}: `{what}` must be a name or a tuple of names, "
            f"got {type(value).__name__} {value!r}."
        )
        raise GradOverrideTypeError(msg) from None
    for name in names:
        if not isinstance(name, str):
            msg = (
                f"{where}: `{what}` must hold parameter names as strings, "
                f"got {type(name).__name__} {name!r}."
            )
            raise GradOverrideTypeError(msg)
    return names


class RuleSpec:
    """What a registered rule takes, owns and asks for, read once from its signature."""

    __slots__ = (
        "materialize_grads",
        "method",
        "n_grads",
        "name",
        "once_differentiable",
        "owned",
        "owns_all",
        "owns_declared",
        "requested",
        "requested_residuals",
        "requested_slots",
        "rule",
        "wants_needs_grad",
        "wants_output",
    )

    def __init__(
        self,
        rule: Callable[..., Any],
        forward: Slots,
        *,
        owns: str | Iterable[str] | None,
        residuals: tuple[str, ...],
        once_differentiable: bool,
        materialize_grads: bool,
        method: bool = False,
        aliases: Mapping[str, int] | None = None,
    ) -> None:
        """`forward` gives the op's slots (a `ForwardSignature`, or a module op's slots).

        `method`: the rule is a method of the module in slot 0 (`go.Module`'s `backward`),
        called with the module first. `aliases`: reserved names standing for a slot (an
        override rule's `module`). A module op's slot 0 holds the module: it is never
        named, owned or given a gradient."""
        where = f"backward rule `{describe(rule)}` of `{forward.name}`"
        if not callable(rule):
            msg = (
                f"the backward of `{forward.name}` must be a callable taking the upstream "
                f"gradient, got {type(rule).__name__} {rule!r}."
            )
            raise GradOverrideTypeError(msg)
        try:
            signature = inspect.signature(rule)
        except (TypeError, ValueError):
            msg = (
                f"the {where} has no signature Python can read; "
                "wrap it in a `def rule(grad, *, x): ...` that names what it needs."
            )
            raise GradOverrideTypeError(msg) from None
        if method:
            # The module comes first (`self`); a function assigned on an instance is not bound.
            params = list(signature.parameters.values())
            signature = signature.replace(parameters=params[1:])

        self.rule = rule
        self.name = describe(rule)
        self.method = method
        aliases = dict(aliases or {})
        hidden = frozenset({0}) if forward.is_module else frozenset()
        nameable = tuple(n for i, n in enumerate(forward.names) if i not in hidden)
        n_grads: int | None = 0
        requested: list[str] = []
        for param in signature.parameters.values():
            if param.kind in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            ):
                if n_grads is not None:
                    n_grads += 1
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                n_grads = None
            elif param.kind is inspect.Parameter.KEYWORD_ONLY:
                requested.append(param.name)
            else:
                msg = (
                    f"the {where} takes `**{param.name}`; gradoverride keeps only what a rule "
                    "names, so name each value it needs as a keyword-only parameter, "
                    "e.g. `def rule(grad, *, x): ...`."
                )
                raise GradOverrideTypeError(msg)
        refuse_named_positionals(
            signature, forward.name, (*nameable, *residuals, *RESERVED_NAMES, *aliases),
            where, self.name, ("self",) if method else (),
        )
        if n_grads == 0:
            first = "self, grad" if method else "grad"
            msg = (
                f"the {where} has no positional parameter for the upstream gradient; "
                f"write it as `def {self.name.split('.')[-1]}({first}, *, ...)`: positional "
                "parameters receive the upstream gradients, one per output."
            )
            raise GradOverrideTypeError(msg)
        self.n_grads = n_grads

        available = [*nameable, *residuals, *RESERVED_NAMES, *aliases]
        for name in requested:
            if name in (*RESERVED_NAMES, *aliases) and (
                name in nameable or name in residuals
            ):
                msg = (
                    f"the {where} names `{name}`, which is both a reserved name and a "
                    f"parameter or residual of `{forward.name}`; rename that parameter."
                )
                raise GradOverrideTypeError(msg)
            if name not in available:
                raise GradOverrideTypeError(forward.unknown_name_message(where, name, available))
        self.requested = tuple(requested)
        self.requested_slots = tuple(
            (name, forward.index[name] if name in forward.index else aliases[name])
            for name in requested
            if (name in forward.index and forward.index[name] not in hidden) or name in aliases
        )
        self.requested_residuals = tuple(
            (name, residuals.index(name)) for name in requested if name in residuals
        )
        self.wants_output = "output" in requested
        self.wants_needs_grad = "needs_grad" in requested

        owned_names = normalize_names(owns, "owns", f"the {where}")
        for name in owned_names:
            if name not in forward.index or forward.index[name] in hidden:
                raise GradOverrideError(forward.unknown_owned_message(where, owned_names, name))
        self.owns_all = owns is None or set(owned_names) >= set(nameable)
        # TensorFlow only: a declared `owns` leaves variables the forward reads their own
        # gradient, even when it names every parameter (see _tensorflow/_backend.py).
        self.owns_declared = owns is not None
        self.owned = tuple(
            i not in hidden and (self.owns_all or name in owned_names)
            for i, name in enumerate(forward.names)
        )
        self.once_differentiable = bool(once_differentiable)
        self.materialize_grads = bool(materialize_grads)

    def __repr__(self) -> str:
        return f"<rule {self.name}>"


def refuse_named_positionals(
    signature: inspect.Signature,
    op: str,
    nameable: Iterable[str],
    where: str,
    rule_name: str,
    leading: tuple[str, ...] = (),
) -> None:
    """A positional parameter (after the first) named like something the rule may name (a
    forward parameter, a residual, a reserved name) is a forgotten `*`: it would receive an
    upstream gradient, not the value, and fail only at the first backward, with a count
    message. `signature` is the rule's, without a method's `self`."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    nameable = set(nameable)
    misplaced = [p.name for p in positional[1:] if p.name in nameable]
    if not misplaced:
        return
    grads = [p.name for p in positional if p.name not in misplaced]
    star = next((f"*{p.name}" for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), "*")
    keywords = [*misplaced, *(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)]
    arguments = ", ".join([*leading, *grads, star, *keywords])
    short = rule_name.split(".")[-1]
    fixed = f"lambda {arguments}: ..." if short == "<lambda>" else f"def {short}({arguments})"
    listed = listing(misplaced).replace(" or ", " and ")
    kind, pronoun = ("a positional parameter", "it") if len(misplaced) == 1 else (
        "positional parameters", "they"
    )
    msg = (
        f"the {where} takes {listed} as {kind}, but positional parameters receive the "
        f"upstream gradients (one per output of `{op}`), and {pronoun} name"
        f"{'s' if pronoun == 'it' else ''} what `{op}` provides. Did you mean "
        f"`{fixed}`? Values the rule needs are keyword-only parameters, after `*`."
    )
    raise GradOverrideTypeError(msg)
