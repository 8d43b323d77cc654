"""`assert_consistent`: the same outputs and gradients in eager mode, compiled and vmapped."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .._errors import GradOverrideError
from ._compare import compare, describe_dtype, format_index, tolerances
from ._inputs import Call, function_name
from ._vjp import Outputs, backward, forward, upstream

__all__ = ["MODES", "assert_consistent"]

#: The modes `assert_consistent` knows; eager mode is the baseline the others must match.
MODES: tuple[str, ...] = ("eager", "compile", "vmap")

# torch's own warnings met while compiling, not the checked function's: dynamo instantiates
# `torch.autograd.Function()` for the ctx of a Function it reaches without a source, inside a
# `warnings.catch_warnings(record=True)` that keeps the caller's filters, so a test suite that
# turns warnings into errors fails on torch's deliberately silenced DeprecationWarning; and
# inductor's first compile imports code that calls the deprecated `torch.jit.script_method`.
_TORCH_COMPILE_WARNINGS = (
    r".*should not be instantiated",
    r"`torch\.jit\.script_method` is deprecated",
)

_COMPILE_HINT = (
    "A rule that reads Python state which changes between calls (dynamo bakes it in as a "
    "constant), or a backward that compilation drops, gives this; if the difference is "
    "rounding (inductor fuses and reorders ops), loosen `atol=`/`rtol=`."
)
_VMAP_HINT = (
    "A rule that reads or writes state outside its arguments (a global, a captured tensor it "
    "modifies), or a hand-written `vmap` staticmethod with the wrong batch dimension, gives "
    "this; if the difference is rounding (batched kernels), loosen `atol=`/`rtol=`."
)


@dataclass(frozen=True)
class _Run:
    """The floating-point outputs (by name) and input gradients of one run."""

    outputs: tuple[tuple[str, Tensor], ...]
    grads: tuple[Tensor, ...]


def _run(outputs: Outputs, grads: Sequence[Tensor | None], inputs: Sequence[Tensor]) -> _Run:
    """A run's results, detached; a missing gradient is a zero one, as PyTorch treats it."""
    return _Run(
        tuple(zip(outputs.names, (t.detach() for t in outputs.tensors), strict=True)),
        tuple(
            torch.zeros_like(t) if g is None else g.detach()
            for t, g in zip(inputs, grads, strict=True)
        ),
    )


def assert_consistent(
    fn: Callable[..., Any],
    *inputs: Any,
    modes: Sequence[str] = MODES,
    backend: str = "aot_eager",
    samples: Sequence[Sequence[Any]] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    seed: int = 0,
) -> None:
    """Check that `fn` gives the same outputs and gradients in eager mode, compiled and vmapped.

    ```python
    import torch
    from gradoverride import recipes
    from gradoverride.testing import assert_consistent

    assert_consistent(recipes.spike(), torch.randn(16))  # eager == compiled == vmapped
    print("consistent")
    #> consistent
    ```

    Eager mode is the baseline: `fn(*inputs)` forward, then backward with a seeded random
    upstream gradient (every floating-point tensor among the inputs gets a gradient, named as
    in `check_backward`). Each other mode must give the same outputs and gradients:

    * `"compile"`: `torch.compile(fn, fullgraph=True, backend=backend)`, forward and
      backward. `fullgraph=True` turns a graph break (a Python `if` on a tensor's value, a
      call dynamo cannot trace) into a failure naming the break and where it is: a silent
      fallback to eager code is exactly what this must not hide. Dynamo's caches are
      reset before and after (`torch._dynamo.reset()`), so an earlier compile of the same
      function cannot hide a break.
    * `"vmap"`: `torch.func.vmap` of `torch.func.vjp` over a batch, against a Python loop of
      eager runs, one per sample (each with its own upstream gradient). The batch is
      `samples` stacked along a new dim 0 (only floating-point tensors are batched; every
      other input is taken from the first sample). By default the samples are `inputs` and
      `inputs` with every floating-point tensor reversed along all its dimensions (`flip`):
      the two differ, yet every value stays a value the function was given, and a symmetric
      or positive-definite matrix stays one.

    Args:
        fn: the function to check: a `go.custom_backward` op, or any function calling one.
        *inputs: its positional inputs (bind keyword arguments with `functools.partial`).
        modes: which of `"eager"`, `"compile"` and `"vmap"` to run; eager always runs.
        backend: the `torch.compile` backend. Default `"aot_eager"`: it traces forward and
            backward exactly as inductor does (dynamo, then AOT autograd), which is where a
            rule is dropped or a graph breaks, but skips code generation, so a check takes a
            fraction of a second instead of seconds. Pass `"inductor"` to check the
            generated kernels too.
        samples: the per-sample inputs batched for vmap, each a sequence like `inputs`.
        rtol: the relative tolerance; default `torch.testing.assert_close`'s for the dtype.
        atol: the absolute tolerance; default `torch.testing.assert_close`'s for the dtype.
        seed: the seed of the random upstream gradients.

    Returns:
        None, when every mode agrees with eager mode.

    Raises:
        GradOverrideError: naming the mode, and the output or input that disagrees (and the
            sample, under vmap), or the graph break under compile.
    """
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        msg = (
            f"assert_consistent(`{function_name(fn)}`): unknown mode "
            f"{unknown[0]!r}; the modes are {', '.join(repr(m) for m in MODES)}."
        )
        raise GradOverrideError(msg)
    call = Call(fn, inputs)
    leaves = call.leaves()
    try:
        outputs = forward(call, leaves)
        grads_out = upstream(outputs, "random", seed, call.fn_name)
        grads = backward(call.fn_name, outputs, leaves, grads_out)
        eager = _run(outputs, grads, call.tensors)
    except Exception as exc:
        exc.add_note(f"(raised in eager mode, the baseline of assert_consistent(`{call.fn_name}`))")
        raise
    if "compile" in modes:
        _check_compile(call, grads_out, eager, backend, rtol, atol)
    if "vmap" in modes:
        _check_vmap(call, samples, seed, rtol, atol)


