"""`check_backward` on JAX arrays: the same checks, report and messages, computed by JAX.

`check_backward` comes here when one of its inputs is a JAX array, so this module (and JAX)
is imported only then. What is the same as on torch tensors: every floating-point array
among the inputs (also inside tuples, lists, dicts and any registered JAX pytree, visited by
`jax.tree_util`) gets a gradient, named by `fn`'s signature and the path (`xs[0]`,
`d['k']`, `params.w`); a floating-point numpy array given with JAX arrays gets one too;
the upstream gradient (`"random"`, seeded as on torch, so the same shapes get the same
numbers, or `"ones"`, or arrays); the references (a proxy, `"finite_differences"`,
given arrays); the tolerances by the input's dtype; the `BackwardReport` and the
`GradOverrideError` texts. How it is computed:

* the gradients are `jax.vjp` of `fn` (eagerly), with one upstream gradient per
  floating-point output; a proxy's are `jax.vjp` of the proxy with the same upstream
  gradients;
* finite differences run `fn`'s forward on float64 copies of the inputs inside
  `jax.enable_x64(True)`, a context manager: JAX's global setting, and so the user's own
  arrays, stay as they were. First the float64 run at the unperturbed inputs must give the
  checked run's outputs to that dtype's precision (a `jax.random` draw differs in float64),
  and an error there is named as the float64 run's;
* each gradient must also have its input's shape and dtype: `jax.vjp` of an op made by
  gradoverride already guarantees it (the op checks what its rule returns), this row check
  covers any other function.

What has no meaning on JAX is refused with a `GradOverrideError` naming it: a torch module
as `fn` (its parameters are torch tensors), torch tensors among the inputs, or as
`grad_outputs` or `reference`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .._errors import GradOverrideError
from ._compare import Difference, compare, difference_problems, format_index, tolerances
from ._inputs import function_name, input_names, module_of
from ._reference import FINITE_DIFFERENCES
from ._report import BackwardReport, GradientRow, mismatch_message

__all__ = ["JaxGradOutputs", "JaxReference", "check_backward_jax"]

#: An array given to `check_backward` with JAX inputs (an upstream or expected gradient).
JaxArray: TypeAlias = jax.Array | np.ndarray
#: What `check_backward(grad_outputs=...)` accepts with JAX inputs.
JaxGradOutputs: TypeAlias = Literal["random", "ones"] | JaxArray | Sequence[JaxArray]
#: What `check_backward(reference=...)` accepts with JAX inputs.
JaxReference: TypeAlias = (
    Callable[..., Any]
    | Literal["finite_differences"]
    | JaxArray
    | Sequence[JaxArray | None]
    | Mapping[str, JaxArray | None]
)

# gradcheck's tolerances, as on torch: central differences are only so accurate.
_FINITE_DIFFERENCE_TOLERANCES = (1e-3, 1e-5)


def _is_floating(value: object, *, numpy: bool = False) -> bool:
    """Whether `value` is a floating-point JAX array (or, with `numpy`, numpy array)."""
    if isinstance(value, jax.Array) or (numpy and isinstance(value, np.ndarray)):
        return bool(jnp.issubdtype(value.dtype, jnp.floating))
    return False


def _key_name(key: Any, parent: Any) -> tuple[str, Any]:
    """How a name shows one step of a pytree path (`[0]`, `['k']`, `.w`), and the value
    the step leads to when it can be followed (None when not)."""
    if isinstance(key, jax.tree_util.SequenceKey):
        name, index = f"[{key.idx}]", key.idx
    elif isinstance(key, jax.tree_util.DictKey):
        name, index = f"[{key.key!r}]", key.key
    elif isinstance(key, jax.tree_util.GetAttrKey):
        fields = getattr(parent, "_fields", None) if isinstance(parent, tuple) else None
        # A named tuple's items keep the names by position they have on torch (`p[0]`).
        name = f"[{fields.index(key.name)}]" if fields and key.name in fields else f".{key.name}"
        return name, getattr(parent, key.name, None)
    else:  # a class flattened without keys: its leaves by position
        return str(key), None
    try:
        return name, parent[index]
    except Exception:  # a registered class that names its children but cannot be indexed
        return name, None


def _path_name(root: str, value: Any, path: Sequence[Any]) -> str:
    name, here = root, value
    for key in path:
        step, here = _key_name(key, here)
        name += step
    return name


def _map_floating(
    value: Any, path: str, fn: Callable[[str, jax.Array], Any], *, numpy: bool = False
) -> Any:
    """`value` with each floating-point JAX array `a` at `path` replaced by `fn(path, a)`;
    every JAX pytree is visited (tuples, named tuples, lists, dicts, registered classes), in
    `jax.tree_util`'s order (a dict's keys sorted). With `numpy`, floating-point numpy
    arrays count as JAX arrays."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(value)
    replaced = [
        fn(_path_name(path, value, keys), leaf) if _is_floating(leaf, numpy=numpy) else leaf
        for keys, leaf in leaves
    ]
    if all(new is old for new, (_, old) in zip(replaced, leaves, strict=True)):
        return value  # (as given, not rebuilt: an unregistered subclass keeps its type)
    return jax.tree_util.tree_unflatten(treedef, replaced)


