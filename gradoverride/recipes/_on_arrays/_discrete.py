"""Placeholder: filled in as this family moves onto the backend protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: recipe class -> implementation(b, recipe, x, *args, **kwargs)
CALLS: dict[type, Callable[..., Any]] = {}
#: recipe class -> implementation(b, recipe, grad, **kwargs)
TRANSFORMS: dict[type, Callable[..., Any]] = {}
