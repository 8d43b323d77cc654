"""Two processes, gloo on 127.0.0.1: parameter gradients from `go.Module` rules and
`override_backward` reach DDP's reducer (and FSDP's), and both ranks end with the averaged
gradients a single process computes on the whole batch."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_model import full_batch, make_model
from torch import nn

WORKER = Path(__file__).with_name("ddp_worker.py")
TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_two_ranks(mode: str, out_dir: Path) -> list[dict[str, torch.Tensor]]:
    port = str(_free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", port, str(out_dir), mode],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
            outputs.append(out)
    finally:
        for proc in procs:  # ended by their ids whatever happened
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out}"
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(2)]


def _reference() -> dict[str, torch.Tensor]:
    model = make_model()
    x, y = full_batch()
    nn.functional.mse_loss(model(x), y).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available in this build",
)


@needs_gloo
def test_ddp_two_ranks_average_rule_gradients(tmp_path: Path) -> None:
    ranks = _run_two_ranks("ddp", tmp_path)
    reference = _reference()
    assert set(ranks[0]) == set(reference)
    for name, grad in reference.items():
        torch.testing.assert_close(ranks[0][name], ranks[1][name])
        torch.testing.assert_close(ranks[0][name], grad)


@needs_gloo
def test_fsdp_fully_shard_two_ranks(tmp_path: Path) -> None:
    ranks = _run_two_ranks("fsdp", tmp_path)
    reference = _reference()
    for name, grad in reference.items():
        torch.testing.assert_close(ranks[0][name], ranks[1][name])
        torch.testing.assert_close(ranks[0][name], grad)
