"""`go.straight_through`: the identity, clipped (both keep options), surrogate and
explicit-derivative forms; what each saves; composition; errors."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import tolerance
from hypothesis import given
from hypothesis import strategies as st
from torch.func import grad as func_grad
from torch.func import vmap

import gradoverride as go
from gradoverride.testing import assert_consistent, saved_bytes
from gradoverride.testing import strategies as gst

EDGES = (0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0)

# Dynamo warns about instantiating a Function for a closure-held apply (see
# tests/test_composition.py for the full story); not gradoverride's warning.
_TORCH_CTX_WARNING = pytest.mark.filterwarnings(
    "ignore:.*should not be instantiated:DeprecationWarning"
)


@go.straight_through
def sign_ste(x: torch.Tensor) -> torch.Tensor:
    """Sign with the identity gradient."""
    return torch.sign(x)


@go.straight_through(clip=1.0)
def sign_clip(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


@go.straight_through(clip=(-0.5, 1.0), keep="mask")
def sign_clip_mask(x: torch.Tensor, k: float = 2.0) -> torch.Tensor:
    return torch.sign(x) * k


@go.straight_through(clip=1.0, keep="mask")
def sign_clip_mask_sym(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


@go.straight_through(clip=(-0.5, 1.0), keep="input")
def sign_clip_pair(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


@go.straight_through(surrogate=torch.tanh)
def step_tanh(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


def _dtanh(x: torch.Tensor) -> torch.Tensor:
    return 1 - torch.tanh(x) ** 2


@go.straight_through(derivative=_dtanh)
def step_dtanh(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


@go.straight_through(surrogate=torch.tanh, clip=1.0)
def step_tanh_clip(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(x.dtype)


def _grad(op: Callable[..., torch.Tensor], x: torch.Tensor, g: torch.Tensor, *args: Any) -> Any:
    leaf = x.detach().requires_grad_()
    y = op(leaf, *args)
    (gx,) = torch.autograd.grad(y, leaf, g)
    return y.detach(), gx


def _window(x: torch.Tensor, g: torch.Tensor, low: float, high: float) -> torch.Tensor:
    inside = (x >= low) & (x <= high)
    return torch.where(inside, g, torch.zeros_like(g))


# ---- identity -------------------------------------------------------------------------------


@given(gst.tensors(edges=EDGES))
def test_identity_forward_is_the_function_and_backward_the_upstream_gradient(
    x: torch.Tensor,
) -> None:
    g = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
    y, gx = _grad(sign_ste, x, g)
    assert torch.equal(y, torch.sign(x)) and y.dtype == x.dtype
    assert torch.equal(gx, g) and gx.dtype == x.dtype


def test_identity_returns_the_upstream_gradient_without_a_copy_and_saves_nothing() -> None:
    x = torch.randn(64, 64, requires_grad=True)
    g = torch.randn(64, 64)
    (gx,) = torch.autograd.grad(sign_ste(x), x, g)
    assert gx.data_ptr() == g.data_ptr()
    assert saved_bytes(sign_ste, x) == 0


def test_further_arguments_go_to_the_forward_and_get_no_gradient() -> None:
    x = torch.tensor([-2.0, 0.25, 3.0], requires_grad=True)
    k = torch.tensor(3.0, requires_grad=True)
    y = sign_clip_mask(x, k)
    assert torch.equal(y, torch.tensor([-3.0, 3.0, 3.0]))
    y.sum().backward()
    assert k.grad is None
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 0.0]))


# ---- clip -----------------------------------------------------------------------------------

CLIPPED = [
    (sign_clip, -1.0, 1.0),
    (sign_clip_pair, -0.5, 1.0),
    (sign_clip_mask_sym, -1.0, 1.0),
    (sign_clip_mask, -0.5, 1.0),
]


@pytest.mark.parametrize("op,low,high", CLIPPED, ids=lambda v: getattr(v, "__name__", str(v)))
@given(x=gst.tensors(edges=EDGES))
def test_clip_passes_the_gradient_inside_the_window_bounds_included(
    op: Any, low: float, high: float, x: torch.Tensor
) -> None:
    g = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
    _, gx = _grad(op, x, g)
    assert gx.dtype == x.dtype
    assert torch.equal(gx, _window(x, g, low, high))


def test_clip_at_the_bounds_exactly() -> None:
    x = torch.tensor([-1.0, 1.0, -1.0001, 1.0001, 0.0, -0.5, -0.5001])
    g = torch.ones(7)
    assert _grad(sign_clip, x, g)[1].tolist() == [1, 1, 0, 0, 1, 1, 1]
    assert _grad(sign_clip_pair, x, g)[1].tolist() == [0, 1, 0, 0, 1, 1, 0]


@pytest.mark.parametrize("dtype", gst.FLOAT_DTYPES, ids=str)
def test_clip_keeps_the_input_or_a_one_byte_mask(dtype: torch.dtype) -> None:
    x = torch.randn(8, 16, dtype=dtype, requires_grad=True)
    assert saved_bytes(sign_clip, x) == x.numel() * x.element_size()
    assert saved_bytes(sign_clip_mask_sym, x) == x.numel()  # bool


def test_clip_bound_a_dtype_cannot_represent_is_rounded_to_it() -> None:
    @go.straight_through(clip=0.1)
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    x = torch.tensor([0.1, -0.1], dtype=torch.float16)  # rounded, like `x.abs() <= 0.1`
    assert _grad(op, x, torch.ones(2, dtype=torch.float16))[1].tolist() == [1, 1]


def test_clip_with_an_infinite_bound() -> None:
    @go.straight_through(clip=(-math.inf, 0.0))
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    x = torch.tensor([-math.inf, -1e30, 0.0, 1e-30])
    assert _grad(op, x, torch.ones(4))[1].tolist() == [1, 1, 1, 0]


# ---- surrogate and derivative ----------------------------------------------------------------


@pytest.mark.parametrize("op", [step_tanh, step_dtanh], ids=["surrogate", "derivative"])
@given(x=gst.tensors(edges=(0.0, 1.0, -1.0)))
def test_surrogate_gradient_is_the_surrogates_derivative(op: Any, x: torch.Tensor) -> None:
    g = torch.randn(x.shape, dtype=torch.float64).to(x.dtype)
    y, gx = _grad(op, x, g)
    assert torch.equal(y, (x > 0).to(x.dtype))
    leaf = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad(torch.tanh(leaf), leaf, g)
    assert gx.dtype == x.dtype
    torch.testing.assert_close(gx, expected, **tolerance(x.dtype))


@given(x=gst.tensors(edges=(1.0, -1.0, 0.0), dtype=gst.float_dtypes(low_precision=False)))
def test_surrogate_with_clip_zeroes_outside_the_window(x: torch.Tensor) -> None:
    g = torch.randn(x.shape, dtype=x.dtype)
    _, gx = _grad(step_tanh_clip, x, g)
    torch.testing.assert_close(gx, _window(x, g * _dtanh(x), -1.0, 1.0))


@pytest.mark.parametrize(
    "dtype,big", [(torch.float16, 1e4), (torch.bfloat16, 1e30), (torch.float32, 1e30)], ids=str
)
def test_surrogate_gradients_are_finite_at_extreme_inputs(dtype: torch.dtype, big: float) -> None:
    x = torch.tensor([-big, big, 0.0], dtype=dtype)
    for op in (step_tanh, step_dtanh, step_tanh_clip):
        _, gx = _grad(op, x, torch.ones(3, dtype=dtype))
        assert torch.isfinite(gx).all(), (op, gx)


def test_surrogate_is_differentiable_twice() -> None:
    x = torch.linspace(-2, 2, 7, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(step_tanh(x).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), x)
    t = x.detach().requires_grad_()
    (expected,) = torch.autograd.grad(_dtanh(t).sum(), t)
    torch.testing.assert_close(ggx, expected)


def test_surrogate_of_the_wrong_shape_is_an_error() -> None:
    @go.straight_through(surrogate=lambda x: x.sum())
    def op(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    x = torch.randn(3, requires_grad=True)
    with pytest.raises(go.GradOverrideError, match=r"surrogate `<lambda>` of `.*op` returned "
                       r"\(\), but the forward's output has shape \(3,\)"):
        op(x).sum().backward()


# ---- the object -------------------------------------------------------------------------------


def test_result_is_a_custom_backward_op_with_name_repr_and_module_form() -> None:
    assert isinstance(sign_clip_mask, go.CustomBackward)
    assert sign_ste.__name__ == "sign_ste"
    assert sign_ste.__doc__ == "Sign with the identity gradient."
    assert sign_clip_mask.__wrapped__.__name__ == "sign_clip_mask"
    assert repr(sign_clip_mask) == (
        "<custom_backward sign_clip_mask(x: 'torch.Tensor', k: 'float' = 2.0) -> "
        "'torch.Tensor', backward=straight_through(clip=(-0.5, 1.0), keep='mask')>"
    )
    assert "straight_through(surrogate=tanh)" in repr(step_tanh)
    module = sign_clip_mask.module(k=3.0)
    x = torch.tensor([0.25, -2.0], requires_grad=True)
    assert torch.equal(module(x), torch.tensor([3.0, -3.0]))


def test_call_form_and_builtins() -> None:
    op = go.straight_through(torch.round, clip=2.0)
    x = torch.tensor([0.4, 2.6, -1.5], requires_grad=True)
    y = op(x)
    y.sum().backward()
    assert torch.equal(y, torch.round(x.detach()))
    assert torch.equal(x.grad, torch.tensor([1.0, 0.0, 1.0]))


def test_autocast_runs_the_clipped_backward() -> None:
    x = torch.tensor([-2.0, 0.5, 1.0], requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = sign_clip(x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([0.0, 1.0, 1.0]))


def test_on_each_device(device: torch.device) -> None:
    x = torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0], device=device)
    g = torch.ones(5, device=device)
    for op, expected in ((sign_ste, [1, 1, 1, 1, 1]), (sign_clip, [0, 1, 1, 1, 0]),
                         (sign_clip_mask, [0, 0, 1, 1, 0])):
        _, gx = _grad(op, x, g)
        assert gx.device == x.device and gx.tolist() == expected


# ---- composition ------------------------------------------------------------------------------


@pytest.mark.compile
@_TORCH_CTX_WARNING
def test_every_form_compiles_with_fullgraph_and_matches_eager() -> None:
    ops = [sign_ste, sign_clip, sign_clip_pair, sign_clip_mask, sign_clip_mask_sym, step_tanh,
           step_dtanh, step_tanh_clip]
    x0 = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 0.75])
    w = torch.arange(8.0)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return sum(((op(x) * w).sum() for op in ops), torch.zeros(()))

    assert_consistent(loss, x0, modes=("compile",))


def assert_dynamic_compile_matches_eager(
    op: Callable[[torch.Tensor], torch.Tensor], inputs: list[torch.Tensor],
    backend: str = "aot_eager",
) -> None:
    """`op` under `torch.compile(dynamic=True, fullgraph=True)` gives eager's values and
    gradients on each input, the graph compiled for the first reused for the others."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend(backend)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(op, dynamic=True, fullgraph=True, backend=counter)
        compiles = []
        for x in inputs:
            g = torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(x.dtype)
            y, gx = _grad(op, x, g)
            y_c, gx_c = _grad(compiled, x, g)
            assert torch.equal(y_c, y), (x, y_c, y)
            assert torch.equal(gx_c, gx), (x, gx_c, gx)
            compiles.append(counter.frame_count)
    finally:
        torch._dynamo.reset()
    assert compiles == compiles[:1] * len(inputs)  # no recompilation for a new shape