def _floating(value: Any, name: str, *, numpy: bool = False) -> list[tuple[str, jax.Array]]:
    found: list[tuple[str, jax.Array]] = []

    def record(path: str, array: jax.Array) -> jax.Array:
        found.append((path, array))
        return array

    _map_floating(value, name, record, numpy=numpy)
    return found


def _torch_tensors(value: Any, path: str) -> Iterator[str]:
    """The places of torch tensors in `value` (any JAX pytree)."""
    for keys, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        if isinstance(leaf, torch.Tensor):
            yield _path_name(path, value, keys)


def _torch_refused(fn_name: str, where: str, what: str) -> GradOverrideError:
    return GradOverrideError(
        f"check_backward(`{fn_name}`): {where} is a torch tensor, but the inputs are JAX "
        f"arrays, so the check runs on JAX; {what}"
    )


class _Call:
    """A call's inputs with each floating-point JAX array in them named; `__call__` runs
    the function with those arrays replaced."""

    def __init__(self, fn: Callable[..., Any], inputs: Sequence[Any]) -> None:
        self.fn = fn
        self.fn_name = function_name(fn)
        if module_of(fn) is not None:
            msg = (
                f"check_backward(`{self.fn_name}`): `fn` is a torch module, but the inputs are "
                "JAX arrays; a module's parameters are torch tensors, which JAX cannot "
                "differentiate. Check a module with torch tensors, or pass a function of "
                "JAX arrays (its parameters as inputs)."
            )
            raise GradOverrideError(msg)
        self.inputs = tuple(inputs)
        names = input_names(fn, len(self.inputs))
        found: list[tuple[str, jax.Array]] = []
        for name, value in zip(names, self.inputs, strict=True):
            for place in _torch_tensors(value, name):
                raise _torch_refused(
                    self.fn_name, f"the input `{place}`",
                    "pass every input as a JAX array (`jnp.asarray(t.numpy())`), or every "
                    "one as a torch tensor.",
                )
            found.extend(_floating(value, name, numpy=True))
        # A floating-point numpy array given with JAX arrays is differentiated as one: it
        # is the same values, and leaving it out would pass a rule that gets it wrong.
        self.numpy_names: tuple[str, ...] = tuple(
            name for name, a in found if isinstance(a, np.ndarray)
        )
        if not found:  # (a JAX array among the inputs brought the call here: an integer one)
            msg = (
                f"`{self.fn_name}` was given no floating-point array to differentiate "
                f"(inputs: {', '.join(type(v).__name__ for v in self.inputs)}); pass the "
                "arrays whose gradients the rule computes as positional inputs."
            )
            raise GradOverrideError(msg)
        self.names: tuple[str, ...] = tuple(name for name, _ in found)
        self.arrays: tuple[jax.Array, ...] = tuple(jnp.asarray(a) for _, a in found)

    def rebuild(self, arrays: Sequence[Any]) -> tuple[Any, ...]:
        replacements = iter(arrays)
        return tuple(
            _map_floating(value, "", lambda _path, _old: next(replacements), numpy=True)
            for value in self.inputs
        )

    def __call__(self, arrays: Sequence[Any]) -> Any:
        return self.fn(*self.rebuild(arrays))


