"""`perturbed_optimizer` as Differentiable Patch Selection ships its perturbed top-k
(Cordonnier et al., CVPR 2021): the diagonal of the Jacobian estimate (`jacobian="diagonal"`)
and given noise (`noise=`, in either draw layout), compared with the paper's own
`PerturbedTopKFunction` on the same draws, and the full estimate of Berthet et al. on given
noise compared with an einsum of its formula."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

import gradoverride as go
from gradoverride.recipes import perturbed_optimizer


class PerturbedTopKFunction(torch.autograd.Function):
    """Differentiable Patch Selection's reference, as it ships, but taking its noise
    (shape (b, n, d), standard normal) as an argument instead of drawing it."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, k: int, sigma: float, noise: Tensor) -> Tensor:
        _, num_samples, d = noise.shape
        perturbed_x = x[:, None, :] + noise * sigma
        topk_results = torch.topk(perturbed_x, k=k, dim=-1, sorted=False)
        indices = torch.sort(topk_results.indices, dim=-1).values
        perturbed_output = F.one_hot(indices, num_classes=d).float()
        indicators = perturbed_output.mean(dim=1)
        ctx.num_samples, ctx.sigma = num_samples, sigma
        ctx.perturbed_output, ctx.noise = perturbed_output, noise
        return indicators

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Any:
        expected_gradient = (
            torch.einsum("bnkd,bnd->bkd", ctx.perturbed_output, ctx.noise)
            / ctx.num_samples / ctx.sigma
        )
        grad_input = torch.einsum("bkd,bkd->bd", grad_output, expected_gradient)
        return grad_input, None, None, None


def topk_one_hot(k: int) -> Any:
    """The solver: k one-hot rows, indices ascending (shape (..., k, d)), in torch ops."""

    def topk(scores: Tensor) -> Tensor:
        indices = torch.topk(scores, k=k, dim=-1, sorted=False).indices.sort(-1).values
        return F.one_hot(indices, scores.shape[-1]).to(scores.dtype)

    return topk


def _setup(b: int = 3, n: int = 400, d: int = 9, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, generator=gen)
    z = torch.randn(b, n, d, generator=gen)  # the reference's layout
    g = torch.randn(b, 4, d, generator=gen)  # dL/dy, for k = 4
    return x, z, g


@pytest.mark.parametrize("batched", [True, False])
def test_diagonal_matches_the_dps_reference_on_the_same_noise(batched: bool) -> None:
    x, z, g = _setup()
    k, sigma = 4, 0.5
    ref_x = x.clone().requires_grad_()
    ref_y = PerturbedTopKFunction.apply(ref_x, k, sigma, z)
    (ref_grad,) = torch.autograd.grad(ref_y, ref_x, g)

    recipe = perturbed_optimizer(topk_one_hot(k), sigma=sigma, jacobian="diagonal",
                                 batched=batched)
    ours_x = x.clone().requires_grad_()
    y = recipe(ours_x, noise=z, noise_layout="batch_first")
    (grad,) = torch.autograd.grad(y, ours_x, g)

    assert y.shape == (3, k, 9)
    assert torch.equal(y, ref_y), "the same draws give the same perturbed top-k"
    assert ((y > 0) & (y < 1)).any(), "the noise changed the selection"
    # The recipe runs the reference's einsums in its order (bit for bit on the CPUs tried);
    # a BLAS may sum in another order, so the test asks for float32 rounding only.
    torch.testing.assert_close(grad, ref_grad, rtol=1.3e-6, atol=1e-6)
    # The full estimate differs: the diagonal is a different estimator.
    full = perturbed_optimizer(topk_one_hot(k), sigma=sigma, batched=batched)
    (full_grad,) = torch.autograd.grad(
        full(ours_x, noise=z, noise_layout="batch_first"), ours_x, g
    )
    assert not torch.allclose(full_grad, ref_grad, rtol=1e-3, atol=1e-3)


