"""The spiking peers (snnTorch, SpikingJelly, norse) for the preset parity tests: importing
them, calling each preset's peer function, and the inputs they are compared on.

Every peer function is called as its library ships it, with one exception each where the
library's own path cannot give a float64 reference or cannot run at all:

* snnTorch's spike is float32 whatever the input, so its autograd rounds the upstream
  gradient to float32; in float64 its Function's own `forward`/`backward` are called
  directly, with the float64 upstream (its formula, in float64);
* snnTorch 1.0's `LSO()` raises a TypeError (it calls the stochastic operator's Function with
  one argument too few) and its `LeakySpikeOperator` returns one gradient for two inputs,
  which autograd refuses: its `backward` is called directly, in both dtypes.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from gradoverride.recipes._surrogate import _PRESETS

Peer = Callable[[Tensor], Tensor]

_MODULES = {
    "snntorch": "snntorch.surrogate",
    "spikingjelly": "spikingjelly.activation_based.surrogate",
    "norse": "norse.torch.functional.threshold",
}


def import_peer(module: str) -> Any:
    """The peer module, or None: missing, or failing to import with this torch. Peers'
    import-time warnings are theirs, not ours; torch's C++ pytree registry is loaded first,
    so that norse's namedtuple registration warns here (silenced) and not later, inside a
    test, when something imports torch.distributed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with contextlib.suppress(ImportError):  # without optree: the Python one only
                importlib.import_module("torch.utils._cxx_pytree")
            return importlib.import_module(module)
    except Exception:  # any failure means the peer is not usable here
        return None


def library(preset: str) -> str:
    return _MODULES[preset.partition(".")[0]]


def defaults(preset: str) -> dict[str, float]:
    return {name: spec[0] for name, spec in _PRESETS[preset].params.items()}


#: Each preset with the parameter settings it is compared at: the default, other values, and
#: each parameter's boundary (0 for a leak or a width that may be 0, just above 1 for
#: QPseudoSpike's alpha, n = 2 for the square wave) with its valid float neighbour.
CASES: list[tuple[str, dict[str, float]]] = [
    ("snntorch.atan", {}), ("snntorch.atan", {"alpha": 0.5}), ("snntorch.atan", {"alpha": 7.0}),
    ("snntorch.sigmoid", {}), ("snntorch.sigmoid", {"slope": 1.0}),
    ("snntorch.fast_sigmoid", {}), ("snntorch.fast_sigmoid", {"slope": 3.0}),
    ("snntorch.straight_through_estimator", {}),
    ("snntorch.heaviside", {}),
    ("snntorch.spike_rate_escape", {}), ("snntorch.spike_rate_escape", {"beta": 2.5, "slope": 3.0}),
    ("snntorch.spike_rate_escape", {"beta": 0.0, "slope": 1.0}),
    ("snntorch.spike_rate_escape", {"beta": 1e-300, "slope": 1.0}),
    ("snntorch.SSO", {}), ("snntorch.SSO", {"mean": 0.3, "variance": 0.5}),
    ("snntorch.SSO", {"mean": -1.0, "variance": 0.0}), ("snntorch.SSO", {"variance": 5e-324}),
    ("snntorch.LSO", {}), ("snntorch.LSO", {"slope": 0.0}), ("snntorch.LSO", {"slope": 5e-324}),
    ("snntorch.LSO", {"slope": -0.2}),
    ("snntorch.SFS", {}), ("snntorch.SFS", {"slope": 5.0, "B": 0.0}),
    ("snntorch.SFS", {"slope": 25.0, "B": -0.5}),
    *[(f"spikingjelly.{name}", params)
      for name in ("ATan", "Sigmoid", "SoftSign", "SuperSpike", "Erf", "PiecewiseQuadratic",
                   "PiecewiseExp", "Rect", "NonzeroSignLogAbs", "FakeNumericalGradient")
      for params in ({}, {"alpha": 1.5}, {"alpha": 7.0})],
    ("spikingjelly.QPseudoSpike", {}), ("spikingjelly.QPseudoSpike", {"alpha": 1.5}),
    ("spikingjelly.QPseudoSpike", {"alpha": math.nextafter(1.0, 2.0)}),
    ("spikingjelly.QPseudoSpike", {"alpha": 1.001}), ("spikingjelly.QPseudoSpike", {"alpha": 10.0}),
    ("spikingjelly.S2NN", {}), ("spikingjelly.S2NN", {"alpha": 2.0, "beta": 0.5}),
    ("spikingjelly.S2NN", {"beta": 0.0}), ("spikingjelly.S2NN", {"beta": 5e-324}),
    ("spikingjelly.SquarewaveFourierSeries", {}),
    ("spikingjelly.SquarewaveFourierSeries", {"n": 4, "T_period": 3.0}),
    ("spikingjelly.SquarewaveFourierSeries", {"n": 7, "T_period": 0.5}),
    ("spikingjelly.LogTailedReLU", {}), ("spikingjelly.LogTailedReLU", {"alpha": 0.1}),
    ("spikingjelly.LogTailedReLU", {"alpha": -0.2}),
    ("spikingjelly.LogTailedReLU", {"alpha": 5e-324}),
    ("spikingjelly.LeakyKReLU", {}), ("spikingjelly.LeakyKReLU", {"leak": 0.1, "k": 2.0}),
    ("spikingjelly.LeakyKReLU", {"leak": 0.3}), ("spikingjelly.LeakyKReLU", {"leak": -5e-324}),
    ("spikingjelly.LeakyKReLU", {"leak": 0.25, "k": 0.5}),
    ("spikingjelly.PiecewiseLeakyReLU", {}), ("spikingjelly.PiecewiseLeakyReLU", {"c": 0.0}),
    ("spikingjelly.PiecewiseLeakyReLU", {"w": 0.5, "c": 0.2}),
    ("spikingjelly.PiecewiseLeakyReLU", {"w": 3.0, "c": 5e-324}),
    ("spikingjelly.DeterministicPass", {}),
    ("spikingjelly.PoissonPass", {}),
    *[(f"norse.{name}", params)
      for name in ("super", "triangle", "heavi_erfc", "tanh", "circ", "super_fn")
      for params in ({}, {"alpha": 0.1}, {"alpha": 2.0})],
    ("norse.triangle_fn", {}), ("norse.triangle_fn", {"alpha": 2.0}),
    *[(f"norse.{name}", params)
      for name in ("heavi_erfc_fn", "heavi_tanh_fn", "heavi_circ_fn", "circ_dist_fn",
                   "logistic_fn")
      for params in ({}, {"k": 0.1}, {"k": 2.0})],
]

