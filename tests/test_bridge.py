"""`go.bridge`: numpy functions in a differentiable graph, with a numpy rule, central finite
differences or SPSA for the backward; conversions, errors, and what torch.compile does."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

import gradoverride as go

# ---- a smooth numpy function with several inputs and outputs, and its torch twin -------------


def field(x: Any, w: Any, k: float = 2.0, *, mode: str = "sin") -> tuple[Any, Any]:
    """Two outputs; `k` and `mode` are non-array arguments passed through."""
    assert mode == "sin" and isinstance(k, float)
    wave = np.sin(k * x) * w
    return wave, np.sum(x**2 * w, axis=-1)


def field_torch(x: torch.Tensor, w: torch.Tensor, k: float = 2.0) -> tuple[torch.Tensor, ...]:
    return torch.sin(k * x) * w, torch.sum(x**2 * w, dim=-1)


def field_batched(x: Any, w: Any, k: float = 2.0, *, mode: str = "sin") -> tuple[Any, Any]:
    """`field`, accepting a leading batch axis on either array argument."""
    wave = np.sin(k * x) * w
    return wave, np.sum(x**2 * w, axis=-1)


def _inputs(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(6, generator=gen, dtype=dtype).requires_grad_()
    return x, w


def _loss(outputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    wave, total = outputs
    return (wave * torch.arange(6, dtype=wave.dtype)).sum() + 3 * total


def _true_grads(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()
    return torch.autograd.grad(_loss(field_torch(xs, ws, 3.0)), (xs, ws))


# ---- forward -------------------------------------------------------------------------------


def test_forward_returns_tensors_on_the_inputs_device_and_dtype(device: torch.device) -> None:
    op = go.bridge(field, backward="finite_differences")
    x = torch.randn(6, device=device)  # float32; numpy computes in float32 too
    w = torch.randn(6, device=device, dtype=torch.float64)
    wave, total = op(x, w, 3.0, mode="sin")
    assert wave.device == x.device and total.device == x.device
    assert wave.dtype == torch.float64, "floating outputs take the promoted input dtype"
    expected_wave, expected_total = field_torch(x.double(), w, 3.0)
    torch.testing.assert_close(wave, expected_wave, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total, expected_total, rtol=1e-5, atol=1e-5)
    half = go.bridge(np.sin, backward="finite_differences")(torch.ones(3, dtype=torch.bfloat16))
    assert half.dtype == torch.bfloat16


def test_integer_outputs_and_containers() -> None:
    def argsort_and_total(xs: list[Any]) -> tuple[Any, Any]:
        return np.argsort(xs[0]), float(np.sum(xs[0] * xs[1]))

    op = go.bridge(argsort_and_total, backward="finite_differences")
    a = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    order, total = op([a, b])
    assert order.dtype == torch.int64 and order.tolist() == [1, 2, 0]
    assert not order.requires_grad
    assert total.dtype == torch.float64 and total.shape == ()
    total.backward()
    assert a.grad is not None and b.grad is not None
    torch.testing.assert_close(a.grad, b.detach())
    torch.testing.assert_close(b.grad, a.detach())


def test_fn_gets_read_only_arrays() -> None:
    def in_place(x: Any) -> Any:
        x += 1
        return x

    # The message (tested in test_bridge_hardening.py) names the function and the argument.
    with pytest.raises(go.GradOverrideError, match="read-only numpy array"):
        go.bridge(in_place, backward="finite_differences")(torch.zeros(2))


# ---- backward: a numpy rule ------------------------------------------------------------------


def test_numpy_rule() -> None:
    @go.bridge(backward=lambda grad, *, x: grad * np.cos(x))
    def sine(x: Any) -> Any:
        return np.sin(x)

    x = torch.linspace(-2, 2, 7, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(sine(x).sum(), x)
    torch.testing.assert_close(g, torch.cos(x.detach()))
    assert sine.__name__ == "sine"
    assert repr(sine) == (
        "<bridge test_numpy_rule.<locals>.sine(x: 'Any') -> 'Any', "
        "backward=test_numpy_rule.<locals>.<lambda>>"
    )


def test_rule_returning_a_dict_of_tensors_and_naming_output() -> None:
    def rule(g_wave: Any, g_total: Any, *, x: Any, w: Any, output: Any) -> dict[str, Any]:
        assert isinstance(g_wave, np.ndarray) and isinstance(output[0], np.ndarray)
        gx = g_wave * 3.0 * np.cos(3.0 * x) * w + g_total * 2 * x * w
        return {"x": torch.from_numpy(gx), "w": g_wave * np.sin(3.0 * x) + g_total * x**2,
                "k": None, "mode": None}

    op = go.bridge(field, backward=rule)
    x, w = _inputs()
    grads = torch.autograd.grad(_loss(op(x, w, 3.0)), (x, w))
    for got, expected in zip(grads, _true_grads(x, w), strict=True):
        torch.testing.assert_close(got, expected)


# ---- backward: finite differences ------------------------------------------------------------


def test_finite_differences_match_the_true_gradient_to_gradcheck_tolerance() -> None:
    op = go.bridge(field, backward="finite_differences")
    x, w = _inputs()
    grads = torch.autograd.grad(_loss(op(x, w, 3.0)), (x, w))
    for got, expected in zip(grads, _true_grads(x, w), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)  # gradcheck's
    assert torch.autograd.gradcheck(lambda a, b: op(a, b, 3.0), (x, w))


def test_vectorized_finite_differences_call_fn_once_per_input() -> None:
    calls = []

    def counted(x: Any, w: Any, k: float = 2.0) -> tuple[Any, Any]:
        calls.append((np.shape(x), np.shape(w)))
        return field_batched(x, w, k)

    op = go.bridge(counted, backward=go.finite_differences(vectorized=True))
    x, w = _inputs()
    grads = torch.autograd.grad(_loss(op(x, w, 3.0)), (x, w))
    for got, expected in zip(grads, _true_grads(x, w), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-5)
    assert calls == [((6,), (6,)), ((12, 6), (6,)), ((6,), (12, 6))]

    calls.clear()
    chunked = go.bridge(counted, backward=go.finite_differences(vectorized=True, batch_size=4))
    x, w = _inputs()
    (gx,) = torch.autograd.grad(_loss(chunked(x, w.detach(), 3.0)), x)
    torch.testing.assert_close(gx, _true_grads(x, w)[0], rtol=1e-3, atol=1e-5)
    assert [s[0] for s in calls[1:]] == [(8, 6), (4, 6)], "at most 2*4 perturbed per call"


def test_finite_differences_skip_inputs_that_need_no_gradient() -> None:
    calls = []

    def counted(x: Any, w: Any) -> Any:
        calls.append(1)
        return x * w

    op = go.bridge(counted, backward="finite_differences")
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(op(x, torch.ones(4, dtype=torch.float64)).sum(), x)
    assert len(calls) == 1 + 2 * 4
    torch.testing.assert_close(gx, torch.ones(4, dtype=torch.float64))


def test_finite_differences_step_option() -> None:
    op = go.bridge(lambda x: x**3, backward=go.finite_differences(step=0.1))
    x = torch.tensor([0.0], dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(op(x).sum(), x)
    # ((0.1)^3 - (-0.1)^3) / 0.2 = 0.01: the O(h^2) error of a large step, as the formula says.
    torch.testing.assert_close(g, torch.tensor([0.01], dtype=torch.float64))


# ---- backward: SPSA --------------------------------------------------------------------------


def _quadratic_form(x: Any) -> Any:
    """A smooth function of 16 inputs, vectorized over a leading axis."""
    weights = np.arange(1, 17) / 4.0
    return np.sum(np.sin(x) * weights + 0.1 * x**2, axis=-1)


def _spsa_grad(estimator: Any, x: torch.Tensor) -> torch.Tensor:
    op = go.bridge(_quadratic_form, backward=estimator)
    xs = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(op(xs), xs)
    return g


def test_spsa_reaches_the_true_gradient_direction_reproducibly() -> None:
    x = torch.linspace(-1, 1, 16, dtype=torch.float64)
    true = torch.cos(x) * torch.arange(1, 17) / 4.0 + 0.2 * x
    estimator = go.spsa(samples=400, seed=0, vectorized=True)
    g = _spsa_grad(estimator, x)
    cosine = torch.nn.functional.cosine_similarity(g, true, dim=0)
    assert cosine > 0.9, f"cosine similarity {float(cosine):.3f}"
    assert torch.equal(_spsa_grad(estimator, x), g), "a seed gives the same estimate"
    unvectorized = _spsa_grad(go.spsa(samples=400, seed=0), x)
    torch.testing.assert_close(unvectorized, g)
    few = _spsa_grad(go.spsa(samples=2, seed=0), x)
    assert torch.nn.functional.cosine_similarity(few, true, dim=0) < 0.9, (
        "with 2 samples the estimate is far from the gradient, so the test can fail"
    )
    assert not torch.equal(_spsa_grad(go.spsa(samples=400, seed=1, vectorized=True), x), g)


def test_spsa_generators_continue_their_stream_reproducibly() -> None:
    x = torch.linspace(-1, 1, 16, dtype=torch.float64)
    for make in (lambda: torch.Generator().manual_seed(3), lambda: np.random.default_rng(3)):
        estimator = go.spsa(samples=8, generator=make())
        first, second = _spsa_grad(estimator, x), _spsa_grad(estimator, x)
        assert not torch.equal(first, second), "the generator's state advances"
        replay = go.spsa(samples=8, generator=make())
        assert torch.equal(_spsa_grad(replay, x), first)
        assert torch.equal(_spsa_grad(replay, x), second)
    torch.manual_seed(5)
    a = _spsa_grad(go.spsa(samples=8), x)
    torch.manual_seed(5)
    assert torch.equal(_spsa_grad(go.spsa(samples=8), x), a), "the global RNG otherwise"


# ---- errors -----------------------------------------------------------------------------------


def test_unknown_estimator_lists_the_valid_ones() -> None:
    with pytest.raises(go.GradOverrideError, match=(
        r"^bridge of `field` got backward='fd', which is not an estimator; the estimators "
        r"are 'finite_differences', 'spsa', or pass a rule"
    )):
        go.bridge(field, backward="fd")
    with pytest.raises(go.GradOverrideTypeError, match=r"needs `backward` to be a rule .*, "
                       r"got int 3\."):
        go.bridge(field, backward=3)  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideTypeError, match=r"bridge needs a function to call on "
                       r"numpy arrays, got int 1\."):
        go.bridge(1, backward="spsa")  # type: ignore[call-overload]


def test_estimator_option_errors() -> None:
    with pytest.raises(go.GradOverrideError, match=r"spsa needs `samples` to be a positive int, "
                       r"got 0\."):
        go.spsa(samples=0)
    with pytest.raises(go.GradOverrideError, match=r"spsa takes a `seed` or a `generator`, "
                       r"not both"):
        go.spsa(seed=1, generator=torch.Generator())
    with pytest.raises(go.GradOverrideTypeError, match=r"spsa needs `generator` to be a "
                       r"torch.Generator or a numpy.random.Generator, got int\."):
        go.spsa(generator=3)  # type: ignore[arg-type]
    with pytest.raises(go.GradOverrideError, match=r"finite_differences needs `step` to be a "
                       r"positive number, got -1\."):
        go.finite_differences(step=-1)
    with pytest.raises(go.GradOverrideError, match=r"finite_differences needs `batch_size` to be "
                       r"a positive int"):
        go.finite_differences(vectorized=True, batch_size=0)
    with pytest.raises(go.GradOverrideError, match=r"spsa needs `step` to be a positive number, "
                       r"got 0\."):
        go.spsa(step=0)


def test_fn_returning_something_not_array_like() -> None:
    op = go.bridge(lambda x: {"y": x}, backward="finite_differences")
    with pytest.raises(go.GradOverrideError, match=(
        r"^`[^`]*<lambda>` \(output 0\) returned dict \{'y': array.*, which is not array-like; "
        r"return a numpy array, a number, or a tuple of them for several outputs"
    )):
        op(torch.ones(2))
    with pytest.raises(go.GradOverrideError, match=r"returned NoneType None, which is not "
                       r"array-like"):
        go.bridge(lambda x: None, backward="spsa")(torch.ones(2))


def test_non_finite_results_are_named() -> None:
    op = go.bridge(lambda x: np.log(x), backward="finite_differences")
    with (
        np.errstate(divide="ignore", invalid="ignore"),
        pytest.raises(go.GradOverrideError, match=(
            r"^`[^`]*<lambda>` returned non-finite values in output 0 \(1 NaN and 1 infinite of 3 "
            r"values\)\. Check `[^`]*<lambda>` at this input, or pass `check_finite=False`"
        )),
    ):
        op(torch.tensor([-1.0, 0.0, 1.0]))
    lenient = go.bridge(lambda x: np.log(x), backward="finite_differences", check_finite=False)
    with np.errstate(divide="ignore"):
        assert lenient(torch.tensor([0.0])).item() == -np.inf

    # Finite at the input, not around it: the estimator's evaluations are checked.
    cliff = go.bridge(lambda x: np.where(np.abs(x) < 1e-9, 0.0, np.inf),
                      backward="finite_differences")
    x = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(go.GradOverrideError, match=(
        r"^`[^`]*<lambda>` returned non-finite values in output 0 when `x` was perturbed by the "
        r"estimator \(0 NaN and 1 infinite of 2 values\)"
    )):
        cliff(x).sum().backward()

    # Finite evaluations whose difference overflows: the estimate itself is checked.
    jump = go.bridge(lambda x: np.where(x > 0, 1e308, -1e308), backward="finite_differences")
    with (
        np.errstate(over="ignore"),
        pytest.raises(go.GradOverrideError, match=(
            r"^the finite_differences\(step=None, vectorized=False, batch_size=None\) estimate "
            r"for `x` of `[^`]*<lambda>` is not finite \(0 NaN and 1 infinite of 1 values\)\. "
            r"Use a larger `step`"
        )),
    ):
        jump(torch.zeros(1, dtype=torch.float64, requires_grad=True)).sum().backward()

    bad_rule = go.bridge(np.sin, backward=lambda grad, *, x: grad / 0.0)
    with (
        np.errstate(divide="ignore"),
        pytest.raises(go.GradOverrideError, match=(
            r"^the backward rule `[^`]*<lambda>` of `sin` returned non-finite values in its "
            r"gradient \(0 NaN and 2 infinite of 2 values\)\. Fix the rule"
        )),
    ):
        bad_rule(torch.ones(2, requires_grad=True)).sum().backward()


def test_shapes_that_do_not_match() -> None:
    op = go.bridge(np.sin, backward=lambda grad, *, x: np.ones(3))
    with pytest.raises(go.GradOverrideError, match=(
        r"backward of `sin` returned a gradient of shape \(3,\) for `x`, which has shape "
        r"\(2,\)"
    )):
        op(torch.ones(2, requires_grad=True)).sum().backward()

    not_vectorized = go.bridge(lambda x: np.sum(x), backward=go.finite_differences(
        vectorized=True))
    with pytest.raises(go.GradOverrideError, match=(
        r"^`[^`]*<lambda>` returned output 0 with shape \(\) when `x` was perturbed; expected "
        r"\(4,\)\. With vectorized=True, `fn` gets a leading batch axis"
    )):
        not_vectorized(torch.ones(2, requires_grad=True)).backward()

    two_then_one = go.bridge(lambda x: (x, x) if x[0] == 1.0 else x, backward="spsa")
    with pytest.raises(go.GradOverrideError, match=(
        r"^`[^`]*<lambda>` returned 1 outputs on perturbed inputs but 2 at the forward; it "
        r"must return the same outputs\."
    )):
        sum(two_then_one(torch.ones(2, dtype=torch.float64, requires_grad=True))).sum().backward()

    changing = go.bridge(lambda x: x if x[0] == 1.0 else x[:1], backward="finite_differences")
    with pytest.raises(go.GradOverrideError, match=(
        r"^`[^`]*<lambda>` returned output 0 with shape \(1,\) when `x` was perturbed; "
        r"expected \(2,\)\.$"
    )):
        changing(torch.ones(2, dtype=torch.float64, requires_grad=True)).sum().backward()


def test_backward_is_once_differentiable() -> None:
    op = go.bridge(np.sin, backward="finite_differences")
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(op(x).sum(), x, create_graph=True)
    with pytest.raises(go.GradOverrideError):
        torch.autograd.grad(g.sum(), x)


# ---- torch.compile ---------------------------------------------------------------------------


def _model(x: torch.Tensor) -> torch.Tensor:
    return (_SINE(x * 2) * 3).sum()


_SINE = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x))


# Dynamo reads `.grad` of the non-leaf tensors it resumes with after a graph break, inside
# `torch._logging.hide_warnings`, which does not hide it from `filterwarnings = error`; users
# see no warning (torch's own behaviour, for any graph break).
@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_compile_runs_a_bridge_call_as_a_graph_break() -> None:
    torch._dynamo.reset()
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    x = torch.linspace(-1, 1, 5, requires_grad=True)
    (eager,) = torch.autograd.grad(_model(x), x)
    (compiled,) = torch.autograd.grad(torch.compile(_model, backend=backend)(x), x)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(eager, 6 * torch.cos(2 * x.detach()))
    assert len(graphs) == 2, "the code before and after the bridge call is compiled apart"
    torch._dynamo.reset()


@pytest.mark.compile
def test_compile_fullgraph_says_a_bridge_cannot_be_inside() -> None:
    torch._dynamo.reset()
    with pytest.raises(RuntimeError, match=(
        r"(?s)torch.compiler.disable.*go.bridge of `sin` has no `outputs=`, so "
        r"torch.compile cannot know what its function \(numpy code, which it cannot trace\) "
        r"returns.*a fullgraph=True region cannot hold\. Pass `outputs=` to go.bridge"
    )):
        torch.compile(_model, backend="eager", fullgraph=True)(torch.ones(3))
    torch._dynamo.reset()


# ==== SPSA's memory and stream, torch.func, read-only inputs ================================
# `go.bridge` hardening: SPSA's memory and random stream, torch.func transforms, and a
# bridged function writing into its read-only inputs.
#
# SPSA is checked against a plain re-implementation of its documented formula (directions
# from one `(samples, *shape)` draw per input, inputs in order), not against the library.


def _reference_bits(source: Any, size: tuple[int, ...]) -> np.ndarray[Any, Any]:
    if isinstance(source, np.random.Generator):
        bits: np.ndarray[Any, Any] = source.integers(0, 2, size=size)
        return bits
    return torch.randint(0, 2, size, generator=source, dtype=torch.int8).numpy()


def _reference_spsa(
    fn: Callable[..., Any], inputs: Sequence[np.ndarray[Any, Any]],
    upstream: np.ndarray[Any, Any], samples: int, source: Any,
) -> list[np.ndarray[Any, Any]]:
    """``mean_b <g, fn(x + h d_b) - fn(x - h d_b)> / ((x + h d_b) - (x - h d_b))`` with
    ``h = eps**(1/3) * max(1, |x|)``, every input perturbed at once, one sample at a time."""
    directions = [
        _reference_bits(source, (samples, *x.shape)).astype(np.float64) * 2.0 - 1.0
        for x in inputs
    ]
    steps = [
        np.finfo(x.dtype).eps ** (1 / 3) * np.maximum(1.0, np.abs(x.astype(np.float64)))
        for x in inputs
    ]
    g = upstream.astype(np.float64)
    sums = [np.zeros(x.shape) for x in inputs]
    for b in range(samples):
        deltas = [h * d[b] for h, d in zip(steps, directions, strict=True)]
        plus = [(x + dx).astype(x.dtype) for x, dx in zip(inputs, deltas, strict=True)]
        minus = [(x - dx).astype(x.dtype) for x, dx in zip(inputs, deltas, strict=True)]
        projection = float(np.vdot(g, np.asarray(fn(*plus), np.float64))) - float(
            np.vdot(g, np.asarray(fn(*minus), np.float64))
        )
        for total, p, m in zip(sums, plus, minus, strict=True):
            total += projection / (p.astype(np.float64) - m.astype(np.float64))
    return [total / samples for total in sums]


def _two_inputs(x: Any, w: Any) -> Any:
    """Smooth in both inputs, vectorized over a leading axis of either."""
    weights = np.arange(1, 17) / 4.0
    return (
        np.sum(np.sin(x) * weights + 0.1 * x**2, axis=-1)[..., None]
        + np.sum(w**3, axis=(-1, -2))[..., None] * np.linspace(0.5, 1.5, 3)
    )


def _sources() -> dict[str, Callable[[], Any]]:
    """Per kind of SPSA randomness: (estimator options, the reference's source), made fresh."""
    return {
        "seed": lambda: ({"seed": 3}, torch.Generator().manual_seed(3)),
        "torch generator": lambda: (
            {"generator": torch.Generator().manual_seed(4)}, torch.Generator().manual_seed(4)
        ),
        "numpy generator": lambda: (
            {"generator": np.random.default_rng(5)}, np.random.default_rng(5)
        ),
    }


@pytest.mark.parametrize("kind", list(_sources()))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunking", [
    {}, {"vectorized": True}, {"vectorized": True, "batch_size": 3},
])
def test_spsa_follows_its_formula_and_random_stream(
    kind: str, dtype: torch.dtype, chunking: dict[str, Any]
) -> None:
    options, source = _sources()[kind]()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, generator=gen, dtype=dtype).requires_grad_()
    w = torch.randn(3, 5, generator=gen, dtype=dtype).requires_grad_()
    upstream = torch.linspace(-1, 2, 3, dtype=dtype)
    estimator = go.spsa(samples=7, **options, **chunking)
    op = go.bridge(_two_inputs, backward=estimator)
    got = torch.autograd.grad(op(x, w), (x, w), upstream)
    expected = _reference_spsa(
        _two_inputs, [x.detach().numpy(), w.detach().numpy()], upstream.numpy(), 7, source
    )
    for g, e in zip(got, expected, strict=True):
        e_t = torch.from_numpy(e).to(dtype)
        if not chunking:
            assert torch.equal(g, e_t), "one sample at a time: the same arithmetic"
        # A vectorized call projects with tensordot and sums a chunk at a time: rounding only.
        torch.testing.assert_close(g, e_t, rtol=1e-9 if dtype == torch.float64 else 1e-5,
                                   atol=0.0)
    if kind != "seed":  # the generator advanced by the whole draw: the next backward follows
        again = torch.autograd.grad(op(x, w), (x, w), upstream)
        expected = _reference_spsa(
            _two_inputs, [x.detach().numpy(), w.detach().numpy()], upstream.numpy(), 7, source
        )
        torch.testing.assert_close(again[0], torch.from_numpy(expected[0]).to(dtype),
                                   rtol=1e-9 if dtype == torch.float64 else 1e-5, atol=0.0)


