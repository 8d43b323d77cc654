"""`custom_backward`: the object users hold, a forward function with a backward rule."""

from __future__ import annotations

import functools
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar, overload

import torch
from torch.compiler import is_dynamo_compiling
from typing_extensions import ParamSpec

from ._backends import backend
from ._errors import GradOverrideError, GradOverrideTypeError
from ._frameworks import autograph_artifact
from ._function import RECORDERS, OpPlan, Route, any_other_framework, build_route
from ._internals import transforms_active
from ._jit import refuse_scripting
from ._pickling import found_at_its_name, require_importable
from ._rule import RuleSpec, normalize_names
from ._signature import ForwardSignature, describe

__all__ = ["CustomBackward", "CustomBackwardModule", "custom_backward"]

P = ParamSpec("P")
R = TypeVar("R")
Rule = TypeVar("Rule", bound=Callable[..., Any])



class _OpDefault:
    """An option of `op.backward(...)` left out: the op takes its own default for it."""

    __slots__ = ()

    def __repr__(self) -> str:
        # What help() and the docs show in the signature.
        return "OP_DEFAULT"


OP_DEFAULT: Any = _OpDefault()

#: Every op with a rule, so that `gradoverride.testing` can make each check its next call.
_OPS: weakref.WeakSet[CustomBackward[..., Any]] = weakref.WeakSet()
#: Told of each op when its rule is registered (a running `go.monitor`, for ops made while it
#: records); empty otherwise.
ON_REGISTER: list[Callable[[CustomBackward[..., Any]], None]] = []
#: Told when every op and module is to be checked again (`arm_all`).
ON_ARM: list[Callable[[], None]] = []


def arm_all() -> None:
    """Make every op and module check its next eager call (see `_audit`): what the testing
    tools do before each run."""
    for op in list(_OPS):
        op._check_next = True
    for listener in ON_ARM:
        listener()


