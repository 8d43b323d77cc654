"""Discrete recipes: straight-through argmax, Gumbel-softmax and the rotation trick. The
forward is the one-hot (or the code) exactly; the backward is autograd of what it stands
for; no NaN in float16 or at tiny temperatures; the generator or given noise makes samples
reproducible; the rotation trick is vector-quantize-pytorch's `rotate_to`."""

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
    # (an upstream gradient drawn from a seeded generator: the example alone decides the
    # outcome, as Hypothesis requires)
    g = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    g = g.to(x.dtype)
    y, gx = _grad(recipe, x, g)
    assert y.dtype == x.dtype and gx.dtype == x.dtype
    assert torch.equal(y, _one_hot(x, dim))
    if x.dtype in (torch.float16, torch.bfloat16):
        # Softmax's backward, s * (g - sum(g * s)) / T, in float64 from the same values: a
        # half-precision result is within a few roundings of its terms' size (a comparison
        # with autograd in half precision compares two roundings of a cancellation).
        s = torch.softmax(x.double() / temperature, dim)
        g64 = g.double()
        exact = s * (g64 - (g64 * s).sum(dim, keepdim=True)) / temperature
        size = s * (g64.abs() + (g64.abs() * s).sum(dim, keepdim=True)) / temperature
        bound = 8 * torch.finfo(x.dtype).eps * size + torch.finfo(x.dtype).tiny
        assert ((gx.double() - exact).abs() <= bound).all(), (gx, exact)
    else:
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
    noise = gumbel_noise(x.shape, dtype=work, generator=torch.Generator().manual_seed(seed),
                         draw_dtype=x.dtype)
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
                         generator=torch.Generator().manual_seed(seed), draw_dtype=x.dtype)
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
    # An exponential draw that rounds to 0 (float16 has few values near 0) stays finite.
    half = gumbel_noise((200_000,), dtype=torch.float16,
                        generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(half).all()


@pytest.mark.parametrize("hard", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_gumbel_draws_as_torch_does_with_the_same_seed(hard: bool, dtype: torch.dtype) -> None:
    # torch.nn.functional.gumbel_softmax draws from the global generator: seeded alike, a
    # swap gives the same samples.
    logits = torch.randn(64, 7, generator=torch.Generator().manual_seed(3), dtype=dtype)
    torch.manual_seed(11)
    theirs = torch.nn.functional.gumbel_softmax(logits, tau=0.5, hard=hard)
    torch.manual_seed(11)
    ours = R.gumbel_softmax(temperature=0.5, hard=hard)(logits)
    if hard:
        assert torch.equal(ours, theirs)
    else:  # (ours subtracts the largest score before dividing: rounding apart)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # And the same generator state afterwards: the next draws agree too.
    assert torch.equal(torch.rand(3), (torch.manual_seed(11), torch.empty(64, 7, dtype=dtype)
                                        .exponential_(), torch.rand(3))[2])


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


# ---- Gumbel-softmax with given noise -------------------------------------------------------------


@pytest.mark.parametrize("hard", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_gumbel_with_given_noise_is_torchs_gumbel_softmax_on_the_same_draws(
    hard: bool, dtype: torch.dtype
) -> None:
    # torch.nn.functional.gumbel_softmax draws G = -log(Exponential(1)) from the global
    # generator: the same draws, given as noise=, give its sample and gradient.
    logits = torch.tensor([[1.0, 3.0, 0.5, -2.0], [0.0, 0.0, 1e-3, -1e-3]], dtype=dtype)
    g = torch.tensor([[1.0, -1.0, 2.0, 0.5], [3.0, 0.0, -2.0, 1.0]], dtype=dtype)
    for seed in range(5):
        torch.manual_seed(seed)
        draws = -torch.empty_like(logits).exponential_().log()
        torch.manual_seed(seed)
        ref_y, ref_g = _grad(
            lambda t: torch.nn.functional.gumbel_softmax(t, tau=0.5, hard=hard), logits, g
        )
        y, gx = _grad(
            lambda t, n=draws: R.gumbel_softmax(temperature=0.5, hard=hard)(t, noise=n),
            logits, g,
        )
        assert y.dtype == gx.dtype == dtype
        torch.testing.assert_close(y, ref_y, **tolerance(dtype))
        torch.testing.assert_close(gx, ref_g, **tolerance(dtype))
        if hard:
            assert torch.equal(y, ref_y)


def test_gumbel_given_noise_reproduces_a_run_and_gets_the_scores_gradient() -> None:
    logits = torch.tensor([[1.0, 3.0, 0.5]], requires_grad=True)
    noise = gumbel_noise(logits.shape, generator=torch.Generator().manual_seed(7))
    drawn = R.gumbel_softmax(hard=False)(logits, generator=torch.Generator().manual_seed(7))
    given_noise = noise.clone().requires_grad_()
    again = R.gumbel_softmax(hard=False)(logits, noise=given_noise)
    assert torch.equal(again, drawn)
    weights = torch.tensor([[1.0, -1.0, 2.0]])
    g_logits, g_noise = torch.autograd.grad((again * weights).sum(), (logits, given_noise))
    assert torch.equal(g_logits, g_noise)  # the scores are logits + noise
    soft = torch.softmax(logits.detach() + noise, -1)
    torch.testing.assert_close(g_logits, soft * (weights - (weights * soft).sum(-1, True)))
    # half inputs: the noise is used in float32, the sample in the input's dtype
    half = R.gumbel_softmax()(logits.detach().half(), noise=noise)
    assert half.dtype == torch.float16 and half.tolist() == [[0.0, 1.0, 0.0]]


@pytest.mark.compile
@_TORCH_CTX_WARNING
def test_gumbel_with_given_noise_compiles_with_fullgraph() -> None:
    from gradoverride.testing import assert_consistent

    noise = gumbel_noise((2, 3), generator=torch.Generator().manual_seed(1))
    recipe = R.gumbel_softmax(temperature=0.7)
    weights = torch.tensor([[1.0, -1.0, 2.0], [0.5, 0.0, 3.0]])
    assert_consistent(lambda x, n: (recipe(x, noise=n) * weights).sum(),
                      torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 1.0]]), noise,
                      modes=("compile",))


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        ({"noise": torch.zeros(2, 3), "generator": torch.Generator()}, go.GradOverrideError,
         r"gumbel_softmax\(.*\) got both `generator=` and `noise=`; pass one: `generator` "
         r"draws the noise, `noise` gives the draws\."),
        ({"noise": torch.zeros(3)}, go.GradOverrideError,
         r"gumbel_softmax\(.*\): `noise` must have the scores' shape and device, \(2, 3\) on "
         r"cpu; got \(3,\) on cpu\. Draw one value per score"),
        ({"noise": torch.zeros(2, 3, dtype=torch.int64)}, go.GradOverrideTypeError,
         r"`noise` must be a floating-point tensor of Gumbel draws shaped like the scores; got "
         r"a torch\.int64 tensor\."),
        ({"noise": [[0.0] * 3] * 2}, go.GradOverrideTypeError,
         r"`noise` must be a floating-point tensor .*; got list "),
    ],
)
def test_gumbel_noise_mistakes_are_errors(kwargs: Any, error: type[Exception], message: str
                                          ) -> None:
    with pytest.raises(error, match=message):
        R.gumbel_softmax()(torch.zeros(2, 3), **kwargs)