def test_spsa_global_rng_follows_the_same_stream() -> None:
    x = torch.linspace(-1, 1, 16, dtype=torch.float64, requires_grad=True)
    w = torch.linspace(0, 1, 15, dtype=torch.float64).reshape(3, 5).requires_grad_()
    upstream = torch.ones(3, dtype=torch.float64)
    torch.manual_seed(9)
    got = torch.autograd.grad(go.bridge(_two_inputs, backward=go.spsa(samples=5))(x, w),
                              (x, w), upstream)
    after = torch.rand(())
    torch.manual_seed(9)
    expected = _reference_spsa(_two_inputs, [x.detach().numpy(), w.detach().numpy()],
                               upstream.numpy(), 5, None)
    assert torch.equal(torch.rand(()), after), "the global RNG ends where one draw leaves it"
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, torch.from_numpy(e))


def test_spsa_with_a_seed_gives_each_input_its_own_directions() -> None:
    # Two inputs of one shape: sharing a direction would add each one's gradient to the
    # other's estimate (x's would be a + b, not a).
    a = np.linspace(1, 2, 8)
    b = np.linspace(-3, 3, 8)
    op = go.bridge(lambda x, w: np.sum(a * x + b * w, axis=-1),
                   backward=go.spsa(samples=4000, seed=0, vectorized=True, batch_size=1000))
    x = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    w = torch.zeros(8, dtype=torch.float64, requires_grad=True)
    gx, gw = torch.autograd.grad(op(x, w), (x, w))
    # The estimator's noise here is about 0.12 per element (sqrt(sum a^2 + b^2) / sqrt(4000)).
    torch.testing.assert_close(gx, torch.from_numpy(a), atol=0.6, rtol=0)
    torch.testing.assert_close(gw, torch.from_numpy(b), atol=0.6, rtol=0)


