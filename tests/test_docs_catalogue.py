"""The tables of docs/recipes.md, the recipes catalogue, against the recipes themselves.

Each number a table shows (a default, a forward value or a gradient at 0 or at the end of a
window, a peak sg(0), a peer library's parameter and default) is read from the page and
compared with what the recipe does, measured with plain autograd (`y.backward()` on a
tensor), and each surrogate formula on the page is evaluated as written and compared with
the recipe's backward. The page is one side, the recipe's behaviour the other; a table that
goes stale fails here. (The page's code blocks are run by tests/test_docs.py.)
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import inspect
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gradoverride as go
from gradoverride import recipes as R

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "recipes.md"
TEXT = PAGE.read_text(encoding="utf-8")

#: Where each recipe is catalogued: the page's `##` sections (other pages link to them).
FAMILIES = {
    "Straight-through family": [
        "ste_round", "ste_floor", "ste_ceil", "ste_sign", "ste_clamp", "binarize",
        "abs_subgradient", "ternarize", "quantize", "lsq",
    ],
    "Surrogate spikes": ["spike"],
    "Discrete choices": ["ste_argmax", "gumbel_softmax", "rotation_trick"],
    "Gradient flow": [
        "reverse_grad", "scale_grad", "ganin_ramp", "clip_grad_value", "clip_grad_norm",
        "sanitize_grad",
    ],
    "Black-box solvers": ["blackbox_solver", "perturbed_optimizer"],
}
#: In `recipes.__all__` but not recipes: base classes, module forms, constants.
NOT_RECIPES = {
    "GradientTransform", "LearnedAlphaSpike", "LearnedStepQuantizer", "Recipe", "RecipeModule",
    "ScaledGradientModule", "SPIKE_PRESETS", "SURROGATES", "BINARIZE_PRESETS", "CLAMP_PRESETS",
}


# ---- reading the page --------------------------------------------------------------------------


def _sections() -> dict[str, str]:
    parts = re.split(r"^## (.+)$", TEXT, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


SECTIONS = _sections()


def _tables(text: str) -> list[list[list[str]]]:
    """Every markdown table in `text`: a list of rows (the header first), each a list of cells."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not all(set(cell) <= {"-", ":", " "} for cell in cells):  # not the rule line
                current.append(cells)
        elif current:
            tables.append(current)
            current = []
    return tables


def _table(header: str, text: str = TEXT) -> list[dict[str, str]]:
    """The rows of the one table whose first header cell is `header`, as dicts by column."""
    found = [t for t in _tables(text) if t[0][0] == header]
    assert len(found) == 1, f"expected one table headed {header!r} on the page, got {len(found)}"
    head, *rows = found[0]
    for row in rows:
        assert len(row) == len(head), f"a row of the {header!r} table has {len(row)} cells: {row}"
    return [dict(zip(head, row, strict=True)) for row in rows]


def _code(cell: str) -> list[str]:
    """The code spans of a cell."""
    return re.findall(r"`([^`]*)`", cell)


def _numbers(span: str) -> list[str]:
    return [v.strip() for v in span.split(",")]


def _eval_recipe(source: str) -> Any:
    return eval(source, {name: getattr(R, name) for name in R.__all__})


# ---- signatures and defaults -------------------------------------------------------------------


def _signature_rows() -> dict[str, tuple[str, str]]:
    """Each recipe's signature as the page writes it, and the section it is in: the first
    cell of the `recipe` tables, and spike's signature, which opens its section."""
    found: dict[str, tuple[str, str]] = {}
    for section, text in SECTIONS.items():
        spans = [_code(t_row[0])[0] for table in _tables(text) if table[0][0] == "recipe"
                 for t_row in table[1:]]
        if section == "Surrogate spikes":
            spans.append(next(s for s in _code(text) if s.startswith("spike(")))
        for span in spans:
            name = span.split("(")[0]
            assert name not in found, f"{name} has two signature rows on the page"
            found[name] = (span, section)
    return found


SIGNATURES = _signature_rows()


