"""The support matrix: every op kind under every context, supported or refused with a reason.

Three tables, torch's (`KINDS` x `CONTEXTS`), TensorFlow's (`TF_KINDS` x `TF_CONTEXTS`) and
JAX's (`JAX_KINDS` x `JAX_CONTEXTS`), are the one source of truth:
`tests/test_support_matrix.py`, `tests/test_support_matrix_tensorflow.py` and
`tests/test_support_matrix_jax.py` run one test per cell (a supported cell must give
the expected gradients, or on a deployment path the expected outputs; a refused cell must
raise the error named here; a warning cell must warn; a known defect is an expected failure
until fixed), and `docs/support-matrix.md` is generated from them (`python -m
gradoverride._support_matrix docs/support-matrix.md`; a test fails when the page is stale).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "CONTEXTS",
    "DEFECTS",
    "JAX_CONTEXTS",
    "JAX_KINDS",
    "JAX_NOTES",
    "JAX_REFUSED",
    "KERAS_BACKENDS",
    "KERAS_BACKEND_KINDS",
    "KERAS_BACKEND_REFUSED",
    "KINDS",
    "NOTES",
    "REFUSED",
    "TF_CONTEXTS",
    "TF_DEFECTS",
    "TF_KINDS",
    "TF_NOTES",
    "TF_NOT_APPLICABLE",
    "TF_REFUSED",
    "TF_WARNS",
    "Refusal",
    "markdown",
]

#: Op kinds: (key, what it is). Each has a case in the test suite.
KINDS: tuple[tuple[str, str], ...] = (
    ("custom_backward", "`@go.custom_backward`, the rule owning every input"),
    ("custom_backward owns=", "a rule owning some inputs; the rest keep autograd's gradient"),
    ("custom_backward residuals", "values computed in forward, read by the rule"),
    ("custom_backward once_differentiable", "a rule that runs without recording a graph"),
    ("straight_through", "the identity backward"),
    ("straight_through clip", "the clipped straight-through (`clip=`)"),
    ("straight_through surrogate", "a surrogate's derivative by autograd (`surrogate=`)"),
    ("go.Module", "a module whose `backward` owns its input and parameters"),
    ("go.Module owns=", "a module whose rule owns its input; parameters keep autograd's"),
    ("override_backward", "a rule given to an existing `nn.Linear`"),
    ("grad_hook inputs", "a transform at a module's inputs"),
    ("grad_hook outputs", "a transform at a module's outputs"),
    ("grad_hook parameters", "a transform at a module's parameters"),
    ("recipe: straight-through estimator", "`ste_round` (the STE family: round, sign, ...)"),
    ("recipe: learned step (lsq)", "`lsq` with a learnable step"),
    ("recipe: surrogate spike", "`spike` (every surrogate shares the op)"),
    ("recipe: stochastic spike", "`spike(sample=True)` and `leaky_relu` with a `spread`, "
     "given `noise=`"),
    ("recipe: gradient flow", "`reverse_grad(...).module()` (scaling, clipping, sanitizing "
     "share the op)"),
    ("recipe: discrete choice", "`ste_argmax` (straight-through argmax)"),
    ("recipe: rotation trick", "`rotation_trick` (vector quantization): x gets the rotated "
     "gradient, its code q none"),
    ("recipe: black-box solver", "`blackbox_solver` around a numpy solver"),
    ("bridge", "`go.bridge`: numpy in the middle of the graph"),
)

#: Contexts: (key, how the cell runs the op).
CONTEXTS: tuple[tuple[str, str], ...] = (
    ("eager", "forward and backward in eager mode (the baseline, checked against an "
     "independent computation)"),
    ("compile", "`torch.compile(fullgraph=True)`, the first call compiled, static shapes"),
    ("compile dynamic", "`torch.compile(fullgraph=True, dynamic=True)`, two input shapes"),
    ("torch.func.grad", "`torch.func.grad` of the loss with respect to the input"),
    ("vmap", "`torch.func.vmap(torch.func.grad(...))`: per-sample gradients"),
    ("functional_call", "`torch.func.functional_call` with other parameters"),
    ("checkpoint", "`torch.utils.checkpoint.checkpoint`, `use_reentrant=False` and `True`"),
    ("in-place after", "an in-place op (`relu_`) on the result right after, the input used "
     "again after it"),
    ("save/load", "`torch.save` then `torch.load` of the module"),
    ("deepcopy", "`copy.deepcopy` of the module"),
    ("torch.jit.script", "`torch.jit.script` of the module"),
    ("autocast", "`torch.autocast('cpu', dtype=torch.bfloat16)`"),
    ("threads", "two threads calling the same module at once"),
    ("torch.export", "`torch.export.export` of the module: an inference graph of the forward, "
     "with the same outputs (no rule applies in it)"),
    ("AOTInductor", "`torch._inductor.aoti_compile_and_package` of the `torch.export` program, "
     "loaded with `torch._inductor.aoti_load_package`: eager mode's outputs on the exported "
     "input and on other values of its shape (the test compiles one model holding every "
     "kind's case side by side, as each build compiles C++ for seconds)"),
    ("ONNX (dynamo)", "`torch.onnx.export(module, (x,), dynamo=True)`, the graph run by "
     "onnxruntime: eager mode's outputs on the exported input and on other values of its "
     "shape, within `torch.testing.assert_close`'s float32 tolerances"),
    ("ONNX (TorchScript)", "`torch.onnx.export(module, (x,), dynamo=False)` with grad enabled, "
     "the graph run by onnxruntime: eager mode's outputs on the exported input and on other "
     "values of its shape, within `torch.testing.assert_close`'s float32 tolerances"),
    ("torch.jit.trace", "`torch.jit.trace` of the module under `torch.no_grad()`: the traced "
     "module gives eager mode's outputs on the traced input and on other values of its shape"),
    ("go.monitor", "forward and backward in eager mode inside `with go.monitor(module)`: the "
     "same gradients, and the override's gradients recorded"),
    ("no_grad", "the forward under `torch.no_grad()`: eager mode's outputs"),
    ("inference_mode", "the forward under `torch.inference_mode()`: eager mode's outputs"),
    ("compile no_grad", "`torch.compile(fullgraph=True)`, the first call under "
     "`torch.no_grad()`: eager mode's outputs (a validation loop)"),
    ("compile inference_mode", "`torch.compile(fullgraph=True)`, the first call under "
     "`torch.inference_mode()`: eager mode's outputs"),
    ("compile frozen", "`torch.compile(fullgraph=True)` of the module with its parameters "
     "frozen, grad enabled, the input requiring none: eager mode's outputs"),
    ("compile torch.func.grad", "`torch.compile` around `torch.func.grad` of the loss"),
    ("compile vmap", "`torch.compile` around `torch.func.vmap(torch.func.grad(...))`"),
    ("copy.copy", "`copy.copy` of the module: the copy runs itself (its own mode and "
     "attributes), with the override"),
    ("replica", "a `nn.DataParallel`-style replica (each module shallow-copied, holding "
     "copies of the parameters computed from them): the same gradients reach the original "
     "parameters"),
)


@dataclass(frozen=True)
class Refusal:
    """A cell that raises instead of computing (or, in `TF_WARNS`, that warns): what it
    raises and why."""

    reason: str
    error: str = "GradOverrideError"  # the exception (or warning) class name the cell raises
    match: str = ""  # a regular expression its message matches


_SCRIPT = Refusal(
    "TorchScript compiles the forward from source or records it alone, without the Python "
    "rule; every gradoverride module refuses, so a scripted module never trains silently "
    "with its ordinary gradient. Use `torch.compile`.",
    match=r"torch\.jit\.script cannot keep the backward",
)
_SCRIPT_BRIDGE = Refusal(
    "A bridge is Python and numpy code, which TorchScript cannot convert to its types: "
    "TorchScript raises its own error (it \"failed to convert Python type\" `Bridge`). Keep "
    "the module in Python.",
    error="RuntimeError",
    match=r"Bridge",
)
_SOLVER_OUTPUT = Refusal(
    "The solver's rule reads the solver's output (the interpolation of Vlastelica et al. "
    "compares two solutions), so an in-place op on that output changes what the rule reads; "
    "the backward raises, saying to make the op out of place or apply it to a copy.",
    match=r"changed in place after the forward",
)

# ---- numpy on the deployment paths (bridges, the black-box solver) ------------------------
#
# A bridge and the black-box solver run numpy inside one opaque operator,
# `gradoverride::outside`: torch.compile, torch.export, AOTInductor and torch.jit.trace hold
# it as one node that calls the Python function; the ONNX exporters have no translation
# for it. Their refusals live here alone.

_NUMPY_KINDS = ("recipe: black-box solver", "bridge")
_NUMPY_ONNX_DYNAMO = Refusal(
    "ONNX cannot call a Python function: the dynamo-based exporter finds no ONNX function "
    "for the `gradoverride::outside` operator the numpy call runs in and raises its "
    "`ConversionError`. Write that computation in ONNX ops and pass it as "
    "`custom_translation_table`, or export the parts around the numpy call.",
    error="ConversionError",
    match=r"gradoverride\.outside",
)
_NUMPY_ONNX_SCRIPT = Refusal(
    "ONNX cannot call a Python function: the TorchScript-based exporter stops at the "
    "`gradoverride::outside` operator the numpy call runs in (`UnsupportedOperatorError`, "
    "\"unrecognized namespace gradoverride::outside\"). Export the parts around the numpy "
    "call.",
    error="UnsupportedOperatorError",
    match=r"gradoverride::outside",
)
_NUMPY_DEPLOY_REFUSED: dict[str, Refusal] = {
    "ONNX (dynamo)": _NUMPY_ONNX_DYNAMO,
    "ONNX (TorchScript)": _NUMPY_ONNX_SCRIPT,
}
_NUMPY_DEPLOYED = (
    "The exported program (and the package AOTInductor compiles from it) calls the Python "
    "function through the `gradoverride::outside` operator: load or run it in a process "
    "that has made the same bridge or recipe (import the module defining it)."
)

#: The refused cells, by (kind, context). Every other cell is supported.
REFUSED: dict[tuple[str, str], Refusal] = {
    **{(kind, "torch.jit.script"): _SCRIPT for kind, _ in KINDS if kind != "bridge"},
    ("bridge", "torch.jit.script"): _SCRIPT_BRIDGE,
    ("recipe: black-box solver", "in-place after"): _SOLVER_OUTPUT,
    **{(kind, context): refusal for kind in _NUMPY_KINDS
       for context, refusal in _NUMPY_DEPLOY_REFUSED.items()},
}

#: Cells that give wrong outputs without an error today (known defects, marked as expected
#: failures in the tests until fixed), by (kind, context).
DEFECTS: dict[tuple[str, str], str] = {}

_COMPILED_TRANSFORM = (
    "torch.compile cannot keep a custom backward inside a `torch.func` transform it traces "
    "(a PyTorch limitation a hand-written autograd.Function shares: it silently gives the "
    "forward's own derivative), so the call is a graph break and runs eagerly, with the "
    "rule; under `fullgraph=True` the compile error gives that reason. Take gradients of a "
    "compiled model with `loss.backward()` or `torch.autograd.grad` instead."
)

_TRACE_UNDER_NO_GRAD = (
    "Traced under `torch.no_grad()` (or `torch.inference_mode()`): with grad enabled the "
    "trace raises a `GradOverrideError` saying to wrap it, because a traced module keeps the "
    "forward alone and would train with its ordinary gradient."
)
_TRACE_HOOKED_PARAMETERS = (
    "With grad enabled the trace is not refused: the hooks are on the parameters "
    "themselves, which the traced module uses, so their gradients are transformed there too."
)
_TRACER_SHAPE_CHECK = (
    "torch warns while tracing (`TracerWarning`: \"Converting a tensor to a Python boolean "
    "might cause the trace to be incorrect\"): the recipe checks its inputs' shapes in "
    "Python, and the trace keeps the check's outcome. The outputs are eager mode's."
)
#: Kinds whose recipe checks shapes in Python (a `TracerWarning` in `torch.jit.trace` and the
#: TorchScript-based ONNX exporter).
_SHAPE_CHECKED = ("recipe: stochastic spike", "recipe: discrete choice",
                  "recipe: rotation trick")

#: Supported cells with something to know, by (kind, context).
NOTES: dict[tuple[str, str], str] = {
    **{
        (kind, "torch.jit.trace"): (
            _TRACE_HOOKED_PARAMETERS if kind == "grad_hook parameters" else _TRACE_UNDER_NO_GRAD
        ) + (" " + _TRACER_SHAPE_CHECK if kind in _SHAPE_CHECKED else "")
        for kind, _ in KINDS
    },
    **{(kind, "ONNX (TorchScript)"): _TRACER_SHAPE_CHECK for kind in _SHAPE_CHECKED},
    **{(kind, context): _NUMPY_DEPLOYED for kind in _NUMPY_KINDS
       for context in ("torch.export", "AOTInductor")},
    **{
        (kind, context): _COMPILED_TRANSFORM
        for kind, _ in KINDS
        for context in ("compile torch.func.grad", "compile vmap")
        if kind != "grad_hook parameters"
    },
    ("custom_backward residuals", "eager"): (
        "First-order gradients; a second differentiation that reaches a residual raises "
        "(a residual is a constant to autograd)."
    ),
    ("recipe: gradient flow", "in-place after"): (
        "The module form copies its input, so `Linear -> reverse_grad().module() -> "
        "ReLU(inplace=True)` works; the function form `reverse_grad()(x)` returns a view, "
        "and an in-place op on it is PyTorch's error for views made in a Function (clone "
        "it, or use the module form): an in-place op through memory shared with `x` would "
        "change `x` behind autograd's back."
    ),
    ("grad_hook inputs", "in-place after"): (
        "A module built with `inplace=True` (`nn.ReLU(inplace=True)`) keeps the transform "
        "too, in eager mode: it gets a copy, and its change is copied back (under "
        "`torch.compile` it meets PyTorch's error for views made in a Function). A module "
        "returning its input as-is returns a view: an in-place op right after it is "
        "PyTorch's error."
    ),
    ("recipe: stochastic spike", "compile"): (
        "With `noise=`. Without it the spike draws from torch's default generator, and a "
        "compiled graph draws its own numbers (not eager mode's); a `generator=` cannot be "
        "compiled."
    ),
    ("recipe: stochastic spike", "vmap"): (
        "With `noise=`: `vmap` refuses random draws (or takes `randomness=`)."
    ),
    ("go.Module", "functional_call"): "The rule reads the parameters passed in.",
    ("go.Module owns=", "functional_call"): "The rule reads the parameters passed in.",
    ("override_backward", "functional_call"): "The rule reads the parameters passed in.",
    ("grad_hook parameters", "functional_call"): (
        "The passed tensors' total gradients are transformed, as a parameter's own is; a "
        "tensor computed from a hooked parameter (MAML's fast weights `p - lr * g`) is not "
        "hooked itself: its gradient reaches the parameter, which transforms it once."
    ),
    ("grad_hook parameters", "checkpoint"): (
        "With `use_reentrant=True` PyTorch runs one backward pass per checkpointed segment, "
        "so a parameter used in several segments has each segment's part transformed on "
        "its own (the same total for a linear transform such as a scale, not for a norm "
        "clip); `use_reentrant=False` transforms the total."
    ),
    ("grad_hook parameters", "save/load"): (
        "`torch.save` keeps no tensor hooks; the loaded module hooks its parameters again "
        "at its first call."
    ),
}


# ---- TensorFlow and Keras ----------------------------------------------------------------
#
# The same contract on TensorFlow: `tests/test_support_matrix_tensorflow.py` runs one test
# per cell. Each op kind is called from a Keras layer (an op on `x * scale`, with `scale` a
# variable), so that every context, `model.fit` included, differentiates the same thing.

#: TensorFlow op kinds: (key, what it is). Each has a case in the test suite.
TF_KINDS: tuple[tuple[str, str], ...] = (
    ("custom_backward", "`@go.custom_backward` on TensorFlow tensors, the rule owning every "
     "input"),
    ("custom_backward owns=", "a rule owning `x`; a Keras variable passed as the other "
     "argument keeps TensorFlow's gradient"),
    ("straight_through", "`go.straight_through(tf.sign)`: the identity backward"),
    ("recipe: surrogate spike", "`recipes.spike('arctan')`: a step forward, the surrogate's "
     "derivative backward"),
    ("recipe: gradient flow", "`recipes.reverse_grad(scale=0.5)`"),
    ("gradoverride.keras.Layer", "a Keras layer whose `backward` gives its input's and its "
     "variable's gradients"),
    ("override_backward", "a rule given to an existing `keras.layers.Dense`"),
    ("grad_hook inputs", "a transform at a `Dense`'s inputs"),
    ("grad_hook outputs", "a transform at a `Dense`'s outputs"),
    ("grad_hook variables", "a transform (`recipes.clip_grad_value`) at a `Dense`'s variables"),
    ("bridge", "`go.bridge` around numpy code on TensorFlow tensors, with `outputs=` giving "
     "the output's shape"),
)

#: TensorFlow contexts: (key, how the cell runs the op).
TF_CONTEXTS: tuple[tuple[str, str], ...] = (
    ("eager", "forward and backward eagerly, checked against gradients worked out by hand"),
    ("tf.function", "the gradient step traced by `tf.function`"),
    ("XLA", "the gradient step compiled by `tf.function(jit_compile=True)`"),
    ("model.fit", "the layer in a `keras.Sequential`, one SGD step of `model.fit` "
     "(`jit_compile=False`): the updated variables"),
    ("vectorized_map", "`tf.vectorized_map` of the layer over the batch's rows, the gradient "
     "with respect to the batched input"),
    ("while loop", "the layer called in a `tf.range` loop under `tf.function` (a "
     "`tf.while_loop`), differentiated"),
    ("mixed precision", "the layer built and run eagerly under `keras.mixed_precision."
     "set_global_policy('mixed_float16')`: float16 compute (an op gets float16 tensors), "
     "float32 variables"),
    ("strategy", "`tf.distribute.MirroredStrategy` over two logical CPUs: each replica's "
     "gradient of its half of the batch, summed"),
    ("installed after tracing", "an override or hook installed on a layer that a "
     "`tf.function` already ran with something installed"),
    ("clone/deepcopy", "`copy.deepcopy` of a Keras model holding the layer, and a `.keras` "
     "file saved and loaded (Keras copies by saving and loading); "
     "`gradoverride.keras.copy_overrides(model, copy)` for what was installed on a layer"),
    ("sparse gradients", "an `IndexedSlices` gradient reaching the layer (its output gathered "
     "with `tf.gather`); for `grad_hook variables`, an `Embedding`'s gradient"),
)

#: Kinds whose override is installed on an existing layer (`override_backward`, `grad_hook`).
_TF_INSTALLED = ("override_backward", "grad_hook inputs", "grad_hook outputs",
                 "grad_hook variables")
_TF_OPS = ("custom_backward", "custom_backward owns=", "straight_through",
           "recipe: surrogate spike", "recipe: gradient flow", "bridge")

_VECTORIZED_MAP = Refusal(
    "`tf.vectorized_map` rewrites each op of its function into a batched op and drops custom "
    "gradients on the way, so the override would be replaced by the derivative of the "
    "forward's own ops; the call raises instead. Call the op or layer on the whole batch "
    "(it takes batched tensors), or use `tf.map_fn`.",
    match=r"is called inside `tf.vectorized_map`.*on the whole batch",
)
_BRIDGE_XLA = Refusal(
    "XLA compiles TensorFlow ops only and cannot call into numpy; the message says to run "
    "the step eagerly or in a `tf.function` without `jit_compile=True` (in Keras, "
    "`model.compile(..., jit_compile=False)`).",
    match=r"go\.bridge, which runs numpy code, so it cannot be compiled by XLA",
)

#: The refused TensorFlow cells, by (kind, context).
TF_REFUSED: dict[tuple[str, str], Refusal] = {
    **{
        (kind, "vectorized_map"): _VECTORIZED_MAP
        for kind in ("custom_backward", "custom_backward owns=", "straight_through",
                     "recipe: surrogate spike", "recipe: gradient flow",
                     "gradoverride.keras.Layer", "override_backward", "grad_hook inputs",
                     "grad_hook outputs", "grad_hook variables")
    },
    ("bridge", "XLA"): _BRIDGE_XLA,
}

_AFTER_TRACING = Refusal(
    "A traced function keeps running the layer as it was when traced, so installing (or "
    "removing) an override or hook on a layer a `tf.function` (`model.fit`'s step) already "
    "traced warns, saying to install before the first traced call or to make the function "
    "again (`model.compile(...)` before the next `fit`). Not detected: a layer first traced "
    "with nothing installed on it; installing then gives no warning, and the traced function "
    "runs the layer without the override.",
    error="GradOverrideWarning",
    match=r"was installed after the Dense `\w+` was traced into a `tf.function`",
)
_PER_REPLICA = Refusal(
    "A hook runs on each replica's share of the gradient before the strategy sums the "
    "shares. A linear transform (a scale, `reverse_grad`) gives the one-device gradient; a "
    "nonlinear one (a clip) warns that it bounds each share, and the cell checks the sum of "
    "the clipped shares. To clip the summed gradient, give the optimizer `clipvalue=` or "
    "`clipnorm=`.",
    error="GradOverrideWarning",
    match=r"runs on each replica's share of the gradient, before MirroredStrategy sums the 2 "
    r"shares",
)

_PER_CALL = Refusal(
    "A hook at the variables applies to the gradient of each call of the layer (TensorFlow "
    "has no hook on a variable's total gradient): in a loop each pass's share is "
    "transformed. A linear transform gives the total's; a clip (this cell's) warns that it "
    "bounds each share, and the cell checks the sum of the clipped shares. To clip the total, "
    "give the optimizer `clipnorm=` or `clipvalue=`.",
    error="GradOverrideWarning",
    match=r"to the gradient of each call of the Dense `\w+`, which runs in a loop",
)

#: TensorFlow cells that work and warn (a `GradOverrideWarning`), by (kind, context).
TF_WARNS: dict[tuple[str, str], Refusal] = {
    **{(kind, "installed after tracing"): _AFTER_TRACING for kind in _TF_INSTALLED},
    ("grad_hook variables", "strategy"): _PER_REPLICA,
    ("grad_hook variables", "while loop"): _PER_CALL,
}

#: TensorFlow cells that do not apply, with the reason.
TF_NOT_APPLICABLE: dict[tuple[str, str], str] = {
    **{
        (kind, "installed after tracing"): "an op is code the layer's `call` runs, not "
        "something installed on a layer: a traced function runs the code it traced."
        for kind in _TF_OPS
    },
    ("gradoverride.keras.Layer", "installed after tracing"): (
        "its backward is part of its class: nothing is installed on the instance."
    ),
}

#: TensorFlow cells that give a wrong gradient without an error today (known defects,
#: marked as expected failures in the tests until fixed), by (kind, context): none now.
TF_DEFECTS: dict[tuple[str, str], str] = {}

#: Supported TensorFlow cells with something to know, by (kind, context).
TF_NOTES: dict[tuple[str, str], str] = {
    **{
        (kind, "clone/deepcopy"): (
            "The copy has no override or hook until `gradoverride.keras.copy_overrides("
            "model, copy)`: Keras copies a layer's config and weights, not what was "
            "installed on the instance (`go.overrides(copy)` lists nothing)."
        )
        for kind in _TF_INSTALLED
    },
    **{
        (kind, "clone/deepcopy"): (
            "The op is code in the layer's `call`, so the copy runs it (the layer class is "
            "registered with Keras, as a loaded `.keras` file needs)."
        )
        for kind in _TF_OPS
    },
    ("gradoverride.keras.Layer", "clone/deepcopy"): (
        "The backward is the class's: the copy has it (the class is registered with Keras)."
    ),
    ("bridge", "model.fit"): (
        "With `outputs=` giving the output's shape: Keras infers a functional model's "
        "shapes before numpy can run (without it, a `GradOverrideError` says to pass it)."
    ),
    ("bridge", "while loop"): (
        "With `outputs=` giving the output's shape: without it the bridge's output has an "
        "unknown shape in the graph, which TensorFlow refuses for a loop variable."
    ),
    ("bridge", "vectorized_map"): "The numpy function runs once per example.",
    ("grad_hook variables", "model.fit"): (
        "The transform gets the gradient of the loss Keras differentiates (the batch mean), "
        "so a clip bounds what the optimizer gets."
    ),
    ("grad_hook variables", "sparse gradients"): (
        "The `Embedding`'s `IndexedSlices` gradient is made dense before the transform: a "
        "row looked up twice has its summed gradient clipped once."
    ),
    ("override_backward", "mixed precision"): (
        "The rule gets float16 gradients and inputs; `layer.kernel` read in the rule is "
        "float16 too (Keras' autocast), and the returned float16 gradients are cast to the "
        "float32 variables."
    ),
}


# ---- JAX --------------------------------------------------------------------------------------
#
# The same contract on JAX arrays: `tests/test_support_matrix_jax.py` runs one test per cell,
# each op on `x * w` (w a fixed array) differentiated with respect to x, against gradients
# worked out by hand.

#: JAX op kinds: (key, what it is). Each has a case in the test suite.
JAX_KINDS: tuple[tuple[str, str], ...] = (
    ("custom_backward", "`@go.custom_backward` on JAX arrays, the rule owning every input"),
    ("custom_backward owns=", "a rule owning `x`; the other array keeps JAX's gradient"),
    ("custom_backward residuals", "values computed in forward, read by the rule"),
    ("custom_backward once_differentiable", "a rule marked `once_differentiable=True`"),
    ("straight_through", "`go.straight_through(jnp.round)`: the identity backward"),
    ("straight_through clip", "the clipped straight-through (`clip=`)"),
    ("straight_through surrogate", "a surrogate's derivative (`surrogate=jnp.tanh`)"),
    ("recipe: straight-through estimator", "`ste_round`"),
    ("recipe: learned step (lsq)", "`lsq(4)` with the step an array (its gradient checked "
     "too)"),
    ("recipe: quantize", "`quantize(4)`, the range from the input"),
    ("recipe: surrogate spike", "`spike('arctan')`"),
    ("recipe: stochastic spike", "`spike('leaky_relu', leak=0.1, spread=0.2)` given "
     "`noise=`"),
    ("recipe: gradient flow", "`reverse_grad(0.5)`"),
    ("recipe: clipping", "`clip_grad_norm(1.0)`"),
    ("recipe: discrete choice", "`ste_argmax()` (a softmax backward)"),
)

#: JAX contexts: (key, how the cell runs the op).
JAX_CONTEXTS: tuple[tuple[str, str], ...] = (
    ("eager", "`jax.grad` of the loss, not compiled"),
    ("jit", "`jax.jit(jax.grad(loss))`"),
    ("vmap", "`jax.vmap(jax.grad(loss))`: per-example gradients"),
    ("second derivative", "`jax.grad` of the gradient's dot product with a fixed array "
     "(a Hessian-vector product)"),
)

_ONCE = Refusal(
    "The rule said it is differentiable once: a second derivative raises, naming the op and "
    "saying to drop `once_differentiable=True` with a rule written in `jnp` ops.",
    match=r"is marked once_differentiable=True",
)

#: The refused JAX cells, by (kind, context).
JAX_REFUSED: dict[tuple[str, str], Refusal] = {
    ("custom_backward once_differentiable", "second derivative"): _ONCE,
}

#: Supported JAX cells with something to know, by (kind, context).
JAX_NOTES: dict[tuple[str, str], str] = {
    **{
        (kind, "second derivative"): (
            "The rule's own ops are differentiated (a piecewise-constant gradient has a zero "
            "second derivative), as with a hand-written `jax.custom_vjp`."
        )
        for kind in ("custom_backward owns=", "straight_through", "straight_through clip",
                     "recipe: straight-through estimator", "recipe: learned step (lsq)",
                     "recipe: quantize", "recipe: stochastic spike", "recipe: gradient flow")
    },
    ("custom_backward residuals", "second derivative"): (
        "JAX differentiates the op's forward as well, so a residual's dependence on the "
        "inputs is followed: the true second derivative (torch refuses this cell, as its "
        "forward's graph is not kept)."
    ),
    ("recipe: stochastic spike", "eager"): (
        "JAX has no global random state: a stochastic spike on JAX arrays takes its uniform "
        "draws as `noise=` (`jax.random.uniform(key, x.shape)`)."
    ),
}


# ---- Keras 3 backends -----------------------------------------------------------------------
#
# `gradoverride.keras` by Keras backend: `tests/test_keras_backends.py` runs the JAX and torch
# columns (one interpreter per backend, as Keras fixes its backend at import); the TensorFlow
# column is the TensorFlow table above.

#: Keras kinds: (key, what it is).
KERAS_BACKEND_KINDS: tuple[tuple[str, str], ...] = (
    ("gradoverride.keras.Layer", "a Keras layer whose `backward` gives its input's and its "
     "variables' gradients, trained by one `model.fit` step"),
    ("recipe layers", "`GradientReversal` (with a `ganin_ramp` schedule counting `fit`'s "
     "steps), `Spike`, `Quantize`"),
    ("override_backward", "a rule given to an existing Keras layer"),
    ("grad_hook", "a transform at an existing Keras layer's variables"),
)

#: Keras backends: (key, what runs).
KERAS_BACKENDS: tuple[tuple[str, str], ...] = (
    ("tensorflow", "`KERAS_BACKEND=tensorflow`: the TensorFlow table above"),
    ("jax", "`KERAS_BACKEND=jax`: `model.fit` and `jax.grad` over `model.stateless_call`; "
     "the rule runs on JAX arrays"),
    ("torch", "`KERAS_BACKEND=torch`: `model.fit` and `loss.backward()`; the rule runs on "
     "torch tensors, the variables being torch parameters"),
)

_KERAS_MODULE_SIDE = Refusal(
    "Installing a rule or a hook on an existing Keras layer uses TensorFlow's graph and "
    "variables; on the other backends it raises, naming the layer and saying to set "
    "`KERAS_BACKEND=tensorflow` or to write the layer as a `gradoverride.keras.Layer` (or "
    "the gradient with `go.custom_backward` on its tensors).",
    match=r"runs on Keras' '(jax|torch)' backend; gradoverride supports Keras layers on the "
    r"TensorFlow backend only for installing a rule or a hook on an existing layer\. Set "
    r"KERAS_BACKEND=tensorflow .* write the layer as a `gradoverride\.keras\.Layer` "
    r"subclass",
)

#: The refused Keras-backend cells, by (kind, backend).
KERAS_BACKEND_REFUSED: dict[tuple[str, str], Refusal] = {
    (kind, backend): _KERAS_MODULE_SIDE
    for kind in ("override_backward", "grad_hook") for backend in ("jax", "torch")
}


def _cell(kind: str, context: str) -> str:
    refusal = REFUSED.get((kind, context))
    if refusal is not None:
        return "refused ¹" if context == "torch.jit.script" else "refused"
    if (kind, context) in DEFECTS:
        return "**wrong** †"
    return "yes *" if (kind, context) in NOTES else "yes"


def _grid(
    kinds: tuple[tuple[str, str], ...],
    contexts: tuple[tuple[str, str], ...],
    cell: Callable[[str, str], str],
    kinds_title: str,
    contexts_title: str,
) -> list[str]:
    """A table of kinds by contexts, then what each kind and context is."""
    keys = [key for key, _ in contexts]
    lines = ["| op kind | " + " | ".join(keys) + " |",
             "| --- | " + " | ".join("---" for _ in keys) + " |"]
    lines += [f"| {kind} | " + " | ".join(cell(kind, key) for key in keys) + " |"
              for kind, _ in kinds]
    lines += ["", kinds_title, ""]
    lines += [f"- **{kind}**: {text}." for kind, text in kinds]
    lines += ["", contexts_title, ""]
    lines += [f"- **{key}**: {text}." for key, text in contexts]
    return lines


def markdown() -> str:
    """The support matrix as a Markdown page."""
    lines = [
        "# Support matrix",
        "",
        "<!-- Generated by `python -m gradoverride._support_matrix docs/support-matrix.md` "
        "from gradoverride/_support_matrix.py; do not edit. -->",
        "",
        "Every op kind under every context. **yes**: supported, and tested to give the same "
        "gradients as eager mode (itself tested against an independent computation). "
        "**refused**: the call raises the error given below, with the reason and the fix in "
        "its message. **wrong** †: a known defect, a wrong result without an error (see "
        "below). The test suite runs one test per cell (`tests/test_support_matrix.py`).",
        "",
    ]
    lines += _grid(KINDS, CONTEXTS, _cell, "## Op kinds", "## Contexts")
    lines += ["", "## Refused cells", ""]
    seen: dict[Refusal, list[str]] = {}
    for (kind, context), refusal in REFUSED.items():
        seen.setdefault(refusal, []).append(f"{kind} in {context}")
    for refusal, cells in seen.items():
        where = "every kind in torch.jit.script (¹)" if refusal is _SCRIPT else "; ".join(cells)
        lines.append(f"- {where}: `{refusal.error}`. {refusal.reason}")
    for title, texts in (("Known defects (†)", DEFECTS), ("Notes (*)", NOTES)):
        lines += ["", f"## {title}", ""]
        grouped: dict[str, list[str]] = {}
        for (kind, context), text in texts.items():
            grouped.setdefault(text, []).append(f"{kind} in {context}")
        lines += [f"- {'; '.join(cells)}: {text}" for text, cells in grouped.items()]
    lines += [
        "",
        "## go.monitor in other contexts",
        "",
        "The `go.monitor` column runs each op kind eagerly under the monitor. The monitor "
        "itself records eager steps only: a step compiled with `torch.compile` runs (with "
        "no graph break and its own gradients) but is not recorded, and `go.monitor` of a "
        "compiled model raises, saying to monitor the eager model; steps under `torch.func` "
        "transforms are not recorded either. Under DistributedDataParallel each process "
        "records its own replica's gradients. Saving or copying a model while it is "
        "monitored carries nothing of the monitor. See the Diagnostics page.",
        "",
        "## Deployment paths",
        "",
        "`torch.export`, AOTInductor, both ONNX exporters and `torch.jit.trace` record the "
        "forward for inference: the graph they produce has no backward, so no rule applies "
        "there, and the exported forward is the op's forward (a straight-through round "
        "exports as a round); each column checks that the deployed model gives the module's "
        "outputs, on the input it was exported with and on other values of that shape. "
        "Each deploys the module in eval mode (`module.eval()`), as a trained model is "
        "shipped. Export a trained model for inference; train with eager mode or "
        "`torch.compile`. The "
        "ONNX columns need the `onnx`, `onnxruntime` and (for `dynamo=True`) `onnxscript` "
        "packages (`pip install 'gradoverride[export]'`), and AOTInductor a C++ compiler; "
        "the tests skip those cells, saying why, where one is missing. See the Deploying "
        "page.",
        "",
        *_tensorflow_markdown(),
        *_jax_markdown(),
        *_keras_backends_markdown(),
    ]
    return "\n".join(lines)


def _tf_cell(kind: str, context: str) -> str:
    cell = (kind, context)
    if cell in TF_REFUSED:
        return "refused"
    if cell in TF_NOT_APPLICABLE:
        return "n/a"
    if cell in TF_DEFECTS:
        return "**wrong** †"
    if cell in TF_WARNS:
        return "warns"
    return "yes *" if cell in TF_NOTES else "yes"


def _tensorflow_markdown() -> list[str]:
    """The TensorFlow and Keras section of the page."""
    lines = [
        "## TensorFlow and Keras",
        "",
        "Every TensorFlow op kind under every TensorFlow context. An op (a `custom_backward`, "
        "a recipe, a bridge) runs inside a small Keras layer, on `x * scale` with `scale` a "
        "variable, so that every context, `model.fit` included, differentiates the same "
        "thing; a layer kind is that layer. **yes**: supported, and tested to give the gradients "
        "worked out by hand. **refused**: the call raises the error given below. **warns**: "
        "it works and gives a `GradOverrideWarning`, for the reason below. **n/a**: the "
        "context does not apply to the kind. **wrong** †: a known defect, a wrong gradient "
        "without an error (see below). The test suite runs one test per cell "
        "(`tests/test_support_matrix_tensorflow.py`).",
        "",
    ]
    lines += _grid(TF_KINDS, TF_CONTEXTS, _tf_cell, "### Op kinds (TensorFlow)",
                   "### Contexts (TensorFlow)")
    for title, table in (("Refused cells (TensorFlow)", TF_REFUSED),
                         ("Cells that warn (TensorFlow)", TF_WARNS)):
        lines += ["", f"### {title}", ""]
        seen: dict[Refusal, list[str]] = {}
        for (kind, context), refusal in table.items():
            seen.setdefault(refusal, []).append(f"{kind} in {context}")
        lines += [f"- {'; '.join(cells)}: `{refusal.error}`. {refusal.reason}"
                  for refusal, cells in seen.items()]
    for title, texts in (("Known defects (†)", TF_DEFECTS),
                         ("Not applicable (TensorFlow)", TF_NOT_APPLICABLE),
                         ("Notes (TensorFlow, *)", TF_NOTES)):
        if not texts:
            continue
        lines += ["", f"### {title}", ""]
        grouped: dict[str, list[str]] = {}
        for (kind, context), text in texts.items():
            grouped.setdefault(text, []).append(f"{kind} in {context}")
        lines += [f"- {'; '.join(cells)}: {text}" for text, cells in grouped.items()]
    lines.append("")
    return lines


def _jax_cell(kind: str, context: str) -> str:
    if (kind, context) in JAX_REFUSED:
        return "refused"
    return "yes *" if (kind, context) in JAX_NOTES else "yes"


def _jax_markdown() -> list[str]:
    """The JAX section of the page."""
    lines = [
        "## JAX",
        "",
        "Every JAX op kind under every JAX context, each op on `x * w` differentiated with "
        "respect to `x`. **yes**: supported, and tested to give the gradients worked out by "
        "hand. **refused**: the call raises the error given below. The test suite runs one "
        "test per cell (`tests/test_support_matrix_jax.py`).",
        "",
    ]
    lines += _grid(JAX_KINDS, JAX_CONTEXTS, _jax_cell, "### Op kinds (JAX)", "### Contexts (JAX)")
    lines += ["", "### Refused cells (JAX)", ""]
    lines += [f"- {kind} in {context}: `{refusal.error}`. {refusal.reason}"
              for (kind, context), refusal in JAX_REFUSED.items()]
    lines += ["", "### Notes (JAX, *)", ""]
    grouped: dict[str, list[str]] = {}
    for (kind, context), text in JAX_NOTES.items():
        grouped.setdefault(text, []).append(f"{kind} in {context}")
    lines += [f"- {'; '.join(cells)}: {text}" for text, cells in grouped.items()]
    lines.append("")
    return lines


def _keras_backends_markdown() -> list[str]:
    """The Keras-backend section of the page."""
    lines = [
        "## Keras 3 backends",
        "",
        "`gradoverride.keras` by Keras backend. **yes**: supported, and tested to give the "
        "gradients (and the `fit` step) worked out by hand; **refused**: the call raises the "
        "error given below. The JAX and torch columns run in `tests/test_keras_backends.py`; "
        "the TensorFlow column is the TensorFlow table above.",
        "",
    ]

    def cell(kind: str, backend: str) -> str:
        return "refused" if (kind, backend) in KERAS_BACKEND_REFUSED else "yes"

    lines += _grid(KERAS_BACKEND_KINDS, KERAS_BACKENDS, cell, "### Kinds (Keras)",
                   "### Backends (Keras)")
    lines += ["", "### Refused cells (Keras)", ""]
    seen: dict[Refusal, list[str]] = {}
    for (kind, backend), refusal in KERAS_BACKEND_REFUSED.items():
        seen.setdefault(refusal, []).append(f"{kind} on {backend}")
    lines += [f"- {'; '.join(cells)}: `{refusal.error}`. {refusal.reason}"
              for refusal, cells in seen.items()]
    lines.append("")
    return lines


if __name__ == "__main__":  # pragma: no cover - the docs page's generator
    text = markdown()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as page:
            page.write(text)
    else:
        print(text)
