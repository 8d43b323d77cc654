"""Black-box solver recipes: the interpolation gradient of Vlastelica et al. (ICLR 2020) and the
perturbed optimizer of Berthet et al. (2020), on a ranking problem and a shortest-path problem
on a small grid, each checked against the paper's formula computed here from the solver."""

from __future__ import annotations

import copy
import heapq
import math
import pickle

import numpy as np
import pytest
import torch

import gradoverride as go
from gradoverride.recipes import blackbox_solver, perturbed_optimizer

# ---- solvers written for the tests ----------------------------------------------------------


def rank(w: np.ndarray) -> np.ndarray:
    """argmin over permutations pi of (1..n) of <w, pi>: the largest score gets rank 1."""
    ranks = np.empty(len(w))
    ranks[np.argsort(-w, kind="stable")] = np.arange(1, len(w) + 1)
    return ranks


def dijkstra(costs: np.ndarray) -> np.ndarray:
    """The cheapest 8-connected path from the top-left to the bottom-right cell of a grid of
    positive vertex costs (the Warcraft setting of the paper), as a 0/1 mask. Costs below
    0.01 count as 0.01: shifted or perturbed costs can be negative, and Dijkstra needs
    positive ones."""
    costs = np.maximum(costs, 0.01)
    h, w = costs.shape
    best = np.full((h, w), np.inf)
    previous: dict[tuple[int, int], tuple[int, int]] = {}
    best[0, 0] = costs[0, 0]
    queue = [(float(costs[0, 0]), 0, 0)]
    while queue:
        d, i, j = heapq.heappop(queue)
        if d > best[i, j]:
            continue
        for di in (-1, 0, 1):
            for dj in (-1, 0, 1):
                a, b = i + di, j + dj
                if (di or dj) and 0 <= a < h and 0 <= b < w and d + costs[a, b] < best[a, b]:
                    best[a, b] = d + costs[a, b]
                    previous[a, b] = (i, j)
                    heapq.heappush(queue, (float(best[a, b]), a, b))
    path = np.zeros((h, w))
    cell = (h - 1, w - 1)
    path[cell] = 1.0
    while cell != (0, 0):
        cell = previous[cell]
        path[cell] = 1.0
    return path


def dijkstra_batch(costs: np.ndarray) -> np.ndarray:
    return np.stack([dijkstra(c) for c in costs])


def one_hot_argmax(t: torch.Tensor) -> torch.Tensor:
    """A torch solver over stacks: argmax_y <t, y> over one-hot vectors."""
    return torch.nn.functional.one_hot(t.argmax(-1), t.shape[-1]).to(t.dtype)


def _grid(batch: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(batch, 5, 5, generator=gen, dtype=torch.float64) * 4 + 0.5)


# ---- Vlastelica et al.: interpolation gradient ----------------------------------------------


def test_blackbox_ranking_by_hand() -> None:
    ranking = blackbox_solver(rank, lambda_=2.0, numpy=True)
    w = torch.tensor([[0.3, 1.0, -0.5], [1.0, 2.0, 3.0]], requires_grad=True)
    y = ranking(w)
    assert y.tolist() == [[2.0, 1.0, 3.0], [3.0, 2.0, 1.0]]
    assert y.dtype == w.dtype
    (g,) = torch.autograd.grad(y, w, torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]]))
    # Row 0: w' = w + 2 g = [2.3, 1, -0.5] ranks [1, 2, 3]; -([2,1,3] - [1,2,3]) / 2.
    # Row 1: w' = [1, 2, 5] ranks as w does, so no gradient.
    assert g.tolist() == [[-0.5, 0.5, 0.0], [0.0, 0.0, 0.0]]


