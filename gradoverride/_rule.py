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
from typing import Any

from ._errors import GradOverrideError, GradOverrideTypeError
from ._signature import ForwardSignature, describe

__all__ = ["RESERVED_NAMES", "RuleSpec", "normalize_names"]

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
        forward: ForwardSignature,
        *,
        owns: str | Iterable[str] | None,
        residuals: tuple[str, ...],
        once_differentiable: bool,
        materialize_grads: bool,
    ) -> None:
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

        self.rule = rule
        self.name = describe(rule)
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
        _refuse_named_positionals(signature, forward, residuals, where, self.name)
        if n_grads == 0:
            msg = (
                f"the {where} has no positional parameter for the upstream gradient; "
                f"write it as `def {self.name.split('.')[-1]}(grad, *, ...)`: positional "
                "parameters receive the upstream gradients, one per output."
            )
            raise GradOverrideTypeError(msg)
        self.n_grads = n_grads

        available = [*forward.names, *residuals, *RESERVED_NAMES]
        for name in requested:
            if name in RESERVED_NAMES and (name in forward.index or name in residuals):
                msg = (
                    f"the {where} names `{name}`, which is both a reserved name and a "
                    f"parameter or residual of `{forward.name}`; rename that parameter."
                )
                raise GradOverrideTypeError(msg)
            if name not in available:
                msg = (
                    f"the {where} names `{name}`, which `{forward.name}` does not have; "
                    f"a rule may name {_listing(available)}."
                )
                raise GradOverrideTypeError(msg)
        self.requested = tuple(requested)
        self.requested_slots = tuple(
            (name, forward.index[name]) for name in requested if name in forward.index
        )
        self.requested_residuals = tuple(
            (name, residuals.index(name)) for name in requested if name in residuals
        )
        self.wants_output = "output" in requested
        self.wants_needs_grad = "needs_grad" in requested

        owned_names = normalize_names(owns, "owns", f"the {where}")
        for name in owned_names:
            if name not in forward.index:
                msg = (
                    f"the {where} declares owns={owned_names!r}, but `{forward.name}` has no "
                    f"parameter `{name}`; its parameters are {_listing(forward.names)}."
                )
                raise GradOverrideError(msg)
        self.owns_all = owns is None or set(owned_names) == set(forward.names)
        # TensorFlow only: a declared `owns` leaves variables the forward reads their own
        # gradient, even when it names every parameter (see _tensorflow/_backend.py).
        self.owns_declared = owns is not None
        self.owned = tuple(
            self.owns_all or name in owned_names for name in forward.names
        )
        self.once_differentiable = bool(once_differentiable)
        self.materialize_grads = bool(materialize_grads)

    def __repr__(self) -> str:
        return f"<rule {self.name}>"


def _refuse_named_positionals(
    signature: inspect.Signature,
    forward: ForwardSignature,
    residuals: tuple[str, ...],
    where: str,
    rule_name: str,
) -> None:
    """A positional parameter (after the first) named like a forward parameter, a residual or
    a reserved name is a forgotten `*`: it would receive an upstream gradient, not the value,
    and fail only at the first backward, with a count message."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in _POSITIONAL]
    nameable = {*forward.names, *residuals, *RESERVED_NAMES}
    misplaced = [p.name for p in positional[1:] if p.name in nameable]
    if not misplaced:
        return
    grads = [p.name for p in positional if p.name not in misplaced]
    star = next((f"*{p.name}" for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), "*")
    keywords = [*misplaced, *(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)]
    arguments = ", ".join([*grads, star, *keywords])
    short = rule_name.split(".")[-1]
    fixed = f"lambda {arguments}: ..." if short == "<lambda>" else f"def {short}({arguments})"
    listed = _listing(misplaced).replace(" or ", " and ")
    kind, pronoun = ("a positional parameter", "it") if len(misplaced) == 1 else (
        "positional parameters", "they"
    )
    msg = (
        f"the {where} takes {listed} as {kind}, but positional parameters receive the "
        f"upstream gradients (one per output of `{forward.name}`), and {pronoun} name"
        f"{'s' if pronoun == 'it' else ''} what `{forward.name}` provides. Did you mean "
        f"`{fixed}`? Values the rule needs are keyword-only parameters, after `*`."
    )
    raise GradOverrideTypeError(msg)


def _listing(names: Iterable[str]) -> str:
    quoted = [f"`{n}`" for n in names]
    if not quoted:
        return "nothing"
    if len(quoted) == 1:
        return quoted[0]
    return ", ".join(quoted[:-1]) + " or " + quoted[-1]
