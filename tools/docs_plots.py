"""MkDocs hook: figures the docs show, drawn at build time from the library itself.

For every surrogate in `gradoverride.recipes.SURROGATES` the hook draws sg(x), the gradient
that `recipes.spike(surrogate=name)` actually sends back (autograd on a grid of inputs, not a
formula written here), as `img/surrogates/<name>.png`, and all of them in one figure,
`img/surrogates/overview.png`; and for every preset of `recipes.SPIKE_PRESETS` the gradient
of `recipes.spike.preset(name)` at the library's defaults, as `img/presets/<name>.png` (a
stochastic one with a seeded generator, so that a build draws the same figure). The PNGs
are made in memory and added to the site's files (`on_files`): nothing is written into the
source tree. `docs/recipes.md` must show every
one of them (`on_page_markdown` checks), so a new surrogate without its entry in the
catalogue fails the build, and so does a surrogate that cannot be drawn (an error, a
gradient that is not finite, not shaped like its input, or zero everywhere).

Matplotlib draws with its Agg canvas, without pyplot (no global backend, no display).
"""

from __future__ import annotations

import functools
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.pages import Page

#: Where the figures live on the site, relative to the docs directory.
IMAGE_DIR = "img/surrogates"
PRESET_DIR = "img/presets"
#: The figure with every surrogate (not a surrogate's name: `_draw_all` checks).
OVERVIEW = "overview"
#: The page that must show every figure.
CATALOGUE = "recipes.md"

_X_RANGE = 2.5  # the grid: [-_X_RANGE, _X_RANGE]
_PROBE_ALPHA = 3.0  # a second alpha, to tell an alias from formulas that meet at a default
_POINTS = 501  # odd, so that x = 0 is on the grid
_DPI = 100
# A surrogate's or preset's own figure is a thumbnail in its table row, shown 9.5rem wide
# (docs/stylesheets/extra.css): drawn at that size (about 190 by 95 px on a desktop) with
# fonts readable there, at twice the pixels for sharp high-density screens. Its row names
# it, so it has no title.
_SINGLE_SIZE = (1.9, 0.95)  # inches
_SINGLE_DPI = 2 * _DPI
_OVERVIEW_SIZE = (7.6, 4.4)


class Curve(NamedTuple):
    """One surrogate sampled on the grid: sg(x) from the recipe's backward."""

    name: str
    alpha: float
    x: tuple[float, ...]
    sg: tuple[float, ...]
    same_as: str | None  # an earlier surrogate with the same gradient at any alpha (an alias)
    uses_alpha: bool = True  # whether another alpha draws another curve

    @property
    def at_zero(self) -> float:
        return self.sg[len(self.sg) // 2]


def _sample(name: str, preset: bool = False, alpha: float | None = None
            ) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """`recipes.spike(surrogate=name)` (or `recipes.spike.preset(name)`) applied to a grid
    with requires_grad; the gradient of the sum is sg at each point. Raises PluginError if
    it cannot be drawn."""
    import torch

    from gradoverride import recipes

    what = "preset" if preset else "surrogate"
    try:
        spike = (recipes.spike.preset(name) if preset
                 else recipes.spike(surrogate=name, alpha=alpha))
        # x = 0 exactly in the middle (linspace's middle point may be 4e-16 off, which a
        # one-sided surrogate tells apart)
        half = (_POINTS - 1) // 2
        x = (torch.arange(-half, half + 1, dtype=torch.float64) * (_X_RANGE / half))
        x.requires_grad_()
        generator = torch.Generator().manual_seed(0) if spike.stochastic else None
        spike(x, generator=generator).sum().backward()  # type: ignore[no-untyped-call]
    except Exception as error:
        msg = f"docs_plots: the {what} {name!r} cannot be drawn: {error!r}"
        raise PluginError(msg) from error
    grad = x.grad
    grid = f"[-{_X_RANGE}, {_X_RANGE}]"
    problem = None
    if grad is None:
        problem = "its spike gives the input no gradient"
    elif grad.shape != x.shape:
        problem = f"its gradient has shape {tuple(grad.shape)}, not {tuple(x.shape)}"
    elif not bool(torch.isfinite(grad).all()):
        problem = f"its gradient is not finite on {grid}"
    elif not bool((grad != 0).any()):
        problem = f"its gradient is zero everywhere on {grid}"
    if problem is not None or grad is None:
        msg = f"docs_plots: the {what} {name!r} cannot be drawn: {problem}."
        raise PluginError(msg)
    xs = tuple(float(v) for v in x.detach().tolist())
    assert spike.alpha is not None  # spike sets its default alpha when given None
    return spike.alpha, xs, tuple(float(v) for v in grad.tolist())


def sample_all() -> list[Curve]:
    """Every surrogate of `recipes.SURROGATES`, sampled, aliases marked."""
    from gradoverride import recipes

    names: Sequence[str] = recipes.SURROGATES
    if not names:
        msg = "docs_plots: gradoverride.recipes.SURROGATES is empty; nothing to draw."
        raise PluginError(msg)
    if OVERVIEW in names:
        msg = f"docs_plots: a surrogate is named {OVERVIEW!r}, the overview figure's name."
        raise PluginError(msg)
    curves: list[Curve] = []
    probes: dict[str, tuple[float, ...]] = {}  # sg at another alpha: two formulas may meet
    for name in names:
        alpha, xs, sg = _sample(name)
        probes[name] = _sample(name, alpha=_PROBE_ALPHA)[2]
        same_as = next(
            (c.name for c in curves if c.same_as is None and c.sg == sg and c.alpha == alpha
             and probes[c.name] == probes[name]),
            None,
        )
        curves.append(Curve(name, alpha, xs, sg, same_as, uses_alpha=probes[name] != sg))
    return curves


def sample_presets() -> list[Curve]:
    """Every preset of `recipes.SPIKE_PRESETS`, sampled at the library's defaults."""
    from gradoverride import recipes

    curves = []
    for name in recipes.SPIKE_PRESETS:
        alpha, xs, sg = _sample(name, preset=True)
        curves.append(Curve(name, alpha, xs, sg, None))
    return curves


def _style(axes: Axes, sg: Sequence[float] = (0.0, 1.0)) -> None:
    axes.set_xlim(-_X_RANGE, _X_RANGE)
    low, high = min(0.0, *sg), max(1.0, *sg)  # from 0 to 1, or wider where sg goes
    pad = 0.07 * (high - low)
    axes.set_ylim(low - pad, high + pad * 2.5)
    axes.axhline(0.0, color="0.75", linewidth=0.6, zorder=0)
    axes.axvline(0.0, color="0.75", linewidth=0.6, zorder=0)
    axes.tick_params(labelsize=7, length=2)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)