def test_the_two_layouts_give_the_same_results() -> None:
    x, z, g = _setup(b=2, n=50)
    recipe = perturbed_optimizer(topk_one_hot(4), sigma=0.5, jacobian="diagonal", batched=True)
    a_x, b_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    a = recipe(a_x, noise=z, noise_layout="batch_first")
    b = recipe(b_x, noise=z.transpose(0, 1).contiguous())  # samples first, the default
    assert torch.equal(a, b)
    a.backward(g)
    b.backward(g)
    assert a_x.grad is not None and b_x.grad is not None
    torch.testing.assert_close(a_x.grad, b_x.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("noise", ["normal", "gumbel"])
@pytest.mark.parametrize("layout", ["samples_first", "batch_first"])
def test_full_estimate_on_given_noise_matches_an_einsum(noise: str, layout: str) -> None:
    x, _, g = _setup()
    x, g = x.double(), g.double()
    k, sigma, n = 4, 0.7, 300
    gen = torch.Generator().manual_seed(7)
    if noise == "normal":
        z = torch.randn(n, 3, 9, generator=gen, dtype=torch.float64)
        score = z
    else:
        z = -torch.empty(n, 3, 9, dtype=torch.float64).exponential_(generator=gen).log()
        score = 1 - torch.exp(-z)
    given = z if layout == "samples_first" else z.transpose(0, 1)
    recipe = perturbed_optimizer(topk_one_hot(k), sigma=sigma, noise=noise)  # type: ignore[arg-type]
    theta = x.clone().requires_grad_()
    y = recipe(theta, noise=given, noise_layout=layout)  # type: ignore[arg-type]
    (grad,) = torch.autograd.grad(y, theta, g)

    # Independently: the top-k of every perturbed instance, by a sort.
    order = (x.unsqueeze(0) + sigma * z).argsort(-1, descending=True)[..., :k].sort(-1).values
    solutions = F.one_hot(order, 9).double()  # (n, b, k, d)
    torch.testing.assert_close(y, solutions.mean(0), rtol=0, atol=1e-12)
    expected = torch.einsum("nbkj,bkj,nbe->be", solutions, g, score) / n / sigma
    torch.testing.assert_close(grad, expected)
    diagonal = torch.einsum("nbke,bke,nbe->be", solutions, g, score) / n / sigma
    assert not torch.allclose(grad, diagonal, rtol=1e-3, atol=1e-3)


def test_diagonal_with_two_instance_dims_and_no_leading_axes() -> None:
    """A solution in the instance's own shape (one-hot argmax per row of a 3x4 grid): the
    diagonal pairs entry (i, j) of the input with entry (i, j) of the solution."""
    gen = torch.Generator().manual_seed(3)
    theta = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    z = torch.randn(2, 200, 3, 4, generator=gen, dtype=torch.float64)
    g = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    sigma = 0.6

    def row_argmax(s: Tensor) -> Tensor:
        return F.one_hot(s.argmax(-1), s.shape[-1]).to(s.dtype)

    recipe = perturbed_optimizer(row_argmax, sigma=sigma, instance_dims=2, batched=True,
                                 jacobian="diagonal")
    leaf = theta.clone().requires_grad_()
    y = recipe(leaf, noise=z, noise_layout="batch_first")
    (grad,) = torch.autograd.grad(y, leaf, g)
    perturbed = theta.unsqueeze(1) + sigma * z  # (b, n, 3, 4)
    solutions = F.one_hot(perturbed.argmax(-1), 4).double()
    torch.testing.assert_close(y, solutions.mean(1), rtol=0, atol=1e-12)
    expected = torch.einsum("bnij,bij,bnij->bij", solutions, g, z) / 200 / sigma
    torch.testing.assert_close(grad, expected)


def test_given_noise_sets_the_sample_count_and_gets_no_gradient() -> None:
    x, z, g = _setup(b=1, n=7)
    seen: list[int] = []

    def solver(s: Tensor) -> Tensor:
        seen.append(s.shape[0])
        return topk_one_hot(4)(s)

    recipe = perturbed_optimizer(solver, sigma=0.5, batched=True)  # samples=1000 by default
    z = z.clone().requires_grad_()
    y = recipe(x.requires_grad_(), noise=z, noise_layout="batch_first")
    assert seen == [7], "seven draws, one batch instance: seven perturbed instances"
    y.backward(g)
    assert x.grad is not None and z.grad is None


def test_reprs_and_option_errors() -> None:
    recipe = perturbed_optimizer(topk_one_hot(2), jacobian="diagonal")
    assert repr(recipe).endswith("numpy=False, jacobian='diagonal')")
    with pytest.raises(go.GradOverrideError, match=r"perturbed_optimizer got "
                       r"jacobian='diag'; pass 'full' \(the whole Monte-Carlo estimate of "
                       r"Berthet et al\.\) or 'diagonal'"):
        perturbed_optimizer(topk_one_hot(2), jacobian="diag")  # type: ignore[arg-type]


def indices(s: Tensor) -> Tensor:
    """The top-2 indices, shape (2,): nothing in them aligns with the scores' d entries."""
    return torch.topk(s, 2).indices.to(s.dtype)


def test_diagonal_refuses_a_solution_that_cannot_align() -> None:
    recipe = perturbed_optimizer(indices, sigma=0.5, samples=3, seed=0, jacobian="diagonal")
    with pytest.raises(go.GradOverrideError, match=(
        r"jacobian='diagonal' pairs each input entry with the solution entries at the same "
        r"place, so each solution must end in the instance's shape \(5,\) \(any leading "
        r"axes, such as top-k's k, are summed\); the solver `indices` returned solutions of "
        r"shape \(2,\) for instances of shape \(5,\)\. Return solutions shaped \(\.\.\., 5\) "
        r"\(top-k as k one-hot rows\), or use jacobian='full'\."
    )):
        recipe(torch.randn(3, 5))
    scalar = perturbed_optimizer(lambda s: s.max(), sigma=0.5, samples=3, seed=0,
                                 jacobian="diagonal")
    with pytest.raises(go.GradOverrideError, match=r"returned solutions of shape \(\) for "
                       r"instances of shape \(5,\)"):
        scalar(torch.randn(5))


def test_given_noise_errors() -> None:
    x = torch.randn(2, 5)
    z = torch.randn(3, 2, 5)
    topk = topk_one_hot(2)
    plain = perturbed_optimizer(topk, batched=True)
    with pytest.raises(go.GradOverrideError, match=(
        r"got `noise=` but draws its own noise \(`seed=`\); pass one: make the recipe "
        r"without `seed` and `generator` to give the draws at the call, or drop `noise=`"
    )):
        perturbed_optimizer(topk, seed=0)(x, noise=z)
    with pytest.raises(go.GradOverrideError, match=r"draws its own noise \(`generator=`\)"):
        perturbed_optimizer(topk, generator=torch.Generator())(x, noise=z)
    with pytest.raises(go.GradOverrideTypeError, match=(
        r"`noise` must be a floating-point tensor of normal draws \(not multiplied by "
        r"sigma\); got a torch\.int64 tensor\."
    )):
        plain(x, noise=torch.zeros(3, 2, 5, dtype=torch.int64))
    with pytest.raises(go.GradOverrideTypeError, match=r"got list \[1\.0\]"):
        plain(x, noise=[1.0])  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideError, match=(
        r"with noise_layout='samples_first', `noise` must be shaped \(samples, \*batch, "
        r"\*instance\) = \(samples, 2, 5\) for an input of shape \(2, 5\) \(instance_dims=1\); "
        r"got \(2, 3, 5\)\. It fits the other layout: pass noise_layout='batch_first'\."
    )):
        plain(x, noise=torch.randn(2, 3, 5))
    with pytest.raises(go.GradOverrideError, match=(
        r"with noise_layout='batch_first', `noise` must be shaped \(\*batch, samples, "
        r"\*instance\) = \(2, samples, 5\) for an input of shape \(2, 5\) \(instance_dims=1\); "
        r"got \(3, 2, 5\)\. It fits the other layout: pass noise_layout='samples_first'\."
    )):
        plain(x, noise=z, noise_layout="batch_first")
    with pytest.raises(go.GradOverrideError, match=r"got \(3, 5\)\.$"):
        plain(x, noise=torch.randn(3, 5))
    with pytest.raises(go.GradOverrideError, match=(
        r"`noise` must have the input's dtype and device, torch\.float32 on cpu; got "
        r"torch\.float64 on cpu\. Convert it with `noise\.to\(theta\)`\."
    )):
        plain(x, noise=z.double())
    with pytest.raises(go.GradOverrideError, match=(
        r"got `noise` with no samples \(shape \(0, 2, 5\)\); give at least one draw\."
    )):
        plain(x, noise=torch.randn(0, 2, 5))
    with pytest.raises(go.GradOverrideError, match=(
        r"got noise_layout='samples_last'; pass 'samples_first' \(noise shaped \(samples, "
        r"\*batch, \*instance\)\) or 'batch_first'"
    )):
        plain(x, noise=z, noise_layout="samples_last")  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideError, match=(
        r"got noise_layout='batch_first' without `noise=`; the layout describes given "
        r"draws: pass them as `noise=`, or drop `noise_layout`\."
    )):
        plain(x, noise_layout="batch_first")
