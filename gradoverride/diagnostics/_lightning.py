"""`LightningMonitor`: `go.monitor` as a PyTorch Lightning callback, logging through the
trainer's loggers. Imported at first use; needs `lightning` (or `pytorch_lightning`)."""

from __future__ import annotations

import importlib
from typing import Any

from .._errors import GradOverrideError
from ._monitor import Monitor, monitor


def _lightning() -> Any:
    """PyTorch Lightning's package (`lightning.pytorch`, or the older `pytorch_lightning`)."""
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    msg = (
        "gradoverride.diagnostics.LightningMonitor needs PyTorch Lightning, which is not "
        "installed: `pip install lightning` (or `pip install 'gradoverride[integrations]'`). "
        "Without it, `go.monitor(model)` records the same numbers in any loop."
    )
    raise GradOverrideError(msg)


_CALLBACK: Any = _lightning().Callback
__all__ = ["LightningMonitor"]


class LightningMonitor(_CALLBACK):  # type: ignore[misc]
    """Record the gradient overrides of a `LightningModule` while it trains, and log their
    numbers with the trainer's loggers (TensorBoard, Weights & Biases, CSV, ...).

    `trainer = lightning.Trainer(callbacks=[LightningMonitor(every=10)])`; after
    `trainer.fit(...)`, the callback's `monitor` has the summary and history. The
    diagnostics page trains a small module with it.

    Training runs inside `go.monitor(module, every=every, max_steps=max_steps)`, from the
    start of training to its end (or an exception). After each training batch whose
    backward pass was a recorded step, `monitor.scalars(prefix)` goes to each of the
    trainer's loggers (`logger.log_metrics`, at the trainer's `global_step`), under keys like
    `gradoverride/encoder.0.act/grad_in`: one row per recorded step, so `every` is how often
    they are logged. With gradient accumulation, only at the batches where the optimizer
    steps (the latest recorded step then). Under mixed precision with loss scaling
    (`precision="16-mixed"`) the norms are the true, unscaled ones (the trainer's
    GradScaler is passed on).

    Args:
        every: record one backward pass in `every` (see `go.monitor`).
        max_steps: keep the records of the last `max_steps` recorded steps (None: all).
        prefix: the first part of the logged keys ("" for none).
        log: whether to log the numbers (False: only record them in `monitor`).
    """

    def __init__(self, every: int = 1, max_steps: int | None = None,
                 prefix: str = "gradoverride", log: bool = True) -> None:
        super().__init__()
        self.every = every
        self.max_steps = max_steps
        self.prefix = prefix
        self.log = log
        self.monitor: Monitor | None = None
        self._logged = -1  # the last recorded step logged
        self._optimizer_steps = 0  # the trainer's global_step when last logged

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Mixed precision ("16-mixed") scales the loss with the precision plugin's
        # GradScaler: the monitor then records the true (unscaled) norms.
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)
        self.monitor = monitor(pl_module, every=self.every, max_steps=self.max_steps,
                               scaler=scaler)
        self.monitor.__enter__()
        self._logged = -1
        self._optimizer_steps = trainer.global_step

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        current = self.monitor
        if current is None or not self.log:
            return
        latest = current.latest()
        if not latest:
            return
        step = next(iter(latest.values())).step
        if trainer.global_step == self._optimizer_steps:
            return  # accumulating gradients: logged when the optimizer steps
        self._optimizer_steps = trainer.global_step
        if step != self._logged:
            self._logged = step
            # Straight to the loggers, as Lightning's LearningRateMonitor does: a value given
            # to `log_dict` would be logged again at each logging step until the next one.
            metrics = current.scalars(self.prefix)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._stop()

    def on_exception(self, trainer: Any, pl_module: Any,
                     exception: BaseException) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.monitor is not None and self.monitor.recording:
            self.monitor.__exit__(None, None, None)
