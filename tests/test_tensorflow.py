"""`custom_backward` and `straight_through` on TensorFlow tensors (DESIGN §2.8, issue 7).

The ops here are written with Python operators only, so one decorated op (one forward, one
rule) serves both frameworks; each test compares TensorFlow's three modes (eager,
`tf.function`, XLA) against torch on the same inputs. Then every TensorFlow trap the issue
names: variables read by the forward (their order differs between eager and graph mode),
Python numbers under `tf.function`, `IndexedSlices`, gradients of the wrong shape or dtype
(TensorFlow checks neither), and `tf.function`'s `__wrapped__` default-argument trap.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from tf_support import MODES, gradients, in_mode, tf

import gradoverride as go

# ---- ops written once, for both frameworks ------------------------------------------------


@go.custom_backward
def cube(x: Any) -> Any:
    return x * x * x


@cube.backward
def _(grad: Any, *, x: Any) -> Any:
    return grad * 2 * x  # not the true derivative (3x²), so the rule is visible


@go.custom_backward(owns="x")
def scale(x: Any, w: Any) -> Any:
    """Partial override: the rule owns `x`; `w` keeps its ordinary gradient (grad * x)."""
    return x * w


@scale.backward
def _(grad: Any, *, w: Any) -> Any:
    return grad * 2 * w


@go.custom_backward
def pair(xs: Any, *, shift: float = 0.0) -> Any:
    """A container input, and a Python number that must not become a gradient slot."""
    a, b = xs
    return a * b + shift


@pair.backward
def _(grad: Any, *, xs: Any) -> Any:
    a, b = xs
    return {"xs": (grad * b * 3, grad * a)}


@go.custom_backward
def sin_cos(x: Any) -> Any:
    """Two outputs: the rule takes two upstream gradients and names `output`."""
    return x * 2, x * 3


@sin_cos.backward
def _(g1: Any, g2: Any, *, output: Any) -> Any:
    first, _ = output
    return g1 * first + g2


@go.custom_backward(residuals="twice")
def with_residual(x: Any) -> Any:
    twice = x * 2
    return twice * x, {"twice": twice}


@with_residual.backward
def _(grad: Any, *, twice: Any) -> Any:
    return grad * twice * 5


@go.custom_backward
def bias_add(x: Any, b: Any) -> Any:
    """The rule returns the batch gradient for `b`, summed down to `b`'s shape."""
    return x + b


@bias_add.backward
def _(grad: Any) -> Any:
    return grad, grad * 3  # (4, 3) for `b` of shape (3,)


@go.custom_backward
def weighted(x: Any, w: Any, *, power: int = 2) -> Any:
    return x * w


@weighted.backward
def _(grad: Any, *, x: Any, w: Any, needs_grad: Any) -> Any:
    return (
        grad * w * 7 if needs_grad["x"] else None,
        grad * x if needs_grad["w"] else None,
        None,
    )


def _torch_gradients(fn: Any, *arrays: np.ndarray) -> tuple[np.ndarray, list[Any]]:
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = fn(*tensors)
    weights = torch.arange(1, out.numel() + 1, dtype=out.dtype).reshape(out.shape) / out.numel()
    grads = torch.autograd.grad((out * weights).sum(), tensors, allow_unused=True)
    return out.detach().numpy(), [None if g is None else g.numpy() for g in grads]


def _tf_gradients(fn: Any, *arrays: np.ndarray, mode: str) -> tuple[np.ndarray, list[Any]]:
    out, grads = gradients(fn, *(tf.constant(a) for a in arrays), mode=mode)
    return out.numpy(), [None if g is None else g.numpy() for g in grads]


def _assert_same(fn: Any, *arrays: np.ndarray, mode: str) -> None:
    torch_out, torch_grads = _torch_gradients(fn, *arrays)
    tf_out, tf_grads = _tf_gradients(fn, *arrays, mode=mode)
    np.testing.assert_allclose(tf_out, torch_out, rtol=1e-6)
    for t, g in zip(torch_grads, tf_grads, strict=True):
        assert (t is None) == (g is None)
        if t is not None:
            np.testing.assert_allclose(g, t, rtol=1e-5, atol=1e-6)


