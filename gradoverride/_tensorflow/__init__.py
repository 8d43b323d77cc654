"""The TensorFlow backend: imported the first time a TensorFlow tensor reaches a gradoverride
function (or by `gradoverride.keras`), never by `import gradoverride`.

The torch side finds it through `gradoverride._backends` and calls the entry points below,
each loaded (with TensorFlow) on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Entry point -> (module of this package, attribute).
_ENTRY_POINTS = {
    "OPS": ("_ops", "OPS"),
    # The recipes on this framework's arrays: written once, for every framework.
    "call_recipe": ("gradoverride.recipes._on_arrays", "call"),
    "transform_gradient": ("gradoverride.recipes._on_arrays", "transform"),
    "TensorFlowCall": ("_backend", "TensorFlowCall"),
    "OpTraceType": ("_tracing", "OpTraceType"),
    "straight_through_gradient": ("_straight_through", "gradient"),
    "window_mask": ("_straight_through", "window_mask"),
    "bridge_call": ("_bridge", "call"),
    "override_layer": ("_keras_modules", "override_layer"),
    "hook_layer": ("_keras_modules", "hook_layer"),
    "keras_overrides": ("_inventory", "keras_overrides"),
}


def __getattr__(name: str) -> Any:
    if name not in _ENTRY_POINTS:
        msg = f"module 'gradoverride._tensorflow' has no attribute {name!r}"
        raise AttributeError(msg)
    module, attribute = _ENTRY_POINTS[name]
    where = module if module.startswith("gradoverride.") else f"{__name__}.{module}"
    value = getattr(importlib.import_module(where), attribute)
    globals()[name] = value
    return value
