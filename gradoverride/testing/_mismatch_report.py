"""What `gradient_report` returns: one row per override, printed as a table."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from torch import Tensor

from .._table import format_table

__all__ = ["GradientReport", "MismatchRow"]


@dataclass(frozen=True)
class MismatchRow:
    """How far one override's gradient is from the reference (a row of `GradientReport`).

    Attributes:
        label: the override, as `"path: name"` (the module's path in the model, then the
            recipe's repr, the op's or the module's name), as `go.monitor` names it.
        kind: `"recipe"`, `"op"`, `"go.Module"`, `"override_backward"` or `"grad_hook"`.
        calls: how many times the forward called it.
        elements: how many input elements its gradient has, over all its calls.
        reference: what it was compared with: the proxy (`"clamp(x, -1, 1)"`), the
            directions (`"32 coordinates"`, `"32 ±1 directions"`), `"given"`; `"-"` when
            it was not compared.
        cosine: the cosine similarity of the override's gradient with the reference (NaN
            when either is zero); None when not compared.
        norm_ratio: |override's gradient| / |reference| (inf when only the reference is
            zero, NaN when both are); None when not compared.
        grad_norm: the norm of what was compared on the override's side (its gradient, or
            its directional derivatives); None when not compared.
        reference_norm: the same for the reference.
        note: why the row was not compared, or what to know about its numbers; "" if
            nothing.
        got: the override's side of the comparison, flat, in float64 (its gradient, or its
            gradient's directional derivatives along the directions); None when not
            compared.
        expected: the reference's side, the same way.
    """

    label: str
    kind: str
    calls: int
    elements: int
    reference: str
    cosine: float | None
    norm_ratio: float | None
    grad_norm: float | None
    reference_norm: float | None
    note: str
    got: Tensor | None
    expected: Tensor | None

    @property
    def compared(self) -> bool:
        """Whether this override was compared with a reference."""
        return self.cosine is not None


class GradientReport:
    """What `gradient_report` found: one `MismatchRow` per override; prints as a table.

    Attributes:
        model: the model's class name.
        reference: `"proxy"`, `"finite_differences"`, `"spsa"` or `"given"`.
        description: the reference in words (the title of the table).
        rows: one `MismatchRow` per override, in the order of their modules in the model.
        loss: the loss of the model as it is (the override run).
        forwards: how many forwards the report ran (its cost, with `backwards`).
        backwards: how many backward passes it ran.
    """

    def __init__(self, model: str, reference: str, description: str,
                 rows: Sequence[MismatchRow], loss: float, forwards: int,
                 backwards: int) -> None:
        self.model = model
        self.reference = reference
        self.description = description
        self.rows: tuple[MismatchRow, ...] = tuple(rows)
        self.loss = loss
        self.forwards = forwards
        self.backwards = backwards

    def __getitem__(self, key: str) -> MismatchRow:
        """The row of the override labelled `key` (or, if only one has it, named or at the
        module path `key`)."""
        for row in self.rows:
            if row.label == key:
                return row
        matches = [r for r in self.rows if key in (_name(r.label), _path(r.label))]
        if len(matches) == 1:
            return matches[0]
        labels = ", ".join(repr(r.label) for r in self.rows) or "none"
        many = f"{len(matches)} overrides match {key!r}" if matches else f"no override {key!r}"
        msg = f"{many}; the labels are {labels}"
        raise KeyError(msg)

    def __iter__(self) -> Iterator[MismatchRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        title = (f"gradient_report of {self.model} against {self.description}: loss "
                 f"{self.loss:.6g}; {self.forwards} forwards, {self.backwards} backward passes")
        if not self.rows:
            return f"{title}\nno gradient override ran in the forward"
        headers = ["override", "kind", "calls", "cosine", "norm ratio", "reference"]
        body = [
            [r.label, r.kind, str(r.calls), _number(r.cosine, ".4f"),
             _number(r.norm_ratio, ".4g"), r.reference]
            for r in self.rows
        ]
        right = [False, False, True, True, True, False]
        if any(r.note for r in self.rows):  # the column only when a row has something to say
            headers.append("note")
            for cells, r in zip(body, self.rows, strict=True):
                cells.append(r.note)
            right.append(False)
        return f"{title}\n{format_table(headers, body, right)}"

    __repr__ = __str__


def _number(value: float | None, spec: str) -> str:
    if value is None:
        return "-"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return format(value, spec)


def _name(label: str) -> str:
    return label.split(": ", 1)[1] if ": " in label else label


def _path(label: str) -> str:
    return label.split(": ", 1)[0]
