"""MkDocs hook: figures the docs show, drawn at build time from the library itself.

For every surrogate in `gradoverride.recipes.SURROGATES` the hook draws sg(x), the gradient
that `recipes.spike(surrogate=name)` actually sends back (autograd on a grid of inputs, not a
formula written here), as `img/surrogates/<name>.png`, and all of them in one figure,
`img/surrogates/overview.png`. The PNGs are made in memory and added to the site's files
(`on_files`): nothing is written into the source tree. `docs/recipes.md` must show every
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
#: The figure with every surrogate (not a surrogate's name: `_draw_all` checks).
OVERVIEW = "overview"
#: The page that must show every figure.
CATALOGUE = "recipes.md"

_X_RANGE = 2.5  # the grid: [-_X_RANGE, _X_RANGE]
_POINTS = 501  # odd, so that x = 0 is on the grid
_DPI = 100
_SINGLE_SIZE = (3.0, 1.7)  # inches
_OVERVIEW_SIZE = (7.6, 3.2)


class Curve(NamedTuple):
    """One surrogate sampled on the grid: sg(x) from the recipe's backward."""

    name: str
    alpha: float
    x: tuple[float, ...]
    sg: tuple[float, ...]
    same_as: str | None  # an earlier surrogate with the same gradient (an alias)

    @property
    def at_zero(self) -> float:
        return self.sg[len(self.sg) // 2]


def _sample(name: str) -> tuple[float, tuple[float, ...], tuple[float, ...]]:
    """`recipes.spike(surrogate=name)` applied to a grid with requires_grad; the gradient of
    the sum is sg at each point. Raises PluginError if it cannot be drawn."""
    import torch

    from gradoverride import recipes

    try:
        spike = recipes.spike(surrogate=name)
        x = torch.linspace(-_X_RANGE, _X_RANGE, _POINTS, dtype=torch.float64,
                           requires_grad=True)
        spike(x).sum().backward()  # type: ignore[no-untyped-call]
    except Exception as error:
        msg = f"docs_plots: the surrogate {name!r} cannot be drawn: {error!r}"
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
        msg = f"docs_plots: the surrogate {name!r} cannot be drawn: {problem}."
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
    for name in names:
        alpha, xs, sg = _sample(name)
        same_as = next(
            (c.name for c in curves if c.same_as is None and c.sg == sg and c.alpha == alpha),
            None,
        )
        curves.append(Curve(name, alpha, xs, sg, same_as))
    return curves


def _style(axes: Axes) -> None:
    axes.set_xlim(-_X_RANGE, _X_RANGE)
    axes.set_ylim(-0.08, 1.18)
    axes.axhline(0.0, color="0.75", linewidth=0.6, zorder=0)
    axes.axvline(0.0, color="0.75", linewidth=0.6, zorder=0)
    axes.tick_params(labelsize=7, length=2)
    for side in ("top", "right"):
        axes.spines[side].set_visible(False)


def _alpha_note(curve: Curve, sep: str) -> str:
    """The default alpha, for a surrogate whose shape depends on it (not a constant sg)."""
    if len(set(curve.sg)) == 1:
        return ""
    return f"{sep}alpha={curve.alpha:.3g}" if sep != " " else f" (alpha={curve.alpha:.3g})"


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
    """sg(x) of one surrogate, with the step H(x) it stands in for, as a PNG."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=_SINGLE_SIZE, dpi=_DPI)
    figure.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.86)
    axes = figure.add_subplot()
    _style(axes)
    axes.step([-_X_RANGE, 0.0, _X_RANGE], [0.0, 1.0, 1.0], where="post", color="0.55",
              linewidth=0.9, linestyle="--", label="H(x)")
    axes.plot(curve.x, curve.sg, color="tab:blue", linewidth=1.6, label="sg(x)")
    axes.plot([0.0], [curve.at_zero], "o", color="tab:blue", markersize=3)
    alias = f" = {curve.same_as}" if curve.same_as else ""
    axes.set_title(f"{curve.name}{alias}{_alpha_note(curve, ', ')}", fontsize=8)
    axes.legend(fontsize=6, loc="center right", frameon=False)
    return _png(figure)


def draw_overview(curves: Sequence[Curve]) -> bytes:
    """Every distinct surrogate's sg(x) in one figure (an alias is named with its formula's
    first name), as a PNG."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=_OVERVIEW_SIZE, dpi=_DPI)
    figure.subplots_adjust(left=0.06, right=0.57, bottom=0.14, top=0.9)
    axes = figure.add_subplot()
    _style(axes)
    aliases: dict[str, list[str]] = {}
    for curve in curves:
        if curve.same_as is not None:
            aliases.setdefault(curve.same_as, []).append(curve.name)
    for curve in curves:
        if curve.same_as is not None:
            continue
        label = " = ".join([curve.name, *aliases.get(curve.name, [])])
        axes.plot(curve.x, curve.sg, linewidth=1.4, label=label + _alpha_note(curve, " "))
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
