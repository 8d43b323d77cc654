"""A module-level bridge for tests/test_bridge_operator.py: an exported program calling it
is loaded in a fresh process, which makes the bridge again by importing this module."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import gradoverride as go


def _sine_rule(grad: Any, *, x: Any) -> Any:
    return grad * np.cos(x)


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


SINE = go.bridge(np.sin, backward=_sine_rule, outputs=_like)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SINE(x * self.scale) + 1