_RNG = np.random.default_rng(0)
X = _RNG.standard_normal((4, 3)).astype(np.float32)
W = _RNG.standard_normal((4, 3)).astype(np.float32)
B = _RNG.standard_normal(3).astype(np.float32)

_SAME_RULE_CASES = {
    "tensor return": (lambda x: cube(x), (X,)),
    "partial override": (lambda x, w: scale(x, w), (X, W)),
    "container input and a Python number": (lambda a, b: pair((a, b), shift=0.5), (X, W)),
    "two outputs and `output`": (lambda x: sum_outputs(sin_cos(x)), (X,)),
    "residuals": (lambda x: with_residual(x), (X,)),
    "broadcast gradient summed down": (lambda x, b: bias_add(x, b), (X, B)),
    "needs_grad and a keyword-only int": (lambda x, w: weighted(x, w, power=3), (X, W)),
}


def sum_outputs(outputs: Any) -> Any:
    first, second = outputs
    return first + second * 2


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(_SAME_RULE_CASES))
def test_one_op_gives_the_same_gradients_in_torch_and_in_every_tensorflow_mode(
    case: str, mode: str
) -> None:
    fn, arrays = _SAME_RULE_CASES[case]
    _assert_same(fn, *arrays, mode=mode)


def test_the_rule_is_what_runs_not_the_true_derivative() -> None:
    # Guards the parity test above against both sides silently using the true gradient.
    _, (grad,) = _tf_gradients(cube, X, mode="eager")
    weights = np.arange(1, X.size + 1, dtype=np.float32).reshape(X.shape) / X.size
    np.testing.assert_allclose(grad, weights * 2 * X, rtol=1e-6)


# ---- straight_through ----------------------------------------------------------------------


def _straight_through_pair(**options: Any) -> tuple[Any, Any]:
    torch_op = go.straight_through(**options)(lambda x: torch.sign(x))
    tf_options = dict(options)
    if "surrogate" in options:
        tf_options["surrogate"] = tf.tanh
    if "derivative" in options:
        tf_options["derivative"] = lambda x: 1 - tf.tanh(x) ** 2
    tf_op = go.straight_through(**tf_options)(lambda x: tf.sign(x))
    return torch_op, tf_op


_EDGES = np.array([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5], dtype=np.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"clip": 1.0},
        {"clip": (-0.5, 1.0), "keep": "mask"},
        {"surrogate": torch.tanh},
        {"derivative": lambda x: 1 - torch.tanh(x) ** 2, "clip": 1.0},
        {"clip": 1.0, "inclusive": False},
        {"clip": (-0.5, 1.0), "inclusive": (True, False), "keep": "mask"},
        {"clip": (-0.5, 1.0), "inclusive": (False, True)},
        {"derivative": lambda x: 1 - torch.tanh(x) ** 2, "clip": 1.0, "inclusive": False},
    ],
    ids=["identity", "clip", "clip-mask", "surrogate", "derivative-clip", "open",
         "closed-open-mask", "open-closed", "derivative-open"],
)
def test_straight_through_matches_torch(options: dict[str, Any], mode: str) -> None:
    torch_op, tf_op = _straight_through_pair(**options)
    torch_out, torch_grads = _torch_gradients(torch_op, _EDGES)
    tf_out, tf_grads = _tf_gradients(tf_op, _EDGES, mode=mode)
    np.testing.assert_array_equal(tf_out, torch_out)
    np.testing.assert_allclose(tf_grads[0], torch_grads[0], rtol=1e-5, atol=1e-7)


def test_straight_through_surrogate_in_torch_ops_on_a_tensorflow_tensor_says_so() -> None:
    op = go.straight_through(surrogate=torch.tanh)(lambda x: tf.sign(x))
    x = tf.constant([0.5])
    with tf.GradientTape() as tape, pytest.raises(TypeError) as info:
        tape.watch(x)
        y = op(x)
        tape.gradient(y, x)
    assert "write the surrogate in TensorFlow ops" in "".join(info.value.__notes__)


