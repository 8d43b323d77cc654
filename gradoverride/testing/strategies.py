"""Hypothesis strategies for tensors, to property-test backward rules.

gradoverride's own tests use these; so can yours:

```python
import torch
from hypothesis import given

from gradoverride import recipes
from gradoverride.testing import strategies as gst

@given(gst.tensors(dtype=gst.float_dtypes()))
def test_the_identity_rule_passes_the_gradient(x):
    x = x.detach().requires_grad_()
    recipes.ste_sign()(x).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))

test_the_identity_rule_passes_the_gradient()
print("passed")
#> passed
```

Needs `hypothesis` (the `test` extra); `import gradoverride` never imports it.

Every strategy draws from what the machine has: `devices()` yields CUDA only when a GPU is
there. Shapes include 0-d and empty (a zero-size dimension); layouts include non-contiguous
ones (transposed, strided); values can mix in edge cases (`edges=(0.0, -0.0, 1.0, -1.0)`
puts exact zeros of both signs and clip bounds into the tensor).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    import hypothesis.extra.numpy as hnp
    from hypothesis import strategies as st
except ImportError as error:  # pragma: no cover - the test extra installs it
    raise ImportError(
        "gradoverride.testing.strategies needs Hypothesis: pip install hypothesis "
        "(or the test extra, pip install 'gradoverride[test]')."
    ) from error
import torch

__all__ = [
    "FLOAT_DTYPES",
    "LAYOUTS",
    "broadcastable_shapes",
    "devices",
    "float_dtypes",
    "shapes",
    "tensor_pairs",
    "tensors",
]

#: The floating dtypes rules are tested in, low precision first.
FLOAT_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)

#: Memory layouts `tensors` draws: contiguous, last two dims swapped, every other element.
LAYOUTS: tuple[str, ...] = ("contiguous", "transposed", "strided")


def shapes(
    *, min_dims: int = 0, max_dims: int = 4, min_side: int = 0, max_side: int = 4
) -> st.SearchStrategy[tuple[int, ...]]:
    """Tensor shapes; by default 0-d and zero-size shapes included."""
    return hnp.array_shapes(
        min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side
    )


def float_dtypes(*, low_precision: bool = True) -> st.SearchStrategy[torch.dtype]:
    """float16, bfloat16 (unless `low_precision=False`), float32, float64."""
    if low_precision:
        return st.sampled_from(FLOAT_DTYPES)
    return st.sampled_from((torch.float32, torch.float64))


def devices() -> st.SearchStrategy[torch.device]:
    """The devices this machine has: CPU, and CUDA when a GPU is available."""
    available = [torch.device("cpu")]
    if torch.cuda.is_available():
        available.append(torch.device("cuda"))
    return st.sampled_from(available)


def broadcastable_shapes(
    shape: Sequence[int], *, min_dims: int = 0, max_dims: int = 4
) -> st.SearchStrategy[tuple[int, ...]]:
    """Shapes that broadcast together with `shape`."""
    return hnp.broadcastable_shapes(
        tuple(shape), min_dims=min_dims, max_dims=max(max_dims, len(shape)), min_side=0
    )


def _resolve(draw: st.DrawFn, value: Any) -> Any:
    return draw(value) if isinstance(value, st.SearchStrategy) else value


@st.composite
def tensors(
    draw: st.DrawFn,
    /,
    *,
    shape: Sequence[int] | st.SearchStrategy[tuple[int, ...]] | None = None,
    dtype: torch.dtype | st.SearchStrategy[torch.dtype] | None = None,
    device: torch.device | str | st.SearchStrategy[torch.device] | None = None,
    layouts: Sequence[str] = LAYOUTS,
    scale: float = 1.0,
    edges: Sequence[float] = (),
    prefix: Sequence[int] = (),
    requires_grad: bool = False,
) -> torch.Tensor:
    """A floating tensor: standard normal values times `scale`, in a drawn layout.

    Args:
        shape: a shape or a strategy of shapes (default: `shapes()`).
        dtype: a dtype or a strategy of dtypes (default: `float_dtypes()`).
        device: a device or a strategy of devices (default: CPU).
        layouts: the memory layouts to draw from (see `LAYOUTS`); a layout that needs more
            dimensions than the shape has falls back to contiguous.
        scale: multiplies the normal values (large scales reach a dtype's extremes).
        edges: values to mix in at drawn positions, e.g. `(0.0, -0.0, 1.0, -1.0)`.
        prefix: leading dimensions put before the drawn shape (a batch for `vmap`).
        requires_grad: return a leaf that requires grad (keeping the drawn strides).
    """
    size = (*prefix, *_resolve(draw, shapes() if shape is None else shape))
    kind = _resolve(draw, float_dtypes() if dtype is None else dtype)
    place = torch.device(_resolve(draw, "cpu" if device is None else device))
    layout = draw(st.sampled_from(tuple(layouts)))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)

    def randn(*dims: int) -> torch.Tensor:
        values = torch.randn(dims, generator=gen, dtype=torch.float64) * scale
        return values.to(device=place, dtype=kind)

    if layout == "transposed" and len(size) >= 2:
        out = randn(*size[:-2], size[-1], size[-2]).transpose(-1, -2)
    elif layout == "strided" and len(size) >= 1:
        out = randn(*size[:-1], 2 * size[-1])[..., ::2]
    else:
        out = randn(*size)
    if edges and out.numel():
        picks = torch.randint(0, len(edges) + 1, size, generator=gen)  # len(edges): keep
        for i, edge in enumerate(edges):
            # Writes through the view, so the drawn layout is kept.
            out[(picks == i).to(place)] = torch.tensor(edge, dtype=kind, device=place)
    if requires_grad:
        out = out.detach().requires_grad_()
    return out


@st.composite
def tensor_pairs(
    draw: st.DrawFn,
    /,
    *,
    broadcastable: bool = False,
    dtype: torch.dtype | st.SearchStrategy[torch.dtype] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two tensors of one dtype: the same shape, or (`broadcastable=True`) shapes that
    broadcast together. Other keyword arguments go to `tensors`."""
    kind = _resolve(draw, float_dtypes() if dtype is None else dtype)
    first = draw(shapes(max_dims=3))
    second = draw(broadcastable_shapes(first, max_dims=3)) if broadcastable else first
    a = draw(tensors(shape=first, dtype=kind, **kwargs))
    b = draw(tensors(shape=second, dtype=kind, **kwargs))
    return a, b
