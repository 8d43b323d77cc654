"""`go.monitor(model, every=N)`: the forwards of the steps it does not record run without
the recorder, and the steps are still every backward pass, recorded whole."""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradoverride as go
from gradoverride import recipes
from gradoverride.diagnostics._recorder import Recorder


class Net(nn.Module):
    """Two overrides; `tap` collects, per backward pass, the gradient arriving at the
    second one's output (tensor hooks: the reference the monitor must match)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.first = recipes.binarize().module()
        self.second = recipes.scale_grad(0.5).module()
        self.out = nn.Linear(6, 1)
        self.arriving: list[torch.Tensor] = []
        self.hidden: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.second(self.first(self.fc(x)))
        if h.requires_grad:
            h.register_hook(lambda g: self.arriving.append(g.clone()))
        self.hidden = h
        return self.out(h)


def _records(mon: go.Monitor, label: str) -> list[Any]:
    return mon.history[label]


SECOND = "second: scale_grad(scale=0.5)"
FIRST = "first: binarize(clip=1.0, inclusive=True, keep='input')"


def _norm(g: torch.Tensor) -> float:
    return math.sqrt(float(g.double().square().sum()))


def _forward_counting_consults(model: nn.Module) -> tuple[torch.Tensor, int]:
    """A loss from one forward of `model`, and how many of its override calls consulted
    the recorder (`Recorder.op_call`, seen by a profile function)."""
    calls: list[int] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is Recorder.op_call.__code__:
            calls.append(len(calls))

    sys.setprofile(profile)
    try:
        loss = model(torch.randn(3, 4)).sum()
    finally:
        sys.setprofile(None)
    return loss, len(calls)


def test_steps_not_recorded_run_their_overrides_without_the_recorder() -> None:
    model = Net()
    with go.monitor(model, every=4) as mon:
        for step in range(8):
            loss, consults = _forward_counting_consults(model)
            loss.backward()
            # Each of the two overrides consults the recorder in the recorded steps alone.
            assert consults == (2 if step % 4 == 0 else 0), step
    assert mon.steps == 8
    assert [r.step for r in _records(mon, SECOND)] == [0, 4]


def test_a_due_step_whose_forward_was_not_recorded_is_recorded_at_the_next_one() -> None:
    # A forward followed by two backward passes, after forwards followed by one: the second
    # pass is a step to record, but its forward left nothing to record. That step is
    # dropped whole, and the next one recorded in its place, with its own gradients.
    torch.manual_seed(0)
    model = Net()
    with go.monitor(model, every=2) as mon:
        model(torch.randn(3, 4)).sum().backward()  # step 0, recorded
        out = model(torch.randn(3, 4))
        out.sum().backward(retain_graph=True)  # step 1
        (2 * out).sum().backward()  # step 2: due, but its forward was not recorded
        model.arriving.clear()
        model(torch.randn(3, 4)).sum().backward()  # step 3: recorded in its place
        (arriving,) = model.arriving
        model(torch.randn(3, 4)).sum().backward()  # step 4
    assert mon.steps == 5
    records = _records(mon, SECOND)
    assert [(r.step, r.calls) for r in records][:2] == [(0, 1), (3, 1)]
    assert records[1].grad_in == pytest.approx(_norm(arriving), rel=1e-6)
    # Both overrides of each recorded step: a step is recorded whole or not at all.
    assert [r.step for r in _records(mon, FIRST)] == [r.step for r in records]


def test_two_forwards_before_one_backward_are_recorded_together() -> None:
    model = Net()
    with go.monitor(model, every=2) as mon:
        for _ in range(5):
            (model(torch.randn(3, 4)) - model(torch.randn(3, 4))).sum().backward()
    assert mon.steps == 5
    assert [(r.step, r.calls) for r in _records(mon, SECOND)] == [(0, 2), (2, 2), (4, 2)]


def test_a_loss_read_off_an_inner_output_counts_every_pass() -> None:
    # No backward pass reaches the model's output; each reaches its overrides.
    model = Net()
    with go.monitor(model, every=2) as mon:
        for _ in range(12):
            model(torch.randn(3, 4))
            assert model.hidden is not None
            model.hidden.sum().backward()
    assert mon.steps == 12
    assert [r.step for r in _records(mon, SECOND)] == [0, 2, 4, 6, 8, 10]


@dataclasses.dataclass
class Output:
    logits: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def forward(self, x: torch.Tensor) -> Output:
        return Output(self.net(x))


@pytest.mark.parametrize("every", [2, 3])
def test_every_pass_is_a_step_whatever_the_output_holds(every: int) -> None:
    # An output torch does not look into (a dataclass), and passes that reach the input
    # alone (the gradient of an adversarial example), which skip the override on a weight.
    model = DataclassOut()
    with go.monitor(model, every=every) as mon:
        for _ in range(6):
            model(torch.randn(3, 4)).logits.sum().backward()
    assert mon.steps == 6
    assert [r.step for r in _records(mon, "net.second: scale_grad(scale=0.5)")] == list(
        range(0, 6, every))

    class WeightBinarized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 4))
            self.act = recipes.binarize()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w = recipes.binarize()(self.weight)
            return self.act(x @ w).sum(dim=1)

    net = WeightBinarized()
    with go.monitor(net, every=every) as mon:
        for _ in range(6):
            x = torch.randn(3, 4, requires_grad=True)
            torch.autograd.grad(net(x).sum(), x)
    assert mon.steps == 6
    rows = {label: [r.step for r in records] for label, records in mon.history.items()}
    assert list(range(0, 6, every)) in rows.values(), rows


def test_passes_that_reach_no_override_are_not_steps() -> None:
    # A GAN whose discriminator holds no override: its own pass is not a step.
    torch.manual_seed(0)
    generator, discriminator = Net(), nn.Sequential(nn.Linear(1, 4), nn.Linear(4, 1))

    class Critic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = discriminator

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x)

    critic = Critic()
    with go.monitor(nn.ModuleList([generator, critic]), every=2) as mon:
        for _ in range(6):
            fake = generator(torch.randn(3, 4))
            critic(fake.detach()).sum().backward()  # reaches no override
            (-critic(fake)).sum().backward()
    assert mon.steps == 6
    assert [r.step for r in _records(mon, "0.second: scale_grad(scale=0.5)")] == [0, 2, 4]


def _doubled_block(x: torch.Tensor) -> torch.Tensor:
    return recipes.scale_grad(2.0)(x * 1.0)


@pytest.mark.filterwarnings("ignore:.*use_reentrant:UserWarning")
def test_recording_goes_on_when_passes_cannot_be_counted() -> None:
    # A function outside any module, checkpointed the reentrant way: its overrides' nodes
    # are made again inside the backward pass, in a step not recorded, where no module call
    # tells the monitor they are the model's. Those steps are not counted, but the monitor
    # still records one now and then.
    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.utils.checkpoint.checkpoint(_doubled_block, self.fc(x),
                                                     use_reentrant=True)

    model = Checkpointed()
    with go.monitor(model, every=2) as mon:
        for _ in range(20):
            model(torch.randn(3, 4)).sum().backward()
    (records,) = mon.history.values()
    assert len(records) >= 3, [r.step for r in records]
    assert {r.calls for r in records} == {1}


def test_a_container_whose_parts_are_called_alone_counts_every_pass() -> None:
    # A GAN's step: the generator and the discriminator called one by one, never the
    # container the monitor watches; two backward passes a step, the second reaching the
    # generator's forward, made before the first.
    torch.manual_seed(0)
    generator, discriminator = Net(), Net()
    with go.monitor(nn.ModuleList([generator, discriminator]), every=3) as mon:
        for _ in range(6):
            fake = generator(torch.randn(3, 4))
            discriminator(fake.detach().expand(3, 4)).sum().backward()
            discriminator(fake.expand(3, 4)).sum().backward()
    assert mon.steps == 12
    # Step 3 met the generator's forward not recorded: dropped, step 4 recorded in its
    # place; from then on the forwards are recorded early enough.
    assert [r.step for r in _records(mon, "1.second: scale_grad(scale=0.5)")] == [0, 4, 6, 9]
    (record,) = _records(mon, "0.second: scale_grad(scale=0.5)")  # the odd steps reach it
    assert (record.step, record.calls) == (9, 1)
    assert record.grad_in == pytest.approx(_norm(generator.arriving[4]), rel=1e-6)


def _in_threads(*targets: Callable[[], None]) -> None:
    """Each of `targets` run in a thread of its own, at once; what one raised, reported."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(target,)) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def test_two_threads_with_every_n_count_every_pass_and_record_whole_steps() -> None:
    model = Net()

    def train() -> None:
        for _ in range(9):
            model(torch.randn(3, 4)).sum().backward()

    with go.monitor(model, every=3) as mon:
        _in_threads(train, train)
    assert mon.steps == 18
    first, second = _records(mon, FIRST), _records(mon, SECOND)
    assert len(second) >= 2
    assert [r.step for r in first] == [r.step for r in second]
    # Each recorded step is one thread's pass, whole: its two overrides, once each.
    assert {r.calls for r in first + second} == {1}


