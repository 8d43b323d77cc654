"""`bridge`: run code outside PyTorch (numpy, scipy, a simulator, a solver) inside a
differentiable graph, with a backward you write or an estimator chosen by name.

The bridged function is a `custom_backward` op underneath: its forward converts tensors to
numpy arrays, calls the user's function, and converts the result back; its backward rule is
the user's rule wrapped the same way, or a finite-difference / SPSA estimator that calls the
function again on perturbed inputs. So the rule contract, the gradient checks and the error
messages are those of `custom_backward`.

The numpy code runs inside one opaque operator (`gradoverride/_outside.py`), both in the
forward and in the rule: torch.compile and torch.export trace the call as one node (its
output shapes from `outputs=`), and torch.func transforms reach real tensors through it (a
vmap calls it per batch entry). On TensorFlow tensors the same bridge runs through
`tf.numpy_function` (`gradoverride/_tensorflow/_bridge.py`).
"""

from __future__ import annotations

import copy
import functools
import inspect
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeAlias, TypeVar, overload

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from typing_extensions import ParamSpec

from . import _outside as outside
from ._backends import backend
from ._decorators import CustomBackward, custom_backward
from ._errors import GradOverrideError, GradOverrideTypeError
from ._frameworks import any_tensorflow, autograph_artifact
from ._function import flatten_inputs
from ._gradients import SKIP, flat_gradients, slot_ranges, takes_gradient
from ._internals import transforms_active
from ._rule import RuleSpec, normalize_names
from ._signature import describe

try:
    import numpy as np
except ImportError:  # pragma: no cover - torch and the rest of gradoverride work without numpy
    np = None  # type: ignore[assignment]

__all__ = ["Bridge", "Estimator", "bridge", "finite_differences", "spsa"]

P = ParamSpec("P")
F = TypeVar("F", bound=Callable[..., Any])

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_ARRAY_KINDS = "biuf"  # bool, int, unsigned, float: what converts to a torch tensor here


# ---- conversions ------------------------------------------------------------------------------


def to_numpy(value: Any) -> Any:
    """A tensor as a read-only numpy array (a view for CPU tensors); anything else as is."""
    if not isinstance(value, Tensor):
        return value
    t = value.detach()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16
        t = t.float()
    array = t.cpu().numpy()
    array.flags.writeable = False  # `fn` must not write into the caller's tensor
    return array


def _tree_to_numpy(values: Any) -> Any:
    """`values` with every tensor in its tuples, lists and dicts as a numpy array (a plain
    walk: torch's pytree costs more than a small bridge's numpy call)."""
    kind = type(values)
    if kind is tuple or kind is list:
        return kind(_tree_to_numpy(v) for v in values)
    if kind is dict:
        return {k: _tree_to_numpy(v) for k, v in values.items()}
    if isinstance(values, tuple) and hasattr(values, "_fields"):  # a namedtuple
        return kind(*(_tree_to_numpy(v) for v in values))
    return to_numpy(values)


def as_array(value: Any, what: str) -> np.ndarray[Any, Any]:
    """`value` as a numeric numpy array, or a GradOverrideError saying what it was."""
    if isinstance(value, Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        converted: np.ndarray[Any, Any] = value.numpy()
        return converted
    try:
        array = np.asarray(value)
    except (TypeError, ValueError):
        array = None
    if array is None or array.dtype.kind not in _ARRAY_KINDS:
        shown = repr(value)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        msg = (
            f"{what} returned {type(value).__name__} {shown}, which is not array-like; "
            "return a numpy array, a number, or a tuple of them for several outputs "
            "(real numbers only: bool, int or float)."
        )
        raise GradOverrideError(msg)
    return array


def _outputs(result: Any) -> tuple[Any, ...]:
    """A plain tuple is several outputs; any other value is one."""
    return result if type(result) is tuple else (result,)


def _target(tree: Any) -> tuple[torch.device, torch.dtype | None]:
    """The device of the first tensor argument and the floating dtype outputs get: the
    promoted dtype of the floating tensor arguments (None when there is none)."""
    device = None
    dtype: torch.dtype | None = None
    for leaf in outside.tensors_in(tree):
        if isinstance(leaf, Tensor):
            if device is None:
                device = leaf.device
            if leaf.is_floating_point():
                dtype = leaf.dtype if dtype is None else torch.promote_types(dtype, leaf.dtype)
    return (device or torch.device("cpu")), dtype


def _to_tensor(array: np.ndarray[Any, Any], device: torch.device, dtype: torch.dtype | None
               ) -> Tensor:
    """A copy of `array` as a tensor; floating arrays get `dtype` when there is one."""
    out = torch.tensor(array, device=device)
    if dtype is not None and out.is_floating_point():
        out = out.to(dtype)
    return out


def _count_nonfinite(array: np.ndarray[Any, Any]) -> str:
    n_nan = int(np.isnan(array).sum())
    n_inf = int(np.isinf(array).sum())
    return f"{n_nan} NaN and {n_inf} infinite of {array.size} values"


def graph_break(fn: Callable[..., Any], reason: str) -> Callable[..., Any]:
    """`fn` as an explicit graph break under torch.compile; `reason` appears in the error
    that `fullgraph=True` raises (torch >= 2.7 takes a reason; older ones get none)."""
    disable: Any = torch.compiler.disable
    try:
        wrapped: Callable[..., Any] = disable(fn, reason=reason)
    except TypeError:  # pragma: no cover - torch < 2.7
        wrapped = disable(fn)
    return wrapped


# ---- what a bridged function cannot be given, or do --------------------------------------------


def _is_read_only_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) and not value.flags.writeable


def _wrote_read_only(exc: ValueError) -> bool:
    """Whether `exc` is numpy refusing a write ("output array is read-only", "assignment
    destination is read-only", ...)."""
    return "is read-only" in str(exc)


def _holding(bound: dict[str, Any], test: Callable[[Any], bool]) -> list[str]:
    """The names in `bound` whose values (searched through tuples, lists and dicts) hold a
    leaf passing `test`."""
    return [
        name for name, value in bound.items() if any(map(test, pytree.tree_leaves(value)))
    ]


def _bind(signature: inspect.Signature, args: Sequence[Any], kwargs: dict[str, Any]
          ) -> dict[str, Any]:
    """The arguments of a call by parameter name ({} when they do not fit `signature`)."""
    try:
        return dict(signature.bind(*args, **kwargs).arguments)
    except TypeError:
        return {}


def _naming(names: Sequence[str], one: str, several: str, unknown: str) -> str:
    """`one` / `several` with the backquoted names filled in for {names}, or `unknown`."""
    if not names:
        return unknown
    shown = ", ".join(f"`{n}`" for n in names)
    return (one if len(names) == 1 else several).format(names=shown)


def _read_only_error(who: str, written: Sequence[str]) -> GradOverrideError:
    """The error for `who` writing into one of the read-only arrays it was given."""
    where = _naming(written, "its argument {names}", "one of its arguments {names}",
                    "one of its array arguments")
    first = written[0] if written else "x"
    msg = (
        f"{who} wrote into {where}, a read-only numpy array: go.bridge passes the caller's "
        "tensors as read-only views, without a copy, so that the function cannot change "
        f"them. Copy the array before writing into it (`{first} = {first}.copy()`), or "
        f"compute a new one (`{first} = {first} + 1` rather than `{first} += 1`)."
    )
    return GradOverrideError(msg)


