"""What every recipe is: a small frozen object with a readable repr, callable on tensors,
with an `nn.Module` form.

A recipe is a frozen dataclass whose class name is the public factory name, so its repr is
the call that makes it (`reverse_grad(scale=1.0)`), like attrs validators:

    @dataclass(frozen=True, repr=False)
    class reverse_grad(GradientTransform):
        scale: float = 1.0
        def transform(self, grad): return -self.scale * grad

Two kinds:

* `Recipe`: an op with an overridden gradient (a straight-through round, a spike with a
  surrogate). `recipe(x, ...)` runs it; `recipe.module()` is its `nn.Module` form.
* `GradientTransform`: a recipe whose forward is the identity and whose backward maps the
  upstream gradient (reversal, scaling, clipping). `recipe(x)` returns `x` with the
  transformed gradient; `recipe.transform(grad)` applies the map to a gradient directly, which
  is what `go.grad_hook` uses, so any gradient transform can be a hook.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from torch import Tensor, nn
from torch.compiler import is_dynamo_compiling

from .._backends import backend
from .._decorators import custom_backward
from .._errors import GradOverrideError
from .._frameworks import autograph_artifact, is_jax, is_tensorflow
from .._function import RECORDERS, RECORDING
from .._internals import is_grad_scaler
from .._jit import refuse_scripting
from .._passthrough import passthrough

__all__ = ["GradientTransform", "Recipe", "RecipeModule"]


class Recipe:
    """Base of all recipes. Subclasses are frozen dataclasses and define `__call__`."""

    # Called from a `tf.function`, a recipe runs as plain Python rather than being rewritten
    # by AutoGraph (see the same mark on `CustomBackward`).
    autograph_info__ = frozenset(("autograph_artifact",))

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # While a model is recorded (go.monitor, go.overrides, gradient_report), a recipe's
        # call tells the recorder that the ops it calls are this recipe's: their row names
        # it. Otherwise the call goes straight through.
        if "__call__" in cls.__dict__:
            cls.__call__ = _told_to_recorder(cls.__dict__["__call__"])  # type: ignore[method-assign]
        # Its methods too (`spike.preset(...)` in a tf.function): AutoGraph looks at the
        # function behind a bound method, not at the class.
        autograph_artifact(cls)

    def __call__(self, x: Tensor, /, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def module(self) -> RecipeModule:
        """This recipe as an `nn.Module` (for `nn.Sequential`); its repr is the recipe's."""
        return RecipeModule(self)

    def __repr__(self) -> str:
        if not dataclasses.is_dataclass(self):  # a user's subclass without @dataclass
            return f"{type(self).__name__}()"
        fields = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.repr
        )
        return f"{type(self).__name__}({fields})"


def _told_to_recorder(call: Callable[..., Any]) -> Callable[..., Any]:
    """A recipe class's `__call__`, telling a recorder that the call runs (see
    `Recipe.__init_subclass__`)."""

    @functools.wraps(call)
    def __call__(self: Recipe, *args: Any, **kwargs: Any) -> Any:
        if args and "jax" in sys.modules and is_jax(args[0]):
            return array_call(self, *args, **kwargs)
        if RECORDERS and not is_dynamo_compiling():
            for recorder in RECORDERS:
                # The recorder keeps the call on its stack (one call, straight to it).
                return recorder.recipe_call(self, call, args, kwargs)
        return call(self, *args, **kwargs)

    # This wrapper and the call it wraps, for a recipe's module form (see `RecipeModule._run`):
    # a pair holding the wrapper itself, since `functools.wraps` copies a function's
    # attributes onto whatever wraps it later.
    __call__._gradoverride_told = (__call__, call)  # type: ignore[attr-defined]
    return __call__


def _transformed(grad: Tensor, *, transform: GradientTransform) -> Tensor:
    return transform.transform(grad)


@custom_backward(backward=_transformed)
def _transform_gradient(x: Tensor, transform: GradientTransform) -> Tensor:
    return passthrough(x)  # a view of `x`: see `passthrough`


@custom_backward(backward=_transformed)
def _transform_gradient_copy(x: Tensor, transform: GradientTransform) -> Tensor:
    return passthrough(x, fresh=True)  # the module form: an in-place op may follow


class GradientTransform(Recipe):
    """A recipe whose forward is the identity and whose backward is `transform(grad)`."""

    def transform(self, grad: Tensor) -> Tensor:
        """The gradient this recipe passes on, given the upstream `grad`."""
        raise NotImplementedError

    def __call__(self, x: Tensor, /, *args: Any, **kwargs: Any) -> Tensor:
        if not isinstance(x, Tensor) and is_tensorflow(x):
            return tensorflow_call(self, x, *args, **kwargs)
        if args or kwargs:
            msg = f"{self!r} takes one tensor; got {len(args) + 1} positional and {sorted(kwargs)}."
            raise TypeError(msg)
        return _transform_gradient(x, self)