@pytest.mark.compile
@_TORCH_CTX_WARNING
@pytest.mark.parametrize(
    "op,low,high",
    [(sign_clip, -1.0, 1.0), (sign_clip_pair, -0.5, 1.0), (sign_clip_mask_sym, -1.0, 1.0),
     (sign_clip_mask, -0.5, 1.0)],
    ids=["clip", "pair", "mask", "pair-mask"],
)
def test_clip_compiles_with_dynamic_shapes_and_matches_eager(
    op: Any, low: float, high: float
) -> None:
    # Under dynamic shapes dynamo traces the bound as a symbolic float: the window must
    # still compile (it once failed rounding the bound at trace time) and be inclusive.
    at_bounds = [low, high, math.nextafter(low, -2.0), math.nextafter(high, 2.0)]
    inputs = [
        torch.tensor([*at_bounds, -2.0, 0.0, 0.75, 2.0]),
        torch.tensor([*at_bounds, -3.0, -0.25, 0.5, 0.9, 1.5, 3.0, -0.0]),
    ]
    assert_dynamic_compile_matches_eager(op, inputs)


@pytest.mark.parametrize("op", [sign_ste, sign_clip, sign_clip_mask_sym, step_tanh, step_dtanh])
def test_vmap_of_grad_matches_the_loop(op: Any) -> None:
    xs = torch.tensor([[-2.0, -1.0, 0.3, 1.0], [0.5, 1.5, -0.2, 0.0]])

    def f(x: torch.Tensor) -> torch.Tensor:
        return (op(x) * torch.arange(4.0)).sum()

    batched = vmap(func_grad(f))(xs)
    looped = torch.stack([func_grad(f)(x) for x in xs])
    torch.testing.assert_close(batched, looped)