def test_another_thread_s_overrides_are_not_steps() -> None:
    # Another model with an override trains in another thread meanwhile: autograd numbers
    # each thread's nodes on its own, from zero, so its nodes' numbers are the model's too.
    model, other = Net(), Net()
    start = threading.Barrier(2)

    def train(net: Net) -> Callable[[], None]:
        def steps() -> None:
            start.wait()
            for _ in range(20):
                net(torch.randn(3, 4)).sum().backward()
        return steps

    with go.monitor(model, every=5) as mon:
        _in_threads(train(model), train(other))
    assert mon.steps == 20
    assert [r.step for r in _records(mon, SECOND)] == [0, 5, 10, 15]


def test_another_model_s_forwards_during_the_first_forward_are_not_the_model_s() -> None:
    # While a forward of another model runs in another thread, the first forward's module
    # hooks stay on: this thread's forwards of the other model meanwhile are not forwards
    # of the monitored one (taken for them, a run of them with no step between looked like
    # a model whose passes cannot be counted, and an extra step was recorded).
    model, other = Net(), Net()
    holding, release = threading.Event(), threading.Event()

    def hold(module: nn.Module, args: Any) -> None:
        if threading.current_thread() is not threading.main_thread() and not release.is_set():
            holding.set()
            release.wait()

    other.fc.register_forward_pre_hook(hold)

    def held_forward() -> None:
        other(torch.randn(3, 4)).sum().backward()

    with go.monitor(model, every=5) as mon:
        thread = threading.Thread(target=held_forward)
        thread.start()
        assert holding.wait(timeout=60)
        model(torch.randn(3, 4)).sum().backward()
        for _ in range(25):
            other(torch.randn(3, 4)).sum().backward()
        release.set()
        thread.join()
        for _ in range(9):
            model(torch.randn(3, 4)).sum().backward()
    assert mon.steps == 10
    assert [r.step for r in _records(mon, SECOND)] == [0, 5]


