"""Turning what a rule returned into one checked gradient per flat input.

Return forms (see the README, "What a rule may return"):

* a dict by parameter name; every owned parameter that holds a tensor must appear (`None`
  for no gradient), and no other name may;
* a tuple with one entry per forward parameter, in order (`None` for no gradient);
* a tensor (or `None`) when exactly one owned parameter holds tensors in this call.

A container parameter (tuple, list, dict of tensors) gets a gradient of the same structure.
Each gradient is checked against its input: a shape the input broadcasts to is summed down
to the input's shape (as PyTorch does); a floating-point gradient of another precision is
cast to the input's dtype (as PyTorch does; autocast produces these); a gradient of another
kind (integer, bool, complex for a real input), another device or another shape is an error.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from ._errors import GradOverrideError

__all__ = [
    "SKIP",
    "Meta",
    "ModuleForm",
    "check_gradient",
    "dtype_message",
    "flat_gradients",
    "format_shape",
    "no_gradient_slot_message",
    "not_a_tensor_message",
    "shape_message",
    "slot_ranges",
    "takes_gradient",
]

#: Meta entry of a tensor input whose gradient is not needed: whatever the rule returns for
#: it is dropped unchecked.
SKIP = False

#: Per flat input: None (takes no gradient: not a tensor, or an integer or bool tensor), SKIP,
#: or (shape, dtype, device) of an input whose gradient is needed.
Meta = Sequence["bool | tuple[torch.Size, torch.dtype, torch.device] | None"]


class ModuleForm(NamedTuple):
    """How the rule of a module's op returns gradients (`go.Module`, `override_backward`):
    the op's slot 0 holds the module, `inputs` are the forward's slots and `params` the
    parameters' (by `named_parameters()` name). A tuple holds one gradient per input; a lone
    tensor is for the one owned input or parameter that needs a gradient; a dict names inputs
    and parameters. Messages call it `where` ("`Layer`")."""

    where: str
    inputs: tuple[int, ...]
    params: tuple[int, ...]


def takes_gradient(value: object) -> bool:
    """Whether `value` can have a gradient: a floating-point or complex torch tensor. Integer
    and bool tensors (indices, masks) never can, so a rule never owns them."""
    return isinstance(value, Tensor) and (value.is_floating_point() or value.is_complex())


def format_shape(shape: Sequence[int | None]) -> str:
    """`(4, 3)`; an unknown dimension (TensorFlow's graph mode) reads `None`."""
    return str(tuple(None if s is None else int(s) for s in shape))


def slot_ranges(layout: Any, n_slots: int) -> list[tuple[int, int, Any]]:
    """Per parameter: (start, stop, treespec or None), its range among the flat inputs."""
    if layout is None:
        return [(i, i + 1, None) for i in range(n_slots)]
    ranges = []
    start = 0
    for entry in layout:
        if entry is None:
            ranges.append((start, start + 1, None))
            start += 1
        else:
            spec, n = entry
            ranges.append((start, start + n, spec))
            start += n
    return ranges


def flat_gradients(
    result: Any,
    *,
    op: str,
    names: tuple[str, ...],
    owned: tuple[bool, ...],
    layout: Any,
    meta: Meta,
    check: Callable[[Any, Any, str, str], Any] | None = None,
    tensor: Any = Tensor,
    module: ModuleForm | None = None,
) -> list[Any]:
    """One checked gradient per flat input, from whatever the rule returned.

    `check` and `tensor` are for another framework's backend (TensorFlow): its per-gradient
    check and its tensor type; the return forms and their errors are the same. `module`:
    the op is a module's (see `ModuleForm`).
    """
    n_slots = len(names)
    grads: list[Any] = [None] * len(meta)
    if check is None:
        check = check_gradient
    if module is not None:
        result = _module_result(result, module, names, owned, layout, meta)

    # Fast path: every parameter is a plain value and the rule returned one tensor.
    if layout is None and (result is None or isinstance(result, tensor)):
        slot = _single_owned_slot(op, names, owned, layout, meta, result)
        if slot is not None and result is not None:
            grads[slot] = check(result, meta[slot], op, names[slot])
        return grads

    ranges = slot_ranges(layout, n_slots)
    per_slot = _per_slot(result, op=op, names=names, owned=owned, layout=layout, meta=meta,
                         ranges=ranges, tensor=tensor)
    for slot, grad in enumerate(per_slot):
        if grad is None:
            continue
        start, _, spec = ranges[slot]
        if not owned[slot]:
            msg = (
                f"backward of `{op}` returned a gradient for `{names[slot]}`, which the rule "
                f"does not own (it owns {_owned_listing(names, owned)}); return None for "
                f"`{names[slot]}`, or add it to `owns` to give it this gradient instead of "
                "its autograd gradient."
            )
            raise GradOverrideError(msg)
        if spec is None:
            grads[start] = check(grad, meta[start], op, names[slot])
            continue
        try:
            leaves = spec.flatten_up_to(grad)
        except (ValueError, TypeError, RuntimeError):
            msg = (
                f"backward of `{op}` returned a gradient for `{names[slot]}` whose structure "
                f"does not match the input's: the input is {_structure(spec)} and the gradient "
                f"is a {type(grad).__name__}; return the same structure, with None where there "
                "is no gradient."
            )
            raise GradOverrideError(msg) from None
        for offset, leaf in enumerate(leaves):
            if leaf is None:
                continue
            m = meta[start + offset]
            if (
                isinstance(leaf, Tensor)
                and isinstance(m, tuple)
                and leaf.shape == m[0]
                and leaf.dtype == m[1]
                and leaf.device == m[2]
            ):
                grads[start + offset] = leaf
                continue
            # Only a gradient that needs fixing or reporting pays for naming its leaf.
            path = f"{names[slot]}{_leaf_path(spec, offset)}"
            grads[start + offset] = check(leaf, m, op, path)
    return grads


def _module_result(
    result: Any, form: ModuleForm, names: tuple[str, ...], owned: tuple[bool, ...],
    layout: Any, meta: Meta,
) -> dict[str, Any]:
    """A module rule's return value as a dict by slot name, checked for the mistakes the
    module forms allow (see `ModuleForm`)."""
    where = form.where
    inputs = tuple(names[i] for i in form.inputs)
    ranges = slot_ranges(layout, len(names))

    def holds(slot: int) -> bool:
        start, stop, _ = ranges[slot]
        return any(m is not None for m in meta[start:stop])

    def needs(slot: int) -> bool:
        start, stop, _ = ranges[slot]
        return any(type(m) is tuple for m in meta[start:stop])

    owned_params = [i for i in form.params if owned[i]]
    if isinstance(result, dict):
        by_name = result
    elif type(result) is tuple:
        if len(result) != len(inputs):
            msg = (
                f"the backward of {where} returned {len(result)} gradients, but the forward "
                f"takes {len(inputs)} inputs ({', '.join(inputs)}); return a tuple with one "
                "entry per input, or a dict by input and parameter name."
            )
            raise GradOverrideError(msg)
        by_name = dict(zip(inputs, result, strict=True))
    else:
        # A lone tensor: for the one owned input or parameter that needs a gradient.
        owned_inputs = [i for i in form.inputs if owned[i] and holds(i)]
        if len(owned_inputs) > 1:
            owned_inputs = [i for i in owned_inputs if needs(i)]
        wanted = [names[i] for i in (*owned_inputs, *(i for i in owned_params if needs(i)))]
        if result is not None and len(wanted) > 1:
            msg = (
                f"the backward of {where} returned a single {type(result).__name__}, but "
                f"{len(wanted)} owned inputs and parameters need a gradient "
                f"({', '.join(f'`{n}`' for n in wanted)}); return a dict by name, e.g. "
                f"{{{', '.join(repr(n) + ': ...' for n in wanted)}}}."
            )
            raise GradOverrideError(msg)
        by_name = {wanted[0]: result} if wanted and result is not None else {}
        by_name.update(
            {names[i]: None for i in form.inputs if owned[i] and names[i] not in by_name}
        )
    params = {names[i]: i for i in form.params}
    valid = [*inputs, *(names[i] for i in owned_params)]
    for key in by_name:
        if key in inputs or (key in params and owned[params[key]]):
            continue
        reason = (
            "a parameter the rule does not own (it keeps its ordinary gradient); return None "
            "for it or add it to `owns`"
            if key in params
            else "neither an input nor a parameter"
        )
        msg = (
            f"the backward of {where} returned a gradient for `{key}`, which is {reason}; the "
            f"names it can return are {', '.join(f'`{n}`' for n in valid)}."
        )
        raise GradOverrideError(msg)
    for i in owned_params:
        if names[i] not in by_name and needs(i):
            raise GradOverrideError(_missing_parameter_message(where, names[i], result, inputs))
    return {names[i]: None for i in owned_params if names[i] not in by_name} | dict(by_name)


def _missing_parameter_message(
    where: str, name: str, result: Any, inputs: tuple[str, ...]
) -> str:
    """An owned parameter with no gradient in what the rule returned, said for its form."""
    fix = (
        f"return {{'{name}': None, ...}} if it gets no gradient, or leave `{name}` out of "
        f"`owns` so it keeps its ordinary autograd gradient."
    )
    if isinstance(result, dict):
        return f"the backward of {where} returned a dict without `{name}`, which it owns; {fix}"
    if type(result) is tuple:
        form = (
            f"a tuple, which holds one gradient per input of the forward "
            f"({', '.join(f'`{n}`' for n in inputs)}) and none for parameters"
        )
    elif result is None:
        form = "None"
    else:
        form = f"a single {type(result).__name__} (the gradient of its input)"
    example = ", ".join(f"'{n}': grad_{n.replace('.', '_')}" for n in (*inputs, name))
    return (
        f"the backward of {where} returned {form}, but it owns the parameter `{name}`, "
        f"which needs a gradient; a module rule returns parameter gradients in a dict by "
        f"name, e.g. {{{example}}}; or {fix}"
    )


def _owned_listing(names: tuple[str, ...], owned: tuple[bool, ...]) -> str:
    listed = [f"`{n}`" for n, o in zip(names, owned, strict=True) if o]
    return ", ".join(listed) if listed else "nothing"


def _single_owned_slot(
    op: str, names: tuple[str, ...], owned: tuple[bool, ...], layout: Any, meta: Meta,
    result: Any,
) -> int | None:
    """The one owned parameter holding tensors, for a rule that returned a single value."""
    candidates = _owned_tensor_slots(owned, meta, slot_ranges(layout, len(names)))
    if len(candidates) == 1:
        return candidates[0]
    if result is None:
        return None
    if not candidates:
        msg = (
            f"backward of `{op}` returned a {type(result).__name__}, but no parameter it owns "
            f"holds a tensor in this call (it owns {_owned_listing(names, owned)}); "
            "return None."
        )
        raise GradOverrideError(msg)
    held = ", ".join(f"`{names[s]}`" for s in candidates)
    msg = (
        f"backward of `{op}` returned a single {type(result).__name__}, but it owns "
        f"{len(candidates)} tensor inputs ({held}); return a tuple with one gradient per "
        f"parameter of `{op}` ({', '.join(names)}), or a dict by name such as "
        f"{{{', '.join(repr(names[s]) + ': ...' for s in candidates)}}}."
    )
    raise GradOverrideError(msg)


def _per_slot(
    result: Any, *, op: str, names: tuple[str, ...], owned: tuple[bool, ...], layout: Any,
    meta: Meta, ranges: list[tuple[int, int, Any]], tensor: Any,
) -> list[Any]:
    n_slots = len(names)
    if isinstance(result, dict):
        # By parameter name, unless the one owned input is itself a dict of that shape.
        single = _maybe_single(owned, meta, ranges)
        if (
            not set(result) <= set(names)
            and single is not None
            and ranges[single][2] is not None
            and _matches(result, ranges[single][2], tensor)
        ):
            by_slot: list[Any] = [None] * n_slots
            by_slot[single] = result
            return by_slot
        return _from_dict(result, op=op, names=names, owned=owned, meta=meta, ranges=ranges)
    if type(result) is tuple:
        single = _maybe_single(owned, meta, ranges)
        # One entry per parameter, unless it is the one owned container input's own
        # gradient (a tuple of its structure), where the entry for it is not.
        whole = single is not None and ranges[single][2] is not None and _matches(
            result, ranges[single][2], tensor
        )
        if len(result) == n_slots and not (
            whole and not _matches(result[single], ranges[single][2], tensor)  # type: ignore[index]
        ):
            return list(result)
        if whole:
            out: list[Any] = [None] * n_slots
            out[single] = result  # type: ignore[index]
            return out
        msg = (
            f"backward of `{op}` returned {len(result)} gradients, but `{op}` has {n_slots} "
            f"parameters ({', '.join(names)}); return a tuple with one entry per parameter "
            "(None for no gradient), or a dict by parameter name."
        )
        raise GradOverrideError(msg)
    single_slot = _single_owned_slot(op, names, owned, layout, meta, result)
    out = [None] * n_slots
    if single_slot is not None:
        out[single_slot] = result
    return out


def _owned_tensor_slots(
    owned: tuple[bool, ...], meta: Meta, ranges: list[tuple[int, int, Any]]
) -> list[int]:
    """The owned parameters that hold at least one tensor in this call."""
    return [
        slot
        for slot, (start, stop, _) in enumerate(ranges)
        if owned[slot] and any(m is not None for m in meta[start:stop])
    ]


def _maybe_single(
    owned: tuple[bool, ...], meta: Meta, ranges: list[tuple[int, int, Any]]
) -> int | None:
    candidates = _owned_tensor_slots(owned, meta, ranges)
    return candidates[0] if len(candidates) == 1 else None


def _matches(value: Any, spec: Any, tensor: Any) -> bool:
    """Whether `value` has the container structure `spec` (leaves: tensors or None)."""
    if spec is None:
        return value is None or isinstance(value, tensor)
    try:
        leaves = spec.flatten_up_to(value)
    except (ValueError, TypeError, RuntimeError):
        return False
    return all(leaf is None or isinstance(leaf, tensor) for leaf in leaves)


def _from_dict(
    result: dict[str, Any], *, op: str, names: tuple[str, ...], owned: tuple[bool, ...],
    meta: Meta, ranges: list[tuple[int, int, Any]],
) -> list[Any]:
    for key in result:
        if key not in names:
            valid = ", ".join(f"`{n}`" for n, o in zip(names, owned, strict=True) if o)
            msg = (
                f"backward of `{op}` returned a gradient for `{key}`, which is not a "
                f"parameter of `{op}`; the names it can return are {valid}."
            )
            raise GradOverrideError(msg)
    out: list[Any] = []
    for slot, name in enumerate(names):
        start, stop, _ = ranges[slot]
        if name not in result and owned[slot] and any(m is not None for m in meta[start:stop]):
            msg = (
                f"backward of `{op}` returned a dict without `{name}`, which it owns; "
                f"return {{'{name}': None, ...}} if it gets no gradient, or leave `{name}` "
                f"out of `owns` so it keeps its ordinary autograd gradient."
            )
            raise GradOverrideError(msg)
        out.append(result.get(name))
    return out


def _structure(spec: Any) -> str:
    kind = getattr(spec, "type", None)
    kind_name = kind.__name__ if isinstance(kind, type) else "container"
    return f"a {kind_name} of {spec.num_leaves} leaves"


def _leaf_path(spec: Any, offset: int) -> str:
    try:
        paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten([0] * spec.num_leaves, spec))
        return pytree.keystr(paths[offset][0])
    except Exception:  # pragma: no cover - path is only for the message
        return f"[leaf {offset}]"