# ---- variables --------------------------------------------------------------------------------

_w = tf.Variable([1.0, 2.0, 3.0], name="w")
_v = tf.Variable([0.5, -1.0, 2.0], name="alpha")


@go.custom_backward
def reads_variables(x: Any) -> Any:
    return x * _w + _v


@reads_variables.backward
def _(grad: Any, *, x: Any) -> Any:
    # Distinct factors, so a gradient delivered to the wrong variable shows.
    return {"x": grad * _w, "w": grad * x * 10, "alpha": grad * 100}


@pytest.mark.parametrize("mode", MODES)
def test_variables_read_by_the_forward_get_their_gradients_by_name(mode: str) -> None:
    # Eager and graph mode pass `variables=` in different orders; by name they match.
    x = tf.constant([1.0, -2.0, 0.5])

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(reads_variables(x))
        return tape.gradient(loss, [x, _w, _v])

    gx, gw, gv = in_mode(step, mode)(x)
    np.testing.assert_allclose(gx.numpy(), _w.numpy())
    np.testing.assert_allclose(gw.numpy(), x.numpy() * 10)
    np.testing.assert_allclose(gv.numpy(), [100.0, 100.0, 100.0])


def test_a_keras_weight_is_addressed_by_its_short_name() -> None:
    import keras

    layer = keras.layers.Dense(2, use_bias=False, name="proj")
    layer.build((None, 3))

    @go.custom_backward
    def project(x: Any) -> Any:
        return layer(x)

    @project.backward
    def _(grad: Any, *, x: Any) -> Any:
        return {"x": tf.matmul(grad, layer.kernel, transpose_b=True), "kernel": tf.ones((3, 2))}

    x = tf.constant(X[:2])
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(project(x))
    gx, gk = tape.gradient(loss, [x, layer.kernel])
    np.testing.assert_allclose(gk.numpy(), np.ones((3, 2)))
    assert gx.shape == (2, 3)


def test_a_missing_variable_gradient_names_the_variable_and_the_fixes() -> None:
    @go.custom_backward
    def forgets(x: Any) -> Any:
        return x * _w

    @forgets.backward
    def _(grad: Any, *, x: Any) -> Any:
        return {"x": grad}

    x = tf.constant([1.0, 2.0, 3.0])
    with tf.GradientTape() as tape, pytest.raises(
        go.GradOverrideError,
        match=r"backward of `.*forgets` returned a dict without `w`, a variable its forward "
        r"reads; add \{'w': gradient\} .* or pass `owns=`",
    ):
        tape.watch(x)
        tape.gradient(forgets(x), x)


def test_a_tensor_return_with_variables_read_asks_for_a_dict() -> None:
    @go.custom_backward
    def plain(x: Any) -> Any:
        return x * _w

    @plain.backward
    def _(grad: Any) -> Any:
        return grad

    x = tf.constant([1.0, 2.0, 3.0])
    with tf.GradientTape() as tape, pytest.raises(
        go.GradOverrideError, match=r"reads the variables `w`, so its backward must return"
    ):
        tape.watch(x)
        tape.gradient(plain(x), x)