def _call_on_arrays(fn: Callable[..., Any], signature: inspect.Signature | None,
                    args: Sequence[Any], kwargs: dict[str, Any], who: str) -> Any:
    """`fn(*args, **kwargs)` on read-only arrays; `fn` writing into one is the error naming
    the argument (`signature`: fn's, read from it when None)."""
    try:
        return fn(*args, **kwargs)
    except ValueError as exc:
        if not _wrote_read_only(exc):
            raise
        bound = _bind(signature or _read_signature(fn), args, kwargs)
        raise _read_only_error(who, _holding(bound, _is_read_only_array)) from exc


# ---- estimators -------------------------------------------------------------------------------


class Estimator:
    """Base of the gradient estimators `bridge` accepts as `backward=`."""

    vectorized: bool = False
    batch_size: int | None = None

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{name}={getattr(self, name)!r}"
            for name in self.__dataclass_fields__  # type: ignore[attr-defined]
        )
        return f"{type(self).__name__}({fields})"

    def vjp(self, problem: _Problem) -> list[np.ndarray[Any, Any] | None]:
        """Per differentiable leaf, the estimated vector-Jacobian product (float64)."""
        raise NotImplementedError


def _check_batch_size(estimator: Estimator) -> None:
    size = estimator.batch_size
    if size is not None and not (isinstance(size, int) and size > 0):
        msg = (
            f"{type(estimator).__name__} needs `batch_size` to be a positive int (the most "
            f"perturbed inputs per call of a vectorized function) or None, got {size!r}."
        )
        raise GradOverrideError(msg)


def _default_step(dtype: np.dtype[Any]) -> float:
    """eps ** (1/3), the step that balances truncation and rounding error of a central
    difference (1.8e-16 ** (1/3) = 6.1e-6 for float64, 4.9e-3 for float32)."""
    return float(np.finfo(dtype).eps ** (1.0 / 3.0))


def _steps(array: np.ndarray[Any, Any], step: float | None) -> np.ndarray[Any, Any]:
    """Per-element steps: `step * max(1, |x|)`, relative for large values."""
    base = _default_step(array.dtype) if step is None else step
    steps: np.ndarray[Any, Any] = base * np.maximum(1.0, np.abs(array.astype(np.float64)))
    return steps


@dataclass(frozen=True, repr=False)
class finite_differences(Estimator):
    """Central finite differences, one element at a time: 2 calls of `fn` per input element.

    Exact up to O(h^2) for a smooth function.

    Formula, for each differentiable input element ``x_i`` with step ``h_i``:

    ```text
    grad_x_i = sum_k < grad_out_k, (fn(x + h_i e_i)_k - fn(x - h_i e_i)_k) > / (2 h_i)
    ```

    with ``h_i = step * max(1, |x_i|)`` and the denominator the representable difference
    ``(x_i + h_i) - (x_i - h_i)``. The default step is ``eps ** (1/3)`` of the input's
    dtype (6e-6 for float64), as for `torch.autograd.gradcheck`-level accuracy.

    ```python
    import numpy as np
    import torch
    import gradoverride as go

    cube = go.bridge(lambda x: x**3, backward=go.finite_differences(vectorized=True))
    x = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    cube(x).sum().backward()  # ufuncs take the leading batch axis: one call for all steps
    print([round(g, 6) for g in x.grad.tolist()])  # 3 x**2
    #> [3.0, 12.0]
    ```

    Args:
        step: the relative step (default: ``eps ** (1/3)`` of the input's dtype).
        vectorized: `fn` accepts a leading batch axis on the input being differentiated
            (the other arguments unchanged) and returns every output with that leading axis,
            as numpy ufuncs and broadcasting code do. The perturbed inputs are then sent in
            one call (or in calls of `batch_size`) instead of one call each.
        batch_size: with `vectorized`, the most perturbed inputs per call (None: all).

    Returns: an estimator for `bridge(fn, backward=...)`.
    """

    step: float | None = None
    vectorized: bool = False
    batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.step is not None and not (
            isinstance(self.step, int | float) and self.step > 0 and math.isfinite(self.step)
        ):
            msg = f"finite_differences needs `step` to be a positive number, got {self.step!r}."
            raise GradOverrideError(msg)
        _check_batch_size(self)

    def vjp(self, problem: _Problem) -> list[np.ndarray[Any, Any] | None]:
        grads: list[np.ndarray[Any, Any] | None] = []
        for leaf in problem.leaves:
            if leaf not in problem.differentiable:
                grads.append(None)
                continue
            base = problem.arrays[leaf]
            h = _steps(base, self.step).reshape(-1)
            flat_grad = np.zeros(base.size)
            for chunk in _chunks(base.size, self.vectorized, self.batch_size):
                m = len(chunk)
                batch = np.repeat(base.reshape(1, -1), 2 * m, axis=0)
                rows = np.arange(m)
                batch[rows, chunk] = base.reshape(-1)[chunk] + h[chunk]
                batch[m + rows, chunk] = base.reshape(-1)[chunk] - h[chunk]
                actual = (
                    batch[rows, chunk].astype(np.float64)
                    - batch[m + rows, chunk].astype(np.float64)
                )
                batch = batch.reshape(2 * m, *base.shape)
                values = problem.evaluate({leaf: batch}, 2 * m, self.vectorized)
                flat_grad[chunk] = (values[:m] - values[m:]) / actual
            grads.append(flat_grad.reshape(base.shape))
        return grads


