"""Plot the surrogates of `go.recipes.spike` that are a smooth step's derivative: the step
and its gradient.

Left: the smooth step whose derivative each surrogate is (the forward stays the Heaviside
step, drawn in black). Right: the surrogate gradient, at its default alpha (peak 1 at the
threshold). Needs matplotlib (`pip install -e ".[plot]"`).

    python examples/plot_surrogates.py [OUTPUT.png]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from gradoverride import recipes


def main(output: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit('plot_surrogates needs matplotlib: pip install -e ".[plot]"')

    x = torch.linspace(-3, 3, 1201, dtype=torch.float64)
    # One curve per formula: aliases (super_spike, soft_sign, piecewise_quadratic) coincide.
    names = ["arctan", "sigmoid", "fast_sigmoid", "erf", "triangle", "rectangular",
             "piecewise_exp", "circ", "q_pseudo_spike", "straight_through"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(x, recipes.spike().step(x), color="black", linewidth=2.5, label="step H(x)")
    for name in names:
        spike = recipes.spike(name)
        if name != "straight_through":
            left.plot(x, spike.proxy(x), label=name)
        right.plot(x, spike.gradient(x), label=f"{name} (alpha={spike.alpha:.3g})")
        print(f"{name:17s} alpha {spike.alpha:.4g}  gradient at 0: {spike.gradient(x[600]):.3f}")
    left.set(title="forward: the step, and each surrogate's smooth step", xlabel="x",
             ylim=(-0.1, 1.1))
    right.set(title="backward: the surrogate gradient", xlabel="x", ylim=(-0.05, 1.15))
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    print(f"wrote {output} ({output.stat().st_size} bytes)")
    return output


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else (
        Path(tempfile.gettempdir()) / "gradoverride_surrogates.png"
    )
    main(target)