def _half_square(x: Any) -> Any:
    """0.5 * |x|^2 over the last axis, in float64 (so that batched and single calls round
    alike), without temporaries the size of `x`."""
    return 0.5 * np.einsum("...i,...i->...", x, x, dtype=np.float64)


@pytest.mark.parametrize(("n", "samples", "chunking", "bound"), [
    # one sample at a time: the steps and the running sum (float64), one direction, the
    # perturbed pair and its float64 differences: about 8x a float32 input's bytes.
    (1 << 20, 8, {}, 12),
    (1 << 18, 64, {}, 12),
    # 2 samples per call: twice the per-sample part.
    (1 << 20, 8, {"vectorized": True, "batch_size": 2}, 20),
])
def test_spsa_memory_is_that_of_a_chunk_not_of_all_samples(
    n: int, samples: int, chunking: dict[str, Any], bound: int
) -> None:
    x = torch.linspace(-1, 1, n, dtype=torch.float32).requires_grad_()
    op = go.bridge(_half_square, backward=go.spsa(samples=samples, seed=0, **chunking))
    y = op(x)
    tracemalloc.start()
    try:
        (g,) = torch.autograd.grad(y, x)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    input_bytes = 4 * n
    assert peak < bound * input_bytes, (
        f"SPSA's backward allocated {peak / input_bytes:.1f}x the input's size "
        f"(bound {bound}x; all directions in float64 would be {8 * samples / 4:.0f}x)"
    )
    if n == 1 << 20:  # and the estimate is still the formula's
        (expected,) = _reference_spsa(_half_square, [x.detach().numpy()], np.ones(()),
                                      samples, torch.Generator().manual_seed(0))
        torch.testing.assert_close(g, torch.from_numpy(expected).float(), rtol=1e-5, atol=0)


