"""Straight-through estimators and recipes against their baselines, in one run.

1. Identity straight-through (`go.straight_through` on `torch.sign`) against the
   `x + (f(x) - x).detach()` idiom and a hand-written classic `autograd.Function`, forward +
   backward on a 4096x4096 float32 tensor: time ratio to the idiom and bytes saved for
   backward (contract: at most 0.4x the idiom, 0 bytes).
2. Clipped straight-through, `keep="input"` vs `keep="mask"`, eager and compiled (Inductor):
   time, peak memory of forward + backward, and memory held between forward and backward
   when the input is an activation that would otherwise be freed.
3. Each recipe against the installed peer implementation of the same formula (snnTorch,
   SpikingJelly, norse, brevitas, vector-quantize-pytorch, and torch itself for the window
   presets and Gumbel-softmax): time ratio ours / peer, forward + backward.

Timings are interleaved in shuffled rounds with paired ratios (see `_timing.py`), on one
thread. Peak memory is read from the profiler's allocation events.

    python benchmarks/ste.py [--quick] [--size N] [--no-compile] [--device cuda]

On a GPU, peak and held memory are read from `torch.cuda`'s allocator statistics instead.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import gradoverride as go
from gradoverride import recipes as R
from gradoverride.testing import saved_bytes

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import add_device_argument, compare, synchronizer

Tensor = torch.Tensor

# Set by `main` from --device: where the tensors live, and what ends a timed block there.
DEVICE = "cpu"


def _no_sync() -> None:
    return None


SYNC: Callable[[], None] = _no_sync


# ---- 1. identity ------------------------------------------------------------------------------


@go.straight_through
def ste_sign(x: Tensor) -> Tensor:
    return torch.sign(x)


def detach_idiom(x: Tensor) -> Tensor:
    return x + (torch.sign(x) - x).detach()


class HandWritten(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:  # type: ignore[override]
        return torch.sign(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:  # type: ignore[override]
        return grad


def step(op: Callable[[Tensor], Tensor], x: Tensor, g: Tensor) -> Callable[[], None]:
    def run() -> None:
        torch.autograd.grad(op(x), x, g)

    return run


def identity_section(n: int, rounds: int) -> None:
    x = torch.randn(n, n, device=DEVICE, requires_grad=True)
    g = torch.randn(n, n, device=DEVICE)
    cases = {
        "x + (f(x) - x).detach()": step(detach_idiom, x, g),
        "hand-written Function": step(HandWritten.apply, x, g),
        "go.straight_through": step(ste_sign, x, g),
    }
    result = compare(cases, rounds=rounds, number=1, sync=SYNC)
    print(f"\n1. identity straight-through, sign, ({n}, {n}) float32, forward + backward:")
    for name, (seconds, ratio) in result.items():
        fn = {"x + (f(x) - x).detach()": detach_idiom, "hand-written Function": HandWritten.apply,
              "go.straight_through": ste_sign}[name]
        print(
            f"  {name:26s} {seconds * 1e3:8.1f} ms   ratio to idiom {ratio:.3f}   "
            f"saved bytes {saved_bytes(fn, x)}"
        )


# ---- 2. clipped -------------------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_stderr() -> Any:
    """The profiler's C++ side prints start/stop lines on fd 2; keep the report readable."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def peak_memory(fn: Callable[[], None]) -> float:
    """Peak MiB allocated while `fn` runs, from the profiler's allocation events."""
    if DEVICE != "cpu":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - start) / 2**20
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak / 2**20


def held_after_forward(op: Callable[[Tensor], Tensor], x: Tensor) -> float:
    """MiB still allocated after the forward of `op(x * 2)`, the activation freed: what the
    backward keeps (output included)."""
    if DEVICE != "cpu":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        h = x * 2
        y = op(h)
        del h
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - start
        del y
        return held / 2**20
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        h = x * 2
        y = op(h)
        del h
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    del y
    return sum(e.nbytes() for e in events) / 2**20


def clipped_section(n: int, rounds: int, compiled: bool) -> None:
    @go.straight_through(clip=1.0, keep="input")
    def clip_input(x: Tensor) -> Tensor:
        return torch.sign(x)

    @go.straight_through(clip=1.0, keep="mask")
    def clip_mask(x: Tensor) -> Tensor:
        return torch.sign(x)

    x = torch.randn(n, n, device=DEVICE, requires_grad=True)
    g = torch.randn(n, n, device=DEVICE)
    modes = [("eager", lambda f: f)]
    if compiled:
        modes.append(("compiled", lambda f: torch.compile(f, fullgraph=True)))
    print(f"\n2. clipped straight-through (clip=1.0), ({n}, {n}) float32, forward + backward:")
    for mode, wrap in modes:
        torch._dynamo.reset()
        ops = {"keep='input'": wrap(clip_input), "keep='mask'": wrap(clip_mask)}
        result = compare({k: step(op, x, g) for k, op in ops.items()}, rounds=rounds, number=1,
                         sync=SYNC)
        for name, (seconds, ratio) in result.items():
            op = ops[name]
            peak = peak_memory(step(op, x, g))
            held = held_after_forward(op, x)
            print(
                f"  {mode:8s} {name:13s} {seconds * 1e3:8.1f} ms  ratio {ratio:.3f}   "
                f"peak {peak:6.1f} MiB   held for backward (activation input) {held:6.1f} MiB"
            )


