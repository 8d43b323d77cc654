"""`go.monitor`: what it records is checked against tensor hooks on the same run (the
gradient arriving at an override's output, the gradient reaching its input), computed by
hand; and nothing of it is left once the `with` block ends."""

from __future__ import annotations

import gc
import math
import pickle
import sys
import threading
import warnings
import weakref
from typing import Any

import pytest
import torch
from torch import nn

import gradoverride as go
from gradoverride import recipes

# -- the hand computation -----------------------------------------------------------------


class Taps:
    """Tensor hooks collecting, per call of an override, the gradient at its output
    (arriving) and at its input (returned): the reference the monitor must match."""

    def __init__(self) -> None:
        self.arriving: list[torch.Tensor] = []
        self.returned: list[torch.Tensor] = []

    def around(self, fn, x: torch.Tensor) -> torch.Tensor:
        # `x` is a fresh tensor read only by the override, so its gradient is exactly what
        # the override returned.
        x = x.view_as(x) if x.requires_grad else x
        x.register_hook(lambda g: self.returned.append(g.clone()))
        y = fn(x)
        y.register_hook(lambda g: self.arriving.append(g.clone()))
        return y

    def expected(self) -> tuple[float, float, float | None]:
        grad_in = math.sqrt(sum(float(g.double().square().sum()) for g in self.arriving))
        grad_out = math.sqrt(sum(float(g.double().square().sum()) for g in self.returned))
        # Pair calls: the hooks fire in reverse call order on both sides.
        nonzero = sum(int((a != 0).sum()) for a in self.arriving)
        zeroed = sum(int(((r == 0) & (a != 0)).sum())
                     for a, r in zip(self.arriving, self.returned, strict=True))
        return grad_in, grad_out, zeroed / nonzero if nonzero else None

    def clear(self) -> None:
        self.arriving, self.returned = [], []


def _only(mon: go.Monitor) -> list[go.StepRecord]:
    history = mon.history
    assert len(history) == 1, history
    return next(iter(history.values()))


class Binarized(nn.Module):
    def __init__(self, taps: Taps | None = None) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.act = recipes.binarize()
        self.out = nn.Linear(6, 1)
        self.taps = taps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        b = self.taps.around(self.act, h) if self.taps else self.act(h)
        return self.out(b)


def test_norms_and_zeroed_match_tensor_hooks_for_each_step(device: torch.device) -> None:
    torch.manual_seed(0)
    taps = Taps()
    model = Binarized(taps).to(device)
    with go.monitor(model) as mon:
        expected = []
        for _ in range(3):
            taps.clear()
            model(torch.randn(8, 4, device=device) * 2).sum().backward()
            expected.append(taps.expected())
    records = _only(mon)
    assert [r.step for r in records] == [0, 1, 2]
    assert next(iter(mon.history)) == "(model): binarize(clip=1.0, inclusive=True, keep='input')"
    for record, (grad_in, grad_out, zeroed) in zip(records, expected, strict=True):
        assert record.calls == 1
        assert record.grad_in == pytest.approx(grad_in, rel=1e-6)
        assert record.grad_out == pytest.approx(grad_out, rel=1e-6)
        assert zeroed is not None and 0 < zeroed < 1  # the window did zero some
        assert record.zeroed == pytest.approx(zeroed, abs=1e-12)
        assert (record.nan_in, record.inf_in, record.nan_out, record.inf_out) == (0, 0, 0, 0)


class Recurrent(nn.Module):
    """One spike recipe called at every time step, in two layers."""

    def __init__(self, taps: dict[str, Taps] | None = None) -> None:
        super().__init__()
        self.spike = recipes.spike(surrogate="fast_sigmoid")
        self.a = nn.Linear(3, 5)
        self.b = nn.Linear(5, 2)
        self.taps = taps

    def _fire(self, layer: str, v: torch.Tensor) -> torch.Tensor:
        if self.taps:
            return self.taps[layer].around(self.spike, v)
        return self.spike(v)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        out = 0
        for x in xs:
            out = out + self._fire("b", self.b(self._fire("a", self.a(x))))
        return out


def test_many_calls_in_a_step_are_one_row_per_place() -> None:
    # The same recipe, called at every time step in two layers of the model's own forward:
    # one place, so one row, with the norms over all its calls.
    torch.manual_seed(0)
    taps = {"a": Taps(), "b": Taps()}
    model = Recurrent(taps)
    with go.monitor(model) as mon:
        model(torch.randn(7, 4, 3)).sum().backward()
    rows = mon.summary().rows
    assert [r.label for r in rows] == [f"(model): {model.spike!r}"]
    record = _only(mon)[0]
    assert record.calls == 14
    both = Taps()
    both.arriving = taps["a"].arriving + taps["b"].arriving
    both.returned = taps["a"].returned + taps["b"].returned
    grad_in, grad_out, _ = both.expected()
    assert record.grad_in == pytest.approx(grad_in, rel=1e-6)
    assert record.grad_out == pytest.approx(grad_out, rel=1e-6)


class LIF(nn.Module):
    def __init__(self, n_in: int, n_out: int, spike: recipes.spike, taps: Taps) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        self.spike = spike
        self.taps = taps

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        v = xs.new_zeros(xs.shape[1], self.fc.out_features)
        out = []
        for x in xs:
            v = 0.9 * v + self.fc(x)
            s = self.taps.around(self.spike, v - 1.0)
            v = v - s.detach()
            out.append(s)
        return torch.stack(out)


def test_rows_are_at_the_module_whose_forward_calls_the_recipe(device: torch.device) -> None:
    # Many calls a step: their gradients are stacked (on a CPU, into kept buffers).
    torch.manual_seed(0)
    spike = recipes.spike()
    taps = {"hidden": Taps(), "readout": Taps()}
    model = nn.Sequential()
    model.add_module("hidden", LIF(3, 6, spike, taps["hidden"]))
    model.add_module("readout", LIF(6, 2, spike, taps["readout"]))
    model.to(device)
    with go.monitor(model) as mon:
        model(torch.rand(5, 4, 3, device=device) * 3).sum().backward()
    history = mon.history
    assert list(history) == [f"hidden: {spike!r}", f"readout: {spike!r}"]
    for name, records in zip(("hidden", "readout"), history.values(), strict=True):
        grad_in, grad_out, zeroed = taps[name].expected()
        assert records[0].calls == 5
        assert records[0].grad_in == pytest.approx(grad_in, rel=1e-6)
        assert records[0].grad_out == pytest.approx(grad_out, rel=1e-6)
        assert records[0].zeroed == pytest.approx(zeroed, abs=1e-12)


def test_every_records_one_step_in_n() -> None:
    model = Binarized()
    with go.monitor(model, every=3) as mon:
        for _ in range(7):
            model(torch.randn(2, 4)).sum().backward()
    assert [r.step for r in _only(mon)] == [0, 3, 6]
    assert mon.steps == 7
    assert "7 steps, every 3" in str(mon.summary())


def test_each_backward_pass_is_a_step() -> None:
    # Two backward passes after one forward: two steps, each with its own gradients.
    torch.manual_seed(0)
    taps = Taps()
    model = Binarized(taps)
    with go.monitor(model) as mon:
        out = model(torch.randn(8, 4) * 2)
        out[:4].sum().backward(retain_graph=True)
        out[4:].sum().backward()
    records = _only(mon)
    assert [(r.step, r.calls) for r in records] == [(0, 1), (1, 1)]
    for record, arriving, returned in zip(records, taps.arriving, taps.returned, strict=True):
        assert record.grad_in == pytest.approx(float(arriving.norm()), rel=1e-6)
        assert record.grad_out == pytest.approx(float(returned.norm()), rel=1e-6)