def test_every_recipe_is_catalogued_in_its_family() -> None:
    recipes = set(R.__all__) - NOT_RECIPES
    assert {n for names in FAMILIES.values() for n in names} == recipes
    assert set(SIGNATURES) == recipes
    for section, names in FAMILIES.items():
        assert section in SECTIONS, f"the page has no section `## {section}`"
        for name in names:
            assert SIGNATURES[name][1] == section, f"{name} is not under `## {section}`"


def _parameters(call: ast.Call) -> list[tuple[str, Any]]:
    """(name, default) for each argument of a written signature; a bare name is required."""
    params: list[tuple[str, Any]] = []
    for arg in call.args:
        assert isinstance(arg, ast.Name), f"a positional argument must be a name: {ast.dump(arg)}"
        params.append((arg.id, inspect.Parameter.empty))
    for keyword in call.keywords:
        assert keyword.arg is not None
        params.append((keyword.arg, ast.literal_eval(keyword.value)))
    return params


def _actual(fn: Any, skip_self: bool = False) -> list[tuple[str, Any]]:
    params = list(inspect.signature(fn).parameters.values())
    if skip_self:
        params = params[1:]
    return [(p.name, p.default) for p in params]


@pytest.mark.parametrize("name", sorted(set(R.__all__) - NOT_RECIPES))
def test_signature_and_defaults(name: str) -> None:
    span = SIGNATURES[name][0]
    # A bare `*` (what follows is keyword-only) is no call syntax: read, then checked apart.
    head, star, keyword_only = span.partition(", *, ")
    if star:
        span = f"{head}, {keyword_only}"
        written = [p.split("=")[0].strip() for p in keyword_only.rstrip(")").split(",")]
        kinds = inspect.signature(getattr(R, name)).parameters
        assert all(kinds[p].kind is inspect.Parameter.KEYWORD_ONLY for p in written), span
    tree = ast.parse(span, mode="eval").body
    assert isinstance(tree, ast.Call)
    factory = getattr(R, name)
    if isinstance(tree.func, ast.Call):  # `lsq(...)(x, step)`: the call's signature too
        assert _parameters(tree) == _actual(factory.__call__, skip_self=True), span
        tree = tree.func
    assert isinstance(tree.func, ast.Name) and tree.func.id == name, span
    assert _parameters(tree) == _actual(factory), span


# ---- the straight-through family's values at the edges ----------------------------------------


EDGES = _table("call")


def _same(expected: str, actual: float) -> bool:
    value = float(expected)
    if value == 0:  # the sign of a zero is part of the convention (round(-0.5) is -0)
        return actual == 0 and math.copysign(1.0, actual) == math.copysign(1.0, value)
    return math.isclose(actual, value, rel_tol=1e-4, abs_tol=1e-6)


@pytest.mark.parametrize("row", EDGES, ids=[row["call"] for row in EDGES])
def test_values_at_the_edges(row: dict[str, str]) -> None:
    source, *extra = _code(row["call"])
    recipe = _eval_recipe(source)
    args = []
    for assignment in extra:  # `step=1.0`
        _, value = assignment.split("=")
        args.append(torch.tensor(float(value), requires_grad=True))
    xs = [float(v) for v in _numbers(_code(row["x"])[0])]
    x = torch.tensor(xs, dtype=torch.float32, requires_grad=True)
    y = recipe(x, *args)
    y.backward(torch.ones_like(y))
    assert x.grad is not None
    forward, grad = _numbers(_code(row["forward"])[0]), _numbers(_code(row["dL/dx"])[0])
    assert len(forward) == len(grad) == len(xs)
    got_y, got_g = y.detach().tolist(), x.grad.tolist()
    assert all(map(_same, forward, got_y)), f"{source} forward: page {forward}, actual {got_y}"
    assert all(map(_same, grad, got_g)), f"{source} gradient: page {grad}, actual {got_g}"


# ---- the window presets -----------------------------------------------------------------------


WINDOW_PRESETS = _table("window preset")


def _window_preset(row: dict[str, str]) -> str:
    return _code(row["window preset"])[0]


