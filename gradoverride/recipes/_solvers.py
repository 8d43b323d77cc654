"""Gradients through black-box combinatorial solvers: shortest paths, rankings, matchings,
assignments, any `solver(w) -> y` whose output jumps between discrete solutions.

Two recipes, each taking any solver callable (torch or numpy) and batching:

* `blackbox_solver`: the interpolation gradient of Vlastelica et al., "Differentiation of
  Blackbox Combinatorial Solvers" (ICLR 2020). Forward: the solver's exact solution. Backward:
  one more solver call, at costs shifted by the upstream gradient.
* `perturbed_optimizer`: the perturbed optimizer of Berthet et al., "Learning with
  Differentiable Perturbed Optimizers" (NeurIPS 2020). Forward: the mean solution over
  randomly perturbed inputs (a smooth function of the input). Backward: a Monte-Carlo
  estimate of its Jacobian from the same samples, with no further solver call.

The solver is called on one problem instance at a time (the trailing `instance_dims`
dimensions of the input; leading dimensions are a batch), or with `batched=True` on a stack
of instances at once. With `numpy=True` it gets numpy arrays instead of tensors. Its result
(a tensor, a numpy array, or anything array-like) is converted to the input's dtype and
device.

A numpy solver (`numpy=True`) is arbitrary Python (loops, heaps, a C library), which
`torch.compile` cannot trace: it runs inside one opaque operator, so a compiled model
(`fullgraph=True` too) or an exported program holds the call as one node, and `torch.func`
transforms work (under `vmap` the solver is called once per batch entry). Traced so, the
solver must return one solution of its instance's shape per instance (what the compiler is
told); another shape is an error naming the solver. A solver written in torch ops
(`numpy=False`) is traced like any torch code. `perturbed_optimizer` with `seed=` or
`generator=` makes a generator, which a compiled function cannot: pass `noise=` there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from .. import _outside as outside
from .._bridge import as_array, to_numpy
from .._decorators import custom_backward
from .._errors import GradOverrideError, GradOverrideTypeError
from .._frameworks import is_tensorflow
from .._internals import is_tracing
from .._signature import describe
from ._base import Recipe, finite, tensorflow_call

__all__ = ["blackbox_solver", "perturbed_optimizer"]

Solver = Callable[[Any], Any]

class _SolverRecipe(Recipe):
    """Calling a user's solver on each instance (or on the stack) and converting back.

    A numpy solver runs inside one opaque operator (`gradoverride/_outside.py`), so that
    torch.compile and torch.export trace the call as one node, whose solutions they take
    to have the instances' shape, and torch.func transforms reach it with real tensors (a
    vmap calls it per batch entry). A solver in torch ops is called as it is (traced like
    any torch code)."""

    solver: Solver
    instance_dims: int
    batched: bool
    numpy: bool
    _key: str  # (not a field: set by `_register`)

    def _register(self) -> None:
        """A key naming this recipe to the operator (again for a copy or an unpickled one)."""
        name = f"{type(self).__name__}({describe(self.solver)})"
        object.__setattr__(self, "_key", outside.register(self, name))

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._register()

    def outside_run(self, role: str, value: Any) -> Tensor:
        (flat,) = value
        return self._solve_flat(flat)

    def outside_fake(self, role: str, value: Any) -> Tensor:
        (flat,) = value
        return torch.empty_like(flat)

    def outside_describe(self, role: str) -> str:
        return f"the solver `{describe(self.solver)}` of {self!r}"

    def outside_promise(self, role: str) -> str:
        return (
            "the instances' shape (traced by torch.compile or torch.export, a numpy solver "
            "is taken to return one solution of its instance's shape per instance)"
        )

    def _check_common(self) -> None:
        name = type(self).__name__
        if not callable(self.solver):
            msg = (
                f"{name} needs a solver callable (`solver(w) -> solution`), got "
                f"{type(self.solver).__name__} {self.solver!r}."
            )
            raise GradOverrideTypeError(msg)
        if not (isinstance(self.instance_dims, int) and self.instance_dims >= 1):
            msg = (
                f"{name} needs `instance_dims` to be an int >= 1 (the trailing dimensions of "
                f"one problem instance: 1 for a vector of scores, 2 for a grid of costs), got "
                f"{self.instance_dims!r}."
            )
            raise GradOverrideError(msg)

    def _split(self, w: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The batch shape and the instance shape of `w`."""
        if w.ndim < self.instance_dims:
            msg = (
                f"{self!r} got an input of shape {tuple(w.shape)}, which has fewer than "
                f"instance_dims={self.instance_dims} dimensions; pass one instance of "
                f"{self.instance_dims} dimensions or a batch of them."
            )
            raise GradOverrideError(msg)
        cut = w.ndim - self.instance_dims
        return tuple(w.shape[:cut]), tuple(w.shape[cut:])

    def _solve(self, w: Tensor) -> Tensor:
        """The solver's solutions for every instance in `w`, stacked, in `w`'s dtype/device.

        Returns a tensor of shape ``(*batch, *solution)``.
        """
        batch, instance = self._split(w)
        flat = w.detach().reshape(-1, *instance)
        if self.numpy:
            solutions: Tensor = outside.call(self._key, "solve", (flat,))
        else:
            solutions = self._solve_flat(flat)
        return solutions.reshape(*batch, *solutions.shape[1:])

    def _solve_flat(self, flat: Tensor) -> Tensor:
        """The solutions of the instances stacked in `flat`, in its dtype and device."""
        n = flat.shape[0]
        inputs: Any = to_numpy(flat) if self.numpy else flat
        name = describe(self.solver)

        def convert(value: Any, what: str) -> Tensor:
            if isinstance(value, Tensor):
                return value.detach().to(device=flat.device, dtype=flat.dtype)
            array = as_array(value, f"the solver `{name}` ({what})")
            return torch.tensor(array, device=flat.device, dtype=flat.dtype)  # a copy

        if self.batched:
            solutions = convert(self.solver(inputs), f"on a batch of {n}")
            if solutions.ndim == 0 or solutions.shape[0] != n:
                msg = (
                    f"the solver `{name}` of {self!r} was called with batched=True on a stack "
                    f"of {n} instances and returned shape {tuple(solutions.shape)}; it must "
                    f"return one solution per instance, stacked along the first axis."
                )
                raise GradOverrideError(msg)
            return solutions
        if n == 0:
            msg = (
                f"{self!r} got an empty batch (input shape {tuple(flat.shape)}); with "
                "batched=False the solution shape is unknown without a solver call."
            )
            raise GradOverrideError(msg)
        return torch.stack(
            [convert(self.solver(inputs[i]), f"instance {i}") for i in range(n)]
        )

    def _solver_repr(self) -> str:
        return describe(self.solver)


