"""`saved_bytes`: what a call keeps alive for backward."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["saved_bytes"]


def saved_bytes(fn: Callable[..., Any], *inputs: Any, **kwargs: Any) -> int:
    """The bytes autograd saves for backward while `fn(*inputs, **kwargs)` runs.

    ```python
    import torch
    from gradoverride import recipes
    from gradoverride.testing import saved_bytes

    x = torch.randn(1000, requires_grad=True)
    print(saved_bytes(recipes.ste_sign(), x))  # an identity rule keeps nothing alive
    #> 0
    print(saved_bytes(recipes.binarize(clip=1.0), x))  # the window keeps the input
    #> 4000
    ```

    Counted with `torch.autograd.graph.saved_tensors_hooks`: every tensor saved by any node
    the call records, as numel * element size (a saved input counts although it may be alive
    anyway).
    """
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs, **kwargs)
    return total
