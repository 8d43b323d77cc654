"""Reading a function's signature forms from text: a builtin's docstring, or `signature=`.

Builtins whose signature Python cannot read (`torch.sign`, `torch.sum`, ...) document it in
their docstring: the first line (`sign(input, *, out=None) -> Tensor`) and, for an overloaded
function, one `.. function:: sum(input, dim, keepdim=False, *, dtype=None)` line per further
form. Each form is parsed as a Python signature; the keyword-only `out` is dropped (writing
into `out=` cannot carry a gradient).
"""

from __future__ import annotations

import ast
import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ._errors import GradOverrideTypeError

__all__ = ["parse_forms", "read_forms"]

_EMPTY = inspect.Parameter.empty
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VAR_POSITIONAL = inspect.Parameter.VAR_POSITIONAL
_VAR_KEYWORD = inspect.Parameter.VAR_KEYWORD
_KEYWORD_ONLY = inspect.Parameter.KEYWORD_ONLY

# Prefixes of the docstring lines that document a further form of an overloaded builtin.
_DIRECTIVES = (".. function::", ".. method::")
_OPENING = {"(": ")", "[": "]", "{": "}"}


def _closing_paren(text: str, start: int) -> int:
    """Index of the `)` that closes the `(` at `start` (brackets and quotes respected)."""
    stack: list[str] = []
    quote = ""
    for i in range(start, len(text)):
        char = text[i]
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char in _OPENING:
            stack.append(_OPENING[char])
        elif stack and char == stack[-1]:
            stack.pop()
            if not stack:
                return i
    msg = "its parameter list is not closed"
    raise ValueError(msg)