def _eval_with_torch(source: str) -> Any:
    return eval(source, {"torch": torch, **{name: getattr(R, name) for name in R.__all__}})


def test_the_window_preset_table_lists_every_preset() -> None:
    names = [ast.literal_eval(ast.parse(_window_preset(row), mode="eval").body.args[0])
             for row in WINDOW_PRESETS]
    assert names == [*R.BINARIZE_PRESETS, *R.CLAMP_PRESETS]


def _at_the_bounds(fn: Any) -> list[float]:
    """dL/dx at -1 and 1 (float32, upstream 1)."""
    x = torch.tensor([-1.0, 1.0], requires_grad=True)
    fn(x).sum().backward()
    assert x.grad is not None
    return x.grad.tolist()


@pytest.mark.parametrize("row", WINDOW_PRESETS, ids=_window_preset)
def test_window_preset_row(row: dict[str, str]) -> None:
    recipe = _eval_with_torch(_window_preset(row))
    assert repr(recipe) == _code(row["the recipe"])[0]
    expected = [float(v) for v in _numbers(_code(row["dL/dx at -1 and 1"])[0])]
    assert _at_the_bounds(recipe) == expected


@pytest.mark.filterwarnings("ignore")  # the peers' own deprecation warnings
@pytest.mark.parametrize(
    "row", [r for r in WINDOW_PRESETS if _code(r["the library's"])
            and _code(r["the library's"])[0].startswith(("torch.", "brevitas."))],
    ids=_window_preset,
)
def test_window_presets_against_the_library(row: dict[str, str]) -> None:
    """Where the library is installed: its own gradient at the bounds is the table's."""
    call = _code(row["the library's"])[0]
    library = call.split(".")[0]
    module = _import_peer(call.partition("(")[0].rpartition(".")[0])
    if module is None:
        pytest.skip(f"{library} is not importable here")
    function = getattr(module, call.partition("(")[0].rpartition(".")[2])
    arguments = call[call.index("(") + 1:-1]
    expected = [float(v) for v in _numbers(_code(row["dL/dx at -1 and 1"])[0])]
    assert _at_the_bounds(
        lambda x: eval(f"function({arguments})", {"function": function, "x": x, "torch": torch})
    ) == expected


# ---- surrogates --------------------------------------------------------------------------------


SURROGATE_ROWS = _table("surrogate")


def _name(row: dict[str, str]) -> str:
    return _code(row["surrogate"])[0]


def _formula(expression: str, x: torch.Tensor, a: float | None = None,
             **names: Any) -> torch.Tensor:
    """The page's sg(x) (or a library's gradient), evaluated as written (elementwise, in x's
    dtype), with `a` and any other names (a surrogate's parameters, the noise `u`)."""
    def tensor(v: Any) -> torch.Tensor:
        return torch.as_tensor(v, dtype=x.dtype)

    namespace = {
        "x": x, "a": a, "pi": math.pi, "sqrt": math.sqrt, "exp": torch.exp, "abs": torch.abs,
        "sigmoid": torch.sigmoid, "tanh": torch.tanh, "cos": torch.cos, "sum": sum,
        "range": range,
        "where": lambda c, u, v: torch.where(c, tensor(u), tensor(v)),
        "max": lambda u, v: torch.maximum(tensor(u), tensor(v)),
        "minimum": lambda u, v: torch.minimum(tensor(u), tensor(v)),
        **names,
    }
    value = eval(expression, namespace)
    return torch.as_tensor(value, dtype=x.dtype).expand_as(x)


def _own_parameters(row: dict[str, str]) -> dict[str, Any]:
    """The surrogate's parameters and defaults as the `parameters` cell writes them."""
    spans = _code(row["parameters"])
    if not spans:
        return {}
    pairs = [item.split("=") for item in spans[0].split(", ")]
    return {k.strip(): ast.literal_eval(v) for k, v in pairs}