# ---- torch.func ----------------------------------------------------------------------------

_SINE_FD = go.bridge(np.sin, backward="finite_differences")


def test_vmap_of_a_bridge_calls_it_once_per_batch_entry() -> None:
    calls: list[tuple[int, ...]] = []

    def pair(x: Any, w: Any) -> Any:
        calls.append(np.shape(x))
        return x * w

    x, w = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(torch.func.vmap(_SINE)(x), torch.sin(x))
    out = torch.func.vmap(go.bridge(pair, backward="spsa"))(x, w)
    torch.testing.assert_close(out, x * w)
    assert calls == [(3,), (3,)]


@pytest.mark.parametrize("transform", ["grad", "jacrev"])
@pytest.mark.parametrize("op", [_SINE, _SINE_FD], ids=["rule", "estimator"])
def test_a_bridge_differentiates_inside_torch_func(transform: str, op: Any) -> None:
    x = torch.linspace(-1, 1, 3, dtype=torch.float64)
    if transform == "grad":
        got = torch.func.grad(lambda x: op(x).sum())(x)
    else:
        got = torch.func.jacrev(op)(x).sum(0)
    torch.testing.assert_close(got, torch.cos(x), atol=1e-9, rtol=0)


def test_a_bridge_under_torch_func_on_untracked_tensors() -> None:
    """Tensors the transform does not track, and the function torch.func.vjp returns."""
    x = torch.linspace(-1, 1, 3, dtype=torch.float64)
    c = torch.linspace(0, 2, 3, dtype=torch.float64)
    g = torch.func.grad(lambda y: (y * _SINE(c)).sum())(x)  # a closure's tensor
    torch.testing.assert_close(g, torch.sin(c))
    g = torch.func.grad(lambda y: (y * _SINE(y.detach())).sum())(x)  # a detached one
    torch.testing.assert_close(g, torch.sin(x))
    batched = torch.func.vmap(lambda y: y * _SINE(c))(torch.ones(2, 3, dtype=torch.float64))
    torch.testing.assert_close(batched, torch.sin(c).expand(2, 3))
    out, vjp_fn = torch.func.vjp(_SINE, x)
    torch.testing.assert_close(out, torch.sin(x))
    (gx,) = vjp_fn(torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(gx, torch.cos(x))


# ---- writing into read-only inputs -------------------------------------------------------


def test_fn_writing_into_its_input_is_an_error_naming_it() -> None:
    def in_place(x: Any) -> Any:
        x += 1
        return x

    caller = torch.zeros(2)
    with pytest.raises(go.GradOverrideError, match=(
        r"^`[^`]*in_place` wrote into its argument `x`, a read-only numpy array: go.bridge "
        r"passes the caller's tensors as read-only views, without a copy, so that the "
        r"function cannot change them\. Copy the array before writing into it "
        r"\(`x = x.copy\(\)`\), or compute a new one \(`x = x \+ 1` rather than `x \+= 1`\)\.$"
    )) as info:
        go.bridge(in_place, backward="finite_differences")(caller)
    assert isinstance(info.value.__cause__, ValueError)
    assert "read-only" in str(info.value.__cause__)
    assert torch.equal(caller, torch.zeros(2))

    def scale_into(x: Any, w: Any, k: float) -> Any:
        w[0] = k
        return x * w

    with pytest.raises(go.GradOverrideError, match=(
        r"^`[^`]*scale_into` wrote into one of its arguments `x`, `w`, a read-only numpy "
        r"array"
    )):
        go.bridge(scale_into, backward="spsa")(torch.ones(2), torch.ones(2), 3.0)

    def copies_first(x: Any) -> Any:
        x = x.copy()
        x += 1
        return x

    out = go.bridge(copies_first, backward="finite_differences")(caller)
    torch.testing.assert_close(out, torch.ones(2))


def test_rule_writing_into_its_arguments_is_an_error_naming_it() -> None:
    def rule(grad: Any, *, x: Any) -> Any:
        grad *= np.cos(x)
        return grad

    op = go.bridge(np.sin, backward=rule)
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(go.GradOverrideError, match=(
        r"^the backward rule `[^`]*rule` of `sin` wrote into one of its arguments `grad`, "
        r"`x`, a read-only numpy array: go.bridge passes the caller's tensors as read-only "
        r"views.*\(`grad = grad.copy\(\)`\)"
    )) as info:
        op(x).sum().backward()
    assert isinstance(info.value.__cause__, ValueError)


def test_fn_writing_into_an_unperturbed_input_under_an_estimator() -> None:
    def writes_when_perturbed(x: Any, w: Any) -> Any:
        if x.flags.writeable:  # the estimator's perturbed copies of x are writeable
            w[0] = 0.0
        return x * w

    op = go.bridge(writes_when_perturbed, backward="finite_differences")
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(go.GradOverrideError, match=(
        r"^`[^`]*writes_when_perturbed`, called by the estimator on perturbed inputs, wrote "
        r"into its argument `w`, a read-only numpy array"
    )) as info:
        op(x, torch.ones(2, dtype=torch.float64)).sum().backward()
    assert isinstance(info.value.__cause__, ValueError)


def test_other_value_errors_of_fn_pass_through() -> None:
    def refuses(x: Any) -> Any:
        raise ValueError("x must be sorted")

    with pytest.raises(ValueError, match=r"^x must be sorted$") as info:
        go.bridge(refuses, backward="spsa")(torch.ones(2))
    assert not isinstance(info.value, go.GradOverrideError)
