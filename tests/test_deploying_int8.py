"""Int8 deployment of `recipes.quantize` and `recipes.lsq`: what the exporters record.

* On an int8/uint8 grid (8 bits or fewer), `torch.export` records torch's fake-quantize op,
  and both ONNX exporters (`dynamo=True`, `dynamo=False`) write QuantizeLinear ->
  DequantizeLinear, per tensor or per channel; a narrower grid adds a Clip before them;
  9..16 bits keep Div/Round/Clip/Mul.
* onnxruntime gives the eager values exactly (graph optimisations off: with them on,
  onnxruntime may fuse a DequantizeLinear into the next MatMul, MatMulNBits, which computes
  differently); an `ExportedProgram` run in torch gives torch's fake-quantize values,
  round(x * (1/s)), which the tests compute by hand.
* Eager values are today's formula, round(x / s), bit for bit, also at the near-tie inputs
  where x * (1/s) rounds the other way.
* An `lsq` module not yet initialised refuses every export and trace.

The ONNX tests skip, with the reason, where `onnx`, `onnxruntime` or (for `dynamo=True`)
`onnxscript` is missing, unless GRADOVERRIDE_REQUIRE_EXPORT=1 (CI).
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
from gradoverride.recipes import lsq, quantize

pytestmark = [
    pytest.mark.filterwarnings("ignore:`torch.jit.trace.*` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings(
        "ignore:You are using the legacy TorchScript-based ONNX export:DeprecationWarning"
    ),
    pytest.mark.filterwarnings("ignore:The feature will be removed:DeprecationWarning"),
    # torch's own dynamo=True exporter calls a pytree API torch deprecates.
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)`:FutureWarning"),
]

_REQUIRE_EXPORT = os.environ.get("GRADOVERRIDE_REQUIRE_EXPORT") == "1"
EXPORTERS = ["dynamo=False", "dynamo=True"]


def _onnxruntime(exporter: str) -> ModuleType:
    if not _REQUIRE_EXPORT:
        needed = ["onnx", "onnxruntime"] + (["onnxscript"] if exporter == "dynamo=True" else [])
        for package in needed:
            pytest.importorskip(
                package, reason=f"{package} is not installed (pip install 'gradoverride[export]')"
            )
    import onnxruntime

    return onnxruntime


def _export_onnx(model: nn.Module, x: Tensor, exporter: str) -> Any:
    """The ONNX ModelProto of `model` at `x`, from the named exporter."""
    import onnx

    if exporter == "dynamo=True":
        return torch.onnx.export(model, (x,), dynamo=True, verbose=False).model_proto
    buffer = io.BytesIO()
    torch.onnx.export(model, (x,), buffer, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


def _run(ort: ModuleType, proto: Any, x: Tensor) -> Tensor:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    return torch.from_numpy(out)


def _ops(proto: Any) -> list[str]:
    return [node.op_type for node in proto.graph.node]


# ---- the models: a Linear, then a quantizer; or a weight quantized per channel --------------


class Act(nn.Module):
    """A Linear whose output a quantizer (or lsq with a step per feature) rounds."""

    def __init__(self, quantizer: Callable[..., Tensor], step: Tensor | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(3, 4)
        self.quantizer = quantizer
        self.step = None if step is None else nn.Parameter(step)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)
        return self.quantizer(h) if self.step is None else self.quantizer(h, self.step)


class Weight(nn.Module):
    """x @ w.T with w rounded by lsq, one step per output channel (step shape (4, 1))."""

    def __init__(self, bits: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 3))
        self.step = nn.Parameter(torch.tensor([[0.02], [0.011], [0.007], [0.03]]))
        self.quantizer = lsq(bits)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.quantizer(self.w, self.step).t()


_PER_FEATURE = torch.tensor([0.01, 0.02, 0.005, 0.013])

# name -> (model, per channel?, Clip expected before QuantizeLinear?)
INT8: dict[str, Callable[[], tuple[nn.Module, bool, bool]]] = {
    "quantize uint8, range from x": lambda: (Act(quantize(symmetric=False)), False, False),
    "quantize uint8, bound": lambda: (
        Act(quantize(symmetric=False, bound=(-0.5, 1.0))), False, False),
    "quantize int8 [-127, 127], bound": lambda: (Act(quantize(bound=0.5)), False, True),
    "quantize int8 [-127, 127], range from x": lambda: (Act(quantize()), False, True),
    "quantize 4 bits": lambda: (Act(quantize(bits=4, bound=0.5)), False, True),
    "lsq int8 module": lambda: (Act(lsq(8).module(step=0.004)), False, False),
    "lsq uint8 per feature": lambda: (Act(lsq(8, signed=False), _PER_FEATURE), True, False),
    "lsq int8 weight per channel": lambda: (Weight(), True, False),
    "lsq 4-bit weight per channel": lambda: (Weight(4), True, True),
}


def _x(scale: float = 3.0) -> Tensor:
    # Wide enough that some codes clamp at both ends of every grid above.
    return scale * torch.randn(64, 3, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("name", list(INT8))
def test_an_8_bit_grid_exports_as_quantize_dequantize_linear_and_onnxruntime_matches(
    name: str, exporter: str
) -> None:
    ort = _onnxruntime(exporter)
    model, _, clipped = INT8[name]()
    model.eval()
    x = _x()
    # With grad enabled, as after training (and so that an op's first-call check runs
    # eagerly, not while the exporter traces).
    expected = model(x).detach()
    proto = _export_onnx(model, x, exporter)
    ops = _ops(proto)
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops, ops
    # A narrower grid clips the input: a Clip (or Max, Min) makes the QuantizeLinear's input,
    # unless the exporter folded it into a constant (a weight's).
    producers = {out: node.op_type for node in proto.graph.node for out in node.output}
    constants = {init.name for init in proto.graph.initializer}
    (q_node,) = [n for n in proto.graph.node if n.op_type == "QuantizeLinear"]
    made_by = producers.get(q_node.input[0], "initializer" if q_node.input[0] in constants
                            else "graph input")
    if clipped:
        assert made_by in ("Clip", "Max", "Min", "initializer"), (made_by, ops)
    else:
        assert made_by not in ("Clip", "Max", "Min"), (made_by, ops)
    # onnxruntime divides, as the eager formula does: the values are equal, bit for bit (and
    # so a per-channel grid is per channel in the graph: one scale could not give them; the
    # torch.export test checks the op by name).
    if not isinstance(model, Weight):
        torch.testing.assert_close(_run(ort, proto, x), expected, rtol=0, atol=0)
        return
    # A quantized weight is then multiplied: the matmul's summation order is the CPU's
    # (its SIMD width), so a random x agrees to float32 rounding only; rows of the identity
    # (then zeros) read the rounded weight itself, exactly, on any CPU.
    torch.testing.assert_close(_run(ort, proto, x), expected, rtol=1e-5, atol=1e-5)
    probe = torch.zeros_like(x)
    probe[:3] = torch.eye(3)
    torch.testing.assert_close(_run(ort, proto, probe), model(probe).detach(), rtol=0, atol=0)


def test_the_codes_stay_on_the_narrow_grid_in_onnxruntime() -> None:
    # [-127, 127]: no output at -128 steps, though inputs reach far below -127 steps.
    ort = _onnxruntime("dynamo=False")
    net = Act(quantize(bound=1.0)).eval()
    x = _x(30.0)
    net(x)  # the first call, eager with grad enabled, as after training
    out = _run(ort, _export_onnx(net, x, "dynamo=False"), x)
    step = torch.tensor(1.0 / 127)
    assert out.min() == -127 * step and out.max() == 127 * step
    assert (net.linear(x) < -128 * step).any()


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_onnxruntime_matches_eager_at_near_ties_where_torchs_kernel_does_not(
    exporter: str,
) -> None:
    # Inputs within 8 ulps of each tie (k + 1/2) * s: x / s and x * (1/s) round apart at
    # some of them. onnxruntime's QuantizeLinear divides, so it keeps the eager values.
    ort = _onnxruntime(exporter)
    model = quantize(symmetric=False, bound=(-2.5, 2.5)).module().eval()
    s = torch.tensor(5.0 / 255)
    x = _near_ties(s, range(-128, 127))
    expected = model(x.clone().requires_grad_()).detach()
    reciprocal = _grid(x, s, torch.round(2.5 / s), 0, 255, reciprocal=True)
    assert (reciprocal != expected).sum() > 0  # the inputs do tell the two apart
    out = _run(ort, _export_onnx(model, x, exporter), x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


# ---- torch.export ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(INT8))
def test_torch_export_records_torchs_fake_quantize_op(name: str) -> None:
    model, per_channel, _ = INT8[name]()
    model.eval()
    x = _x()
    program = torch.export.export(model, (x,))
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    op = "per_channel" if per_channel else "per_tensor"
    assert any(f"fake_quantize_{op}_affine" in t for t in targets), targets
    # The program computes torch's fake-quantize, round(x * (1/s)): worked out by hand from
    # the model's own scale.
    with torch.no_grad():
        expected = _by_hand_with_reciprocal(model, x)
        torch.testing.assert_close(program.module()(x), expected, rtol=0, atol=0)


def _by_hand_with_reciprocal(model: nn.Module, x: Tensor) -> Tensor:
    if isinstance(model, Weight):
        qn, qp = model.quantizer.code_range
        w = _grid(model.w, model.step, torch.tensor(0.0), -qn, qp, reciprocal=True)
        return x @ w.t()
    assert isinstance(model, Act)
    h = model.linear(x)
    q: Any = model.quantizer
    if model.step is not None:
        qn, qp = q.code_range
        return _grid(h, model.step, torch.tensor(0.0), -qn, qp, reciprocal=True)
    if isinstance(q, go.recipes.LearnedStepQuantizer):
        qn, qp = q.recipe.code_range
        return _grid(h, q.step, torch.tensor(0.0), -qn, qp, reciprocal=True)
    s, z, qmin, qmax = _quantize_grid(q, h)
    return _grid(h, s, z, qmin, qmax, reciprocal=True)


# ---- eager: today's formula, bit for bit -----------------------------------------------------


def _grid(x: Tensor, s: Tensor, z: Tensor, qmin: int, qmax: int, *, reciprocal: bool) -> Tensor:
    """(clamp(round(x / s) + z, qmin, qmax) - z) * s; with `reciprocal`, x * (1/s) in place
    of x / s (torch's fake-quantize kernels, 1/s in float32)."""
    v = x * (1.0 / s) if reciprocal else x / s
    return (torch.clamp(torch.round(v) + z, qmin, qmax) - z) * s


def _quantize_grid(q: quantize, x: Tensor) -> tuple[Tensor, Tensor, int, int]:
    """`quantize`'s scale, zero point and codes for x, from its docstring's formulas."""
    b = q.bits
    if q.symmetric:
        qmax = 2 ** (b - 1) - 1
        top = torch.tensor(float(q.bound)) if q.bound is not None else x.abs().max()  # type: ignore[arg-type]
        top = torch.where(top > 0, top, 1.0)
        return top / qmax, torch.tensor(0.0), -qmax, qmax
    qmax = 2**b - 1
    if q.bound is not None:
        low, high = min(q.bound[0], 0.0), max(q.bound[1], 0.0)  # type: ignore[index]
        s = torch.tensor((high - low) / qmax)
        return s, torch.tensor(float(round(-low / float((high - low) / qmax)))), 0, qmax
    lo, hi = x.min().clamp_max(0), x.max().clamp_min(0)
    s = torch.where(hi - lo > 0, hi - lo, 1.0) / qmax
    return s, torch.round(-lo / s).clamp(0, qmax), 0, qmax


def _near_ties(s: Tensor, codes: range, ulps: int = 8) -> Tensor:
    mid = ((torch.tensor(list(codes), dtype=torch.float64) + 0.5) * float(s)).float()
    points, up, down = [mid], mid, mid
    for _ in range(ulps):
        up = torch.nextafter(up, torch.full_like(up, float("inf")))
        down = torch.nextafter(down, torch.full_like(down, -float("inf")))
        points += [up, down]
    return torch.cat(points)


@pytest.mark.parametrize(
    "q", [quantize(), quantize(bound=2.5), quantize(symmetric=False),
          quantize(symmetric=False, bound=(-1.0, 3.0)), quantize(bits=4, bound=1.0)],
    ids=repr,
)
def test_eager_quantize_keeps_todays_formula_bit_for_bit(q: quantize) -> None:
    x = torch.cat([_x().flatten(), _near_ties(torch.tensor(2.5 / 127), range(-130, 130))])
    s, z, qmin, qmax = _quantize_grid(q, x)
    expected = _grid(x, s, z, qmin, qmax, reciprocal=False)
    for grad in (False, True):
        xs = x.clone().requires_grad_(grad)
        assert torch.equal(q(xs).detach(), expected)
    with torch.no_grad():
        assert torch.equal(q(x), expected)


def test_eager_lsq_keeps_todays_formula_bit_for_bit_at_near_ties() -> None:
    step = torch.tensor(0.0123)
    x = torch.cat([_x().flatten(), _near_ties(step, range(-130, 130))])
    expected = torch.round(torch.clamp(x / step, -128, 127)) * step
    assert (_grid(x, step, torch.tensor(0.0), -128, 127, reciprocal=True) != expected).any()
    xs = x.clone().requires_grad_()
    assert torch.equal(lsq(8)(xs, step.clone().requires_grad_()).detach(), expected)
    module = lsq(8).module(step=0.0123)
    assert torch.equal(module(x).detach(), expected)


# ---- other grids -----------------------------------------------------------------------------


# (No filter for TracerWarning: `quantize` reads no traced size while tracing.)
@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_grid_wider_than_8_bits_exports_as_its_float_formula(exporter: str) -> None:
    ort = _onnxruntime(exporter)
    model = Act(quantize(bits=12)).eval()
    x = _x()
    expected = model(x).detach()
    proto = _export_onnx(model, x, exporter)
    ops = _ops(proto)
    assert "QuantizeLinear" not in ops and {"Div", "Round", "Mul"} <= set(ops), ops
    torch.testing.assert_close(_run(ort, proto, x), expected, rtol=0, atol=0)
    program = torch.export.export(model, (x,))
    assert not any("fake_quantize" in str(n.target) for n in program.graph.nodes)


# ---- lsq before its first call -----------------------------------------------------------------

_NOT_INITIALISED = (
    r"lsq\(bits=8, .*\)\.module\(\): `step` is not initialised yet .* Call the module once "
    r"on representative data before exporting, load a trained state_dict, or give the "
    r"initial step: `lsq\(.*\)\.module\(step=\.\.\.\)`"
)


def _export_by(how: str, model: nn.Module, x: Tensor) -> Any:
    if how == "torch.export":
        return torch.export.export(model, (x,))
    if how == "torch.jit.trace":
        with torch.no_grad():
            return torch.jit.trace(model, (x,))
    _onnxruntime(how)
    return _export_onnx(model, x, how)


@pytest.mark.parametrize("how", ["torch.export", "torch.jit.trace", *EXPORTERS])
def test_an_lsq_module_before_its_first_call_refuses_export(how: str) -> None:
    model = Act(lsq(8).module()).eval()
    with pytest.raises(Exception) as info:  # the exporter may wrap it: see below
        _export_by(how, model, _x())
    error = info.value
    while not isinstance(error, go.GradOverrideError) and error.__cause__ is not None:
        error = error.__cause__  # type: ignore[assignment]
    assert isinstance(error, go.GradOverrideError), repr(info.value)
    with pytest.raises(go.GradOverrideError, match=_NOT_INITIALISED):
        raise error
    # Nothing was initialised by the refused export: the first call still sets the step.
    quantizer: Any = model.quantizer
    assert quantizer._needs_init and quantizer.step.item() == 1.0


def test_an_lsq_module_exports_after_its_first_call_with_the_step_it_learned() -> None:
    model = Act(lsq(8).module()).eval()
    x = _x()
    with torch.no_grad():
        h = model.linear(x)
        model(x)  # the paper's initialisation, from this batch
        step = 2 * h.abs().mean() / 127**0.5
        quantizer: Any = model.quantizer
        torch.testing.assert_close(quantizer.step, step)
        other = _x(0.3)
        expected = model(other)
    program = torch.export.export(model, (x,))
    assert any("fake_quantize" in str(n.target) for n in program.graph.nodes)
    with torch.no_grad():
        # The step is a parameter of the program, not worked out from its input.
        hand = _grid(model.linear(other), quantizer.step, torch.tensor(0.0), -128, 127,
                     reciprocal=True)
        torch.testing.assert_close(program.module()(other), hand, rtol=0, atol=0)
        torch.testing.assert_close(program.module()(other), expected,
                                   rtol=0, atol=float(quantizer.step))