# ---- errors -----------------------------------------------------------------------------------


def _sign(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


@pytest.mark.parametrize(
    "options,error,message",
    [
        ({"clip": -1.0}, go.GradOverrideError,
         r"straight_through: `clip` must be a bound c >= 0 \(the window \[-c, c\]\) or a pair "
         r"\(low, high\); got -1\.0\. Pass a non-negative number"),
        ({"clip": (1.0, -1.0)}, go.GradOverrideError,
         r"`clip` as a pair must be \(low, high\) with low <= high; got \(1\.0, -1\.0\)\. "
         r"Swap the bounds"),
        ({"clip": "1"}, go.GradOverrideTypeError,
         r"`clip` must be a number c \(the window \[-c, c\]\) or a pair \(low, high\) of "
         r"numbers; got str '1'\."),
        ({"keep": "mask"}, go.GradOverrideError,
         r"straight_through got keep='mask' without `clip=`; .* Add `clip=` or drop `keep`\."),
        ({"clip": 1.0, "keep": "bytes"}, go.GradOverrideError,
         r"`keep` must be 'input' .* or 'mask' .*; got 'bytes'\."),
        ({"clip": 1.0, "keep": "mask", "surrogate": torch.tanh}, go.GradOverrideError,
         r"keep='mask' does not apply with a surrogate or derivative"),
        ({"surrogate": torch.tanh, "derivative": _sign}, go.GradOverrideError,
         r"straight_through got both `surrogate=` and `derivative=`; pass one"),
        ({"surrogate": 1.0}, go.GradOverrideTypeError,
         r"straight_through: `surrogate` must be a function of the input tensor, got float"),
    ],
)
def test_option_mistakes_are_errors_that_name_the_fix(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        go.straight_through(_sign, **options)


def test_forward_must_take_the_tensor_first() -> None:
    def keyword_only(*, x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    with pytest.raises(go.GradOverrideTypeError, match=r"the forward must take the tensor "
                       r"first, as a positional parameter; `.*keyword_only` has the signature"):
        go.straight_through(keyword_only)
    with pytest.raises(go.GradOverrideTypeError, match=r"needs a forward function to "
                       r"decorate, got int 3\."):
        go.straight_through(3)  # type: ignore[call-overload]


@given(st.sampled_from([1.0, (0.0, 2.0)]), st.sampled_from(["input", "mask"]))
def test_valid_options_build(clip: Any, keep: Any) -> None:
    op = go.straight_through(_sign, clip=clip, keep=keep)
    x = torch.tensor([1.0], requires_grad=True)
    op(x).sum().backward()
    assert x.grad is not None and x.grad.tolist() == [1.0]


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_clip_bound_rounded_to_the_dtype_alike_eager_and_inductor(dtype: torch.dtype) -> None:
    # 0.3 rounds up in float16 and bfloat16: an input equal to the rounded bound is inside
    # the window in eager mode and must be inside when compiled too.
    @go.straight_through(clip=0.3)
    def st(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    x = torch.tensor([0.3, -0.3, 0.5], dtype=dtype)
    assert_consistent(st, x, modes=("compile",), backend="inductor")


@pytest.mark.compile
@_TORCH_CTX_WARNING
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_clip_bound_rounded_to_the_dtype_under_dynamic_shapes_with_inductor() -> None:
    # Under dynamic shapes the bounds reach the graph as symbolic floats, and Inductor
    # computes float16 in float32: -0.7 and 0.3 must still be rounded as eager rounds them.
    @go.straight_through(clip=(-0.7, 0.3))
    def st(x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x)

    edges = [0.3, -0.7, 0.2998, -0.6997, 0.3003, -0.7007, 0.0]
    inputs = [torch.tensor(edges, dtype=torch.float16),
              torch.tensor([*edges, 1.0, -1.0, 0.25], dtype=torch.float16)]
    assert_dynamic_compile_matches_eager(st, inputs, backend="inductor")


# ---- which ends belong to the window (`inclusive`) ---------------------------------------------


def _window_with_ends(
    x: torch.Tensor, g: torch.Tensor, low: float, high: float, ends: tuple[bool, bool]
) -> torch.Tensor:
    """The gradient the window passes, by comparisons in float64 with the bounds rounded to
    x's dtype first (as `x <= c` rounds them): independent of the library's forms."""
    lo = torch.tensor(low, dtype=torch.float64).to(x.dtype).double()
    hi = torch.tensor(high, dtype=torch.float64).to(x.dtype).double()
    v = x.double()
    above = v >= lo if ends[0] else v > lo
    below = v <= hi if ends[1] else v < hi
    return torch.where(above & below, g, torch.zeros_like(g))


ENDS_CASES = [
    (1.0, False, (-1.0, 1.0), (False, False)),
    ((-0.5, 1.0), False, (-0.5, 1.0), (False, False)),
    ((-0.5, 1.0), (True, False), (-0.5, 1.0), (True, False)),
    ((-0.5, 1.0), (False, True), (-0.5, 1.0), (False, True)),
    (1.0, (True, False), (-1.0, 1.0), (True, False)),
    (0.3, False, (-0.3, 0.3), (False, False)),
    ((-math.inf, 0.0), False, (-math.inf, 0.0), (False, False)),
]
_ENDS_IDS = ["sym-open", "pair-open", "closed-open", "open-closed", "sym-closed-open",
             "0.3-open", "inf-open"]


def _neighbours(*values: float) -> list[float]:
    out = []
    for v in values:
        out += [math.nextafter(v, -math.inf), v, math.nextafter(v, math.inf)]
    return out


@pytest.mark.parametrize("keep", ["input", "mask"])
@pytest.mark.parametrize("clip,inclusive,window,ends", ENDS_CASES, ids=_ENDS_IDS)
@pytest.mark.parametrize("dtype", gst.FLOAT_DTYPES, ids=str)
def test_each_end_is_in_or_out_as_inclusive_says(
    clip: Any, inclusive: Any, window: tuple[float, float], ends: tuple[bool, bool],
    keep: str, dtype: torch.dtype,
) -> None:
    op = go.straight_through(_sign, clip=clip, inclusive=inclusive, keep=keep)
    finite = [b for b in window if math.isfinite(b)]
    values = [*_neighbours(*finite), -math.inf, math.inf, 0.0, -0.0, 2.0, -2.0, 0.99, -0.51]
    x = torch.tensor(values, dtype=torch.float64).to(dtype)
    # and each rounded bound's own neighbours in this dtype
    rounded = torch.tensor(finite, dtype=torch.float64).to(dtype)
    inf = torch.tensor(math.inf, dtype=dtype)
    x = torch.cat([x, rounded, torch.nextafter(rounded, inf), torch.nextafter(rounded, -inf)])
    g = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g = g.to(dtype)
    _, gx = _grad(op, x, g)
    assert gx.dtype == dtype
    assert torch.equal(gx, _window_with_ends(x, g, *window, ends)), (x, gx)


@pytest.mark.parametrize("keep", ["input", "mask"])
@pytest.mark.parametrize("clip", [1.0, (-0.5, 2.0), 0.25])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_open_window_is_torch_hardtanhs_gradient(
    clip: Any, keep: str, dtype: torch.dtype
) -> None:
    # torch's own hardtanh passes the gradient where low < x < high: 0 at the bounds.
    low, high = (-clip, clip) if isinstance(clip, float) else clip
    op = go.straight_through(_sign, clip=clip, inclusive=False, keep=keep)
    x = torch.tensor([*_neighbours(low, high), 0.0, -0.0, 5.0, -5.0, (low + high) / 2],
                     dtype=dtype)
    g = torch.linspace(-3, 3, x.numel(), dtype=dtype)
    _, gx = _grad(op, x, g)
    _, expected = _grad(lambda t: torch.nn.functional.hardtanh(t, low, high), x, g)
    assert torch.equal(gx, expected)
    # the default, inclusive=True, is not hardtanh's at the bounds
    _, closed = _grad(go.straight_through(_sign, clip=clip, keep=keep), x, g)
    assert not torch.equal(closed, expected)


@pytest.mark.compile
@_TORCH_CTX_WARNING
@pytest.mark.parametrize("keep", ["input", "mask"])
@pytest.mark.parametrize(
    "clip,inclusive,window,ends", ENDS_CASES[:5], ids=_ENDS_IDS[:5]
)
def test_ends_compile_with_dynamic_shapes_and_match_eager(
    clip: Any, inclusive: Any, window: tuple[float, float], ends: tuple[bool, bool], keep: str
) -> None:
    op = go.straight_through(_sign, clip=clip, inclusive=inclusive, keep=keep)
    edges = _neighbours(*window)
    inputs = [torch.tensor([*edges, -2.0, 0.0, 2.0]),
              torch.tensor([*edges, -3.0, -0.25, 0.5, 1.5, -0.0])]
    assert_dynamic_compile_matches_eager(op, inputs)
    for x in inputs:
        g = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
        assert torch.equal(_grad(op, x, g)[1], _window_with_ends(x, g, *window, ends))


@pytest.mark.compile
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inclusive", [False, (True, False), (False, True)], ids=str)
def test_open_ends_rounded_to_the_dtype_alike_eager_and_inductor(
    dtype: torch.dtype, inclusive: Any
) -> None:
    # 0.3 rounds up in float16 and bfloat16: the rounded bound itself is left out of an open
    # end in eager mode, and must be left out when compiled (where half is computed in
    # float32) too.
    op = go.straight_through(_sign, clip=0.3, inclusive=inclusive)
    x = torch.tensor([0.3, -0.3, 0.2998, -0.2998, 0.5], dtype=dtype)
    assert_consistent(op, x, modes=("compile",), backend="inductor")
    ends = parse = (inclusive, inclusive) if isinstance(inclusive, bool) else inclusive
    del parse
    g = torch.ones(5, dtype=dtype)
    assert torch.equal(_grad(op, x, g)[1], _window_with_ends(x, g, -0.3, 0.3, ends))


def test_inclusive_shows_in_the_repr_unless_it_is_the_default() -> None:
    closed = go.straight_through(_sign, clip=1.0)
    opened = go.straight_through(_sign, clip=1.0, inclusive=False, keep="mask")
    half = go.straight_through(_sign, clip=(0.0, 1.0), inclusive=(True, False))
    assert "backward=straight_through(clip=1.0, keep='input')>" in repr(closed)
    assert "backward=straight_through(clip=1.0, inclusive=False, keep='mask')>" in repr(opened)
    assert "straight_through(clip=(0.0, 1.0), inclusive=(True, False), keep='input')" in (
        repr(half)
    )


@pytest.mark.parametrize(
    "options,error,message",
    [
        ({"inclusive": False}, go.GradOverrideError,
         r"straight_through got inclusive=False without `clip=`; .* Add `clip=` or drop "
         r"`inclusive`\."),
        ({"clip": 1.0, "inclusive": "open"}, go.GradOverrideTypeError,
         r"straight_through: `inclusive` must be True \(both ends belong to the window, low "
         r"<= x <= high\), False \(neither: low < x < high\) or a pair of bools \(low end, "
         r"high end\); got str 'open'\."),
        ({"clip": 1.0, "inclusive": (True, 1)}, go.GradOverrideTypeError,
         r"`inclusive` must be True .*; got tuple \(True, 1\)\."),
        ({"clip": 0.0, "inclusive": False}, go.GradOverrideError,
         r"straight_through: the window \(-0\.0, 0\.0\) with inclusive=\(False, False\) is "
         r"empty, so no gradient would pass anywhere; widen the window or make both ends "
         r"inclusive\."),
        ({"clip": (1.0, 1.0), "inclusive": (True, False)}, go.GradOverrideError,
         r"the window \(1\.0, 1\.0\) with inclusive=\(True, False\) is empty"),
    ],
)
def test_inclusive_mistakes_are_errors_that_name_the_fix(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        go.straight_through(_sign, **options)


def test_a_closed_window_of_one_point_passes_only_there() -> None:
    op = go.straight_through(_sign, clip=(1.0, 1.0))
    x = torch.tensor([math.nextafter(1.0, 0.0), 1.0, math.nextafter(1.0, 2.0)],
                     dtype=torch.float64)
    assert _grad(op, x, torch.ones(3, dtype=torch.float64))[1].tolist() == [0, 1, 0]


def test_inclusive_pickles_with_the_op() -> None:
    import pickle

    op = go.straight_through(torch.sign, clip=1.0, inclusive=(False, True), keep="mask")
    again = pickle.loads(pickle.dumps(op))
    x = torch.tensor([-1.0, 1.0, 0.5])
    assert _grad(again, x, torch.ones(3))[1].tolist() == [0, 1, 1]


# ---- keep="mask": the eager block-by-block form -------------------------------------------------
#
# Large contiguous CPU inputs take the block-by-block form (`_straight_through._BLOCK`
# elements per block); the rest (small, strided, under a transform, with create_graph) take
# the whole-tensor form. Each must give keep="input"'s gradient exactly.


def _large(dtype: torch.dtype, n: int) -> torch.Tensor:
    x = torch.randn(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 1.5
    x[:8] = torch.tensor([1.0, -1.0, 0.5, 0.0, -0.0, math.inf, -math.inf, 1.0000001])
    x[-3:] = torch.tensor([-1.0, 1.0, 2.0])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", gst.FLOAT_DTYPES, ids=str)
@pytest.mark.parametrize("inclusive", [True, False, (False, True)], ids=str)
def test_mask_block_by_block_matches_keeping_the_input(dtype: torch.dtype, inclusive: Any) -> None:
    from gradoverride._straight_through import _BLOCK

    n = 2 * _BLOCK + 12345  # two whole blocks and a partial one
    x = _large(dtype, n)
    g = torch.randn(n, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    g[5:7] = math.inf  # an infinite upstream gradient outside the window: 0, not NaN
    g = g.to(dtype)
    by_mask = go.straight_through(_sign, clip=(-1.0, 1.0), inclusive=inclusive, keep="mask")
    by_input = go.straight_through(_sign, clip=(-1.0, 1.0), inclusive=inclusive)
    ends = (inclusive, inclusive) if isinstance(inclusive, bool) else inclusive
    expected = _window_with_ends(x, g, -1.0, 1.0, ends)
    for op in (by_mask, by_input):
        gx = _grad(op, x, g)[1]
        assert torch.equal(gx, expected)
        assert not torch.signbit(gx[expected == 0]).any()  # +0 where zeroed, as hardtanh gives


def test_mask_other_layouts_and_double_backward_match_keeping_the_input() -> None:
    from gradoverride._straight_through import _BLOCK

    op_mask = go.straight_through(_sign, clip=1.0, keep="mask")
    x = _large(torch.float32, 2 * _BLOCK + 7)
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(5))
    expected = _window(x, g, -1.0, 1.0)
    strided = torch.stack([x, x], 1)[:, 0]  # not contiguous
    assert not strided.is_contiguous()
    assert torch.equal(_grad(op_mask, strided, g)[1], expected)
    parameter = torch.nn.Parameter(x.clone())  # a weight: an nn.Parameter subclass
    (gp,) = torch.autograd.grad(op_mask(parameter), parameter, g)
    assert torch.equal(gp, expected)
    leaf = x.clone().requires_grad_()
    up = g.clone().requires_grad_()
    (gx,) = torch.autograd.grad(op_mask(leaf), leaf, up, create_graph=True)
    assert torch.equal(gx.detach(), expected)
    (gg,) = torch.autograd.grad(gx.sum(), up)  # d(gx)/d(upstream): the window itself
    assert torch.equal(gg, _window(x, torch.ones_like(x), -1.0, 1.0))


def test_mask_forward_makes_no_full_size_float_temporary() -> None:
    # The window's float temporaries are made block by block: a full-size one (`x.abs()`),
    # written to memory and read back, made keep="mask" 2.7x slower than keep="input".
    from torch.utils._python_dispatch import TorchDispatchMode

    from gradoverride._straight_through import _BLOCK

    class FullSizeFloats(TorchDispatchMode):
        """Records each op that makes a new full-size floating-point tensor."""

        def __init__(self, like: torch.Tensor) -> None:
            super().__init__()
            self.like, self.ops = like, list[str]()

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if (
                    isinstance(t, torch.Tensor)
                    and t.is_floating_point()
                    and t.numel() == self.like.numel()
                    and t.untyped_storage().data_ptr() != self.like.untyped_storage().data_ptr()
                ):
                    self.ops.append(str(func))
            return out

    x = torch.randn(4 * _BLOCK, requires_grad=True)
    for clip in (1.0, (-0.5, 1.0)):
        op = go.straight_through(_sign, clip=clip, keep="mask")
        op(x)  # the first call's checks done
        with FullSizeFloats(x) as mode:
            op(x)
        assert mode.ops == ["aten.sign.default"], mode.ops  # only the forward's own output