class Block(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight

    def backward(self, grad, *, x):
        return {"x": 2 * grad * self.weight, "weight": (grad * x).sum(0)}


def test_a_module_rule_returns_its_parameters_gradients_too() -> None:
    torch.manual_seed(0)
    block = Block()
    model = nn.Sequential(nn.Linear(3, 3), block)
    x = torch.randn(4, 3)
    with go.monitor(model) as mon:
        h = model[0](x)
        h.retain_grad()
        y = block(h)
        y.retain_grad()
        y.square().sum().backward()
    assert list(mon.history) == ["1: Block"]
    record = mon.history["1: Block"][0]
    assert record.grad_in == pytest.approx(float(y.grad.norm()), rel=1e-6)
    expected = math.sqrt(float(h.grad.square().sum()) + float(block.weight.grad.square().sum()))
    assert record.grad_out == pytest.approx(expected, rel=1e-6)
    # The input's gradient pairs with the output's (same shape): nothing zeroed.
    assert record.zeroed == 0.0


def test_a_rule_owning_some_inputs_is_measured_without_the_passed_on_gradient() -> None:
    # `owns="input"`: the weight keeps its ordinary gradient, which autograd computes
    # through the forward's graph: not what the rule returned.
    torch.manual_seed(0)
    linear = nn.Linear(4, 2)
    go.override_backward(linear, lambda g, *, module: -(g @ module.weight), owns="input")
    x = torch.randn(3, 4, requires_grad=True)
    with go.monitor(linear) as mon:
        y = linear(x)
        y.retain_grad()
        y.sum().backward()
    record = mon.history["(model): Linear"][0]
    assert record.grad_in == pytest.approx(float(y.grad.norm()), rel=1e-6)
    assert record.grad_out == pytest.approx(float(x.grad.norm()), rel=1e-6)


@pytest.mark.parametrize("at", ["inputs", "outputs", "parameters"])
def test_grad_hooks_are_measured_at_their_place(at: str) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(3, 3)
    model = nn.Sequential(layer)
    go.grad_hook(layer, lambda g: g.clamp(-0.1, 0.1), at=at)
    x = torch.randn(5, 3, requires_grad=True)
    with go.monitor(model) as mon:
        y = model(x)
        y.square().sum().backward()
    (label,) = mon.history
    assert label.startswith("0: grad_hook(") and label.endswith(f"<lambda>) at {at}")
    record = mon.history[label][0]
    if at == "outputs":
        grad = 2 * y.detach()  # what arrives at the output, before the transform
        assert record.grad_in == pytest.approx(float(grad.norm()), rel=1e-6)
        assert record.grad_out == pytest.approx(float(grad.clamp(-0.1, 0.1).norm()), rel=1e-6)
    elif at == "inputs":
        assert record.grad_out == pytest.approx(float(x.grad.norm()), rel=1e-6)
        # What arrived at the input before the clamp: the plain gradient.
        plain = torch.autograd.grad((x @ layer.weight.T + layer.bias).square().sum(), x)[0]
        assert record.grad_in == pytest.approx(float(plain.norm()), rel=1e-5)
    else:
        assert record.calls == 2  # weight and bias
        returned = math.sqrt(sum(float(p.grad.square().sum()) for p in layer.parameters()))
        assert record.grad_out == pytest.approx(returned, rel=1e-6)


def test_nan_and_inf_are_counted_not_raised() -> None:
    @go.custom_backward
    def poison(x):
        return x.clone()

    @poison.backward
    def _(grad, *, x):
        out = grad.clone()
        out[0] = float("nan")
        out[1] = float("inf")
        return out

    class M(nn.Module):
        def forward(self, x):
            return poison(x)

    model = M()
    x = torch.ones(4, requires_grad=True)
    with go.monitor(model) as mon:
        model(x).sum().backward()
    record = _only(mon)[0]
    assert (record.nan_in, record.inf_in, record.nan_out, record.inf_out) == (0, 0, 1, 1)
    assert record.grad_in == pytest.approx(2.0)
    assert record.grad_out == pytest.approx(math.sqrt(2.0))  # the finite elements
    assert mon.summary().rows[0].nonfinite == 2


@pytest.mark.parametrize("scale", [1e-24, 1e-20, 1.0, 1e20])
def test_tiny_and_huge_float32_gradients_keep_their_norms_and_zeroed(scale: float) -> None:
    # A vanishing gradient is what the monitor is for: its squares (and the product of
    # the arriving and returned gradients) underflow in float32, and must not read as zero.
    torch.manual_seed(0)
    taps = Taps()

    @go.custom_backward
    def halve(x):
        return x / 2

    @halve.backward
    def _(grad, *, x):
        return grad * (x > 0) / 2  # zeroes the negative half

    class M(nn.Module):
        def forward(self, x):
            return taps.around(halve, x) * scale

    model = M()
    with go.monitor(model) as mon:
        model(torch.randn(1000, requires_grad=True)).sum().backward()
    record = _only(mon)[0]
    grad_in, grad_out, zeroed = taps.expected()
    assert grad_in > 0
    # (approx's default absolute tolerance, 1e-12, would pass a zero norm here)
    assert record.grad_in == pytest.approx(grad_in, rel=1e-6, abs=0)
    assert record.grad_out == pytest.approx(grad_out, rel=1e-6, abs=0)
    assert record.zeroed == pytest.approx(zeroed, abs=1e-12)


def test_a_model_without_overrides_says_it_recorded_nothing() -> None:
    model = nn.Linear(2, 2)
    with go.monitor(model) as mon:
        model(torch.randn(3, 2)).sum().backward()
    assert mon.history == {}
    assert str(mon.summary()) == (
        "go.monitor of Linear: nothing recorded (no gradient override of Linear ran backward "
        "in eager mode; steps compiled with torch.compile and torch.func transforms are not "
        "recorded)"
    )
    assert mon.steps == 0


def test_an_override_called_outside_the_model_is_not_recorded() -> None:
    model = Binarized()
    other = recipes.binarize()
    with go.monitor(model) as mon:
        other(torch.randn(3, requires_grad=True)).sum().backward()
        model(torch.randn(2, 4)).sum().backward()
    assert len(_only(mon)) == 1


def test_nothing_is_left_after_the_block() -> None:
    model = Binarized()
    layer = nn.Linear(3, 3)
    go.grad_hook(layer, recipes.reverse_grad(), at="parameters")
    go.grad_hook(layer, recipes.reverse_grad(), at="outputs")
    container = nn.ModuleList([model, layer])
    op = model.act
    model(torch.randn(2, 4)).sum().backward()  # the ops' first call checked
    inner = next(o for o in go._decorators._OPS if o.__name__ == "_ste_window")
    before_class = type(inner)
    before_state = dict(vars(inner))
    before_hooks = dict(layer._forward_hooks), dict(layer._forward_pre_hooks)
    before_param_hooks = {n: list(p._backward_hooks.values()) for n, p in layer.named_parameters()}
    at_outputs = next(h for h in layer._forward_hooks.values() if hasattr(h, "transform"))
    before_transform = at_outputs.transform
    with go.monitor(container):
        model(torch.randn(2, 4)).sum().backward()
        layer(torch.randn(2, 3)).sum().backward()
        assert go._function.RECORDERS
    assert not go._function.RECORDERS  # what the ops consult
    assert not torch.nn.modules.module._has_any_global_hook()  # the recorder's module hooks
    assert type(inner) is before_class and vars(inner) == before_state
    function = type(model.act(torch.randn(2, requires_grad=True)).grad_fn)._forward_cls
    assert function.__dict__["backward"].__func__.__name__ == "backward"
    assert (dict(layer._forward_hooks), dict(layer._forward_pre_hooks)) == before_hooks
    assert at_outputs.transform is before_transform
    after = {n: list(p._backward_hooks.values()) for n, p in layer.named_parameters()}
    assert after == before_param_hooks
    assert not container._forward_pre_hooks and not container._forward_hooks
    assert op is model.act


def test_a_module_pickled_while_monitored_keeps_its_own_hooks() -> None:
    layer = nn.Linear(3, 3)
    go.grad_hook(layer, recipes.reverse_grad(), at="outputs")
    with go.monitor(layer):
        loaded = pickle.loads(pickle.dumps(layer))
    hook = next(iter(loaded._forward_hooks.values()))
    assert repr(hook.transform.__self__) == "reverse_grad(scale=1.0)"


def test_torch_func_transforms_run_unrecorded_with_their_gradients() -> None:
    model = Binarized()
    x = torch.randn(3, 4)
    params = dict(model.named_parameters())

    def loss(p):
        return torch.func.functional_call(model, p, (x,)).sum()

    expected = torch.func.grad(loss)(params)
    with go.monitor(model) as mon:
        got = torch.func.grad(loss)(params)
    assert mon.history == {}
    for name in params:
        torch.testing.assert_close(got[name], expected[name])


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # dynamo's
# torch's, about the recorder's global module hooks (which its own warning explains):
@pytest.mark.filterwarnings("ignore:Using `torch.compile.module.` when there are global hooks")
def test_compiled_steps_run_unrecorded_with_their_gradients() -> None:
    torch.manual_seed(0)
    model = Binarized()
    x = torch.randn(3, 4)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with go.monitor(model) as mon:
        with pytest.warns(go.GradOverrideWarning, match=r"go\.monitor of Binarized: "
                          r"Binarized runs compiled \(torch\.compile\), and the overrides "
                          r"inside a compiled call are not recorded.*`model`, not "
                          r"`torch\.compile\(model\)`"):
            compiled(x).sum().backward()
        model.zero_grad()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            compiled(x).sum().backward()
        assert not [w for w in seen if w.category is go.GradOverrideWarning]  # warned once
    assert mon.history == {}
    assert "steps compiled with torch.compile" in str(mon.summary())
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e)
    with pytest.raises(go.GradOverrideError, match=r"this Binarized is compiled with "
                       r"torch\.compile.*`with go\.monitor\(model\):`"):
        go.monitor(torch.compile(model, backend="aot_eager"))