def _is_optional(annotation: ast.expr | None) -> bool:
    """`Optional[T]`, `Union[..., None]`, `T | None` or `None`: torch docs' "may be left out"."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant):
        return annotation.value is None
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _is_optional(annotation.left) or _is_optional(annotation.right)
    if isinstance(annotation, ast.Subscript):
        head = annotation.value
        head_name = head.attr if isinstance(head, ast.Attribute) else getattr(head, "id", "")
        if head_name == "Optional":
            return True
        if head_name == "Union":
            members = annotation.slice
            items = members.elts if isinstance(members, ast.Tuple) else [members]
            return any(_is_optional(item) for item in items)
    return False


def _default_value(node: ast.expr) -> Any:
    """A documented default: a literal, or a dotted name of a loaded module (`torch.strided`)."""
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    parts: list[str] = []
    root = node
    while isinstance(root, ast.Attribute):
        parts.append(root.attr)
        root = root.value
    if parts and isinstance(root, ast.Name) and root.id in sys.modules:
        value: Any = sys.modules[root.id]
        for part in reversed(parts):
            value = getattr(value, part, _EMPTY)
        if value is not _EMPTY:
            return value
    msg = f"its default `{ast.unparse(node)}` is neither a literal nor a loaded module's name"
    raise ValueError(msg)


def _parameters(args: ast.arguments) -> list[inspect.Parameter]:
    """The parameters of a parsed `def`, defaults evaluated.

    A parameter documented as optional (`out: Optional[Tensor]`) without a default gets None
    where the signature allows one (keyword-only, or a trailing positional parameter).
    """
    positional = [*args.posonlyargs, *args.args]
    pos_defaults: list[Any] = [_EMPTY] * (len(positional) - len(args.defaults))
    pos_defaults += [_default_value(d) for d in args.defaults]
    for i in range(len(positional) - 1, -1, -1):
        if pos_defaults[i] is not _EMPTY:
            continue
        if not _is_optional(positional[i].annotation):
            break
        pos_defaults[i] = None
    params: list[inspect.Parameter] = []
    for i, (arg, default) in enumerate(zip(positional, pos_defaults, strict=True)):
        kind = (
            inspect.Parameter.POSITIONAL_ONLY
            if i < len(args.posonlyargs)
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        params.append(inspect.Parameter(arg.arg, kind, default=default))
    if args.vararg is not None:
        params.append(inspect.Parameter(args.vararg.arg, _VAR_POSITIONAL))
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if kw_default is not None:
            value = _default_value(kw_default)
        else:
            value = None if _is_optional(arg.annotation) else _EMPTY
        params.append(inspect.Parameter(arg.arg, _KEYWORD_ONLY, default=value))
    if args.kwarg is not None:
        params.append(inspect.Parameter(args.kwarg.arg, _VAR_KEYWORD))
    return params


def _parse_form(text: str, names: Sequence[str] | None) -> inspect.Signature:
    """`name(params) -> result`, or just `(params)`, as a signature; ValueError says why not.

    `names`: the names the text may start with (a docstring's form must name its function);
    None accepts any name or none.
    """
    text = text.strip()
    for directive in _DIRECTIVES:
        if text.startswith(directive):
            text = text[len(directive) :].strip()
    opening = text.find("(")
    if opening < 0:
        msg = "it has no parameter list in parentheses"
        raise ValueError(msg)
    head = text[:opening].strip()
    if names is not None and head not in names:
        msg = f"it documents `{head}`, not this function"
        raise ValueError(msg)
    if names is None and head and not all(part.isidentifier() for part in head.split(".")):
        msg = f"`{head}` before the parameter list is not a name"
        raise ValueError(msg)
    closing = _closing_paren(text, opening)
    rest = text[closing + 1 :].strip()
    if rest and not rest.startswith("->"):
        msg = f"`{rest}` follows the parameter list (only `-> result` may)"
        raise ValueError(msg)
    try:
        tree = ast.parse(f"def _{text[opening : closing + 1]}: pass")
    except SyntaxError as exc:
        msg = f"its parameter list is not Python syntax ({exc.msg})"
        raise ValueError(msg) from None
    func = tree.body[0]
    assert isinstance(func, ast.FunctionDef)  # the source is one `def`
    return inspect.Signature(_parameters(func.args))


def _doc_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The names a builtin's docstring may document it under.

    `torch.special.erf` is `special_erf` to Python and `erf(...)` in its docs;
    `torch.linalg.norm` is `linalg_norm` and `linalg.norm(...)`.
    """
    name = str(getattr(fn, "__name__", "") or "")
    if not name:
        return ()
    names = [name]
    module = str(getattr(fn, "__module__", "") or "")
    prefix = module.rsplit(".", 1)[-1].lstrip("_")
    if prefix and name.startswith(prefix + "_"):
        names += [name[len(prefix) + 1 :], f"{prefix}.{name[len(prefix) + 1 :]}"]
    return tuple(names)


def _forms_from_doc(fn: Callable[..., Any]) -> list[inspect.Signature]:
    """Every form a builtin's docstring documents: its first lines and `.. function::` lines."""
    doc = getattr(fn, "__doc__", None)
    names = _doc_names(fn)
    if not isinstance(doc, str) or not names:
        return []
    forms: list[inspect.Signature] = []
    for number, line in enumerate(doc.strip().splitlines()):
        line = line.strip()
        is_directive = line.startswith(_DIRECTIVES)
        if not is_directive and (number >= 3 or forms):
            continue
        if not is_directive and not line.startswith(tuple(n + "(" for n in names)):
            continue
        try:
            form = _without_out(_parse_form(line, names))
        except ValueError:
            continue
        if all(str(form) != str(known) for known in forms):
            forms.append(form)
    return forms


def _without_out(form: inspect.Signature) -> inspect.Signature:
    """The form without its keyword-only `out`: writing into `out` cannot carry a gradient."""
    params = [
        p for p in form.parameters.values() if not (p.name == "out" and p.kind is _KEYWORD_ONLY)
    ]
    return form.replace(parameters=params)


def parse_forms(text: str | Sequence[str], where: str) -> tuple[inspect.Signature, ...]:
    """The forms a user gave as `signature=`: one string, or one per form."""
    texts: list[Any] = [text] if isinstance(text, str) else []
    if not texts and isinstance(text, Sequence):
        texts = list(text)
    if not texts or not all(isinstance(t, str) for t in texts):
        msg = (
            f"{where}: `signature` must be the parameter list as a string, such as "
            f'"(input, dim=None, keepdim=False)", or a tuple of such strings (one per form); '
            f"got {text!r}."
        )
        raise GradOverrideTypeError(msg)
    forms = []
    for item in texts:
        try:
            form = _parse_form(item, None)
        except ValueError as exc:
            msg = (
                f"{where}: cannot read signature={item!r}: {exc}. Write the parameter list "
                'as Python does, with literal defaults: "(input, dim=None, keepdim=False)".'
            )
            raise GradOverrideTypeError(msg) from None
        if "out" in form.parameters:
            msg = (
                f"{where}: signature={item!r} has an `out` parameter; an op with a custom "
                "backward returns a new tensor for autograd to attach the rule to, so it "
                "does not take `out=`. Leave `out` out of the signature."
            )
            raise GradOverrideTypeError(msg)
        forms.append(form)
    return tuple(forms)


def read_forms(fn: Callable[..., Any]) -> tuple[tuple[inspect.Signature, ...], bool]:
    """The forward's forms (one unless documented overloads), and whether they were read
    from its docstring or guessed (a builtin)."""
    try:
        return (inspect.signature(fn),), False
    except (TypeError, ValueError):
        pass
    forms = _forms_from_doc(fn)
    if forms:
        return tuple(forms), True
    generic = inspect.Signature(
        [
            inspect.Parameter("args", _VAR_POSITIONAL),
            inspect.Parameter("kwargs", _VAR_KEYWORD),
        ]
    )
    return (generic,), True


