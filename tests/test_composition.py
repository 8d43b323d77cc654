"""Composition with the rest of PyTorch: torch.compile, torch.func, gradcheck, higher-order
gradients, once_differentiable, autocast and threads.

Every op here has a rule whose gradient differs from what autograd would compute through
the forward (unless the test is about the true derivative), so a transform that silently
ignores the rule fails the comparison.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import tolerance
from ops import pair_product, quantize, scale, sin_cos
from torch.func import grad, jacrev, vmap

import gradoverride as go
from gradoverride.testing import assert_consistent, check_backward

# ---- ops used across the file ---------------------------------------------------------------


@go.custom_backward(residuals=("norm",))
def normalize(x: torch.Tensor) -> Any:
    norm = x.norm()
    return x / norm, {"norm": norm}


@normalize.backward
def _(grad: torch.Tensor, *, norm: torch.Tensor) -> torch.Tensor:
    return grad / norm  # ignores the norm's own dependence on x: a deliberate override


def _expected_quantize(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return g * (x.abs() <= 1)


# ---- torch.compile ------------------------------------------------------------------------
# `assert_consistent` compiles with fullgraph=True (a graph break fails) and compares outputs
# and gradients with eager mode; `check_backward` pins eager mode to the rule's formula.


@pytest.mark.compile
def test_compile_single_output_inductor() -> None:
    """The one test with the default (inductor) backend."""
    x = torch.linspace(-1.5, 1.5, 6)
    c = torch.arange(6.0)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return (quantize(x) * c).sum()

    check_backward(loss, x, reference=_expected_quantize(x, c))
    assert_consistent(loss, x, modes=("compile",), backend="inductor")


@pytest.mark.compile
def test_compile_partial_override() -> None:
    x = torch.tensor([0.5, -1.0, 2.0])
    w = torch.tensor([3.0, 0.25, -1.0])
    c = torch.tensor([1.0, 2.0, 3.0])

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (scale(x, w) * c).sum()

    # the rule for `x`, ordinary autograd for `w`
    check_backward(loss, x, w, reference={"x": 2 * w * c, "w": x * c})
    assert_consistent(scale, x, w, modes=("compile",))


@pytest.mark.compile
def test_compile_container_input() -> None:
    a = torch.tensor([1.0, -2.0, 0.5])
    b = torch.tensor([0.25, 4.0, -3.0])

    def loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return pair_product((a, b)).sum()

    check_backward(loss, a, b, reference={"a": b + 1, "b": a - 1})
    assert_consistent(pair_product, (a, b), modes=("compile",))


@pytest.mark.compile
def test_compile_multi_output() -> None:
    x = torch.tensor([0.1, 1.0, -2.0])

    def loss(x: torch.Tensor) -> torch.Tensor:
        s, c = sin_cos(x)
        return (2 * s + 3 * c).sum()

    check_backward(loss, x, reference=2 * x.cos() - 3 * x.sin() + 0.5)
    assert_consistent(sin_cos, x, modes=("compile",))


@pytest.mark.compile
def test_compile_residuals() -> None:
    x = torch.tensor([3.0, 4.0])
    c = torch.tensor([1.0, -2.0])

    def loss(x: torch.Tensor) -> torch.Tensor:
        return (normalize(x) * c).sum()

    check_backward(loss, x, reference=c / 5.0)
    assert_consistent(normalize, x, modes=("compile",))


# ---- torch.func ---------------------------------------------------------------------------


def _leaves(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def _eager_grads(
    fn: Callable[..., torch.Tensor], *inputs: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    leaves = _leaves(*inputs)
    return torch.autograd.grad(fn(*leaves), leaves)


def _eager_jacobian(
    fn: Callable[..., torch.Tensor], *inputs: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Row by row with torch.autograd.grad: d out / d input for each input."""
    leaves = _leaves(*inputs)
    out = fn(*leaves)
    rows: list[tuple[torch.Tensor, ...]] = []
    for i in range(out.numel()):
        basis = torch.zeros(out.numel(), dtype=out.dtype)
        basis[i] = 1
        rows.append(torch.autograd.grad(out, leaves, basis.view_as(out), retain_graph=True))
    return tuple(
        torch.stack([row[k] for row in rows]).reshape(*out.shape, *leaves[k].shape)
        for k in range(len(leaves))
    )


