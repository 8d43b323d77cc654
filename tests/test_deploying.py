"""Shipping a model trained with gradoverride: the deployment paths record its forward alone.

* `torch.onnx.export(..., dynamo=False)`, the TorchScript-based exporter, traces the model with
  grad enabled: each op kind records its plain forward there (an ONNX graph holds no backward
  rule), and onnxruntime reproduces the eager outputs;
* `torch.jit.trace` records the forward alone under `no_grad` / `inference_mode`, and refuses
  with grad enabled, saying to wrap it;
* `torch.ao.quantization.quantize_dynamic` keeps a module's `grad_hook` (its module swap
  registers the hooks again without their keyword arguments), and the quantized model runs.

The ONNX tests skip, with the reason, where `onnx` or `onnxruntime` is missing, unless
GRADOVERRIDE_REQUIRE_EXPORT=1 (CI), where a missing package is an error.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import gradoverride as go
from gradoverride.recipes import spike, ste_round

# torch deprecates TorchScript and its ONNX exporter, and says so on every call.
pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.trace.*` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(
        "ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"
    ),
    pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning"),
]

_REQUIRE_EXPORT = os.environ.get("GRADOVERRIDE_REQUIRE_EXPORT") == "1"


def _onnxruntime() -> ModuleType:
    """onnxruntime, after onnx (the exporter writes through it); a skip with the reason where
    either is missing, unless CI requires them (then the ImportError fails the test)."""
    if not _REQUIRE_EXPORT:
        for package in ("onnx", "onnxruntime"):
            pytest.importorskip(
                package, reason=f"{package} is not installed (pip install 'gradoverride[export]')"
            )
    import onnx  # noqa: F401
    import onnxruntime

    return onnxruntime


# ---- one small model per op kind, each a Linear followed by (or hooked with) the kind --------


@go.custom_backward
def clip_times_three(x: Tensor) -> Tensor:
    return x.clamp(-1.0, 1.0) * 3.0


@clip_times_three.backward
def _(grad: Tensor, *, x: Tensor) -> Tensor:
    return grad * 3.0  # straight through the clamp


@go.custom_backward(owns="x")
def scaled(x: Tensor, w: Tensor) -> Tensor:
    return torch.sign(x) * w


@scaled.backward
def _(grad: Tensor, *, w: Tensor) -> Tensor:
    return grad * w


sign_st = go.straight_through(torch.sign)


class Squash(go.Module):
    """tanh with the gradient of the identity (the rule owns the input)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x)

    def backward(self, grad: Tensor, *, x: Tensor) -> Tensor:
        return grad


class Op(nn.Module):
    def __init__(self, op: Callable[[Tensor], Tensor]) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.op = op

    def forward(self, x: Tensor) -> Tensor:
        return self.op(self.linear(x))


class Owns(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)
        self.w = nn.Parameter(torch.tensor(0.5))

    def forward(self, x: Tensor) -> Tensor:
        return scaled(self.linear(x), self.w)


def _overridden() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh())
    go.override_backward(model[1], lambda grad, *, input: grad)
    return model


def _hooked(at: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
        go.grad_hook(model[0], lambda g: g * 2, at=at)
        return model

    return build


KINDS: dict[str, Callable[[], nn.Module]] = {
    "custom_backward": lambda: Op(clip_times_three),
    "custom_backward owns=": Owns,
    "straight_through": lambda: Op(sign_st),
    "recipe ste_round": lambda: Op(ste_round()),
    "recipe spike": lambda: Op(spike()),
    "recipe spike at_zero=1": lambda: Op(spike("fast_sigmoid", at_zero=1.0)),
    "go.Module": lambda: nn.Sequential(nn.Linear(3, 4), Squash()),
    "override_backward": _overridden,
    "grad_hook inputs": _hooked("inputs"),
    "grad_hook outputs": _hooked("outputs"),
}


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return KINDS[kind]().eval()


def _x() -> Tensor:
    return torch.randn(5, 3, generator=torch.Generator().manual_seed(1))


def _run_onnx(ort: ModuleType, data: bytes, x: Tensor) -> Tensor:
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return torch.from_numpy(out)


# ---- the TorchScript-based ONNX exporter ------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_torchscript_onnx_exporter_records_the_forward_and_onnxruntime_matches(
    kind: str,
) -> None:
    ort = _onnxruntime()
    model = _model(kind)
    x = _x()
    with torch.no_grad():
        expected = model(x)
    buffer = io.BytesIO()
    # With grad enabled, as a user (or a toolchain built on this exporter) calls it.
    torch.onnx.export(model, (x,), buffer, dynamo=False)
    assert torch.is_grad_enabled()
    torch.testing.assert_close(_run_onnx(ort, buffer.getvalue(), x), expected,
                               rtol=1e-5, atol=1e-6)
    graph = buffer.getvalue()
    assert b"PythonOp" not in graph and b"CustomBackward" not in graph


