"""`custom_backward` on JAX arrays: the same rule contract, on `jax.custom_vjp`.

A call whose arguments hold JAX arrays (tracers included) comes here (see `CustomBackward`),
with the rule the user registered. What is the same as in torch: the rule's signature
(positional upstream gradients, keyword-only names for what it needs, `output`,
`needs_grad`, residuals), the return forms (array, tuple, dict, containers), ownership
(`owns=`), the checks on every returned gradient and their error texts (`_gradients.py`),
`once_differentiable`.

How the contract maps onto `jax.custom_vjp`, built per call around the forward:

* Every JAX array among the arguments is an argument of the `custom_vjp` function, so
  tracers of `jax.jit` and `jax.vmap` go in as arguments, never in a closure. Python
  values (numbers, strings) and numpy arrays stay in the closure: they are constants to
  JAX and get no gradient. An integer or bool array gets none either (JAX's float0 zero).
* Only what the rule names is saved (the `custom_vjp` residuals): the inputs it names,
  declared residuals, `output`; arrays among them are residuals, other values stay in the
  closure.
* An owned floating-point (or complex) array gets the rule's gradient; one the rule does
  not own (`owns=`) gets its ordinary JAX gradient, from a `jax.vjp` of the forward taken
  in the forward pass (only when there is such an input).
* Shapes and dtypes of returned gradients are checked as in torch (JAX's own check names
  neither the function nor the argument): a shape the input broadcasts to is summed down,
  another float precision is cast, anything else is a `GradOverrideError` naming the input.
  The checks read static shapes, so they run while `jax.jit` traces, and per example under
  `jax.vmap` (which batches the `custom_vjp` itself).

Differences from torch, as `jax.custom_vjp` has them: an output the loss does not use
sends the rule zeros (`materialize_grads=False` has no effect); `needs_grad` is True for
every owned floating-point input (JAX does not say which gradients will be used);
forward-mode differentiation (`jax.jvp`, `jax.jacfwd`) is refused by JAX itself; a rule
written in `jnp` ops has second derivatives (`jax.grad(jax.grad(f))`), in which the
values it names are differentiated through the forward's own ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch.utils import _pytree as pytree

from .._errors import GradOverrideError, GradOverrideTypeError
from .._function import check_output_count, flatten_inputs, unflatten_inputs, unpack_residuals
from .._gradients import (
    SKIP,
    dtype_message,
    flat_gradients,
    no_gradient_slot_message,
    not_a_tensor_message,
    shape_message,
    slot_ranges,
)
from .._rule import RuleSpec
from .._signature import ForwardSignature

__all__ = ["JaxCall", "check_gradient"]


class _Meta(NamedTuple):
    """An input's shape and dtype: what checking its gradient needs."""

    shape: tuple[int, ...]
    dtype: Any


def _is_array(value: object) -> bool:
    return isinstance(value, jax.Array)


def _differentiable(value: object) -> bool:
    """A floating-point or complex JAX array: one that can have a gradient."""
    return isinstance(value, jax.Array) and bool(jnp.issubdtype(value.dtype, jnp.inexact))


class _Output(NamedTuple):
    """How the forward's output is rebuilt from the arrays the `custom_vjp` returns."""

    leaves: list[Any]  # the output's leaves; arrays are replaced by the returned ones
    spec: Any
    arrays: tuple[int, ...]  # the leaves that are JAX arrays (returned by the custom_vjp)
    picked: tuple[int, ...]  # among `arrays`, the floating-point ones (carry a gradient)
    tuple_output: bool  # a plain tuple: the rule takes one upstream gradient per element