def test_blackbox_ranking_matches_the_formula() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(4, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    lam = 3.0
    (got,) = torch.autograd.grad(blackbox_solver(rank, lambda_=lam, numpy=True)(w), w, g)
    wn, gn = w.detach().numpy(), g.numpy()
    expected = np.stack([-(rank(wn[i]) - rank(wn[i] + lam * gn[i])) / lam for i in range(4)])
    torch.testing.assert_close(got, torch.from_numpy(expected))
    assert got.abs().sum() > 0, "some ranks changed, so the test can fail"


def test_blackbox_shortest_path_matches_the_formula() -> None:
    costs = _grid(3).requires_grad_()
    gen = torch.Generator().manual_seed(2)
    g = torch.randn(3, 5, 5, generator=gen, dtype=torch.float64) * 3
    lam = 5.0
    recipe = blackbox_solver(dijkstra, lambda_=lam, instance_dims=2, numpy=True)
    paths = recipe(costs)
    assert paths.shape == (3, 5, 5) and set(paths.unique().tolist()) == {0.0, 1.0}
    (got,) = torch.autograd.grad(paths, costs, g)
    c, gn = costs.detach().numpy(), g.numpy()
    expected = np.stack(
        [-(dijkstra(c[i]) - dijkstra(c[i] + lam * gn[i])) / lam for i in range(3)]
    )
    torch.testing.assert_close(got, torch.from_numpy(expected))
    assert got.abs().sum() > 0

    batched = blackbox_solver(dijkstra_batch, lambda_=lam, instance_dims=2, batched=True,
                              numpy=True)
    (same,) = torch.autograd.grad(batched(costs), costs, g)
    torch.testing.assert_close(same, got)
    one = costs[1].detach().requires_grad_()
    (single,) = torch.autograd.grad(recipe(one), one, g[1])
    torch.testing.assert_close(single, got[1])


def test_blackbox_maximize_applies_the_formula_to_minus_w() -> None:
    w = torch.tensor([[0.1, 0.5, 0.3]], requires_grad=True)
    g = torch.tensor([[0.0, 1.0, 0.0]])
    recipe = blackbox_solver(one_hot_argmax, lambda_=1.0, batched=True, maximize=True)
    y = recipe(w)
    assert y.tolist() == [[0.0, 1.0, 0.0]]
    (got,) = torch.autograd.grad(y, w, g)
    # w' = w - g = [0.1, -0.5, 0.3] picks index 2: (y(w) - y(w')) / 1.
    assert got.tolist() == [[0.0, 1.0, -1.0]]


# ---- Berthet et al.: perturbed optimizer ----------------------------------------------------


def _noise(kind: str, seed: int, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The draws the recipe documents: float64 on a CPU generator seeded with `seed`."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        z = torch.randn(shape, generator=gen, dtype=torch.float64)
        return z, z
    e = torch.empty(shape, dtype=torch.float64).exponential_(generator=gen)
    return -torch.log(e), 1 - e


@pytest.mark.parametrize("noise", ["normal", "gumbel"])
def test_perturbed_shortest_path_matches_the_formula(noise: str) -> None:
    costs = _grid(2, seed=3).requires_grad_()
    sigma, m = 0.7, 24
    recipe = perturbed_optimizer(dijkstra, sigma=sigma, samples=m, noise=noise, seed=11,
                                 instance_dims=2, numpy=True)
    y = recipe(costs)
    g = torch.randn(2, 5, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (got,) = torch.autograd.grad(y, costs, g)

    z, score = _noise(noise, 11, (m, 2, 5, 5))
    c = costs.detach()
    solutions = torch.stack([
        torch.stack([torch.from_numpy(dijkstra((c[b] + sigma * z[n, b]).numpy()))
                     for b in range(2)])
        for n in range(m)
    ])
    torch.testing.assert_close(y, solutions.mean(0))
    projection = (solutions * g).sum(dim=(2, 3))  # <y_n, g> per sample and instance
    expected = (projection[:, :, None, None] * score).mean(0) / sigma
    torch.testing.assert_close(got, expected)
    assert ((y > 0) & (y < 1)).any(), "the mean path is fractional: the noise changed paths"


def test_perturbed_argmax_with_gumbel_noise_is_softmax() -> None:
    theta = torch.tensor([0.2, -0.3, 0.5, 0.0], dtype=torch.float64, requires_grad=True)
    sigma = 0.5
    recipe = perturbed_optimizer(one_hot_argmax, sigma=sigma, samples=20000, noise="gumbel",
                                 seed=0, batched=True)
    y = recipe(theta)
    v = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    (got,) = torch.autograd.grad(y, theta, v)
    reference = theta.detach().requires_grad_()
    soft = torch.softmax(reference / sigma, -1)
    (expected,) = torch.autograd.grad(soft, reference, v)
    torch.testing.assert_close(y.detach(), soft.detach(), rtol=0, atol=0.02)
    torch.testing.assert_close(got, expected, rtol=0, atol=0.03)


def test_perturbed_optimal_value_output_has_softmax_gradient() -> None:
    """The solver may return the optimal value (any shape per instance): E[max(theta + sigma
    G)] = sigma * logsumexp(theta / sigma) + sigma * Euler's gamma, whose gradient is
    softmax(theta / sigma)."""
    theta = torch.tensor([[1.0, 0.0, -1.0]], dtype=torch.float64, requires_grad=True)
    recipe = perturbed_optimizer(lambda t: t.max(-1).values, sigma=1.0, samples=20000,
                                 noise="gumbel", seed=0, batched=True)
    value = recipe(theta)
    assert value.shape == (1,)
    expected = torch.logsumexp(theta.detach(), -1) + 0.5772156649
    torch.testing.assert_close(value, expected, rtol=0, atol=0.03)
    (got,) = torch.autograd.grad(value.sum(), theta)
    torch.testing.assert_close(got, torch.softmax(theta.detach(), -1), rtol=0, atol=0.03)


def test_perturbed_batching_seed_and_generator() -> None:
    scores = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    per_instance = perturbed_optimizer(rank, sigma=0.3, samples=8, seed=5, numpy=True)
    stacked = perturbed_optimizer(lambda s: np.stack([rank(r) for r in s]), sigma=0.3,
                                  samples=8, seed=5, batched=True, numpy=True)
    a, b = per_instance(scores), stacked(scores)
    assert a.dtype == torch.float32
    assert torch.equal(a, b), "batched and per-instance calls see the same noise"
    assert torch.equal(per_instance(scores), a), "a seed repeats the noise"
    gen = torch.Generator().manual_seed(5)
    streaming = perturbed_optimizer(rank, sigma=0.3, samples=8, generator=gen, numpy=True)
    first, second = streaming(scores), streaming(scores)
    assert torch.equal(first, a), "a generator seeded alike draws the same first noise"
    assert not torch.equal(second, first)


# ---- conversions and errors -----------------------------------------------------------------


def test_solutions_keep_the_input_dtype() -> None:
    costs = _grid(1).float().requires_grad_()
    paths = blackbox_solver(lambda c: dijkstra(c).astype(np.int64), lambda_=1.0,
                            instance_dims=2, numpy=True)(costs)
    assert paths.dtype == torch.float32 and paths.requires_grad


def test_reprs() -> None:
    assert repr(blackbox_solver(rank, lambda_=2.0)) == (
        "blackbox_solver(rank, lambda_=2.0, instance_dims=1, batched=False, numpy=False, "
        "maximize=False)"
    )
    assert repr(perturbed_optimizer(rank)) == (
        "perturbed_optimizer(rank, sigma=0.05, samples=1000, noise='normal', seed=None, "
        "instance_dims=1, batched=False, numpy=False)"
    )


def test_option_errors() -> None:
    with pytest.raises(go.GradOverrideError, match=r"blackbox_solver needs `lambda_` to be a "
                       r"number > 0 \(the interpolation strength of Vlastelica et al\.\), got 0"):
        blackbox_solver(rank, lambda_=0)
    with pytest.raises(go.GradOverrideTypeError, match=r"blackbox_solver needs a solver "
                       r"callable \(`solver\(w\) -> solution`\), got str 'dijkstra'\."):
        blackbox_solver("dijkstra", lambda_=1.0)  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideError, match=r"perturbed_optimizer got noise='uniform'; "
                       r"the noises are 'normal', 'gumbel'\."):
        perturbed_optimizer(rank, noise="uniform")  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideError, match=r"perturbed_optimizer needs `instance_dims` "
                       r"to be an int >= 1"):
        perturbed_optimizer(rank, instance_dims=0)
    with pytest.raises(go.GradOverrideError, match=r"takes a `seed` or a `generator`, not both"):
        perturbed_optimizer(rank, seed=1, generator=torch.Generator())
    with pytest.raises(go.GradOverrideError, match=r"perturbed_optimizer needs `sigma` to be a "
                       r"number > 0, got -1"):
        perturbed_optimizer(rank, sigma=-1)
    with pytest.raises(go.GradOverrideError, match=r"perturbed_optimizer needs `samples` to be a "
                       r"positive int, got 2\.5\."):
        perturbed_optimizer(rank, samples=2.5)  # type: ignore[arg-type]


def rank_prefix(w: np.ndarray) -> np.ndarray:
    return rank(w)[:3]


def test_solver_result_errors() -> None:
    w = torch.randn(2, 4)
    with pytest.raises(go.GradOverrideError, match=(
        r"the solver `rank_prefix` of blackbox_solver\(rank_prefix, .*\) returned solutions of "
        r"shape \(3,\) for instances of shape \(4,\); the interpolation gradient needs a "
        r"solution y in the space of the costs w"
    )):
        blackbox_solver(rank_prefix, lambda_=1.0, numpy=True)(w)
    with pytest.raises(go.GradOverrideError, match=(
        r"^the solver `[^`]*<lambda>` \(instance 0\) returned str 'path', which is not "
        r"array-like"
    )):
        blackbox_solver(lambda s: "path", lambda_=1.0)(w)
    with pytest.raises(go.GradOverrideError, match=(
        r"was called with batched=True on a stack of 2 instances and returned shape \(4,\); "
        r"it must return one solution per instance"
    )):
        blackbox_solver(lambda s: s[0], lambda_=1.0, batched=True)(w)
    with pytest.raises(go.GradOverrideError, match=(
        r"got an input of shape \(4,\), which has fewer than instance_dims=2 dimensions"
    )):
        blackbox_solver(dijkstra, lambda_=1.0, instance_dims=2)(torch.randn(4))
    with pytest.raises(go.GradOverrideError, match=r"got an empty batch \(input shape \(0, 4\)\)"):
        blackbox_solver(rank, lambda_=1.0)(torch.randn(0, 4))


def test_module_form() -> None:
    module = blackbox_solver(rank, lambda_=1.0, numpy=True).module()
    assert repr(module).startswith("blackbox_solver(rank")
    assert module(torch.tensor([0.5, -1.0])).tolist() == [1.0, 2.0]
    assert math.isclose(float(perturbed_optimizer(rank, samples=4, seed=0, numpy=True).module()(
        torch.tensor([10.0, -10.0]))[0]), 1.0)


# ---- torch.compile --------------------------------------------------------------------------


def _ranked_loss(w: torch.Tensor) -> torch.Tensor:
    return (_RANKING(w * 2) * torch.arange(3.0)).sum()


_RANKING = blackbox_solver(rank, lambda_=2.0, numpy=True)


def _ranked_by_hand(w: torch.Tensor) -> torch.Tensor:
    """The gradient of `_ranked_loss` by Vlastelica et al.'s formula, with torch's argsort:
    (rank(2w + lambda * g) - rank(2w)) / lambda, times 2 (the chain rule through w * 2)."""
    g = torch.arange(3.0)

    def ranks(v: torch.Tensor) -> torch.Tensor:  # 1 for the largest, as `rank`
        return (len(v) - torch.argsort(torch.argsort(v))).to(v.dtype)

    shifted = ranks(w * 2 + 2.0 * g)
    return 2 * (shifted - ranks(w * 2)) / 2.0


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_a_numpy_solver_compiles_exports_and_transforms() -> None:
    """One operator: fullgraph compile (forward and the rule's second solver call), export
    as one node, torch.func.grad and per-sample gradients by vmap."""
    torch._dynamo.reset()
    w = torch.tensor([0.3, 1.0, -0.5], requires_grad=True)
    (eager,) = torch.autograd.grad(_ranked_loss(w), w)
    torch.testing.assert_close(eager, _ranked_by_hand(w.detach()))
    assert eager.abs().sum() > 0
    compiled = torch.compile(_ranked_loss, backend="aot_eager", fullgraph=True)
    (got,) = torch.autograd.grad(compiled(w), w)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(torch.func.grad(_ranked_loss)(w.detach()), eager)
    batch = torch.stack([w.detach(), -w.detach()])
    per_sample = torch.func.vmap(torch.func.grad(_ranked_loss))(batch)
    torch.testing.assert_close(per_sample, torch.stack([_ranked_by_hand(v) for v in batch]))

    class Ranks(torch.nn.Module):
        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return _RANKING(v * 2)

    program = torch.export.export(Ranks(), (w.detach(),))
    nodes = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert "gradoverride.outside.default" in nodes, nodes
    torch.testing.assert_close(program.module()(w.detach()), torch.tensor([2.0, 1.0, 3.0]))
    torch._dynamo.reset()


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_a_compiled_solver_returning_another_shape_is_named() -> None:
    torch._dynamo.reset()
    top2 = perturbed_optimizer(lambda t: np.stack([t, t]), samples=2, sigma=0.5,
                               numpy=True)
    with pytest.raises(go.GradOverrideError, match=(
        r"the solver `[^`]*<lambda>` of perturbed_optimizer\(.*\) returned \(2, 2, 3\) "
        r"float32, but the compiled or exported graph was traced with \(2, 3\) float32, what "
        r"the instances' shape \(traced by torch.compile or torch.export, a numpy solver is "
        r"taken to return one solution of its instance's shape per instance\) said"
    )):
        torch.compile(top2, backend="aot_eager", fullgraph=True)(torch.ones(3))
    torch._dynamo.reset()


def test_a_copied_or_unpickled_solver_recipe_runs() -> None:
    w = torch.tensor([0.3, 1.0, -0.5], requires_grad=True)
    for twin in (copy.deepcopy(_RANKING), pickle.loads(pickle.dumps(_RANKING))):
        assert twin == _RANKING
        (got,) = torch.autograd.grad((twin(w * 2) * torch.arange(3.0)).sum(), w)
        torch.testing.assert_close(got, _ranked_by_hand(w.detach()))


def test_booleans_are_not_counts_or_strengths() -> None:
    with pytest.raises(go.GradOverrideError, match="needs `lambda_` to be a number > 0"):
        blackbox_solver(lambda s: s, lambda_=True)  # type: ignore[arg-type]
    expected = "needs `samples` to be a positive int, got True"
    with pytest.raises(go.GradOverrideError, match=expected):
        perturbed_optimizer(lambda s: s, samples=True)  # type: ignore[arg-type]


def test_min_cost_clamps_the_perturbed_costs_as_the_papers_code_does() -> None:
    seen: list[np.ndarray] = []

    def cheapest(w):  # argmin over one-hot choices, recording the costs it is given
        seen.append(np.array(w))
        y = np.zeros_like(w)
        y[np.argmin(w)] = 1.0
        return y

    w = torch.tensor([0.2, 0.5, 1.0], dtype=torch.float64, requires_grad=True)
    g = torch.tensor([-1.0, 0.0, 2.0], dtype=torch.float64)
    for min_cost in (None, 0.0):
        seen.clear()
        recipe = blackbox_solver(cheapest, lambda_=1.0, numpy=True, min_cost=min_cost)
        (grad,) = torch.autograd.grad((recipe(w) * g).sum(), w)
        # By hand (Vlastelica et al.'s Algorithm 1; the code's maximum(w + lambda g, 0)):
        perturbed = w.detach() + 1.0 * g
        if min_cost is not None:
            perturbed = perturbed.clamp(min=min_cost)
        np.testing.assert_array_equal(seen[1], perturbed.numpy())
        y, y_shifted = torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3)
        y_shifted[int(perturbed.argmin())] = 1.0
        torch.testing.assert_close(grad, (y_shifted - y).double() / 1.0)
    assert seen[1].min() == 0.0  # clamped: -0.8 would have been given
    with pytest.raises(go.GradOverrideError, match=r"blackbox_solver needs `min_cost` to be a "
                       r"finite number .* got inf"):
        blackbox_solver(cheapest, lambda_=1.0, min_cost=float("inf"))
