"""MkDocs hook: where the code in a table cell may wrap.

A table cell's code wraps only at its spaces (docs/stylesheets/extra.css), never inside a
word. Two things the stylesheet cannot say are done here, on each page's HTML:

- A long dotted name such as `spikingjelly.activation_based.surrogate.ATan(alpha=2.0)` has
  no space, so it would set its column's width alone. Where a cell holds nothing but one
  code span (a name or a call, as in the recipes catalogue's tables and the API reference's
  parameter tables), a break opportunity (`<wbr>`, which adds no character to the text a
  reader copies) goes after each dot between two letters, and in a bare name (no call, no
  space, such as `fake_numerical_gradient`) after each underscore between two letters too,
  so that the name wraps at its dots and underscores instead. Code within a cell's prose
  is left alone: there a name that does not fit moves to the next line whole.
- A browser may break a line after a hyphen, which in code is a minus (`exp(-slope*x)`):
  in a table cell's code a minus is kept on the line of what follows it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

# A table cell whose content is one code span (and white space).
_CODE_CELL = re.compile(r"(<t[dh]\b[^>]*>\s*<code>)([^<]*)(</code>\s*</t[dh]>)")
_DOT = re.compile(r"(?<=[A-Za-z_])\.(?=[A-Za-z_])")  # a name's dot, not a number's
_BARE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
# An underscore between letters; in a call it would break inside an argument's name.
_UNDERSCORE = re.compile(r"(?<=[A-Za-z0-9])_(?=[A-Za-z])")

_CELL = re.compile(r"(<t[dh]\b[^>]*>)(.*?)(</t[dh]>)", re.DOTALL)
_CODE = re.compile(r"(<code>)(.*?)(</code>)", re.DOTALL)
# A minus and what follows it, where a line may break after the minus (before a letter, a
# name's underscore or a bracket; before a digit it may not).
_MINUS = re.compile(r"-([A-Za-z_(\[])")
_TAG = re.compile(r"(<[^>]*>)")  # the code's own markup (links), left as it is
NO_BREAK = "go-nobreak"  # the class extra.css keeps on one line


def _code_cell_breaks(match: re.Match[str]) -> str:
    code = match[2]
    if _BARE_NAME.fullmatch(code):
        code = _UNDERSCORE.sub("_<wbr>", code)
    return match[1] + _DOT.sub(".<wbr>", code) + match[3]


def _keep_minus(match: re.Match[str]) -> str:
    parts = _TAG.split(match[2])  # text at even indices, tags at odd ones
    for i in range(0, len(parts), 2):
        parts[i] = _MINUS.sub(rf'<span class="{NO_BREAK}">-\1</span>', parts[i])
    return match[1] + "".join(parts) + match[3]


def _cell_minus(match: re.Match[str]) -> str:
    return match[1] + _CODE.sub(_keep_minus, match[2]) + match[3]


def add_breaks(html: str) -> str:
    """`html` with the break opportunities of its table cells' code set as above."""
    return _CELL.sub(_cell_minus, _CODE_CELL.sub(_code_cell_breaks, html))


def on_page_content(
    html: str, *, page: Page, config: MkDocsConfig, files: Files
) -> str:
    return add_breaks(html)
