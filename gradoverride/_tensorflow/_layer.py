"""`gradoverride.keras.Layer` and the helpers the Keras module side shares with it
(`_keras_modules.py`, `_inventory.py`): defined in `gradoverride._keras._layer`, since the
class serves every Keras backend."""

from __future__ import annotations

from .._keras._layer import Layer, _relative_names, frozen_in, with_layer_slot
from .._keras._stateless import autocast_scope

__all__ = ["Layer", "_relative_names", "autocast_scope", "frozen_in", "with_layer_slot"]