@dataclass(frozen=True)
class _Outputs:
    """The floating-point arrays a call returned, named (`output`, `output[0]`, ...)."""

    names: tuple[str, ...]
    arrays: tuple[jax.Array, ...]


def _check_result(fn_name: str, result: Any) -> None:
    """A `GradOverrideError` when what a call returned holds a torch tensor, or no
    floating-point array."""
    for place in _torch_tensors(result, "output"):
        msg = (
            f"`{fn_name}` returned a torch tensor at `{place}` for JAX inputs; a function "
            "checked on JAX arrays (and a proxy) must compute with JAX (`jnp`) ops."
        )
        raise GradOverrideError(msg)
    if not _floating(result, "output"):
        # (Traced during jax.vjp: a tracer's class name would mean nothing to the user.)
        what = (f"an array of dtype {result.dtype}" if isinstance(result, jax.Array)
                else type(result).__name__)
        msg = (
            f"`{fn_name}` returned {what}, which holds no floating-point "
            "array to take a gradient of; the function checked must return an array, or "
            "a tuple, list or dict of arrays."
        )
        raise GradOverrideError(msg)


def _vjp(
    fn_name: str, run: Callable[[Sequence[Any]], Any], leaves: Sequence[jax.Array]
) -> tuple[_Outputs, Callable[[tuple[jax.Array, ...]], tuple[jax.Array, ...]]]:
    """`jax.vjp` of `run` over `leaves`, seen through its floating-point outputs."""
    seen: list[tuple[Any, tuple[str, ...]]] = []

    def flat(*arrays: jax.Array) -> tuple[jax.Array, ...]:
        result = run(arrays)
        found = _floating(result, "output")
        seen.append((result, tuple(name for name, _ in found)))
        return tuple(a for _, a in found)

    values, pullback = jax.vjp(flat, *leaves)
    result, names = seen[-1]
    # Checked here, outside JAX's trace, whose traceback note would end the message.
    _check_result(fn_name, result)
    return _Outputs(names, tuple(values)), pullback


def _upstream(
    outputs: _Outputs, grad_outputs: Any, seed: int, fn_name: str
) -> tuple[jax.Array, ...]:
    """One upstream gradient per output, in the output's shape and dtype."""
    if isinstance(grad_outputs, str):
        if grad_outputs == "ones":
            return tuple(jnp.ones_like(a) for a in outputs.arrays)
        if grad_outputs == "random":
            # torch's generator, as on torch tensors: the same seed and shapes give the
            # same upstream gradient in both frameworks.
            gen = torch.Generator().manual_seed(seed)
            return tuple(
                jnp.asarray(
                    torch.randn(tuple(a.shape), generator=gen, dtype=torch.float64).numpy(),
                    dtype=a.dtype,
                )
                for a in outputs.arrays
            )
        msg = (
            f"`grad_outputs` for `{fn_name}` must be 'random', 'ones', an array or one array "
            f"per output, got the string {grad_outputs!r}."
        )
        raise GradOverrideError(msg)
    if isinstance(grad_outputs, jax.Array | np.ndarray | torch.Tensor):
        given: tuple[Any, ...] = (grad_outputs,)
    elif isinstance(grad_outputs, Sequence):
        given = tuple(grad_outputs)
    else:
        msg = (
            f"`grad_outputs` for `{fn_name}` must be 'random', 'ones', an array (one output) "
            f"or a sequence of one array per output, got {type(grad_outputs).__name__} "
            f"{grad_outputs!r}; for an upstream gradient of ones pass 'ones', for another "
            "value an array in the output's shape (`jnp.full_like(output, value)`)."
        )
        raise GradOverrideError(msg)
    for i, grad in enumerate(given):
        if isinstance(grad, torch.Tensor):
            where = "`grad_outputs`" if len(given) == 1 else f"`grad_outputs[{i}]`"
            raise _torch_refused(
                fn_name, where, "pass the upstream gradients as JAX or numpy arrays."
            )
    if len(given) != len(outputs.arrays):
        msg = (
            f"`grad_outputs` for `{fn_name}` has {len(given)} array(s), but `{fn_name}` "
            f"returned {len(outputs.arrays)} floating-point output(s) "
            f"({', '.join(outputs.names)}); pass one upstream gradient per output."
        )
        raise GradOverrideError(msg)
    result: list[jax.Array] = []
    for name, out, grad in zip(outputs.names, outputs.arrays, given, strict=True):
        if tuple(np.shape(grad)) != tuple(out.shape):
            msg = (
                f"`grad_outputs` for `{name}` of `{fn_name}` has shape {tuple(np.shape(grad))}, "
                f"but `{name}` has shape {tuple(out.shape)}; pass an upstream gradient of "
                "the output's shape."
            )
            raise GradOverrideError(msg)
        result.append(jnp.asarray(grad, dtype=out.dtype))
    return tuple(result)


