"""Property tests: the rule contract holds for any shape (0-d, empty, non-contiguous) and any
floating dtype (float16, bfloat16, float32, float64), on the fast path and the general one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from conftest import tolerance
from hypothesis import given
from hypothesis import strategies as st

import gradoverride as go
from gradoverride.testing import strategies as gst

DTYPES = gst.FLOAT_DTYPES
_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}
tensors = gst.tensors
tensor_pairs = gst.tensor_pairs


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf that keeps `t`'s strides (non-contiguous stays non-contiguous)."""
    return t.detach().requires_grad_()


# ---- identity rules, one per code path --------------------------------------------------


@go.custom_backward
def round_fast(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)


@round_fast.backward
def _(grad: torch.Tensor) -> torch.Tensor:
    return grad


@go.custom_backward
def round_general(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)


@round_general.backward(once_differentiable=True)  # takes the general (reference) path
def _(grad: torch.Tensor) -> torch.Tensor:
    return grad


@go.custom_backward(owns="x")
def round_partial(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.round(x) * w


@round_partial.backward
def _(grad: torch.Tensor) -> torch.Tensor:
    return grad


@go.custom_backward
def round_container(xs: tuple[torch.Tensor]) -> torch.Tensor:
    return torch.round(xs[0])


@round_container.backward
def _(grad: torch.Tensor) -> Any:
    return {"xs": (grad,)}


def _x_grad_of_identity(kind: str, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    xl = _leaf(x)
    if kind == "fast":
        y = round_fast(xl)
    elif kind == "general":
        y = round_general(xl)
    elif kind == "partial":
        y = round_partial(xl, torch.ones((), dtype=x.dtype, requires_grad=True))
    else:
        y = round_container((xl,))
    (gx,) = torch.autograd.grad(y, xl, gy)
    return gx


@given(
    pair=tensor_pairs(),
    kind=st.sampled_from(("fast", "general", "partial", "container")),
)
def test_identity_rule_passes_gradient_bitwise(pair: tuple[torch.Tensor, ...], kind: str) -> None:
    x, gy = pair
    gx = _x_grad_of_identity(kind, x, gy)
    assert gx.dtype == x.dtype
    assert gx.shape == x.shape
    assert torch.equal(_bits(gx), _bits(gy))


# ---- a rule equal to the true derivative ------------------------------------------------


def _op_with_exact_rule(name: str) -> tuple[Any, Callable[[torch.Tensor], torch.Tensor]]:
    if name == "sin":

        def sin(x: torch.Tensor) -> torch.Tensor:
            return x.sin()

        def sin_rule(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
            return grad * x.cos()

        return go.custom_backward(sin, backward=sin_rule), sin
    if name == "exp":

        def exp(x: torch.Tensor) -> torch.Tensor:
            return x.exp()

        def exp_rule(grad: torch.Tensor, *, output: torch.Tensor) -> torch.Tensor:
            return grad * output

        return go.custom_backward(exp, backward=exp_rule), exp

    def square(x: torch.Tensor) -> torch.Tensor:
        return x * x

    def square_rule(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
        return 2 * x * grad

    return go.custom_backward(square, backward=square_rule), square


EXACT = {name: _op_with_exact_rule(name) for name in ("sin", "exp", "square")}


def _plain_grad(fn: Callable[..., torch.Tensor], x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    xl = _leaf(x)
    (gx,) = torch.autograd.grad(fn(xl), xl, gy)
    return gx


@given(pair=tensor_pairs(), name=st.sampled_from(sorted(EXACT)))
def test_exact_rule_matches_autograd(pair: tuple[torch.Tensor, ...], name: str) -> None:
    x, gy = pair
    op, plain = EXACT[name]
    got = _plain_grad(op, x, gy)
    want = _plain_grad(plain, x, gy)
    torch.testing.assert_close(got, want, **tolerance(x.dtype))


@go.custom_backward(owns="x")
def mul_partial(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


@mul_partial.backward
def _(grad: torch.Tensor, *, w: torch.Tensor) -> torch.Tensor:
    return grad * w


@given(data=st.data())
def test_exact_partial_rule_matches_autograd(data: st.DataObject) -> None:
    x, w = data.draw(tensor_pairs())
    gy = data.draw(tensors(dtype=x.dtype, shape=tuple(x.shape)))
    xl, wl = _leaf(x), _leaf(w)
    got = torch.autograd.grad(mul_partial(xl, wl), (xl, wl), gy)
    xr, wr = _leaf(x), _leaf(w)
    want = torch.autograd.grad(xr * wr, (xr, wr), gy)
    for g, e, inp in zip(got, want, (x, w), strict=True):
        assert g.dtype == inp.dtype and g.shape == inp.shape
        torch.testing.assert_close(g, e, **tolerance(x.dtype))


# ---- broadcast law ----------------------------------------------------------------------


@given(pair=tensor_pairs(), k=st.integers(1, 4), owns_all=st.booleans())
def test_broadcast_gradient_is_summed_down(
    pair: tuple[torch.Tensor, ...], k: int, owns_all: bool
) -> None:
    x, gy = pair

    def fwd(x: torch.Tensor, w: float) -> torch.Tensor:
        return x.sin() * w

    def rule(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
        g = grad * x.cos()
        return g.expand(k, *g.shape)  # an extra leading dim of size k

    op = go.custom_backward(fwd, backward=rule, owns=None if owns_all else "x")
    w = 1.0  # a non-tensor argument: x is the one tensor, so the rule returns a tensor
    got = _plain_grad(lambda t: op(t, w), x, gy)
    plain = _plain_grad(torch.sin, x, gy)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, k * plain, **tolerance(x.dtype))


# ---- gradient dtype and shape -----------------------------------------------------------


@given(
    x=tensors(),
    returned=st.sampled_from(DTYPES),
    extra_dim=st.booleans(),
    owns_all=st.booleans(),
)
def test_gradient_dtype_and_shape_equal_the_input(
    x: torch.Tensor, returned: torch.dtype, extra_dim: bool, owns_all: bool
) -> None:
    def fwd(x: torch.Tensor, w: float) -> torch.Tensor:
        return x * w

    def rule(grad: torch.Tensor) -> torch.Tensor:
        g = grad.to(returned)  # another float precision: cast back to the input's dtype
        return g.expand(2, *g.shape) if extra_dim else g

    op = go.custom_backward(fwd, backward=rule, owns=None if owns_all else "x")
    w = 3.0
    xl = _leaf(x)
    y = op(xl, w)
    (gx,) = torch.autograd.grad(y, xl, torch.ones_like(y))
    assert gx.dtype == x.dtype
    assert gx.shape == x.shape
    expected = torch.full_like(x, 2.0 if extra_dim else 1.0)
    torch.testing.assert_close(gx, expected, rtol=0, atol=0)


# ---- vmap of grad equals a Python loop ---------------------------------------------------


@given(data=st.data(), batch=st.integers(1, 3), kind=st.sampled_from(("owning", "partial")))
def test_vmap_of_grad_matches_loop(data: st.DataObject, batch: int, kind: str) -> None:
    xb, vb = data.draw(tensor_pairs(prefix=(batch,)))
    v = vb[0]  # an unbatched upstream weight, closed over
    if kind == "owning":
        op, _ = EXACT["sin"]

        def loss(x: torch.Tensor) -> torch.Tensor:
            return (op(x) * v).sum()
    else:
        w = torch.full((), 0.5, dtype=xb.dtype)

        def loss(x: torch.Tensor) -> torch.Tensor:
            return (mul_partial(x, w) * v).sum()

    got = torch.func.vmap(torch.func.grad(loss))(xb)
    rows = []
    for i in range(batch):
        xi = _leaf(xb[i])
        rows.append(torch.autograd.grad(loss(xi), xi)[0])
    want = torch.stack(rows)
    assert got.dtype == xb.dtype and got.shape == xb.shape
    torch.testing.assert_close(got, want, **tolerance(xb.dtype))
