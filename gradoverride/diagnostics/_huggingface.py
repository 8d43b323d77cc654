"""`HuggingFaceMonitor`: `go.monitor` as a HuggingFace `TrainerCallback`, adding the
overrides' numbers to what the `Trainer` logs. Imported at first use; needs `transformers`."""

from __future__ import annotations

import importlib
from typing import Any

from .._errors import GradOverrideError
from ._monitor import Monitor, monitor

try:
    _transformers: Any = importlib.import_module("transformers")
except ImportError:
    msg = (
        "gradoverride.diagnostics.HuggingFaceMonitor needs HuggingFace transformers, which is "
        "not installed: `pip install transformers` (or `pip install "
        "'gradoverride[integrations]'`). Without it, `go.monitor(model)` records the same "
        "numbers in any loop."
    )
    raise GradOverrideError(msg) from None

_CALLBACK: Any = _transformers.TrainerCallback
__all__ = ["HuggingFaceMonitor"]


class HuggingFaceMonitor(_CALLBACK):  # type: ignore[misc]
    """Record the gradient overrides of a model while a HuggingFace `Trainer` trains it, and
    add their numbers to what the trainer logs (its `log_history`, and the reporting
    integrations of `report_to`).

    `trainer.callback_handler.callbacks.insert(0, HuggingFaceMonitor(every=10))` before
    `trainer.train()`; after it, the callback's `monitor` has the summary and history. The
    diagnostics page trains a small model with it.

    Training runs inside `go.monitor(model, every=every, max_steps=max_steps)`, from the
    start of `trainer.train()` to its end. At each of the trainer's logging steps
    (`logging_steps`), `monitor.scalars(prefix)` (the latest recorded step) is added to the
    logs, under keys like `gradoverride/encoder.0.act/grad_in`. The `Trainer` runs its
    callbacks in order, the reporting ones (`report_to`: TensorBoard, Weights & Biases)
    first when given in `callbacks=`: put this one first, as above, for them to log its
    numbers; `log_history` has them either way. If training raises, call its `close()`
    (the `Trainer` calls no callback then) before another monitor starts.

    Args:
        every: record one backward pass in `every` (see `go.monitor`).
        max_steps: keep the records of the last `max_steps` recorded steps (None: all).
        prefix: the first part of the logged keys ("" for none).
    """

    def __init__(self, every: int = 1, max_steps: int | None = None,
                 prefix: str = "gradoverride") -> None:
        self.every = every
        self.max_steps = max_steps
        self.prefix = prefix
        self.monitor: Monitor | None = None

    def on_train_begin(self, args: Any, state: Any,
                       control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            msg = (
                "HuggingFaceMonitor needs the model the Trainer trains; the Trainer passed "
                "none to on_train_begin. Use `go.monitor(model)` around your own loop instead."
            )
            raise GradOverrideError(msg)
        self.close()
        self.monitor = monitor(model, every=self.every, max_steps=self.max_steps)
        self.monitor.__enter__()

    def on_log(self, args: Any, state: Any, control: Any,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if self.monitor is None or logs is None:
            return
        numbers = self.monitor.scalars(self.prefix)
        logs.update(numbers)
        if state.log_history:
            state.log_history[-1].update(numbers)  # the entry the trainer made of `logs`

    def on_train_end(self, args: Any, state: Any,
                     control: Any, **kwargs: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop recording (what the end of training does)."""
        if self.monitor is not None and self.monitor.recording:
            self.monitor.__exit__(None, None, None)