def test_partial_ownership_leaves_variables_their_tensorflow_gradient() -> None:
    @go.custom_backward(owns="x")
    def partial(x: Any) -> Any:
        return x * _w

    @partial.backward
    def _(grad: Any) -> Any:
        return grad * 5

    x = tf.constant([1.0, 2.0, 3.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(partial(x))
    gx, gw = tape.gradient(loss, [x, _w])
    np.testing.assert_allclose(gx.numpy(), [5.0, 5.0, 5.0])
    np.testing.assert_allclose(gw.numpy(), x.numpy())  # the true gradient


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_variables_passed_as_arguments_get_their_gradient(mode: str) -> None:
    import keras

    keras_weight = keras.Variable(np.ones(3, np.float32) * 2)

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(scale(x, keras_weight)) + tf.reduce_sum(cube(_w))
        return tape.gradient(loss, [x, keras_weight.value, _w])

    x = tf.Variable([1.0, 2.0, 3.0])
    gx, gk, gw = in_mode(step, mode)(x)
    np.testing.assert_allclose(gx.numpy(), [4.0, 4.0, 4.0])  # the rule: grad * 2 * w
    np.testing.assert_allclose(gk.numpy(), x.numpy())  # not owned: the true gradient
    np.testing.assert_allclose(gw.numpy(), 2 * _w.numpy())  # cube's rule


# ---- the other TensorFlow traps ---------------------------------------------------------------


def test_a_decorated_op_as_a_tf_function_default_argument_keeps_its_gradient() -> None:
    # tf.function replaces an argument that has `__wrapped__` by the wrapped function; the
    # op declares its own trace type so it stays itself (see gradoverride/_tensorflow/_tracing).
    @tf.function
    def step(x: Any, f: Any = cube) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(f(x))
        return tape.gradient(loss, x)

    x = tf.constant([1.0, 2.0])
    np.testing.assert_allclose(step(x).numpy(), 2 * x.numpy())  # the rule, not 3x²
    np.testing.assert_allclose(step(x, cube).numpy(), 2 * x.numpy())
    assert cube.__wrapped__ is not None  # still there for everyone else


@pytest.mark.parametrize("mode", MODES)
def test_a_python_number_needs_no_gradient_slot(mode: str) -> None:
    # tf.custom_gradient would make `0.5` a tensor under tf.function and want a gradient
    # for it; here the rule's `return grad_x, None` is all it takes.
    @go.custom_backward
    def shifted(x: Any, shift: float) -> Any:
        return x + shift

    @shifted.backward
    def _(grad: Any) -> Any:
        return grad * 3, None

    _, (grad,) = _tf_gradients(lambda x: shifted(x, 0.5), B, mode=mode)
    np.testing.assert_allclose(grad, 3 * np.arange(1, 4) / 3, rtol=1e-6)


def test_a_gradient_for_a_python_number_is_an_error() -> None:
    @go.custom_backward
    def shifted(x: Any, shift: float) -> Any:
        return x + shift

    @shifted.backward
    def _(grad: Any) -> Any:
        return grad, grad

    x = tf.constant(B)
    with tf.GradientTape() as tape, pytest.raises(
        go.GradOverrideError,
        match=r"returned a gradient for `shift`, which takes no gradient in this call",
    ):
        tape.watch(x)
        tape.gradient(shifted(x, 0.5), x)


def test_an_integer_tensor_gets_no_gradient_and_no_slot() -> None:
    @go.custom_backward
    def gather_rows(x: Any, index: Any) -> Any:
        return tf.gather(x, index)

    @gather_rows.backward
    def _(grad: Any, *, x: Any, index: Any) -> Any:
        return tf.scatter_nd(index[:, None], grad, tf.shape(x)), None

    x = tf.constant(X)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(gather_rows(x, tf.constant([0, 2])))
    grad = tape.gradient(loss, x).numpy()
    np.testing.assert_array_equal(grad[[0, 2]], 1.0)
    np.testing.assert_array_equal(grad[[1, 3]], 0.0)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_indexed_slices_are_dense_before_the_rule_sees_them(mode: str) -> None:
    seen: list[type] = []

    @go.custom_backward
    def doubled(x: Any) -> Any:
        return x * 2

    @doubled.backward
    def _(grad: Any) -> Any:
        seen.append(type(grad))
        # Rows 0..3 as IndexedSlices, without a dense shape: made dense on return.
        return tf.IndexedSlices(grad, tf.range(tf.shape(grad)[0]))

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.gather(doubled(x), [1]))
        return tape.gradient(loss, x)

    grad = in_mode(step, mode)(tf.constant(X)).numpy()
    assert seen and all(issubclass(t, tf.Tensor) for t in seen)
    np.testing.assert_array_equal(grad[1], 1.0)
    np.testing.assert_array_equal(grad[[0, 2, 3]], 0.0)


def test_an_unused_output_sends_the_rule_zeros() -> None:
    received: list[Any] = []

    @go.custom_backward
    def two(x: Any) -> Any:
        return x * 2, x * 3

    @two.backward
    def _(g1: Any, g2: Any) -> Any:
        received.append(g2)
        return g1 + g2

    x = tf.constant(B)
    with tf.GradientTape() as tape:
        tape.watch(x)
        first, _ = two(x)
        loss = tf.reduce_sum(first)
    tape.gradient(loss, x)
    np.testing.assert_array_equal(received[0].numpy(), np.zeros(3))


def test_a_builtin_tensorflow_function_takes_a_rule() -> None:
    sign = go.custom_backward(tf.sign, backward=lambda grad: grad * 4)
    x = tf.constant([-1.0, 0.5])
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(sign(x))
    np.testing.assert_array_equal(tape.gradient(loss, x).numpy(), [4.0, 4.0])


# ---- errors: the same class and text as in torch ------------------------------------------------


def _torch_error(op: Any, *args: Any) -> str:
    inputs = [torch.tensor(a, requires_grad=True) for a in args]
    with pytest.raises(go.GradOverrideError) as info:
        op(*inputs).sum().backward()
    return str(info.value)


def _tf_error(op: Any, *args: Any, mode: str = "eager") -> str:
    def step(*xs: Any) -> Any:
        with tf.GradientTape() as tape:
            for x in xs:
                tape.watch(x)
            loss = tf.reduce_sum(op(*xs))
        return tape.gradient(loss, list(xs))

    with pytest.raises(go.GradOverrideError) as info:
        in_mode(step, mode)(*(tf.constant(a) for a in args))
    return str(info.value)


def _wrong_shape(grad: Any) -> Any:
    return grad[:2]


def _integer(grad: Any) -> Any:
    return grad > 0


def _too_many(grad: Any) -> Any:
    return grad, grad, grad


def _unknown_name(grad: Any) -> Any:
    return {"x": grad, "y": grad}


def _missing_name(grad: Any) -> Any:
    return {}


_MISTAKES = {
    "wrong shape": (_wrong_shape, r"returned a gradient of shape \(2, 3\) for `x`, which has "
                    r"shape \(4, 3\)"),
    "integer dtype": (_integer, r"returned a gradient of dtype (torch\.)?bool for `x`, which "
                      r"has dtype (torch\.)?float32; a gradient must be a floating-point tensor"),
    "tuple length": (_too_many, r"returned 3 gradients, but `.*` has 1 parameters \(x\)"),
    "unknown name": (_unknown_name, r"returned a gradient for `y`, which is not a parameter"),
    "missing name": (_missing_name, r"returned a dict without `x`, which it owns"),
}


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("mistake", sorted(_MISTAKES))
def test_a_mistake_reads_the_same_in_torch_and_tensorflow(mistake: str, mode: str) -> None:
    rule, pattern = _MISTAKES[mistake]

    def forward(x: Any) -> Any:
        return x * 1

    op = go.custom_backward(forward, backward=rule)
    torch_text = _torch_error(op, X)
    tf_text = _tf_error(op, X, mode=mode)
    assert re_search(pattern, torch_text)
    assert re_search(pattern, tf_text)
    # The same sentence, apart from how each framework spells a dtype. Under tf.function,
    # TensorFlow puts the traced frames before an error's message ("in user code: ...").
    expected = torch_text.replace("torch.", "").replace("`.to(x.dtype)`",
                                                        "`tf.cast(grad, x.dtype)`")
    assert tf_text.strip().endswith(expected)


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def test_a_rule_that_raises_is_reraised_with_the_op_named() -> None:
    @go.custom_backward
    def fails(x: Any) -> Any:
        return x * 1

    @fails.backward
    def broken(grad: Any) -> Any:
        raise ValueError("inside the rule")

    x = tf.constant(B)
    with tf.GradientTape() as tape, pytest.raises(ValueError, match="inside the rule") as info:
        tape.watch(x)
        tape.gradient(fails(x), x)
    assert "(raised in backward rule `" in "".join(info.value.__notes__)
    assert "broken` of `" in "".join(info.value.__notes__)


def test_the_wrong_number_of_upstream_gradients_is_a_type_error_at_forward() -> None:
    @go.custom_backward
    def two(x: Any) -> Any:
        return x * 2, x * 3

    @two.backward
    def _(grad: Any) -> Any:
        return grad

    with pytest.raises(go.GradOverrideTypeError, match=r"takes 1 upstream gradient\(s\), but "):
        two(tf.constant(B))


# ---- higher order ---------------------------------------------------------------------------


def test_a_rule_in_differentiable_ops_has_a_second_derivative() -> None:
    x = tf.constant([1.0, -2.0])
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            y = tf.reduce_sum(cube(x))
        first = inner.gradient(y, x)  # the rule: 2x
    np.testing.assert_allclose(outer.gradient(first, x).numpy(), [2.0, 2.0])


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_once_differentiable_raises_on_a_second_derivative(mode: str) -> None:
    op = go.custom_backward(
        lambda x: x * x * x, backward=lambda grad, *, x: grad * 3 * x * x,
        once_differentiable=True,
    )

    def step(x: Any) -> Any:
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                y = tf.reduce_sum(op(x))
            first = inner.gradient(y, x)
        return first, outer.gradient(first, x)

    with pytest.raises(go.GradOverrideError, match="runs without recording a graph"):
        in_mode(step, mode)(tf.constant([1.0, 2.0]))

    # A first derivative alone is fine.
    x = tf.constant([1.0, 2.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = tf.reduce_sum(op(x))
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), [3.0, 12.0])


# ---- dtypes -------------------------------------------------------------------------------


def test_a_float64_gradient_is_cast_to_a_float16_input() -> None:
    @go.custom_backward
    def half(x: Any) -> Any:
        return x * 1

    @half.backward
    def _(grad: Any) -> Any:
        return tf.cast(grad, tf.float64) * 2

    x = tf.constant([1.0, 2.0], dtype=tf.float16)
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(half(x))
    grad = tape.gradient(loss, x)
    assert grad.dtype == tf.float16
    np.testing.assert_array_equal(grad.numpy(), [2.0, 2.0])


def test_torch_calls_are_unchanged_after_tensorflow_was_used() -> None:
    _tf_gradients(cube, X, mode="eager")
    x = torch.tensor(X, requires_grad=True)
    cube(x).sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, 2 * x.detach())


