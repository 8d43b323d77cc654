"""The exceptions gradoverride raises for user mistakes.

Every message is a full sentence that names the function or module, the argument, what was
expected, what was got, and how to fix it.
"""

from __future__ import annotations

__all__ = ["GradOverrideError", "GradOverrideTypeError", "GradOverrideWarning"]


class GradOverrideError(Exception):
    """A gradient override was used in a way gradoverride cannot honour.

    Raised for mistakes found while a rule runs (a gradient of the wrong shape, dtype or
    device, a gradient for an input the rule does not own, ...) and for misuse of the API.
    """


class GradOverrideTypeError(GradOverrideError, TypeError):
    """A signature mistake: a rule or call whose parameters do not fit the forward.

    For example a rule naming a parameter the forward does not have, a rule with no positional
    parameter for the upstream gradient, or a call with arguments the forward does not take.
    It is a `TypeError`, as Python's own signature errors are.
    """


class GradOverrideWarning(UserWarning):
    """Something gradoverride does not do for a call it cannot refuse, said where it happens.

    For example a monitored model whose compiled calls run unrecorded.
    """


# Tracebacks and reprs show the public path, not the private module.
GradOverrideError.__module__ = "gradoverride"
GradOverrideTypeError.__module__ = "gradoverride"
GradOverrideWarning.__module__ = "gradoverride"
