"""The private torch pieces in `gradoverride._internals`: found on the tested torch, and the
public fallback path gives the same gradients as the fast one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._functorch.utils as functorch_utils
from ops import pair_product, quantize, scale, sin_cos

import gradoverride as go
import gradoverride._function as go_function
import gradoverride._internals as internals

# ---- the private pieces are found ----------------------------------------------------------


def test_fast_apply_is_available_on_this_torch() -> None:
    # A torch upgrade that moves `_FunctionBase.apply` would silently slow every call down;
    # this makes it a failing test instead.
    assert internals.FAST_APPLY is True


def test_private_torch_pieces_are_the_real_ones() -> None:
    assert internals.transforms_active is torch._C._are_functorch_transforms_active
    assert internals.any_autocast_enabled is torch._C._is_any_autocast_enabled


# ---- the fallback path (`Function.apply`) equals the fast path ------------------------------


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=gen) * 1.5
    w = torch.randn(4, 3, generator=gen)
    c = torch.randn(4, 3, generator=gen)
    return x, w, c


def _case_quantize(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (quantize(x) * c).sum() + (quantize(w, bits=3) * c).sum()


def _case_scale(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (scale(x, w) * c).sum()


def _case_sin_cos(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    s, k = sin_cos(x * w)
    return (s * c + k).sum()


def _case_container(x: torch.Tensor, w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return (pair_product((x, w), shift=2.0) * c).sum()


CASES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "owning": _case_quantize,
    "partial": _case_scale,
    "multi_output": _case_sin_cos,
    "container": _case_container,
}


def _grads(case: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
    x, w, c = _inputs()
    x.requires_grad_()
    w.requires_grad_()
    out = case(x, w, c)
    return (out.detach(), *torch.autograd.grad(out, (x, w)))


@pytest.fixture
def apply_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts calls of `Function.apply`'s dead-wrapper unwrapping (only `cls.apply` does it)."""
    calls: list[int] = []
    original = functorch_utils.unwrap_dead_wrappers

    def counting(args: Any) -> Any:
        calls.append(1)
        return original(args)

    monkeypatch.setattr(functorch_utils, "unwrap_dead_wrappers", counting)
    return calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_fallback_path_gives_identical_gradients(
    name: str, monkeypatch: pytest.MonkeyPatch, apply_calls: list[int]
) -> None:
    case = CASES[name]
    fast = _grads(case)
    assert apply_calls == [], "the fast path should not go through Function.apply"

    monkeypatch.setattr(go_function, "FAST_APPLY", False)
    slow = _grads(case)
    assert apply_calls, "with FAST_APPLY off the op should call Function.apply"

    for f, s in zip(fast, slow, strict=True):
        assert torch.equal(f, s)


# ---- NOTE [functorch vjp and autograd interaction] -----------------------------------------


@go.custom_backward
def mymul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


@mymul.backward
def _(grad: torch.Tensor, *, a: torch.Tensor, b: torch.Tensor) -> Any:
    return grad * b, grad * a


@go.custom_backward
def mysin(x: torch.Tensor) -> torch.Tensor:
    return x.sin()


@mysin.backward
def _(grad: torch.Tensor, *, x: torch.Tensor) -> torch.Tensor:
    return mymul(grad, x.cos())  # another custom_backward op, called from the rule


@pytest.mark.parametrize("fast_apply", [True, False], ids=["fast", "fallback"])
def test_vjp_fn_with_dead_wrappers_is_differentiable(
    fast_apply: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's NOTE [functorch vjp and autograd interaction]: the rule runs from `vjp_fn`
    after the transform finished, on tensors saved under it ("dead" wrappers)."""
    monkeypatch.setattr(go_function, "FAST_APPLY", fast_apply)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)
    gy = torch.randn(5, generator=gen, dtype=torch.float64, requires_grad=True)

    y, vjp_fn = torch.func.vjp(mysin, x)
    torch.testing.assert_close(y, x.detach().sin())
    (result,) = vjp_fn(gy)
    torch.testing.assert_close(result.detach(), (gy * x.cos()).detach())

    gx, ggy = torch.autograd.grad(result, (x, gy), torch.ones_like(result))
    torch.testing.assert_close(gx, (-gy * x.sin()).detach())
    torch.testing.assert_close(ggy, x.detach().cos())


def test_private_pieces_used_by_modules_and_recipes_exist() -> None:
    # Listed in gradoverride/_internals.py; each has a fallback or a clear error, but a torch
    # upgrade that removes one should fail here first.
    from torch.nn.utils.stateless import _reparametrize_module

    assert callable(_reparametrize_module)
    assert callable(torch._assert_async)
    assert hasattr(torch.ops.aten, "_softmax_backward_data")
    assert callable(torch.autograd.Variable._execution_engine.queue_callback)
    for name in ("_foreach_norm", "_foreach_sign", "_foreach_mul", "_foreach_sign_"):
        assert callable(getattr(torch, name)), name


def test_graph_task_id_tells_backward_passes_apart() -> None:
    from gradoverride._internals import graph_task_id

    seen: list[int | None] = []
    x = torch.ones(2, requires_grad=True)
    for _ in range(2):
        y = x * 2
        y.register_hook(lambda g: seen.append(graph_task_id()))
        y.sum().backward()
    assert graph_task_id() == -1
    assert None not in seen and seen[0] != seen[1], seen


def test_import_gradoverride_does_not_import_dynamo() -> None:
    # `import torch._dynamo` alone costs over a second, twenty times the import budget.
    import subprocess
    import sys

    code = (
        "import sys, gradoverride, gradoverride.recipes, gradoverride.testing; "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


# ---- add_tensor_hook: Tensor.register_hook without its handle --------------------------------


def test_fast_tensor_hooks_are_available_on_this_torch() -> None:
    assert internals.FAST_TENSOR_HOOKS is True


@pytest.mark.parametrize("fast", [True, False])
def test_add_tensor_hook_transforms_as_register_hook_does(
    fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(internals, "FAST_TENSOR_HOOKS", fast)
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    h = x * 2
    internals.add_tensor_hook(h, lambda g: g * 10)
    # A hook registered later on the same tensor runs after it, and neither replaces the
    # other (the fast path takes its key from the handles' counter).
    handle = h.register_hook(lambda g: g + 1)
    (h * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    torch.testing.assert_close(x.grad, (torch.tensor([1.0, 2.0, 3.0]) * 10 + 1) * 2)
    handle.remove()


def test_add_tensor_hook_under_a_torch_function_mode_is_register_hook() -> None:
    from torch.overrides import TorchFunctionMode

    seen: list[str] = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = torch.ones(3, requires_grad=True)
    h = x * 2
    with Watch():
        internals.add_tensor_hook(h, lambda g: g * 10)
    assert "register_hook" in seen
    h.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 20.0))
