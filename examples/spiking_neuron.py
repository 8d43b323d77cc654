"""A leaky integrate-and-fire (LIF) layer trained with a surrogate gradient.

A spiking neuron emits a spike when its membrane potential crosses a threshold: a step
function, whose true derivative is zero almost everywhere, so no gradient reaches the
weights. `go.recipes.spike()` keeps the step in the forward and uses the derivative of a
smooth step (arctan by default) in the backward. The task: tell two classes of Poisson spike
trains apart by their input rates, from the output neurons' spike counts. Runs in seconds on
a CPU, on data it makes itself.

Training runs under `go.monitor`, which records what each spike layer's surrogate received
and returned at every step: the summary is printed, and with a path as argument (and
matplotlib installed) the gradient flow is drawn to a PNG.

    python examples/spiking_neuron.py [monitor.png]
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable

import torch
from torch import nn

import gradoverride as go
from gradoverride import recipes

STEPS = 25  # time steps per sample


class LIF(nn.Module):
    """v[t] = beta * v[t-1] + W x[t]; spike s[t] = H(v[t] - 1); reset by subtraction."""

    def __init__(self, n_in: int, n_out: int, spike: Callable[[torch.Tensor], torch.Tensor],
                 beta: float = 0.9) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        self.spike = spike
        self.beta = beta

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:  # (time, batch, n_in)
        v = inputs.new_zeros(inputs.shape[1], self.fc.out_features)
        spikes = []
        for x in inputs:
            v = self.beta * v + self.fc(x)
            s = self.spike(v - 1.0)  # threshold 1
            v = v - s.detach()  # reset by subtraction (no gradient through the reset)
            spikes.append(s)
        return torch.stack(spikes)


class SpikingNet(nn.Module):
    """Two LIF layers sharing one spike recipe; the output is each output neuron's spike
    count."""

    def __init__(self, spike: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        spike = spike or recipes.spike()  # arctan surrogate, alpha=2, H(0) = 0
        self.hidden = LIF(20, 32, spike)
        self.readout = LIF(32, 2, spike)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.readout(self.hidden(inputs)).sum(0)  # spikes per output neuron


def make_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Poisson spike trains on 20 channels: class 0 fires mostly on the first half of the
    channels, class 1 on the second half."""
    label = torch.randint(0, 2, (n,), generator=generator)
    rates = torch.full((n, 20), 0.1)
    rates[label == 0, :10] = 0.16
    rates[label == 1, 10:] = 0.16
    spikes = torch.rand(STEPS, n, 20, generator=generator) < rates
    return spikes.float(), label


def main(epochs: int = 80, plot: str | None = None) -> tuple[float, float]:
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    x, y = make_data(256, generator)
    model = SpikingNet()
    print(f"surrogate: {model.hidden.spike!r}")

    # The true step, `(v > 0).float()`, cuts the graph: its output does not even require grad.
    true_step = LIF(20, 32, lambda v: (v > 0).float())
    print(f"true step: spikes require grad: {true_step(x[:, :8]).requires_grad}")

    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    losses, accuracies = [], []
    with go.monitor(model, every=10) as monitor:
        for epoch in range(epochs + 1):
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            accuracies.append(float((out.argmax(1) == y).float().mean()))
            if epoch % 20 == 0:
                print(f"epoch {epoch:3d}  loss {losses[-1]:.4f}  accuracy {accuracies[-1]:.3f}")
    assert model.hidden.fc.weight.grad is not None
    differentiable = model.hidden.spike(torch.zeros(1, requires_grad=True)).requires_grad
    print(f"surrogate: spikes require grad: {differentiable}, "
          f"hidden weight gradient norm {model.hidden.fc.weight.grad.norm():.3f}")
    print(f"loss fell from {losses[0]:.4f} to {losses[-1]:.4f}")
    print(f"accuracy rose from {accuracies[0]:.3f} to {accuracies[-1]:.3f}")
    print(monitor.summary())
    if plot is not None:
        if importlib.util.find_spec("matplotlib") is None:
            print("matplotlib is not installed: no plot (pip install 'gradoverride[plot]')")
        else:
            monitor.plot(plot)
            print(f"wrote {plot}")
    return losses[0], losses[-1]


if __name__ == "__main__":
    main(plot=sys.argv[1] if len(sys.argv) > 1 else None)
