"""The frameworks besides torch, each found through this one registry by name.

A framework's implementation of gradoverride lives in its own package
(`gradoverride._tensorflow` for TensorFlow and Keras, `gradoverride._jax` for JAX), which
imports the torch side freely. The torch side never imports it: once a value of that
framework reaches a gradoverride function (`_frameworks.is_tensorflow` and `is_jax` tell,
without importing anything), the function asks this registry for the framework's package
and calls one of its entry points. So `import gradoverride` imports no other framework,
the package's import graph has no cycle, and a new framework, or a new entry point of one,
grows its own package only (the way einops finds its backends).

The entry points a backend package provides (`ENTRY_POINTS`), each loaded on first use:
the array primitives the recipes' formulas are written with (`OPS`, a
`gradoverride._ops.Backend`) and the recipes on its arrays (`call_recipe`,
`transform_gradient`: `gradoverride.recipes._on_arrays`, shared by every framework), the
`custom_backward` call (`TensorFlowCall`) and its
`tf.function` trace type (`OpTraceType`), the straight-through rule
(`straight_through_gradient`, `window_mask`), `bridge_call`, and the module side
(`override_layer`, `hook_layer`). JAX provides `OPS`, the recipes, its `custom_backward` call
(`JaxCall`) and the straight-through rule so far.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ._frameworks import autograph_artifact

__all__ = ["BACKENDS", "ENTRY_POINTS", "backend"]

#: Framework name -> the package that implements gradoverride on it.
BACKENDS: dict[str, str] = {"tensorflow": "gradoverride._tensorflow", "jax": "gradoverride._jax"}

#: What a full backend package provides (as module attributes, loaded on first use); JAX
#: provides `OPS`, `call_recipe`, `transform_gradient`, `JaxCall`,
#: `straight_through_gradient` and `window_mask` so far.
ENTRY_POINTS: tuple[str, ...] = (
    "OPS", "call_recipe", "transform_gradient", "TensorFlowCall", "OpTraceType",
    "straight_through_gradient", "window_mask", "bridge_call", "override_layer", "hook_layer",
)


@autograph_artifact  # called while tf.function traces: AutoGraph must not convert importlib
def backend(framework: str) -> ModuleType:
    """The package implementing gradoverride on `framework` (imported on first use)."""
    return importlib.import_module(BACKENDS[framework])