def check_gradient(grad: Any, meta: Any, op: str, name: str) -> Tensor | None:
    """Check one gradient against its input's metadata; fix what PyTorch itself would fix."""
    if meta is None:
        raise GradOverrideError(no_gradient_slot_message(op, name))
    if not isinstance(grad, Tensor):
        raise GradOverrideError(not_a_tensor_message(grad, op, name))
    if meta is SKIP:
        return None
    shape, dtype, device = meta
    if grad.shape != shape:
        grad = _fit_shape(grad, shape, op, name)
    if grad.dtype != dtype:
        grad = _fit_dtype(grad, dtype, op, name)
    if grad.device != device:
        msg = (
            f"backward of `{op}` returned a gradient on {grad.device} for `{name}`, which is "
            f"on {device}; create the gradient on the input's device "
            f"(e.g. with `.to({name}.device)`)."
        )
        raise GradOverrideError(msg)
    checked: Tensor = grad
    return checked


def _fit_shape(grad: Tensor, shape: torch.Size, op: str, name: str) -> Tensor:
    extra = grad.dim() - len(shape)
    fits = extra >= 0 and all(
        s == 1 or s == g for s, g in zip(shape, grad.shape[extra:], strict=True)
    )
    if not fits:
        raise GradOverrideError(shape_message(grad.shape, shape, op, name))
    summed: Tensor = grad.sum_to_size(shape)
    return summed


