"""`custom_backward` on TensorFlow tensors: the same rule contract, on `tf.custom_gradient`.

A call whose arguments hold TensorFlow tensors comes here (see `CustomBackward`), with the
rule the user registered. What is the same as in torch: the rule's signature (positional
upstream gradients, keyword-only names for what it needs, `output`, `needs_grad`, residuals),
the return forms (tensor, tuple, dict, containers), ownership (`owns=`), the checks on every
returned gradient and their error texts (`_gradients.py`), `once_differentiable`.

What TensorFlow's `tf.custom_gradient` leaves to its users, done here:

* Only floating-point (and complex) tensors of owned parameters become arguments of the
  `tf.custom_gradient` function. Python numbers, strings, integer tensors stay outside, in a
  closure: under `tf.function`, `tf.custom_gradient` converts every argument to a tensor and
  then wants a gradient for it.
* Variables passed as arguments are read (`tf.convert_to_tensor`), so their gradient flows
  through the read as for any tensor. Variables the forward reads by itself (a Keras layer's
  weights, a closure) come to the gradient function as `variables=`, in an order that
  differs between eager and graph mode; the rule returns their gradients in its dict *by
  name* (`"w"` for a `tf.Variable(name="w")`, `"dense/kernel"` or just `"kernel"` when that
  is unambiguous for a Keras weight), and they are matched here. A rule that owns only some
  inputs (`owns=`) leaves variables their ordinary TensorFlow gradient.
* `IndexedSlices` (from `tf.gather` downstream, say) are made dense before the rule sees
  them, and a returned `IndexedSlices` is made dense before it is checked.
* Shapes and dtypes of returned gradients are checked as in torch (TensorFlow checks
  neither): a shape the input broadcasts to is summed down, another float precision is cast,
  anything else is a `GradOverrideError` naming the input. As in torch, an integer or bool
  tensor argument (an index, Keras' `mask=`) takes no gradient, so a returned dict need not
  name it.
* In graph mode the rule runs as a function call of its own that is not inlined (see
  `_in_function`): a rule that reads a variable (`self.kernel`) then reads it before the
  optimizer updates it, and works inside a `tf.while_loop`'s gradient.
* Refused with a `GradOverrideError` that names the fix: a call inside `tf.vectorized_map`
  (which drops custom gradients, see `_tracing`), and a `tf.RaggedTensor` or
  `tf.SparseTensor` of floats as an owned argument or as the output (`tf.custom_gradient`
  has no gradient slot for one; integer ones reach the forward as they are).

Differences, documented in the README: an output the loss does not use always sends the
rule zeros (TensorFlow materializes them in both modes, so `materialize_grads=False` has no
effect), there is no autocast state to restore, and `needs_grad` is True for every owned
floating-point input (TensorFlow does not say which gradients a tape will use).
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf
import torch
from torch.utils import _pytree as pytree

from .._errors import GradOverrideError, GradOverrideTypeError
from .._frameworks import autograph_artifact, is_keras_layer, is_tensorflow
from .._function import (
    check_output_count,
    flatten_inputs,
    unflatten_inputs,
    unpack_residuals,
)
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
from ._tracing import refuse_vectorized_map

__all__ = ["TensorFlowCall", "check_gradient"]

_ONE_LEAF = pytree.tree_structure(0)  # the structure of a lone tensor output
#: What a rule may return as a gradient (an `IndexedSlices` is made dense).
_GRADIENT_TYPES = (tf.Tensor, tf.IndexedSlices)
#: Tensors `tf.custom_gradient` cannot give a gradient slot to.
_COMPOSITE = (tf.RaggedTensor, tf.SparseTensor)


class _Meta:
    """A tensor's shape and dtype, without the tensor: what checking its gradient needs.
    The run-time shape is kept (a small int tensor) only where the static one has gaps,
    which happens in graph mode only."""

    __slots__ = ("_runtime", "dtype", "shape")

    def __init__(self, tensor: Any) -> None:
        self.shape = tensor.shape
        self.dtype = tensor.dtype
        self._runtime = None if self.shape.is_fully_defined() else tf.shape(tensor)

    def runtime_shape(self) -> Any:
        return self.shape if self._runtime is None else self._runtime

    def zeros(self) -> Any:
        return tf.zeros(self.runtime_shape(), self.dtype)


class _Record(NamedTuple):
    """What one call's gradient function keeps (see `TensorFlowCall._record`)."""

    kwargs: dict[str, Any]  # the values the rule names, by name
    meta: list[Any]  # per flat input: None (not a tensor) | SKIP | _Meta
    layout: Any
    slots: tuple[int, ...]  # the flat inputs that get a gradient
    out_spec: Any  # None for a lone tensor output, else the output's structure
    tuple_output: bool  # the forward returned a plain tuple (one upstream gradient each)
    n_leaves: int
    picked: tuple[int, ...]  # the output leaves that carry a gradient
    out_meta: list[_Meta]


