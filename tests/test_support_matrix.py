"""One test per cell of the support matrix (`gradoverride/_support_matrix.py`), twice.

A supported cell must give eager mode's gradients (eager mode itself is checked against each
case's independent reference); a refused cell must raise the error the table names. The
published page (`docs/support-matrix.md`) must be the table's own rendering.

Each cell runs on a fresh module (`first`: the context makes the first call, as a model
compiled before it ever ran) and on a warm one (`warm`: the module was called once already,
forward and backward with other inputs, so its first call's check is behind it); for
save/load and deepcopy, the copy of a warm module is called twice. Scripting and the
deployment paths (torch.export, AOTInductor, both ONNX exporters, jit.trace) record a forward
and run on a fresh module only; AOTInductor and the dynamo ONNX exporter deploy one model
holding every kind's case side by side (`shared_deployments`), as each of their builds takes
seconds. The ONNX cells skip where onnx, onnxruntime or onnxscript is missing, and the
AOTInductor cells where no C++ compiler is, unless GRADOVERRIDE_REQUIRE_EXPORT=1 (CI).
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import os
import re
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
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
    "ignore:`torch.jit.[a-z_]*` is deprecated:DeprecationWarning",  # (AOTInductor's too)
    "ignore:The .grad attribute of a Tensor that is not a leaf",
    # torch deprecates its TorchScript-based ONNX exporter, and says so on every call.
    "ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning",
    "ignore:The feature will be removed:DeprecationWarning",
    # torch's own, while AOTInductor compiles.
    "ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning",
)

_gen = torch.Generator().manual_seed(0)
# Inputs away from the ops' kinks (rounding ties at multiples of 1/8, the clip bound at 1).
X = (torch.rand(4, 3, generator=_gen) * 2.6 - 1.3).clamp(-1.3, 1.3)
X = torch.where((X * 8).frac().abs() < 0.1, X + 0.03, X)
UP = torch.randn(4, 3, generator=_gen)
# Other values of X's shape, for a deployed model (rows reversed, so that each row's argmin and
# argmax move: a numpy result recorded as a constant cannot pass for the right one).
X_OTHER = X.flip(0) * 0.5

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


# ---- the deployment paths ------------------------------------------------------------------
#
# Each records the forward for inference, of a module in eval mode, as a trained model is
# shipped. A deployed model (`Deployed`: a callable of X's shape) must give eager mode's
# outputs on X, the input it was exported with, and on X_OTHER.

_REQUIRE_EXPORT = os.environ.get("GRADOVERRIDE_REQUIRE_EXPORT") == "1"
Deployed = Callable[[Tensor], Any]


def _onnxruntime(*, dynamo: bool) -> ModuleType:
    """onnxruntime, after onnx (the exporters write through it) and, for `dynamo=True`,
    onnxscript; a skip with the reason where one is missing, unless CI requires them (then
    the ImportError fails the test)."""
    if not _REQUIRE_EXPORT:
        for package in ("onnx", "onnxruntime", *(("onnxscript",) if dynamo else ())):
            pytest.importorskip(
                package, reason=f"{package} is not installed (pip install 'gradoverride[export]')"
            )
    import onnx  # noqa: F401
    import onnxruntime

    return onnxruntime


def _onnx_session(data: bytes, *, dynamo: bool) -> Deployed:
    ort = _onnxruntime(dynamo=dynamo)
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()
    # A graph without an input computes a constant (a numpy result recorded while tracing).
    assert len(inputs) == 1, f"the ONNX graph takes {len(inputs)} inputs, not x"

    def run(x: Tensor) -> Any:
        outs = [torch.from_numpy(o) for o in session.run(None, {inputs[0].name: x.numpy()})]
        return outs[0] if len(outs) == 1 else tuple(outs)

    return run


def deploy_aoti(module: nn.Module, directory: Path) -> Deployed:
    compiler = torch._inductor.config.cpp.cxx[-1] or "g++"  # Inductor's (CXX, else g++)
    if not _REQUIRE_EXPORT and shutil.which(compiler) is None:
        pytest.skip(f"AOTInductor compiles C++, and the compiler {compiler!r} is not installed")
    program = torch.export.export(module, (X,))
    package = torch._inductor.aoti_compile_and_package(
        program, package_path=str(directory / "model.pt2"))
    loaded: Deployed = torch._inductor.aoti_load_package(package)
    return loaded


def deploy_onnx_dynamo(module: nn.Module, directory: Path) -> Deployed:
    _onnxruntime(dynamo=True)
    program = torch.onnx.export(module, (X,), dynamo=True, verbose=False)
    assert program is not None
    return _onnx_session(program.model_proto.SerializeToString(), dynamo=True)


def deploy_onnx_torchscript(module: nn.Module, directory: Path) -> Deployed:
    _onnxruntime(dynamo=False)
    buffer = io.BytesIO()
    # With grad enabled, as a user (or a toolchain built on this exporter) calls it.
    torch.onnx.export(module, (X,), buffer, dynamo=False)
    return _onnx_session(buffer.getvalue(), dynamo=False)


def deploy_jit_trace(module: nn.Module, directory: Path) -> Deployed:
    # Under no_grad: with grad enabled the trace is refused (tests/test_deploying.py).
    with torch.no_grad():
        traced = torch.jit.trace(module, (X,))

    def run(x: Tensor) -> Any:
        with torch.no_grad():
            return traced(x)

    return run


DEPLOY: dict[str, Callable[[nn.Module, Path], Deployed]] = {
    "AOTInductor": deploy_aoti,
    "ONNX (dynamo)": deploy_onnx_dynamo,
    "ONNX (TorchScript)": deploy_onnx_torchscript,
    "torch.jit.trace": deploy_jit_trace,
}
#: The columns whose test deploys one model holding every kind's case side by side: each
#: AOTInductor build compiles and links C++ (about 9 s on a 2-core machine, the first one of
#: a run 20 s more), each dynamo ONNX export takes about a second; the others take
#: milliseconds per kind and deploy each case alone.
SHARED = ("AOTInductor", "ONNX (dynamo)")


def _deploy(context: str, module: nn.Module, directory: Path) -> tuple[Deployed, list[str]]:
    """`module` deployed by `context`, and torch's tracer warnings on the way (recorded for
    the notes' check; every other warning meets the suite's filters, which make it an error)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", torch.jit.TracerWarning)
        deployed = DEPLOY[context](module, directory)
    return deployed, [str(w.message) for w in caught
                      if issubclass(w.category, torch.jit.TracerWarning)]