class JaxCall:
    """One op's calls with JAX arrays. Built once per op, on its first such call."""

    def __init__(
        self,
        op: str,
        sig: ForwardSignature,
        spec: RuleSpec,
        residuals: tuple[str, ...],
        *,
        rule: Callable[..., Any],
    ) -> None:
        self.op = op
        self.sig = sig
        self.spec = spec
        self.residuals = residuals
        self.rule = rule
        self.note = f"(raised in backward rule `{spec.name}` of `{op}`)"

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        values = self.sig.bind(args, kwargs)
        flat, layout = flatten_inputs(values, _is_array)
        if any(isinstance(v, torch.Tensor) for v in flat):
            self._refuse_torch(flat, layout)
        owned = _per_leaf(self.spec.owned, layout)
        # Every array is an argument of the custom_vjp (tracers must not be closed over);
        # of those, the rule gives the owned floating-point ones their gradient, JAX the
        # floating-point ones it does not own, and the rest (integer, bool) get none.
        arrays = tuple(i for i, v in enumerate(flat) if isinstance(v, jax.Array))
        slots = tuple(i for i in arrays if owned[i] and _differentiable(flat[i]))
        others = tuple(i for i in arrays if not owned[i] and _differentiable(flat[i]))
        meta = [
            (_Meta(tuple(v.shape), v.dtype) if i in slots else SKIP) if _differentiable(v)
            else None
            for i, v in enumerate(flat)
        ]
        made: dict[str, Any] = {}

        def inputs_of(given: tuple[Any, ...]) -> list[Any]:
            inputs = list(flat)
            for i, value in zip(arrays, given, strict=True):
                inputs[i] = value
            return inputs

        def primal(*given: Any) -> Any:
            output, _ = self._forward(inputs_of(given), layout)
            return self._split(output, made)

        def fwd(*given: Any) -> Any:
            inputs = inputs_of(given)
            pullback = None
            if others:  # their ordinary gradient: the forward's own vjp in them

                def of_others(*values: Any) -> Any:
                    changed = list(inputs)
                    for i, value in zip(others, values, strict=True):
                        changed[i] = value
                    output, residuals = self._forward(changed, layout)
                    return self._split(output, made), (output, residuals)

                out, pullback, (output, residuals) = jax.vjp(
                    of_others, *(inputs[i] for i in others), has_aux=True
                )
            else:
                output, residuals = self._forward(inputs, layout)
                out = self._split(output, made)
            saved = self._saved(inputs, layout, slots, output, residuals)
            leaves, saved_spec = jax.tree_util.tree_flatten(saved)
            kept = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
            # Only arrays can be residuals; other values the rule names stay here.
            made["saved"] = (saved_spec, [None if _is_array(v) else v for v in leaves])
            return out, (kept, pullback)

        def bwd(res: Any, cotangents: Any) -> Any:
            kept, pullback = res
            saved_spec, statics = made["saved"]
            it = iter(kept)
            saved = jax.tree_util.tree_unflatten(
                saved_spec, [next(it) if v is None else v for v in statics]
            )
            grads = self._gradients(cotangents, made["output"], saved, meta, layout, slots)
            by_input = dict(zip(slots, grads, strict=True))
            if pullback is not None:
                by_input.update(zip(others, pullback(cotangents), strict=True))
            # None: a zero cotangent (JAX makes the float0 zeros of integer inputs itself).
            return tuple(by_input.get(i) for i in arrays)

        function = jax.custom_vjp(primal)
        function.defvjp(fwd, bwd)
        results = function(*(flat[i] for i in arrays))
        return _rebuild(made["output"], results)

    def _refuse_torch(self, flat: tuple[Any, ...], layout: Any) -> None:
        """Name the parameter holding a torch tensor (only called when one does)."""
        for slot, (start, stop, _) in enumerate(slot_ranges(layout, len(self.sig.names))):
            if any(isinstance(v, torch.Tensor) for v in flat[start:stop]):
                name = self.sig.names[slot]
                msg = (
                    f"`{self.op}` got a torch tensor for `{name}` in a call with JAX arrays; "
                    f"one call works in one framework: convert `{name}` with "
                    f"`jnp.asarray({name}.numpy())` (or the JAX arrays to torch)."
                )
                raise GradOverrideTypeError(msg)

    def _forward(self, inputs: list[Any], layout: Any) -> tuple[Any, dict[str, Any]]:
        values = tuple(inputs) if layout is None else unflatten_inputs(tuple(inputs), layout)
        output = self.sig.call(values)
        residuals: dict[str, Any] = {}
        if self.residuals:
            output, residuals = unpack_residuals(output, self.residuals, self.op)
            # Left differentiable: under an outer transform JAX differentiates the
            # custom_vjp's forward too, so a second derivative follows how a residual
            # depends on the inputs (where torch, which cannot, refuses).
        n_top = len(output) if type(output) is tuple else 1
        check_output_count(self.spec.n_grads, n_top, self.spec.name, self.op)
        return output, residuals

    def _split(self, output: Any, made: dict[str, Any]) -> list[Any]:
        """The output's arrays (what the custom_vjp returns); the rest is kept in `made`."""
        leaves, spec = pytree.tree_flatten(output)
        arrays = tuple(j for j, leaf in enumerate(leaves) if isinstance(leaf, jax.Array))
        if not arrays:
            msg = (
                f"the forward of `{self.op}` returned {type(output).__name__}, which holds no "
                "JAX array, so there is nothing for a gradient to flow through; return an "
                "array (`jnp.asarray(...)`), a tuple of arrays, or a container (tuple, list, "
                "dict) of arrays."
            )
            raise GradOverrideError(msg)
        picked = tuple(j for j in arrays if _differentiable(leaves[j]))
        # Arrays only as placeholders: the tracers of this trace must not outlive it.
        kept = [None if j in arrays else leaf for j, leaf in enumerate(leaves)]
        made["output"] = _Output(kept, spec, arrays, picked, type(output) is tuple)
        return [leaves[j] for j in arrays]

    def _saved(
        self, inputs: list[Any], layout: Any, slots: tuple[int, ...], output: Any,
        residuals: dict[str, Any],
    ) -> dict[str, Any]:
        """The values the rule names, by name: only these are kept for backward."""
        spec = self.spec
        ranges = slot_ranges(layout, len(self.sig.names))
        saved: dict[str, Any] = {}
        for name, slot in spec.requested_slots:
            start, stop, treespec = ranges[slot]
            part = inputs[start:stop]
            saved[name] = part[0] if treespec is None else pytree.tree_unflatten(part, treespec)
        for name, _ in spec.requested_residuals:
            saved[name] = residuals[name]
        if spec.wants_output:
            saved["output"] = output
        if spec.wants_needs_grad:
            saved["needs_grad"] = {
                name: any(start <= i < stop for i in slots)
                for name, (start, stop, _) in zip(self.sig.names, ranges, strict=True)
            }
        return saved

    def _gradients(
        self, cotangents: list[Any], out: _Output, saved: dict[str, Any], meta: list[Any],
        layout: Any, slots: tuple[int, ...],
    ) -> list[Any]:
        """Call the rule with the upstream gradients; its checked gradients for `slots`."""
        grad_leaves: list[Any] = [None] * len(out.leaves)
        for j, cotangent in zip(out.arrays, cotangents, strict=True):
            if j in out.picked:  # (an integer output's cotangent is JAX's float0: none)
                grad_leaves[j] = cotangent
        tree = pytree.tree_unflatten(grad_leaves, out.spec)
        upstream = tuple(tree) if out.tuple_output else (tree,)
        try:
            result = self.rule(*upstream, **saved)
        except GradOverrideError:
            raise
        except Exception as exc:
            exc.add_note(self.note)
            raise
        flat_grads = flat_gradients(
            result,
            op=self.op,
            names=self.sig.names,
            owned=self.spec.owned,
            layout=layout,
            meta=meta,
            check=check_gradient,
            tensor=jax.Array,
        )
        grads = [flat_grads[i] for i in slots]
        if self.spec.once_differentiable:
            grads = [g if g is None else _once_differentiable(self.op, g) for g in grads]
        return grads