#: Parameter values just across a boundary, each an error naming the preset and parameter.
INVALID: list[tuple[str, dict[str, float], str]] = [
    ("spikingjelly.QPseudoSpike", {"alpha": 1.0}, "`alpha` must be greater than 1"),
    ("spikingjelly.S2NN", {"beta": -5e-324}, "`beta` must be a finite number >= 0"),
    ("spikingjelly.SquarewaveFourierSeries", {"n": 1}, "`n` must be an integer >= 2"),
    ("spikingjelly.SquarewaveFourierSeries", {"n": 2.5}, "`n` must be an integer >= 2"),
    ("spikingjelly.PiecewiseLeakyReLU", {"w": 0.0}, "`w` must be a positive finite number"),
    ("spikingjelly.LeakyKReLU", {"k": 0.0}, "`k` must be a positive finite number"),
    ("snntorch.SSO", {"variance": -5e-324}, "`variance` must be a finite number >= 0"),
    ("snntorch.spike_rate_escape", {"beta": -1.0}, "`beta` must be a finite number >= 0"),
    # slope exp(-beta |x - 1|) as (2 slope / beta) (beta/2) exp(...): the factor overflows
    ("snntorch.spike_rate_escape", {"beta": 5e-324}, "has no spike equal to it"),
    ("snntorch.SFS", {"B": math.inf}, "`B` must be a finite number"),
    ("norse.circ", {"alpha": 0.0}, "`alpha` must be a positive finite number"),
]

#: The peers' float64 arithmetic that is float32 arithmetic: compared with float32's
#: tolerance there (their own rounding, not a difference of formula).
FLOAT32_IN_FLOAT64 = {
    "snntorch.LSO": "snnTorch multiplies the slope by a float32 mask: the slope is rounded "
    "to float32",
    "norse.heavi_erfc": "norse divides by torch.as_tensor(np.pi).sqrt(), a float32 sqrt(pi)",
    "norse.heavi_erfc_fn": "norse divides by torch.as_tensor(np.pi).sqrt(), a float32 sqrt(pi)",
}

_SNN_FUNCTIONS = {  # preset -> (Function class, its parameters in order)
    "atan": ("ATan", ["alpha"]),
    "sigmoid": ("Sigmoid", ["slope"]),
    "fast_sigmoid": ("FastSigmoid", ["slope"]),
    "straight_through_estimator": ("StraightThroughEstimator", []),
    "heaviside": ("Heaviside", []),
    "spike_rate_escape": ("SpikeRateEscape", ["beta", "slope"]),
    "SSO": ("StochasticSpikeOperator", ["mean", "variance"]),
    "LSO": ("LeakySpikeOperator", ["slope"]),
    "SFS": ("SparseFastSigmoid", ["slope", "B"]),
}


class _Context:
    """What an old-style autograd Function's forward and backward read from `ctx`."""

    needs_input_grad = (True, False, False)
    saved_tensors: tuple[Tensor, ...] = ()

    def save_for_backward(self, *tensors: Tensor) -> None:
        self.saved_tensors = tensors


