"""TensorFlow: a `go.custom_backward` op against the same op written by hand with
`tf.custom_gradient`, in one run.

The op is the quickstart's quantizer (round in forward, straight-through inside [-1, 1] in
backward). One step is forward + backward under a `tf.GradientTape`, with a dense upstream
gradient; timed eagerly (where gradoverride's per-call Python work shows: binding the
arguments, choosing the gradient slots, checking the returned gradient) and inside a
`tf.function` (where that work happens once, at trace time, and the graph is what runs).
Interleaved, shuffled rounds; medians and the median of paired ratios to the hand-written op.
No contract number: DESIGN §4 states the torch one; this reports where TensorFlow stands.

    pip install -e ".[tensorflow]"
    python benchmarks/tf_overhead.py [--quick] [--device cuda]

`--device cuda` places the tensors on TensorFlow's first GPU (it needs a TensorFlow build
with GPU support; the CPU-only `tensorflow-cpu` exits saying so).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:
    import tensorflow as tf
except ImportError:
    # Exit status 3: this benchmark cannot run here (what benchmarks/gpu.sh marks skipped).
    print("TensorFlow is not installed (pip install -e '.[tensorflow]')", file=sys.stderr)
    sys.exit(3)

import gradoverride as go

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _timing import add_device_argument, compare, tensorflow_device


@go.custom_backward
def quantize(x: Any, bits: int = 4) -> Any:
    scale = 2.0**bits
    return tf.round(x * scale) / scale


@quantize.backward
def _(grad: Any, *, x: Any) -> Any:
    return grad * tf.cast(tf.abs(x) <= 1, grad.dtype)


def quantize_by_hand(x: Any, bits: int = 4) -> Any:
    """The same op written directly with `tf.custom_gradient` (the bit width closed over)."""

    @tf.custom_gradient
    def op(x: Any) -> Any:
        scale = 2.0**bits

        def grad(upstream: Any) -> Any:
            return upstream * tf.cast(tf.abs(x) <= 1, upstream.dtype)

        return tf.round(x * scale) / scale, grad

    return op(x)


def _step(op: Callable[..., Any]) -> Callable[[Any, Any], Any]:
    def step(x: Any, upstream: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = op(x, 4)
        return tape.gradient(y, x, output_gradients=upstream)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (for the test suite)")
    add_device_argument(parser)
    args = parser.parse_args()
    placement = tensorflow_device(args.device)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    print(f"tensorflow {tf.__version__}, {placement}, 1 thread")
    with tf.device(placement):
        run_all(args.quick)


def run_all(quick: bool) -> None:
    for shape, number, rounds in (((1, 256), 100, 21), ((2048, 2048), 3, 9)):
        x = tf.random.stateless_normal(shape, seed=(0, 1))
        upstream = tf.random.stateless_normal(shape, seed=(0, 2))
        for mode in ("eager", "tf.function"):
            cases: dict[str, Callable[[], Any]] = {}
            for name, op in (("tf.custom_gradient", quantize_by_hand),
                             ("go.custom_backward", quantize)):
                step = _step(op)
                if mode == "tf.function":
                    step = tf.function(step)

                def run(step: Callable[[Any, Any], Any] = step, x: Any = x,
                        upstream: Any = upstream) -> None:
                    step(x, upstream).numpy()

                cases[name] = run
            result = compare(cases, rounds=3 if quick else rounds,
                             number=2 if quick else number)
            print(f"\nforward+backward per step, shape {shape}, {mode}:")
            for name, (seconds, ratio) in result.items():
                print(f"  {name:22s} {seconds * 1e6:10.1f} us   ratio {ratio:.3f}")


if __name__ == "__main__":
    main()