def test_the_spike_recipe_exports_through_the_torchscript_exporter_under_no_grad() -> None:
    # Its step wrote into a preallocated tensor (`out=`), which that exporter cannot translate.
    ort = _onnxruntime()
    model = _model("recipe spike")
    x = _x()
    with torch.no_grad():
        expected = model(x)
        buffer = io.BytesIO()
        torch.onnx.export(model, (x,), buffer, dynamo=False)
    torch.testing.assert_close(_run_onnx(ort, buffer.getvalue(), x), expected)
    assert set(expected.unique().tolist()) == {0.0, 1.0}


def test_after_a_torchscript_onnx_export_the_rules_still_train() -> None:
    # The export changes nothing the training relies on: each rule applies afterwards, as
    # worked out by hand (the straight-through gradients below are the upstream ones).
    _onnxruntime()
    op_model, module_model, overridden = _model("custom_backward"), _model("go.Module"), \
        _model("override_backward")
    hooked = _model("grad_hook inputs")
    x = _x()
    for model in (op_model, module_model, overridden, hooked):
        torch.onnx.export(model, (x,), io.BytesIO(), dynamo=False)
    xs = x.clone().requires_grad_()
    op_model(xs).sum().backward()
    torch.testing.assert_close(xs.grad, 3.0 * op_model.linear.weight.detach().sum(0).expand(5, 3))
    for model in (module_model, overridden):
        xs = x.clone().requires_grad_()
        model(xs).sum().backward()
        # d sum(tanh(linear(x))) / dx with tanh's gradient replaced by the identity
        torch.testing.assert_close(xs.grad, model[0].weight.detach().sum(0).expand(5, 3))
    xs = x.clone().requires_grad_()
    hooked(xs).sum().backward()
    h = hooked[0](x)
    expected = 2.0 * ((h > 0).to(x.dtype) @ hooked[0].weight.detach())
    torch.testing.assert_close(xs.grad, expected)


# ---- torch.jit.trace --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_jit_trace_without_gradients_records_the_forward_alone(kind: str, mode: str) -> None:
    model = _model(kind)
    x = _x()
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    with context():
        expected = model(x)
        traced = torch.jit.trace(model, (x,))
    other = torch.randn(7, 3, generator=torch.Generator().manual_seed(2))
    with context():
        torch.testing.assert_close(traced(x), expected)
        torch.testing.assert_close(traced(other), model(other))
    assert "CustomBackward" not in str(traced.inlined_graph)


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "grad_hook parameters"])
def test_jit_trace_with_grad_enabled_says_to_wrap_it_in_no_grad(kind: str) -> None:
    with pytest.raises(
        go.GradOverrideError,
        match=r"torch\.jit\.trace cannot keep the backward rule of .*trace under "
        r"`torch\.no_grad\(\)` or `torch\.inference_mode\(\)`",
    ):
        torch.jit.trace(_model(kind), (_x(),))


# ---- dynamic quantization ---------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.* are deprecated:UserWarning")
@pytest.mark.parametrize("at", ["inputs", "outputs"])
def test_quantize_dynamic_keeps_a_grad_hooked_model_running(at: str) -> None:
    # quantize_dynamic swaps the Linear for its quantized twin and registers the Linear's
    # hooks on it again, without their keyword arguments.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    hooked = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    hooked.load_state_dict(plain.state_dict())
    go.grad_hook(hooked[0], lambda g: g * 2, at=at)  # type: ignore[arg-type]
    go.grad_hook(hooked[2], lambda g: g * 2, at=at)  # type: ignore[arg-type]
    quantized = torch.ao.quantization.quantize_dynamic(hooked, {nn.Linear}, dtype=torch.qint8)
    reference = torch.ao.quantization.quantize_dynamic(plain, {nn.Linear}, dtype=torch.qint8)
    assert type(quantized[0]) is type(reference[0]) and type(quantized[0]) is not nn.Linear
    x = _x()
    torch.testing.assert_close(quantized(x), reference(x), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(quantized(x), reference(x), rtol=0, atol=0)
    # The float model keeps its hooks: its input gradient is doubled at each Linear.
    xs = x.clone().requires_grad_()
    hooked(xs).sum().backward()
    xp = x.clone().requires_grad_()
    plain(xp).sum().backward()
    torch.testing.assert_close(xs.grad, 4 * xp.grad)


@pytest.mark.filterwarnings("ignore:torch.ao.quantization is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.* are deprecated:UserWarning")
def test_quantize_dynamic_of_an_overridden_model_runs_for_inference() -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    overridden = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    overridden.load_state_dict(plain.state_dict())
    go.override_backward(overridden[0], lambda grad, *, input: grad)
    quantized = torch.ao.quantization.quantize_dynamic(
        overridden, {nn.Linear}, dtype=torch.qint8
    )
    reference = torch.ao.quantization.quantize_dynamic(plain, {nn.Linear}, dtype=torch.qint8)
    x = _x()
    with torch.no_grad():
        torch.testing.assert_close(quantized(x), reference(x), rtol=0, atol=0)
