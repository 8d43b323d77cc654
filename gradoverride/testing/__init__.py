"""Tools to check the backward rules you write: `check_backward` and `assert_consistent`.

```python
import torch
import gradoverride as go
from gradoverride.testing import assert_consistent, check_backward

@go.custom_backward
def spike(x):
    return (x > 0).to(x.dtype)

@spike.backward
def _(grad, *, x):
    return grad / (1 + x.abs()) ** 2  # the fast-sigmoid surrogate

x = torch.linspace(-2, 2, 9)
print(check_backward(spike, x, reference=lambda x: x / (1 + x.abs())).ok)  # its proxy
#> True
assert_consistent(spike, x)  # the same gradients eagerly, compiled and vmapped
```

`gradcheck` cannot check a straight-through or surrogate rule, whose backward is on purpose
not the derivative of its forward; `check_backward` checks each input's gradient for shape,
dtype, device and finiteness, and against what the rule stands for (a smooth proxy function,
finite differences, or given tensors). `assert_consistent` checks that eager mode,
`torch.compile(fullgraph=True)` and `torch.func.vmap` agree, and reports graph breaks.
`gradient_report` looks at a whole model instead: per override, how far the gradient it
produces is from a reference (the true gradient of its smooth proxy, finite differences or
SPSA of the true loss, or gradients you give), as a cosine similarity and a norm ratio.

`gradoverride.testing.strategies` holds Hypothesis strategies for tensors; import it
explicitly (it needs the `hypothesis` package, which `import gradoverride.testing` does not).

No pytest plugin or fixtures: both tools are plain functions that raise `GradOverrideError`
with a full message, so a test is one call, and a fixture would only wrap that call; an
auto-loaded plugin would run in every pytest session of every project that installs
gradoverride. Parametrize over devices with your own `device` fixture (ours is in
`tests/conftest.py`).
"""

from typing import TYPE_CHECKING, Any

from ._check import check_backward
from ._consistent import MODES, assert_consistent
from ._report import BackwardReport, GradientRow
from ._saved import saved_bytes

if TYPE_CHECKING:
    from ._mismatch import gradient_report
    from ._mismatch_report import GradientReport, MismatchRow

# Loaded on first use: the gradient report runs models through the diagnostics recorder.
_LAZY = {
    "gradient_report": "_mismatch",
    "GradientReport": "_mismatch_report",
    "MismatchRow": "_mismatch_report",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name not in _LAZY:
        msg = f"module 'gradoverride.testing' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "MODES",
    "BackwardReport",
    "GradientReport",
    "GradientRow",
    "MismatchRow",
    "assert_consistent",
    "check_backward",
    "gradient_report",
    "saved_bytes",
]
