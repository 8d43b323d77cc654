"""The well-known gradient overrides, each one documented formula (DESIGN §2.6).

Every recipe is a small frozen object with a readable repr, callable on tensors, with an
`nn.Module` form (`recipe.module()`), keeping the input's dtype. Gradient transforms
(`GradientTransform`) also work as `go.grad_hook` transforms.
"""

from ._base import GradientTransform, Recipe, RecipeModule

__all__ = ["GradientTransform", "Recipe", "RecipeModule"]
