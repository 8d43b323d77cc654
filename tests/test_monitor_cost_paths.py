"""The cheaper paths of `go.monitor` record the numbers the plain computation gives: the
reduction of a recorded step (dot products, kept buffers, many calls stacked), the rows read
once per backward pass for calls that share one, and the early return of a node reached in a
step that is not recorded. Each is checked against statistics computed here from the
gradients themselves (tensor hooks on the same run, or the tensors handed in)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import gradoverride as go
from gradoverride import recipes
from gradoverride.diagnostics._recorder import Gradients, Site
from gradoverride.diagnostics._statistics import FIELDS, GradientStatistics


def _expected(arriving: list[torch.Tensor], returned: list[torch.Tensor]) -> dict[str, float]:
    """The FIELDS numbers of one override's calls, computed in float64, element by element."""
    got = torch.cat([g.reshape(-1).double() for g in arriving])
    gave = torch.cat([g.reshape(-1).double() for g in returned])
    finite_got = torch.where(torch.isfinite(got), got, torch.zeros_like(got))
    finite_gave = torch.where(torch.isfinite(gave), gave, torch.zeros_like(gave))
    return {
        "calls": float(len(arriving)),
        "in_sq": float((finite_got * finite_got).sum()),
        "out_sq": float((finite_gave * finite_gave).sum()),
        "zeroed": float(((got != 0) & (gave == 0)).sum()),
        "paired": float((got != 0).sum()),
        "nan_in": float(got.isnan().sum()),
        "inf_in": float(got.isinf().sum()),
        "nan_out": float(gave.isnan().sum()),
        "inf_out": float(gave.isinf().sum()),
    }


def _group(arriving: list[torch.Tensor], returned: list[torch.Tensor]) -> Gradients:
    return Gradients(calls=len(arriving), arriving=arriving, returned=returned,
                     pairs=list(zip(returned, arriving, strict=True)))


def _pair(shape: tuple[int, ...], generator: torch.Generator,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """An arriving gradient with some exact zeros, and a returned one that zeroes about a
    third of it and is nonzero in a few places where the arriving one is zero."""
    got = torch.randn(shape, generator=generator, dtype=torch.float64)
    got = got * (torch.rand(shape, generator=generator, dtype=torch.float64) > 0.1)
    keep = torch.rand(shape, generator=generator, dtype=torch.float64) > 0.3
    extra = (got == 0) & (torch.rand(shape, generator=generator, dtype=torch.float64) > 0.5)
    gave = torch.where(extra, torch.ones_like(got), got * keep * 0.5)
    return got.to(dtype), gave.to(dtype)


def _groups(seed: int) -> tuple[dict[tuple[Site, int], Gradients],
                                 dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]]]:
    generator = torch.Generator().manual_seed(seed)
    cases: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    # One call of a small MLP's width (below the kept-buffer size).
    got, gave = _pair((128, 96), generator)
    cases["small"] = [got], [gave]
    # One call large enough for the kept buffers (2**14 elements and up).
    got, gave = _pair((64, 300), generator)
    cases["large"] = [got], [gave]
    # Five calls in the step, stacked into a kept buffer.
    pairs = [_pair((40, 100), generator) for _ in range(5)]
    cases["stacked"] = [g for g, _ in pairs], [r for _, r in pairs]
    # Other dtypes: float64 kept, float16 taken in float64.
    got, gave = _pair((10, 10), generator, torch.float64)
    cases["float64"] = [got], [gave]
    got, gave = _pair((50,), generator, torch.float16)
    cases["float16"] = [got], [gave]
    # Not contiguous (a transposed view, as a matmul's backward gives), beside a contiguous
    # gradient of the same shape: paired element by element all the same.
    got, gave = _pair((96, 128), generator)
    cases["transposed"] = [got.t()], [gave.t().contiguous()]
    # NaN and infinity in one override of the pass: counted, the others unaffected.
    got, gave = _pair((30, 7), generator)
    got[0, 0], gave[1, 1], gave[2, 2] = float("nan"), float("inf"), float("nan")
    cases["nonfinite"] = [got], [gave]
    groups = {
        (Site(name, name, "op"), 0): _group(list(arriving), list(returned))
        for name, (arriving, returned) in cases.items()
    }
    return groups, cases


def test_the_reduction_matches_statistics_computed_from_the_gradients() -> None:
    statistics = GradientStatistics()
    # Three steps through the same kept buffers: what one step wrote there is not read by
    # the next (the third step has new values in the same shapes).
    for seed in (0, 0, 1):
        groups, cases = _groups(seed)
        results = statistics(groups)
        assert len(results) == len(cases)
        for (site, _), numbers in results.items():
            expected = _expected(*cases[site.path])
            got = dict(zip(FIELDS, numbers, strict=True))
            for field in ("calls", "zeroed", "paired", "nan_in", "inf_in", "nan_out",
                          "inf_out"):
                assert got[field] == expected[field], (site.path, field)
            for field in ("in_sq", "out_sq"):
                assert got[field] == pytest.approx(expected[field], rel=1e-6), (
                    site.path, field)