def _check_compile(
    call: Call,
    grads_out: Sequence[Tensor],
    eager: _Run,
    backend: str,
    rtol: float | None,
    atol: float | None,
) -> None:
    import torch._dynamo  # only when compiling: a heavy import

    mode = f"torch.compile(fullgraph=True, backend={backend!r})"
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            for message in _TORCH_COMPILE_WARNINGS:
                warnings.filterwarnings("ignore", message=message, category=DeprecationWarning)
            compiled = torch.compile(call.fn, backend=backend, fullgraph=True)
            leaves = call.leaves()
            outputs = Outputs(call.fn_name, compiled(*call.rebuild(leaves)))
            grads = backward(call.fn_name, outputs, leaves, grads_out)
    except torch._dynamo.exc.Unsupported as exc:
        msg = (
            f"assert_consistent(`{call.fn_name}`): `{call.fn_name}` does not compile under "
            f"{mode}: the forward or its backward rule has a graph break: {_summary(exc)} "
            "Graph breaks come from code dynamo cannot trace: a Python `if` on a tensor's "
            "value, `.tolist()`, printing, calls into other libraries. Keep values as tensors "
            "and write conditions with `torch.where`."
        )
        raise GradOverrideError(msg) from exc
    except Exception as exc:
        msg = (
            f"assert_consistent(`{call.fn_name}`): `{call.fn_name}` runs in eager mode but "
            f"raises under {mode}: {type(exc).__name__}: {_summary(exc)}"
        )
        raise GradOverrideError(msg) from exc
    finally:
        torch._dynamo.reset()
    got = _run(outputs, grads, call.tensors)
    _compare_runs(call, mode, got, eager, rtol, atol, hint=_COMPILE_HINT)


