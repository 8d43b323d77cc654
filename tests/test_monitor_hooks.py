"""Which module calls keep `go.monitor`'s call stack: torch's global module hooks during the
first forward only, then hooks on the model itself and on the modules whose own code may
call an override (not torch's plain layers and containers, which then run on torch's fast
path). Each row's path is checked where the hooks could miss it: modules added to the model
after the first forward (at the top, or inside a module added earlier), a branch of a
module's forward taken only at a later step, an override called through a torch layer that
runs a callable it was given; the gradients are checked against tensor hooks on the same
run."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import gradoverride as go
from gradoverride import recipes

BIN = repr(recipes.binarize())


def _norm(grads: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))


def _check(records: list[go.StepRecord], arriving: list[torch.Tensor],
           returned: list[torch.Tensor]) -> None:
    """Each record's norms are those of the gradients its step's tensor hooks caught."""
    for record, got, gave in zip(records, arriving, returned, strict=True):
        assert record.grad_in == pytest.approx(_norm([got]))
        assert record.grad_out == pytest.approx(_norm([gave]))


class Tapped(nn.Module):
    """binarize called in the forward (no recipe module): its arriving and returned
    gradients taken by tensor hooks. `when` says at which calls it runs."""

    def __init__(self, when: Callable[[int], bool] = lambda k: True) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = recipes.binarize()
        self.when = when
        self.calls = 0
        self.arriving: list[torch.Tensor] = []
        self.returned: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h: torch.Tensor = self.fc(x)
        if not self.when(self.calls - 1):
            return h
        h.register_hook(lambda g: self.returned.append(g.clone()))  # type: ignore[no-untyped-call]
        y: torch.Tensor = self.act(h)
        y.register_hook(lambda g: self.arriving.append(g.clone()))  # type: ignore[no-untyped-call]
        return y


def test_after_the_first_forward_torch_layers_and_recipe_modules_run_without_hooks() -> None:
    model = nn.Sequential(nn.Linear(4, 4), recipes.binarize().module(), nn.Linear(4, 1))
    globals_before = (len(torch_module._global_forward_pre_hooks),
                      len(torch_module._global_forward_hooks))
    x = torch.randn(3, 4)
    with go.monitor(model) as mon:
        for step in range(3):
            model(x).sum().backward()
            if step == 0:  # the first forward ran under the global hooks: gone now
                assert (len(torch_module._global_forward_pre_hooks),
                        len(torch_module._global_forward_hooks)) == globals_before
            assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks
            assert not model[2]._forward_pre_hooks and not model[2]._forward_hooks
            # A recipe's module form keeps itself on the recorder's stack: no hooks either.
            assert not model[1]._forward_pre_hooks and not model[1]._forward_hooks
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
    assert [r.step for r in mon.history[f"1: {BIN}"]] == [0, 1, 2]


def test_a_module_added_after_the_first_forward_has_its_own_row() -> None:
    # The model is a torch container (no hook of its own but the recorder's on the model):
    # the module appended later is hooked as torch registers it, or its calls would be
    # rows of the model itself.
    torch.manual_seed(0)
    model = nn.Sequential(Tapped())
    x = torch.randn(5, 4)
    with go.monitor(model) as mon:
        model(x).sum().backward()
        model(x).sum().backward()
        late = Tapped()
        model.append(late)
        model(x).sum().backward()
        model(x).sum().backward()
    assert sorted(mon.history) == [f"0: {BIN}", f"1: {BIN}"]
    records = mon.history[f"1: {BIN}"]
    assert [r.step for r in records] == [2, 3]
    _check(records, late.arriving, late.returned)


def test_a_module_added_inside_a_module_added_later_has_its_own_row() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Tapped())
    x = torch.randn(5, 4)
    with go.monitor(model) as mon:
        model(x).sum().backward()
        block = nn.Sequential()
        model.append(block)
        model(x).sum().backward()
        block.append(nn.Sequential(nn.Identity(), recipes.binarize().module()))
        model(x).sum().backward()
    assert sorted(mon.history) == [f"0: {BIN}", f"1.0.1: {BIN}"]
    assert [r.step for r in mon.history[f"1.0.1: {BIN}"]] == [2]


def test_a_branch_taken_at_a_later_step_has_its_module_s_row() -> None:
    torch.manual_seed(0)
    rare = Tapped(when=lambda k: k == 3)
    model = nn.Sequential(Tapped(), nn.Sequential(nn.Linear(4, 4), rare))
    x = torch.randn(5, 4)
    with go.monitor(model) as mon:
        for _ in range(5):
            model(x).sum().backward()
    assert sorted(mon.history) == [f"0: {BIN}", f"1.1: {BIN}"]
    (record,) = mon.history[f"1.1: {BIN}"]
    assert record.step == 3
    assert record.grad_in == pytest.approx(_norm(rare.arriving))
    assert record.grad_out == pytest.approx(_norm(rare.returned))


def test_an_override_a_torch_layer_calls_is_that_layer_s_row() -> None:
    # A transformer layer calls the activation it is given: the row is the layer's.
    torch.manual_seed(0)
    act = recipes.binarize()
    layer = nn.TransformerEncoderLayer(4, 1, dim_feedforward=8, dropout=0.0,
                                       activation=lambda h: act(h), batch_first=True)
    model = nn.Sequential(nn.Linear(4, 4), layer)
    x = torch.randn(2, 3, 4)
    with go.monitor(model) as mon:
        for _ in range(3):
            model(x).sum().backward()
    assert sorted(mon.history) == [f"1: {BIN}"]
    assert [r.step for r in mon.history[f"1: {BIN}"]] == [0, 1, 2]


def test_a_module_hooked_later_by_the_user_keeps_its_hooks_order() -> None:
    # A forward hook the user registers after the recorder's still sees the module as the
    # innermost one: an override it calls is the module's row.
    torch.manual_seed(0)
    act = recipes.binarize()
    model = nn.Sequential(nn.Linear(4, 4), Tapped(when=lambda k: False))
    x = torch.randn(5, 4)
    with go.monitor(model) as mon:
        model(x).sum().backward()
        model[1].register_forward_hook(lambda m, a, out: act(out))
        model(x).sum().backward()
    assert sorted(mon.history) == [f"1: {BIN}"]
    assert [r.step for r in mon.history[f"1: {BIN}"]] == [0]  # (the first reached none)


def test_a_model_copied_or_saved_after_the_first_forward_carries_no_working_hook() -> None:
    import copy
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), recipes.binarize().module())
    x = torch.randn(3, 4)
    with go.monitor(model):
        model(x).sum().backward()  # the recorder's hooks are on the model now
        twin = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for copied in (twin, loaded):
        for m, hooked in ((copied, 2), (copied[1], 0)):  # (a recipe module: none)
            hooks = [*m._forward_pre_hooks.values(), *m._forward_hooks.values()]
            # (a hook that does nothing: not one that keeps a recorder's call stack)
            assert all(h(m, (x,)) is None for h in m._forward_pre_hooks.values())
            assert all(h(m, (x,), x) is None for h in m._forward_hooks.values())
            assert len(hooks) == hooked
        assert torch.equal(copied(x), model(x))
        # Monitored itself, the copy's rows are what the model's were.
        with go.monitor(copied) as mon:
            for _ in range(2):
                copied(x).sum().backward()
        assert sorted(mon.history) == [f"1: {BIN}"]
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks


def test_a_recipe_module_called_outside_a_plain_container_then_added_is_recorded() -> None:
    # Met outside the model, the module is looked up again when the model's next forward
    # starts (which the model's own hooks mark, a torch container's too).
    torch.manual_seed(0)
    late = recipes.binarize().module()
    model = nn.Sequential(nn.Linear(4, 4), recipes.binarize().module())
    x = torch.randn(3, 4, requires_grad=True)
    with go.monitor(model) as mon:
        model(x).sum().backward()
        late(x).sum().backward()  # not the model's yet: not a step
        model.append(late)
        model(x).sum().backward()
    assert {label: [r.step for r in records] for label, records in mon.history.items()} == {
        f"1: {BIN}": [0, 1], f"2: {BIN}": [1]}


def test_a_hook_calling_an_override_added_to_a_plain_container_model_later_is_recorded() -> None:
    # No module of the model called an override at its first forward; a forward hook
    # registered on the model afterwards does (torch says nothing of a hook added): the
    # model's own hooks give its calls the model's row.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    x = torch.randn(3, 4)
    binarize = recipes.binarize()
    arriving: list[torch.Tensor] = []
    returned: list[torch.Tensor] = []

    def hook(module: nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        out.register_hook(lambda g: returned.append(g.clone()))  # type: ignore[no-untyped-call]
        y: torch.Tensor = binarize(out)
        y.register_hook(lambda g: arriving.append(g.clone()))  # type: ignore[no-untyped-call]
        return y

    with go.monitor(model) as mon:
        model(x).sum().backward()
        model.register_forward_hook(hook)
        for _ in range(2):
            model(x).sum().backward()
    records = mon.history[f"(model): {BIN}"]
    assert [r.step for r in records] == [0, 1]  # (the first pass reached no override)
    _check(records, arriving, returned)


def test_a_module_inserted_without_torch_s_registration_is_recorded() -> None:
    # `Sequential.insert` sets the module in `_modules` itself, unseen by torch's
    # registration hook: the module is not hooked, and its override's row is the model's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), recipes.binarize().module())
    x = torch.randn(3, 4)
    tapped = Tapped()
    with go.monitor(model) as mon:
        model(x).sum().backward()
        model.insert(1, tapped)
        for _ in range(2):
            model(x).sum().backward()
    records = mon.history[f"(model): {BIN}"]
    assert [r.step for r in records] == [1, 2]
    _check(records, tapped.arriving, tapped.returned)


def test_a_module_moved_to_another_attribute_is_recorded_at_its_new_path() -> None:
    # A step's rows are those of the last recorded step for the same calls, unless the
    # model's paths were read again since (torch registered a module): a module moved from
    # one attribute to another is recorded under its new path from the next step on.
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = recipes.binarize().module()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            (child,) = self.children()
            out: torch.Tensor = child(x)
            return out

    torch.manual_seed(0)
    model = Holder()
    x = torch.randn(3, 4, requires_grad=True)
    with go.monitor(model) as mon:
        for _ in range(2):
            model(x).sum().backward()
        model.b = model.a
        del model.a
        for _ in range(2):
            model(x).sum().backward()
    assert {label: [r.step for r in records] for label, records in mon.history.items()} == {
        f"a: {BIN}": [0, 1], f"b: {BIN}": [2, 3]}


def test_modules_shifted_by_an_insert_are_recorded_at_their_new_paths() -> None:
    # `Sequential.insert` moves the modules after it without torch's registration: their
    # new paths are read when the new module is met, and the rows of the steps after are
    # read at them (not taken from the steps before, at the old paths).
    torch.manual_seed(0)
    first, second, new = recipes.binarize(), recipes.ste_sign(), recipes.ste_round()
    model = nn.Sequential(first.module(), second.module())
    x = torch.randn(3, 4, requires_grad=True)
    with go.monitor(model) as mon:
        for _ in range(2):
            model(x).sum().backward()
        model.insert(0, new.module())
        for _ in range(3):
            model(x).sum().backward()
    later = {label: [r.step for r in records if r.step >= 3]
             for label, records in mon.history.items()}
    assert {label: steps for label, steps in later.items() if steps} == {
        f"0: {new!r}": [3, 4], f"1: {first!r}": [3, 4], f"2: {second!r}": [3, 4]}


def test_a_module_called_from_outside_the_model_then_set_in_it_gets_its_path() -> None:
    # The model calls a recipe module it holds in a list (its calls are the model's rows);
    # set in the model's modules directly (no registration), the module is looked up again
    # at the next forward, and its rows are at its path from then on.
    class Side(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.side = [recipes.binarize().module()]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.side[0](self.fc(x))
            return out

    torch.manual_seed(0)
    model = Side()
    x = torch.randn(3, 4)
    with go.monitor(model) as mon:
        for _ in range(2):
            model(x).sum().backward()
        model._modules["act"] = model.side[0]
        for _ in range(3):
            model(x).sum().backward()
    assert {label: [r.step for r in records] for label, records in mon.history.items()} == {
        f"(model): {BIN}": [0, 1], f"act: {BIN}": [2, 3, 4]}
