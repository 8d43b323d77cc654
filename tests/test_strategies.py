"""`gradoverride.testing.strategies` draws what it promises: 0-d and empty shapes, every
floating dtype, non-contiguous layouts, edge values, broadcastable pairs, available devices."""

from __future__ import annotations

import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

from gradoverride.testing import strategies as gst


def _found(strategy: st.SearchStrategy[torch.Tensor], condition: object) -> torch.Tensor:
    return find(strategy, condition, settings=settings(max_examples=500, database=None))  # type: ignore[arg-type]


def test_tensors_reach_0d_empty_and_noncontiguous() -> None:
    assert _found(gst.tensors(), lambda t: t.dim() == 0).dim() == 0
    assert _found(gst.tensors(), lambda t: t.numel() == 0).numel() == 0
    strided = _found(gst.tensors(), lambda t: t.numel() > 1 and not t.is_contiguous())
    assert not strided.is_contiguous()


def test_tensors_reach_every_float_dtype() -> None:
    for dtype in gst.FLOAT_DTYPES:
        assert _found(gst.tensors(), lambda t, d=dtype: t.dtype == d).dtype == dtype


def test_edges_put_signed_zeros_and_bounds_in() -> None:
    strategy = gst.tensors(shape=(16,), dtype=torch.float32, edges=(-0.0, 1.0))
    t = _found(strategy, lambda t: bool((t == 1.0).any()) and bool(torch.signbit(t[t == 0]).any()))
    assert (t == 1.0).any()
    assert torch.signbit(t[t == 0]).any()


@given(gst.tensor_pairs(broadcastable=True))
def test_broadcastable_pairs_broadcast(pair: tuple[torch.Tensor, torch.Tensor]) -> None:
    a, b = pair
    torch.broadcast_shapes(a.shape, b.shape)  # raises if they do not
    assert a.dtype == b.dtype


@given(gst.tensors(prefix=(3,), requires_grad=True), gst.devices())
def test_prefix_requires_grad_and_devices(t: torch.Tensor, device: torch.device) -> None:
    assert t.shape[0] == 3
    assert t.is_leaf and t.requires_grad
    assert device.type == "cpu" or torch.cuda.is_available()
