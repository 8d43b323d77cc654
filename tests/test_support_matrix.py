"""One test per cell of the support matrix (`gradoverride/_support_matrix.py`), twice.

A supported cell must give eager mode's gradients (eager mode itself is checked against each
case's independent reference); a refused cell must raise the error the table names. The
published page (`docs/support-matrix.md`) must be the table's own rendering.

Each cell runs on a fresh module (`first`: the context makes the first call, as a model
compiled before it ever ran) and on a warm one (`warm`: the module was called once already,
forward and backward with other inputs, so its first call's check is behind it); for
save/load and deepcopy, the copy of a warm module is called twice.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matrix_cases
import pytest
import torch
from matrix_cases import CASES, Grads
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import gradoverride as go
from gradoverride import _support_matrix as matrix

pytestmark = pytest.mark.filterwarnings(
    # torch's own warnings while compiling and scripting, not gradoverride's.
    "ignore:.*should not be instantiated:DeprecationWarning",
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning",
    "ignore:The .grad attribute of a Tensor that is not a leaf",
)

_gen = torch.Generator().manual_seed(0)
# Inputs away from the ops' kinks (rounding ties at multiples of 1/8, the clip bound at 1).
X = (torch.rand(4, 3, generator=_gen) * 2.6 - 1.3).clamp(-1.3, 1.3)
X = torch.where((X * 8).frac().abs() < 0.1, X + 0.03, X)
UP = torch.randn(4, 3, generator=_gen)

CONTEXTS = [key for key, _ in matrix.CONTEXTS]
KINDS = [key for key, _ in matrix.KINDS]


def gradients(
    module: nn.Module,
    x: Tensor,
    up: Tensor,
    call: Callable[[Tensor], Tensor] | None = None,
    after: Callable[[Tensor], Tensor] | None = None,
) -> Grads:
    """d sum(after(call(x)) * up) / d(x and each parameter of `module`)."""
    x = x.clone().requires_grad_()
    out = (module if call is None else call)(x)
    if after is not None:
        out = after(out)
    names = ["x", *(name for name, _ in module.named_parameters())]
    tensors = [x, *(p for _, p in module.named_parameters())]
    grads = torch.autograd.grad((out * up).sum(), tensors, allow_unused=True)
    return {
        n: torch.zeros_like(t) if g is None else g
        for n, t, g in zip(names, tensors, grads, strict=True)
    }


def assert_same(got: Grads, expected: Grads, *, keys: Any = None, **tolerance: float) -> None:
    for name in keys or expected:
        assert got[name].dtype == expected[name].dtype, name
        torch.testing.assert_close(got[name], expected[name], msg=lambda m, n=name: f"{n}: {m}",
                                   **tolerance)


def eager(kind: str, x: Tensor = X, up: Tensor = UP, **kw: Any) -> Grads:
    return gradients(CASES[kind].build(), x, up, **kw)


# ---- the contexts ------------------------------------------------------------------------


def run_eager(kind: str) -> None:
    case = CASES[kind]
    module = case.build()
    assert_same(gradients(module, X, UP), case.reference(module, X, UP))


def run_compile(kind: str, dynamic: bool = False) -> None:
    # Many cases share `OpModule.forward`; without a reset dynamo would count the cases as
    # recompilations of one function and stop at its recompile limit.
    torch._dynamo.reset()
    module = CASES[kind].build()  # fresh: the first call is the compiled one
    compiled = torch.compile(module, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    assert_same(gradients(module, X, UP, call=compiled), eager(kind))
    if dynamic:
        x2, up2 = X[:2] * 0.5, UP[:2]
        assert_same(gradients(module, x2, up2, call=compiled), eager(kind, x2, up2))


def run_func_grad(kind: str) -> None:
    module = CASES[kind].build()
    got = torch.func.grad(lambda x: (module(x) * UP).sum())(X)
    assert_same({"x": got}, eager(kind), keys=["x"])


def run_vmap(kind: str) -> None:
    module = CASES[kind].build()
    xs, ups = torch.stack([X, X * 0.5]), torch.stack([UP, -UP])
    got = torch.func.vmap(torch.func.grad(lambda x, up: (module(x) * up).sum()))(xs, ups)
    for k in range(2):
        assert_same({"x": got[k]}, eager(kind, xs[k], ups[k]), keys=["x"])


def run_functional_call(kind: str) -> None:
    module = CASES[kind].build()
    params = {n: (p.detach() * 1.1 + 0.05).requires_grad_() for n, p in module.named_parameters()}
    x = X.clone().requires_grad_()
    out = functional_call(module, params, (x,))
    names = ["x", *params]
    grads = torch.autograd.grad((out * UP).sum(), [x, *params.values()], allow_unused=True)
    got = {n: torch.zeros_like(t) if g is None else g
           for n, t, g in zip(names, [x, *params.values()], grads, strict=True)}
    expected_module = CASES[kind].build()
    with torch.no_grad():
        for name, p in expected_module.named_parameters():
            p.copy_(params[name])
    assert_same(got, gradients(expected_module, X, UP))


def run_checkpoint(kind: str) -> None:
    module = CASES[kind].build()
    expected = eager(kind)
    got = gradients(module, X, UP, call=lambda x: checkpoint(module, x, use_reentrant=False))
    assert_same(got, expected)
    # The reentrant form supports `.backward()` only (not torch.autograd.grad).
    x = X.clone().requires_grad_()
    module.zero_grad()
    (checkpoint(module, x, use_reentrant=True) * UP).sum().backward()
    got = {"x": x.grad, **{
        n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in module.named_parameters()
    }}
    assert_same(got, expected)


def run_inplace_after(kind: str) -> None:
    # The input is used again after the in-place op: an output sharing its memory behind
    # autograd's back would give that use a wrong gradient.
    module = CASES[kind].build()

    def program(inplace: bool) -> Grads:
        x = X.clone().requires_grad_()
        h = x * 1.0
        out = module(h)
        out = out.relu_() if inplace else torch.relu(out)
        loss = (out * UP).sum() + (h * 5).sum()
        params = [p for _, p in module.named_parameters()]
        grads = torch.autograd.grad(loss, [x, *params], allow_unused=True)
        names = ["x", *(n for n, _ in module.named_parameters())]
        return {n: torch.zeros_like(t) if g is None else g
                for n, t, g in zip(names, [x, *params], grads, strict=True)}

    assert_same(program(inplace=True), program(inplace=False))


def run_save_load(kind: str) -> None:
    saved = CASES[kind].saved
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_same(gradients(loaded, X, UP), gradients(saved, X, UP))


def run_deepcopy(kind: str) -> None:
    saved = CASES[kind].saved
    assert_same(gradients(copy.deepcopy(saved), X, UP), gradients(saved, X, UP))


def run_script(kind: str) -> None:
    # The kind's own module form: a function kind's `op.module()` / `recipe.module()`.
    module = CASES[kind].build()
    op = getattr(module, "op", None)
    form = op.module() if hasattr(op, "module") else module
    torch.jit.script(form)


def run_autocast(kind: str) -> None:
    module = CASES[kind].build()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = gradients(module, X, UP)
    assert_same(got, eager(kind), rtol=5e-2, atol=5e-2)


def run_threads(kind: str) -> None:
    module = CASES[kind].build()  # fresh: both threads make its first call at once
    expected = eager(kind)
    start = threading.Barrier(2)
    results: list[Grads | BaseException] = []

    def work() -> None:
        try:
            start.wait()
            for _ in range(3):
                results.append(gradients(module, X, UP))
        except BaseException as exc:  # reported in the main thread
            results.append(exc)

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
        assert_same(result, expected)


def run_export(kind: str) -> None:
    module = CASES[kind].build()
    exported = torch.export.export(module, (X,)).module()
    torch.testing.assert_close(exported(X), module(X))


def run_monitor(kind: str) -> None:
    module = CASES[kind].build()
    expected = eager(kind)
    with go.monitor(module) as mon:
        got = gradients(module, X, UP)
    assert_same(got, expected)
    assert mon.history, f"{kind}: nothing recorded"
    records = [r for rows in mon.history.values() for r in rows]
    assert all(r.calls >= 1 and math.isfinite(r.grad_in) and math.isfinite(r.grad_out)
               for r in records), records
    # The gradient at the module's output is the upstream one, so an override producing
    # that output receives exactly it.
    assert any(r.grad_in == pytest.approx(float(UP.norm()), rel=1e-6) for r in records) or (
        kind in ("grad_hook inputs", "grad_hook parameters")  # not at the output
    ), records


def _outputs_as_eager(kind: str, run: Callable[[nn.Module], Tensor],
                      frozen: bool = False) -> None:
    """`run(module)` (a forward where no gradient is computed) gives eager mode's outputs,
    requiring no grad."""
    module = CASES[kind].build()
    expected = module(X).detach()
    if frozen:
        for p in module.parameters():
            p.requires_grad_(False)
    out = run(module)
    assert not out.requires_grad
    torch.testing.assert_close(out, expected)


def run_no_grad(kind: str) -> None:
    def call(module: nn.Module) -> Tensor:
        with torch.no_grad():
            out: Tensor = module(X)
        return out

    _outputs_as_eager(kind, call)


def run_inference_mode(kind: str) -> None:
    def call(module: nn.Module) -> Tensor:
        with torch.inference_mode():
            out: Tensor = module(X)
        return out.clone()  # (an inference tensor: compared outside inference mode)

    _outputs_as_eager(kind, call)


def _compiled_forward(mode: Callable[[], Any]) -> Callable[[nn.Module], Tensor]:
    def call(module: nn.Module) -> Tensor:
        torch._dynamo.reset()
        compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
        with mode():
            out: Tensor = compiled(X)
        return out.clone()

    return call


def run_compile_frozen(kind: str) -> None:
    _outputs_as_eager(kind, _compiled_forward(torch.enable_grad), frozen=True)


def run_compile_transform(kind: str, vmapped: bool) -> None:
    torch._dynamo.reset()
    module = CASES[kind].build()
    grad_of = torch.func.grad(lambda x, up: (module(x) * up).sum())
    if vmapped:
        xs, ups = torch.stack([X, X * 0.5]), torch.stack([UP, -UP])
        got = torch.compile(torch.func.vmap(grad_of), backend="aot_eager")(xs, ups)
        for k in range(2):
            assert_same({"x": got[k]}, eager(kind, xs[k], ups[k]), keys=["x"])
    else:
        got = torch.compile(grad_of, backend="aot_eager")(X, UP)
        assert_same({"x": got}, eager(kind), keys=["x"])


def run_copy(kind: str) -> None:
    module = CASES[kind].build()
    copied = copy.copy(module)
    copied.train(False)  # its own mode: the original keeps training
    assert module.training
    copied.train(True)
    assert_same(gradients(copied, X, UP), eager(kind))


def replica_of(module: nn.Module) -> nn.Module:
    """What `torch.nn.parallel.replicate` makes for one device, step by step as it makes it
    (its broadcast needs CUDA): each module shallow-copied, holding copies of the
    parameters computed from them (not leaves: plain attributes, listed in
    `_former_parameters`), so their gradients reach the originals; the buffers shared."""
    from collections import OrderedDict

    copies = {id(m): m._replicate_for_data_parallel() for m in module.modules()}
    for replica in copies.values():
        replica._former_parameters = OrderedDict()
    for m in module.modules():
        replica = copies[id(m)]
        for name, child in m._modules.items():
            if child is None:
                replica._modules[name] = None
            else:
                setattr(replica, name, copies[id(child)])
        for name, p in m._parameters.items():
            if p is None:
                replica._parameters[name] = None
            else:
                setattr(replica, name, p * 1)
                replica._former_parameters[name] = replica.__dict__[name]
    return copies[id(module)]


def run_replica(kind: str) -> None:
    module = CASES[kind].build()
    replica = replica_of(module)
    x = X.clone().requires_grad_()
    out = replica(x)
    names = ["x", *(n for n, _ in module.named_parameters())]
    tensors = [x, *(p for _, p in module.named_parameters())]
    grads = torch.autograd.grad((out * UP).sum(), tensors, allow_unused=True)
    got = {n: torch.zeros_like(t) if g is None else g
           for n, t, g in zip(names, tensors, grads, strict=True)}
    assert_same(got, eager(kind))


RUN: dict[str, Callable[[str], None]] = {
    "eager": run_eager,
    "compile": run_compile,
    "compile dynamic": lambda kind: run_compile(kind, dynamic=True),
    "torch.func.grad": run_func_grad,
    "vmap": run_vmap,
    "functional_call": run_functional_call,
    "checkpoint": run_checkpoint,
    "in-place after": run_inplace_after,
    "save/load": run_save_load,
    "deepcopy": run_deepcopy,
    "torch.jit.script": run_script,
    "autocast": run_autocast,
    "threads": run_threads,
    "torch.export": run_export,
    "go.monitor": run_monitor,
    "no_grad": run_no_grad,
    "inference_mode": run_inference_mode,
    "compile no_grad": lambda kind: _outputs_as_eager(kind, _compiled_forward(torch.no_grad)),
    "compile inference_mode": lambda kind: _outputs_as_eager(
        kind, _compiled_forward(torch.inference_mode)
    ),
    "compile frozen": run_compile_frozen,
    "compile torch.func.grad": lambda kind: run_compile_transform(kind, vmapped=False),
    "compile vmap": lambda kind: run_compile_transform(kind, vmapped=True),
    "copy.copy": run_copy,
    "replica": run_replica,
}


def _marks(context: str) -> list[Any]:
    return [pytest.mark.compile] if context.startswith("compile") else []


def warm(module: nn.Module) -> nn.Module:
    """`module` after one forward and backward (other inputs, so nothing is reused)."""
    x = (X * 0.7).requires_grad_()
    (module(x) * UP).sum().backward()
    module.zero_grad()
    return module


def run_warm_copy(kind: str, how: str) -> None:
    """A copy of a warm module, called twice, and the original after it."""
    saved = CASES[kind].saved
    expected = gradients(saved, X, UP)
    gradients(saved, X, UP)  # the original is warm too
    if how == "deepcopy":
        copied = copy.deepcopy(saved)
    else:
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    for _ in range(2):
        assert_same(gradients(copied, X, UP), expected)
    assert_same(gradients(saved, X, UP), expected)


# Scripting and export record a forward: a warm module is no different there.
_WARM = [c for c in CONTEXTS if c not in ("torch.jit.script", "torch.export")]


@pytest.mark.parametrize(
    ("kind", "context", "state"),
    [
        pytest.param(k, c, state, id=f"{k} | {c} | {state}", marks=_marks(c))
        for k in KINDS for c in CONTEXTS for state in ("first", "warm")
        if state == "first" or c in _WARM
    ],
)
def test_cell(kind: str, context: str, state: str, monkeypatch: pytest.MonkeyPatch) -> None:
    run = RUN[context]
    if state == "warm":
        if context in ("save/load", "deepcopy"):
            run = lambda kind: run_warm_copy(kind, context)  # noqa: E731
        else:
            case = CASES[kind]
            monkeypatch.setitem(CASES, kind, dataclasses.replace(
                case, build=lambda build=case.build: warm(build())
            ))
    refusal = matrix.REFUSED.get((kind, context))
    if refusal is None:
        run(kind)
        return
    with pytest.raises(Exception) as info:
        run(kind)
    names = {cls.__name__ for cls in type(info.value).__mro__}
    assert refusal.error in names, f"raised {type(info.value).__name__}: {info.value}"
    assert re.search(refusal.match, str(info.value), re.DOTALL), str(info.value)


def test_the_table_covers_every_case_and_context() -> None:
    assert set(KINDS) == set(CASES), "every kind has a case in tests/matrix_cases.py"
    assert set(CONTEXTS) == set(RUN), "every context has a runner here"
    for kind, context in (*matrix.REFUSED, *matrix.NOTES):
        assert kind in KINDS and context in CONTEXTS, (kind, context)


def test_the_published_page_is_generated_from_the_table() -> None:
    page = Path(__file__).parent.parent / "docs" / "support-matrix.md"
    assert page.read_text(encoding="utf-8") == matrix.markdown(), (
        "docs/support-matrix.md is stale: run "
        "`python -m gradoverride._support_matrix docs/support-matrix.md`"
    )


def test_matrix_cases_are_importable_by_name() -> None:
    # `saved` modules pickle their classes and ops by reference.
    assert matrix_cases.OpModule.__module__ == "matrix_cases"