def test_float32_and_float64_on_a_cpu_are_reduced_without_torch_kernels(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The numpy reduction takes them (each torch kernel launch costs more in a training
    # step than the arithmetic); the torch one is left for other dtypes, devices and
    # non-finite sums.
    groups, cases = _groups(0)
    del cases["float16"], cases["nonfinite"]
    groups = {key: grads for key, grads in groups.items() if key[0].path in cases}

    def refused(*args: object) -> None:
        raise AssertionError("the torch reduction ran")

    monkeypatch.setattr(GradientStatistics, "_aligned", refused)
    results = GradientStatistics()(groups)
    for (site, _), numbers in results.items():
        expected = _expected(*cases[site.path])
        got = dict(zip(FIELDS, numbers, strict=True))
        assert (got["zeroed"], got["paired"]) == (expected["zeroed"], expected["paired"])
        assert got["in_sq"] == pytest.approx(expected["in_sq"], rel=1e-6)


def _numbers_of(got: torch.Tensor, gave: torch.Tensor) -> dict[str, float]:
    """The FIELDS numbers of one call that got `got` and gave `gave`, by the reduction."""
    site = Site("one", "one", "op")
    return dict(zip(FIELDS, GradientStatistics()({(site, 0): _group([got], [gave])})[(site, 0)],
                    strict=True))


def test_a_large_float32_gradient_is_summed_in_float64() -> None:
    # 2**22 positive elements: a float32 sum of squares is off by about 5e-7 there (and
    # 3e-4 at 2**26), a float64 one by about 1e-13.
    generator = torch.Generator().manual_seed(0)
    got = torch.rand(2**22, generator=generator) + 0.5
    gave = got * (torch.rand(2**22, generator=generator) > 0.25)
    numbers = _numbers_of(got, gave)
    expected = _expected([got], [gave])
    assert numbers["in_sq"] == pytest.approx(expected["in_sq"], rel=1e-10)
    assert numbers["out_sq"] == pytest.approx(expected["out_sq"], rel=1e-10)
    assert (numbers["zeroed"], numbers["paired"]) == (expected["zeroed"], expected["paired"])


def test_a_numpy_error_state_that_raises_is_not_tripped() -> None:
    # A user's `np.seterr(all="raise")`: squares that underflow (a vanishing gradient) or
    # overflow (a huge one) are read, not raised; the user's state is left as it was.
    for value in (1e-25, 1e20):
        got = torch.full((200,), value)
        gave = got.clone()
        gave[:50] = 0.0
        with np.errstate(all="raise"):
            numbers = _numbers_of(got, gave)
            assert np.geterr()["under"] == "raise"
        expected = _expected([got], [gave])
        assert numbers["in_sq"] == pytest.approx(expected["in_sq"], rel=1e-6)
        assert (numbers["zeroed"], numbers["paired"]) == (50.0, 200.0)


def test_a_vanishing_gradient_keeps_its_norm() -> None:
    # float32 squares of 1e-25 underflow to zero: the sum is taken again in float64.
    got = torch.full((200,), 1e-25)
    gave = got.clone()
    gave[:50] = 0.0
    numbers = _numbers_of(got, gave)
    expected = _expected([got], [gave])
    assert numbers["in_sq"] == pytest.approx(expected["in_sq"], rel=1e-6)
    assert numbers["out_sq"] == pytest.approx(expected["out_sq"], rel=1e-6)
    assert numbers["in_sq"] > 0
    assert (numbers["zeroed"], numbers["paired"]) == (50.0, 200.0)


# -- rows read once per pass ------------------------------------------------------------


class Taps:
    """Per override, the gradients at its output (arriving) and input (returned) of each
    call, read by tensor hooks: the reference."""

    def __init__(self) -> None:
        self.arriving: dict[str, list[torch.Tensor]] = {}
        self.returned: dict[str, list[torch.Tensor]] = {}

    def around(self, name: str, fn, x: torch.Tensor) -> torch.Tensor:
        x = x.view_as(x)  # read only by the override: its gradient is what it returned
        x.register_hook(lambda g: self.returned.setdefault(name, []).append(g.clone()))
        y = fn(x)
        y.register_hook(lambda g: self.arriving.setdefault(name, []).append(g.clone()))
        return y

    def clear(self) -> None:
        self.arriving, self.returned = {}, {}


class Recurrent(nn.Module):
    """A recipe called at each time step, one made at each call with settings alternating
    between two values, and the same recipe in a second module."""

    def __init__(self, taps: Taps, name: str, spike) -> None:
        super().__init__()
        self.fc = nn.Linear(5, 5)
        self.spike = spike
        self.taps, self.name = taps, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = torch.zeros(x.shape[1], 5)
        out = []
        for t, xt in enumerate(x):
            v = 0.9 * v + self.fc(xt)
            s = self.taps.around(self.name, self.spike, v - 0.5)
            fresh = recipes.spike(alpha=3.0 + t % 2)  # a new recipe at each call
            out.append(s + self.taps.around(f"{self.name} alpha={3.0 + t % 2}", fresh, v))
        return torch.stack(out)


class Net(nn.Module):
    def __init__(self, taps: Taps) -> None:
        super().__init__()
        spike = recipes.spike()
        self.first = Recurrent(taps, "first", spike)
        self.second = Recurrent(taps, "second", spike)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x)).sum()


