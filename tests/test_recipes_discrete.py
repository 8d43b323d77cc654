"""Discrete recipes: straight-through argmax and Gumbel-softmax. The forward is the one-hot
exactly; the backward is autograd of the softmax it stands for; no NaN in float16 or at tiny
temperatures; the generator makes noise reproducible."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
from conftest import tolerance
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad as func_grad
from torch.func import vmap

import gradoverride as go
from gradoverride import recipes as R
from gradoverride.recipes._discrete import gumbel_noise
from gradoverride.testing import strategies as gst

_TORCH_CTX_WARNING = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated:DeprecationWarning"
)

scores = gst.tensors(shape=gst.shapes(min_dims=1, min_side=1), scale=3.0)


def _grad(fn: Any, x: torch.Tensor, g: torch.Tensor) -> Any:
    leaf = x.detach().requires_grad_()
    y = fn(leaf)
    (gx,) = torch.autograd.grad(y, leaf, g)
    return y.detach(), gx


def _one_hot(x: torch.Tensor, dim: int) -> torch.Tensor:
    index = x.argmax(dim, keepdim=True)
    return torch.zeros_like(x).scatter_(dim, index, 1)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
@given(x=scores, dim=st.sampled_from([0, -1]))
def test_argmax_forward_is_the_one_hot_and_backward_the_softmax(
    temperature: float, x: torch.Tensor, dim: int
) -> None:
    recipe = R.ste_argmax(dim=dim, temperature=temperature)
    g = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
    y, gx = _grad(recipe, x, g)
    assert y.dtype == x.dtype and gx.dtype == x.dtype
    assert torch.equal(y, _one_hot(x, dim))
    _, expected = _grad(lambda t: torch.softmax(t / temperature, dim), x, g)
    torch.testing.assert_close(gx, expected, **tolerance(x.dtype))
    _, identity = _grad(R.ste_argmax(dim=dim, backward="identity"), x, g)
    assert torch.equal(identity, g)


def test_argmax_ties_go_to_the_first_index_and_0d_is_one() -> None:
    assert R.ste_argmax()(torch.tensor([1.0, 3.0, 3.0])).tolist() == [0, 1, 0]
    assert R.ste_argmax()(torch.tensor(2.0)).item() == 1.0


def _soft_sample(x: torch.Tensor, temperature: float, seed: int, dim: int = -1) -> torch.Tensor:
    """y_soft as the docstring states it, from the same noise (float32 for half inputs)."""
    work = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    noise = gumbel_noise(x.shape, dtype=work, generator=torch.Generator().manual_seed(seed))
    return torch.softmax((x.to(work) + noise) / temperature, dim)


@pytest.mark.parametrize("hard", [True, False])
@given(x=scores, seed=st.integers(0, 2**16), temperature=st.sampled_from([0.3, 1.0, 4.0]))
def test_gumbel_forward_and_backward_follow_the_soft_sample(
    hard: bool, x: torch.Tensor, seed: int, temperature: float
) -> None:
    recipe = R.gumbel_softmax(temperature=temperature, hard=hard)
    g = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
    y, gx = _grad(lambda t: recipe(t, generator=torch.Generator().manual_seed(seed)), x, g)
    assert y.dtype == x.dtype and gx.dtype == x.dtype
    soft = _soft_sample(x, temperature, seed)
    if hard:
        assert torch.equal(y, _one_hot(soft, -1).to(x.dtype))
    else:
        torch.testing.assert_close(y, soft.to(x.dtype), **tolerance(x.dtype))
    leaf = x.detach().requires_grad_()
    noise = gumbel_noise(x.shape, dtype=soft.dtype,
                         generator=torch.Generator().manual_seed(seed))
    proxy = torch.softmax((leaf.to(soft.dtype) + noise) / temperature, -1)
    (expected,) = torch.autograd.grad(proxy, leaf, g.to(soft.dtype))
    torch.testing.assert_close(gx, expected.to(x.dtype), **tolerance(x.dtype))


def test_gumbel_generator_makes_samples_reproducible() -> None:
    recipe = R.gumbel_softmax()
    logits = torch.zeros(50, 10)
    a = recipe(logits, generator=torch.Generator().manual_seed(7))
    b = recipe(logits, generator=torch.Generator().manual_seed(7))
    c = recipe(logits, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a.sum(-1), torch.ones(50))


@pytest.mark.parametrize("dtype", gst.FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("temperature", [1e-30, 1e-6, 1.0, 1e6])
def test_gumbel_never_nan(dtype: torch.dtype, temperature: float) -> None:
    big = 1e4 if dtype == torch.float16 else 1e30
    logits = torch.tensor([[0.0, 1.0, -1.0], [big, -big, 0.0], [-big, -big, -big]], dtype=dtype)
    g = torch.tensor([[1.0, -2.0, 0.5]] * 3, dtype=dtype)
    for hard in (True, False):
        recipe = R.gumbel_softmax(temperature=temperature, hard=hard)
        y, gx = _grad(lambda t, r=recipe: r(t, generator=torch.Generator().manual_seed(0)),
                      logits, g)
        assert not y.isnan().any() and not gx.isnan().any(), (hard, y, gx)
    y = R.gumbel_softmax(temperature=temperature)(logits)
    assert torch.equal(y.sum(-1), torch.ones(3, dtype=dtype))


def test_gumbel_noise_is_finite_at_the_uniforms_ends() -> None:
    noise = gumbel_noise((200_000,), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(noise).all()


def test_reprs_and_module_form() -> None:
    assert repr(R.ste_argmax()) == "ste_argmax(dim=-1, backward='softmax', temperature=1.0)"
    assert repr(R.gumbel_softmax(temperature=0.5)) == (
        "gumbel_softmax(temperature=0.5, dim=-1, hard=True)"
    )
    module = R.ste_argmax(dim=1).module()
    assert module(torch.tensor([[0.0, 2.0]])).tolist() == [[0.0, 1.0]]


def test_on_each_device(device: torch.device) -> None:
    x = torch.randn(3, 4, device=device)
    for recipe in (R.ste_argmax(), R.gumbel_softmax()):
        y, gx = _grad(recipe, x, torch.ones(3, 4, device=device))
        assert y.device == device and gx.device == device


@pytest.mark.compile
@_TORCH_CTX_WARNING
def test_compile_with_fullgraph_matches_eager() -> None:
    recipes = [R.ste_argmax(), R.ste_argmax(dim=0, backward="identity", temperature=0.5),
               R.gumbel_softmax(temperature=0.5)]
    x0 = torch.tensor([[0.5, -1.0, 2.0], [1.5, 0.0, -0.5]])
    w = torch.arange(6.0).reshape(2, 3)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return sum(((r(x) * w).sum() for r in recipes), torch.zeros(()))

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager_x = x0.clone().requires_grad_()
    (eager,) = torch.autograd.grad(loss(eager_x), eager_x)
    torch.manual_seed(0)
    compiled_x = x0.clone().requires_grad_()
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    (got,) = torch.autograd.grad(compiled(compiled_x), compiled_x)
    torch._dynamo.reset()
    torch.testing.assert_close(got, eager)


def test_vmap_of_grad_matches_the_loop() -> None:
    recipe = R.ste_argmax(temperature=0.7)
    xs = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(0))

    def f(x: torch.Tensor) -> torch.Tensor:
        return (recipe(x) * torch.arange(4.0)).sum()

    torch.testing.assert_close(vmap(func_grad(f))(xs), torch.stack([func_grad(f)(x) for x in xs]))


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: R.gumbel_softmax(temperature=0.0), go.GradOverrideError,
         r"gumbel_softmax: `temperature` must be a positive finite number; got float 0\.0\. "
         r"Use a small positive value \(say 0\.1\) for samples close to one-hot\."),
        (lambda: R.gumbel_softmax(temperature=math.nan), go.GradOverrideError,
         r"`temperature` must be a positive finite number; got float nan\."),
        (lambda: R.ste_argmax(temperature=True), go.GradOverrideError,
         r"ste_argmax: `temperature` must be a positive finite number; got bool True\."),
        (lambda: R.ste_argmax(backward="gumbel"), go.GradOverrideError,
         r"ste_argmax: `backward` must be 'softmax' .* or 'identity' .*; got 'gumbel'\."),
        (lambda: R.ste_argmax(dim=1.0), go.GradOverrideTypeError,
         r"ste_argmax: `dim` must be an integer; got float 1\.0\."),
        (lambda: R.gumbel_softmax()(torch.zeros(2), generator=3), go.GradOverrideTypeError,
         r"gumbel_softmax\(temperature=1\.0, dim=-1, hard=True\): `generator` must be a "
         r"torch\.Generator \(or None\); got int 3\."),
        (lambda: R.ste_argmax()(torch.zeros(3, 0)), go.GradOverrideError,
         r"ste_argmax\(dim=-1, backward='softmax', temperature=1\.0\) got a tensor with no "
         r"entries along dim -1 \(shape \(3, 0\)\); there is nothing to choose from\."),
        (lambda: R.ste_argmax()(torch.tensor([1, 2])), go.GradOverrideTypeError,
         r"takes a floating-point tensor of scores; got a torch\.int64 tensor\."),
    ],
)
def test_mistakes_are_errors_that_name_the_fix(call: Any, error: type[Exception],
                                               message: str) -> None:
    with pytest.raises(error, match=message):
        call()


def test_the_fused_softmax_backward_is_found_and_matches_the_formula() -> None:
    """A private aten op (with a written-out fallback): a silent fallback after a torch
    upgrade fails here instead of slowing users down."""
    from gradoverride.recipes import _discrete

    assert _discrete._SOFTMAX_BACKWARD is not None
    soft = torch.softmax(torch.randn(4, 5, dtype=torch.float64), -1)
    g = torch.randn(4, 5, dtype=torch.float64)
    fused = _discrete._softmax_grad(g, soft, -1, 0.5)
    written = soft * (g - (g * soft).sum(-1, keepdim=True)) / 0.5
    torch.testing.assert_close(fused, written)


def test_ste_argmax_gradient_is_finite_at_tiny_temperatures_and_large_logits() -> None:
    for dtype, temperature in ((torch.float16, 1e-4), (torch.float32, 1e-38)):
        x = torch.tensor([[10.0, 5.0, 0.0]], dtype=dtype, requires_grad=True)
        R.ste_argmax(temperature=temperature)(x).backward(torch.tensor([[1.0, 2.0, 3.0]]).to(dtype))
        assert x.grad is not None and x.grad.dtype == dtype
        assert torch.isfinite(x.grad).all()  # the softmax is one-hot: its gradient is 0
        torch.testing.assert_close(x.grad, torch.zeros(1, 3, dtype=dtype))


def test_dim_out_of_range_names_the_valid_range() -> None:
    with pytest.raises(go.GradOverrideError, match=re.escape(
        "got a tensor with 2 dimensions (shape (2, 3)), so `dim=5` is out of range; pass a dim "
        "in [-2, 1]."
    )):
        R.ste_argmax(dim=5)(torch.zeros(2, 3))