def test_checkpointed_forward_is_recorded_once() -> None:
    torch.manual_seed(0)
    taps = Taps()
    inner = Binarized(taps)

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)

    model = Checkpointed()
    with go.monitor(model) as mon:
        model(torch.randn(8, 4) * 2).sum().backward()
    record = _only(mon)[0]
    assert record.calls == 1
    grad_in, grad_out, _ = taps.expected() if len(taps.arriving) == 1 else (None, None, None)
    assert grad_in is not None
    assert record.grad_in == pytest.approx(grad_in, rel=1e-6)
    assert record.grad_out == pytest.approx(grad_out, rel=1e-6)


def test_two_threads_record_every_backward() -> None:
    model = Binarized()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            for _ in range(5):
                model(torch.randn(4, 4)).sum().backward()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    with go.monitor(model) as mon:
        threads = [threading.Thread(target=train) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert mon.steps == 10
    assert sum(r.calls for r in _only(mon)) == 10


def test_passes_of_two_threads_running_at_once_are_separate_steps() -> None:
    # Thread A's backward waits, between its two overrides, until thread B's whole pass
    # has run: B's pass is a step of its own, and A's still is one.
    b_done = threading.Event()
    waiting = threading.Event()

    @go.custom_backward
    def gate(x):
        return x.clone()

    @gate.backward
    def _(grad, *, x):
        if threading.current_thread().name == "A":
            waiting.set()
            assert b_done.wait(10)
        return grad

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = recipes.binarize()

        def forward(self, x):
            return self.act(gate(x))  # backward: binarize, then the gate

    model = M()

    def run(name: str) -> None:
        model(torch.randn(3, requires_grad=True)).sum().backward()
        if name == "B":
            b_done.set()

    with go.monitor(model) as mon:
        a = threading.Thread(target=run, args=("A",), name="A")
        a.start()
        assert waiting.wait(10)
        b = threading.Thread(target=run, args=("B",), name="B")
        b.start()
        b.join()
        a.join()
    assert mon.steps == 2
    for records in mon.history.values():
        assert [r.calls for r in records] == [1, 1]


def test_a_forward_another_thread_runs_as_the_first_one_ends_is_recorded() -> None:
    # The first forward's end takes torch's global module hooks off. A forward another
    # thread runs right then (here: while the recorder reads the model's paths again, which
    # the model's `named_modules` sees) is recorded as any: the model's modules keep hooks of
    # their own throughout.
    class Model(Binarized):
        ended = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            self.ended = threading.current_thread() is threading.main_thread()
            return out

        def named_modules(self, *args: Any, **kwargs: Any) -> Any:
            if self.ended:
                self.ended = False
                other = threading.Thread(target=train, args=(taps_b,))
                other.start()
                other.join()
            return super().named_modules(*args, **kwargs)

    taps_a, taps_b = Taps(), Taps()
    model = Model()

    def train(taps: Taps) -> None:
        model.taps = taps
        model(torch.randn(4, 4)).sum().backward()

    with go.monitor(model) as mon:
        train(taps_a)
    assert mon.steps == 2
    records = _only(mon)
    assert [r.calls for r in records] == [1, 1]
    # B's step ran inside A's forward's end, so it is step 0 and A's step 1.
    for record, taps in zip(records, (taps_b, taps_a), strict=True):
        grad_in, grad_out, _ = taps.expected()
        assert record.grad_in == pytest.approx(grad_in, rel=1e-6)
        assert record.grad_out == pytest.approx(grad_out, rel=1e-6)


def test_a_module_added_in_the_first_forward_keeps_its_row_in_another_thread() -> None:
    # A module added to the model during its first forward is hooked as torch registers it:
    # a forward another thread runs as that first forward ends (when torch's global module
    # hooks go) gives its override its own row.
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = recipes.binarize()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(x)

    class Model(nn.Module):
        ended = False

        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not hasattr(self, "extra"):
                self.extra = Block()
            out = self.extra(self.fc(x))
            self.ended = threading.current_thread() is threading.main_thread()
            return out

        def named_modules(self, *args: Any, **kwargs: Any) -> Any:
            if self.ended:
                self.ended = False
                other = threading.Thread(target=train)
                other.start()
                other.join()
            return super().named_modules(*args, **kwargs)

    model = Model()

    def train() -> None:
        model(torch.randn(2, 4)).sum().backward()

    with go.monitor(model) as mon:
        train()
        train()
    assert mon.steps == 3
    row = f"extra: {recipes.binarize()!r}"
    assert list(mon.history) == [row]
    assert [(r.step, r.calls) for r in mon.history[row]] == [(0, 1), (1, 1), (2, 1)]


def test_a_pre_hook_prepended_while_monitored_calls_overrides_of_its_module() -> None:
    # A forward pre-hook registered first (`prepend=True`) after the monitor started: the
    # override it calls is its module's, from the first step on.
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    model = nn.Sequential(nn.Linear(4, 4), Block(), nn.Linear(4, 1))
    with go.monitor(model) as mon:
        model[1].register_forward_pre_hook(
            lambda module, args: (recipes.scale_grad(0.5)(args[0]),), prepend=True)
        for _ in range(3):
            model(torch.randn(3, 4)).sum().backward()
    row = f"1: {recipes.scale_grad(0.5)!r}"
    assert {label: [r.step for r in records] for label, records in mon.history.items()} == {
        row: [0, 1, 2]}


def test_an_error_in_a_backward_pass_leaves_the_next_steps_recorded() -> None:
    # The error skips the pass's end (its queued callbacks): the next passes must still be
    # steps of their own, not merged into one and kept until the block ends.
    fail = [False]

    @go.custom_backward
    def fragile(x):
        return x.clone()

    @fragile.backward
    def _(grad, *, x):
        if fail[0]:
            raise RuntimeError("a rule that fails")
        return grad

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = recipes.binarize()

        def forward(self, x):
            return self.act(fragile(x))  # backward: binarize, then fragile

    model = M()
    with go.monitor(model) as mon:
        model(torch.randn(3, requires_grad=True)).sum().backward()
        fail[0] = True
        with pytest.raises(RuntimeError, match="a rule that fails"):
            model(torch.randn(3, requires_grad=True)).sum().backward()
        fail[0] = False
        for _ in range(2):
            model(torch.randn(3, requires_grad=True)).sum().backward()
            assert not mon._recorder._pending  # no gradient kept past its pass
    assert mon.steps == 4
    history = mon.history
    # The failed pass is step 1, with what ran before the error.
    binarize = history["(model): binarize(clip=1.0, inclusive=True, keep='input')"]
    assert [(r.step, r.calls) for r in binarize] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    assert [(r.step, r.calls) for r in history["(model): fragile"]] == [(0, 1), (2, 1), (3, 1)]


@pytest.mark.filterwarnings("ignore:.*use_reentrant:UserWarning")
@pytest.mark.parametrize("every", [1, 2])
def test_a_reentrant_checkpoint_is_part_of_the_step_it_runs_in(every: int) -> None:
    # A reentrant checkpoint recomputes each segment and runs its backward as a nested
    # pass: each segment is still part of the one step of the loss's backward.
    torch.manual_seed(0)

    class Segments(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Binarized() for _ in range(3)])

        def forward(self, x):
            return sum(torch.utils.checkpoint.checkpoint(b, x, use_reentrant=True)
                       for b in self.blocks)

    model = Segments()
    with go.monitor(model, every=every) as mon:
        for _ in range(4):
            model(torch.randn(8, 4, requires_grad=True)).sum().backward()
    assert mon.steps == 4
    assert len(mon.history) == 3
    for records in mon.history.values():
        assert [(r.step, r.calls) for r in records] == [(s, 1) for s in range(0, 4, every)]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"go.monitor needs the model as an "
                       r"nn.Module; got function"):
        go.monitor(lambda x: x)
    with pytest.raises(go.GradOverrideTypeError, match=r"`every` must be a positive integer.*"
                       r"got 0"):
        go.monitor(nn.Linear(1, 1), every=0)
    model = nn.Linear(1, 1)
    mon = go.monitor(model)
    with mon, pytest.raises(go.GradOverrideError, match=r"already has an active go\.monitor"):
        go.monitor(model).__enter__()
    with pytest.raises(go.GradOverrideError, match="is entered once"), mon:
        pass


