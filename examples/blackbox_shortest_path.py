"""Learning grid costs through a Dijkstra solver (Vlastelica et al., ICLR 2020, in miniature).

Each example is a 6x6 map whose cells have 5 features; a hidden rule turns the features into
traversal costs, and the label is the cheapest path from the top-left to the bottom-right
cell (8-connected), as a 0/1 mask. A small network predicts each cell's cost from its
features; Dijkstra (plain Python, outside PyTorch) turns predicted costs into a path; the loss
is the Hamming distance to the true path. Dijkstra's output is piecewise constant in the
costs, so its true gradient is zero; `blackbox_solver` gives it the interpolation gradient,
one more Dijkstra call per example in backward.

Printed: the Hamming loss on held-out maps falls, and the share of held-out maps where the
predicted path is optimal (its true cost equals the shortest path's) rises. Runs in a few
seconds on a CPU.

    python examples/blackbox_shortest_path.py
"""

from __future__ import annotations

import heapq

import numpy as np
import torch
from torch import nn

from gradoverride.recipes import blackbox_solver

SIZE = 6
FEATURES = 5


def dijkstra(costs: np.ndarray) -> np.ndarray:
    """The cheapest 8-connected path from the top-left to the bottom-right cell, as a 0/1
    mask; a path's cost is the sum of its cells' costs (both ends included)."""
    costs = np.maximum(costs, 1e-3)  # Dijkstra needs positive costs
    h, w = costs.shape
    best = np.full((h, w), np.inf)
    previous = {}
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


def make_maps(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cell features (n, 6, 6, 5), true costs (n, 6, 6) and true shortest paths (n, 6, 6)."""
    features = torch.randn(n, SIZE, SIZE, FEATURES, generator=gen)
    hidden = torch.tensor([1.5, -1.0, 0.5, 0.0, 0.0])
    costs = nn.functional.softplus(2.0 * (features @ hidden)) + 0.1
    paths = torch.stack([torch.from_numpy(dijkstra(c.numpy())) for c in costs]).float()
    return features, costs, paths


def evaluate(model: nn.Module, shortest: blackbox_solver, data: tuple[torch.Tensor, ...]
             ) -> tuple[float, float]:
    """Mean Hamming distance to the true paths, and the share of optimal predicted paths."""
    features, costs, paths = data
    with torch.no_grad():
        predicted = shortest(model(features).squeeze(-1))
    hamming = float((predicted - paths).abs().sum(dim=(1, 2)).mean())
    optimal = ((predicted * costs).sum(dim=(1, 2)) <= (paths * costs).sum(dim=(1, 2)) + 1e-5)
    return hamming, float(optimal.float().mean())


def main(epochs: int = 8) -> tuple[list[float], list[float]]:
    torch.set_num_threads(1)  # tiny tensors: threads cost more than they save
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    train = make_maps(256, gen)
    test = make_maps(128, gen)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, 1), nn.Softplus())
    shortest = blackbox_solver(dijkstra, lambda_=10.0, instance_dims=2, numpy=True)
    print(shortest)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)

    hamming, optimal = [], []
    for epoch in range(epochs + 1):
        h, o = evaluate(model, shortest, test)
        hamming.append(h)
        optimal.append(o)
        print(f"epoch {epoch}  held-out Hamming loss {h:.2f}  optimal paths {o:.2f}")
        if epoch == epochs:
            break
        order = torch.randperm(256, generator=gen)
        for start in range(0, 256, 32):
            batch = order[start : start + 32]
            features, _, paths = (t[batch] for t in train)
            predicted = shortest(model(features).squeeze(-1))
            loss = (predicted - paths).abs().sum(dim=(1, 2)).mean()  # Hamming, as the paper
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    print(
        f"Hamming loss fell from {hamming[0]:.2f} to {hamming[-1]:.2f}; "
        f"optimal paths rose from {optimal[0]:.2f} to {optimal[-1]:.2f}"
    )
    return hamming, optimal


if __name__ == "__main__":
    main()