def test_another_model_trained_by_a_thread_started_after_one_that_trained_this_one() -> None:
    # A thread trains the model and ends; the next thread started (the system gives it the
    # ended one's id again, on Linux at least) trains another model: autograd numbers its
    # nodes from zero again, as it numbered the first thread's, yet they are not the model's.
    model, other = Net(), Net()

    def train(net: Net) -> None:
        for _ in range(20):
            net(torch.randn(3, 4)).sum().backward()

    with go.monitor(model, every=10) as mon:
        for net in (model, other):
            thread = threading.Thread(target=train, args=(net,))
            thread.start()
            thread.join()
        train(model)
    assert mon.steps == 40
    assert [r.step for r in _records(mon, SECOND)] == [0, 10, 20, 30]


def test_many_forwards_without_grad_between_a_forward_and_its_backward() -> None:
    # Sampling, a rollout, a target network's forwards: 100 forwards under no_grad between
    # each step's forward and its backward.
    model = Net()
    with go.monitor(model, every=2) as mon:
        for _ in range(6):
            loss = model(torch.randn(3, 4)).sum()
            with torch.no_grad():
                for _ in range(100):
                    model(torch.randn(3, 4))
            loss.backward()
    assert mon.steps == 6
    assert [r.step for r in _records(mon, SECOND)] == [0, 2, 4]


class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.act = recipes.scale_grad(0.5).module()

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.act(self.lin(torch.cat([x, h], -1))))


