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
    "TensorFlowCall": ("_backend", "TensorFlowCall"),
    "OpTraceType": ("_tracing", "OpTraceType"),
    "call_recipe": ("recipes", "call"),
    "transform_gradient": ("recipes", "transform"),
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
    value = getattr(importlib.import_module(f".{module}", __name__), attribute)
    globals()[name] = value
    return value
