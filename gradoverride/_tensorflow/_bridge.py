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
- Inside a graph the `tf.numpy_function` op carries the same gradient as well (a gradient
  registered for it with `gradient_override_map`): `tf.vectorized_map` rewrites the
  `tf.custom_gradient` wrapper into a plain identity, but runs an op it cannot vectorize
  (ours) in a loop that keeps its attributes, so the gradient stays the bridge's there too.
- The gradient decides between numpy on values and `tf.numpy_function` when it runs, not
  when the forward ran: `tape.jacobian` differentiates an eager forward inside a graph.
- The bridge's backward is once-differentiable: differentiating its gradient again raises.
- XLA (`jit_compile=True`) cannot compile a call into Python: a `GradOverrideError` says so.
- A SavedModel cannot hold Python code: saving one whose graph holds a bridge is refused
  (TensorFlow traces the registered gradients of the ops it saves, and ours refuses there).
- Inside a `tf.function`, TensorFlow reports an error of the numpy code as
  `tf.errors.UnknownError` (`InvalidArgumentError` for a `TypeError` or `ValueError`) with
  the original text; a `GradOverrideError` there says so and how to get it as itself.
"""

from __future__ import annotations

import importlib
import itertools
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf
import torch

from .._errors import GradOverrideError
from .._frameworks import autograph_artifact
from ._ops import in_xla


def _specs(outputs: Any) -> list[Any] | None:
    # A function is torch's `outputs=` (shapes for torch.compile): TensorFlow takes the
    # default, one output in the floating arguments' dtype.
    if outputs is None or callable(outputs):
        return None
    items = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    return [s if isinstance(s, tf.TensorSpec) else tf.TensorSpec(None, tf.as_dtype(s))
            for s in items]


@autograph_artifact
def call(bridge: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outputs: Any) -> Any:
    """`bridge(*args, **kwargs)` where the arguments hold TensorFlow tensors."""
    name = bridge._name
    if in_xla():
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
    op_name = "bridge_" + re.sub(r"[^A-Za-z0-9_.\-]", "_", name)

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

    @autograph_artifact
    def gradient_of(upstream: Sequence[Any], inputs: Sequence[Any]) -> list[Any]:
        """Per input, the bridge's gradient (None for a non-floating one), guarded against
        being differentiated again. Eager or graph as TensorFlow runs *now*: `tape.jacobian`
        calls the gradient of an eager forward inside a graph."""
        float_inputs = [inputs[k] for k in floating]
        upstream = [tf.convert_to_tensor(u) for u in upstream]  # `IndexedSlices` dense
        grads: list[Any]
        if tf.executing_eagerly():
            arrays = backward(*(u.numpy() for u in upstream), *(t.numpy() for t in inputs))
            grads = [tf.convert_to_tensor(g) for g in arrays]
        else:
            _refuse_saving(name)
            made = tf.numpy_function(
                _reporting(backward, name), [*upstream, *inputs],
                [t.dtype for t in float_inputs], stateful=True, name=op_name + "_backward",
            )
            grads = list(made) if isinstance(made, (list, tuple)) else [made]
            for g, t in zip(grads, float_inputs, strict=True):
                g.set_shape(t.shape)
        grads = [tf.cast(g, t.dtype) for g, t in zip(grads, float_inputs, strict=True)]
        if grads:
            grads = _once_differentiable(name, grads, float_inputs)
        by_input: list[Any] = [None] * len(inputs)
        for k, g in zip(floating, grads, strict=True):
            by_input[k] = g
        return by_input

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    @autograph_artifact
    def op(*inputs: Any) -> Any:
        if tf.executing_eagerly():
            results = [tf.convert_to_tensor(r) for r in forward(*(t.numpy() for t in inputs))]
        else:
            results = _graph_forward(
                name, op_name, _reporting(forward, name), list(inputs), specs,
                [_promoted(tensors)], gradient_of,
            )

        @autograph_artifact
        def gradient(*upstream: Any) -> Any:
            return gradient_of(upstream, inputs)

        return (results[0] if len(results) == 1 else results), gradient

    return op(*tensors)


def _graph_forward(
    name: str,
    op_name: str,
    forward: Callable[..., Any],
    inputs: list[Any],
    specs: list[Any] | None,
    default_dtypes: list[Any],
    gradient_of: Callable[[Sequence[Any], Sequence[Any]], list[Any]],
) -> list[Any]:
    """The forward as a `tf.numpy_function` op that carries the bridge's gradient itself."""
    _refuse_saving(name)

    @autograph_artifact
    def pyfunc_gradient(op: Any, *upstream: Any) -> list[Any]:
        _refuse_saving(name)  # TensorFlow traces it when saving, with op=None
        # Reached where the `tf.custom_gradient` wrapper was rewritten away (under
        # `tf.vectorized_map`, the op runs in a loop over the batch, one row at a time):
        # TensorFlow gives no gradient for an output nobody used.
        filled = [
            tf.zeros_like(out) if g is None else tf.convert_to_tensor(g)
            for g, out in zip(upstream, op.outputs, strict=True)
        ]
        return gradient_of(filled, list(op.inputs))

    gradient_name = f"GradOverrideBridge_{next(_GRADIENT_IDS)}"
    tf.RegisterGradient(gradient_name)(pyfunc_gradient)
    dtypes = [s.dtype for s in specs] if specs is not None else default_dtypes
    with tf.compat.v1.get_default_graph().gradient_override_map({"PyFunc": gradient_name}):
        made = tf.numpy_function(forward, inputs, dtypes, stateful=True, name=op_name)
    results = list(made) if isinstance(made, (list, tuple)) else [made]
    if specs is not None:
        for r, s in zip(results, specs, strict=True):
            r.set_shape(s.shape)
    if _in_keras_symbolic_build() and any(r.shape.rank is None for r in results):
        msg = (
            f"`{name}` is a go.bridge, and Keras is inferring the output shape of the layer "
            "that calls it from symbolic inputs (building a functional model), where its "
            "numpy function cannot run, so the shape of what it returns is unknown. Pass "
            f"`outputs=` to go.bridge with each output's shape and dtype, e.g. "
            f"`go.bridge({name}, backward=..., outputs=tf.TensorSpec([None, 3], "
            "tf.float32))` (None for the batch axis)."
        )
        raise GradOverrideError(msg)
    return results


