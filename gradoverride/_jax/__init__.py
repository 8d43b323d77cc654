"""The JAX backend: imported the first time a JAX array reaches a gradoverride function,
never by `import gradoverride`.

The torch side finds it through `gradoverride._backends` and calls the entry points below,
each loaded (with JAX) on first use. So far JAX has the ops: `custom_backward` and
`straight_through` (`JaxCall`, `straight_through_gradient`, `window_mask`); recipes, the
module side and `gradoverride.testing` take torch and TensorFlow values only.
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
    "JaxCall": ("_backend", "JaxCall"),
    "straight_through_gradient": ("_straight_through", "gradient"),
    "window_mask": ("_straight_through", "window_mask"),
}


def __getattr__(name: str) -> Any:
    if name not in _ENTRY_POINTS:
        msg = f"module 'gradoverride._jax' has no attribute {name!r}"
        raise AttributeError(msg)
    module, attribute = _ENTRY_POINTS[name]
    where = module if module.startswith("gradoverride.") else f"{__name__}.{module}"
    value = getattr(importlib.import_module(where), attribute)
    globals()[name] = value
    return value
