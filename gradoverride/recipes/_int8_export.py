"""What exporters see of `quantize` and `lsq`: QuantizeLinear/DequantizeLinear on 8-bit grids.

An exporter (`torch.export`, and `torch.onnx.export` with either exporter) records a
quantizer whose codes fit int8 or uint8 as torch's `fake_quantize_per_tensor_affine` /
`fake_quantize_per_channel_affine`, which both ONNX exporters write as QuantizeLinear ->
DequantizeLinear, so that int8 runtimes run it on integers. A grid narrower than its 8-bit
type (the symmetric [-127, 127] of `quantize`, 2..7 bits) first clips the input, in float, to
the grid's ends (a Clip node before the QuantizeLinear); a wider grid (9..16 bits) has no
8-bit form and keeps its float formula (Div, Round, Clip, Mul). Eager calls, `torch.compile`
and a plain `torch.jit.trace` never come here: they keep the recipes' own formula.

Values: onnxruntime's QuantizeLinear computes round(x / s), the recipes' own formula, and
gives their values exactly. torch's fake-quantize kernels compute round(x * (1/s)), which
rounds the other way at a few inputs within a few ulps of a tie (measured: 68 of 44 million
uniform inputs over eleven typical scales, 636 of 47,872 inputs within 8 ulps of a tie), so
an `ExportedProgram` run in torch can differ from eager there by one step s. That is why
eager training never takes this path.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from .._function import exporting_onnx
from .._internals import tracing_state

__all__ = ["exporting", "fake_quantize", "int8_range"]


def exporting() -> bool:
    """Whether an exporter records the forward now: `torch.export` (also under the dynamo
    ONNX exporter, `dynamo=True`) or the TorchScript-based ONNX exporter (`dynamo=False`),
    which traces with `torch.jit.trace`."""
    if torch.compiler.is_exporting():
        return True
    return tracing_state() is not None and exporting_onnx()


def int8_range(qmin: int, qmax: int) -> tuple[int, int] | None:
    """The 8-bit code range holding the codes qmin..qmax: int8's (-128, 127) for a grid with
    negative codes, uint8's (0, 255) otherwise; None where the grid does not fit either."""
    if qmin >= -128 and qmax <= 127 and qmin < 0:
        return -128, 127
    if qmin >= 0 and qmax <= 255:
        return 0, 255
    return None


def fake_quantize(
    x: Tensor, scale: Tensor | float, zero_point: Tensor | float, qmin: int, qmax: int
) -> Tensor | None:
    """(clamp(round(x / s) + z, qmin, qmax) - z) * s as torch's fake-quantize op (see the
    module docstring), or None where it has no 8-bit form: a grid outside int8/uint8, an
    input other than float32 (QuantizeLinear's float type before opset 19), a scale that is
    not one number or one per channel of x.

    `scale` and `zero_point` are numbers or tensors broadcast against x (`lsq`'s step per
    channel). A grid narrower than its 8-bit type clamps x to the float ends of the grid
    first: those ends, divided by s, round back to qmin and qmax, and every other input
    keeps its code, so the values are those of the clamped codes."""
    full = int8_range(qmin, qmax)
    if full is None or x.dtype != torch.float32:
        return None
    if isinstance(scale, Tensor):
        if scale.dtype != torch.float32:
            return None
        # An exported graph is an inference graph, and the fake-quantize ops refuse a scale
        # that requires grad (their backward has no scale gradient).
        scale = scale.detach()
    axis = _channel_axis(x, scale)
    if axis == -1:
        return None
    if axis is None and isinstance(scale, Tensor):
        scale = scale.reshape(())
    if (qmin, qmax) != full:
        z = zero_point
        x = torch.clamp(x, (qmin - z) * scale, (qmax - z) * scale)  # type: ignore[arg-type]
    if axis is not None:
        assert isinstance(scale, Tensor)  # `_channel_axis` gives an axis only for a tensor
        channels = scale.reshape(-1)
        zero = _zero_point(zero_point, channels.shape)
        return torch.fake_quantize_per_channel_affine(x, channels, zero, axis, *full)
    if isinstance(scale, Tensor):
        zero = _zero_point(zero_point, torch.Size())
        return torch.fake_quantize_per_tensor_affine(x, scale, zero, *full)
    return torch.fake_quantize_per_tensor_affine(x, scale, int(zero_point), *full)


def _channel_axis(x: Tensor, scale: Tensor | float) -> int | None:
    """The axis of x that a per-channel scale runs along; None for one scale; -1 for a
    shape no per-channel op expresses (several axes, or one that broadcasts against x)."""
    if not isinstance(scale, Tensor) or scale.dim() == 0:
        return None
    if scale.dim() > x.dim():
        return -1
    with warnings.catch_warnings():
        # The TorchScript-based exporter traces sizes as tensors and warns when Python
        # compares one; these sizes choose which op to record, for the fixed shapes of
        # this export, as any shape check in a forward does.
        warnings.filterwarnings("ignore", "Converting a tensor to a Python integer")
        sizes, scale_sizes = [int(n) for n in x.shape], [int(n) for n in scale.shape]
    sized = [d for d, n in enumerate(scale_sizes) if n != 1]
    if not sized:
        return None
    if len(sized) != 1:
        return -1
    axis = x.dim() - scale.dim() + sized[0]
    return axis if sizes[axis] == scale_sizes[sized[0]] else -1


def _zero_point(zero_point: Tensor | float, shape: torch.Size) -> Tensor:
    """The zero point as the int32 tensor the fake-quantize ops take (a code: an integer)."""
    if isinstance(zero_point, Tensor):
        return zero_point.detach().to(torch.int32).expand(shape).contiguous()
    return torch.full(shape, int(zero_point), dtype=torch.int32)