def test_a_second_recorder_while_one_records_is_refused() -> None:
    # Two models sharing a recipe's op (the recipes' ops are module-level): a second
    # monitor, or go.overrides' example forward, used to record nothing, silently.
    generator, discriminator = Binarized(), Binarized()
    x = torch.randn(2, 4)
    with go.monitor(generator) as mon:
        with pytest.raises(go.GradOverrideError, match=(
            r"go\.monitor of Binarized cannot start while go\.monitor of Binarized is "
            r"recording.*monitor one container holding them \(`go\.monitor\(nn\.ModuleList"
        )):
            go.monitor(discriminator).__enter__()
        with pytest.raises(go.GradOverrideError, match=(
            r"go\.overrides\(Binarized, example inputs\) cannot start while go\.monitor of "
            r"Binarized is recording.*`go\.overrides\(model\)` without example inputs"
        )):
            go.overrides(discriminator, x)
        assert [r.name for r in go.overrides(discriminator)] == [
            "binarize(clip=1.0, inclusive=True, keep='input')"]
        generator(x).sum().backward()
    assert len(_only(mon)) == 1
    # Refused starts leave nothing behind: both work once the first monitor is left.
    assert [r.active for r in go.overrides(discriminator, x)] == [True]
    with go.monitor(discriminator) as second:
        discriminator(x).sum().backward()
    assert len(_only(second)) == 1