# ---- the rotation trick ----------------------------------------------------------------------


def _rotation_grad(x: torch.Tensor, q: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d/dx of sum(g * (lambda R) x), with lambda R held constant: (lambda R)^T g."""
    leaf = x.double().detach().requires_grad_()
    eps = 1e-6
    flat, codes = leaf.reshape(-1, x.shape[-1]), q.double().reshape(-1, x.shape[-1])
    rows = []
    for e, c in zip(flat, codes, strict=True):
        ed = e.detach()
        u = ed / ed.norm().clamp_min(eps)
        v = c / c.norm().clamp_min(eps)
        w = (u + v) / (u + v).norm().clamp_min(eps)
        rotation = (torch.eye(e.numel(), dtype=torch.float64) - 2 * torch.outer(w, w)
                    + 2 * torch.outer(v, u))
        rows.append(c.norm() / ed.norm().clamp_min(eps) * (rotation @ e))
    out = torch.stack(rows).reshape(x.shape)
    (gx,) = torch.autograd.grad(out, leaf, g.double())
    return gx


@given(x=gst.tensors(shape=gst.shapes(min_dims=1, max_dims=3, min_side=1), scale=2.0,
                     dtype=gst.float_dtypes(low_precision=False)), seed=st.integers(0, 99))
def test_rotation_trick_forward_is_q_and_backward_the_rotation(x: torch.Tensor, seed: int
                                                               ) -> None:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.dtype)
    y, gx = _grad(lambda t: R.rotation_trick()(t, q), x, g)
    assert y.dtype == gx.dtype == x.dtype
    assert torch.equal(y, q)
    torch.testing.assert_close(gx, _rotation_grad(x, q, g).to(x.dtype),
                               **tolerance(x.dtype))


def test_rotation_trick_at_its_edges() -> None:
    q = torch.tensor([[3.0, 4.0]], dtype=torch.float64)
    g = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    trick = R.rotation_trick()
    for x, expected in [
        (q / 5, g * 5.0 / 1.0),                 # same direction: R = I, lambda = |q| / |x| = 5
        (-q, g - 2 * (g * q / 5).sum() * q / 5),  # opposite: the reflection I - 2 v v^T, lambda 1
        (torch.zeros(1, 2, dtype=torch.float64),  # x = 0: u = 0, w = v, lambda = |q| / eps
         (g - 2 * (g * q / 5).sum() * q / 5) * 5 / 1e-6),
    ]:
        y, gx = _grad(lambda t: trick(t, q), x, g)
        assert torch.equal(y, q)
        torch.testing.assert_close(gx, expected)
    _, at_zero_code = _grad(lambda t: trick(t, torch.zeros_like(q)), q, g)
    assert at_zero_code.tolist() == [[0.0, 0.0]]  # q = 0: lambda = 0


def test_rotation_trick_along_another_dim_half_inputs_and_no_gradient_for_q() -> None:
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
    q = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)
    g = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(2))
    _, along_1 = _grad(lambda t: R.rotation_trick(dim=1)(t, q), x, g)
    _, last = _grad(lambda t: R.rotation_trick()(t.movedim(1, -1), q.movedim(1, -1)), x,
                    g.movedim(1, -1))
    torch.testing.assert_close(along_1, last)
    leaf = x.clone().requires_grad_()
    gx, gq = torch.autograd.grad(R.rotation_trick()(leaf, q).sum(), (leaf, q), allow_unused=True)
    assert gq is None and gx is not None
    for dtype in (torch.float16, torch.bfloat16):  # computed in float32, returned in dtype
        code = q.detach().to(dtype)
        y, gh = _grad(lambda t, c=code: R.rotation_trick()(t, c), x.to(dtype), g.to(dtype))
        assert y.dtype == gh.dtype == dtype and torch.isfinite(gh).all()
        torch.testing.assert_close(gh.float(), _rotation_grad(x.to(dtype), q.to(dtype),
                                                               g.to(dtype)).float(),
                                   **tolerance(dtype))


@pytest.mark.compile
@_TORCH_CTX_WARNING
def test_rotation_trick_compiles_and_vmaps() -> None:
    from gradoverride.testing import assert_consistent

    q = torch.tensor([[1.0, 2.0, -1.0], [0.5, 0.0, 2.0]])
    weights = torch.tensor([[1.0, -1.0, 2.0], [0.5, 3.0, -2.0]])
    x0 = torch.tensor([[0.3, -1.0, 2.0], [1.0, 1.0, 0.0]])
    trick = R.rotation_trick()
    assert_consistent(lambda x: (trick(x, q) * weights).sum(), x0, modes=("compile",))

    def f(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return (trick(x, c) * weights[0]).sum()

    looped = torch.stack([func_grad(f)(x, c) for x, c in zip(x0, q, strict=True)])
    torch.testing.assert_close(vmap(func_grad(f))(x0, q), looped)


def test_rotation_trick_module_form_and_repr() -> None:
    layer = R.rotation_trick().module()
    assert repr(layer) == "rotation_trick(dim=-1, eps=1e-06)"
    x, q = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.equal(layer(x, q), q)


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda: R.rotation_trick()(torch.zeros(2, 3), torch.zeros(2, 4)), go.GradOverrideError,
         r"rotation_trick\(dim=-1, eps=1e-06\): `x` and its codebook vector `q` must have the "
         r"same shape; got \(2, 3\) and \(2, 4\)\. Gather one code per vector first"),
        (lambda: R.rotation_trick()(torch.zeros(()), torch.zeros(())), go.GradOverrideError,
         r"rotation_trick\(.*\) got tensors of shape \(\), with no dimension -1 to hold the "
         r"vectors"),
        (lambda: R.rotation_trick(dim=2)(torch.zeros(2, 3), torch.zeros(2, 3)),
         go.GradOverrideError, r"no dimension 2 to hold the vectors; pass a dim in \[-2, 1\]"),
        (lambda: R.rotation_trick()(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long)),
         go.GradOverrideTypeError, r"`q` must be a floating-point tensor; got a torch\.int64"),
        (lambda: R.rotation_trick(eps=0.0), go.GradOverrideError,
         r"rotation_trick: `eps` must be a positive finite number; got float 0\.0\. It floors "
         r"the norms"),
    ],
)
def test_rotation_trick_mistakes_are_errors(call: Any, error: type[Exception], message: str
                                            ) -> None:
    with pytest.raises(error, match=message):
        call()


def _vector_quantize_pytorch() -> Any:
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import vector_quantize_pytorch.vector_quantize_pytorch as vq
    except Exception:  # any failure means the peer is not usable here
        pytest.skip("vector-quantize-pytorch is not importable here (the `peers` extra)")
    return vq


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rotation_trick_matches_vector_quantize_pytorchs_rotate_to(dtype: torch.dtype) -> None:
    vq = _vector_quantize_pytorch()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(12, 8, generator=gen, dtype=torch.float64)
    x = torch.randn(12, 8, generator=gen, dtype=torch.float64)
    tiny = torch.finfo(dtype).eps
    x[0] = q[0] * 0.5                          # same direction
    x[1] = -q[1] * 2.0                         # opposite
    x[2] = -q[2] * (1 + tiny)                  # opposite, a float step apart
    x[3] = q[3]                                # x is its code
    x[4, 1:] = 0.0                             # on an axis
    x[5] = 1e-7                                # near eps, the norms' floor
    x[6] = 1e-5
    q[7] = 0.0                                 # a zero code
    x[8] = x[8] * 1e3                          # large
    x, q = x.to(dtype), q.to(dtype)
    g = torch.randn(12, 8, generator=gen, dtype=torch.float64).to(dtype)
    y, gx = _grad(lambda t: R.rotation_trick()(t, q), x, g)
    ref_y, ref_g = _grad(lambda t: vq.rotate_to(t, q), x, g)
    assert y.dtype == gx.dtype == ref_g.dtype == dtype
    assert torch.equal(y, q)  # exactly q; the peer computes lambda R x, q up to rounding
    close = {"rtol": 1e-4, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-10,
                                                                          "atol": 1e-12}
    floored = torch.linalg.vector_norm(x, dim=-1) < 1e-6  # the peer's forward is not q there
    assert floored.tolist() == [False] * 5 + [True] + [False] * 6
    # (in float32 the peer's lambda R x loses digits where x and q are nearly opposite)
    peer_forward = {"rtol": 1e-3, "atol": 1e-3} if dtype == torch.float32 else close
    torch.testing.assert_close(ref_y[~floored], q[~floored], **peer_forward)
    torch.testing.assert_close(gx, ref_g, **close)
    # x = 0: the peer's forward is 0 (lambda R x), this recipe's is q; the gradients agree
    zero = torch.zeros(1, 8, dtype=dtype)
    assert torch.equal(vq.rotate_to(zero, q[:1]), torch.zeros(1, 8, dtype=dtype))
    torch.testing.assert_close(_grad(lambda t: R.rotation_trick()(t, q[:1]), zero, g[:1])[1],
                               _grad(lambda t: vq.rotate_to(t, q[:1]), zero, g[:1])[1],
                               **close)


@pytest.mark.parametrize(
    "dtype,big", [(torch.float16, 1e4), (torch.bfloat16, 1e30), (torch.float32, 1e30),
                  (torch.float64, 1e300)], ids=str
)
def test_rotation_trick_gradient_is_finite_and_right_at_extreme_inputs(
    dtype: torch.dtype, big: float
) -> None:
    # The squares of a float32 1e20 overflow; the norm, and so the gradient, do not.
    q = torch.tensor([[1.0, 2.0, -1.0], [0.5, -0.5, 2.0]], dtype=dtype)
    g = torch.tensor([[1.0, -2.0, 0.5], [3.0, 1.0, -1.0]], dtype=dtype)
    x = torch.tensor([[big, -big, big / 2], [-big, big / 4, 1.0]], dtype=dtype)
    y, gx = _grad(lambda t: R.rotation_trick()(t, q), x, g)
    assert torch.equal(y, q) and torch.isfinite(gx).all()
    expected = _rotation_grad(x / big, q, g) / big  # R is scale-free, lambda goes as 1 / |x|
    torch.testing.assert_close(gx.double(), expected, rtol=2e-2 if dtype in (
        torch.float16, torch.bfloat16) else 1e-5, atol=0)
