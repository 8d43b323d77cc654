"""The monitor in the trainers and loggers people use: a PyTorch Lightning callback, a
HuggingFace `Trainer` callback, TensorBoard's `SummaryWriter` and Weights & Biases, each in
a real (small) training run.

Each test skips with its reason where its package is not installed, unless
`GRADOVERRIDE_REQUIRE_INTEGRATIONS=1` (set by `.ci/run`): there a missing package fails.
"""

from __future__ import annotations

import importlib
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradoverride as go
from gradoverride import recipes

REQUIRED = os.environ.get("GRADOVERRIDE_REQUIRE_INTEGRATIONS") == "1"


def _need(module: str, install: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        if REQUIRED:
            raise
        pytest.skip(f"{module} is not installed (pip install {install})")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, 8), recipes.binarize().module())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


LABEL = f"encoder.1: {recipes.binarize()!r}"
KEY = "gradoverride/encoder.1"


def _data(n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def _no_recorder_left() -> None:
    assert not go._function.RECORDERS
    assert not torch.nn.modules.module._has_any_global_hook()


# Lightning's own, about torch's pytree and a small DataLoader:
@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
@pytest.mark.filterwarnings("ignore:.*does not have many workers:UserWarning")
def test_a_lightning_callback_records_and_logs_each_step(tmp_path: Path) -> None:
    pl = _need("lightning.pytorch", "lightning")
    from gradoverride.diagnostics import LightningMonitor

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    watch = LightningMonitor(every=2)
    trainer = pl.Trainer(
        max_epochs=2, callbacks=[watch], logger=pl.loggers.CSVLogger(tmp_path),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, accelerator="cpu", devices=1,
    )
    trainer.fit(Module(), loader)
    _no_recorder_left()
    mon = watch.monitor
    assert mon is not None and not mon.recording
    assert mon.steps == 8  # 4 batches, 2 epochs
    records = mon.history[f"net.{LABEL}"]
    assert [r.step for r in records] == [0, 2, 4, 6]
    # What the CSV logger wrote for each recorded step is the record of that step.
    import csv

    [metrics] = list(tmp_path.rglob("metrics.csv"))
    key = "gradoverride/net.encoder.1/grad_in"
    with metrics.open() as lines:
        rows = [r for r in csv.DictReader(lines) if r.get(key)]
    logged = [float(r[key]) for r in rows]
    assert logged == pytest.approx([r.grad_in for r in records], rel=1e-6)
    assert [int(r["step"]) for r in rows] == [1, 3, 5, 7]  # the optimizer steps after them

    # Accumulating two batches per optimizer step: logged once per optimizer step, with
    # the latest recorded pass (the window's second).
    accumulating = LightningMonitor()
    trainer = pl.Trainer(
        max_epochs=1, callbacks=[accumulating], logger=pl.loggers.CSVLogger(tmp_path / "acc"),
        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, accelerator="cpu", devices=1, accumulate_grad_batches=2,
    )
    trainer.fit(Module(), loader)
    [metrics] = list((tmp_path / "acc").rglob("metrics.csv"))
    with metrics.open() as lines:
        rows = [r for r in csv.DictReader(lines) if r.get(key)]
    passes = accumulating.monitor.history[f"net.{LABEL}"]
    assert [int(r["step"]) for r in rows] == [1, 2]
    assert [float(r[key]) for r in rows] == pytest.approx(
        [passes[1].grad_in, passes[3].grad_in], rel=1e-6)


def test_a_huggingface_callback_adds_the_numbers_to_the_logs(tmp_path: Path) -> None:
    transformers = _need("transformers", "transformers")
    from gradoverride.diagnostics import HuggingFaceMonitor

    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}

    class Rows(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x, self.y = _data()

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[i], "labels": self.y[i]}

    torch.manual_seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_train_epochs=1,
        logging_steps=2, report_to=[], save_strategy="no", use_cpu=True,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = transformers.Trainer(model=WithLoss(), args=args, train_dataset=Rows())
    watch = HuggingFaceMonitor()
    trainer.callback_handler.callbacks.insert(0, watch)
    trainer.train()
    _no_recorder_left()
    mon = watch.monitor
    assert mon is not None and mon.steps == 4
    records = mon.history[f"net.{LABEL}"]
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in logged] == [2, 4]
    # At trainer steps 2 and 4, the latest recorded steps were the 2nd and 4th.
    assert [entry["gradoverride/net.encoder.1/grad_in"] for entry in logged] == pytest.approx(
        [records[1].grad_in, records[3].grad_in], rel=1e-6)


def test_tensorboard_and_wandb_take_the_scalars_in_one_line(tmp_path: Path) -> None:
    tensorboard = _need("torch.utils.tensorboard", "tensorboard")
    event_accumulator = _need("tensorboard.backend.event_processing.event_accumulator",
                              "tensorboard")
    wandb = _need("wandb", "wandb")
    torch.manual_seed(0)
    model = Net()
    x, y = _data(8)
    writer = tensorboard.SummaryWriter(str(tmp_path / "tb"))
    run = wandb.init(mode="offline", dir=str(tmp_path), project="gradoverride-test")
    try:
        with go.monitor(model) as mon:
            for step in range(3):
                nn.functional.cross_entropy(model(x), y).backward()
                for key, value in mon.scalars().items():
                    writer.add_scalar(key, value, step)
                run.log(mon.scalars(), step=step)
        records = mon.history[LABEL]
        assert run.summary[f"{KEY}/grad_out"] == pytest.approx(records[-1].grad_out)
        assert math.isfinite(run.summary[f"{KEY}/zeroed"])
    finally:
        writer.close()
        run.finish()
    events = event_accumulator.EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    written = [e.value for e in events.Scalars(f"{KEY}/grad_out")]
    assert written == pytest.approx([r.grad_out for r in records], rel=1e-6)


def test_a_missing_trainer_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    for name in ("gradoverride.diagnostics._lightning", "gradoverride.diagnostics._huggingface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning", "transformers"):
        monkeypatch.setitem(sys.modules, name, None)  # what an import of it then raises
    # (from the module's dict: `hasattr` would import them, which is what is tested)
    monkeypatch.delitem(vars(go.diagnostics), "LightningMonitor", raising=False)
    monkeypatch.delitem(vars(go.diagnostics), "HuggingFaceMonitor", raising=False)
    with pytest.raises(go.GradOverrideError, match=r"LightningMonitor needs PyTorch Lightning, "
                       r"which is not installed: `pip install lightning`"):
        go.diagnostics.LightningMonitor  # noqa: B018
    with pytest.raises(go.GradOverrideError, match=r"HuggingFaceMonitor needs HuggingFace "
                       r"transformers, which is not installed: `pip install transformers`"):
        go.diagnostics.HuggingFaceMonitor  # noqa: B018