def test_func_grad_vmap_jacrev_full_owning() -> None:
    x = torch.linspace(-1.6, 1.6, 5)
    c = torch.linspace(1.0, 2.0, 5)

    def loss(x: torch.Tensor) -> torch.Tensor:
        return (quantize(x) * c).sum()

    check_backward(loss, x, reference=_expected_quantize(x, c))
    torch.testing.assert_close(grad(loss)(x), _expected_quantize(x, c))

    # vmap of vjp against a loop of eager runs, outputs and gradients, sample by sample
    xb = torch.linspace(-2.0, 2.0, 15).reshape(3, 5)
    assert_consistent(quantize, x, modes=("vmap",), samples=[(r,) for r in xb])

    (eager_jac,) = _eager_jacobian(quantize, x)
    torch.testing.assert_close(jacrev(quantize)(x), eager_jac)
    torch.testing.assert_close(eager_jac, torch.diag((x.abs() <= 1).to(x.dtype)))


def test_func_grad_vmap_jacrev_partial_override() -> None:
    x = torch.tensor([0.5, -1.0, 2.0])
    w = torch.tensor([3.0, 0.25, -1.0])
    c = torch.tensor([1.0, 2.0, 3.0])

    def loss(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (scale(x, w) * c).sum()

    expected = (2 * w * c, x * c)
    check_backward(loss, x, w, reference=expected)
    torch.testing.assert_close(grad(loss, argnums=(0, 1))(x, w), expected)

    xb = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    wb = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(vmap(scale)(xb, wb), xb * wb)
    assert_consistent(scale, x, w, modes=("vmap",), samples=list(zip(xb, wb, strict=True)))
    # w unbatched (in_dims=None), which assert_consistent does not form: per-example gradients
    got_x = vmap(grad(loss), in_dims=(0, None))(xb, w)
    torch.testing.assert_close(got_x, torch.stack([_eager_grads(loss, xi, w)[0] for xi in xb]))

    jx, jw = jacrev(scale, argnums=(0, 1))(x, w)
    ex, ew = _eager_jacobian(scale, x, w)
    torch.testing.assert_close(jx, ex)
    torch.testing.assert_close(jw, ew)
    torch.testing.assert_close(jx, torch.diag(2 * w))
    torch.testing.assert_close(jw, torch.diag(x))


# ---- gradcheck / gradgradcheck (rules equal to the true derivative) ------------------------


@go.custom_backward
def exact_sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@exact_sin.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad * x.cos()


@go.custom_backward
def exact_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


@exact_mul.backward
def _(grad: torch.Tensor, *, x: torch.Tensor, w: torch.Tensor) -> Any:
    return grad * w, grad * x


@go.custom_backward(owns="x")
def exact_mul_partial(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


@exact_mul_partial.backward
def _(grad: torch.Tensor, *, w: torch.Tensor) -> torch.Tensor:
    return grad * w


@go.custom_backward
def exact_sin_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.sin(), x.cos()


@exact_sin_cos.backward
def _(gs: torch.Tensor, gc: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return gs * x.cos() - gc * x.sin()


def _f64(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_()


@pytest.mark.parametrize(
    ("op", "n_inputs"),
    [(exact_sin, 1), (exact_mul, 2), (exact_sin_cos, 1)],
    ids=["sin", "mul", "sin_cos"],
)
def test_gradcheck_and_gradgradcheck(op: Any, n_inputs: int) -> None:
    inputs = tuple(_f64(3, 2, seed=i) for i in range(n_inputs))
    assert torch.autograd.gradcheck(op, inputs)
    assert torch.autograd.gradgradcheck(op, inputs)


def test_gradcheck_partial_override() -> None:
    inputs = (_f64(3, 2, seed=0), _f64(3, 2, seed=1))
    assert torch.autograd.gradcheck(exact_mul_partial, inputs)


def test_partial_override_second_order_is_the_documented_one() -> None:
    """README: with owns=, d(grad_x)/dw comes from the rule's graph; d(grad_w)/dx is zero
    (the non-owned input's gradient is computed with x held constant)."""
    x = _f64(3, seed=0)
    w = _f64(3, seed=1)
    gx, gw = torch.autograd.grad(exact_mul_partial(x, w).sum(), (x, w), create_graph=True)
    torch.testing.assert_close(gx, w.detach())
    torch.testing.assert_close(gw.detach(), x.detach())
    # d(grad_x)/dw through the rule
    (dgx_dw,) = torch.autograd.grad(gx.sum(), w, retain_graph=True)
    torch.testing.assert_close(dgx_dw, torch.ones_like(w))
    # total second order of (grad_x + grad_w): d/dx gets no d(grad_w)/dx term
    ddx, ddw = torch.autograd.grad(
        (gx + gw).sum(), (x, w), allow_unused=True, materialize_grads=True
    )
    torch.testing.assert_close(ddx, torch.zeros_like(x))
    torch.testing.assert_close(ddw, torch.ones_like(w))


# ---- once_differentiable ------------------------------------------------------------------


@go.custom_backward
def once_sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@once_sin.backward(once_differentiable=True)
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad * x.cos()


def test_once_differentiable_first_order_is_right() -> None:
    x = torch.linspace(-2, 2, 7, requires_grad=True)
    (gx,) = torch.autograd.grad(once_sin(x).sum(), x)
    torch.testing.assert_close(gx, x.detach().cos())
    # also with create_graph=True (the result is usable, only differentiating it raises)
    (gx,) = torch.autograd.grad(once_sin(x).sum(), x, create_graph=True)
    torch.testing.assert_close(gx.detach(), x.detach().cos())
    xs = torch.linspace(-2, 2, 7)
    torch.testing.assert_close(grad(lambda t: once_sin(t).sum())(xs), xs.cos())


def test_once_differentiable_second_order_raises_in_eager() -> None:
    x = torch.linspace(-2, 2, 7, requires_grad=True)
    (gx,) = torch.autograd.grad(once_sin(x).sum(), x, create_graph=True)
    with pytest.raises(go.GradOverrideError, match="once_differentiable"):
        torch.autograd.grad(gx.sum(), x)


def test_once_differentiable_second_order_raises_under_func_grad() -> None:
    with pytest.raises(go.GradOverrideError, match="once_differentiable"):
        grad(grad(lambda t: once_sin(t)))(torch.tensor(0.3))


def test_second_derivative_without_once_differentiable() -> None:
    x = torch.linspace(-2, 2, 7, dtype=torch.float64, requires_grad=True)
    (gx,) = torch.autograd.grad(exact_sin(x).sum(), x, create_graph=True)
    (ggx,) = torch.autograd.grad(gx.sum(), x)
    torch.testing.assert_close(ggx, -x.detach().sin())
    t = torch.tensor(0.3, dtype=torch.float64)
    torch.testing.assert_close(grad(grad(lambda t: exact_sin(t)))(t), -t.sin())


# ---- autocast -----------------------------------------------------------------------------


def _matmul_op(owns: str | None, device_type: str) -> tuple[Any, list[tuple[bool, Any]]]:
    seen: list[tuple[bool, Any]] = []

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w

    if owns is None:

        def rule(g: torch.Tensor, *, x: torch.Tensor, w: torch.Tensor) -> Any:
            seen.append((torch.is_autocast_enabled(device_type), g.dtype))
            return g @ w.t(), x.t() @ g

        op = go.custom_backward(mm, backward=rule)
    else:

        def rule_x(g: torch.Tensor, *, w: torch.Tensor) -> torch.Tensor:
            seen.append((torch.is_autocast_enabled(device_type), g.dtype))
            return g @ w.t()

        op = go.custom_backward(mm, backward=rule_x, owns=owns)
    return op, seen


def _check_autocast(device: str, dtype: torch.dtype, owns: str | None) -> None:
    op, seen = _matmul_op(owns, device)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 3, generator=gen).to(device)
    w0 = torch.randn(3, 2, generator=gen).to(device)
    x, w = _leaves(x0, w0)
    with torch.autocast(device, dtype=dtype):
        y = op(x, w)
    assert y.dtype == dtype  # the matmul ran under autocast
    assert not torch.is_autocast_enabled(device)
    (y.float() * torch.arange(8.0, device=device).view(4, 2)).sum().backward()  # outside

    assert seen == [(True, dtype)]  # the rule ran under the forward's autocast state
    assert x.grad is not None and w.grad is not None
    assert x.grad.dtype == torch.float32
    assert w.grad.dtype == torch.float32

    # the same computation through plain autograd under autocast
    xr, wr = _leaves(x0, w0)
    with torch.autocast(device, dtype=dtype):
        yr = xr @ wr
    (yr.float() * torch.arange(8.0, device=device).view(4, 2)).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, **tolerance(dtype))
    torch.testing.assert_close(w.grad, wr.grad, **tolerance(dtype))


@pytest.mark.parametrize("owns", [None, "x"], ids=["owns_all", "owns_x"])
def test_autocast_cpu_bfloat16(owns: str | None) -> None:
    _check_autocast("cpu", torch.bfloat16, owns)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available on this machine")
@pytest.mark.parametrize("owns", [None, "x"], ids=["owns_all", "owns_x"])
def test_autocast_cuda_float16(owns: str | None) -> None:
    _check_autocast("cuda", torch.float16, owns)


# ---- threads ------------------------------------------------------------------------------


@pytest.mark.parametrize("op_kind", ["owning", "partial", "multi_output"])
def test_two_threads_forward_backward(op_kind: str) -> None:
    iterations = 200
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def work(seed: int, shape: tuple[int, ...]) -> None:
        try:
            gen = torch.Generator().manual_seed(seed)
            barrier.wait()
            for _ in range(iterations):
                x0 = torch.randn(*shape, generator=gen) * 1.5
                w0 = torch.randn(*shape, generator=gen)
                x, w = _leaves(x0, w0)
                if op_kind == "owning":
                    (quantize(x) * w0).sum().backward()
                    torch.testing.assert_close(x.grad, _expected_quantize(x0, w0))
                elif op_kind == "partial":
                    scale(x, w).sum().backward()
                    torch.testing.assert_close(x.grad, 2 * w0)
                    torch.testing.assert_close(w.grad, x0)
                else:
                    s, c = sin_cos(x)
                    (s * w0 + c).sum().backward()
                    torch.testing.assert_close(x.grad, w0 * x0.cos() - x0.sin() + 0.5)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)
            barrier.abort()

    threads = [
        threading.Thread(target=work, args=(1, (3,))),
        threading.Thread(target=work, args=(2, (5, 2))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]


# ---- every other form compiles with fullgraph=True too --------------------------------------


@go.custom_backward
def _once_sin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@_once_sin.backward(once_differentiable=True)
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return grad * x.cos()


@go.custom_backward
def _dict_out(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"a": x * 2, "b": x.exp()}


@_dict_out.backward
def _(grad: dict[str, torch.Tensor], *, output: dict[str, torch.Tensor]) -> torch.Tensor:
    return grad["a"] * 2 + grad["b"] * output["b"]


_sign = go.custom_backward(torch.sign, backward=lambda grad, *, input: grad * (input.abs() <= 1))


@go.custom_backward(materialize_grads=False)
def _two(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x * 2, x * 3


@_two.backward
def _(g1: torch.Tensor | None, g2: torch.Tensor | None) -> Any:
    # Eager sends None for the unused second output; a compiled backward sends zeros
    # (AOTAutograd materializes them), as the README says, so accept both.
    total = 0 if g1 is None else g1 * 2
    return total if g2 is None else total + g2 * 3


@go.custom_backward
def _scaled(x: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
    return x * scale


@_scaled.backward
def _(grad: torch.Tensor, *, scale: float) -> torch.Tensor:
    return grad * scale


def _under_autocast(x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _once_sin(x).float()


@pytest.mark.compile
@pytest.mark.parametrize(
    "fn",
    [
        _once_sin,
        lambda x: _dict_out(x)["a"] + _dict_out(x)["b"],
        _sign,
        lambda x: _two(x)[0],
        lambda x: _scaled(x, scale=3.0),
        _under_autocast,
    ],
    ids=["once_differentiable", "dict_output", "builtin", "materialize_false", "keyword_only",
         "autocast"],
)
def test_other_forms_compile_with_fullgraph(fn: Any) -> None:
    assert_consistent(fn, torch.linspace(-2.0, 2.0, 7), modes=("compile",))