def _check_vmap(
    call: Call,
    samples: Sequence[Sequence[Any]] | None,
    seed: int,
    rtol: float | None,
    atol: float | None,
) -> None:
    if samples is None:
        flipped = call.rebuild([t.flip(tuple(range(t.dim()))) for t in call.tensors])
        samples = (call.inputs, flipped)
    calls = [Call(call.fn, sample) for sample in samples]
    if not calls:
        msg = f"assert_consistent(`{call.fn_name}`): `samples` is empty; give at least one."
        raise GradOverrideError(msg)
    first = calls[0]
    for k, other in enumerate(calls):
        if other.names != first.names or any(
            a.shape != b.shape or a.dtype != b.dtype
            for a, b in zip(other.tensors, first.tensors, strict=True)
        ):
            msg = (
                f"assert_consistent(`{call.fn_name}`): sample {k} does not match sample 0: "
                "every sample needs floating-point tensors of the same names, shapes and "
                "dtypes, so that they stack into a batch."
            )
            raise GradOverrideError(msg)
    mode = f"torch.func.vmap (over a batch of {len(calls)} samples stacked along a new dim 0)"

    baseline: list[_Run] = []
    cotangents: list[tuple[Tensor, ...]] = []
    for k, sample in enumerate(calls):
        leaves = sample.leaves()
        outputs = forward(sample, leaves)
        grads_out = upstream(outputs, "random", seed + 1 + k, call.fn_name)
        grads = backward(call.fn_name, outputs, leaves, grads_out)
        baseline.append(_run(outputs, grads, sample.tensors))
        cotangents.append(grads_out)

    def per_sample(
        tensors: tuple[Tensor, ...], grads_out: tuple[Tensor, ...]
    ) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        def run(*leaves: Tensor) -> tuple[Tensor, ...]:
            return forward(first, leaves).tensors

        # vjp's stub also covers has_aux=True (a 3-tuple); without it the result is a pair.
        outputs, vjp_fn = torch.func.vjp(run, *tensors)[:2]
        return outputs, tuple(vjp_fn(grads_out))

    batch = tuple(torch.stack(column) for column in zip(*(c.tensors for c in calls), strict=True))
    batch_out = tuple(torch.stack(column) for column in zip(*cotangents, strict=True))
    try:
        outputs_b, grads_b = torch.func.vmap(per_sample)(batch, batch_out)
    except Exception as exc:
        msg = (
            f"assert_consistent(`{call.fn_name}`): `{call.fn_name}` runs in eager mode but "
            f"raises under {mode}: {type(exc).__name__}: {_summary(exc)} Under vmap the "
            "forward and the rule see batched tensors whose values Python cannot read: "
            "`.item()`, `.tolist()`, numpy and a Python `if` on a tensor's value fail; use "
            "tensor ops (`torch.where`) instead."
        )
        raise GradOverrideError(msg) from exc
    names = [name for name, _ in baseline[0].outputs]
    for k, want in enumerate(baseline):
        got = _Run(
            tuple(zip(names, (o[k] for o in outputs_b), strict=True)),
            tuple(g[k] for g in grads_b),
        )
        _compare_runs(calls[k], mode, got, want, rtol, atol, hint=_VMAP_HINT, sample=k)


def _compare_runs(
    call: Call,
    mode: str,
    got: _Run,
    eager: _Run,
    rtol: float | None,
    atol: float | None,
    *,
    hint: str,
    sample: int | None = None,
) -> None:
    where = "" if sample is None else f" in sample {sample}"
    pairs = [
        (f"the output `{name}`", out, want)
        for (name, out), (_, want) in zip(got.outputs, eager.outputs, strict=True)
    ]
    if len(got.outputs) != len(eager.outputs):
        msg = (
            f"assert_consistent(`{call.fn_name}`): under {mode}, `{call.fn_name}` returned "
            f"{len(got.outputs)} floating-point outputs{where}, in eager mode "
            f"{len(eager.outputs)}."
        )
        raise GradOverrideError(msg)
    pairs += [
        (f"the gradient for `{name}`", g, want)
        for name, g, want in zip(call.names, got.grads, eager.grads, strict=True)
    ]
    for what, value, want in pairs:
        if value.shape != want.shape or value.dtype != want.dtype:
            msg = (
                f"assert_consistent(`{call.fn_name}`): under {mode}, {what}{where} is "
                f"{describe_dtype(value.dtype)} of shape {tuple(value.shape)}, but in eager "
                f"mode {describe_dtype(want.dtype)} of shape {tuple(want.shape)}. {hint}"
            )
            raise GradOverrideError(msg)
        rtol_, atol_ = tolerances(want.dtype, rtol, atol)
        d = compare(value, want, rtol_, atol_)
        if not d.close:
            msg = (
                f"assert_consistent(`{call.fn_name}`): under {mode}, {what}{where} differs "
                f"from eager mode: the largest difference is {d.max_abs:.3g}"
                f"{format_index(d.worst)} ({d.got:.6g} against {d.expected:.6g} in eager "
                f"mode), over atol={atol_:g} + rtol={rtol_:g} * |eager|. {hint}"
            )
            raise GradOverrideError(msg)


def _summary(exc: BaseException) -> str:
    """The first line of an exception's message, and where in user code it was raised."""
    text = str(exc).strip()
    lines = [line.rstrip() for line in text.splitlines()]
    head = lines[0] if lines else type(exc).__name__
    summary = head if head.endswith(".") else head + "."
    if "from user code:" in lines:
        frames = [line.strip() for line in lines[lines.index("from user code:") + 1 :]]
        frames = [
            line for line in frames if line.strip("^~ ") and not line.startswith("Set TORCHDYNAMO")
        ]
        if len(frames) >= 2 and frames[-2].startswith("File "):
            summary += f" It is at {frames[-2].removeprefix('File ')}: `{frames[-1]}`."
    return summary