def _autograd(recipe: Any, x: torch.Tensor, **call: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().clone().requires_grad_()
    y = recipe(x, **call)
    y.sum().backward()
    assert x.grad is not None
    return y.detach(), x.grad


def test_the_surrogate_table_lists_every_surrogate() -> None:
    assert [_name(row) for row in SURROGATE_ROWS] == list(R.SURROGATES)


def _default_alpha(row: dict[str, str]) -> float | None:
    cell = row["default alpha"]
    return None if cell == "unused" else float(eval(cell, {"sqrt": math.sqrt, "pi": math.pi}))


#: The noise the formulas' `u` stands for, where a surrogate takes one (leaky_relu's spread).
_U = 0.3


@pytest.mark.parametrize("row", SURROGATE_ROWS, ids=_name)
def test_surrogate_row(row: dict[str, str]) -> None:
    name = _name(row)
    expression = _code(row["sg(x)"])[0]
    default = _default_alpha(row)
    spike = R.spike(surrogate=name)
    own = _own_parameters(row)
    for param, value in own.items():  # the surrogate's own parameters and their defaults
        assert getattr(spike, param) == value, (name, param)
    others = {"leak", "spread", "beta", "terms", "bound"} - set(own)
    assert all(getattr(spike, param) is None for param in others), name
    if default is not None:
        assert spike.alpha == pytest.approx(default, rel=1e-12)
    changed = {p: (v + 2 if p == "terms" else v + 0.25) for p, v in own.items()}
    for alpha, params in ((spike.alpha, own), (3.0, own), (spike.alpha, changed)):
        assert alpha is not None
        recipe = R.spike(surrogate=name, alpha=alpha, **params)
        ends = [0.5 / alpha, 1 / alpha]  # the rectangle's and the triangle's
        x = torch.cat([
            torch.linspace(-3, 3, 601, dtype=torch.float64),
            torch.tensor([0.0, 1e-3, *ends, *(-e for e in ends)], dtype=torch.float64),
        ])
        noise = {"noise": torch.full_like(x, _U)} if recipe.stochastic else {}
        y, grad = _autograd(recipe, x, **noise)
        expected = _formula(expression, x, alpha, u=_U, **params)
        torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)
        assert torch.equal(y, (x > 0).to(x.dtype))  # H(x), H(0) = 0
    at_zero = _autograd(spike, torch.zeros(1, dtype=torch.float64))[1].item()
    assert at_zero == pytest.approx(float(row["sg(0)"]), rel=1e-4, abs=1e-12)
    zero = torch.zeros(1, dtype=torch.float64)
    assert _formula(expression, zero, spike.alpha, u=_U, **own).item() == (
        pytest.approx(float(row["sg(0)"]), rel=1e-4, abs=1e-12)
    )
    assert f"img/surrogates/{name}.png" in row["plot"]


@pytest.mark.parametrize("row", SURROGATE_ROWS, ids=_name)
def test_surrogate_integral(row: dict[str, str]) -> None:
    """The page: the surrogates whose integral column says 1 are each the derivative of a
    smooth step from 0 to 1, at any alpha (the others, `none`, say why in the list below the
    table: a constant, a 1/x tail, a periodic sum)."""
    assert "are each the derivative of a smooth step from 0 to 1" in TEXT
    assert row["integral"] in ("1", "none")
    default = _default_alpha(row)
    own = _own_parameters(row)
    # x = tan(t): the integral over the real line is the integral of sg(tan t) / cos(t)^2.
    t = torch.linspace(-math.pi / 2, math.pi / 2, 400_001, dtype=torch.float64)[1:-1]
    for alpha in (default or 1.0, 3.0):
        sg = _formula(_code(row["sg(x)"])[0], torch.tan(t), alpha, u=_U, **own)
        integral = torch.trapezoid(sg / torch.cos(t) ** 2, t).item()
        if row["integral"] == "1":
            assert integral == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize(
    ("dtype", "big"), [(torch.float16, 1e4), (torch.float32, 1e30)], ids=["float16", "float32"]
)
def test_surrogate_gradients_stay_finite(dtype: torch.dtype, big: float) -> None:
    """The page: no overflow into NaN, at ±1e4 in float16 as at ±1e30 in float32."""
    assert "±1e4 in float16" in TEXT and "±1e30 in float32" in TEXT
    for name in R.SURROGATES:
        x = torch.tensor([-big, -1.0, 0.0, 1.0, big], dtype=dtype)
        assert torch.isfinite(_autograd(R.spike(surrogate=name), x)[1]).all(), name