def _describe_upstream(grad_outputs: Any, seed: int) -> str:
    if isinstance(grad_outputs, str):
        return f"random normal (seed {seed})" if grad_outputs == "random" else "ones"
    return "given"


# ---- references ---------------------------------------------------------------------------


def _reference_gradients(
    reference: Any,
    call: _Call,
    outputs: _Outputs,
    grads_out: tuple[jax.Array, ...],
    step: float,
) -> tuple[str, dict[str, Any]]:
    """A description of the reference, and its gradient for each input it covers (None:
    no gradient, compared as zeros)."""
    fn = call.fn_name
    if isinstance(reference, str):
        if reference != FINITE_DIFFERENCES:
            msg = (
                f"check_backward(`{fn}`): unknown reference {reference!r}; the string "
                f"reference is {FINITE_DIFFERENCES!r}. A reference can also be a proxy "
                "function or the expected gradients as arrays."
            )
            raise GradOverrideError(msg)
        grads = _finite_differences(call, outputs, grads_out, step)
        return f"central finite differences (step {step:g}, float64)", dict(
            zip(call.names, grads, strict=True)
        )
    if isinstance(reference, jax.Array | np.ndarray | torch.Tensor | Mapping | Sequence):
        return "the given gradients", _given(reference, call)
    if callable(reference):
        return f"the proxy `{function_name(reference)}`", _proxy(reference, call, outputs,
                                                                 grads_out)
    msg = (
        f"check_backward(`{fn}`): `reference` must be a proxy function, "
        f"{FINITE_DIFFERENCES!r}, or the expected gradients as arrays, got "
        f"{type(reference).__name__}."
    )
    raise GradOverrideError(msg)


def _proxy(
    proxy: Callable[..., Any], call: _Call, outputs: _Outputs, grads_out: tuple[jax.Array, ...]
) -> dict[str, Any]:
    name = function_name(proxy)
    proxy_outputs, pullback = _vjp(name, lambda arrays: proxy(*call.rebuild(arrays)),
                                   call.arrays)
    got = [tuple(a.shape) for a in proxy_outputs.arrays]
    want = [tuple(a.shape) for a in outputs.arrays]
    if got != want:
        msg = (
            f"check_backward(`{call.fn_name}`): the proxy `{name}` returned outputs of shapes "
            f"{got}, but `{call.fn_name}` returned {want}; a proxy must take the same inputs "
            "and return outputs of the same shapes, so the same upstream gradients apply."
        )
        raise GradOverrideError(msg)
    cotangents = tuple(
        g.astype(a.dtype) for g, a in zip(grads_out, proxy_outputs.arrays, strict=True)
    )
    return dict(zip(call.names, pullback(cotangents), strict=True))