# ---- Vlastelica et al. ----------------------------------------------------------------------


@custom_backward
def _interpolated(w: Tensor, recipe: blackbox_solver) -> Tensor:
    return recipe._solve_same_shape(w)


@_interpolated.backward(once_differentiable=True)
def _(grad: Tensor, *, w: Tensor, recipe: blackbox_solver, output: Tensor) -> Tensor:
    sign = -1.0 if recipe.maximize else 1.0
    perturbed = w + sign * recipe.lambda_ * grad
    if recipe.min_cost is not None:  # (a shortest path needs non-negative costs)
        perturbed = perturbed.clamp(min=recipe.min_cost)
    shifted = recipe._solve_same_shape(perturbed)
    return sign * (shifted - output) / recipe.lambda_


@dataclass(frozen=True, repr=False)
class blackbox_solver(_SolverRecipe):
    """The interpolation gradient of Vlastelica et al. (ICLR 2020) through a black-box solver.

    The solver minimises a linear objective, ``y(w) = argmin_{y in Y} <w, y>``. Forward:
    ``y = solver(w)``, exactly. Backward, for the upstream gradient ``g = dL/dy``:

    ```text
    w' = w + lambda_ * g
    grad_w = -(y(w) - y(w')) / lambda_
    ```

    the gradient of a piecewise-linear interpolation of ``L(y(w))`` (the paper's
    Algorithm 1). `lambda_` trades the interpolation's faithfulness (small) against how far
    it sees (large); tune it to the scale of the costs. With
    ``maximize=True`` the solver maximises ``<w, y>`` and the formula is applied to ``-w``:
    ``w' = w - lambda_ * g`` and ``grad_w = (y(w) - y(w')) / lambda_``.

    ```python
    import numpy as np
    import torch
    from gradoverride.recipes import blackbox_solver

    def cheapest(w):  # argmin over one-hot choices: the solver, in numpy
        y = np.zeros_like(w)
        y[np.argmin(w)] = 1.0
        return y

    choose = blackbox_solver(cheapest, lambda_=2.0, numpy=True)
    costs = torch.tensor([1.0, 0.5, 2.0], requires_grad=True)
    choice = choose(costs)
    target = torch.tensor([1.0, 0.0, 0.0])
    (choice - target).abs().sum().backward()  # Hamming loss, as in the paper
    print(choice.tolist(), costs.grad.tolist())  # raise the chosen cost, lower the wanted one
    #> [0.0, 1.0, 0.0] [0.5, -0.5, 0.0]
    ```

    Args:
        solver: the solver: one instance (or, with `batched`, a stack) in, the solution in the
            same shape out (an indicator vector or mask, a rank vector, ...).
        lambda_: the interpolation strength, > 0.
        instance_dims: the trailing dimensions of one instance (default 1).
        batched: the solver takes a stack of instances (first axis) and returns a stack.
        numpy: call the solver with numpy arrays instead of tensors.
        maximize: the solver maximises ``<w, y>`` instead of minimising it.
        min_cost: clamp the perturbed costs ``w'`` from below at this value before the
            solver sees them (default None: no clamp). A shortest-path solver needs
            non-negative weights: `min_cost=0.0` is what the paper's code does there
            (``maximum(w + lambda * g, 0)``).

    Returns (when called): the solutions, shape of the input, in its dtype and device.
    """

    solver: Solver
    lambda_: float
    instance_dims: int = 1
    batched: bool = False
    numpy: bool = False
    maximize: bool = False
    min_cost: float | None = None

    def __post_init__(self) -> None:
        self._check_common()
        self._register()
        if not (
            isinstance(self.lambda_, int | float)
            and not isinstance(self.lambda_, bool)
            and self.lambda_ > 0
        ):
            msg = (
                f"blackbox_solver needs `lambda_` to be a number > 0 (the interpolation "
                f"strength of Vlastelica et al.), got {self.lambda_!r}."
            )
            raise GradOverrideError(msg)
        if self.min_cost is not None and not (
            isinstance(self.min_cost, int | float) and not isinstance(self.min_cost, bool)
            and finite(float(self.min_cost))
        ):
            msg = (
                f"blackbox_solver needs `min_cost` to be a finite number (the least perturbed "
                f"cost the solver sees, 0.0 for a shortest path) or None; got "
                f"{self.min_cost!r}."
            )
            raise GradOverrideError(msg)

    def _solve_same_shape(self, w: Tensor) -> Tensor:
        y = self._solve(w)
        # (Not while torch.jit.trace records: its sizes are tensors, and comparing them
        # warns; an eager call checks it.)
        if not is_tracing() and y.shape != w.shape:
            _, instance = self._split(w)
            msg = (
                f"the solver `{self._solver_repr()}` of {self!r} returned solutions of shape "
                f"{tuple(y.shape[len(w.shape) - self.instance_dims:])} for instances of shape "
                f"{instance}; the interpolation gradient needs a solution y in the space of "
                "the costs w (the objective is <w, y>), so of the same shape."
            )
            raise GradOverrideError(msg)
        return y

    def __call__(self, w: Tensor, /) -> Tensor:
        if not isinstance(w, Tensor) and is_tensorflow(w):
            return tensorflow_call(self, w)
        return _interpolated(w, self)

    def __repr__(self) -> str:
        return (
            f"blackbox_solver({self._solver_repr()}, lambda_={self.lambda_!r}, "
            f"instance_dims={self.instance_dims!r}, batched={self.batched!r}, "
            f"numpy={self.numpy!r}, maximize={self.maximize!r}"
            + ("" if self.min_cost is None else f", min_cost={self.min_cost!r}") + ")"
        )