def test_plot_writes_a_png(tmp_path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is the `plot` extra")
    model = Binarized()
    with go.monitor(model) as mon:
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
    figure = mon.plot(tmp_path / "flow.png")
    assert (tmp_path / "flow.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib.figure import Figure

    assert isinstance(figure, Figure)  # for TensorBoard's add_figure or wandb.Image
    # Drawn without a path: nothing written, the figure's lines are the records.
    norms = mon.plot().axes[0]
    [(label, records)] = mon.history.items()
    assert list(norms.lines[0].get_ydata()) == [r.grad_out for r in records]
    assert norms.lines[0].get_label() == label
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flow.png"]
    with pytest.raises(go.GradOverrideError, match="writes a PNG; got the path"):
        mon.plot(tmp_path / "flow.jpg")


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with go.monitor(nn.Linear(1, 1)) as mon:
        pass
    with pytest.raises(go.GradOverrideError, match=r"pip install 'gradoverride\[plot\]'"):
        mon.plot(tmp_path / "x.png")


def test_a_recipe_made_at_each_call_is_one_row() -> None:
    class Inline(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            # ste_round's op is not given the recipe: the row still names the recipe.
            return (recipes.binarize()(self.fc(x)) + recipes.binarize(clip=2.0)(x)
                    + recipes.ste_round()(x))

    model = Inline()
    with go.monitor(model) as mon:
        for _ in range(3):
            model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert list(mon.history) == [
        "(model): binarize(clip=1.0, inclusive=True, keep='input')",
        "(model): binarize(clip=2.0, inclusive=True, keep='input')",
        "(model): ste_round()",
    ]
    assert [len(records) for records in mon.history.values()] == [3, 3, 3]


def test_ops_and_modules_made_while_monitoring_are_recorded() -> None:
    model = nn.Sequential()
    with go.monitor(model) as mon:

        class Late(go.Module):
            def __init__(self) -> None:
                super().__init__()
                self.w = nn.Parameter(torch.ones(3))

            def forward(self, x):
                return x * self.w

            def backward(self, grad, *, x):
                return {"x": 3 * grad, "w": None}

        rounding = go.straight_through(torch.round)

        class Rounds(nn.Module):
            def forward(self, x):
                return rounding(x)

        model.add_module("late", Late())
        model.add_module("rounds", Rounds())
        x = torch.randn(2, 3, requires_grad=True)
        model(x).sum().backward()
    assert list(mon.history) == ["late: Late", "rounds: round"]
    expected = float((3 * torch.ones(2, 3)).norm())  # the rule's input gradient
    assert mon.history["late: Late"][0].grad_out == pytest.approx(expected)


def test_a_copy_made_while_monitored_has_the_plain_transform() -> None:
    import copy

    layer = nn.Linear(3, 3)
    go.grad_hook(layer, recipes.reverse_grad(), at="outputs")
    go.grad_hook(layer, recipes.reverse_grad(), at="inputs")
    with go.monitor(layer):
        twin = copy.deepcopy(layer)
    hooks = [*twin._forward_hooks.values(), *twin._forward_pre_hooks.values()]
    transforms = [h.transform for h in hooks if hasattr(h, "transform")]
    assert len(transforms) == 2
    assert all(repr(t.__self__) == "reverse_grad(scale=1.0)" for t in transforms)


def test_the_first_calls_check_runs_once_under_the_monitor(monkeypatch) -> None:
    # An op first called inside the monitor: its first eager call is checked (captured
    # tensors, in-place changes), then it takes its fast path, as outside the monitor.
    from gradoverride import _audit

    @go.custom_backward
    def fresh(x):
        return x * 2

    @fresh.backward
    def _(grad, *, x):
        return grad

    calls = []
    real = _audit.audit_call
    monkeypatch.setattr(_audit, "audit_call", lambda *a: calls.append(1) or real(*a))

    class M(nn.Module):
        def forward(self, x):
            return fresh(x)

    model = M()
    with go.monitor(model) as mon:
        for _ in range(3):
            model(torch.ones(2, requires_grad=True)).sum().backward()
    assert len(calls) == 1
    assert len(mon.history["(model): fresh"]) == 3


def test_large_stacked_gradients_match_tensor_hooks() -> None:
    # Above the size where a CPU's stacks and temporaries go to the monitor's kept buffers;
    # two steps, so the second reuses them.
    torch.manual_seed(0)
    spike = recipes.spike(surrogate="triangle")  # zero outside its support: zeroed > 0
    taps = Taps()
    model = LIF(8, 64, spike, taps)
    with go.monitor(model) as mon:
        expected = []
        for _ in range(2):
            taps.clear()
            model(torch.rand(5, 64, 8) * 4).square().sum().backward()
            expected.append(taps.expected())
    records = _only(mon)
    for record, (grad_in, grad_out, zeroed) in zip(records, expected, strict=True):
        assert record.calls == 5
        assert record.grad_in == pytest.approx(grad_in, rel=1e-5)
        assert record.grad_out == pytest.approx(grad_out, rel=1e-5)
        assert zeroed is not None and zeroed > 0
        assert record.zeroed == pytest.approx(zeroed, abs=1e-9)


def test_two_overrides_with_one_name_in_one_module_are_two_rows() -> None:
    def make(scale: float) -> go.CustomBackward:
        def q(x):
            return x.round()

        return go.custom_backward(q, backward=lambda grad, *, x: scale * grad)

    first, second = make(1.0), make(3.0)

    class Two(nn.Module):
        def forward(self, x):
            return first(x) + second(x)

    model = Two()
    with go.monitor(model) as mon:
        model(torch.ones(4, requires_grad=True)).sum().backward()
    assert list(mon.history) == ["(model): q", "(model): q #2"]
    outs = sorted(records[0].grad_out for records in mon.history.values())
    assert outs == pytest.approx([2.0, 6.0])
    assert [r.label for r in mon.summary().rows] == ["(model): q", "(model): q #2"]


def test_rows_stay_at_their_module_over_steps() -> None:
    # Rows by the module whose call runs: a helper called from the model, a child's
    # forward called directly (not through `__call__`, so no module call of its own: its
    # ops are the caller's), the child called, a loop, a forward hook; the same over steps.
    spike = recipes.spike()

    def helper(x):
        return spike(x)

    class Child(nn.Module):
        def forward(self, x):
            return spike(x) * 10

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.child = Child()
            self.blocks = nn.ModuleList([nn.Linear(3, 3) for _ in range(2)])
            self.hooked = nn.Linear(3, 3)
            self.hooked.register_forward_hook(lambda mod, inp, out: recipes.ste_round()(out))

        def forward(self, x):
            a = (lambda t: helper(t))(x)
            b = self.child.forward(x) + self.child(x)
            for block in self.blocks:
                x = spike(block(x))
            return a.sum() + b.sum() + self.hooked(x).sum()

    model = Parent()
    with go.monitor(model) as mon:
        for _ in range(3):
            model(torch.randn(2, 3, requires_grad=True)).backward()
    calls = {label: [r.calls for r in records] for label, records in mon.history.items()}
    assert calls == {
        f"(model): {spike!r}": [4, 4, 4],
        f"child: {spike!r}": [1, 1, 1],
        "hooked: ste_round()": [1, 1, 1],
    }


def test_with_every_n_passes_outside_the_model_are_not_steps() -> None:
    model = Binarized()
    other = recipes.binarize()  # the same op, used outside the model
    with go.monitor(model, every=2) as mon:
        for _ in range(4):
            model(torch.randn(2, 4)).sum().backward()
            other(torch.randn(3, requires_grad=True)).sum().backward()
    assert mon.steps == 4
    assert [r.step for r in _only(mon)] == [0, 2]


def test_a_recipe_with_tensor_settings_is_a_one_line_row() -> None:
    low = nn.Parameter(torch.tensor(-0.5))
    clamp = recipes.ste_clamp(low, 0.5, "zero")

    class M(nn.Module):
        def forward(self, x):
            return clamp(x)

    model = M()
    with go.monitor(model) as mon:
        model(torch.randn(5, requires_grad=True)).sum().backward()
    (label,) = mon.history
    assert "\n" not in label and label.startswith("(model): ste_clamp(")
    table = str(go.overrides(nn.Sequential(clamp.module())))
    assert len(table.splitlines()) == 4, table  # title, header, rule, one row


# -- where a row is: the module whose call runs, however the override is reached ----------


BIN = repr(recipes.binarize())  # binarize(clip=1.0, ...)


def _deep(x: torch.Tensor, act, depth: int) -> torch.Tensor:
    return act(x) if depth == 0 else _deep(x, act, depth - 1)


def test_an_override_called_far_below_a_module_forward_is_its_row() -> None:
    class Deep(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.act = recipes.binarize()

        def forward(self, x):
            return _deep(x, self.act, 20)  # 20 helper frames below the forward

    model = nn.Sequential(nn.Linear(4, 4), Deep())
    with go.monitor(model) as mon:
        (3 * model(torch.randn(5, 4))).sum().backward()
    [records] = mon.history.values()
    assert list(mon.history) == [f"1: {BIN}"]
    # The loss's gradient at the op's output: 3 at each of 20 elements.
    assert records[0].grad_in == pytest.approx(3 * math.sqrt(20))


_SEGMENT_ACT = recipes.binarize()


def _segment(h: torch.Tensor) -> torch.Tensor:
    return 2 * _SEGMENT_ACT(h)


@pytest.mark.filterwarnings("ignore:.*use_reentrant:UserWarning")
@pytest.mark.parametrize("reentrant", [True, False])
def test_an_override_in_a_checkpointed_function_is_recorded(reentrant: bool) -> None:
    # A reentrant checkpoint runs the function under no_grad and again inside the backward
    # pass, where no module's call runs: the recomputed call is the row of the first.
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x):
            return torch.utils.checkpoint.checkpoint(_segment, self.fc(x),
                                                     use_reentrant=reentrant)

    model = Model()
    with go.monitor(model) as mon:
        for _ in range(2):
            model(torch.randn(5, 4)).sum().backward()
    assert list(mon.history) == [f"(model): {BIN}"]
    records = mon.history[f"(model): {BIN}"]
    assert [(r.step, r.calls) for r in records] == [(0, 1), (1, 1)]
    assert records[0].grad_in == pytest.approx(2 * math.sqrt(30))  # 2 at each of 30


@pytest.mark.parametrize("at", ["parameters", "outputs", "inputs"])
def test_a_grad_hook_in_a_checkpointed_module_is_recorded_in_its_step(at: str) -> None:
    # With `use_reentrant=False` (torch's recommended mode) the recomputation's backward is
    # part of the step's pass: the hook's row and the recipe's share each step.
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = recipes.scale_grad(0.5).module()
            self.block = nn.Linear(4, 4)
            go.grad_hook(self.block, lambda g: g * 0.5, at=at)  # type: ignore[arg-type]

        def forward(self, x):
            h = self.act(self.fc(x))
            return torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)

    model = Model()
    with go.monitor(model) as mon:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
    assert mon.steps == 3
    assert len(mon.history) == 2
    assert all([r.step for r in rows] == [0, 1, 2] for rows in mon.history.values())


def test_a_module_called_outside_the_model_then_added_is_recorded() -> None:
    torch.manual_seed(0)
    late = Binarized()
    model = nn.ModuleList([Binarized()])
    x = torch.randn(3, 4)
    with go.monitor(model) as mon:
        late(x).sum().backward()  # not the model's yet: not a step
        model.append(late)
        for _ in range(2):
            sum(m(x).sum() for m in model).backward()
    assert sorted(mon.history) == [f"0: {BIN}", f"1: {BIN}"]
    assert [r.step for r in mon.history[f"1: {BIN}"]] == [0, 1]


def test_an_op_made_at_each_forward_is_one_row_and_not_kept() -> None:
    made: list[weakref.ref[Any]] = []

    class PerCall(nn.Module):
        def forward(self, x):
            @go.custom_backward
            def doubled_grad(x):
                return x.clone()

            @doubled_grad.backward
            def _(grad, *, x):
                return 2 * grad

            made.append(weakref.ref(doubled_grad))
            return doubled_grad(x) + doubled_grad(x)  # one op, two calls

    model = nn.Sequential(nn.Linear(3, 3), PerCall())
    with go.monitor(model) as mon:
        for _ in range(30):
            model(torch.randn(2, 3)).sum().backward()
        gc.collect()
        alive = [r for r in made if r() is not None]
    assert list(mon.history) == ["1: doubled_grad"]
    assert [r.calls for r in mon.history["1: doubled_grad"]] == [2] * 30
    assert len(alive) <= 2  # the row's own and the last step's, not one per step


def test_two_ops_made_at_each_forward_are_two_rows() -> None:
    class Two(nn.Module):
        def forward(self, x):
            ops = []
            for factor in (2.0, 3.0):
                @go.custom_backward
                def scaled_grad(x, factor=factor):
                    return x.clone()

                @scaled_grad.backward
                def _(grad, *, factor):
                    return factor * grad

                ops.append(scaled_grad)
            return ops[0](x) + ops[1](x)

    model = nn.Sequential(nn.Linear(3, 3), Two())
    with go.monitor(model) as mon:
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
    assert list(mon.history) == ["1: scaled_grad", "1: scaled_grad #2"]
    for records, factor in zip(mon.history.values(), (2.0, 3.0), strict=True):
        # 1 arrives at each of 6 elements and `factor` goes back.
        assert [r.grad_out for r in records] == pytest.approx([factor * math.sqrt(6)] * 3)


# -- gradients of every kind ---------------------------------------------------------------


def test_sparse_gradients_are_recorded() -> None:
    # nn.Embedding(sparse=True): the rows looked up get the gradient. Looked up: 1 once and
    # 2 twice, so with a loss of sum() row 1 gets ones and row 2 twos (4 wide).
    expected_in = math.sqrt(4 * 1 + 4 * 4)
    hooked = nn.Embedding(10, 4, sparse=True)
    go.grad_hook(hooked, recipes.scale_grad(0.5), at="parameters")

    def rule(grad, *, input, weight):
        rows = 3 * grad.reshape(-1, 4)
        return {"weight": torch.sparse_coo_tensor(input.reshape(1, -1), rows, weight.shape,
                                                  check_invariants=True)}

    overridden = nn.Embedding(10, 4, sparse=True)
    go.override_backward(overridden, rule)
    model = nn.ModuleList([hooked, overridden])
    with go.monitor(model) as mon:
        sum(m(torch.tensor([1, 2, 2])).sum() for m in model).backward()
    [hook_record] = mon.history["0: grad_hook(scale_grad(scale=0.5)) at parameters"]
    assert hook_record.grad_in == pytest.approx(expected_in)
    assert hook_record.grad_out == pytest.approx(0.5 * expected_in)
    assert hook_record.zeroed == 0.0
    [rule_record] = mon.history["1: Embedding"]
    assert rule_record.grad_in == pytest.approx(math.sqrt(12))  # ones at the 3 looked-up rows
    assert rule_record.grad_out == pytest.approx(3 * expected_in)
    assert hooked.weight.grad.is_sparse and overridden.weight.grad.is_sparse


def test_complex_gradients_keep_their_imaginary_part() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(recipes.scale_grad(2.0).module())
    z = torch.randn(3, 2, dtype=torch.complex64, requires_grad=True)
    with go.monitor(model) as mon:
        (model(z) * (1 + 2j)).real.sum().backward()
    [record] = _only(mon)
    # d(Re((1+2i) z))/dz, by PyTorch's convention, is conj(1+2i) = 1-2i at each element.
    assert record.grad_in == pytest.approx(math.sqrt(6 * 5))
    assert record.grad_out == pytest.approx(2 * math.sqrt(6 * 5))
    torch.testing.assert_close(z.grad, torch.full((3, 2), 2 - 4j))


def test_a_recipe_module_form_is_the_recipe_row() -> None:
    model = nn.Sequential(nn.Linear(3, 3), recipes.reverse_grad(0.5).module(),
                          recipes.scale_grad(2.0).module())
    with go.monitor(model) as mon:
        model(torch.randn(2, 3)).sum().backward()
    assert [(row.label, row.kind) for row in mon.summary().rows] == [
        ("1: reverse_grad(scale=0.5)", "recipe"),
        ("2: scale_grad(scale=2.0)", "recipe"),
    ]
    # Each element: 1 arrives at the output, 2 at scale_grad's input, -0.5 * 2 below.
    [reversal] = mon.history["1: reverse_grad(scale=0.5)"]
    assert (reversal.grad_in, reversal.grad_out) == pytest.approx((2 * math.sqrt(6),
                                                                   math.sqrt(6)))


# -- reading while training ---------------------------------------------------------------


def _step(model: nn.Module, scale: float) -> None:
    (scale * model(torch.randn(8, 4))).sum().backward()


def test_latest_and_since_read_only_the_new_steps() -> None:
    torch.manual_seed(0)
    model = Binarized()
    with go.monitor(model) as mon:
        assert mon.latest() == {} and mon.since(0) == {} and mon.scalars() == {}
        for k in range(5):
            _step(model, float(k + 1))
            [(label, latest)] = mon.latest().items()
            assert latest.step == k
            # The loss's gradient at the output layer's input is scale * out.weight.
            assert latest.grad_in == pytest.approx(
                (k + 1) * math.sqrt(8) * float(model.out.weight.detach().norm()), rel=1e-5)
        assert [r.step for r in mon.since(3)[label]] == [3, 4]
        assert mon.since(5) == {}
        assert mon.since(0)[label] == mon.history[label]


def test_max_steps_bounds_the_history_not_the_summary() -> None:
    torch.manual_seed(0)
    model = Binarized()
    kept = go.monitor(model, max_steps=3)
    every = go.monitor(Binarized())
    with kept:
        for k in range(7):
            _step(model, float(k + 1))
    [records] = kept.history.values()
    assert [r.step for r in records] == [4, 5, 6]
    [row] = kept.summary().rows
    assert (row.steps, row.calls) == (7, 7)
    # The mean over all 7 steps: the loss scale grows 1..7 with the same weights.
    assert row.grad_in == pytest.approx(sum(range(1, 8)) / 7 / 7 * records[-1].grad_in)
    assert "max_steps" not in repr(every)
    with pytest.raises(go.GradOverrideTypeError, match=r"go.monitor: `max_steps` must be a "
                       r"positive integer .* got 0\."):
        go.monitor(model, max_steps=0)


def test_scalars_are_metric_keys_of_the_latest_step() -> None:
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(4, 4), recipes.binarize().module())
            self.head = nn.Linear(4, 1)
            go.grad_hook(self.head, recipes.scale_grad(0.5), at="inputs")
            go.grad_hook(self.head, recipes.reverse_grad(), at="parameters")

        def forward(self, x):
            return self.head(self.encoder(x))

    model = Net()
    with go.monitor(model) as mon:
        _step(model, 1.0)
        first = mon.scalars()
        _step(model, 2.0)
        second = mon.scalars(prefix="train/go")
    latest = mon.latest()
    assert sorted({k.rsplit("/", 1)[0] for k in first}) == [
        "gradoverride/encoder.1",
        "gradoverride/head",
        "gradoverride/head.grad_hook_reverse_grad_scale_1.0_at_parameters",
    ]
    assert sorted({k.rsplit("/", 1)[1] for k in first}) == [
        "calls", "grad_in", "grad_out", "nonfinite", "zeroed"]
    # The same keys, another prefix, the latest step's numbers.
    assert sorted(second) == sorted(k.replace("gradoverride/", "train/go/") for k in first)
    label = f"encoder.1: {recipes.binarize()!r}"
    assert second["train/go/encoder.1/grad_in"] == latest[label].grad_in
    assert second["train/go/encoder.1/zeroed"] == latest[label].zeroed
    assert all(isinstance(v, float) for v in second.values())


# -- loss scaling (torch AMP's GradScaler) -----------------------------------------------


def test_with_the_scaler_the_norms_are_the_true_ones() -> None:
    torch.manual_seed(0)
    taps = Taps()
    model = Binarized(taps)
    x = torch.randn(6, 4)
    model(x).sum().backward()  # the reference: plain backward, tensor hooks
    grad_in, grad_out, zeroed = taps.expected()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for given, factor in ((scaler, 1.0), (None, 1024.0)):
        with go.monitor(model, scaler=given) as mon:
            scaler.scale(model(x).sum()).backward()
        [record] = _only(mon)
        assert record.grad_in == pytest.approx(factor * grad_in, rel=1e-6)
        assert record.grad_out == pytest.approx(factor * grad_out, rel=1e-6)
        assert record.zeroed == pytest.approx(zeroed)
    with pytest.raises(go.GradOverrideTypeError, match=r"go.monitor: `scaler` must be the "
                       r"torch.amp.GradScaler scaling the loss \(or None\); got float 1024.0"):
        go.monitor(model, scaler=1024.0)


@pytest.mark.parametrize("recipe", ["value", "norm"])
def test_clipping_with_the_scaler_clips_the_true_gradient(recipe: str) -> None:
    upstream = torch.tensor([0.05, 0.5, -2.0, 3.0])
    if recipe == "value":
        expected = upstream.clamp(-0.1, 0.1)  # torch.nn.utils.clip_grad_value_'s formula
        make = lambda scaler: recipes.clip_grad_value(0.1, scaler=scaler)  # noqa: E731
    else:
        expected = upstream * min(1.0, 1.0 / (float(upstream.norm()) + 1e-6))
        make = lambda scaler: recipes.clip_grad_norm(1.0, scaler=scaler)  # noqa: E731
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for given in (scaler, None):
        x = torch.zeros(4, requires_grad=True)
        scaler.scale((make(given)(x) * upstream).sum()).backward()
        got = x.grad / scaler.get_scale()  # what scaler.unscale_ gives the optimizer
        if given is None:  # the scaled gradient was clipped: 1/65536 of the bound
            assert float(got.abs().max()) < 1e-3
        else:
            torch.testing.assert_close(got, expected)
    assert repr(make(scaler)) == repr(make(None))  # the scaler is not a setting
    with pytest.raises(go.GradOverrideTypeError, match=r"clip_grad_(value|norm) needs "
                       r"`scaler` to be the torch.amp.GradScaler scaling the loss"):
        make(65536.0)


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # dynamo's
@pytest.mark.filterwarnings("ignore:Using `torch.compile.module.` when there are global hooks")
def test_a_compiled_child_is_warned_and_the_eager_rest_recorded() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Binarized(), nn.Linear(1, 1), recipes.scale_grad(2.0).module())
    model[0] = torch.compile(model[0], backend="aot_eager")
    with go.monitor(model) as mon, pytest.warns(
        go.GradOverrideWarning, match=r"`0\._orig_mod` of Sequential runs compiled "
        r"\(torch\.compile\)"
    ):
        model(torch.randn(3, 4)).sum().backward()
    # The compiled child's binarize is not recorded; the eager scale_grad is.
    assert list(mon.history) == ["2: scale_grad(scale=2.0)"]