# ---- 3. recipes against peers -----------------------------------------------------------------


def _maybe(module: str) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except Exception:  # any failure means the peer is not usable here
        return None


#: (preset, its parameters, how to build the peer's function from its module) for every
#: spike preset with a peer function that runs; the peers' modules are imported lazily.
#: norse's functions take their parameter positionally and have no default: 2.0 here.
_SJ = "spikingjelly.activation_based.surrogate"
_NT = "norse.torch.functional.threshold"
_PeerFactory = Callable[[Any], Callable[[Tensor], Tensor]]
SPIKE_PEERS: list[tuple[str, dict[str, float], str, _PeerFactory]] = [
    ("snntorch.atan", {}, "snntorch.surrogate", lambda m: m.atan()),
    ("snntorch.sigmoid", {}, "snntorch.surrogate", lambda m: m.sigmoid()),
    ("snntorch.fast_sigmoid", {}, "snntorch.surrogate", lambda m: m.fast_sigmoid()),
    ("snntorch.straight_through_estimator", {}, "snntorch.surrogate",
     lambda m: m.straight_through_estimator()),
    ("snntorch.heaviside", {}, "snntorch.surrogate", lambda m: m.heaviside()),
    ("snntorch.spike_rate_escape", {}, "snntorch.surrogate", lambda m: m.spike_rate_escape()),
    ("snntorch.SSO", {}, "snntorch.surrogate", lambda m: m.SSO()),
    ("snntorch.SFS", {}, "snntorch.surrogate", lambda m: m.SFS()),
    *[(f"spikingjelly.{name}", {}, _SJ, lambda m, n=name: getattr(m, n)())
      for name in ("ATan", "Sigmoid", "SoftSign", "SuperSpike", "Erf", "PiecewiseQuadratic",
                   "PiecewiseExp", "Rect", "QPseudoSpike", "S2NN", "SquarewaveFourierSeries",
                   "NonzeroSignLogAbs", "FakeNumericalGradient", "LogTailedReLU",
                   "DeterministicPass", "PoissonPass")],
    ("spikingjelly.LeakyKReLU", {"leak": 0.1, "k": 1.0}, _SJ, lambda m: m.LeakyKReLU(0.1, 1.0)),
    ("spikingjelly.PiecewiseLeakyReLU", {}, _SJ, lambda m: m.PiecewiseLeakyReLU()),
    *[(f"norse.{method}", {"alpha": 2.0}, _NT,
       lambda m, k=method: lambda x: m.threshold(x, k, 2.0))
      for method in ("super", "triangle", "heavi_erfc", "tanh", "circ")],
    ("norse.super_fn", {"alpha": 2.0}, _NT, lambda m: lambda x: m.super_fn(x, 2.0)),
    ("norse.triangle_fn", {}, _NT, lambda m: m.triangle_fn),
    *[(f"norse.{fn}", {"k": 2.0}, _NT, lambda m, f=fn: lambda x: getattr(m, f)(x, 2.0))
      for fn in ("heavi_erfc_fn", "heavi_tanh_fn", "heavi_circ_fn", "circ_dist_fn",
                 "logistic_fn")],
]
#: The presets whose peer function cannot run, and why (reported, not timed).
BROKEN_PEERS = {
    "snntorch.LSO": "snnTorch 1.0's LSO() raises a TypeError (and its LeakySpikeOperator "
    "returns one gradient for two inputs)",
}