# ---- Berthet et al. -------------------------------------------------------------------------

_NOISES = ("normal", "gumbel")
_JACOBIANS = ("full", "diagonal")
_LAYOUTS = ("samples_first", "batch_first")


@custom_backward(residuals=("solutions", "score"))
def _perturbed(theta: Tensor, recipe: perturbed_optimizer, given: Tensor | None) -> Any:
    noise, score = recipe._noise(theta) if given is None else recipe._score(theta, given)
    solutions = recipe._solve(theta.detach().unsqueeze(0) + recipe.sigma * noise)
    if recipe.jacobian == "diagonal":
        recipe._check_diagonal(theta, solutions)
    return solutions.mean(0), {"solutions": solutions, "score": score}


@_perturbed.backward(once_differentiable=True)
def _(
    grad: Tensor, *, theta: Tensor, recipe: perturbed_optimizer, solutions: Tensor,
    score: Tensor,
) -> Any:
    batch_dims = theta.ndim - recipe.instance_dims
    if recipe.jacobian == "diagonal":
        # Solutions (samples, *batch, *lead, *instance) seen as (n, b, k, d), and the same
        # einsums, in the same order, as Differentiable Patch Selection's reference, so that
        # the gradients round as its do (bit for bit on CPU).
        samples = solutions.shape[0]
        cut = 1 + batch_dims
        b = math.prod(solutions.shape[1:cut])
        d = math.prod(score.shape[cut:])
        k = math.prod(solutions.shape[cut:solutions.ndim - recipe.instance_dims])
        expected = torch.einsum(
            "nbkd,nbd->bkd", solutions.reshape(samples, b, k, d), score.reshape(samples, b, d)
        ) / samples / recipe.sigma
        diagonal = torch.einsum("bkd,bkd->bd", grad.reshape(b, k, d), expected)
        return diagonal.reshape(theta.shape), None, None
    # (samples, *batch): <y(theta + sigma Z_n), g> per sample and instance.
    out_dims = tuple(range(1 + batch_dims, solutions.ndim))
    projection = solutions * grad.unsqueeze(0)
    if out_dims:  # (`sum(dim=())` would sum everything)
        projection = projection.sum(dim=out_dims)
    projection = projection.reshape(*projection.shape, *([1] * recipe.instance_dims))
    return (projection * score).mean(0) / recipe.sigma, None, None