# -- the recorder at the edges: interrupts, recursion, several passes, threads ------------


@go.custom_backward
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_doubled.backward
def _(grad, *, x):
    return 2 * grad


def test_an_interrupted_forward_leaves_nothing_behind() -> None:
    # A KeyboardInterrupt skips torch's always-called module hooks: the recorder's call
    # stack and its per-call hook must still go, and the model with them.
    class Boom(nn.Module):
        def forward(self, x):
            raise KeyboardInterrupt

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.boom = Boom()
            self.boom.register_forward_hook(lambda mod, inp, out: None)

        def forward(self, x, fail=False):
            return self.boom(x) if fail else _doubled(x)

    model = Net()
    with go.monitor(model) as mon:
        with pytest.raises(KeyboardInterrupt):
            model(torch.ones(2), fail=True)
        model(torch.ones(2, requires_grad=True)).sum().backward()
    assert list(mon.history) == ["(model): _doubled"]
    assert len(model.boom._forward_hooks) == 1  # its own hook only
    ref = weakref.ref(model)
    del model, mon
    gc.collect()
    assert ref() is None


def test_a_recursive_module_call_keeps_its_row() -> None:
    class Recursive(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_forward_hook(lambda mod, inp, out: None)

        def forward(self, x, depth=1):
            if depth:
                x = self(x, depth - 1)
            return _doubled(x)  # after the inner call ended

    model = nn.Sequential(Recursive())
    with go.monitor(model) as mon:
        model(torch.ones(2, requires_grad=True)).sum().backward()
    assert [(label, r[0].calls) for label, r in mon.history.items()] == [("0: _doubled", 2)]


def test_every_counts_passes_when_a_forward_has_several() -> None:
    # A gradient penalty: autograd.grad, then backward, on each forward (two passes).
    model = nn.Sequential(nn.Linear(4, 4))
    go.grad_hook(model[0], recipes.scale_grad(0.5), at="outputs")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, x):
            return _doubled(self.inner(x))

    net = Net()
    with go.monitor(net, every=3) as mon:
        for _ in range(6):
            x = torch.randn(2, 4, requires_grad=True)
            y = net(x).sum()
            torch.autograd.grad(y, x, retain_graph=True)
            y.backward()
    assert mon.steps == 12
    for records in mon.history.values():  # the op and the hook: both, on the same steps
        assert [r.step for r in records] == [0, 3, 6, 9]


