"""`go.overrides(model)`: the rows of a model built with a known set of overrides, nested
and removed ones included; the table; bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradoverride as go
from gradoverride import recipes


class Inner(go.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight

    def backward(self, grad, *, x):
        return {"x": grad, "weight": None}


class Outer(go.Module, owns="x"):
    """A go.Module holding another (nested rules)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def backward(self, grad, *, x):
        return {"x": 2 * grad}


@go.custom_backward
def twice(x: torch.Tensor) -> torch.Tensor:
    return 2 * x


@twice.backward
def _(grad, *, x):
    return grad


@go.custom_backward
def unused(x: torch.Tensor) -> torch.Tensor:
    return x


@unused.backward
def _(grad, *, x):
    return grad


class Holder(nn.Module):
    """Holds a recipe it calls and an op it never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.spike = recipes.spike()
        self.spare = unused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.spike(x)


def _rule(grad, *, module):
    return grad @ module.weight


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("outer", Outer())
    model.add_module("act", recipes.binarize().module())
    model.add_module("rev", recipes.reverse_grad(0.5).module())
    model.add_module("op", twice.module())
    model.add_module("fc", nn.Linear(4, 4))
    model.add_module("gone", nn.Linear(4, 4))
    model.add_module("neuron", Holder())
    go.override_backward(model.fc, _rule, owns="input")
    go.override_backward(model.gone, _rule).remove()
    go.grad_hook(model.fc, recipes.clip_grad_value(0.1), at="inputs")
    go.grad_hook(model.gone, recipes.clip_grad_value(0.1), at="outputs").remove()
    go.grad_hook(model.gone, recipes.reverse_grad(), at="parameters")
    return model


EXPECTED = [
    ("outer", "go.Module", "Outer", "backward=Outer.backward; owns=x", True),
    ("outer.inner", "go.Module", "Inner", "backward=Inner.backward", True),
    ("act", "recipe module", "binarize(clip=1.0, inclusive=True, keep='input')", "", True),
    ("rev", "recipe module", "reverse_grad(scale=0.5)", "", True),
    ("op", "op module", "twice", "", True),
    ("fc", "override_backward", "Linear", "backward=_rule; owns=input", True),
    ("fc", "grad_hook", "clip_grad_value(clip_value=0.1)", "at inputs", True),
    ("gone", "grad_hook", "reverse_grad(scale=1.0)", "at parameters", True),
]


def _rows(found: go.Overrides) -> list[tuple[object, ...]]:
    return [(r.path, r.kind, r.name, r.settings, r.active) for r in found]


def test_rows_of_a_known_model_without_running_it() -> None:
    model = make_model()
    spike = model.neuron.spike
    assert _rows(go.overrides(model)) == [
        *EXPECTED,
        ("neuron", "recipe", repr(spike), "attribute `spike`", None),
        ("neuron", "op", "unused", "attribute `spare`", None),
    ]


def test_an_example_forward_finds_what_runs_and_what_does_not() -> None:
    model = make_model()
    spike = model.neuron.spike
    rows = _rows(go.overrides(model, torch.randn(2, 4)))
    assert rows == [
        *EXPECTED,
        ("neuron", "recipe", repr(spike), "attribute `spike`", True),
        ("neuron", "op", "unused", "attribute `spare`", False),
    ]


def test_an_op_called_in_forward_but_not_held_is_listed_where_it_runs() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return twice(self.fc(x)) + twice(x)

    model = Net()
    assert len(go.overrides(model)) == 0
    assert _rows(go.overrides(model, torch.randn(2, 3))) == [
        ("", "op", "twice", "called 2x in forward", True),
    ]


def test_a_hook_at_frozen_parameters_is_inactive() -> None:
    layer = nn.Linear(2, 2)
    layer.requires_grad_(False)
    go.grad_hook(layer, recipes.reverse_grad(), at="parameters")
    (record,) = go.overrides(layer)
    assert (record.path, record.kind, record.active) == ("", "grad_hook", False)


def test_the_table_and_the_empty_inventory() -> None:
    found = go.overrides(make_model())
    text = str(found)
    lines = text.splitlines()
    assert lines[0] == "10 gradient overrides in Sequential"
    assert lines[1].split() == ["path", "kind", "override", "settings", "active"]
    assert set(lines[2]) == {"-", " "}
    assert "outer.inner  go.Module" in text
    assert lines[-1].split()[-1] == "?"  # the unused op: unknown without an example forward
    assert repr(found) == text
    assert str(go.overrides(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))) == (
        "no gradient overrides in Sequential"
    )


def test_indexing_and_slicing() -> None:
    found = go.overrides(make_model())
    assert found[0].path == "outer"
    assert [r.path for r in found[1:3]] == ["outer.inner", "act"]
    assert len(found) == len(list(found))


def test_a_model_saved_and_loaded_keeps_its_inventory(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), recipes.binarize().module())
    go.override_backward(model[0], _rule)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    loaded = torch.load(path, weights_only=False)
    assert _rows(go.overrides(loaded)) == _rows(go.overrides(model))


def test_not_a_model_is_named() -> None:
    with pytest.raises(go.GradOverrideTypeError, match=r"go\.overrides needs a model \(an "
                       r"nn\.Module or a Keras model\); got function"):
        go.overrides(lambda x: x)
    with pytest.raises(go.GradOverrideTypeError, match="got Tensor"):
        go.overrides(torch.ones(2))


def test_a_recipe_made_at_each_call_is_one_row() -> None:
    class Inline(nn.Module):
        def forward(self, x):
            return recipes.ste_round()(x) + recipes.ste_round()(2 * x)

    assert _rows(go.overrides(Inline(), torch.randn(3))) == [
        ("", "recipe", "ste_round()", "called 2x in forward", True),
    ]


def test_recipes_ops_and_bridges_held_in_containers_are_listed() -> None:
    import numpy as np

    sine = go.bridge(np.sin, backward=lambda grad, *, x: grad * np.cos(x))

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quantizers = [recipes.ste_round(), recipes.binarize()]
            self.by_name = {"act": recipes.spike()}
            self.sine = sine
            self.ops = (twice,)

        def forward(self, x):
            return self.sine(self.quantizers[0](x))

    model = nn.Sequential(Holder())
    rows = _rows(go.overrides(model, torch.randn(2, 3)))
    assert rows == [
        ("0", "recipe", "ste_round()", "attribute `quantizers[0]`", True),
        ("0", "recipe", repr(recipes.binarize()), "attribute `quantizers[1]`", False),
        ("0", "recipe", repr(recipes.spike()), "attribute `by_name['act']`", False),
        ("0", "bridge", "bridge(sin)", "attribute `sine`", True),
        ("0", "op", "twice", "attribute `ops[0]`", False),
    ]


def test_a_recipe_calling_recipes_is_active_with_them() -> None:
    import dataclasses

    from gradoverride.recipes import Recipe

    @dataclasses.dataclass(frozen=True, repr=False)
    class quant_then_reverse(Recipe):
        scale: float = 0.5

        def __call__(self, x):
            return recipes.reverse_grad(self.scale)(recipes.binarize()(x))

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = quant_then_reverse()

        def forward(self, x):
            return self.q(x)

    rows = _rows(go.overrides(Holder(), torch.randn(4)))
    assert rows[0] == ("", "recipe", "quant_then_reverse(scale=0.5)", "attribute `q`", True)
    assert [r[2] for r in rows[1:]] == [repr(recipes.binarize()), "reverse_grad(scale=0.5)"]