def _float64() -> AbstractContextManager[Any]:
    """JAX in float64 for the duration of a `with` only (not the user's global setting)."""
    return cast(AbstractContextManager[Any], jax.enable_x64(True))


def _finite_differences(
    call: _Call, outputs: _Outputs, grads_out: tuple[jax.Array, ...], step: float
) -> tuple[np.ndarray, ...]:
    """Central differences of `<upstream, f(x)>` for each element of each input, in float64
    (numpy float64 arrays)."""
    weights = [np.asarray(g).astype(np.float64) for g in grads_out]
    points = [np.array(a).astype(np.float64) for a in call.arrays]

    def values() -> list[np.ndarray]:
        try:
            result = call([jnp.asarray(p) for p in points])
        except Exception as exc:
            msg = (
                f"check_backward(`{call.fn_name}`): `{call.fn_name}` raised "
                f"{type(exc).__name__} in the float64 run of finite differences (its "
                "inputs as float64 copies, inside `jax.enable_x64(True)`), not in its own "
                f"dtype: {str(exc).rstrip('.')}. An op that needs matching dtypes "
                "(`jax.lax.conv`, `jnp.dot` with preferred_element_type) fails there "
                "against an array the function closes over, which stays in its dtype: pass "
                "such arrays as inputs (they are then converted too), or check against a "
                "proxy function instead of "
                f"{FINITE_DIFFERENCES!r}."
            )
            raise GradOverrideError(msg) from exc
        return [np.asarray(a).astype(np.float64) for _, a in _floating(result, "output")]

    def weighted_sum() -> float:
        return sum(
            float((v * w).sum()) for v, w in zip(values(), weights, strict=True)
        )

    grads: list[np.ndarray] = []
    with _float64():
        _same_in_float64(call.fn_name, outputs, values())
        for point in points:
            flat = point.reshape(-1)  # a view: perturbing `flat` perturbs `point`
            grad = np.zeros(flat.size, dtype=np.float64)
            for i in range(flat.size):
                saved = flat[i]
                flat[i] = saved + step
                plus = weighted_sum()
                flat[i] = saved - step
                minus = weighted_sum()
                flat[i] = saved
                grad[i] = (plus - minus) / (2 * step)
            grads.append(grad.reshape(point.shape))
    return tuple(grads)


def _same_in_float64(fn_name: str, outputs: _Outputs, wide: list[np.ndarray]) -> None:
    """A `GradOverrideError` unless the float64 run, at the unperturbed inputs, gives the
    outputs of the checked run to that run's precision: else its differences are those of
    another function, and the rule would be blamed for them."""
    problem = ""
    if len(wide) != len(outputs.arrays):
        problem = (
            f"it returns {len(wide)} floating-point output(s) there, against "
            f"{len(outputs.arrays)} in the checked run"
        )
    for name, array, value in zip(outputs.names, outputs.arrays, wide, strict=False):
        if problem:
            break
        got = np.asarray(array).astype(np.float64)
        if got.shape != value.shape:
            problem = f"its `{name}` has shape {value.shape} there, against {got.shape}"
            break
        # Rounding to the checked dtype moves an output by a few ulps, and a long sum by a
        # few more: the square root of the dtype's epsilon leaves room for both.
        dtype = np.dtype(array.dtype)
        finfo: Any = jnp.finfo  # (jnp's knows bfloat16 too)
        tol = float(np.sqrt(float(finfo(dtype).eps)))
        far = ~np.isclose(value, got, rtol=tol, atol=tol * max(1.0, float(
            np.max(np.abs(got), initial=0.0, where=np.isfinite(got)))), equal_nan=True)
        if far.any():
            index = tuple(int(i) for i in np.argwhere(far)[0]) if far.ndim else ()
            problem = (
                f"its `{name}` differs{format_index(index)}: {float(value[index]):.6g} "
                f"in float64 against {float(got[index]):.6g} in {dtype.name}, beyond "
                f"{dtype.name}'s precision (tolerance {tol:.2g})"
            )
    if problem:
        msg = (
            f"check_backward(`{fn_name}`): finite differences run `{fn_name}` on float64 "
            "copies of its inputs (inside `jax.enable_x64(True)`), but there it is not the "
            f"same function: at the unperturbed inputs {problem}. Random draws (`jax.random` "
            "gives other numbers in float64) or code that depends on the dtype make it so. "
            "Check the rule against a proxy function, or against the expected gradients "
            f"given as arrays, instead of {FINITE_DIFFERENCES!r}."
        )
        raise GradOverrideError(msg)


