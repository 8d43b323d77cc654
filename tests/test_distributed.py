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
from distributed_model import full_batch, make_model, rank_batch
from torch import nn

WORKER = Path(__file__).with_name("ddp_worker.py")


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
            out, _ = proc.communicate()
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


def _rank_rules(rank: int) -> dict[str, tuple[float, float]]:
    """What each rule got and returned on this rank's half batch, by hand (plain autograd
    and the rules' formulas): the monitor of each rank records these, before DDP averages
    the parameters' gradients."""
    model = make_model()
    x, y = rank_batch(rank, 2)
    w = model[0].weights.detach()
    linear = model[1]
    h = torch.tanh(x * w).requires_grad_()
    o = (h @ linear.weight.T + linear.bias).detach().requires_grad_()
    (g_o,) = torch.autograd.grad(nn.functional.mse_loss(o, y), o)
    g_h = (g_o @ linear.weight).detach()  # the linear rule's input gradient
    linear_out = torch.cat([g_h.flatten(), (g_o.T @ h.detach()).flatten(), 2 * g_o.sum(0)])
    scaled_out = 0.5 * (g_h * (1 - h.detach() ** 2) * x).sum(0)  # x needs no gradient
    return {
        "module.0: ScaledLayer": (float(g_h.norm()), float(scaled_out.norm())),
        "module.1: Linear": (float(g_o.norm()), float(linear_out.norm())),
    }


needs_gloo = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available in this build",
)


@needs_gloo
def test_ddp_two_ranks_average_rule_gradients(tmp_path: Path) -> None:
    ranks = _run_two_ranks("ddp", tmp_path)
    reference = _reference()
    assert set(ranks[0]) - {"records"} == set(reference)
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


@needs_gloo
def test_ddp_each_rank_monitors_its_own_gradients(tmp_path: Path) -> None:
    ranks = _run_two_ranks("ddp-monitor", tmp_path)
    reference = _reference()
    for rank, saved in enumerate(ranks):
        expected = _rank_rules(rank)
        assert list(saved["records"]) == list(expected)
        for label, (grad_in, grad_out) in expected.items():
            got_in, got_out = saved["records"][label]
            assert got_in == pytest.approx(grad_in, rel=1e-5), (rank, label)
            assert got_out == pytest.approx(grad_out, rel=1e-5), (rank, label)
        for name, grad in reference.items():  # DDP still averages, as without the monitor
            torch.testing.assert_close(saved[name], grad)
    assert ranks[0]["records"] != ranks[1]["records"]  # each rank its own half batch