# ---- presets -----------------------------------------------------------------------------------


PRESET_ROWS = _table("preset")


def _preset(row: dict[str, str]) -> str:
    return _code(row["preset"])[0]


def test_the_preset_table_lists_every_preset() -> None:
    assert [_preset(row) for row in PRESET_ROWS] == list(R.SPIKE_PRESETS)


def _library_call(row: dict[str, str]) -> tuple[str, list[ast.expr], dict[str, Any]]:
    call = ast.parse(_code(row["the library's surrogate"])[0], mode="eval").body
    assert isinstance(call, ast.Call)
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg}
    return ast.unparse(call.func), call.args, keywords


def _changed(value: Any) -> Any:
    """Another valid value of a library parameter (a default of 0 cannot be doubled)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value + 1
    return 2 * value if value else 0.25


#: Library parameters the formula does not use (the page says so).
UNUSED = {("norse.super", "alpha"): "norse's `super` does not use alpha",
          ("norse.super_fn", "alpha"): "norse's `super` does not use alpha"}


@pytest.mark.parametrize("row", PRESET_ROWS, ids=_preset)
def test_preset_row(row: dict[str, str]) -> None:
    name = _preset(row)
    spike = R.spike.preset(name)
    assert repr(spike) == _code(row["`spike.preset(name)`"])[0]
    _, _, keywords = _library_call(row)
    for param, default in keywords.items():  # the library's parameter names and defaults
        assert R.spike.preset(name, **{param: default}) == spike
        if (name, param) in UNUSED:
            assert UNUSED[name, param] in TEXT
        else:
            assert R.spike.preset(name, **{param: _changed(default)}) != spike, param
    if not keywords:
        with pytest.raises(go.GradOverrideTypeError, match="takes no parameter"):
            R.spike.preset(name, alpha=1.0)
    zero = torch.zeros(1, dtype=torch.float64)
    y, grad = _autograd(spike, zero, **_seeded(spike))
    if row["H(0)"] == "sampled":
        assert spike.sample
    else:
        assert y.item() == float(row["H(0)"]) == spike.at_zero
    if row["sg(0)"] == "noise":
        assert spike.spread
    else:
        assert grad.item() == pytest.approx(float(row["sg(0)"]), rel=1e-4, abs=1e-12)
    assert f"img/presets/{name}.png" in row["plot"]


def _seeded(spike: Any) -> dict[str, Any]:
    return {"generator": torch.Generator().manual_seed(0)} if spike.stochastic else {}


@pytest.mark.parametrize("row", PRESET_ROWS, ids=_preset)
def test_preset_gradient_is_the_library_formula(row: dict[str, str]) -> None:
    """The `gradient` column, in the library's own parameter names, evaluated as written at
    the library's defaults and at changed values, against the preset's backward."""
    name = _preset(row)
    _, _, keywords = _library_call(row)
    expression = _code(row["gradient"])[0]
    x = torch.cat([torch.linspace(-3, 3, 601, dtype=torch.float64),
                   torch.tensor([0.0, 0.25, -0.25, 1.0, -1.0, 4.0], dtype=torch.float64)])
    u = torch.rand(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    settings = [keywords, *({**keywords, p: _changed(v)} for p, v in keywords.items())]
    for params in settings:
        spike = R.spike.preset(name, **params)
        noise = {"noise": u} if spike.stochastic and not spike.sample else {}
        _, grad = _autograd(spike, x, **noise)
        expected = _formula(expression, x, u=u, **params)
        peak = expected.abs().max().item()
        torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-12 * max(peak, 1.0))


def _import_peer(module: str) -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except Exception:  # missing, or failing to import with this torch
        return None


def _library_module(row: dict[str, str]) -> str:
    return _library_call(row)[0].rpartition(".")[0]


LIBRARIES = sorted({_library_module(row) for row in PRESET_ROWS})


@pytest.mark.filterwarnings("ignore")  # the peers' own deprecation warnings
@pytest.mark.parametrize("library", LIBRARIES)
def test_presets_against_the_library(library: str) -> None:
    """Where the peer is installed (`pip install -e ".[peers]"`): for each of its rows, its
    parameter's default, and its H(0) and sg(0) at that default, are the table's."""
    module = _import_peer(library)
    if module is None:
        pytest.skip(f"{library} is not importable here")
    rows = [row for row in PRESET_ROWS if _library_module(row) == library]
    assert rows
    for row in rows:
        function, args, keywords = _library_call(row)
        peer = getattr(module, function.rpartition(".")[2])
        parameters = inspect.signature(peer).parameters
        for param, default in keywords.items():  # the library's own default, where it has one
            if parameters[param].default is inspect.Parameter.empty:
                lif = _import_peer("norse.torch.functional.lif")  # norse: LIFParameters'
                assert float(lif.LIFParameters().alpha) == default, _preset(row)
            else:
                assert parameters[param].default == default, _preset(row)
        if library.startswith("norse"):  # functions of x: threshold(x, method, alpha), f(x, k)
            extra = {"method": ast.literal_eval(args[1])} if len(args) > 1 else {}
            surrogate = functools.partial(peer, **extra, **keywords)
        else:
            surrogate = peer(**keywords)
        try:
            torch.manual_seed(0)
            y, grad = _autograd(surrogate, torch.zeros(1))
        except (TypeError, RuntimeError):  # snnTorch 1.0's LSO(): as the page says
            assert _preset(row) == "snntorch.LSO"
            assert "snnTorch 1.0's `LSO()` raises a TypeError" in TEXT
            continue
        if row["H(0)"] != "sampled":
            assert y.item() == float(row["H(0)"]), _preset(row)
        if row["sg(0)"] != "noise":
            assert grad.item() == pytest.approx(float(row["sg(0)"]), rel=1e-4), _preset(row)


# ---- the figures the site shows ----------------------------------------------------------------


def _plots_hook() -> Any:
    pytest.importorskip("matplotlib")
    pytest.importorskip("mkdocs")
    name = "docs_plots_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "docs_plots.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_docs_hook_draws_every_surrogate_shown_on_the_page() -> None:
    hook = _plots_hook()
    figures = hook.figures()
    expected = [f"img/surrogates/{n}.png" for n in (*R.SURROGATES, hook.OVERVIEW)]
    expected += [f"img/presets/{n}.png" for n in R.SPIKE_PRESETS]
    assert list(figures) == expected
    for uri, png in figures.items():
        assert png.startswith(b"\x89PNG\r\n\x1a\n"), uri
        assert f"]({uri})" in TEXT, f"docs/recipes.md does not show {uri}"
    curves = {curve.name: curve for curve in hook.sample_all()}
    for row in SURROGATE_ROWS:  # what is drawn is the recipe's sg, peak as on the page
        assert curves[_name(row)].at_zero == pytest.approx(float(row["sg(0)"]), rel=1e-4)
    assert curves["super_spike"].same_as == "fast_sigmoid"
    assert curves["q_pseudo_spike"].same_as is None  # equal at alpha = 2 only: no alias
    presets = {curve.name: curve for curve in hook.sample_presets()}
    for row in PRESET_ROWS:  # each preset's figure is its gradient at the library's defaults
        if row["sg(0)"] != "noise":
            assert presets[_preset(row)].at_zero == pytest.approx(float(row["sg(0)"]), rel=1e-4)


def test_the_docs_hook_fails_loudly_on_a_surrogate_it_cannot_draw() -> None:
    hook = _plots_hook()
    from mkdocs.exceptions import PluginError

    with pytest.raises(PluginError, match="the surrogate 'no_such_surrogate' cannot be drawn"):
        hook._sample("no_such_surrogate")
