"""`go.bridge` hardening: SPSA's memory and random stream, torch.func transforms, and a
bridged function writing into its read-only inputs.

SPSA is checked against a plain re-implementation of its documented formula (directions
from one `(samples, *shape)` draw per input, inputs in order), not against the library.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch

import gradoverride as go

# ---- SPSA: the documented formula, written out ------------------------------------------------


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

_SINE = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x))
_SINE_SPSA = go.bridge(np.sin, backward="spsa")


def test_vmap_of_a_bridge_is_an_error_at_the_call() -> None:
    with pytest.raises(go.GradOverrideError, match=(
        r"^`sin` is a go.bridge, which runs its function on numpy arrays, so it cannot run "
        r"under torch.func.vmap: its argument `x` is a tensor batched by vmap, which numpy "
        r"cannot read \(no data of its own\)\. Call it outside vmap \(in a loop over the "
        r"batch, or on the whole batch with a function written for a leading batch axis\), "
        r"or write `sin` in torch ops, which vmap can transform\.$"
    )):
        torch.func.vmap(_SINE)(torch.ones(2, 3))

    def pair(x: Any, w: Any) -> Any:
        return x * w

    with pytest.raises(go.GradOverrideError,
                       match=r"its arguments `x`, `w` are tensors batched "):
        torch.func.vmap(go.bridge(pair, backward="spsa"))(torch.ones(2, 3), torch.ones(2, 3))


@pytest.mark.parametrize("transform", ["grad", "jacrev"])
@pytest.mark.parametrize(("op", "backward"), [
    (_SINE, r"the rule `[^`]*<lambda>`"), (_SINE_SPSA, r"the spsa estimator"),
])
def test_differentiating_a_bridge_inside_torch_func_is_an_error(
    transform: str, op: Any, backward: str
) -> None:
    x = torch.ones(3, dtype=torch.float64)
    call = torch.func.grad(lambda x: op(x).sum()) if transform == "grad" else (
        torch.func.jacrev(op))
    with pytest.raises(go.GradOverrideError, match=(
        rf"^`sin` is a go.bridge, whose backward \({backward}\) runs on numpy arrays, so it "
        r"cannot be differentiated inside a torch.func transform \(grad, jacrev, \.\.\.\): "
        r"the transform gives the backward tensors it wraps, which have no data numpy can "
        r"read\. Differentiate it outside the transform \(torch.autograd.grad or "
        r"\.backward\(\) instead of torch.func.grad; the function torch.func.vjp returns "
        r"works when called outside any transform\), or write `sin` in torch ops"
    )):
        call(x)


def test_a_bridge_under_torch_func_where_it_can_run() -> None:
    """What the errors above leave working: tensors the transform does not track, and the
    function torch.func.vjp returns, called outside any transform."""
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