def test_autograph_leaves_the_op_alone() -> None:
    # The op's entry point is marked as AutoGraph's own (see CustomBackward): a tf.function
    # calls it as plain Python instead of rewriting gradoverride's internals.
    from tensorflow.python.autograph.impl.api import is_autograph_artifact

    assert is_autograph_artifact(cube)
    assert is_autograph_artifact(go.straight_through(lambda x: tf.sign(x)))


def test_torch_and_tensorflow_tensors_in_one_call_is_a_type_error() -> None:
    with pytest.raises(
        go.GradOverrideTypeError,
        match=r"`.*scale` got a torch tensor for `w` in a call with TensorFlow tensors",
    ):
        scale(tf.constant(B), torch.tensor(B))


@pytest.mark.parametrize("mode", ["eager", "xla"])
def test_a_shape_changing_straight_through_is_an_error_not_a_wrong_gradient(mode: str) -> None:
    # tf.grad_pass_through hands back the upstream gradient whatever its shape; the same
    # mistake here names both shapes.
    row_sums = go.straight_through(lambda x: tf.reduce_sum(x, axis=1))
    with pytest.raises(
        go.GradOverrideError,
        match=r"returned a gradient of shape \(4,\) for `x`, which has shape \(4, 3\)",
    ):
        _tf_gradients(row_sums, X, mode=mode)


