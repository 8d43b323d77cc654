"""`go.bridge` on TensorFlow tensors: the same bridge, run through `tf.numpy_function`.

The bridge's own machinery (argument conversion, the checks on what `fn` returns, the user's
numpy rule or the estimator) is the torch side's, run on CPU torch tensors that share
memory with the numpy arrays TensorFlow hands over; only the edges are TensorFlow's:

- Forward: eagerly, `fn` runs directly on the tensors' values; inside a `tf.function`, in a
  `tf.numpy_function`, whose output dtypes must be known when the function is traced: given
  by `outputs=` (a `tf.TensorSpec`, a dtype, or a tuple of them), or else one output of the
  floating tensor arguments' promoted dtype (a bridge returning something else inside a
  `tf.function` needs `outputs=`, and says so when it runs).
- Backward: a `tf.custom_gradient` whose gradient runs the bridge's backward in a
  `tf.numpy_function` (directly, eagerly). TensorFlow keeps no Python state between the
  forward and the backward, so the backward calls `fn` once more, on the same inputs, to
  rebuild what the rule needs; an estimator calls it many times anyway.
- XLA (`jit_compile=True`) cannot compile a call into Python: a `GradOverrideError` says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import torch

from .._errors import GradOverrideError
from .._frameworks import autograph_artifact
from .recipes import _in_xla


def _specs(outputs: Any) -> list[Any] | None:
    if outputs is None:
        return None
    items = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    return [s if isinstance(s, tf.TensorSpec) else tf.TensorSpec(None, tf.as_dtype(s))
            for s in items]


@autograph_artifact
def call(bridge: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any) -> Any:
    """`bridge(*args, **kwargs)` where the arguments hold TensorFlow tensors."""
    name = bridge._name
    if _in_xla():
        msg = (
            f"`{name}` is a go.bridge, which runs numpy code, so it cannot be compiled by XLA "
            "(`jit_compile=True`): XLA compiles TensorFlow ops only. Call it eagerly or from a "
            "`tf.function` without `jit_compile=True` (in Keras, `model.compile(..., "
            "jit_compile=False)`)."
        )
        raise GradOverrideError(msg)
    flat, structure = _flatten((args, kwargs))
    slots = [i for i, v in enumerate(flat) if tf.is_tensor(v)]
    tensors = [tf.convert_to_tensor(flat[i]) for i in slots]
    floating = [k for k, t in enumerate(tensors) if t.dtype.is_floating]
    specs = _specs(outputs)

    def run_torch(arrays: Sequence[Any], with_grad: bool) -> tuple[list[Any], Any]:
        values = list(flat)
        leaves = []
        for k, (i, array) in enumerate(zip(slots, arrays, strict=True)):
            tensor = torch.from_numpy(np.array(array, copy=True))
            if with_grad and k in floating:
                tensor.requires_grad_(True)
            leaves.append(tensor)
            values[i] = tensor
        call_args, call_kwargs = tf.nest.pack_sequence_as(structure, values)
        result = bridge.op(*call_args, **call_kwargs)
        outs = list(result) if type(result) is tuple else [result]
        return outs, leaves

    @autograph_artifact
    def forward(*arrays: Any) -> list[np.ndarray[Any, Any]]:
        with torch.no_grad():
            outs, _ = run_torch(arrays, with_grad=False)
        results = [o.numpy() for o in outs]
        if specs is not None and len(results) != len(specs):
            msg = (
                f"`{name}` returned {len(results)} outputs, but the bridge was given "
                f"outputs= for {len(specs)}; give one `tf.TensorSpec` per output."
            )
            raise GradOverrideError(msg)
        return results

    @autograph_artifact
    def backward(*arrays: Any) -> list[np.ndarray[Any, Any]]:
        n_out = len(arrays) - len(tensors)
        upstream, inputs = arrays[:n_out], arrays[n_out:]
        outs, leaves = run_torch(inputs, with_grad=True)
        wanted = [leaves[k] for k in floating]
        pairs = [(o, torch.from_numpy(np.array(g, copy=True)).to(o.dtype))
                 for o, g in zip(outs, upstream, strict=True) if o.requires_grad]
        grads = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
        ) if pairs else [None] * len(wanted)
        return [
            np.zeros(leaf.shape, leaf.detach().numpy().dtype) if g is None else g.numpy()
            for leaf, g in zip(wanted, grads, strict=True)
        ]

    eager = tf.executing_eagerly()

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    @autograph_artifact
    def op(*inputs: Any) -> Any:
        if eager:
            results = [tf.convert_to_tensor(r) for r in forward(*(t.numpy() for t in inputs))]
        else:
            dtypes = [s.dtype for s in specs] if specs is not None else [_promoted(tensors)]
            results = tf.numpy_function(forward, list(inputs), dtypes, stateful=True)
            results = list(results) if isinstance(results, (list, tuple)) else [results]
            if specs is not None:
                for r, s in zip(results, specs, strict=True):
                    r.set_shape(s.shape)

        @autograph_artifact
        def gradient(*upstream: Any) -> Any:
            float_inputs = [inputs[k] for k in floating]
            grads: list[Any]
            if eager:
                arrays = backward(*(u.numpy() for u in upstream), *(t.numpy() for t in inputs))
                grads = [tf.convert_to_tensor(g) for g in arrays]
            else:
                made = tf.numpy_function(
                    backward, [*upstream, *inputs], [t.dtype for t in float_inputs],
                    stateful=True,
                )
                grads = list(made) if isinstance(made, (list, tuple)) else [made]
                for g, t in zip(grads, float_inputs, strict=True):
                    g.set_shape(t.shape)
            by_input: list[Any] = [None] * len(inputs)
            for k, g in zip(floating, grads, strict=True):
                by_input[k] = tf.cast(g, inputs[k].dtype)
            return by_input

        return (results[0] if len(results) == 1 else results), gradient

    return op(*tensors)


def _promoted(tensors: list[Any]) -> Any:
    floats = [t.dtype for t in tensors if t.dtype.is_floating]
    if not floats:
        return tf.float32
    return max(floats, key=lambda d: d.size)


def _flatten(values: Any) -> tuple[list[Any], Any]:
    return tf.nest.flatten(values, expand_composites=False), values