def _carried(every: int, detach_at: int) -> tuple[go.Monitor, dict[int, float]]:
    """A cell stepped once a forward, its state carried from step to step (detached once,
    at `detach_at`), each step's loss run backward with the graph kept."""
    torch.manual_seed(0)
    cell = Cell()
    with go.monitor(cell, every=every) as mon:
        h = torch.zeros(2, 4)
        for i in range(16):
            if i == detach_at:
                h = h.detach()
            h = cell(torch.randn(2, 4), h)
            h.square().sum().backward(retain_graph=True)
    return mon, {r.step: r.grad_in for r in _records(mon, "act: scale_grad(scale=0.5)")}


def test_a_state_never_detached_is_warned_of_and_recorded_once_it_is() -> None:
    _, every_step = _carried(1, 8)
    with pytest.warns(go.GradOverrideWarning, match=(
        r"go\.monitor of Cell \(every=2\): step 4 is not recorded, nor are the steps after "
        r"it whose backward pass reaches forwards of steps it did not record \(a recurrent "
        r"state carried from step to step and never detached\).*use every=1, or detach the "
        r"carried state every few steps"
    )):
        mon, recorded = _carried(2, 8)
    assert mon.steps == 16
    # Steps 2 to 7 reach the forwards of steps 1 and 3, not recorded: none of them is (the
    # warning names the first dropped once every forward is). Once the state is detached
    # (step 8) the steps are recorded again, one in two (and step 9 in place of one), whole.
    assert sorted(recorded) == [0, 8, 9, 10, 12, 14]
    for step, grad_in in recorded.items():
        assert grad_in == pytest.approx(every_step[step], rel=1e-6)


def test_a_forward_in_one_thread_and_its_backward_in_another() -> None:
    model = Net()

    def backward(loss: torch.Tensor) -> None:
        thread = threading.Thread(target=loss.backward)
        thread.start()
        thread.join()

    with go.monitor(model, every=3) as mon:
        for _ in range(9):
            backward(model(torch.randn(3, 4)).sum())
    assert mon.steps == 9
    assert [r.step for r in _records(mon, SECOND)] == [0, 3, 6]


def _encoder_steps(every: int) -> tuple[go.Monitor, dict[int, float]]:
    """A model whose encoder, a torch container of a layer and a recipe's module form, is
    trained on its own at odd steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 6), recipes.binarize().module()),
                          nn.Linear(6, 1))
    with go.monitor(model, every=every) as mon:
        for step in range(12):
            x = torch.randn(3, 4)
            if step % 2:
                model[0](x).square().sum().backward()
            else:
                model(x).sum().backward()
    return mon, {r.step: r.grad_out for r in _records(mon, "0.1: " + FIRST.split(": ")[1])}


@pytest.mark.parametrize("every", [2, 3, 4])
def test_a_part_of_the_model_trained_on_its_own_counts_its_steps(every: int) -> None:
    _, every_step = _encoder_steps(1)
    mon, recorded = _encoder_steps(every)
    assert mon.steps == 12
    assert sorted(recorded) == list(range(0, 12, every))
    for step, grad_out in recorded.items():
        assert grad_out == pytest.approx(every_step[step], rel=1e-6)


def test_a_thread_that_ended_inside_a_forward_is_not_taken_for_one_running() -> None:
    # A thread whose forward raised SystemExit (which torch's forward hooks do not see) and
    # which then ended never ran that forward to its end. The forwards of the
    # main thread afterwards are still decided one by one: its steps not recorded run
    # their overrides without the recorder, and every pass is a step.
    model = Net()
    original = model.first.forward

    def stop(x: torch.Tensor) -> torch.Tensor:
        raise SystemExit

    def worker() -> None:
        model(torch.randn(3, 4)).sum().backward()
        model.first.forward = stop  # type: ignore[method-assign]
        try:
            model(torch.randn(3, 4))
        except SystemExit:
            pass  # (the thread ends here, as it would unguarded, without a report)
        finally:
            model.first.forward = original  # type: ignore[method-assign]

    with go.monitor(model, every=3) as mon:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        for _ in range(7):
            due = mon.steps % 3 == 0
            loss, consults = _forward_counting_consults(model)
            loss.backward()
            assert consults == (2 if due else 0), mon.steps
    assert mon.steps == 8
    assert [r.step for r in _records(mon, SECOND)] == [0, 3, 6]


@go.custom_backward
def halve(x):
    return x.clone()


@halve.backward
def _(grad, *, x):
    return grad / 2


class _Holder(nn.Module):
    """A linear layer, then `act` (a recipe of the test's) on its output."""

    def __init__(self, act: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))