class RecipeModule(nn.Module):
    """The `nn.Module` form of a recipe: `forward(x, ...)` is `recipe(x, ...)`.

    For a gradient transform (identity forward) the module returns a copy of its input where
    the function form returns a view: modules sit in `nn.Sequential` blocks, where an in-place
    activation may follow (`Linear -> reverse_grad().module() -> ReLU(inplace=True)`), and an
    in-place op on a view made inside an autograd Function is refused by PyTorch. The copy
    costs one pass over the tensor in forward.
    """

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        self.recipe = recipe

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        if RECORDING and not is_dynamo_compiling():
            for recorder in RECORDING:
                # A recorder keeps the call on its stack, as it keeps a recipe's: the module
                # needs no module hooks of the recorder's (each sends a call down torch's
                # slow path); called on its own, it is a forward to the recorder.
                return recorder.module_form_call(self, (x, *args), kwargs)
        return self._run(x, *args, **kwargs)

    def _run(self, x: Tensor, *args: Any, **kwargs: Any) -> Any:
        recipe = self.recipe
        if isinstance(recipe, GradientTransform) and isinstance(x, Tensor) and not (
            args or kwargs
        ) and type(recipe).__call__ is GradientTransform.__call__:
            return _transform_gradient_copy(x, recipe)
        if RECORDERS and isinstance(x, Tensor) and not is_dynamo_compiling():
            # On a recorder's stack already (see `forward`), where the module names its
            # recipe: the call the class's recorder wrapper wraps, which would put the
            # recipe on the stack again; not when another wrapper is around it (a class
            # decorator's), which must run.
            call = type(recipe).__call__
            told = getattr(call, "_gradoverride_told", None)
            if told is not None and told[0] is call:
                return told[1](recipe, x, *args, **kwargs)
        return recipe(x, *args, **kwargs)

    def __repr__(self) -> str:
        return repr(self.recipe)

    def __prepare_scriptable__(self) -> nn.Module:
        # torch.jit.script calls this on every module it scripts.
        refuse_scripting(repr(self.recipe))


def finite(value: float) -> bool:
    """`math.isfinite(value)` in comparisons, which dynamo applies to a float it traces as
    symbolic (`torch.compile(dynamic=True)` makes a module's float attributes so), where it
    cannot apply `math.isfinite`."""
    return value == value and -math.inf < value < math.inf


def positive_number(recipe: str, name: str, value: object, hint: str = "") -> float:
    """`value` as a float if it is a positive finite number, else a GradOverrideError naming
    the recipe and the argument (`hint`, if given, ends the message with the fix)."""
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not finite(value)
        or value <= 0
    ):
        msg = (
            f"{recipe}: `{name}` must be a positive finite number; got "
            f"{type(value).__name__} {value!r}.{' ' + hint if hint else ''}"
        )
        raise GradOverrideError(msg)
    return float(value)


def keep_dtype(value: Tensor, like: Tensor) -> Tensor:
    """`value` in `like`'s dtype: recipes never change the caller's dtype."""
    return value if value.dtype == like.dtype else value.to(like.dtype)


# ---- TensorFlow and JAX ---------------------------------------------------------------------
#
# Each recipe's `__call__` (and each gradient transform's `transform`) starts with
# `if not isinstance(x, Tensor) and is_tensorflow(x): return array_call(self, x)`: written
# inline, so a torch tensor costs one isinstance check and no extra Python frame (a JAX array
# is sent by the call's wrapper above). The recipes on those arrays
# (`gradoverride.recipes._on_arrays`) import their framework's backend at the first such
# array, so `import gradoverride` imports neither framework. Both helpers are typed as
# returning a Tensor so that the recipes' torch-typed signatures hold; the value is the
# framework's own.


def array_call(recipe: object, x: Any, /, *args: Any, **kwargs: Any) -> Tensor:
    """`recipe(x, ...)` for a TensorFlow or JAX `x`; a recipe with no form there raises
    GradOverrideTypeError naming those that have one."""
    _refuse_torch_scaler(recipe, x)
    result: Tensor = _framework(x).call_recipe(recipe, x, *args, **kwargs)
    return result


def array_transform(recipe: object, grad: Any, /, **kwargs: Any) -> Tensor:
    """`recipe.transform(grad, ...)` for a TensorFlow (dense or IndexedSlices) or JAX
    gradient."""
    _refuse_torch_scaler(recipe, grad)
    result: Tensor = _framework(grad).transform_gradient(recipe, grad, **kwargs)
    return result


def _framework(value: Any) -> ModuleType:
    """The backend package of a TensorFlow or JAX value (imported on first use)."""
    return backend("tensorflow" if is_tensorflow(value) else "jax")


#: The names the recipe modules used before JAX arrays were recipes' inputs too.
tensorflow_call = array_call
tensorflow_transform = array_transform


def _refuse_torch_scaler(recipe: object, value: Any) -> None:
    """A recipe given torch's GradScaler (`scaler=`) has nothing to read on another
    framework's gradient: on TensorFlow the loss is scaled by Keras' LossScaleOptimizer,
    which `scaler=` takes instead; on JAX the gradients are unscaled before the recipe."""
    scaler = getattr(recipe, "scaler", None)
    if scaler is not None and is_grad_scaler(scaler):
        name = type(recipe).__name__
        if is_tensorflow(value):
            instead = (
                "TensorFlow's: a GradScaler scales torch losses only. Under Keras mixed "
                "precision give the optimizer that scales the loss, the LossScaleOptimizer "
                "(`scaler=model.optimizer` after `model.compile` under the `mixed_float16` "
                "policy), or no scaler."
            )
        else:
            instead = (
                "a JAX array: a GradScaler scales torch losses only. Unscale the JAX "
                "gradients before the recipe sees them, and give no scaler."
            )
        kind = type(scaler).__name__
        msg = f"{name}(scaler=...) got torch's {kind}, and this gradient is {instead}"
        raise GradOverrideError(msg)