def _per_leaf(owned: tuple[bool, ...], layout: Any) -> tuple[bool, ...]:
    if layout is None:
        return owned
    return tuple(
        o for o, entry in zip(owned, layout, strict=True)
        for _ in range(1 if entry is None else entry[1])
    )


def _rebuild(out: _Output, results: list[Any]) -> Any:
    leaves = list(out.leaves)
    for j, result in zip(out.arrays, results, strict=True):
        leaves[j] = result
    return pytree.tree_unflatten(leaves, out.spec)


# ---- checking one gradient -------------------------------------------------------------------


def check_gradient(grad: Any, meta: Any, op: str, name: str) -> Any:
    """Check one returned gradient against its input (a JAX array); fix what the torch side
    fixes (broadcast shape, another float precision) and refuse the rest."""
    if meta is None:
        raise GradOverrideError(no_gradient_slot_message(op, name))
    if isinstance(grad, torch.Tensor):
        msg = (
            f"backward of `{op}` returned a torch tensor for `{name}`, a JAX array in this "
            "call; write the rule in JAX ops (`jnp`) for JAX inputs."
        )
        raise GradOverrideError(msg)
    if isinstance(grad, np.ndarray):
        grad = jnp.asarray(grad)  # a numpy gradient (of constants) is a JAX array's value
    if not isinstance(grad, jax.Array):
        raise GradOverrideError(not_a_tensor_message(grad, op, name))
    if meta is SKIP:
        return None
    x: _Meta = meta
    if grad.dtype != x.dtype:
        inexact = jnp.issubdtype(grad.dtype, jnp.inexact)
        to_complex = jnp.issubdtype(x.dtype, jnp.complexfloating)
        real_for_complex = jnp.issubdtype(grad.dtype, jnp.floating) and to_complex
        same_kind = inexact and (
            jnp.issubdtype(grad.dtype, jnp.complexfloating) == to_complex or real_for_complex
        )
        if not same_kind:
            msg = dtype_message(
                str(grad.dtype), str(x.dtype), bool(to_complex), op, name,
                f"`grad.astype({name}.dtype)`",
            )
            raise GradOverrideError(msg)
        grad = grad.astype(x.dtype)
    if tuple(grad.shape) == x.shape:
        return grad
    return _fit_shape(grad, x.shape, op, name)