@dataclass(frozen=True, repr=False)
class spsa(Estimator):
    """Simultaneous perturbation (SPSA, Spall 1992): 2 calls of `fn` per sample, any input size.

    Every input element is perturbed at once along a random ±1 direction.

    Formula, averaged over `samples` directions ``d`` with independent ±1 entries (each
    differentiable input gets its own direction, independent of the others'):

    ```text
    s = sum_k < grad_out_k, fn(x + h*d)_k - fn(x - h*d)_k >
    grad_x_i = mean over samples of  s / (2 h_i d_i)
    ```

    with ``h_i = step * max(1, |x_i|)``. It is unbiased up to O(h^2) and its variance falls
    as 1/samples. When every ``|x_i| <= 1`` (all steps equal), the relative error is about
    ``sqrt(n / samples)`` for n input elements: cosine similarity with the true gradient is
    about 0.9 at ``samples = 4 n``. Larger inputs get larger steps, and the cross terms
    ``(h_j / h_i) d_j d_i`` then add variance: measured on 1000 elements at 4096 samples, a
    cosine of 0.90 for inputs in [-1, 1], 0.79 for standard normal inputs, and 0.57 for
    inputs in [-10, 10] (at 5000 samples). Rescale such inputs to about unit size, or use
    more samples. Use it for large inputs where finite differences cost too many calls.

    Memory: the directions are drawn a chunk at a time (one sample, or `batch_size` samples
    when vectorized) and dropped once that chunk is evaluated, so the estimator needs a few
    times the input's size (the steps, the running sum, the chunk's perturbed inputs), not
    `samples` times it.

    Random directions: the bits are drawn in the order of one ``(samples, *shape)`` draw per
    differentiable input, inputs in argument order, so the estimate is the same with or
    without `vectorized` and for any `batch_size`. With `seed`, all inputs share one
    stream seeded by it: the first input's directions are those of
    ``torch.randint(0, 2, (samples, *shape), generator=torch.Generator().manual_seed(seed))``
    and the next inputs' follow in the same stream. (Earlier versions restarted the seeded
    stream for every input, so inputs of the same shape got the same direction and each
    one's estimate had the others' gradient added to it: with a seed and several
    differentiable inputs, the estimates now differ from those versions'; with one input,
    or with a generator or the global RNG, they are the same.)

    ```python
    import numpy as np
    import torch
    import gradoverride as go

    def simulate(v):  # a black box of 100 inputs
        return np.sum(np.sin(v))

    bridged = go.bridge(simulate, backward=go.spsa(samples=400, seed=0))
    v = torch.linspace(-1, 1, 100, dtype=torch.float64, requires_grad=True)
    bridged(v).backward()  # 800 calls of `simulate`, whatever the input size
    cosine = torch.nn.functional.cosine_similarity(v.grad, torch.cos(v.detach()), dim=0)
    print(f"{float(cosine):.2f}")
    #> 0.89
    ```

    Args:
        samples: the number of random directions (default 32).
        step: the relative step (default: ``eps ** (1/3)`` of the input's dtype).
        seed: a seed for the directions; each backward then draws the same directions, so
            the gradient is reproducible call after call.
        generator: a CPU `torch.Generator` or a `numpy.random.Generator` to draw from instead
            (its state advances, so successive backwards differ but a run is reproducible
            from its seed). With neither, torch's global RNG is used (`torch.manual_seed`).
        vectorized: `fn` accepts a leading batch axis on its differentiated inputs and
            returns every output with it; the 2 * samples calls become one (or a few).
        batch_size: with `vectorized`, the most perturbed inputs per call (None: all, so
            the memory of all samples at once: set it for large inputs).

    Returns: an estimator for `bridge(fn, backward=...)`.
    """

    samples: int = 32
    step: float | None = None
    seed: int | None = None
    generator: torch.Generator | np.random.Generator | None = None
    vectorized: bool = False
    batch_size: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.samples, int) and self.samples > 0):
            msg = f"spsa needs `samples` to be a positive int, got {self.samples!r}."
            raise GradOverrideError(msg)
        if self.step is not None and not (
            isinstance(self.step, int | float) and self.step > 0 and math.isfinite(self.step)
        ):
            msg = f"spsa needs `step` to be a positive number, got {self.step!r}."
            raise GradOverrideError(msg)
        if self.seed is not None and self.generator is not None:
            msg = (
                "spsa takes a `seed` or a `generator`, not both: a seed draws the same "
                "directions at every backward; a generator continues its stream."
            )
            raise GradOverrideError(msg)
        if self.generator is not None and not isinstance(
            self.generator, torch.Generator | np.random.Generator
        ):
            msg = (
                "spsa needs `generator` to be a torch.Generator or a numpy.random.Generator, "
                f"got {type(self.generator).__name__}."
            )
            raise GradOverrideTypeError(msg)
        _check_batch_size(self)

    def vjp(self, problem: _Problem) -> list[np.ndarray[Any, Any] | None]:
        leaves = [leaf for leaf in problem.leaves if leaf in problem.differentiable]
        bases = [problem.arrays[leaf] for leaf in leaves]
        directions = _DirectionStream(self, [base.shape for base in bases])
        steps = [_steps(base, self.step) for base in bases]
        sums = [np.zeros(base.shape) for base in bases]
        # Directions are drawn chunk by chunk and dropped after it: memory is that of the
        # chunk being evaluated (one sample, or `batch_size` when vectorized), not samples * n.
        for chunk in _chunks(self.samples, self.vectorized, self.batch_size):
            m = len(chunk)
            replaced: dict[int, np.ndarray[Any, Any]] = {}
            actual: list[np.ndarray[Any, Any]] = []
            for k, (leaf, base) in enumerate(zip(leaves, bases, strict=True)):
                replaced[leaf], difference = _perturb(base, steps[k], directions.draw(k, m))
                actual.append(difference)
            values = problem.evaluate(replaced, 2 * m, self.vectorized)
            projection = values[:m] - values[m:]  # (m,)
            for k, base in enumerate(bases):
                scale = projection.reshape(m, *([1] * base.ndim))
                np.divide(scale, actual[k], out=actual[k])
                # One sample's terms are added as they are (no (n,) temporary for the sum).
                sums[k] += actual[k][0] if m == 1 else actual[k].sum(axis=0)
            del replaced, actual, difference  # free this chunk before drawing the next
        estimates = dict(zip(leaves, sums, strict=True))
        for total in sums:
            total /= self.samples
        return [estimates.get(leaf) for leaf in problem.leaves]


# Where SPSA draws its directions; None is torch's global generator.
_Source: TypeAlias = "torch.Generator | np.random.Generator | None"