@pytest.mark.compile
# Dynamo itself instantiates the Function base class when it traces a Function (torch 2.13).
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")
def test_torch_compile_of_an_op_is_unaffected_by_tensorflow_being_imported() -> None:
    # With TensorFlow in sys.modules, the dispatch check must still be invisible to dynamo
    # (a float argument takes the general path, which checks every argument).
    assert "tensorflow" in __import__("sys").modules
    compiled = torch.compile(
        lambda a, b: pair((a, b), shift=0.5), fullgraph=True, backend="aot_eager"
    )
    a = torch.tensor(B, requires_grad=True)
    b = torch.tensor(-B, requires_grad=True)
    compiled(a, b).sum().backward()
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad, 3 * b.detach())  # the rule: (3 * grad * b, grad * a)
    torch.testing.assert_close(b.grad, a.detach())


def test_the_gradient_function_keeps_only_what_the_rule_names() -> None:
    # The gradient function lives as long as the tape, and what it references stays alive.
    # TensorFlow's own custom_gradient keeps the inputs and the forward's result anyway; a
    # residual the rule does not name must not be kept on top of that. (Residual tensors
    # reach the rule through `tf.stop_gradient`, so numpy residuals are what a weak
    # reference can follow here.)
    import gc
    import weakref

    refs: dict[str, Any] = {}

    @go.custom_backward(residuals=("big", "small"))
    def forward(x: Any) -> Any:
        big, small = np.zeros(100_000, np.float32), np.float32(2.0) * np.ones(3, np.float32)
        refs.update(big=weakref.ref(big), small=weakref.ref(small))
        return x * 2, {"big": big, "small": small}

    @forward.backward
    def _(grad: Any, *, small: Any) -> Any:
        return grad * small

    x = tf.constant(B)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = forward(x)
        gc.collect()
        alive = {name: ref() is not None for name, ref in refs.items()}
    np.testing.assert_allclose(tape.gradient(y, x).numpy(), np.full(3, 2.0))
    assert alive == {"big": False, "small": True}


