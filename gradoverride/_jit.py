"""TorchScript cannot keep a gradoverride rule; what scripting or tracing one says instead.

`torch.jit.script` compiles a module's forward from its source, and `torch.jit.trace` records
the tensor operations a call makes; neither keeps the Python rule a gradoverride module runs
in backward, so the scripted module would silently train with its ordinary gradient. Every
gradoverride module refuses in `__prepare_scriptable__` (which `torch.jit.script` calls on
each module it scripts), and module calls refuse while `torch.jit.trace` records. TorchScript
is deprecated in PyTorch; `torch.compile` keeps the rules, and `torch.export` / ONNX record an
inference graph, where no backward rule applies.
"""

from __future__ import annotations

from typing import Any, NoReturn

from ._errors import GradOverrideError

__all__ = ["RefuseScripting", "jit_message", "refuse_scripting"]


def jit_message(where: str, tool: str) -> str:
    """The refusal for `where` (a module or op, quoted) under `tool`."""
    deploy = (
        "to deploy, trace under `torch.no_grad()` or `torch.inference_mode()` (the forward "
        "is recorded alone: no rule applies to inference), or use torch.export or ONNX"
        if tool == "torch.jit.trace"
        else "for deployment use torch.export or ONNX, which record the forward for "
        "inference, where no rule applies"
    )
    return (
        f"{tool} cannot keep the backward rule of {where}: TorchScript compiles or records "
        "the forward alone, so the module would silently train with its ordinary gradient. "
        "Keep the module in Python, and use torch.compile to speed it up (the rule is kept, "
        f"with no graph break); {deploy}."
    )


def refuse_scripting(where: str) -> NoReturn:
    raise GradOverrideError(jit_message(where, "torch.jit.script"))


class RefuseScripting:
    """Put on a module instance as `__prepare_scriptable__` (by `override_backward` and
    `grad_hook`, which cannot change the module's class): scripting it raises.

    An object, not a closure, so that the module still pickles."""

    __slots__ = ("where",)

    def __init__(self, where: str) -> None:
        self.where = where

    def __call__(self) -> NoReturn:
        refuse_scripting(self.where)

    def __reduce__(self) -> tuple[Any, ...]:
        return (RefuseScripting, (self.where,))
