"""What `check_backward` found: one row per differentiable input, printed as a table."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._compare import Difference, describe_dtype
from ._reference import FINITE_DIFFERENCES

__all__ = ["BackwardReport", "GradientRow"]


@dataclass(frozen=True)
class GradientRow:
    """The gradient `check_backward` got for one input, and how it compares.

    Attributes:
        name: the input's name (`x`, `xs[0]`, `args[1]`).
        grad: the gradient, or None when no gradient flows to the input.
        expected: the reference gradient (None: no reference, or the reference gives none).
        difference: how `grad` compares with the reference (None without one).
        problems: why the row fails, one sentence each; empty when it passes.
    """

    name: str
    grad: Tensor | None
    expected: Tensor | None
    difference: Difference | None
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """Whether the gradient passed every check."""
        return not self.problems

    @property
    def finite(self) -> bool:
        """Whether every element of the gradient is finite (True when there is none)."""
        return self.grad is None or bool(torch.isfinite(self.grad).all())

    def cells(self, with_reference: bool) -> list[str]:
        """The table cells of this row."""
        g = self.grad
        if g is None:
            cells = [self.name, "no gradient", "-", "-", "-"]
        else:
            cells = [
                self.name,
                str(tuple(g.shape)),
                describe_dtype(g.dtype),
                str(g.device),
                "yes" if self.finite else "NO",
            ]
        if with_reference:
            d = self.difference
            if d is None:
                cells += ["-", "-", "-"]
            else:
                cells += [f"{d.max_abs:.3g}", f"{d.max_rel:.3g}", f"{d.cosine:.6f}"]
        cells.append("ok" if self.ok else "MISMATCH")
        return cells


_HEADER = ["input", "grad shape", "dtype", "device", "finite"]
_REFERENCE_HEADER = ["max abs diff", "max rel diff", "cosine"]


class BackwardReport:
    """What `check_backward` found, one `GradientRow` per differentiable input.

    ```python
    import torch
    from gradoverride import recipes
    from gradoverride.testing import check_backward

    spike = recipes.spike(surrogate="fast_sigmoid")  # sg(x) = 1 / (1 + 2|x|)^2
    x = torch.linspace(-1, 1, 5)
    report = check_backward(spike, x, reference=torch.tanh, raise_on_mismatch=False)
    print(report.ok, report.mismatches)  # its gradient is not tanh's
    #> False ('x',)
    print(f"{report['x'].difference.cosine:.3f}", report.grads["x"].shape)
    #> 0.959 torch.Size([5])
    ```

    Attributes:
        fn_name: the checked function's name.
        rows: one `GradientRow` per input that gets a gradient, in input order.
        reference: how the reference was described (None without one).
        upstream: the upstream gradient used (`random normal (seed 0)`, `ones`, `given`).
    """

    def __init__(
        self,
        fn_name: str,
        rows: Sequence[GradientRow],
        *,
        reference: str | None,
        upstream: str,
    ) -> None:
        self.fn_name = fn_name
        self.rows: tuple[GradientRow, ...] = tuple(rows)
        self.reference = reference
        self.upstream = upstream

    @property
    def ok(self) -> bool:
        """Whether every input's gradient passed."""
        return all(row.ok for row in self.rows)

    @property
    def mismatches(self) -> tuple[str, ...]:
        """The names of the inputs whose gradient failed a check."""
        return tuple(row.name for row in self.rows if not row.ok)

    @property
    def grads(self) -> dict[str, Tensor | None]:
        """The gradient for each input, by name (None where none flows)."""
        return {row.name: row.grad for row in self.rows}

    def __getitem__(self, name: str) -> GradientRow:
        for row in self.rows:
            if row.name == name:
                return row
        msg = f"no input named {name!r}; the inputs are {', '.join(r.name for r in self.rows)}"
        raise KeyError(msg)

    def __iter__(self) -> Iterator[GradientRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        with_reference = self.reference is not None
        header = _HEADER + (_REFERENCE_HEADER if with_reference else []) + ["status"]
        table = [header] + [row.cells(with_reference) for row in self.rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        lines = [
            "  " + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
            for line in table
        ]
        against = f" against {self.reference}" if with_reference else ""
        title = (
            f"check_backward(`{self.fn_name}`){against}, upstream gradient {self.upstream}: "
            f"{'ok' if self.ok else 'MISMATCH in ' + ', '.join(self.mismatches)}"
        )
        problems = [f"  `{row.name}`: {p}" for row in self.rows for p in row.problems]
        return "\n".join([title, *lines, *problems])

    __str__ = __repr__


def mismatch_message(report: BackwardReport, reference: object, safe_ops: str) -> str:
    """The error `check_backward` raises for a failed report: the first failing input, the
    others, the problem and its fix (`safe_ops`: the framework's ops that make a rule safe
    where it divides or takes a log, as the hint names them)."""
    first = next(row for row in report.rows if not row.ok)
    others = [name for name in report.mismatches if name != first.name]
    also = f" (and for {', '.join(f'`{n}`' for n in others)})" if others else ""
    problem = first.problems[0]
    # (With allow_nonfinite=True a gradient that is not finite fails only by its values.)
    if problem.startswith("its gradient is not finite"):
        fix = (
            f"Make the rule safe where it divides or takes a log or square root ({safe_ops}), "
            "or pass `allow_nonfinite=True` if infinite gradients are intended."
        )
    elif problem.startswith("its gradient has"):
        fix = f"Make the rule return a gradient of `{first.name}`'s shape and dtype."
    else:
        fix = (
            f"Fix the rule's formula for `{first.name}`, or, if the reference only "
            "approximates the rule, loosen `atol=`/`rtol=` (or check only the direction "
            "with `min_cosine=`)."
        )
        if isinstance(reference, str) and reference == FINITE_DIFFERENCES:
            fix += (
                " Finite differences need a smooth forward: check a straight-through or "
                "surrogate rule against a proxy function instead. The step can also be the "
                "cause: too large for a strongly curved forward, too small for its "
                "precision; try another `step=`."
            )
    return (
        f"check_backward(`{report.fn_name}`): the gradient for `{first.name}` fails{also}: "
        f"{problem} {fix} Pass `raise_on_mismatch=False` to get "
        f"the report without raising.\n\n{report!r}"
    )