# ---- found in review: each of these was wrong once ---------------------------------------------


def test_two_variables_with_one_name_are_an_error_not_one_gradient_twice() -> None:
    first = tf.Variable([1.0, 2.0], name="twin")
    second = tf.Variable([10.0, 20.0], name="twin")
    op = go.custom_backward(
        lambda x: x * first + x * second, backward=lambda grad, *, x: {"x": grad, "twin": grad}
    )
    x = tf.constant([1.0, 1.0])
    with tf.GradientTape() as tape, pytest.raises(
        go.GradOverrideError, match=r"reads 2 variables named `twin`, so their gradients cannot"
    ):
        tape.watch(x)
        tape.gradient(op(x), x)


def test_none_for_a_variable_means_no_gradient() -> None:
    op = go.custom_backward(lambda x: x * _w, backward=lambda grad, *, x: {"x": grad, "w": None})
    x = tf.constant([1.0, 2.0, 3.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(op(x))
    gx, gw = tape.gradient(loss, [x, _w])
    np.testing.assert_array_equal(gx.numpy(), [1.0, 1.0, 1.0])
    assert gw is None


def test_a_variable_named_like_a_parameter_is_addressed_by_its_tensorflow_name() -> None:
    # `w` is a parameter of the op, and the variable `_w` its forward reads is named "w" too:
    # the key "w" is the parameter's, "w:0" the variable's.
    w = tf.Variable([1.0, 2.0, 3.0], name="weight")
    op = go.custom_backward(lambda x, w: x * _w * w, backward=lambda grad, *, w: {
        "x": grad, "w": grad, "w:0": grad * 7})
    x = tf.constant([1.0, 1.0, 1.0])
    with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(op(x, w))
    gx, gw, g_read = tape.gradient(loss, [x, w, _w])
    np.testing.assert_array_equal(gx.numpy(), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(g_read.numpy(), [7.0, 7.0, 7.0])
    np.testing.assert_array_equal(gw.numpy(), [1.0, 1.0, 1.0])


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_a_wrong_shape_with_unknown_dimensions_names_both_shapes(mode: str) -> None:
    op = go.custom_backward(lambda x: x * 2, backward=lambda grad: grad[:, :2])

    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(op(x))
        return tape.gradient(loss, x)

    traced = tf.function(step, input_signature=[tf.TensorSpec([None, 3])],
                         jit_compile=mode == "xla")
    with pytest.raises(
        go.GradOverrideError,
        match=r"returned a gradient of shape \(None, 2\) for `x`, which has shape \(None, 3\)",
    ):
        traced(tf.constant(X))


def test_a_mismatch_only_the_run_time_shapes_show_is_still_named() -> None:
    # (1, 3) against (None, 3) passes the static check; the run-time check catches it.
    op = go.custom_backward(
        lambda x: x * 2, backward=lambda grad: tf.reduce_sum(grad, 0, keepdims=True)
    )

    @tf.function(input_signature=[tf.TensorSpec([None, 3])])
    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(op(x))
        return tape.gradient(loss, x)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"returned a gradient of shape "
                       r"\(1, 3\) for `x`, which has shape \(None, 3\)"):
        step(tf.constant(X))
    # One row: the rule's gradient has the input's shape, and passes.
    np.testing.assert_array_equal(step(tf.constant(X[:1])).numpy(), np.ones((1, 3)))


@pytest.mark.parametrize(
    "call",
    [lambda op: op(3.0), lambda op: op(torch.tensor(3.0))],
    ids=["python-number", "torch-tensor"],
)
def test_a_tensorflow_result_from_a_call_without_tensorflow_arguments_is_an_error(
    call: Any,
) -> None:
    # The rule could never run: torch ran the call. Silently the true gradient, before.
    op = go.custom_backward(lambda scale: _w * scale, backward=lambda grad, *, scale: {})
    with pytest.raises(
        go.GradOverrideTypeError, match=r"returned a TensorFlow tensor from a call "
        r"gradoverride ran as a torch call"
    ):
        call(op)


def test_a_torch_tensor_first_and_a_tensorflow_tensor_second_is_an_error() -> None:
    op = go.custom_backward(lambda x, w: w * tf.constant(x.numpy()),
                            backward=lambda grad: (grad, grad))
    with pytest.raises(go.GradOverrideTypeError, match=r"ran as a torch call"):
        op(torch.tensor(B), tf.constant(B))


def _second_derivatives(op: Any, x: np.ndarray, w: np.ndarray) -> tuple[Any, Any]:
    torch_x = torch.tensor(x, requires_grad=True)
    torch_w = torch.tensor(w, requires_grad=True)
    (gx,) = torch.autograd.grad(op(torch_x, torch_w).sum(), torch_x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), torch_x)
    tf_x, tf_w = tf.constant(x), tf.constant(w)
    with tf.GradientTape() as outer:
        outer.watch(tf_x)
        with tf.GradientTape() as inner:
            inner.watch([tf_x, tf_w])
            loss = tf.reduce_sum(op(tf_x, tf_w))
        tf_gx = inner.gradient(loss, tf_x)
    return ggx.numpy(), outer.gradient(tf_gx, tf_x)


def test_partial_ownership_keeps_the_rules_second_derivative() -> None:
    @go.custom_backward(owns="x")
    def square_scale(x: Any, w: Any) -> Any:
        return x * x * w

    @square_scale.backward
    def _(grad: Any, *, x: Any, w: Any) -> Any:
        return grad * 2 * x * w * 10

    torch_second, tf_second = _second_derivatives(square_scale, B, -B)
    assert tf_second is not None
    np.testing.assert_allclose(tf_second.numpy(), torch_second, rtol=1e-6)


def test_a_rule_naming_output_has_torchs_second_derivative() -> None:
    @go.custom_backward
    def cubed(x: Any, w: Any) -> Any:
        return x * x * x * w

    @cubed.backward
    def _(grad: Any, *, output: Any) -> Any:
        return grad * output, None

    torch_second, tf_second = _second_derivatives(cubed, np.array([1.0, 3.0], np.float32),
                                                  np.ones(2, np.float32))
    np.testing.assert_allclose(tf_second.numpy(), torch_second, rtol=1e-6)