def _given(reference: Any, call: _Call) -> dict[str, Any]:
    fn = call.fn_name
    if isinstance(reference, jax.Array | np.ndarray | torch.Tensor):
        if len(call.names) != 1:
            msg = (
                f"check_backward(`{fn}`): the reference is one array, but `{fn}` has "
                f"{len(call.names)} inputs to differentiate ({', '.join(call.names)}); "
                "pass a dict by input name."
            )
            raise GradOverrideError(msg)
        given: dict[str, Any] = {call.names[0]: reference}
    elif isinstance(reference, Mapping):
        unknown = [k for k in reference if k not in call.names]
        if unknown:
            msg = (
                f"check_backward(`{fn}`): the reference names `{unknown[0]}`, which is not an "
                f"input of `{fn}` that gets a gradient; those are {', '.join(call.names)}."
            )
            raise GradOverrideError(msg)
        given = dict(reference)
    else:
        if len(reference) != len(call.names):
            msg = (
                f"check_backward(`{fn}`): the reference has {len(reference)} gradient(s), but "
                f"`{fn}` has {len(call.names)} inputs to differentiate "
                f"({', '.join(call.names)}); pass one per input (None for none) or a dict."
            )
            raise GradOverrideError(msg)
        given = dict(zip(call.names, reference, strict=True))
    arrays = dict(zip(call.names, call.arrays, strict=True))
    for name, grad in given.items():
        if grad is None:
            continue
        if isinstance(grad, torch.Tensor):
            raise _torch_refused(
                fn, f"the reference gradient for `{name}`",
                "give the expected gradients as JAX or numpy arrays.",
            )
        if not isinstance(grad, jax.Array | np.ndarray):
            msg = (
                f"check_backward(`{fn}`): the reference gradient for `{name}` must be an "
                f"array or None, got {type(grad).__name__}."
            )
            raise GradOverrideError(msg)
        if tuple(grad.shape) != tuple(arrays[name].shape):
            msg = (
                f"check_backward(`{fn}`): the reference gradient for `{name}` has shape "
                f"{tuple(grad.shape)}, but `{name}` has shape {tuple(arrays[name].shape)}; "
                "give the expected gradient in the input's shape."
            )
            raise GradOverrideError(msg)
    return given


# ---- rows, report and message ----------------------------------------------------------------


def _as_torch(value: Any) -> torch.Tensor:
    """A float64 torch copy of an array, to compare as on torch (`_compare.compare`);
    through float64 numpy, which also takes bfloat16."""
    return torch.from_numpy(np.asarray(value).astype(np.float64))


def _device(array: Any) -> str:
    devices = array.devices()
    return str(next(iter(devices))) if len(devices) == 1 else f"{len(devices)} devices"


@dataclass(frozen=True)
class JaxGradientRow(GradientRow):
    """A `GradientRow` whose `grad` and `expected` are JAX (or numpy) arrays."""

    @property
    def finite(self) -> bool:
        """Whether every element of the gradient is finite (True when there is none)."""
        return self.grad is None or bool(np.isfinite(np.asarray(self.grad)).all())

    def cells(self, with_reference: bool) -> list[str]:
        """The table cells of this row: as on torch, with JAX's device name."""
        cells = super().cells(with_reference)
        if self.grad is not None:
            cells[3] = _device(self.grad)
        return cells


def _shape_problems(name: str, grad: Any, array: jax.Array) -> list[str]:
    if tuple(grad.shape) != tuple(array.shape):
        return [
            f"its gradient has shape {tuple(grad.shape)}, but `{name}` has shape "
            f"{tuple(array.shape)}."
        ]
    if grad.dtype != array.dtype:
        return [f"its gradient has dtype {grad.dtype}, but `{name}` has dtype {array.dtype}."]
    return []