def _check_outputs(kind: str, got: tuple[Tensor, Tensor], expected: tuple[Tensor, Tensor]) -> None:
    assert not torch.equal(*expected), f"{kind}: X_OTHER gives the same outputs as X"
    for name, g, e in zip(("X", "X_OTHER"), got, expected, strict=True):
        torch.testing.assert_close(g, e, msg=lambda m, n=name: f"{kind} on {n}: {m}")


def _check_tracer_warnings(kind: str, context: str, tracer: list[str]) -> None:
    # A supported cell where torch warns says so in its note (and only there).
    if (kind, context) in matrix.DEFECTS:
        return
    noted = "TracerWarning" in matrix.NOTES.get((kind, context), "")
    assert bool(tracer) == noted, (kind, context, tracer)


class SideBySide(nn.Module):
    """Every given kind's case on the same input, its outputs in that order."""

    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self.cases = nn.ModuleList(CASES[kind].build() for kind in kinds)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        return tuple(case(x) for case in self.cases)


SharedOutputs = dict[str, tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]]


@pytest.fixture(scope="module")
def shared_deployments(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[[str], SharedOutputs]]:
    """For a column in SHARED: one model holding every kind's case that the table does not
    refuse there, deployed once; each kind's deployed outputs on X and X_OTHER, and eager
    mode's (computed before the export). A failure (or a skip) is kept and raised again in
    every cell of the column, which would otherwise deploy the model again each time."""
    done: dict[str, SharedOutputs | BaseException] = {}

    def deploy(context: str) -> SharedOutputs:
        kinds = [k for k in KINDS if (k, context) not in matrix.REFUSED]
        model = SideBySide(kinds).eval()
        with torch.no_grad():
            expected = [model(X), model(X_OTHER)]
        deployed, tracer = _deploy(context, model, tmp_path_factory.mktemp("deployed"))
        assert not tracer, tracer
        got = [deployed(X), deployed(X_OTHER)]
        return {kind: ((got[0][i], got[1][i]), (expected[0][i], expected[1][i]))
                for i, kind in enumerate(kinds)}

    def outputs(context: str) -> SharedOutputs:
        if context not in done:
            try:
                done[context] = deploy(context)
            except BaseException as exc:  # a skip too (pytest's is a BaseException)
                done[context] = exc
        result = done[context]
        if isinstance(result, BaseException):
            raise result
        return result

    yield outputs