def _fit_shape(grad: Any, shape: tuple[int, ...], op: str, name: str) -> Any:
    """`grad` summed down to `shape`, which it must broadcast from (as torch does)."""
    extra = grad.ndim - len(shape)
    tail = tuple(grad.shape[extra:]) if extra >= 0 else ()
    if extra < 0 or not all(s == 1 or s == g for s, g in zip(shape, tail, strict=True)):
        raise GradOverrideError(shape_message(tuple(grad.shape), shape, op, name))
    axes = tuple(range(extra)) + tuple(
        extra + k for k, (s, g) in enumerate(zip(shape, tail, strict=True)) if s == 1 and g != 1
    )
    return jnp.sum(grad, axis=axes).reshape(shape)


# ---- once_differentiable --------------------------------------------------------------------


def _once_differentiable(op: str, grad: Any) -> Any:
    """`grad`, unchanged; differentiating it again raises instead of giving a wrong value."""

    @jax.custom_vjp
    def guard(value: Any) -> Any:
        return value

    def forward(value: Any) -> Any:
        return value, None

    def second(_: Any, __: Any) -> Any:
        msg = (
            f"backward of `{op}` is marked once_differentiable=True and cannot be "
            "differentiated again; for higher-order gradients, write the rule in "
            "differentiable JAX ops without once_differentiable."
        )
        raise GradOverrideError(msg)

    guard.defvjp(forward, second)
    return guard(grad)
