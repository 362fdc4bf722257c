"""Show the attention viewer inline in Jupyter (or any notebook that renders HTML)."""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from pathlib import Path

from handformer.viz.html import render_html, save_html

__all__ = ["AttentionView"]


class AttentionView:
    """The interactive viewer as a notebook object: the last expression of a cell shows it.

    The page is placed in an ``<iframe srcdoc=...>``, so its script and styles stay apart from
    the notebook's and it works in Jupyter, JupyterLab and VS Code without network access.

    Args:
        attentions: anything :func:`handformer.viz.save_html` accepts.
        tokens: one string per query position.
        height: the iframe height in CSS pixels.
        **options: the keyword options of :func:`handformer.viz.save_html` (title, pattern,
            pattern_label, key_tokens, note, layer, head, view, cmap).

    Raises:
        ValueError, TypeError: as :func:`handformer.viz.save_html`, at construction.
    """

    def __init__(self, attentions: object, tokens: Sequence[str], *, height: int = 720,
                 **options: object) -> None:
        if isinstance(height, bool) or not isinstance(height, int) or height < 100:
            raise ValueError(f"height must be an int >= 100 (CSS pixels), got {height!r}")
        self.attentions = attentions
        self.tokens = list(tokens)
        self.height = height
        self.options = options
        self._page = render_html(attentions, self.tokens, **options)  # validates now

    def html(self) -> str:
        """The complete, self-contained HTML page."""
        return self._page

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the page to ``path`` (atomically); returns the path."""
        return save_html(self.attentions, self.tokens, path, **self.options)

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self._page, quote=True)}" '
                f'style="width:100%;height:{self.height}px;border:1px solid #d9dde6" '
                'title="handformer attention viewer"></iframe>')

    def __repr__(self) -> str:
        return f"AttentionView({len(self.tokens)} tokens)"