def _finiteness_problems(grad: Any) -> list[str]:
    values = np.asarray(grad)
    bad = ~np.isfinite(values)
    count = int(bad.sum())
    if not count:
        return []
    first = tuple(int(i) for i in np.argwhere(bad)[0]) if values.ndim else ()
    return [
        f"its gradient is not finite: {count} of {values.size} values are NaN or infinite "
        f"(the first{format_index(first)}: {float(values[first]):g})."
    ]


def _torch_dtype(dtype: Any) -> torch.dtype | None:
    """The torch dtype of the same name (for `torch.testing`'s default tolerances)."""
    found = getattr(torch, np.dtype(dtype).name, None)
    return found if isinstance(found, torch.dtype) else None


def check_backward_jax(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    reference: JaxReference | None,
    grad_outputs: JaxGradOutputs,
    rtol: float | None,
    atol: float | None,
    min_cosine: float | None,
    allow_nonfinite: bool,
    step: float,
    seed: int,
    raise_on_mismatch: bool,
) -> BackwardReport:
    """`check_backward(fn, *inputs, ...)` where the inputs hold JAX arrays (its
    arguments, as `check_backward` documents them; `grad_outputs` already chosen)."""
    call = _Call(fn, inputs)
    try:
        outputs, pullback = _vjp(call.fn_name, call, call.arrays)
    except jax.errors.TracerArrayConversionError as exc:
        if not call.numpy_names:
            raise
        msg = (
            f"check_backward(`{call.fn_name}`): the numpy input(s) "
            f"{', '.join(f'`{n}`' for n in call.numpy_names)} are differentiated as JAX "
            "arrays (given with JAX inputs, a floating-point numpy array is checked too), "
            f"but `{call.fn_name}` converts one back to numpy, which JAX cannot "
            "differentiate. Compute with `jnp` ops, or, to keep a numpy array a constant, "
            "bind it with `functools.partial` or a closure instead of passing it as an input."
        )
        raise GradOverrideError(msg) from exc
    grads_out = _upstream(outputs, grad_outputs, seed, call.fn_name)
    try:
        grads = pullback(grads_out)
    except Exception as exc:
        exc.add_note(f"(raised in the backward of `{call.fn_name}` run by check_backward)")
        raise

    expected: dict[str, Any] = {}
    description: str | None = None
    if reference is not None:
        description, expected = _reference_gradients(reference, call, outputs, grads_out, step)
    by_differences = isinstance(reference, str) and reference == FINITE_DIFFERENCES
    at_least = _FINITE_DIFFERENCE_TOLERANCES if by_differences else (0.0, 0.0)

    rows: list[GradientRow] = []
    for name, array, grad in zip(call.names, call.arrays, grads, strict=True):
        problems = _shape_problems(name, grad, array)
        if not problems and not allow_nonfinite:
            problems = _finiteness_problems(grad)
        difference: Difference | None = None
        if description is not None and name in expected and not problems:
            want = expected[name]
            dtype = _torch_dtype(array.dtype)
            rtol_, atol_ = tolerances(
                dtype if dtype is not None else torch.float64, rtol, atol, at_least=at_least
            )
            zeros = torch.zeros(tuple(array.shape), dtype=torch.float64)
            difference = compare(
                _as_torch(grad), zeros if want is None else _as_torch(want), rtol_, atol_
            )
            problems += difference_problems(difference, description, atol_, rtol_, min_cosine)
        want_value = expected.get(name)
        rows.append(JaxGradientRow(name, cast(Any, grad), cast(Any, want_value), difference,
                                   tuple(problems)))

    report = BackwardReport(
        call.fn_name, rows, reference=description,
        upstream=_describe_upstream(grad_outputs, seed),
    )
    if raise_on_mismatch and not report.ok:
        raise GradOverrideError(mismatch_message(report, reference, "`jnp.where`, `jnp.clip`"))
    return report