@dataclass(frozen=True, repr=False)
class perturbed_optimizer(_SolverRecipe):
    """A solver made smooth by random perturbations of its input (Berthet et al., 2020).

    The perturbed optimizer of "Learning with Differentiable Perturbed Optimizers" (NeurIPS
    2020): the solutions are averaged over random perturbations of the input.

    Forward, with ``Z_1..Z_M`` drawn from the noise (M = `samples`):

    ```text
    y_sigma(theta) = mean_m  solver(theta + sigma * Z_m)
    ```

    Backward, from the same samples (no further solver call), for the upstream ``g``:

    ```text
    grad_theta = mean_m  <solver(theta + sigma Z_m), g> * grad_nu(Z_m) / sigma
    ```

    where ``grad_nu`` is the gradient of the noise's negative log-density: ``Z`` for
    ``noise="normal"``, ``1 - exp(-Z)`` for ``noise="gumbel"`` (paper, section 3). This is
    an unbiased estimate of the Jacobian of the expectation, for any solver; for an argmax
    solver with Gumbel noise, ``y_sigma`` is ``softmax(theta / sigma)``. Defaults match the
    reference implementation (google-research/perturbations): ``sigma=0.05``,
    ``samples=1000``, normal noise. The solver's output may have any shape per instance (a
    solution, or the optimal value).

    ``jacobian="diagonal"`` keeps only the diagonal of that estimate, as the perturbed top-k
    of Differentiable Patch Selection (Cordonnier et al., CVPR 2021) does: each input entry
    ``e`` gets only the terms of the solution entries at the same place,

    ```text
    grad_theta[e] = sum_k mean_m  y_m[k, e] * g[k, e] * grad_nu(Z_m)[e] / sigma
    ```

    It needs each solution to end in the instance's shape, ``(*lead, *instance)``, its
    trailing axes aligned with the input's; any leading solution axes (top-k's ``k`` one-hot
    rows, shape ``(k, d)`` for scores of shape ``(d,)``) are summed. A solver whose output
    does not end in the instance's shape is refused, at the forward call.

    Given noise: ``recipe(theta, noise=Z)`` perturbs with the draws ``Z`` instead of drawing
    them: standard normal (or standard Gumbel, for ``noise="gumbel"``) values, not multiplied
    by `sigma`, in the input's dtype and on its device. The number of samples is then ``Z``'s,
    and the recipe must have no `seed` or `generator`. ``noise_layout`` says where ``Z``
    holds its samples: ``"samples_first"`` (default), shape ``(samples, *batch, *instance)``,
    the recipe's own; or ``"batch_first"``, shape ``(*batch, samples, *instance)``, the layout
    of Differentiable Patch Selection's reference (``(b, n, d)``). For one unbatched instance
    the two agree. Given noise is a constant: it gets no gradient.

    ```python
    import torch
    import torch.nn.functional as F
    from gradoverride.recipes import perturbed_optimizer

    def argmax(theta):  # one-hot of the largest score, in torch ops
        return F.one_hot(theta.argmax(-1), theta.shape[-1]).to(theta.dtype)

    soft_argmax = perturbed_optimizer(argmax, sigma=0.5, samples=2000, seed=0)
    scores = torch.tensor([1.0, 1.2, 0.0], requires_grad=True)
    y = soft_argmax(scores)  # the mean of the perturbed solutions
    y[1].backward()
    print([round(v, 2) for v in y.tolist()], scores.grad[1].item() > 0)
    #> [0.39, 0.6, 0.02] True
    ```

    Args:
        solver: the solver: one instance (or, with `batched`, a stack) in, a solution out.
        sigma: the noise scale, > 0.
        samples: the number of perturbations M (default 1000).
        noise: ``"normal"`` (default) or ``"gumbel"``.
        seed: a seed for the noise; each call then draws the same perturbations.
        generator: a `torch.Generator` to draw from instead (its state advances).
            With neither, torch's global RNG is used.
        instance_dims: the trailing dimensions of one instance (default 1).
        batched: the solver takes a stack of instances (first axis) and returns a stack; it
            then gets all ``samples * batch`` perturbed instances in one call.
        numpy: call the solver with numpy arrays instead of tensors.
        jacobian: ``"full"`` (default), the estimate above (Berthet et al.); or
            ``"diagonal"``, its diagonal (Differentiable Patch Selection's perturbed top-k).

    Call: ``recipe(theta)``, or ``recipe(theta, noise=Z, noise_layout="samples_first")``
    with given draws (see above).

    Returns (when called): the mean solution, shape ``(*batch, *solution)``, in the input's
    dtype and device. It keeps ``samples`` solutions and noise gradients for backward.
    """

    solver: Solver
    sigma: float = 0.05
    samples: int = 1000
    noise: Literal["normal", "gumbel"] = "normal"
    seed: int | None = None
    generator: torch.Generator | None = None
    instance_dims: int = 1
    batched: bool = False
    numpy: bool = False
    jacobian: Literal["full", "diagonal"] = "full"

    def __post_init__(self) -> None:
        self._check_common()
        self._register()
        if self.jacobian not in _JACOBIANS:
            msg = (
                f"perturbed_optimizer got jacobian={self.jacobian!r}; pass 'full' (the whole "
                "Monte-Carlo estimate of Berthet et al.) or 'diagonal' (only its diagonal, as "
                "Differentiable Patch Selection's perturbed top-k)."
            )
            raise GradOverrideError(msg)
        if not (isinstance(self.sigma, int | float) and self.sigma > 0):
            msg = f"perturbed_optimizer needs `sigma` to be a number > 0, got {self.sigma!r}."
            raise GradOverrideError(msg)
        if not (
            isinstance(self.samples, int)
            and not isinstance(self.samples, bool)
            and self.samples > 0
        ):
            msg = (
                f"perturbed_optimizer needs `samples` to be a positive int, got "
                f"{self.samples!r}."
            )
            raise GradOverrideError(msg)
        if self.noise not in _NOISES:
            msg = (
                f"perturbed_optimizer got noise={self.noise!r}; the noises are "
                f"{', '.join(repr(n) for n in _NOISES)}."
            )
            raise GradOverrideError(msg)
        if self.seed is not None and self.generator is not None:
            msg = (
                "perturbed_optimizer takes a `seed` or a `generator`, not both: a seed draws "
                "the same perturbations at every call; a generator continues its stream."
            )
            raise GradOverrideError(msg)

    def _noise(self, theta: Tensor) -> tuple[Tensor, Tensor]:
        """Noise ``Z`` of shape ``(samples, *theta.shape)`` and ``grad_nu(Z)``, drawn on the
        generator's device (CPU for a seed or the global RNG) in float64 for a float64 input,
        else float32, then moved to `theta`'s device and dtype."""
        generator = self.generator
        if self.seed is not None:
            generator = torch.Generator().manual_seed(self.seed)
        device = generator.device if generator is not None else torch.device("cpu")
        kind = torch.float64 if theta.dtype == torch.float64 else torch.float32
        shape = (self.samples, *theta.shape)
        # (`generator=` only when there is one: a compiled graph with symbolic sizes cannot
        # take `generator=None` in `randn`.)
        if self.noise == "normal":
            noise = (
                torch.randn(shape, device=device, dtype=kind) if generator is None
                else torch.randn(shape, generator=generator, device=device, dtype=kind)
            )
            score = noise
        else:
            # -log(E) with E ~ Exp(1) is a standard Gumbel variable.
            exponential = torch.empty(shape, device=device, dtype=kind)
            if generator is None:
                exponential.exponential_()
            else:
                exponential.exponential_(generator=generator)
            noise = -torch.log(exponential)
            score = 1.0 - exponential  # 1 - exp(-Z)
        return (
            noise.to(device=theta.device, dtype=theta.dtype),
            score.to(device=theta.device, dtype=theta.dtype),
        )

    def _score(self, theta: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
        """Given draws ``Z`` (samples first, in `theta`'s dtype and device) and
        ``grad_nu(Z)``, computed as for drawn noise: in float64 for a float64 input, else
        float32."""
        if self.noise == "normal":
            return noise, noise
        kind = torch.float64 if theta.dtype == torch.float64 else torch.float32
        score = -torch.expm1(-noise.to(kind))  # 1 - exp(-Z)
        return noise, score.to(theta.dtype)

    def _check_diagonal(self, theta: Tensor, solutions: Tensor) -> None:
        """Refuse solutions that do not end in the instance's shape (jacobian="diagonal")."""
        batch, instance = self._split(theta)
        solution = tuple(solutions.shape[1 + len(batch):])
        if len(solution) < len(instance) or solution[len(solution) - len(instance):] != instance:
            msg = (
                f"{self!r}: jacobian='diagonal' pairs each input entry with the solution "
                f"entries at the same place, so each solution must end in the instance's "
                f"shape {instance} (any leading axes, such as top-k's k, are summed); the "
                f"solver `{self._solver_repr()}` returned solutions of shape {solution} for "
                f"instances of shape {instance}. Return solutions shaped (..., "
                f"{', '.join(map(str, instance))}) (top-k as k one-hot rows), or use "
                "jacobian='full'."
            )
            raise GradOverrideError(msg)

    def _given(self, theta: Tensor, noise: object, layout: object) -> Tensor:
        """The draws given at the call, checked, samples first and detached."""
        if self.seed is not None or self.generator is not None:
            what = "seed=" if self.seed is not None else "generator="
            msg = (
                f"{self!r} got `noise=` but draws its own noise (`{what}`); pass one: make "
                "the recipe without `seed` and `generator` to give the draws at the call, "
                "or drop `noise=` to draw them."
            )
            raise GradOverrideError(msg)
        if layout not in _LAYOUTS:
            msg = (
                f"{self!r} got noise_layout={layout!r}; pass 'samples_first' (noise shaped "
                "(samples, *batch, *instance)) or 'batch_first' ((*batch, samples, "
                "*instance), as Differentiable Patch Selection's reference)."
            )
            raise GradOverrideError(msg)
        if not isinstance(noise, Tensor) or not noise.is_floating_point():
            got = f"a {noise.dtype} tensor" if isinstance(noise, Tensor) else (
                f"{type(noise).__name__} {noise!r}"
            )
            msg = (
                f"{self!r}: `noise` must be a floating-point tensor of {self.noise} draws "
                f"(not multiplied by sigma); got {got}."
            )
            raise GradOverrideTypeError(msg)
        batch, instance = self._split(theta)
        if layout == "samples_first":
            pattern, expected = "(samples, *batch, *instance)", ("samples", *batch, *instance)
            fits = noise.ndim == theta.ndim + 1 and tuple(noise.shape[1:]) == theta.shape
            other = noise.ndim == theta.ndim + 1 and (
                tuple(noise.shape[: len(batch)]) == batch
                and tuple(noise.shape[len(batch) + 1:]) == instance
            )
        else:
            pattern, expected = "(*batch, samples, *instance)", (*batch, "samples", *instance)
            fits = noise.ndim == theta.ndim + 1 and (
                tuple(noise.shape[: len(batch)]) == batch
                and tuple(noise.shape[len(batch) + 1:]) == instance
            )
            other = noise.ndim == theta.ndim + 1 and tuple(noise.shape[1:]) == theta.shape
        if not fits:
            hint = (
                f" It fits the other layout: pass noise_layout="
                f"{'batch_first' if layout == 'samples_first' else 'samples_first'!r}."
                if other else ""
            )
            shape = "(" + ", ".join(map(str, expected)) + ")"
            msg = (
                f"{self!r}: with noise_layout={layout!r}, `noise` must be shaped {pattern} = "
                f"{shape} for an input of shape {tuple(theta.shape)} (instance_dims="
                f"{self.instance_dims}); got {tuple(noise.shape)}.{hint}"
            )
            raise GradOverrideError(msg)
        if noise.dtype != theta.dtype or noise.device != theta.device:
            msg = (
                f"{self!r}: `noise` must have the input's dtype and device, {theta.dtype} on "
                f"{theta.device}; got {noise.dtype} on {noise.device}. Convert it with "
                "`noise.to(theta)`."
            )
            raise GradOverrideError(msg)
        samples_axis = 0 if layout == "samples_first" else len(batch)
        if noise.shape[samples_axis] == 0:
            msg = (
                f"{self!r} got `noise` with no samples (shape {tuple(noise.shape)}); give at "
                "least one draw."
            )
            raise GradOverrideError(msg)
        return noise.detach().movedim(samples_axis, 0)

    def __call__(
        self,
        theta: Tensor,
        /,
        *,
        noise: Tensor | None = None,
        noise_layout: Literal["samples_first", "batch_first"] = "samples_first",
    ) -> Tensor:
        if not isinstance(theta, Tensor) and is_tensorflow(theta):
            return tensorflow_call(self, theta, noise=noise, noise_layout=noise_layout)
        given: Tensor | None = None
        if noise is not None:
            given = self._given(theta, noise, noise_layout)
        elif noise_layout != "samples_first":
            msg = (
                f"{self!r} got noise_layout={noise_layout!r} without `noise=`; the layout "
                "describes given draws: pass them as `noise=`, or drop `noise_layout`."
            )
            raise GradOverrideError(msg)
        out: Tensor = _perturbed(theta, self, given)
        return out

    def __repr__(self) -> str:
        generator = "" if self.generator is None else ", generator=<torch.Generator>"
        jacobian = "" if self.jacobian == "full" else f", jacobian={self.jacobian!r}"
        return (
            f"perturbed_optimizer({self._solver_repr()}, sigma={self.sigma!r}, "
            f"samples={self.samples!r}, noise={self.noise!r}, seed={self.seed!r}"
            f"{generator}, instance_dims={self.instance_dims!r}, batched={self.batched!r}, "
            f"numpy={self.numpy!r}{jacobian})"
        )