def _alpha_note(curve: Curve) -> str:
    """The default alpha, for a surrogate whose shape depends on it."""
    return f" (alpha={curve.alpha:.3g})" if curve.uses_alpha else ""


def _png(figure: object) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    assert isinstance(figure, Figure)
    canvas = FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    # No metadata (matplotlib's version): the same figure gives the same bytes.
    canvas.print_png(buffer, metadata={"Software": None})  # type: ignore[no-untyped-call]
    return buffer.getvalue()


def draw_one(curve: Curve) -> bytes:
    """sg(x) of one surrogate (or preset), with the step H(x) it stands in for, as a PNG
    thumbnail for its table row (which names it and gives its alpha)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=_SINGLE_SIZE, dpi=_SINGLE_DPI)
    figure.subplots_adjust(left=0.15, right=0.98, bottom=0.19, top=0.97)
    axes = figure.add_subplot()
    _style(axes, curve.sg)
    axes.tick_params(labelsize=6.5, length=2, pad=1.5)
    axes.step([-_X_RANGE, 0.0, _X_RANGE], [0.0, 1.0, 1.0], where="post", color="0.55",
              linewidth=0.9, linestyle="--", label="H(x)")
    axes.plot(curve.x, curve.sg, color="tab:blue", linewidth=1.5, label="sg(x)")
    axes.plot([0.0], [curve.at_zero], "o", color="tab:blue", markersize=2.5)
    # Where it hides the least of the curves (a flat sg leaves the top left no room).
    axes.legend(fontsize=6, loc="best", frameon=False, handlelength=1.6, borderaxespad=0.1,
                labelspacing=0.2)
    return _png(figure)


def draw_overview(curves: Sequence[Curve]) -> bytes:
    """Every distinct surrogate's sg(x) in one figure (an alias is named with its formula's
    first name), as a PNG."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=_OVERVIEW_SIZE, dpi=_DPI)
    figure.subplots_adjust(left=0.06, right=0.57, bottom=0.14, top=0.9)
    axes = figure.add_subplot()
    _style(axes, [v for curve in curves for v in curve.sg])
    aliases: dict[str, list[str]] = {}
    for curve in curves:
        if curve.same_as is not None:
            aliases.setdefault(curve.same_as, []).append(curve.name)
    for curve in curves:
        if curve.same_as is not None:
            continue
        label = " = ".join([curve.name, *aliases.get(curve.name, [])])
        axes.plot(curve.x, curve.sg, linewidth=1.4, label=label + _alpha_note(curve))
    axes.set_xlabel("x", fontsize=8)
    axes.set_title("sg(x) of every surrogate at its default alpha (spike's backward)",
                   fontsize=9)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _png(figure)


@functools.cache
def figures() -> dict[str, bytes]:
    """Each figure's site path and PNG bytes. Cached for the process: `mkdocs serve`
    rebuilds with the library already imported, so the figures cannot change."""
    curves = sample_all()
    drawn = {f"{IMAGE_DIR}/{curve.name}.png": draw_one(curve) for curve in curves}
    drawn[f"{IMAGE_DIR}/{OVERVIEW}.png"] = draw_overview(curves)
    for curve in sample_presets():
        drawn[f"{PRESET_DIR}/{curve.name}.png"] = draw_one(curve)
    return drawn


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    """Add the figures to the site, as files generated in memory."""
    for src_uri, png in figures().items():
        if files.get_file_from_path(src_uri) is not None:
            msg = (
                f"docs_plots: docs/{src_uri} exists, but the hook generates it; remove the "
                "file from the docs directory."
            )
            raise PluginError(msg)
        files.append(File.generated(config, src_uri, content=png))
    return files


def on_page_markdown(
    markdown: str, *, page: Page, config: MkDocsConfig, files: Files
) -> str:
    """Check that the catalogue shows every figure."""
    if page.file.src_uri != CATALOGUE:
        return markdown
    missing = [uri for uri in figures() if uri not in markdown]
    if missing:
        msg = (
            f"docs_plots: docs/{CATALOGUE} does not show {', '.join(missing)}; add each as "
            f"![name]({missing[0]}) next to its surrogate."
        )
        raise PluginError(msg)
    return markdown