#: Names for the gradients registered with TensorFlow, one per traced bridge call (as
#: `tf.custom_gradient` registers one per call); TensorFlow's registry refuses a name twice.
_GRADIENT_IDS = itertools.count()


def _once_differentiable(name: str, grads: list[Any], inputs: list[Any]) -> list[Any]:
    """`grads`, unchanged; differentiating them again (with respect to the inputs they were
    computed at) raises instead of giving a silent None: the numpy backward records no
    graph. The inputs are arguments so that the tape sees the gradient depend on them."""

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    @autograph_artifact
    def guard(*values: Any) -> Any:
        @autograph_artifact
        def second(*_: Any) -> Any:
            _refuse_saving(name)  # TensorFlow traces this gradient too when saving
            msg = (
                f"`{name}` is a go.bridge, whose backward runs numpy code and records no "
                "graph, so its gradient cannot be differentiated again (the backward is "
                "once-differentiable). For higher-order gradients, write it in TensorFlow "
                "ops, as a `go.custom_backward` op whose rule is differentiable."
            )
            raise GradOverrideError(msg)

        return [tf.identity(v) for v in values[: len(grads)]], second

    guarded: list[Any] = guard(*grads, *inputs)
    return list(guarded)


def _refuse_saving(name: str) -> None:
    """A `GradOverrideError` while TensorFlow writes a SavedModel: the bridge is a Python
    callback, which a SavedModel cannot hold (the saved graph would fail when it is run
    in another process, where the callback does not exist)."""
    if not _in_save_context():
        return
    msg = (
        f"`{name}` is a go.bridge, which runs numpy code through `tf.numpy_function`, a "
        "callback into this Python process: a SavedModel (`model.export`, "
        "`tf.saved_model.save`) cannot hold it, and would fail when served or loaded "
        "in another process. Export a model without the bridge (write that part in "
        "TensorFlow ops, as a `go.custom_backward` op with a TensorFlow rule), or keep "
        "the model in Python: save its weights (`model.save_weights`) and rebuild it "
        "where the bridged function can be imported."
    )
    raise GradOverrideError(msg)


def _in_save_context() -> bool:
    """Whether TensorFlow is writing a SavedModel (it enters a save context for that)."""
    try:
        save_context: Any = importlib.import_module("tensorflow.python.saved_model.save_context")
    except ImportError:  # pragma: no cover - a TensorFlow without the module: cannot tell
        return False
    return bool(save_context.in_save_context())


def _in_keras_symbolic_build() -> bool:
    """Whether Keras is inferring a layer's output from symbolic inputs (it traces `call` on
    placeholders inside its symbolic scope while it builds a functional model)."""
    if "keras" not in sys.modules:
        return False
    try:
        scope: Any = importlib.import_module("keras.src.backend.common.symbolic_scope")
    except ImportError:  # pragma: no cover - another Keras layout: cannot tell
        return False
    return bool(scope.in_symbolic_scope())


def _reporting(callback: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`callback` for a `tf.numpy_function`, whose errors reach the caller of the
    `tf.function` as TensorFlow's (`tf.errors.UnknownError`, or `InvalidArgumentError`), with
    the original text: a `GradOverrideError`'s text then says how to get it as itself."""

    @autograph_artifact
    def run(*arrays: Any) -> Any:
        try:
            return callback(*arrays)
        except GradOverrideError as exc:
            note = _NOTE.format(name=name)
            if note in str(exc):  # already said by an inner bridge's callback
                raise
            msg = f"{exc} {note}"
            raise type(exc)(msg) from exc  # GradOverrideTypeError stays a TypeError

    return run


_NOTE = (
    "(Raised inside a tf.function by go.bridge `{name}`; TensorFlow reports errors of "
    "numpy code run by a graph as `tf.errors.UnknownError` or `InvalidArgumentError`. Catch "
    "those, or call it eagerly (`tf.config.run_functions_eagerly(True)`) to get this "
    "GradOverrideError itself.)"
)


def _promoted(tensors: list[Any]) -> Any:
    floats = [t.dtype for t in tensors if t.dtype.is_floating]
    if not floats:
        return tf.float32
    return max(floats, key=lambda d: d.size)


def _flatten(values: Any) -> tuple[list[Any], Any]:
    return tf.nest.flatten(values, expand_composites=False), values
