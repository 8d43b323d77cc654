"""One rank of the two-process DDP (and FSDP) check in test_distributed.py.

    python tests/ddp_worker.py RANK WORLD PORT OUT_DIR {ddp,fsdp,ddp-monitor}

Builds the shared model (a `go.Module` layer and an `nn.Linear` with `override_backward`),
wraps it, runs forward+backward on this rank's half of the batch and saves the gradients
(`ddp-monitor`: under `go.monitor` of the DDP model, and the monitor's records too).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from distributed_model import make_model, rank_batch

import gradoverride as go


def main() -> None:
    rank, world, port, out_dir, mode = (
        int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    )
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = port
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = make_model()
        if mode in ("ddp", "ddp-monitor"):
            wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model:
                fully_shard(layer)
            wrapped = fully_shard(model)
        x, y = rank_batch(rank, world)
        records: dict[str, list[float]] = {}
        if mode == "ddp-monitor":
            with go.monitor(wrapped) as monitor:
                nn.functional.mse_loss(wrapped(x), y).backward()
            records = {label: [r.grad_in, r.grad_out] for label, (r,) in monitor.history.items()}
        else:
            nn.functional.mse_loss(wrapped(x), y).backward()
        grads: dict[str, object] = {"records": records}
        for name, p in model.named_parameters():
            grad = p.grad
            if hasattr(grad, "full_tensor"):  # FSDP2 shards gradients as DTensors
                grad = grad.full_tensor()
            grads[name] = grad.detach().clone()
        torch.save(grads, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # workers can abort at exit without it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Everything is saved and the group destroyed. Leave without the interpreter's
    # finalization: after FSDP, torch's gloo teardown aborts there now and then (a
    # joinable thread destroyed: "terminate called without an active exception", about
    # 1 run in 30 on 2 cores), after the results this check reads were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
