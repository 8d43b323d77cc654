"""Shared fixtures: the `device` fixture (CPU always, CUDA skipped with a reason) and the
Hypothesis profile (deterministic, no deadline: torch calls have uneven first-call costs)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "gradoverride",
    deadline=None,
    derandomize=True,
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "40")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("gradoverride")

_NO_CUDA = "CUDA is not available on this machine"


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=_NO_CUDA)
        ),
    ]
)
def device(request: pytest.FixtureRequest) -> torch.device:
    """Each device a test should run on: CPU always; CUDA when there is a GPU."""
    return torch.device(request.param)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """`torch.testing.assert_close` tolerances, loosened for low precision in one place."""
    if dtype in (torch.float16, torch.bfloat16):
        return {"rtol": 1e-2, "atol": 1e-2}
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-6}
    return {"rtol": 1e-7, "atol": 1e-9}
