"""Checked by mypy in CI (not run): `straight_through` keeps the forward's signature, bare and
with options; each `type: ignore[...]` line must stay an error."""

from __future__ import annotations

from typing import assert_type

import torch

import gradoverride as go


@go.straight_through
def round_ste(x: torch.Tensor, bits: int = 2) -> torch.Tensor:
    rounded: torch.Tensor = torch.round(x * 2**bits) / 2**bits
    return rounded


@go.straight_through(clip=(-1.0, 1.0), keep="mask")
def sign_clipped(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x)


assert_type(round_ste(torch.ones(2), bits=3), torch.Tensor)
assert_type(sign_clipped(torch.ones(2)), torch.Tensor)
sign_clipped(torch.ones(2), 4)  # type: ignore[call-arg]
go.straight_through(torch.sign, keep="bytes")  # type: ignore[call-overload]
