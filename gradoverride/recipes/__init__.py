"""The well-known gradient overrides, each one documented formula.

Every recipe is a small frozen object with a readable repr, callable on tensors, with an
`nn.Module` form (`recipe.module()`), keeping the input's dtype. Gradient transforms
(`GradientTransform`) also work as `go.grad_hook` transforms.
"""

from ._base import GradientTransform, Recipe, RecipeModule
from ._discrete import gumbel_softmax, rotation_trick, ste_argmax
from ._flow import (
    ScaledGradientModule,
    clip_grad_norm,
    clip_grad_value,
    ganin_ramp,
    reverse_grad,
    sanitize_grad,
    scale_grad,
)
from ._solvers import blackbox_solver, perturbed_optimizer
from ._ste import (
    BINARIZE_PRESETS,
    CLAMP_PRESETS,
    LearnedStepQuantizer,
    abs_subgradient,
    binarize,
    lsq,
    quantize,
    ste_ceil,
    ste_clamp,
    ste_floor,
    ste_round,
    ste_sign,
    ternarize,
)
from ._surrogate import SPIKE_PRESETS, SURROGATES, spike
from ._surrogate_width import LearnedAlphaSpike

__all__ = [
    "BINARIZE_PRESETS",
    "CLAMP_PRESETS",
    "SPIKE_PRESETS",
    "SURROGATES",
    "GradientTransform",
    "LearnedAlphaSpike",
    "LearnedStepQuantizer",
    "Recipe",
    "RecipeModule",
    "ScaledGradientModule",
    "abs_subgradient",
    "binarize",
    "blackbox_solver",
    "clip_grad_norm",
    "clip_grad_value",
    "ganin_ramp",
    "gumbel_softmax",
    "lsq",
    "perturbed_optimizer",
    "quantize",
    "reverse_grad",
    "rotation_trick",
    "sanitize_grad",
    "scale_grad",
    "spike",
    "ste_argmax",
    "ste_ceil",
    "ste_clamp",
    "ste_floor",
    "ste_round",
    "ste_sign",
    "ternarize",
]