def _snntorch_direct(module: Any, name: str, params: dict[str, float]) -> Peer:
    """snnTorch's Function for `name`, its forward and backward called directly (so the
    upstream keeps its dtype), wrapped as a Function of x."""
    cls_name, order = _SNN_FUNCTIONS[name]
    cls = getattr(module, cls_name)
    args = [params[p] for p in order]

    class Direct(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
            ctx.peer = _Context()
            out: Tensor = cls.forward(ctx.peer, x, *args)
            return out.to(x.dtype)

        @staticmethod
        def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
            result = cls.backward(ctx.peer, grad)
            return result[0] if isinstance(result, tuple) else result

    return Direct.apply  # type: ignore[no-any-return]


def peer_function(preset: str, params: dict[str, float], dtype: torch.dtype) -> Peer | None:
    """The peer's own function for `preset` at `params` (None when the peer is missing)."""
    module = import_peer(library(preset))
    if module is None:
        return None
    lib, _, name = preset.partition(".")
    full = defaults(preset) | params
    if lib == "snntorch":
        if name == "LSO" or dtype == torch.float64:
            return _snntorch_direct(module, name, full)
        factory: Callable[..., Peer] = getattr(module, name)
        return factory(**params)
    if lib == "spikingjelly":
        return getattr(module, name)(**params)  # type: ignore[no-any-return]
    if name in ("super", "triangle", "heavi_erfc", "tanh", "circ"):
        return lambda x: module.threshold(x, name, full["alpha"])  # type: ignore[no-any-return]
    function = getattr(module, name)
    return lambda x: function(x, *full.values())  # type: ignore[no-any-return]


def _edges(preset: str, params: dict[str, float]) -> list[float]:
    """The preset's window ends, knees and centre at these parameters."""
    name = preset.partition(".")[2]
    p = defaults(preset) | params
    a = p.get("alpha", p.get("k", p.get("slope", 1.0)))
    edges = [0.0, 0.5, 1.0, 2.0]
    if name == "Rect":
        edges.append(0.5 / a)
    elif name in ("PiecewiseQuadratic", "FakeNumericalGradient"):
        edges.append(1 / a)
    elif name == "PiecewiseLeakyReLU":
        edges.append(p["w"])
    elif name == "SFS":
        edges.append(p["B"])
    elif name == "SquarewaveFourierSeries":
        edges.append(p["T_period"] / 4)  # where the first harmonic crosses 0
    return edges


def inputs(preset: str, params: dict[str, float], dtype: torch.dtype) -> Tensor:
    """Edge values (0, -0, the smallest normal, large, infinite), the preset's boundaries
    with their float neighbours in `dtype` on both sides, and random values."""
    info = torch.finfo(dtype)
    base = [0.0, -0.0, info.tiny, -info.tiny, 1e-3, -1e-3, 0.25, -0.25, 3.0, -3.0, 10.0,
            -10.0, 100.0, -100.0, 1e4, -1e4, 1e30, -1e30, math.inf, -math.inf]
    edges = torch.tensor(sorted({v for e in _edges(preset, params) for v in (e, -e)}),
                         dtype=dtype)
    around = torch.cat([torch.nextafter(edges, torch.full_like(edges, -math.inf)), edges,
                        torch.nextafter(edges, torch.full_like(edges, math.inf))])
    generator = torch.Generator().manual_seed(0)
    random = (torch.randn(200, generator=generator, dtype=torch.float64) * 2).to(dtype)
    x = torch.cat([torch.tensor(base, dtype=dtype), around, random])
    if preset == "spikingjelly.PoissonPass":  # its input is a probability: [0, 1]
        return x[(x >= 0) & (x <= 1)]
    if preset == "norse.circ_dist_fn":  # its probability is NaN at +-inf: Bernoulli raises
        return x[torch.isfinite(x)]
    return x


def peer_functions(module: Any, lib: str) -> list[str]:
    """The surrogate functions a peer module ships, by the name a preset would take."""
    if lib == "spikingjelly":
        base = module.SurrogateFunctionBase
        return sorted(name for name, obj in vars(module).items()
                      if isinstance(obj, type) and issubclass(obj, base) and obj is not base)
    if lib == "snntorch":
        return sorted(name for name, obj in vars(module).items()
                      if callable(obj) and not isinstance(obj, type)
                      and getattr(obj, "__module__", "") == module.__name__
                      and name != "custom_surrogate")
    names = ["super", "triangle", "heavi_erfc", "tanh", "circ"]  # threshold's methods
    return names + sorted(name for name, obj in vars(module).items()
                          if name.endswith("_fn") and callable(obj)
                          and name != "superspike_fn")  # an alias of super_fn