def _fit_dtype(grad: Tensor, dtype: torch.dtype, op: str, name: str) -> Tensor:
    if grad.dtype.is_floating_point and dtype.is_floating_point:
        return grad.to(dtype)
    if grad.dtype.is_complex and dtype.is_complex:
        return grad.to(dtype)
    if grad.dtype.is_floating_point and dtype.is_complex:
        # A real gradient for a complex input (of a real function of it, such as
        # `2 * z.real`): its imaginary part is zero, as PyTorch takes it.
        return grad.to(dtype)
    msg = dtype_message(
        str(grad.dtype), str(dtype), dtype.is_complex, op, name, f"`.to({name}.dtype)`"
    )
    raise GradOverrideError(msg)


# The messages every backend raises with, so a mistake reads the same in torch and TensorFlow.


def no_gradient_slot_message(op: str, name: str) -> str:
    return (
        f"backward of `{op}` returned a gradient for `{name}`, which takes no gradient in "
        "this call (it is not a floating-point or complex tensor: a Python value, or an "
        "integer or bool tensor such as an index); return None for it."
    )


def not_a_tensor_message(grad: object, op: str, name: str) -> str:
    return (
        f"backward of `{op}` returned a {type(grad).__name__} for `{name}`; "
        "expected a tensor (or None for no gradient)."
    )


def shape_message(
    got: Sequence[int | None], expected: Sequence[int | None], op: str, name: str
) -> str:
    return (
        f"backward of `{op}` returned a gradient of shape {format_shape(got)} for "
        f"`{name}`, which has shape {format_shape(expected)}; return a gradient of the "
        "input's shape (or one the input broadcasts to, which is summed down to it)."
    )


def dtype_message(
    got: str, expected: str, complex_input: bool, op: str, name: str, convert: str
) -> str:
    kind = "complex" if complex_input else "floating-point"
    return (
        f"backward of `{op}` returned a gradient of dtype {got} for `{name}`, which has "
        f"dtype {expected}; a gradient must be a {kind} "
        f"tensor: multiply the upstream gradient by a mask (`grad * mask`) rather than "
        f"returning the mask, or convert with {convert}."
    )
