"""Which framework a value belongs to, without importing any framework.

`import gradoverride` never imports TensorFlow (DESIGN §2.8): a TensorFlow value can only
exist once the user has imported TensorFlow, so `sys.modules` is asked first and nothing is
imported here. The TensorFlow backend (`gradoverride._tensorflow`) is imported the first
time one of its tensors reaches a gradoverride function.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils import _pytree as pytree

__all__ = ["any_tensorflow", "is_tensorflow"]


def is_tensorflow(value: object) -> bool:
    """Whether `value` is a TensorFlow tensor, variable (Keras 3 variables included) or
    composite tensor (`IndexedSlices`, ...)."""
    tf: Any = sys.modules.get("tensorflow")
    if tf is None or not type(value).__module__.startswith(("tensorflow", "keras")):
        return False
    return bool(tf.is_tensor(value))


def any_tensorflow(args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> bool:
    """Whether any argument (tuples, lists and dicts are searched) is TensorFlow's.

    Free when TensorFlow was never imported: one lookup in `sys.modules`.
    """
    if "tensorflow" not in sys.modules:
        return False
    values = args if not kwargs else (*args, *kwargs.values())
    return any(is_tensorflow(leaf) for leaf in pytree.tree_leaves(values))