class _DirectionStream:
    """The ±1 directions of SPSA, drawn a chunk of samples at a time.

    The directions are those one draw of `(samples, *shape)` bits per differentiated input,
    inputs one after the other, would give (torch and numpy give the same numbers drawn in
    consecutive pieces): so the estimate does not depend on `vectorized` or `batch_size`,
    and the source's state ends where that one draw would leave it. Input k > 0 starts
    after the bits of the inputs before it: every input but the last reads from a copy of
    the source, which skips past that input's bits; the last reads from the source itself.

    Small inputs draw up to `_AHEAD` bits ahead (never past `samples`) instead of calling
    the generator once per sample; the numbers are the same.
    """

    def __init__(self, estimator: spsa, shapes: Sequence[tuple[int, ...]]) -> None:
        source: _Source = estimator.generator
        if estimator.seed is not None:
            source = torch.Generator().manual_seed(estimator.seed)
        self._cursors: list[_Source] = []
        for k, shape in enumerate(shapes):
            if k == len(shapes) - 1:
                self._cursors.append(source)
                break
            self._cursors.append(_copy_source(source))
            # Skip in pieces of about a million bits, to keep memory bounded here too.
            per_piece = max(1, 2**20 // max(1, math.prod(shape)))
            for start in range(0, estimator.samples, per_piece):
                _draw_bits(source, (min(per_piece, estimator.samples - start), *shape))
        self._shapes = list(shapes)
        self._left = [estimator.samples] * len(shapes)  # samples not drawn yet, per input
        self._ahead = [np.empty((0, *shape), np.int8) for shape in shapes]

    def draw(self, k: int, m: int) -> np.ndarray[Any, Any]:
        """The next `m` directions of input k: (m, *shape) entries of ±1 as int8."""
        ahead, shape = self._ahead[k], self._shapes[k]
        if len(ahead) < m:
            count = min(self._left[k], max(m - len(ahead), _AHEAD // max(1, math.prod(shape))))
            bits = _draw_bits(self._cursors[k], (count, *shape))
            signs = bits.astype(np.int8) * np.int8(2) - np.int8(1)
            ahead = np.concatenate([ahead, signs]) if len(ahead) else signs
            self._left[k] -= count
        # A view of what is left would keep all of `ahead` alive: drop it when nothing is.
        self._ahead[k] = ahead[m:] if len(ahead) > m else np.empty((0, *shape), np.int8)
        drawn: np.ndarray[Any, Any] = ahead[:m]
        return drawn


_AHEAD = 1 << 16  # bits SPSA may draw ahead of the chunk it evaluates (64 KiB as int8)


def _copy_source(source: _Source) -> _Source:
    """An independent generator in the same state as `source`."""
    if isinstance(source, np.random.Generator):
        return copy.deepcopy(source)
    state_of = torch.default_generator if source is None else source
    twin = torch.Generator(device=state_of.device)
    twin.set_state(state_of.get_state())
    return twin


def _draw_bits(source: _Source, size: tuple[int, ...]) -> np.ndarray[Any, Any]:
    """`size` random 0/1 entries from `source`. From numpy, in its default integer dtype:
    the stream the directions are documented to follow (numpy draws int8 differently)."""
    if isinstance(source, np.random.Generator):
        drawn: np.ndarray[Any, Any] = source.integers(0, 2, size=size)
        return drawn
    return torch.randint(0, 2, size, generator=source, dtype=torch.int8).numpy()


def _perturb(base: np.ndarray[Any, Any], steps: np.ndarray[Any, Any],
             signs: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """The `2m` perturbed inputs ``[x + h*d; x - h*d]`` in `base`'s dtype, and the
    representable differences ``(x + h*d) - (x - h*d)`` in float64, for m directions."""
    m = len(signs)
    delta = steps * signs  # (m, *shape) float64: exactly ±h
    pair = np.empty((2 * m, *base.shape), dtype=base.dtype)
    # Computed in float64 and rounded to base's dtype once, written in place.
    np.add(base, delta, out=pair[:m], casting="unsafe")
    np.subtract(base, delta, out=pair[m:], casting="unsafe")
    np.subtract(pair[:m], pair[m:], out=delta, dtype=np.float64)  # reuses delta's memory
    return pair, delta


def _chunks(n: int, vectorized: bool, batch_size: int | None) -> Iterator[np.ndarray[Any, Any]]:
    """Index ranges: one at a time, or (vectorized) batch_size at a time."""
    size = (batch_size or n) if vectorized else 1
    for start in range(0, n, max(size, 1)):
        yield np.arange(start, min(start + size, n))


ESTIMATORS: dict[str, type[Estimator]] = {
    "finite_differences": finite_differences,
    "spsa": spsa,
}


# ---- the problem an estimator solves: fn, its arguments as numpy leaves, the upstream grads --


class _Problem:
    """`fn` at the saved arguments, with the upstream gradients: `evaluate` returns the
    projections ``sum_k <grad_out_k, fn(args')_k>`` for a batch of perturbed arguments."""

    def __init__(
        self,
        bridge: Bridge[...],
        values: tuple[Any, ...],
        needs_grad: dict[str, bool],
        grads: tuple[Any, ...],
        check_finite: bool,
    ) -> None:
        self.bridge = bridge
        leaves, self.spec = pytree.tree_flatten(values)
        self.leaves = list(range(len(leaves)))
        self.originals = leaves
        self.arrays: dict[int, np.ndarray[Any, Any]] = {}
        self.differentiable: set[int] = set()
        self.slot_of: dict[int, str] = {}
        names = bridge._parameters
        # Which slot each leaf belongs to: flatten slot by slot.
        position = 0
        for name, value in zip(names, values, strict=True):
            for _ in pytree.tree_leaves(value):
                self.slot_of[position] = name
                position += 1
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                self.arrays[i] = to_numpy(leaf)
                if leaf.is_floating_point() and needs_grad.get(self.slot_of[i], False):
                    self.differentiable.add(i)
        self.grads = [
            None if g is None else np.asarray(to_numpy(g), dtype=np.float64) for g in grads
        ]
        self.check_finite = check_finite

    def _call(self, replaced: dict[int, Any]) -> tuple[Any, ...]:
        leaves = [
            replaced.get(i, self.arrays.get(i, self.originals[i])) for i in self.leaves
        ]
        values = pytree.tree_unflatten(leaves, self.spec)
        return _outputs(self.bridge._call_numpy(values))

    def evaluate(self, replaced: dict[int, np.ndarray[Any, Any]], batch: int,
                 vectorized: bool) -> np.ndarray[Any, Any]:
        """``sum_k <grad_out_k, fn(...)_k>`` for each of `batch` perturbed argument sets;
        `replaced` holds, per perturbed leaf, the stacked (batch, *shape) arrays."""
        if vectorized:
            outs = [self._outputs(self._call(replaced), batch, replaced)]
        else:
            outs = [
                self._outputs(self._call({i: a[b] for i, a in replaced.items()}), None, replaced)
                for b in range(batch)
            ]
        result = np.zeros(batch)
        for k, g in enumerate(self.grads):
            if g is None:
                continue
            if vectorized:
                result += np.tensordot(outs[0][k], g, axes=g.ndim)
            else:
                result += np.array([float(np.vdot(g, out[k])) for out in outs])
        return result

    def _outputs(self, outs: tuple[Any, ...], batch: int | None,
                 replaced: dict[int, np.ndarray[Any, Any]]) -> list[np.ndarray[Any, Any]]:
        name = self.bridge._name
        if len(outs) != len(self.grads):
            msg = (
                f"`{name}` returned {len(outs)} outputs on perturbed inputs but "
                f"{len(self.grads)} at the forward; it must return the same outputs."
            )
            raise GradOverrideError(msg)
        arrays = []
        inputs = ", ".join(f"`{self.slot_of[i]}`" for i in replaced)
        for k, (out, g) in enumerate(zip(outs, self.grads, strict=True)):
            array = as_array(out, f"`{name}` (output {k}, on perturbed inputs)")
            expected = tuple(g.shape) if g is not None else tuple(array.shape)
            if batch is not None:
                expected = (batch, *expected)
            if g is not None and tuple(array.shape) != expected:
                hint = (
                    " With vectorized=True, `fn` gets a leading batch axis on the perturbed "
                    "input and must return each output with it, also an output that does not "
                    "depend on that input (`np.broadcast_to(out, (len(x), *out.shape))`); "
                    "pass vectorized=False if it cannot."
                    if batch is not None
                    else ""
                )
                msg = (
                    f"`{name}` returned output {k} with shape {tuple(array.shape)} when "
                    f"{inputs} was perturbed; expected {expected}.{hint}"
                )
                raise GradOverrideError(msg)
            if self.check_finite and array.dtype.kind == "f" and not np.isfinite(array).all():
                msg = (
                    f"`{name}` returned non-finite values in output {k} when {inputs} was "
                    f"perturbed by the estimator ({_count_nonfinite(array)}), so the "
                    "estimated gradient would not be finite. Make `fn` finite near the input, "
                    "use a smaller `step`, or pass `check_finite=False` to bridge."
                )
                raise GradOverrideError(msg)
            arrays.append(array.astype(np.float64, copy=False))
        return arrays


# ---- the bridge -------------------------------------------------------------------------------


def _rebuild_bridge(
    fn: Callable[..., Any], backward: Any, check_finite: bool, outputs: Any = None,
    residuals: tuple[str, ...] = (),
) -> Bridge[...]:
    return Bridge(fn, backward, check_finite=check_finite, outputs=outputs,
                  residuals=residuals)


def _read_signature(fn: Callable[..., Any]) -> inspect.Signature:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return inspect.Signature(
            [
                inspect.Parameter("args", inspect.Parameter.VAR_POSITIONAL),
                inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD),
            ]
        )


_COMPILE_REASON = (
    "go.bridge of `{name}` has no `outputs=`, so torch.compile cannot know what its "
    "function (numpy code, which it cannot trace) returns: the call runs eagerly between "
    "compiled graphs (a graph break), which a fullgraph=True region cannot hold. Pass "
    "`outputs=` to go.bridge (a function of the same arguments returning empty tensors of "
    "the outputs' shapes and dtypes, e.g. `outputs=lambda x: torch.empty_like(x)`) to "
    "compile the call as one operator"
)


def _rule_key(backward: Any) -> str:
    if isinstance(backward, Estimator):
        # (Not its repr: a generator in it would put a memory address into the key.)
        return type(backward).__name__
    module = getattr(backward, "__module__", None) or ""
    return f"{module}.{describe(backward)}" if module else describe(backward)


def _through_operator(key: str, role: str, value: Any) -> Any:
    """The bridge `key`'s `outside_run(role, value)` as one opaque operator, which
    torch.compile, torch.export and torch.func see as such (eagerly, it runs right here).
    A value the operator cannot carry (neither a tensor nor a Python literal) is an error
    there; eagerly (tensor subclasses, say) the bridge runs it right here."""
    try:
        return outside.call(key, role, value)
    except outside.NotLiteral as exc:
        if torch.compiler.is_compiling() or transforms_active():
            raise _not_carried(key, role, exc) from None
        return _RUN_HERE[0](key, role, value)


def _run_here(key: str, role: str, value: Any) -> Any:
    bridge: Bridge[...] = outside.owner(key)
    return bridge.outside_run(role, value)


# `_run_here` as dynamo never traces it: where dynamo resumes after the graph break the error
# above makes (no fullgraph), it runs eagerly, numpy included. Wrapped when the first bridge
# is made (not at import: `torch.compiler.disable` imports dynamo, over a second).
_RUN_HERE: list[Callable[[str, str, Any], Any]] = []


def _not_carried(key: str, role: str, reason: outside.NotLiteral) -> GradOverrideError:
    # (Named from the key, "<function> by <rule>": the bridge itself is not looked up while
    # dynamo traces.)
    name = key.split(" by ")[0]
    parts = re.findall(r"\[([^\]]+)\]", reason.path)
    where = parts[1].strip("'") if len(parts) > 1 else "?"
    if parts and parts[0] == "0" and role == "forward":
        where = f"at position {where}"
    else:
        where = f"`{where}`"
    msg = (
        f"`{name}` is a go.bridge, called here under torch.compile, torch.export or a "
        "torch.func transform, which need it as one operator holding tensors and Python "
        f"literals only; its argument {where} holds a {reason.kind}, which is neither. Pass "
        f"it as a tensor, or bind it into the function (`functools.partial({name}, ...)`) "
        "before bridging."
    )
    return GradOverrideError(msg)


class Bridge(Generic[P]):
    """A function outside PyTorch, callable on tensors and differentiable. Made by `bridge`.

    Call it like `fn`, with tensors where `fn` takes arrays. `bridged.op` is the underlying
    `custom_backward` op; `bridged.backward` the rule or estimator.
    """

    __wrapped__: Callable[P, Any]

    # Marked as TensorFlow AutoGraph's own (as `CustomBackward` is), so that a `tf.function`
    # calls it as plain Python: its errors then reach the caller as
    # itself, not wrapped in AutoGraph's StagingError.
    autograph_info__ = frozenset(("autograph_artifact",))

    def __init__(
        self,
        fn: Callable[P, Any],
        backward: Callable[..., Any] | Estimator | str,
        *,
        check_finite: bool = True,
        outputs: Any = None,
        residuals: str | Sequence[str] | None = None,
    ) -> None:
        if np is None:  # pragma: no cover - numpy is installed wherever the tests run
            msg = "go.bridge passes numpy arrays to the function it bridges; install numpy."
            raise GradOverrideError(msg)
        if not callable(fn):
            msg = (
                "bridge needs a function to call on numpy arrays, got "
                f"{type(fn).__name__} {fn!r}."
            )
            raise GradOverrideTypeError(msg)
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._name = describe(fn)
        self._signature = _read_signature(fn)
        self._parameters = tuple(self._signature.parameters)
        self.check_finite = check_finite
        self.outputs = outputs
        if isinstance(backward, str):
            if backward not in ESTIMATORS:
                msg = (
                    f"bridge of `{self._name}` got backward={backward!r}, which is not an "
                    f"estimator; the estimators are {', '.join(map(repr, ESTIMATORS))}, or "
                    "pass a rule `def rule(grad, *, x): ...` written in numpy."
                )
                raise GradOverrideError(msg)
            backward = ESTIMATORS[backward]()
        if not (isinstance(backward, Estimator) or callable(backward)):
            msg = (
                f"bridge of `{self._name}` needs `backward` to be a rule (a function of the "
                f"upstream gradient), an estimator name ({', '.join(map(repr, ESTIMATORS))}) "
                f"or an estimator object such as go.spsa(samples=64), got "
                f"{type(backward).__name__} {backward!r}."
            )
            raise GradOverrideTypeError(msg)
        self.backward = backward
        self.residuals = normalize_names(residuals, "residuals", f"bridge of `{self._name}`")
        if self.residuals and isinstance(backward, Estimator):
            msg = (
                f"bridge of `{self._name}` got residuals={self.residuals!r} with the "
                f"{type(backward).__name__} estimator, which calls `{self._name}` again and "
                "reads no residuals; drop `residuals=`, or pass a rule that names them."
            )
            raise GradOverrideError(msg)
        # Keyed by the function and the rule (an exported program names its bridge so, and a
        # fresh process that imports the module defining it makes the same key).
        self._key = outside.register(self, f"{self._name} by {_rule_key(backward)}")
        if not _RUN_HERE:
            _RUN_HERE.append(graph_break(_run_here, "a go.bridge's code runs eagerly"))
        op: CustomBackward[..., Any] = custom_backward(
            self._make_forward(), residuals=self.residuals
        )
        # A numpy rule or an estimator has no graph to differentiate again.
        op.backward(self._make_rule(op), once_differentiable=True)
        self.op = op

        def run(*args: Any, **kwargs: Any) -> Any:
            if any_tensorflow(args, kwargs):
                return backend("tensorflow").bridge_call(self, args, kwargs, self.outputs)
            if "keras" in sys.modules:
                self._refuse_keras_tensors(args, kwargs)
            return op(*args, **kwargs)

        run.__name__ = run.__qualname__ = f"bridge({self._name})"
        # With `outputs=`, the compiler traces the call as one operator; without, it cannot
        # know what comes out, so the call is an explicit graph break whose reason, shown by
        # fullgraph=True's error, names the bridge and the fix.
        self._run = run if callable(outputs) else graph_break(
            run, _COMPILE_REASON.format(name=self._name))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as the call that makes it (the function and the rule by reference), so a
        # saved model holding a bridge loads back with it.
        from ._pickling import require_importable

        require_importable(self._fn, f"`bridge({self._name})`", "the bridged function")
        if not isinstance(self.backward, Estimator):
            require_importable(self.backward, f"`bridge({self._name})`", "its backward rule")
        if callable(self.outputs):
            require_importable(self.outputs, f"`bridge({self._name})`", "its `outputs=`")
        return (_rebuild_bridge, (self._fn, self.backward, self.check_finite, self.outputs,
                                  self.residuals))

    def __deepcopy__(self, memo: dict[int, Any]) -> Bridge[P]:
        return self  # shared, as a function is: a bridge holds no per-copy state

    def __tf_tracing_type__(self, context: Any) -> Any:
        # `tf.function` replaces an argument that has `__wrapped__` (ours: the bridged
        # function) by the wrapped function, which would run the numpy function on symbolic
        # tensors, or drop the backward; declaring our own trace type keeps the bridge.
        return backend("tensorflow").OpTraceType(self)

    # -- forward ------------------------------------------------------------------------------

    def _call_numpy(self, values: tuple[Any, ...]) -> Any:
        """Call `fn` with one value per parameter slot (already numpy)."""
        positional: list[Any] = []
        keywords: dict[str, Any] = {}
        for param, value in zip(self._signature.parameters.values(), values, strict=True):
            if param.kind in _POSITIONAL:
                positional.append(value)
            elif param.kind is inspect.Parameter.VAR_POSITIONAL:
                positional.extend(value)
            elif param.kind is inspect.Parameter.KEYWORD_ONLY:
                if value is not param.default:
                    keywords[param.name] = value
            else:
                keywords.update(value)
        who = f"`{self._name}`, called by the estimator on perturbed inputs,"
        return _call_on_arrays(self._fn, self._signature, positional, keywords, who)

    def _make_forward(self) -> Callable[..., Any]:
        signature = self._signature
        defaults = {
            p.name: p.default
            for p in signature.parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }

        positional_defaults = [
            p.default for p in signature.parameters.values() if p.kind in _POSITIONAL
        ]

        def forward(*args: Any, **kwargs: Any) -> Any:
            # custom_backward passes every keyword-only default explicitly; some functions
            # (numpy ufuncs: `signature=None, dtype=None`) reject that, so leave them out.
            kwargs = {
                k: v for k, v in kwargs.items() if k not in defaults or v is not defaults[k]
            }
            # And trailing positional defaults (np.sin's `out=None`): `fn` and `outputs=`
            # get the arguments the caller gave.
            while args and len(args) <= len(positional_defaults) and (
                args[-1] is positional_defaults[len(args) - 1]
            ):
                args = args[:-1]
            return _through_operator(key, "forward", (args, kwargs))

        key = self._key  # (not `self`: dynamo can trace a string in a Function's forward)
        functools.update_wrapper(forward, self._fn)
        forward.__signature__ = signature  # type: ignore[attr-defined]
        return forward

    def outside_run(self, role: str, value: Any) -> Any:
        """The real computation of `role` on real tensors (see `gradoverride._outside`)."""
        if role == "forward":
            args, kwargs = value
            return self._forward_numpy(args, kwargs)
        grads, named = value
        return self._backward_numpy(grads, named)

    def outside_fake(self, role: str, value: Any) -> Any:
        """What `role` returns, in shapes and dtypes, without running it."""
        if role == "forward":
            args, kwargs = value
            return self._fake_forward(args, kwargs)
        _, named = value
        return self._per_input(named, named["needs_grad"], None, fill=torch.empty_like)

    def outside_describe(self, role: str) -> str:
        what = "function" if role == "forward" else "backward"
        return f"the {what} of the go.bridge of `{self._name}`"

    def outside_promise(self, role: str) -> str:
        if role == "forward":
            return "its `outputs=`"
        return "the inputs' shapes (a gradient per input, in its shape)"

    def _fake_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not callable(self.outputs):
            msg = (
                f"`{self._name}` is a go.bridge traced by torch.compile or torch.export, "
                "which need its outputs' shapes and dtypes without running it; pass "
                "`outputs=` to go.bridge, a function of the same arguments returning empty "
                "tensors of those shapes and dtypes, e.g. `outputs=lambda x: "
                "x.new_empty(x.shape[:-1])` (with `residuals=`: `(output, {name: tensor})`)."
                + ("" if self.outputs is None else
                   f" Got {type(self.outputs).__name__} {self.outputs!r}, which describes "
                   "TensorFlow outputs only.")
            )
            raise GradOverrideError(msg)
        return self.outputs(*args, **kwargs)

    def _forward_numpy(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`fn` on numpy views of the arguments, its outputs (and residuals) as tensors."""
        name = self._name
        device, dtype = _target((args, kwargs))
        arrays, named_arrays = _tree_to_numpy(args), _tree_to_numpy(kwargs)
        result = _call_on_arrays(self._fn, self._signature, arrays, named_arrays, f"`{name}`")
        residuals: dict[str, Any] | None = None
        if self.residuals:
            result, residuals = self._split_residuals(result)
        outs = []
        for k, out in enumerate(_outputs(result)):
            array = as_array(out, f"`{name}` (output {k})")
            if self.check_finite and array.dtype.kind == "f" and not np.isfinite(array).all():
                msg = (
                    f"`{name}` returned non-finite values in output {k} "
                    f"({_count_nonfinite(array)}). Check `{name}` at this input, or "
                    "pass `check_finite=False` to bridge if they are expected."
                )
                raise GradOverrideError(msg)
            outs.append(_to_tensor(array, device, dtype))
        output = tuple(outs) if type(result) is tuple else outs[0]
        if residuals is None:
            return output
        kept = {
            k: torch.as_tensor(as_array(v, f"`{name}` (residual `{k}`)"), device=device)
            for k, v in residuals.items()
        }
        return output, kept

    def _split_residuals(self, result: Any) -> tuple[Any, dict[str, Any]]:
        names = self.residuals
        if not (type(result) is tuple and len(result) == 2 and isinstance(result[1], dict)
                and set(result[1]) == set(names)):
            msg = (
                f"`{self._name}` is bridged with residuals={names!r}, so it must return "
                f"`(output, {{{', '.join(repr(n) + ': ...' for n in names)}}})`: its output "
                "and a dict of the values its backward rule reads; got "
                f"{type(result).__name__}."
            )
            raise GradOverrideError(msg)
        return result[0], {n: result[1][n] for n in names}

    # -- backward -----------------------------------------------------------------------------

    def _rule_signature(self, extra: Sequence[str]) -> inspect.Signature:
        params = [inspect.Parameter("grads", inspect.Parameter.VAR_POSITIONAL)]
        params += [
            inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in (*self._parameters,
                                                                             *extra)
        ]
        return inspect.Signature(params)

    def _make_rule(self, op: CustomBackward[..., Any]) -> Callable[..., Any]:
        """The op's rule: the user's rule or the estimator, run through the operator.

        It names every parameter (so every tensor input is saved: the backward runs
        outside PyTorch and returns one gradient per input, whose shape the operator must
        know before it runs), what the user's rule names beyond them (`output`, residuals),
        and `needs_grad`."""
        extra: tuple[str, ...] = ()
        if not isinstance(self.backward, Estimator):
            # The user's rule is checked here against the forward (unknown names, a missing
            # gradient parameter), with custom_backward's own messages.
            self._user_rule = RuleSpec(
                self.backward, op._signature, owns=None, residuals=self.residuals,
                once_differentiable=True, materialize_grads=True,
            )
            extra = tuple(
                n for n in self._user_rule.requested
                if n not in self._parameters and n != "needs_grad"
            )

        key = self._key

        def rule(*grads: Any, **named: Any) -> Any:
            return _through_operator(key, "backward", (grads, named))

        name = (
            type(self.backward).__name__ if isinstance(self.backward, Estimator)
            else describe(self.backward)
        )
        rule.__name__ = rule.__qualname__ = name
        rule.__signature__ = self._rule_signature((*extra, "needs_grad"))  # type: ignore[attr-defined]
        return rule

    def _backward_numpy(self, grads: tuple[Any, ...], named: dict[str, Any]) -> Any:
        """The rule or the estimator on numpy arrays: one gradient per input that needs one
        (zeros where the rule gives None), by parameter name."""
        needs = named["needs_grad"]
        if isinstance(self.backward, Estimator):
            result = self._estimate(self.backward, grads, named)
        else:
            spec = self._user_rule
            rule_name = spec.name
            if spec.n_grads is not None and spec.n_grads != len(grads):
                msg = (
                    f"the backward rule `{rule_name}` of `{self._name}` takes {spec.n_grads} "
                    f"upstream gradient(s) but `{self._name}` has {len(grads)} output(s); "
                    "give the rule one positional parameter per output."
                )
                raise GradOverrideTypeError(msg)
            device = next((g.device for g in grads if isinstance(g, Tensor)), None)
            wanted = {n: named[n] for n in spec.requested}
            arrays, named_arrays = _tree_to_numpy(grads), _tree_to_numpy(wanted)
            who = f"the backward rule `{rule_name}` of `{self._name}`"
            result = _call_on_arrays(spec.rule, None, arrays, named_arrays, who)
            result = self._convert_rule_result(result, device, rule_name)
        return self._per_input(named, needs, result, fill=torch.zeros_like)

    def _estimate(self, estimator: Estimator, grads: tuple[Any, ...], named: dict[str, Any]
                  ) -> dict[str, Any]:
        names = self._parameters
        values = tuple(named[n] for n in names)
        problem = _Problem(self, values, named["needs_grad"], grads, self.check_finite)
        estimates = estimator.vjp(problem)
        leaves: list[Any] = []
        for i, estimate in enumerate(estimates):
            original = problem.originals[i]
            if estimate is None or not isinstance(original, Tensor):
                leaves.append(None)
                continue
            self._check_gradient(estimate, problem.slot_of[i])
            leaves.append(torch.as_tensor(estimate, device=original.device).to(original.dtype))
        tree = pytree.tree_unflatten(leaves, problem.spec)
        return dict(zip(names, tree, strict=True))

    def _per_input(self, named: dict[str, Any], needs: dict[str, bool], result: Any,
                   fill: Callable[[Tensor], Tensor]) -> dict[str, Any]:
        """Per parameter, a gradient for each tensor leaf that needs one (the rule's, read
        as custom_backward reads it, or `fill` of the input), None elsewhere: the same
        structure whatever the rule returned, as the operator needs."""
        names = self._parameters
        values = tuple(named[n] for n in names)
        flat, layout = flatten_inputs(values)
        ranges = slot_ranges(layout, len(names))
        slot_of = [slot for slot, (start, stop, _) in enumerate(ranges)
                   for _ in range(start, stop)]
        meta: list[Any] = [
            (leaf.shape, leaf.dtype, leaf.device)
            if takes_gradient(leaf) and needs.get(names[slot_of[i]], False)
            else (SKIP if isinstance(leaf, Tensor) else None)
            for i, leaf in enumerate(flat)
        ]
        given: list[Any] = [None] * len(flat)
        if result is not None:
            given = flat_gradients(result, op=self._name, names=names,
                                   owned=(True,) * len(names), layout=layout, meta=meta)
        grads = [
            (fill(flat[i]) if given[i] is None else given[i]) if isinstance(m, tuple) else None
            for i, m in enumerate(meta)
        ]
        return {
            names[slot]: grads[start] if spec is None else pytree.tree_unflatten(
                grads[start:stop], spec)
            for slot, (start, stop, spec) in enumerate(ranges)
        }

    def _convert_rule_result(self, result: Any, device: torch.device | None, rule: str) -> Any:
        """Arrays in a rule's result become tensors on the bridge's device, checked finite.
        The result's form (one gradient, tuple, dict) is kept for custom_backward to read."""

        def label(path: tuple[Any, ...]) -> str:
            if not path:
                return "its gradient"
            key = getattr(path[0], "key", getattr(path[0], "idx", None))
            if isinstance(key, int) and key < len(self._parameters):
                key = self._parameters[key]
            return f"the gradient for `{key}`"

        def convert(path: tuple[Any, ...], leaf: Any) -> Any:
            if leaf is None:
                return None
            if isinstance(leaf, Tensor):
                array = None
                tensor = leaf
            else:
                array = as_array(leaf, f"the backward rule `{rule}` of `{self._name}`")
                tensor = torch.as_tensor(array, device=device)
            if self.check_finite and tensor.is_floating_point():
                finite = torch.isfinite(tensor).all()
                if not finite:
                    shown = array if array is not None else tensor.detach().cpu().numpy()
                    msg = (
                        f"the backward rule `{rule}` of `{self._name}` returned non-finite "
                        f"values in {label(path)} ({_count_nonfinite(shown)}). Fix the rule, "
                        "or pass `check_finite=False` to bridge if they are expected."
                    )
                    raise GradOverrideError(msg)
            return tensor

        if type(result) is tuple or isinstance(result, dict):
            flat, spec = pytree.tree_flatten_with_path(result)
            return pytree.tree_unflatten([convert(p, v) for p, v in flat], spec)
        return convert((), result)

    def _check_gradient(self, estimate: np.ndarray[Any, Any], slot: str) -> None:
        if self.check_finite and not np.isfinite(estimate).all():
            msg = (
                f"the {self.backward!r} estimate for `{slot}` of `{self._name}` is not finite "
                f"({_count_nonfinite(estimate)}). Use a larger `step`, or make `{self._name}` "
                "smooth near the input."
            )
            raise GradOverrideError(msg)

    # -- arguments a bridge refuses -----------------------------------------------------------

    def _refuse_keras_tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A GradOverrideError if an argument is a symbolic KerasTensor (a functional Keras
        model being built): `fn` cannot run on it, and the bridge is no Keras layer."""
        keras: Any = sys.modules["keras"]
        kind = getattr(keras, "KerasTensor", None)
        if kind is None:
            return

        def symbolic(value: Any) -> bool:
            return isinstance(value, kind)

        if not any(map(symbolic, pytree.tree_leaves((args, kwargs)))):
            return
        where = _naming(
            _holding(_bind(self._signature, args, kwargs), symbolic),
            "its argument {names} is", "its arguments {names} are", "an argument is",
        )
        msg = (
            f"`{self._name}` is a go.bridge, and {where} a symbolic KerasTensor (a "
            "functional Keras model is being built), which holds no values for its numpy "
            "function. Call the bridge inside a layer's `call` (a `keras.layers.Layer` "
            "subclass, or `keras.layers.Lambda`), and pass `outputs=` to go.bridge with "
            "each output's shape and dtype (e.g. `outputs=tf.TensorSpec([None, 3], "
            "tf.float32)`), so that Keras can infer the layer's output without running it."
        )
        raise GradOverrideError(msg)

    # -- calling ------------------------------------------------------------------------------

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        return self._run(*args, **kwargs)

    def __repr__(self) -> str:
        backward = self.backward
        shown = backward if isinstance(backward, Estimator) else describe(backward)
        return f"<bridge {self._name}{self._signature}, backward={shown}>"


@overload
def bridge(
    fn: Callable[P, Any],
    /,
    *,
    backward: Callable[..., Any] | Estimator | str,
    check_finite: bool = ...,
    outputs: Any = ...,
    residuals: str | Sequence[str] | None = ...,
) -> Bridge[P]: ...


@overload
def bridge(
    fn: None = None,
    /,
    *,
    backward: Callable[..., Any] | Estimator | str,
    check_finite: bool = ...,
    outputs: Any = ...,
    residuals: str | Sequence[str] | None = ...,
) -> Callable[[Callable[P, Any]], Bridge[P]]: ...


@autograph_artifact
def bridge(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    backward: Callable[..., Any] | Estimator | str,
    check_finite: bool = True,
    outputs: Any = None,
    residuals: str | Sequence[str] | None = None,
) -> Any:
    """Run a function outside PyTorch (numpy, scipy, a simulator) in a differentiable graph.

    ```python
    import numpy as np
    import torch
    import gradoverride as go

    def energy(x, k=2.0):  # numpy in, numpy out
        return np.sum(np.cos(k * x) * x**2)

    op = go.bridge(energy, backward="finite_differences")
    params = torch.tensor([0.5, 1.0], dtype=torch.float64, requires_grad=True)
    loss = op(params, k=3.0)  # a tensor on params' device and dtype
    loss.backward()
    print(loss.dtype, [round(g, 4) for g in params.grad.tolist()])
    #> torch.float64 [-0.6774, -2.4033]

    @go.bridge(backward=lambda grad, *, x: grad * np.cos(x))  # a numpy rule
    def sine(x):
        return np.sin(x)

    x = torch.zeros(2, requires_grad=True)
    sine(x).sum().backward()
    print(x.grad)
    #> tensor([1., 1.])
    ```

    Forward: tensor arguments (also inside tuples, lists and dicts) are passed to `fn` as
    read-only numpy arrays (bfloat16 as float32); other arguments are passed through. The
    arrays are views of the caller's CPU tensors, not copies, and read-only so that `fn`
    cannot change them: `fn` (or a rule) writing into one raises a `GradOverrideError`
    naming the argument; copy it first (``x = x.copy()``) to change it. `fn`
    returns an array-like (an array, a number, a list, a CPU tensor) or a tuple of them for
    several outputs. Each output comes back as a tensor on the device of the first tensor
    argument; floating outputs take the promoted dtype of the floating tensor arguments,
    integer and bool outputs keep their type (and get no gradient).

    Backward, by `backward=`:

    * a rule, with the `custom_backward` contract (positional parameters receive the
      upstream gradients, keyword-only ones name the inputs it needs, `output`,
      `needs_grad`), given numpy arrays and returning numpy arrays (or tensors): one
      gradient, a tuple aligned with the parameters, or a dict by name;
    * ``"finite_differences"`` or ``go.finite_differences(step=..., vectorized=...)``;
    * ``"spsa"`` or ``go.spsa(samples=..., seed=...)``, for large inputs.

    A gradient of the wrong shape is an error naming the input and both shapes; the
    estimated or returned gradients, and the outputs, must be finite unless
    ``check_finite=False``. The backward is once-differentiable.

    Compiling, exporting, transforming: a call is one operator, `gradoverride::outside`,
    which `torch.compile` (also ``fullgraph=True``), `torch.export` and `torch.func`
    (`grad`, `jacrev`, `vmap`) treat as opaque: its kernel runs `fn` (or the rule) on real
    tensors, and `outputs=` tells the compiler and the exporter what comes out. Without
    `outputs=`, a compiled call is a graph break (the code around it is compiled), and
    ``fullgraph=True`` fails with a message saying to pass it. Under `vmap` (and `jacrev`,
    a `vmap` of the backward), `fn` or the rule is called once per batch entry. An
    exported program calls the bridge by name: load it in a process that has made the
    same bridge (import the module defining it). An argument that is neither a tensor nor
    a Python literal (a numpy array, an object) runs eagerly only: under a compiler or a
    transform it is a `GradOverrideError` naming it.

    The backward keeps every tensor input (it returns one gradient per input, in the
    input's shape, known before it runs), and a rule's None for an input that needs a
    gradient is a zero gradient. With `residuals=`, `fn` returns ``(output, {name:
    value})``: callers get the output, and the rule names the values, which are kept
    rather than computed again (a solver runs once).

    TensorFlow: the same bridge takes TensorFlow tensors, eagerly and inside a
    `tf.function` (through `tf.numpy_function`; give `outputs=` there when `fn` returns
    something other than one array of the inputs' dtype), with the same rule or estimator.
    The backward calls `fn` once more on the same inputs (TensorFlow keeps no Python state
    between forward and backward). It works under `tf.vectorized_map` (`fn` then runs once
    per example) and `tape.jacobian`; its gradient cannot be differentiated again (a
    `GradOverrideError`, as on torch). Under XLA (`jit_compile=True`) a bridge is a
    `GradOverrideError`: XLA cannot compile a call into Python; so is saving it in a
    SavedModel (`model.export`, `tf.saved_model.save`), which cannot hold Python code. In a
    functional Keras model, call it from a layer and give `outputs=` with the shapes.

    Args:
        fn: the function, called on numpy arrays.
        backward: a rule, an estimator name, or an estimator object.
        check_finite: raise `GradOverrideError` on non-finite outputs and gradients
            (default True).
        outputs: what `fn` returns, for code that is traced before `fn` runs. On torch
            tensors (for `torch.compile` and `torch.export`), a function of the same
            arguments returning empty tensors of the outputs' shapes and dtypes, e.g.
            ``lambda x: torch.empty_like(x)``, with the residuals as ``(output, {name:
            tensor})``; it runs on fake tensors, and gets a number argument (a float, an
            int) as a 0-d tensor. On TensorFlow tensors inside a
            `tf.function`, a `tf.TensorSpec`, a dtype, or a tuple of them, one per output.
            Default: none; eagerly none is needed (on TensorFlow: one output in the floating
            arguments' promoted dtype). In a layer of a functional Keras model, give the
            shapes too (None for the batch axis): Keras infers the layer's output from them.
        residuals: names of values `fn` computes for the rule, which `fn` then returns as
            ``(output, {name: value})``; the rule names them as keyword-only parameters.

    Returns:
        A `Bridge`, callable like `fn` on tensors; usable as a decorator with options.
    """

    def make(f: Callable[P, Any]) -> Bridge[P]:
        return Bridge(f, backward, check_finite=check_finite, outputs=outputs,
                      residuals=residuals)

    if fn is None:
        return autograph_artifact(make)
    return make(fn)