def _by_name(mon: go.Monitor) -> dict[str, list[go.StepRecord]]:
    names = {}
    for label, records in mon.history.items():
        path, _, name = label.partition(": ")
        setting = " alpha=3.0" if "alpha=3.0" in name else (
            " alpha=4.0" if "alpha=4.0" in name else "")
        names[f"{path}{setting}"] = records
    return names


def _check(record: go.StepRecord, taps: Taps, name: str) -> None:
    arriving, returned = taps.arriving[name], taps.returned[name]
    expected = _expected(arriving, returned)
    assert record.calls == len(arriving)
    assert record.grad_in == pytest.approx(math.sqrt(expected["in_sq"]), rel=1e-6)
    assert record.grad_out == pytest.approx(math.sqrt(expected["out_sq"]), rel=1e-6)
    assert record.zeroed == pytest.approx(expected["zeroed"] / expected["paired"], abs=1e-12)


def test_calls_sharing_a_row_in_a_pass_are_recorded_as_tensor_hooks_see_them() -> None:
    torch.manual_seed(0)
    taps = Taps()
    net = Net(taps)
    with go.monitor(net) as mon:
        for step in range(3):
            taps.clear()
            net(torch.randn(6, 4, 5)).backward()
            rows = {name: records[step] for name, records in _by_name(mon).items()}
            assert set(rows) == {"first", "second", "first alpha=3.0", "first alpha=4.0",
                                 "second alpha=3.0", "second alpha=4.0"}
            for name, record in rows.items():
                assert record.step == step
                _check(record, taps, name)


def test_a_graph_run_twice_records_both_passes_in_their_rows() -> None:
    torch.manual_seed(0)
    taps = Taps()
    net = Net(taps)
    with go.monitor(net) as mon:
        loss = net(torch.randn(4, 3, 5))
        loss.backward(retain_graph=True)
        first = {name: (list(a), list(taps.returned[name]))
                 for name, a in taps.arriving.items()}
        taps.clear()
        loss.backward()
    assert mon.steps == 2
    for name, records in _by_name(mon).items():
        assert [r.step for r in records] == [0, 1]
        _check(records[1], taps, name)
        taps_first = Taps()
        taps_first.arriving[name], taps_first.returned[name] = first[name]
        _check(records[0], taps_first, name)


def test_passes_reaching_part_of_the_model_are_counted_on_unrecorded_steps() -> None:
    # Each forward is followed by two passes: the first reaches only the first override,
    # the second both. Steps 0, 3, 6, ... are recorded, whichever pass they are.
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = recipes.binarize().module()
            self.b = recipes.binarize().module()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.a(x)
            return h, self.b(self.fc(h))

    model = Two()
    with go.monitor(model, every=3) as mon:
        for _ in range(5):
            x = torch.randn(4, 3, requires_grad=True)
            h, y = model(x)
            torch.autograd.grad(h.sum(), x, retain_graph=True)  # reaches `a` only
            y.sum().backward()
    assert mon.steps == 10
    steps = {label.partition(":")[0]: [r.step for r in records]
             for label, records in mon.history.items()}
    # Passes 0, 2, 4, ... reach `a` only; 1, 3, 5, ... both.
    assert steps == {"a": [0, 3, 6, 9], "b": [3, 9]}


def test_a_recipe_module_under_the_monitor_runs_a_wrapper_put_around_its_call() -> None:
    # A recipe's module form, while recorded, skips its class's own recorder wrapper (the
    # module is on the recorder's stack already), never one a class decorator put around
    # it: the monitored forward is the plain one, and so is the recorded gradient.
    import dataclasses
    import functools

    def times_ten(cls: type) -> type:
        inner = cls.__call__  # type: ignore[operator]

        @functools.wraps(inner)
        def __call__(self: object, x: torch.Tensor) -> torch.Tensor:
            return 10 * inner(self, x)  # type: ignore[no-any-return]

        cls.__call__ = __call__  # type: ignore[operator]
        return cls

    @times_ten
    @dataclasses.dataclass(frozen=True, repr=False)
    class Rounded(recipes.Recipe):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = recipes.ste_round()(x)
            return out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), Rounded().module())
    x = torch.randn(4, 3)
    plain = model(x)
    with go.monitor(model) as mon:
        monitored = model(x)
        arriving = torch.ones_like(monitored)
        monitored.backward(arriving)
    assert torch.equal(monitored, plain)
    assert torch.equal(plain, 10 * torch.round(model[0](x)))
    (record,) = mon.history["1: ste_round()"]
    # the straight-through op gets the gradient after the decorator's factor of 10
    assert record.grad_in == pytest.approx(10 * math.sqrt(arriving.numel()))