def run_deployed(kind: str, context: str, request: pytest.FixtureRequest) -> None:
    if context in SHARED and (kind, context) not in matrix.REFUSED:
        got, expected = request.getfixturevalue("shared_deployments")(context)[kind]
        _check_outputs(kind, got, expected)
        return
    # A cell deployed alone (a refused one must raise in its own export).
    module = CASES[kind].build().eval()
    with torch.no_grad():
        expected = (module(X), module(X_OTHER))
    deployed, tracer = _deploy(context, module, request.getfixturevalue("tmp_path"))
    _check_outputs(kind, (deployed(X), deployed(X_OTHER)), expected)
    _check_tracer_warnings(kind, context, tracer)
    if context == "torch.jit.trace":
        _check_trace_with_grad(kind)


def _check_trace_with_grad(kind: str) -> None:
    """What the jit.trace note says of a trace with grad enabled: refused, saying to wrap it,
    or (hooked parameters) traced, the traced module's gradients those of eager mode."""
    module = CASES[kind].build()
    with warnings.catch_warnings():
        # (the shape checks' warnings, which the cell itself checks against the notes)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        if "is not refused" not in matrix.NOTES.get((kind, "torch.jit.trace"), ""):
            with pytest.raises(go.GradOverrideError, match=r"torch\.jit\.trace cannot keep "
                               r"the backward rule of .*trace under `torch\.no_grad\(\)`"):
                torch.jit.trace(module, (X,))
            return
        traced = torch.jit.trace(module, (X,))
    assert_same(gradients(module, X, UP, call=traced), eager(kind))


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


def _marks(kind: str, context: str) -> list[Any]:
    # AOTInductor compiles with Inductor, as slow as the compiled columns.
    marks = [pytest.mark.compile] if context.startswith("compile") or context == "AOTInductor" \
        else []
    defect = matrix.DEFECTS.get((kind, context))
    if defect is not None:
        # A wrong result fails an assertion; should the cell start raising instead (a
        # refusal) or pass, the test fails, so that the table is brought up to date.
        marks.append(pytest.mark.xfail(strict=True, raises=AssertionError, reason=defect))
    return marks


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


# Scripting and the deployment paths record a forward: a warm module is no different there.
_WARM = [c for c in CONTEXTS if c not in ("torch.jit.script", "torch.export", *DEPLOY)]


@pytest.mark.parametrize(
    ("kind", "context", "state"),
    [
        pytest.param(k, c, state, id=f"{k} | {c} | {state}", marks=_marks(k, c))
        for k in KINDS for c in CONTEXTS for state in ("first", "warm")
        if state == "first" or c in _WARM
    ],
)
def test_cell(kind: str, context: str, state: str, monkeypatch: pytest.MonkeyPatch,
              request: pytest.FixtureRequest) -> None:
    if context in DEPLOY:
        run: Callable[[str], None] = lambda kind: run_deployed(  # noqa: E731
            kind, context, request)
    else:
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
    assert set(CONTEXTS) == {*RUN, *DEPLOY}, "every context has a runner here"
    assert not set(RUN) & set(DEPLOY)
    for kind, context in (*matrix.REFUSED, *matrix.NOTES, *matrix.DEFECTS):
        assert kind in KINDS and context in CONTEXTS, (kind, context)
    # A cell is supported (with or without a note), refused, or a known defect.
    assert not set(matrix.REFUSED) & {*matrix.NOTES, *matrix.DEFECTS}
    assert not set(matrix.NOTES) & set(matrix.DEFECTS)


def test_the_published_page_is_generated_from_the_table() -> None:
    page = Path(__file__).parent.parent / "docs" / "support-matrix.md"
    assert page.read_text(encoding="utf-8") == matrix.markdown(), (
        "docs/support-matrix.md is stale: run "
        "`python -m gradoverride._support_matrix docs/support-matrix.md`"
    )


def test_matrix_cases_are_importable_by_name() -> None:
    # `saved` modules pickle their classes and ops by reference.
    assert matrix_cases.OpModule.__module__ == "matrix_cases"