def test_ops_from_one_factory_kept_on_a_module_are_two_rows() -> None:
    def scaled(factor: float) -> go.CustomBackward:
        @go.custom_backward
        def scaled_grad(x):
            return x.clone()

        @scaled_grad.backward
        def _(grad, *, x):
            return grad * factor

        return scaled_grad

    class Phases(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = scaled(2.0), scaled(10.0)
            self.phase = 0

        def forward(self, x):
            return (self.a if self.phase == 0 else self.b)(x)

    model = Phases()
    with go.monitor(model) as mon:
        for phase in (0, 1):
            model.phase = phase
            model(torch.ones(4, requires_grad=True)).sum().backward()
    assert [[(r.step, r.grad_out) for r in records] for records in mon.history.values()] == [
        [(0, 4.0)], [(1, 20.0)]]  # 1 arrives at 4 elements: 2 and 10 times back


def test_an_op_made_at_each_call_of_a_cell_is_one_row() -> None:
    class Cell(nn.Module):
        def forward(self, x):
            @go.custom_backward
            def clipped(x):
                return x.clamp(-1, 1)

            @clipped.backward
            def _(grad, *, x):
                return grad * (x.abs() <= 1)

            return clipped(x)

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = Cell()

        def forward(self, x):
            for _ in range(5):
                x = self.cell(x)
            return x

    model = Loop()
    with go.monitor(model) as mon:
        for _ in range(2):
            model(torch.randn(3, requires_grad=True)).sum().backward()
    assert [(label, [r.calls for r in records]) for label, records in mon.history.items()] == [
        ("cell: clipped", [5, 5])]


def test_large_gradients_of_two_threads_are_measured_apart() -> None:
    n = 1 << 15  # past the size where the statistics use scratch buffers

    class Net(nn.Module):
        def __init__(self, scale: float) -> None:
            super().__init__()
            self.scale = scale

        def forward(self, x):
            return self.scale * (_doubled(x).sum() + _doubled(x * 1.0).sum())

    models = nn.ModuleList([Net(1.0), Net(3.0)])

    def train(k: int) -> None:
        for _ in range(40):
            models[k](torch.ones(n, requires_grad=True)).backward()

    with go.monitor(models) as mon:
        threads = [threading.Thread(target=train, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for label, scale in (("0: _doubled", 1.0), ("1: _doubled", 3.0)):
        records = mon.history[label]
        assert len(records) == 40
        # Each step: two calls, `scale` arriving at each of n elements, twice that back.
        expected = scale * math.sqrt(2 * n)
        assert [(r.grad_in, r.grad_out) for r in records] == [
            (pytest.approx(expected), pytest.approx(2 * expected))] * 40
        assert [r.step for r in records] == sorted(r.step for r in records)


def test_grad_hooks_registered_while_recording_are_recorded() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    with go.monitor(model) as mon:
        go.grad_hook(model[0], recipes.scale_grad(0.5), at="outputs")
        model(torch.randn(2, 3)).sum().backward()
        late = nn.Linear(3, 1)
        go.grad_hook(late, recipes.reverse_grad(), at="parameters")
        model.append(late)
        model(torch.randn(2, 3)).sum().backward()
    assert [(label, [r.step for r in records]) for label, records in mon.history.items()] == [
        ("0: grad_hook(scale_grad(scale=0.5)) at outputs", [0, 1]),
        ("1: grad_hook(reverse_grad(scale=1.0)) at parameters", [1]),
    ]


def test_a_graph_run_backward_after_the_block_is_not_recorded() -> None:
    model = nn.Sequential(recipes.binarize().module())
    with go.monitor(model) as mon:
        out = model(torch.randn(3, requires_grad=True)).sum()
    out.backward()
    assert mon.steps == 0 and mon.history == {}


@pytest.mark.compile
@pytest.mark.filterwarnings("ignore:.*should not be instantiated:DeprecationWarning")  # dynamo's
def test_a_child_compiled_in_place_is_warned() -> None:
    model = nn.Sequential(Binarized(), nn.Linear(1, 1))
    model[0].compile(backend="aot_eager")
    with pytest.warns(go.GradOverrideWarning, match=r"`0` of Sequential is compiled in place "
                      r"\(module\.compile\(\)\), and the overrides inside a compiled call are "
                      r"not recorded"), go.monitor(model) as mon:
        model(torch.randn(3, 4)).sum().backward()
    assert mon.history == {}


def test_the_models_own_key_is_not_a_submodule_named_model() -> None:
    class Wrapper(nn.Module):  # HuggingFace-style: the network is `self.model`
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Sequential(nn.Linear(2, 2), recipes.scale_grad(2.0).module())

        def forward(self, x):
            return _doubled(self.model(x))

    wrapper = Wrapper()
    with go.monitor(wrapper) as mon:
        wrapper(torch.randn(3, 2)).sum().backward()
    assert sorted({key.rsplit("/", 1)[0] for key in mon.scalars()}) == [
        "gradoverride/_model", "gradoverride/model.1"]
    with pytest.raises(go.GradOverrideTypeError, match=r"Monitor.since needs a step number "
                       r"\(an int\); got '3'"):
        mon.since("3")  # type: ignore[arg-type]


def test_a_scaler_that_scaled_no_loss_yet_leaves_the_norms_alone() -> None:
    torch.manual_seed(0)
    taps = Taps()
    model = Binarized(taps)
    x = torch.randn(6, 4)
    model(x).sum().backward()
    grad_in, _, _ = taps.expected()
    fresh = torch.amp.GradScaler("cpu", init_scale=1024.0)  # no scale() yet: factor 1
    with go.monitor(model, scaler=fresh) as mon:
        model(x).sum().backward()
    [record] = _only(mon)
    assert record.grad_in == pytest.approx(grad_in, rel=1e-6)



def test_a_monitor_whose_start_fails_leaves_nothing_behind() -> None:
    # The model raises as the monitor reads its modules' paths: a later monitor starts, and
    # override calls consult no recorder.
    from gradoverride._function import RECORDERS, RECORDING

    class Failing(Binarized):
        def named_modules(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("cannot list")

    with pytest.raises(RuntimeError, match="cannot list"), go.monitor(Failing()):
        pass  # pragma: no cover - the monitor does not start
    assert (RECORDING, RECORDERS) == ([], [])
    other = Binarized()
    with go.monitor(other) as mon:
        other(torch.randn(3, 4)).sum().backward()
    assert mon.steps == 1


@go.custom_backward
def _tripled_gradient(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_tripled_gradient.backward
def _(grad: torch.Tensor) -> torch.Tensor:
    return grad * 3


class _Weighted(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5, 4.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w

    def backward(self, grad: torch.Tensor, *, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"x": grad * self.w, "w": (grad * x).sum(0)}


class _EachKind(nn.Module):
    """An op, a recipe and a go.Module, each called in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.weighted = _Weighted()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weighted(recipes.scale_grad(0.5)(_tripled_gradient(x)))


_LOOKS = {
    "op call": lambda code: code.co_name == "_watched_call",
    "recipe call": lambda code: code is type(recipes.scale_grad(0.5)).__call__.__code__,
    "go.Module call": lambda code: code.co_name == "_through_route",
    "backward": lambda code: code.co_name == "backward" and (
        code.co_filename.startswith("<gradoverride generated")
        or code.co_filename.endswith("_function.py")),
}


# The lines where an override looks for the recorder in use.
_LOOK_LINES = ("if RECORDERS", "if RECORDING", "if _go_RECORDING", "for recorder in RECORD")


@pytest.mark.parametrize("site", sorted(_LOOKS))
def test_leaving_the_monitor_as_an_override_in_another_thread_reads_it(site: str) -> None:
    # Another thread's override, paused (a trace function) right after its look at the
    # recorder in use (found there), resumes after the monitor's block ended: it runs, with
    # its own gradient, and does not fail reading a recorder that is gone.
    import linecache

    model = _EachKind()
    looks = _LOOKS[site]
    paused, resume = threading.Event(), threading.Event()
    looked: list[int] = []

    def in_site(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and not paused.is_set():
            if looked:
                paused.set()
                assert resume.wait(10)
            else:
                text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                if text.startswith(_LOOK_LINES):
                    looked.append(frame.f_lineno)
        return in_site

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return in_site if looks(frame.f_code) else None

    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], requires_grad=True)
    errors: list[BaseException] = []

    def trainer() -> None:
        sys.settrace(tracer)
        try:
            if site == "backward":  # (an op called outside the model: its node holds no record)
                _tripled_gradient(x).sum().backward()
            else:
                model(x).sum().backward()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
        finally:
            sys.settrace(None)

    model(torch.ones(1, 4)).sum().backward()  # (the first calls, checked, before)
    with go.monitor(model):
        model(torch.ones(1, 4)).sum().backward()  # (the first forward, in this thread)
        thread = threading.Thread(target=trainer)
        thread.start()
        assert paused.wait(10), "the site was never reached"
    resume.set()
    thread.join()
    assert not errors, errors
    w = torch.tensor([1.0, -2.0, 0.5, 4.0])
    expected = torch.full((1, 4), 3.0) if site == "backward" else (w * 0.5 * 3).expand(1, 4)
    torch.testing.assert_close(x.grad, expected)


def test_leaving_the_monitor_as_another_thread_s_first_forward_ends_leaves_no_hooks() -> None:
    # Another thread's first forward ends (a trace function pauses it as it hooks the
    # model's modules) while the monitor's block is left: no hook stays on the model.
    import inspect

    from gradoverride.diagnostics._recorder import Recorder

    model = Binarized()
    source, first = inspect.getsourcelines(Recorder.forward_ended)
    hooking = first + next(k for k, line in enumerate(source) if "self._hook_own(" in line)
    lines, start = inspect.getsourcelines(Recorder.stop)
    locking = [start + k for k, line in enumerate(lines) if "with self._switching" in line]
    paused, stopped = threading.Event(), threading.Event()
    stopper: list[threading.Thread] = []

    def until_stopping() -> None:
        # Until the block is left, or the thread leaving it waits for this one.
        while not stopped.wait(0.001):
            if stopper:
                frame = sys._current_frames().get(stopper[0].ident or -1)
                if (frame is not None and frame.f_code is Recorder.stop.__code__
                        and frame.f_lineno in locking):
                    return

    def in_forward_ended(frame: Any, event: str, arg: Any) -> Any:
        if event == "line" and frame.f_lineno == hooking and not paused.is_set():
            paused.set()
            until_stopping()
        return in_forward_ended

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return in_forward_ended if frame.f_code is Recorder.forward_ended.__code__ else None

    def first_forward() -> None:
        sys.settrace(tracer)
        try:
            model(torch.randn(3, 4)).sum().backward()
        finally:
            sys.settrace(None)

    mon = go.monitor(model)
    mon.__enter__()
    trainer = threading.Thread(target=first_forward)
    trainer.start()
    assert paused.wait(10), "the first forward's end was never reached"

    def leave() -> None:
        mon.__exit__(None, None, None)
        stopped.set()

    stopper.append(threading.Thread(target=leave))
    stopper[0].start()
    stopper[0].join()
    trainer.join()
    hooked = [name for name, m in model.named_modules()
              if m._forward_pre_hooks or m._forward_hooks]
    assert hooked == []