def peer_pairs(n: int) -> list[tuple[str, Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]]:
    """(label, ours, peer) for every installed peer, on (n, n) inputs."""
    low = -torch.rand(n, 1, device=DEVICE) - 0.5  # per-row tensor bounds for the tensor clamps
    high = torch.rand(n, 1, device=DEVICE) + 0.5
    pairs: list[tuple[str, Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]] = []
    for preset, params, module, make in SPIKE_PEERS:
        peer = _maybe(module)
        if peer is not None:
            pairs.append((preset, R.spike.preset(preset, **params), make(peer)))
    bv = _maybe("brevitas.function.ops_ste")
    if bv is not None:
        pairs += [
            ("brevitas round_ste", R.ste_round(), bv.round_ste),
            ("brevitas floor_ste", R.ste_floor(), bv.floor_ste),
            ("brevitas ceil_ste", R.ste_ceil(), bv.ceil_ste),
            ("brevitas ternary_sign_ste", R.ste_sign(), bv.ternary_sign_ste),
            ("brevitas binary_sign_ste", R.binarize(clip=None), bv.binary_sign_ste),
            ("brevitas scalar_clamp_ste", R.ste_clamp(-1.0, 1.0, outside="pass"),
             lambda x: bv.scalar_clamp_ste(x, -1.0, 1.0)),
            ("brevitas tensor_clamp_ste",
             R.ste_clamp.preset("brevitas.tensor_clamp_ste", low, high),
             lambda x: bv.tensor_clamp_ste(x, low, high)),
            ("brevitas abs_binary_sign_grad", R.abs_subgradient(), bv.abs_binary_sign_grad),
        ]
    pairs += [
        ("torch.clamp", R.ste_clamp.preset("torch.clamp", -1.0, 1.0),
         lambda x: torch.clamp(x, -1.0, 1.0)),
        ("torch.nn.functional.hardtanh",
         R.ste_clamp.preset("torch.nn.functional.hardtanh", -1.0, 1.0),
         torch.nn.functional.hardtanh),
        ("torch.clamp, tensor bounds", R.ste_clamp(low, high, outside="zero"),
         lambda x: torch.clamp(x, low, high)),
        ("torch gumbel_softmax (noise=)",
         lambda x: R.gumbel_softmax(temperature=0.5)(x, noise=_gumbel_noise(x)),
         lambda x: torch.nn.functional.gumbel_softmax(x, tau=0.5, hard=True)),
    ]
    return pairs


def _gumbel_noise(x: Tensor) -> Tensor:
    """Gumbel draws as torch's own gumbel_softmax makes them (the same work on both sides)."""
    return -torch.empty_like(x).exponential_().log()


def rotation_pairs(n: int) -> list[tuple[str, Callable[[], None], Callable[[], None]]]:
    """The rotation trick against vector-quantize-pytorch's `rotate_to`, on n vectors of 64."""
    vq = _maybe("vector_quantize_pytorch.vector_quantize_pytorch")
    if vq is None:
        return []
    x = torch.randn(n, 64, device=DEVICE, requires_grad=True)
    q = torch.randn(n, 64, device=DEVICE)
    g = torch.randn(n, 64, device=DEVICE)
    trick = R.rotation_trick()

    def ours() -> None:
        torch.autograd.grad(trick(x, q), x, g)

    def peer() -> None:
        torch.autograd.grad(vq.rotate_to(x, q), x, g)

    return [(f"vector-quantize-pytorch rotate_to, ({n}, 64)", ours, peer)]


def peers_section(n: int, rounds: int, number: int, only: str = "") -> None:
    pairs = [pair for pair in peer_pairs(n) if only in pair[0]]
    print(f"\n3. recipes against peers, ({n}, {n}) float32, forward + backward (ratio ours/peer):")
    if not pairs:
        print("  no peer installed (pip install -e '.[peers]')")
        return
    x = torch.randn(n, n, device=DEVICE, requires_grad=True)
    # PoissonPass takes probabilities
    probability = torch.rand(n, n, device=DEVICE, requires_grad=True)
    g = torch.randn(n, n, device=DEVICE)
    runs = [
        (label, step(peer, xi, g), step(ours, xi, g))
        for label, ours, peer in pairs
        for xi in [probability if label == "spikingjelly.PoissonPass" else x]
    ]
    runs += [(label, peer, ours) for label, ours, peer in rotation_pairs(n * n // 64)
             if only in label]
    worst = 0.0
    for label, peer_run, ours_run in runs:
        result = compare({"peer": peer_run, "ours": ours_run}, rounds=rounds, number=number,
                         sync=SYNC)
        ratio = result["ours"][1]
        worst = max(worst, ratio)
        print(f"  {label:38s} peer {result['peer'][0] * 1e3:7.2f} ms   ours "
              f"{result['ours'][0] * 1e3:7.2f} ms   ratio {ratio:.3f}")
    for label, why in BROKEN_PEERS.items():
        if only in label:
                print(f"  {label:38s} not timed: {why}")
    print(f"  worst ratio {worst:.3f} (contract: never slower, at most 1.0)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small and few rounds (tests)")
    parser.add_argument("--size", type=int, default=4096, help="side of sections 1 and 2")
    parser.add_argument("--peer-size", type=int, default=1024, help="side of section 3")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled runs")
    add_device_argument(parser)
    parser.add_argument("--peers-only", action="store_true", help="only section 3")
    parser.add_argument("--only", default="", help="section 3: labels containing this text")
    args = parser.parse_args()
    global DEVICE, SYNC
    SYNC = synchronizer(args.device)
    DEVICE = args.device
    torch.set_num_threads(1)
    torch.manual_seed(0)
    size, peer_size = (256, 64) if args.quick else (args.size, args.peer_size)
    rounds = 3 if args.quick else 9
    print(f"torch {torch.__version__}, device {args.device}, 1 thread")
    with contextlib.ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        if not args.peers_only:
            identity_section(size, rounds)
            clipped_section(size, rounds, compiled=not (args.no_compile or args.quick))
        peers_section(peer_size, rounds if args.quick else 15, 1 if args.quick else 3,
                      only=args.only)


if __name__ == "__main__":
    main()