@autograph_artifact
class TensorFlowCall:
    """One op's calls with TensorFlow tensors. Built once per op, on its first such call."""

    def __init__(
        self,
        op: str,
        sig: ForwardSignature,
        spec: RuleSpec,
        residuals: tuple[str, ...],
        *,
        rule: Callable[..., Any],
        variable_names: Callable[[dict[str, Any], Any], str | None] | None = None,
        variable_frozen: Callable[[dict[str, Any], Any], bool] | None = None,
        variables_get_none: bool = False,
    ) -> None:
        self.op = op
        # `variable_names(named_values, variable)`: the name a rule gives a variable the
        # forward reads, or None for the default (its path or TensorFlow name).
        self.variable_names = variable_names
        # `variable_frozen(named_values, variable)`: whether the variable belongs to a frozen
        # Keras layer (`trainable=False`), whose gradient a rule may leave out.
        self.variable_frozen = variable_frozen
        self.variables_get_none = variables_get_none
        self.sig = sig
        self.spec = spec
        self.residuals = residuals
        self.rule = rule
        self.note = f"(raised in backward rule `{spec.name}` of `{op}`)"
        # A declared `owns=` takes the attach form even when it names every parameter, so
        # that variables the forward reads keep their own gradient.
        self.owning = spec.owns_all and not spec.owns_declared

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        refuse_vectorized_map(f"`{self.op}`")
        values = self.sig.bind(args, kwargs)
        flat, layout = flatten_inputs(values, tf.is_tensor)
        if _holds_torch(flat):
            self._refuse_torch(flat, layout)
        owned = _per_leaf(self.spec.owned, layout)
        if any(isinstance(v, _COMPOSITE) for v in flat):
            self._refuse_composite(flat, layout, owned)
        flat = tuple(_read(v) for v in flat)
        # The inputs that get a gradient: owned floating-point (or complex) tensors.
        slots = tuple(
            i
            for i, value in enumerate(flat)
            if owned[i] and isinstance(value, tf.Tensor) and _differentiable(value.dtype)
        )
        if self.owning:
            return self._owning(flat, layout, slots)
        return self._attaching(flat, layout, slots)

    def _refuse_torch(self, flat: tuple[Any, ...], layout: Any) -> None:
        """Name the parameter holding a torch tensor (only called when one does)."""
        for slot, (start, stop, _) in enumerate(slot_ranges(layout, len(self.sig.names))):
            if _holds_torch(flat[start:stop]):
                name = self.sig.names[slot]
                msg = (
                    f"`{self.op}` got a torch tensor for `{name}` in a call with TensorFlow "
                    f"tensors; one call works in one framework: convert `{name}` with "
                    f"`tf.convert_to_tensor({name}.numpy())` (or the TensorFlow tensors to torch)."
                )
                raise GradOverrideTypeError(msg)

    def _refuse_composite(
        self, flat: tuple[Any, ...], layout: Any, owned: tuple[bool, ...]
    ) -> None:
        """Refuse a `tf.RaggedTensor` or `tf.SparseTensor` that would need a gradient (one of
        floating-point values the rule owns): `tf.custom_gradient` gives its gradient
        function no gradient for one. Other ones (integer ids, say) reach the forward as
        they are."""
        ranges = slot_ranges(layout, len(self.sig.names))
        for i, value in enumerate(flat):
            if not (isinstance(value, _COMPOSITE) and owned[i] and _differentiable(value.dtype)):
                continue
            slot = next(s for s, (start, stop, _) in enumerate(ranges) if start <= i < stop)
            name = self.sig.names[slot]
            kind, fix = (
                ("tf.RaggedTensor", f"`{name}.to_tensor()`")
                if isinstance(value, tf.RaggedTensor)
                else ("tf.SparseTensor", f"`tf.sparse.to_dense({name})`")
            )
            msg = (
                f"`{self.op}` got a {kind} of {value.dtype.name} for `{name}`, which its rule "
                f"owns; a gradient override takes dense tensors: pass {fix} (or leave "
                f"`{name}` out of `owns=` so it keeps its ordinary TensorFlow gradient)."
            )
            raise GradOverrideTypeError(msg)

    # ---- the two forms --------------------------------------------------------------------

    def _owning(self, flat: tuple[Any, ...], layout: Any, slots: tuple[int, ...]) -> Any:
        """The forward runs inside `tf.custom_gradient`; the rule gives every gradient."""
        made: dict[str, Any] = {}

        @autograph_artifact  # run as Python, not converted by AutoGraph
        def forward(*tensors: Any) -> Any:
            inputs = list(flat)
            for i, tensor in zip(slots, tensors, strict=True):
                inputs[i] = tensor
            output, residuals = self._forward(inputs, layout)
            leaves, spec, picked = _output_leaves(output)
            made.update(leaves=leaves, spec=spec, picked=picked)
            record = self._record(inputs, layout, slots, output, spec, leaves, picked, residuals)
            made["record"] = record

            @autograph_artifact  # run as Python, not converted by AutoGraph
            def gradient(*upstream: Any, variables: Any = None) -> Any:
                grads, var_grads, _ = self._gradients(upstream, record, variables)
                if variables:
                    return grads, var_grads
                return grads

            if len(picked) == 1:  # one tensor, not a list: TensorFlow's nest work is less
                return leaves[picked[0]], gradient
            return [leaves[j] for j in picked], gradient

        results = tf.custom_gradient(forward)(*(flat[i] for i in slots))
        if isinstance(results, tf.Tensor):
            results = (results,)
        final = _rebuild(made["leaves"], made["spec"], made["picked"], results)
        if self.spec.wants_output:
            # The result the caller got, as torch saves it: differentiating the rule through
            # `output` then goes through this op's rule again (not through the forward's
            # ops, which the tape also recorded).
            made["record"].kwargs["output"] = final
        return final

    def _attaching(self, flat: tuple[Any, ...], layout: Any, slots: tuple[int, ...]) -> Any:
        """The forward runs on the ordinary tape with the owned inputs cut off
        (`tf.stop_gradient`), so everything else (other inputs, variables it reads) gets
        its ordinary gradient; an identity `tf.custom_gradient` then adds the rule's
        gradients for the owned inputs and passes the outputs' gradients on unchanged."""
        inputs = list(flat)
        for i in slots:
            inputs[i] = tf.stop_gradient(flat[i])
        output, residuals = self._forward(inputs, layout)
        leaves, spec, picked = _output_leaves(output)
        if not slots or not picked:
            return output
        # The rule sees the inputs themselves, not the cut-off copies, so that a rule in
        # differentiable ops has the second derivative it has in torch.
        record = self._record(list(flat), layout, slots, output, spec, leaves, picked, residuals)
        n_owned = len(slots)

        @autograph_artifact  # run as Python, not converted by AutoGraph
        def attach(*tensors: Any) -> Any:
            @autograph_artifact  # run as Python, not converted by AutoGraph
            def gradient(*upstream: Any, variables: Any = None) -> Any:
                # The outputs' gradients pass on through the rule's call (see `_in_function`).
                grads, _, passed = self._gradients(
                    upstream, record, None, carry=[_dense(g) for g in upstream]
                )
                return [*grads, *passed]

            return [tf.identity(t) for t in tensors[n_owned:]], gradient

        results = tf.custom_gradient(attach)(
            *(flat[i] for i in slots), *(leaves[j] for j in picked)
        )
        return _rebuild(leaves, spec, picked, results)

    # ---- shared by both ---------------------------------------------------------------------

    def _forward(self, inputs: list[Any], layout: Any) -> tuple[Any, dict[str, Any]]:
        values = tuple(inputs) if layout is None else unflatten_inputs(tuple(inputs), layout)
        output = self.sig.call(values)
        residuals: dict[str, Any] = {}
        if self.residuals:
            output, residuals = unpack_residuals(output, self.residuals, self.op)
            # Non-differentiable, as torch marks them (`mark_non_differentiable`).
            residuals = {
                k: tf.stop_gradient(v) if isinstance(v, tf.Tensor) else v
                for k, v in residuals.items()
            }
        n_top = len(output) if type(output) is tuple else 1
        check_output_count(self.spec.n_grads, n_top, self.spec.name, self.op)
        if not isinstance(output, tf.Tensor):
            for leaf in pytree.tree_leaves(output):
                if isinstance(leaf, _COMPOSITE) and _differentiable(leaf.dtype):
                    kind = type(leaf).__name__
                    msg = (
                        f"the forward of `{self.op}` returned a tf.{kind}; its rule could "
                        "not be given the upstream gradient of one, so a gradient override "
                        "returns dense tensors: return `result.to_tensor()` (ragged) or "
                        "`tf.sparse.to_dense(result)` (sparse) from the forward."
                    )
                    raise GradOverrideError(msg)
        return output, residuals

    def _record(
        self,
        inputs: list[Any],
        layout: Any,
        slots: tuple[int, ...],
        output: Any,
        out_spec: Any,
        leaves: list[Any],
        picked: tuple[int, ...],
        residuals: dict[str, Any],
    ) -> _Record:
        """What the gradient function keeps: the values the rule names and metadata. Only
        these: the gradient function lives as long as the tape, so anything it referenced
        (the forward's output, an input the rule does not name) would stay alive with it."""
        spec = self.spec
        names = self.sig.names
        ranges = slot_ranges(layout, len(names))
        kwargs: dict[str, Any] = {}
        graph = not tf.executing_eagerly()
        for name, slot in spec.requested_slots:
            start, stop, treespec = ranges[slot]
            part = inputs[start:stop]
            value = part[0] if treespec is None else pytree.tree_unflatten(part, treespec)
            if graph and is_keras_layer(value):
                # Weakly: TensorFlow keeps a traced gradient function for good (its gradient
                # registry), which would keep the layer and its weights alive with it.
                value = weakref.proxy(value)
            kwargs[name] = value
        for name, _ in spec.requested_residuals:
            kwargs[name] = residuals[name]
        if spec.wants_output:
            kwargs["output"] = output
        if spec.wants_needs_grad:
            kwargs["needs_grad"] = {
                name: any(start <= i < stop for i in slots)
                for name, (start, stop, _) in zip(names, ranges, strict=True)
            }
        # As in torch: an integer or bool tensor (an index, a mask) can never have a
        # gradient, so it is no gradient slot (None) and a returned dict need not name it;
        # a floating-point tensor whose gradient is not asked for is SKIP.
        meta = [
            (_Meta(value) if i in slots else SKIP)
            if isinstance(value, tf.Tensor) and _differentiable(value.dtype)
            else None
            for i, value in enumerate(inputs)
        ]
        lone = isinstance(output, tf.Tensor)
        return _Record(
            kwargs=kwargs,
            meta=meta,
            layout=layout,
            slots=slots,
            out_spec=None if lone else out_spec,
            tuple_output=type(output) is tuple,
            n_leaves=len(leaves),
            picked=picked,
            out_meta=[_Meta(leaves[j]) for j in picked],
        )

    def _gradients(
        self, upstream: tuple[Any, ...], record: _Record, variables: Any, carry: Any = ()
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """Call the rule; the checked gradients for the inputs in `slots` and for
        `variables`, and `carry` as it comes out of the rule's call."""
        # The upstream gradients, in the structure of the forward's output.
        grad_leaves: list[Any] = [None] * record.n_leaves
        for j, grad, m in zip(record.picked, upstream, record.out_meta, strict=True):
            grad_leaves[j] = m.zeros() if grad is None else _dense(grad)
        if record.out_spec is None:
            rule_grads: tuple[Any, ...] = (grad_leaves[0],)
        else:
            tree = pytree.tree_unflatten(grad_leaves, record.out_spec)
            rule_grads = tuple(tree) if record.tuple_output else (tree,)

        result, carried = self._call_rule(rule_grads, record.kwargs, list(carry))
        var_grads: list[Any] = []
        if variables and self.variables_get_none:
            var_grads = [None] * len(variables)
        elif variables:
            result, var_grads = self._variable_gradients(result, variables, record)
        flat_grads = flat_gradients(
            result,
            op=self.op,
            names=self.sig.names,
            owned=self.spec.owned,
            layout=record.layout,
            meta=record.meta,
            check=check_gradient,
            tensor=_GRADIENT_TYPES,
        )
        grads = [flat_grads[i] for i in record.slots]
        if self.spec.once_differentiable:
            grads = [g if g is None else _once_differentiable(self.op, g) for g in grads]
            var_grads = [g if g is None else _once_differentiable(self.op, g) for g in var_grads]
        return grads, var_grads, carried

    def _call_rule(
        self, grads: tuple[Any, ...], kwargs: dict[str, Any], carry: list[Any]
    ) -> tuple[Any, list[Any]]:
        """The rule's result, and `carry` unchanged: in graph mode both come out of one
        function call, so that what uses them runs after every read the rule made (see
        `_in_function`). A rule gradoverride wrote (straight_through's) reads no
        variables and runs as it is."""
        if self.variables_get_none or tf.executing_eagerly():
            return self._run_rule(grads, kwargs), carry
        result: tuple[Any, list[Any]] = _in_function(
            lambda: (self._run_rule(grads, kwargs), carry)
        )
        return result

    def _run_rule(self, grads: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            return self.rule(*grads, **kwargs)
        except GradOverrideError:
            raise
        except Exception as exc:
            exc.add_note(self.note)
            raise

    def _variable_gradients(
        self, result: Any, variables: Any, record: _Record
    ) -> tuple[Any, list[Any]]:
        """Split the gradients of variables the forward read from the rule's dict."""
        named = record.kwargs
        inputs = self._tensor_names(record)
        namer = self.variable_names
        names = [
            (namer(named, v) if namer is not None else None) or _variable_name(v)
            for v in variables
        ]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            msg = (
                f"the forward of `{self.op}` reads {names.count(repeated[0])} variables named "
                f"`{repeated[0]}`, so their gradients cannot be told apart by name; give them "
                "distinct names (`tf.Variable(..., name=...)`), or pass them to "
                f"`{self.op}` as arguments."
            )
            raise GradOverrideError(msg)
        if not isinstance(result, dict):
            listing = ", ".join(f"`{n}`" for n in names)
            example = ", ".join(f"{n!r}: ..." for n in names)
            msg = (
                f"the forward of `{self.op}` reads the variables {listing}, so its backward "
                f"must return their gradients too, in a dict by name: "
                f"{{{', '.join(repr(p) + ': ...' for p in inputs)}"
                f"{', ' if inputs else ''}{example}}}; or declare what the rule owns"
                f"{f' (`owns={inputs[0]!r}`, say)' if inputs else ' with `owns=`'}: "
                "variables it does not name then keep their TensorFlow gradient."
            )
            raise GradOverrideError(msg)
        rest = {k: v for k, v in result.items() if k in self.sig.index}
        given = {k: v for k, v in result.items() if k not in self.sig.index}
        keys = _variable_keys(variables, names, self.sig.index)
        var_grads: list[Any] = []
        used: set[str] = set()
        for variable, name, own_keys in zip(variables, names, keys, strict=True):
            key = next((k for k in own_keys if k in given), None)
            if key is None and self.variable_frozen is not None and self.variable_frozen(
                named, variable
            ):
                var_grads.append(None)  # frozen: no one asks for its gradient
                continue
            if key is None:
                address = own_keys[0]
                clash = (
                    f" (`{name}` is also a parameter of `{self.op}`, so the variable is "
                    f"'{address}' here)" if address != name else ""
                )
                strays = [k for k in given if not any(k in ks for ks in keys)]
                instead = (
                    f" (it returned `{strays[0]}`, which names no variable the forward reads)"
                    if strays else ""
                )
                msg = (
                    f"backward of `{self.op}` returned a dict without `{name}`, a variable "
                    f"its forward reads{clash}{instead}; add {{'{address}': gradient}} (or None "
                    "for no gradient), or pass `owns=` so the variable keeps its TensorFlow "
                    "gradient."
                )
                raise GradOverrideError(msg)
            used.add(key)
            grad = given[key]
            var_grads.append(
                None if grad is None else check_gradient(grad, _Meta(variable), self.op, name)
            )
        unknown = [k for k in given if k not in used]
        if unknown:
            valid = ", ".join(f"`{n}`" for n in (*inputs, *names))
            msg = (
                f"backward of `{self.op}` returned a gradient for `{unknown[0]}`, which is "
                f"neither a parameter of `{self.op}` nor a variable its forward reads; the "
                f"names it can return are {valid}."
            )
            raise GradOverrideError(msg)
        return rest, var_grads

    def _tensor_names(self, record: _Record) -> list[str]:
        """The owned parameters that hold a floating-point tensor in this call: those a
        rule's dict gives gradients for (not the layer, not `training=`)."""
        ranges = slot_ranges(record.layout, len(self.sig.names))
        return [
            name
            for name, owned, (start, stop, _) in zip(
                self.sig.names, self.spec.owned, ranges, strict=True
            )
            if owned and any(record.meta[i] is not None for i in range(start, stop))
        ]


def _in_function(run: Callable[[], Any]) -> Any:
    """`run()`, traced as a function of its own and called as one op that is not inlined,
    in graph mode.

    Why: a rule may read variables (a layer's `self.kernel`, a closure's `tf.Variable`),
    which no TensorFlow gradient function does (they use the forward's values), and two
    things go wrong with such reads when they are plain ops of the gradient:

    * order: the read is ordered before the optimizer's update of the same variable by a
      control edge only, which TensorFlow's graph optimizer (grappler's dependency
      optimizer) may drop: in `model.fit` with `steps_per_execution > 1` the rule then reads
      an already updated weight now and then, and training gives run-to-run different
      weights. A call that is not inlined gives all its outputs at its end, so the gradients
      that come out of it (the rule's, and the upstream gradients the attaching form passes
      on through it) depend on every read in it by data, as do the updates made from them.
    * while loops: the gradient of a `tf.while_loop` (a `tf.range` loop under `tf.function`,
      a Keras RNN) cannot capture a variable handle straight from eager (TensorFlow's
      "internal_captures" error); it can capture one from the function around the loop. So
      the handles this function captures from eager are captured by that function first,
      and passed from there (`set_external_captures`).

    Only tensors leave the function: other values the rule returned (a Python number, a
    torch tensor) come back as they are, for the checks to report.
    """
    kept: dict[str, Any] = {}

    def body() -> list[Any]:
        leaves, spec = pytree.tree_flatten(run())
        is_tf = [isinstance(leaf, (tf.Tensor, tf.IndexedSlices)) for leaf in leaves]
        kept.update(leaves=leaves, spec=spec, is_tf=is_tf)
        return [leaf for leaf, t in zip(leaves, is_tf, strict=True) if t]

    concrete = tf.function(
        body, autograph=False, experimental_attributes={"_noinline": True}
    ).get_concrete_function()
    graph = tf.compat.v1.get_default_graph()
    # The function being traced around the control-flow bodies (while, cond) we are in: a
    # handle captured there is the one its other ops (an optimizer's update) use, so that
    # they stay ordered with this call.
    outer = graph
    while isinstance(outer, _control_flow_graph()):
        outer = outer.outer_graph
    captured = list(concrete.captured_inputs)
    if outer is not graph and hasattr(outer, "capture") and any(_eager(t) for t in captured):
        with outer.as_default():
            captured = [outer.capture(t) if _eager(t) else t for t in captured]
        concrete.set_external_captures(captured)
    results = iter(concrete())
    leaves = [next(results) if t else leaf for leaf, t in zip(kept["leaves"], kept["is_tf"],
                                                                 strict=True)]
    return pytree.tree_unflatten(leaves, kept["spec"])


@functools.cache
def _control_flow_graph() -> Any:
    """The class of TensorFlow's while-loop and cond bodies (and their gradients)."""
    module = importlib.import_module("tensorflow.python.ops.control_flow_v2_func_graphs")
    return module.ControlFlowFuncGraph


@functools.cache
def _while_body_graph() -> Any:
    """The class of TensorFlow's while-loop bodies (a Keras RNN's step, a `tf.range` loop)."""
    module = importlib.import_module("tensorflow.python.ops.control_flow_v2_func_graphs")
    return module.WhileBodyFuncGraph


def _eager(value: Any) -> bool:
    """Whether `value` is an eager tensor (one with no graph)."""
    return isinstance(value, tf.Tensor) and getattr(value, "graph", None) is None


# ---- checking one gradient -------------------------------------------------------------------


def check_gradient(grad: Any, meta: Any, op: str, name: str) -> Any:
    """Check one returned gradient against its input (a TensorFlow tensor); fix what the
    torch side fixes (broadcast shape, another float precision) and refuse the rest."""
    if meta is None:
        raise GradOverrideError(no_gradient_slot_message(op, name))
    if isinstance(grad, torch.Tensor):
        msg = (
            f"backward of `{op}` returned a torch tensor for `{name}`, a TensorFlow tensor in "
            "this call; write the rule in TensorFlow ops for TensorFlow inputs."
        )
        raise GradOverrideError(msg)
    if meta is SKIP and isinstance(grad, tf.IndexedSlices):
        return None  # not needed: dropped unchecked, as any gradient for such an input
    if isinstance(grad, tf.IndexedSlices):
        if grad.dense_shape is None and isinstance(meta, _Meta):
            # Rows of the input: the input says how many there are.
            rows = meta.runtime_shape()[0]
            grad = tf.math.unsorted_segment_sum(grad.values, grad.indices, rows)
        else:
            grad = tf.convert_to_tensor(grad)
    if not isinstance(grad, tf.Tensor):
        raise GradOverrideError(not_a_tensor_message(grad, op, name))
    if meta is SKIP:
        return None
    x: _Meta = meta
    if grad.dtype != x.dtype:
        both_float = grad.dtype.is_floating and x.dtype.is_floating
        both_complex = grad.dtype.is_complex and x.dtype.is_complex
        if not (both_float or both_complex):
            msg = dtype_message(
                grad.dtype.name, x.dtype.name, x.dtype.is_complex, op, name,
                f"`tf.cast(grad, {name}.dtype)`",
            )
            raise GradOverrideError(msg)
        grad = tf.cast(grad, x.dtype)
    return _fit_shape(grad, x, op, name)


def _fit_shape(grad: Any, x: _Meta, op: str, name: str) -> Any:
    """`grad` in `x`'s shape: equal, or summed down from a shape `x` broadcasts to."""
    g_shape, x_shape = grad.shape, x.shape
    if g_shape.rank is None or x_shape.rank is None:
        return _sum_to(grad, x, op, name)  # unknown rank: only the run-time shapes can tell
    if g_shape.is_fully_defined() and x_shape.is_fully_defined() and g_shape == x_shape:
        return grad
    extra = g_shape.rank - x_shape.rank
    tail = list(g_shape)[extra:] if extra >= 0 else []
    fits = extra >= 0 and all(
        s is None or g is None or s == 1 or s == g
        for s, g in zip(list(x_shape), tail, strict=True)
    )
    if not fits:
        raise GradOverrideError(shape_message(g_shape.as_list(), x_shape.as_list(), op, name))
    if g_shape.is_fully_defined() and x_shape.is_fully_defined():
        axes = list(range(extra)) + [
            extra + k for k, (s, g) in enumerate(zip(list(x_shape), tail, strict=True))
            if s == 1 and g != 1
        ]
        return tf.reshape(tf.reduce_sum(grad, axis=axes), x_shape)
    return _sum_to(grad, x, op, name)


def _sum_to(grad: Any, x: _Meta, op: str, name: str) -> Any:
    """Sum `grad` down to `x`'s run-time shape, as TensorFlow's broadcasting ops do.

    Only in graph mode with unknown dimensions, where the static check could not decide:
    the run-time shapes are checked by a `tf.debugging.Assert` carrying the message the
    static check gives, raised by TensorFlow as an `InvalidArgumentError`. XLA compiles
    assertions to nothing; there, a mismatch fails in the reshape instead.
    """
    shape = x.runtime_shape()
    grad_shape = tf.shape(grad)
    checks = []
    if grad.shape.rank is not None and x.shape.rank is not None:
        tail = grad_shape[grad.shape.rank - x.shape.rank :]
        fits = tf.reduce_all(tf.logical_or(tf.equal(shape, 1), tf.equal(shape, tail)))
        message = shape_message(grad.shape.as_list(), x.shape.as_list(), op, name)
        checks.append(tf.debugging.Assert(fits, [message]))
    with tf.control_dependencies(checks):
        _, axes = tf.raw_ops.BroadcastGradientArgs(s0=grad_shape, s1=shape)
        return tf.reshape(tf.reduce_sum(grad, axis=axes), shape)


# ---- once_differentiable --------------------------------------------------------------------


def _once_differentiable(op: str, grad: Any) -> Any:
    """`grad`, unchanged; differentiating it again raises instead of giving a wrong value."""

    @tf.custom_gradient  # type: ignore[untyped-decorator]
    def guard(value: Any) -> Any:
        def second(_: Any) -> Any:
            msg = (
                f"backward of `{op}` runs without recording a graph (once_differentiable=True; "
                "a go.bridge always is) and cannot be differentiated again; for higher-order "
                "gradients, write the rule in differentiable ops without once_differentiable."
            )
            raise GradOverrideError(msg)

        return tf.identity(value), second

    return guard(grad)


# ---- values, containers and variables --------------------------------------------------------


def _read(value: Any) -> Any:
    """A variable (TensorFlow's or Keras') as the tensor it holds; a ragged or sparse
    tensor as it is (it gets no gradient: see `_refuse_composite`)."""
    if isinstance(value, (tf.Tensor, *_COMPOSITE)) or not is_tensorflow(value):
        return value
    return tf.convert_to_tensor(value)


def _holds_torch(values: Any) -> bool:
    for value in values:
        if isinstance(value, torch.Tensor):
            return True
        if isinstance(value, (tuple, list)) and _holds_torch(value):
            return True
        if isinstance(value, dict) and _holds_torch(value.values()):
            return True
    return False


def _dense(grad: Any) -> Any:
    return tf.convert_to_tensor(grad) if isinstance(grad, tf.IndexedSlices) else grad


def _differentiable(dtype: Any) -> bool:
    return bool(dtype.is_floating or dtype.is_complex)


def _per_leaf(owned: tuple[bool, ...], layout: Any) -> tuple[bool, ...]:
    if layout is None:
        return owned
    return tuple(
        o for o, entry in zip(owned, layout, strict=True)
        for _ in range(1 if entry is None else entry[1])
    )


def _output_leaves(output: Any) -> tuple[list[Any], Any, tuple[int, ...]]:
    """The output's leaves, its structure, and which leaves are tensors that can carry a
    gradient (the others pass through untouched)."""
    if isinstance(output, tf.Tensor):  # the common case, without a tree walk
        return [output], _ONE_LEAF, ((0,) if _differentiable(output.dtype) else ())
    leaves, spec = pytree.tree_flatten(output)
    leaves = [_read(leaf) for leaf in leaves]
    picked = tuple(
        j for j, leaf in enumerate(leaves)
        if isinstance(leaf, tf.Tensor) and _differentiable(leaf.dtype)
    )
    return leaves, spec, picked


def _rebuild(leaves: list[Any], spec: Any, picked: tuple[int, ...], results: Any) -> Any:
    out = list(leaves)
    for j, result in zip(picked, results, strict=True):
        out[j] = result
    return pytree.tree_unflatten(out, spec)


def _variable_name(variable: Any) -> str:
    name = str(getattr(variable, "path", None) or variable.name)
    return name[:-2] if name.endswith(":0") else name


def _variable_keys(
    variables: Any, names: list[str], parameters: dict[str, int]
) -> list[tuple[str, ...]]:
    """Per variable, the dict keys that address it, preferred first: its name, its
    TensorFlow name (`"w:0"`), and its last path component (`"kernel"` of `"dense/kernel"`)
    when no other variable read by the forward shares it. A key that is also one of the op's
    parameters addresses the parameter, so it is left out."""
    short = [n.rsplit("/", 1)[-1] for n in names]
    keys: list[tuple[str, ...]] = []
    for variable, name, s in zip(variables, names, short, strict=True):
        candidates = [name, str(variable.name)]
        if short.count(s) == 1:
            candidates.append(s)
        unique = dict.fromkeys(k for k in candidates if k not in parameters)
        keys.append(tuple(unique) or (str(variable.name),))
    return keys