@autograph_artifact
class CustomBackward(Generic[P, R]):
    """A forward function whose backward is a rule you wrote. Made by `custom_backward`.

    Call it like the forward. Register the rule with `@op.backward`; get an `nn.Module` form
    with `op.module(**fixed)`; the generated `torch.autograd.Function` is `op.function`.
    """

    __wrapped__: Callable[P, R]
    __name__: str
    __qualname__: str

    # TensorFlow's AutoGraph rewrites the Python code a `tf.function` calls, recursively,
    # unless the callee carries this mark (what `tf.autograph.experimental.do_not_convert`
    # sets). Our entry point is plain control flow on Python values, and the user's forward
    # runs inside `tf.custom_gradient`, which AutoGraph never converts; converting ours would
    # only add trace time. `tests/test_tensorflow.py` checks TensorFlow still reads the mark.
    autograph_info__ = frozenset(("autograph_artifact",))

    # Set when the rule is registered (class defaults until then).
    _tracks_inplace = False  # the forward's in-place changes to its inputs are marked dirty
    _labels: dict[str, str] = {}  # noqa: RUF012 - replaced per op; names shown in messages
    # Whether the next eager call with grad enabled is checked (see `_audit`): the first.
    _check_next = False
    # (factory, args, kwargs) that rebuild this op when pickled by value; set by the
    # factories that make ops (straight_through) whose rule is generated.
    _rebuild: tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]] | None = None

    def __init__(
        self,
        fn: Callable[P, R],
        *,
        residuals: tuple[str, ...] = (),
        rule_options: dict[str, Any] | None = None,
        signature: str | Sequence[str] | None = None,
    ) -> None:
        # `@custom_backward` over `@staticmethod` / `@classmethod`: decorate the function
        # inside, and bind as the wrapper would (see `__get__`).
        self._binding: type | None = None
        if isinstance(fn, (staticmethod, classmethod)):
            self._binding = type(fn)
            fn = fn.__func__
        if not callable(fn):
            msg = (
                "custom_backward needs a forward function to decorate, got "
                f"{type(fn).__name__} {fn!r}."
            )
            raise GradOverrideTypeError(msg)
        functools.update_wrapper(self, fn)
        self._name = describe(fn)
        forms = None
        if signature is not None:
            from ._signature_forms import parse_forms

            forms = parse_forms(signature, f"custom_backward({self._name})")
        self._signature = ForwardSignature(fn, self._name, forms)
        for name in residuals:
            if name in self._signature.index:
                msg = (
                    f"`{self._name}` declares a residual `{name}`, which is also one of its "
                    "parameters; give the residual another name."
                )
                raise GradOverrideTypeError(msg)
        self._residuals = residuals
        self._rule_options = rule_options or {}
        self._rule: RuleSpec | None = None
        self._route: Route | None = None
        # The entry a call takes: the route's once a rule is registered.
        self._run: Callable[[tuple[Any, ...], dict[str, Any]], Any] = self._no_rule
        # The TensorFlow side, built when the first TensorFlow tensor arrives. A rule written
        # in torch ops by gradoverride itself (straight_through's) has a TensorFlow twin here.
        self._tensorflow_call: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None
        self._tensorflow_rule: Callable[..., Any] | None = None
        # How the TensorFlow side names the variables a forward reads, from the values the
        # rule names (gradoverride.keras.Layer names them relative to the layer).
        self._tensorflow_variable_names: Callable[[dict[str, Any], Any], str | None] | None = None
        self._tensorflow_variable_frozen: Callable[[dict[str, Any], Any], bool] | None = None
        # The JAX side, built when the first JAX array arrives; straight_through's rule has a
        # JAX twin here, as it has a TensorFlow one.
        self._jax_call: Callable[[tuple[Any, ...], dict[str, Any]], Any] | None = None
        self._jax_rule: Callable[..., Any] | None = None

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if self._check_next or RECORDERS:
            return self._watched_call(args, kwargs)  # type: ignore[no-any-return]
        result: R = self._run(args, kwargs)
        return result

    def _no_rule(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        short = getattr(self, "__name__", self._name)
        msg = (
            f"`{self._name}` has no backward rule yet; register one before calling it:\n\n"
            f"    @{short}.backward\n"
            f"    def _(grad, *, ...):  # name the inputs the rule needs\n"
            f"        return ...\n"
        )
        raise GradOverrideError(msg)

    def _watched_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call to check (the first eager call with grad enabled: captured tensors, inputs
        changed in place; see `_audit`) or to record (see `_recorder`)."""
        # (Every recorded call comes here: the checks cost no Python call when the first
        # argument is a torch tensor, as the route's own entry decides; otherwise, once
        # TensorFlow or JAX was imported, the arguments are searched for their values.)
        if is_dynamo_compiling() or (
            not (args and isinstance(args[0], torch.Tensor))
            and ("tensorflow" in sys.modules or "jax" in sys.modules)
            and any_other_framework(args, kwargs)
        ):
            return self._run(args, kwargs)
        run: Callable[[tuple[Any, ...], dict[str, Any]], Any]
        if not self._check_next or transforms_active() or not torch.is_grad_enabled():
            run = self._run
        else:
            from ._audit import audit_call  # imported at the first check, not with the package

            def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # (check, call)
                result = audit_call(self, args, kwargs)
                self._check_next = False
                return result

        for recorder in RECORDERS:
            return recorder.op_call(self, args, kwargs, run)
        return run(args, kwargs)

    @overload
    def backward(
        self,
        rule: Rule,
        /,
        *,
        owns: str | Iterable[str] | None = ...,
        once_differentiable: bool = ...,
        materialize_grads: bool = ...,
    ) -> Rule: ...

    @overload
    def backward(
        self,
        rule: None = None,
        /,
        *,
        owns: str | Iterable[str] | None = ...,
        once_differentiable: bool = ...,
        materialize_grads: bool = ...,
    ) -> Callable[[Rule], Rule]: ...

    def backward(
        self,
        rule: Callable[..., Any] | None = None,
        /,
        *,
        owns: str | Iterable[str] | None = OP_DEFAULT,
        once_differentiable: bool = OP_DEFAULT,
        materialize_grads: bool = OP_DEFAULT,
    ) -> Any:
        """Register the backward rule; use bare (`@op.backward`) or with options.

        Args:
            rule: `rule(*upstream_grads, *, names...)`. Positional parameters receive one
                upstream gradient per forward output; keyword-only parameters name what the
                rule needs (forward parameters, declared residuals, `output`,
                `needs_grad`), and only those are kept for backward.
            owns: the parameters whose gradient the rule supplies (a name or a tuple of
                names). Default: all of them. The others keep their ordinary autograd
                gradient, computed through the forward's graph.
            once_differentiable: run the rule without recording a graph; differentiating
                its result again then raises `GradOverrideError` (in eager mode and under
                `torch.func`) instead of silently giving zeros.
            materialize_grads: when an output is unused by the loss, pass the rule a zero
                gradient for it (True, PyTorch's default) or `None` (False). A compiled
                backward may pass zeros even with False (AOTAutograd materializes them).

        An option left at `OP_DEFAULT` takes the op's default: the one given to
        `go.custom_backward(...)`, else `owns=None` (all), `once_differentiable=False`,
        `materialize_grads=True`.

        Returns:
            The rule itself, unchanged, so it can still be called and tested on its own.

        What the rule may return:
            - a tensor (or None) when exactly one owned parameter holds a tensor in this call;
            - a tuple with one entry per forward parameter, in order, None for no gradient
              (`return grad_x, None`, as in an `autograd.Function`);
            - a dict by parameter name, naming every owned parameter that holds a tensor
              (None for no gradient).

            A container argument (tuple, list, dict of tensors) gets a gradient of the same
            structure. Each gradient must have its input's shape, or one the input broadcasts
            to (summed down to it); another floating-point precision is cast to the input's.
            Any other shape, an integer/bool/complex gradient for a real input, another device,
            or a gradient for a non-tensor or unowned argument raises `GradOverrideError`.
        """
        options = dict(self._rule_options)
        for key, value in (
            ("owns", owns),
            ("once_differentiable", once_differentiable),
            ("materialize_grads", materialize_grads),
        ):
            if value is not OP_DEFAULT:
                options[key] = value
        if rule is None:

            def register(fn: Rule) -> Rule:
                return self._register(fn, options)

            return autograph_artifact(register)
        return self._register(rule, options)

    def _register(self, rule: Rule, options: dict[str, Any]) -> Rule:
        if self._rule is not None:
            msg = (
                f"`{self._name}` already has the backward rule `{self._rule.name}`; a rule is "
                "registered once. To try another rule, decorate the forward again: "
                f"`go.custom_backward({self._name}.__wrapped__, backward=new_rule)`."
            )
            raise GradOverrideError(msg)
        spec = RuleSpec(
            rule,
            self._signature,
            owns=options.get("owns"),
            residuals=self._residuals,
            once_differentiable=options.get("once_differentiable", False),
            materialize_grads=options.get("materialize_grads", True),
        )
        module = getattr(self.__wrapped__, "__module__", None) or __name__
        self._tracks_inplace = bool(options.get("track_inplace", False))
        self._labels = dict(options.get("labels", {}))
        sig = self._signature
        self._route = build_route(OpPlan(
            op=self._name, module=module, names=sig.names, labels=self._labels,
            bind=sig.bind, call=sig.caller(), plain=sig.fn if sig.is_plain else None, rule=spec,
            residuals=self._residuals, track_inplace=self._tracks_inplace, form=None,
            run_tensorflow=self._run_tensorflow, run_jax=self._run_jax,
            plain_signature=sig.fn if sig.is_plain else None, defaults=sig.defaults,
        ))
        # (AutoGraph converts the functions a callable object calls unless they are marked.)
        self._run = autograph_artifact(self._route.run)
        self._rule = spec
        # The first eager call with grad enabled is checked (captured tensors, inputs changed
        # in place; see _audit).
        self._check_next = True
        _OPS.add(self)
        for listener in ON_REGISTER:
            listener(self)
        return rule

    def _run_tensorflow(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call with TensorFlow tensors: the same rule contract on `tf.custom_gradient`."""
        call = self._tensorflow_call
        if call is None:
            assert self._rule is not None  # calls reach here only after registration
            call = self._tensorflow_call = backend("tensorflow").TensorFlowCall(
                self._name,
                self._signature,
                self._rule,
                self._residuals,
                rule=self._tensorflow_rule or self._rule.rule,
                variable_names=self._tensorflow_variable_names,
                variable_frozen=self._tensorflow_variable_frozen,
                # A rule gradoverride wrote (straight_through's) gives the first argument its
                # gradient and nothing else: variables the forward reads (or writes, as
                # `x.assign` does) get none, as `tf.grad_pass_through` gives them.
                variables_get_none=self._tensorflow_rule is not None,
            )
        return call(args, kwargs)

    def _run_jax(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call with JAX arrays: the same rule contract on `jax.custom_vjp`."""
        call = self._jax_call
        if call is None:
            assert self._rule is not None  # calls reach here only after registration
            call = self._jax_call = backend("jax").JaxCall(
                self._name, self._signature, self._rule, self._residuals,
                rule=self._jax_rule or self._rule.rule,
            )
        return call(args, kwargs)

    def __tf_tracing_type__(self, context: Any) -> Any:
        # `tf.function` replaces an argument (or a default argument, `def step(x, f=op)`)
        # that has `__wrapped__` by the wrapped function, which would silently drop the
        # custom gradient; declaring our own trace type keeps the op itself.
        return backend("tensorflow").OpTraceType(self)

    @property
    def rule(self) -> Callable[..., Any] | None:
        """The registered backward rule, or None."""
        return None if self._rule is None else self._rule.rule

    @property
    def function(self) -> type[torch.autograd.Function]:
        """The generated `torch.autograd.Function` class (after a rule is registered)."""
        if self._route is None:
            msg = f"`{self._name}` has no backward rule yet, so no Function was generated."
            raise GradOverrideError(msg)
        return self._route.function

    @property
    def parameters(self) -> tuple[str, ...]:
        """The forward's parameter names, as rules and returned dicts address them."""
        return self._signature.names

    def module(self, **fixed: Any) -> CustomBackwardModule:
        """An `nn.Module` that calls this op with `fixed` keyword arguments bound.

        `quantize.module(bits=4)` is a module whose `forward(x)` is `quantize(x, bits=4)`,
        for `nn.Sequential` and everything else that expects modules.
        """
        unknown = [n for n in fixed if n not in self._signature.index]
        if unknown and self._signature.var_keyword is None:
            msg = (
                f"`{self._name}.module()` got `{unknown[0]}`, which `{self._name}` does not "
                f"take; its parameters are {', '.join(self._signature.names)}."
            )
            raise GradOverrideTypeError(msg)
        return CustomBackwardModule(self, fixed)

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        # Decorated methods bind like functions: `obj.op(x)` calls `op(obj, x)`; over a
        # staticmethod nothing is bound, over a classmethod the class is.
        binding = self._binding
        if binding is staticmethod:
            return self
        if binding is classmethod:
            return types.MethodType(self, owner if owner is not None else type(instance))
        if instance is None:
            return self
        return types.MethodType(self, instance)

    def __repr__(self) -> str:
        rule = "no rule" if self._rule is None else f"backward={self._rule.name}"
        return f"<custom_backward {self._signature!r}, {rule}>"

    def __deepcopy__(self, memo: dict[int, Any]) -> CustomBackward[P, R]:
        return self  # shared, as a function is: an op holds no per-copy state

    def __reduce__(self) -> Any:
        # Pickle by reference, as functions are, when the op is found under its module and
        # qualified name (a decorated module-level function); otherwise (an op made from a
        # builtin such as `torch.sign`, or inside a function) by what rebuilds it: the
        # forward and the rule, each pickled by reference.
        if found_at_its_name(self):
            return str(self.__qualname__)
        if self._rebuild is not None:
            factory, args, kwargs = self._rebuild
            for value in (*args, *kwargs.values()):
                if callable(value):
                    require_importable(value, f"`{self._name}`", "a function it was built from")
            return (_rebuild_with, (factory, args, kwargs))
        if self._rule is None:
            msg = (
                f"`{self._name}` cannot be pickled: it has no backward rule yet and is not "
                "a module-level name; register its rule first."
            )
            raise GradOverrideError(msg)
        forward = self.__wrapped__
        require_importable(forward, f"`{self._name}`", "its forward")
        require_importable(self._rule.rule, f"`{self._name}`", "its backward rule")
        options = {
            key: value for key, value in self._rule_options.items()
            if key not in ("track_inplace", "labels")
        }
        spec = self._rule
        owned = tuple(n for n, o in zip(self._signature.names, spec.owned, strict=True) if o)
        options.update(
            owns=owned if spec.owns_declared else None,
            once_differentiable=self._rule.once_differentiable,
            materialize_grads=self._rule.materialize_grads,
        )
        return (
            _rebuild_with,
            (custom_backward, (forward,), {
                **options, "residuals": self._residuals, "backward": self._rule.rule,
            }),
        )


class CustomBackwardModule(torch.nn.Module):
    """The `nn.Module` form of a `custom_backward` op, with some arguments fixed."""

    def __init__(self, op: CustomBackward[..., Any], fixed: dict[str, Any]) -> None:
        super().__init__()
        self.op = op
        self.fixed = dict(fixed)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.op(*args, **self.fixed, **kwargs)

    def _get_name(self) -> str:
        return str(self.op.__name__)

    def __prepare_scriptable__(self) -> torch.nn.Module:
        # torch.jit.script calls this on every module it scripts.
        refuse_scripting(f"`{self.op._name}`")

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.fixed.items())


@overload
def custom_backward(
    fn: Callable[P, R],
    /,
    *,
    backward: Callable[..., Any] | None = ...,
    signature: str | Sequence[str] | None = ...,
    owns: str | Iterable[str] | None = ...,
    once_differentiable: bool = ...,
    materialize_grads: bool = ...,
) -> CustomBackward[P, R]: ...


@overload
def custom_backward(
    fn: Callable[P, Any],
    /,
    *,
    residuals: str | Iterable[str],
    backward: Callable[..., Any] | None = ...,
    signature: str | Sequence[str] | None = ...,
    owns: str | Iterable[str] | None = ...,
    once_differentiable: bool = ...,
    materialize_grads: bool = ...,
) -> CustomBackward[P, Any]: ...


@overload
def custom_backward(
    fn: None = None,
    /,
    *,
    residuals: str | Iterable[str] | None = ...,
    backward: Callable[..., Any] | None = ...,
    signature: str | Sequence[str] | None = ...,
    owns: str | Iterable[str] | None = ...,
    once_differentiable: bool = ...,
    materialize_grads: bool = ...,
) -> Callable[[Callable[P, R]], CustomBackward[P, R]]: ...


@autograph_artifact
def custom_backward(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    residuals: str | Iterable[str] | None = None,
    backward: Callable[..., Any] | None = None,
    signature: str | Sequence[str] | None = None,
    owns: str | Iterable[str] | None = None,
    once_differentiable: bool = False,
    materialize_grads: bool = True,
) -> Any:
    """Give a forward function a backward rule you write.

    ```python
    import torch
    import gradoverride as go

    @go.custom_backward
    def quantize(x, bits=8):
        s = 2**bits
        return torch.round(x * s) / s

    @quantize.backward
    def _(grad, *, x):  # keyword-only names choose what is kept
        return grad * (x.abs() <= 1)  # gradient for `x`; `bits` gets none

    x = torch.tensor([0.3, 1.5], requires_grad=True)
    quantize(x, bits=2).sum().backward()
    print(x.grad)
    #> tensor([1., 0.])
    ```

    Works bare, with options (`@go.custom_backward(owns="x")`), over a `@staticmethod` or
    `@classmethod` (binding as those do), and as a call on an existing function
    (`go.custom_backward(torch.sign, backward=rule)`).

    A builtin's parameters are read from its docstring, named as torch documents them
    (`sign(input, *, out=None)`: the rule names `input`). `out` is not a parameter: an op
    with a custom backward returns a new tensor, so a call with `out=` is an error. A builtin
    documented in several forms, such as `sum(input, *, dtype=None)` and
    `sum(input, dim, keepdim=False, *, dtype=None)`, has the parameters of all its forms, in
    the order the forms list them (`input, dim, keepdim, dtype`), and a rule may name any of
    them. Each call binds to the first form that takes it; the parameters that form lacks
    hold None (`op(x)`: `dim` is None). A call that two forms read differently
    (`torch.max(x, 1)`: `dim` or `other`?) is an error asking for a keyword argument
    (`dim=1`) or for `signature=`.

    What the rule may return:
        - a tensor (or None) when exactly one owned parameter holds a tensor in this call;
        - a tuple with one entry per forward parameter, in order, None for no gradient
          (`return grad_x, None`, as in an `autograd.Function`);
        - a dict by parameter name, naming every owned parameter that holds a tensor
          (None for no gradient).

        A container argument (tuple, list, dict of tensors) gets a gradient of the same
        structure. Each gradient must have its input's shape, or one the input broadcasts
        to (summed down to it); another floating-point precision is cast to the input's.
        Any other shape, an integer/bool/complex gradient for a real input, another device,
        or a gradient for a non-tensor or unowned argument raises `GradOverrideError`.

    Args:
        fn: the forward. Any Python function of tensors, non-tensor values and
            tuples/lists/dicts of tensors, returning a tensor, a tuple of outputs or a
            container of tensors; or a builtin (see above).
        residuals: names of values the forward computes for the rule. The forward then
            returns `(output, {name: value, ...})`; callers get only `output`, and the rule
            names the residuals as keyword-only parameters. Tensors are saved with
            `save_for_backward`; nothing is recomputed.
        backward: the rule, when not registered with `@op.backward`.
        signature: the forward's signature as text, replacing the one read from it: for a
            function whose signature Python cannot read and whose docstring does not
            document it, or documents forms you want to narrow down:
            `go.custom_backward(torch.max, signature="(input, other)", backward=rule)`.
            One string in Python's syntax with literal defaults (`"(input, dim=None)"`, or
            `"max(input, other) -> Tensor"` as torch docs write it), or a tuple of such
            strings for several forms. The defaults must be the function's own: a value
            equal to its default is left out when the forward is called.
        owns: the parameters whose gradient the rule supplies (default: all); see
            `CustomBackward.backward`.
        once_differentiable: run the rule without recording a graph; see
            `CustomBackward.backward`.
        materialize_grads: send the rule zeros (True) or None (False) for unused
            outputs; see `CustomBackward.backward`.

    Returns:
        A `CustomBackward` that keeps the forward's name, docstring, signature and
        `__wrapped__`.
    """
    residual_names = normalize_names(residuals, "residuals", "custom_backward")
    options = {
        "owns": owns,
        "once_differentiable": once_differentiable,
        "materialize_grads": materialize_grads,
    }

    def decorate(forward: Callable[P, R]) -> CustomBackward[P, R]:
        op: CustomBackward[P, R] = CustomBackward(
            forward, residuals=residual_names, rule_options=options, signature=signature
        )
        if backward is not None:
            op.backward(backward)
        return op

    if fn is None:
        return autograph_artifact(decorate)
    return decorate(fn)


def _rebuild_with(factory: Callable[..., Any], args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    """Unpickling an op pickled by value: make it again."""
    return factory(*args, **kwargs)
