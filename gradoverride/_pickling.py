"""Pickling what gradoverride makes: functions go by reference, so say which cannot.

pickle stores a function by its module and qualified name, and fails with a terse message
for a lambda or a function defined inside another. An op, a bridge, an override or a hook
that holds such a function cannot be saved; `require_importable` says so when saving, naming
the function and the fix, instead of pickle's bare error (or a checkpoint that cannot be
loaded back).
"""

from __future__ import annotations

import pickle
import sys
from typing import Any

from ._errors import GradOverrideError
from ._signature import describe

__all__ = ["found_at_its_name", "require_importable"]


def found_at_its_name(obj: Any) -> bool:
    """Whether pickle, looking `obj` up by its module and qualified name, finds `obj`."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    qualname = getattr(obj, "__qualname__", None)
    if module is None or not qualname or "<locals>" in qualname:
        return False
    found: Any = module
    for part in qualname.split("."):
        found = getattr(found, part, None)
        if found is None:
            return False
    return found is obj


def require_importable(fn: Any, owner: str, what: str, fix: str = "") -> None:
    """Refuse, naming `owner` (what is being pickled) and `fn` (`what` it is to the owner),
    a function pickle cannot store; `fix` adds another way out."""
    if found_at_its_name(fn):
        return
    try:
        pickle.dumps(fn)
    except Exception as exc:  # pickle raises several types here
        msg = (
            f"{owner} cannot be pickled: {what}, `{describe(fn)}`, is not importable by name "
            f"({type(exc).__name__}: {exc}); pickle stores functions by their module and "
            "name, so define it at the top level of a module (not a lambda or a function "
            f"inside a function){fix}."
        )
        raise GradOverrideError(msg) from None
