"""MkDocs hook: the Diagnostics page's figure, drawn at build time by the library itself.

It trains the spiking example's network (`examples/spiking_neuron.py`, `SpikingNet`) for a
few epochs under `go.monitor(model, every=2)` and adds `Monitor.plot`'s PNG to the site as
`img/diagnostics/monitor.png` (made in a temporary directory, never in the source tree).
`docs/diagnostics.md` must show it (`on_page_markdown` checks), and the build fails if the
monitor recorded nothing.
"""

from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.pages import Page

FIGURE = "img/diagnostics/monitor.png"
PAGE = "diagnostics.md"
_EPOCHS = 40
_EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@functools.cache
def monitor_png() -> bytes:
    """The PNG of a short monitored training of the spiking example."""
    import torch
    from torch import nn

    import gradoverride as go

    sys.path.insert(0, str(_EXAMPLES))
    try:
        import spiking_neuron
    finally:
        sys.path.remove(str(_EXAMPLES))
    torch.manual_seed(0)
    x, y = spiking_neuron.make_data(256, torch.Generator().manual_seed(0))
    model = spiking_neuron.SpikingNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    with go.monitor(model, every=2) as monitor:
        for _ in range(_EPOCHS):
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    if not monitor.history:
        msg = f"docs_monitor: the monitor recorded nothing:\n{monitor.summary()}"
        raise PluginError(msg)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "monitor.png"
        monitor.plot(path)
        return path.read_bytes()


def on_files(files: Files, *, config: MkDocsConfig) -> Files:
    """Add the figure to the site, as a file generated in memory."""
    if files.get_file_from_path(FIGURE) is not None:
        msg = f"docs_monitor: docs/{FIGURE} exists, but the hook generates it; remove it."
        raise PluginError(msg)
    files.append(File.generated(config, FIGURE, content=monitor_png()))
    return files


def on_page_markdown(markdown: str, *, page: Page, config: MkDocsConfig, files: Files) -> str:
    """The Diagnostics page must show the figure."""
    if page.file.src_uri == PAGE and FIGURE not in markdown:
        msg = f"docs_monitor: docs/{PAGE} does not show {FIGURE}."
        raise PluginError(msg)
    return markdown