def test_a_forward_whose_recording_turns_on_midway_records_none_of_its_calls() -> None:
    # Thread A's forward starts in a step not recorded. Inside it, between a recipe's call
    # and the call of the op the recipe makes, thread B runs a forward of the model: two
    # forwards at once, so every forward is recorded from then on. A's op call must not be
    # recorded then: its recipe, called before, is not on the call stack, and the call
    # would land on a row of the op alone. A's step is dropped whole, and the next recorded
    # in its place.
    from gradoverride.recipes import Recipe

    pause: list[Callable[[], None]] = []

    @dataclasses.dataclass(frozen=True)
    class Pausing(Recipe):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            if pause:
                pause.pop()()
            return halve(x)

    model = _Holder(Pausing())

    def other_thread() -> None:
        _in_threads(lambda: model(torch.randn(3, 4)).sum().backward())

    with go.monitor(model, every=2) as mon:
        for step in range(5):  # steps 0, 2 (A), 1 (B), 3, 4, 5
            if step == 1:
                pause.append(other_thread)
            model(torch.randn(3, 4)).sum().backward()
    assert mon.steps == 6
    row = f"(model): {Pausing()!r}"  # (the recipe's row, not the op's alone)
    assert list(mon.history) == [row]
    assert [(r.step, r.calls) for r in mon.history[row]] == [(0, 1), (3, 1), (4, 1)]


def test_two_threads_meeting_an_override_first_at_once_make_one_row() -> None:
    # A row is made the first time a recorded pass meets its override. Thread B's whole
    # step runs while thread A's pass is making the row (here: while it reads the recipe's
    # repr, the row's name, inside A's backward pass): both steps land on one row.
    from gradoverride.recipes import Recipe

    reprs_in_a_pass: list[int] = []

    @dataclasses.dataclass(frozen=True, repr=False)
    class Slow(Recipe):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return halve(x)

        def __repr__(self) -> str:
            in_pass = torch._C._current_graph_task_id() >= 0
            if in_pass and threading.current_thread() is threading.main_thread():
                reprs_in_a_pass.append(1)
                if len(reprs_in_a_pass) == 2:  # (the first is read into the row's key)
                    _in_threads(lambda: model(torch.randn(3, 4)).sum().backward())
            return "Slow()"

    model = _Holder(Slow())
    with go.monitor(model) as mon:
        model(torch.randn(3, 4)).sum().backward()
    assert len(reprs_in_a_pass) >= 2  # (B's step ran while A's row was made)
    assert mon.steps == 2
    assert list(mon.history) == ["(model): Slow()"]
    assert [(r.step, r.calls) for r in mon.history["(model): Slow()"]] == [(0, 1), (1, 1)]


def test_leaving_the_monitor_while_another_thread_decides_leaves_nothing() -> None:
    # Another thread trains the model while the monitor's block ends: its forward, paused
    # as it starts deciding whether its overrides are recorded (a trace function), resumes
    # after the block. The ops then consult no recorder, and a new monitor records.
    from gradoverride._function import RECORDERS

    paused, resume = threading.Event(), threading.Event()
    calls = []

    def tracer(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is Recorder._arm.__code__:
            calls.append(1)
            if len(calls) == 2:  # (the second forward's: the consult turns on, every=2)
                paused.set()
                assert resume.wait(10)

    model = Net()

    def trainer() -> None:
        sys.settrace(tracer)
        try:
            for _ in range(3):
                model(torch.randn(3, 4)).sum().backward()
        finally:
            sys.settrace(None)

    with go.monitor(model, every=2):
        model(torch.randn(3, 4)).sum().backward()  # (the first forward, in this thread)
        thread = threading.Thread(target=trainer)
        thread.start()
        assert paused.wait(10)
    resume.set()
    thread.join()
    assert RECORDERS == []
    with go.monitor(model) as mon:
        model(torch.randn(3, 4)).sum().backward()
    assert mon.steps == 1
    assert [r.step for r in _records(mon, SECOND)] == [0]
