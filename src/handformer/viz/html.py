"""The self-contained HTML attention viewer: one file, no network, opens from disk.

The page is ``viewer.html`` with ``viewer.css``, the viewer's script and the data inlined. The
script is the files of :data:`VIEWER_SCRIPTS` joined in that order inside one function (they
share its names; see ``viewer.js``), then ``rollout.js``: one inline script, which a strict
Content-Security-Policy can allow by its hash (``handformer serve`` does). The data is compact
JSON: tokens, one ``[lo, hi]`` range per head, and the weights quantised to 8 bits
(deflate-compressed for large inputs, so 512 tokens x 6 layers x 12 heads is a few MB).

Shape letters: ``N`` layers, ``H`` heads, ``L_q`` queries, ``L_k`` keys.
"""

from __future__ import annotations

import base64
import functools
import html
import json
import os
import re
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import numpy as np

from handformer.viz.data import as_attention_layers, as_pattern, check_tokens, encode_weights
from handformer.viz.files import write_atomic

__all__ = ["render_html", "save_html", "describe_pattern", "viewer_payload", "viewer_page",
           "viewer_script", "join_scripts", "VIEWER_SCRIPTS"]

_PLACEHOLDER = re.compile(r"__HF_(TITLE|CSS|JS|DATA)__")
# The viewer's script, in this order: the data and shared helpers, the heat-map view, the
# head and model views, then the controls, which start the viewer (see viewer.js).
VIEWER_SCRIPTS = ("viewer.js", "viewer_heat.js", "viewer_heads.js", "viewer_controls.js")


def _asset(name: str) -> str:
    return resources.files("handformer.viz").joinpath(name).read_text(encoding="utf-8")


def join_scripts(parts: Sequence[str]) -> str:
    """Script files as one strict script: the texts in order, inside one function.

    The parts share the function's scope (a name one defines at its top level, the others
    use), and add no names to the page's global scope.
    """
    return '"use strict";\n(function () {\n' + "\n".join(parts) + "})();\n"


def viewer_script() -> str:
    """The viewer page's script: :data:`VIEWER_SCRIPTS` joined, then ``rollout.js``."""
    return join_scripts([_asset(name) for name in VIEWER_SCRIPTS]) + "\n" + _asset("rollout.js")


def _json_for_script(payload: dict[str, object]) -> str:
    """JSON that is safe inside ``<script type="application/json">`` and holds no URLs.

    ``<``, ``>`` and ``&`` become ``\\u003c``... so no token can close the script element, and
    ``/`` becomes ``\\/`` so a token such as ``https://x`` is not a link in the file.
    """
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("/", "\\/")):
        text = text.replace(char, escaped)
    return text


@functools.lru_cache(maxsize=8)
def _colormap_bytes(cmap: str) -> str:
    import matplotlib

    lut = matplotlib.colormaps[cmap](np.linspace(0.0, 1.0, 256))[:, :3]  # (256, RGB)
    return base64.b64encode(np.rint(lut * 255).astype(np.uint8).tobytes()).decode("ascii")


def describe_pattern(allowed: np.ndarray, kind: str | None = None) -> str:
    """One sentence about a pattern, e.g. how many keys each query may reach and the cost."""
    L_q, L_k = allowed.shape
    per_query = allowed.sum(axis=1)  # (L_q,)
    total = int(per_query.sum())
    most = int(per_query.max(initial=0))
    # a window that covers the whole text leaves some query every key: nothing "instead"
    reach = (f"at most {most} per query instead of {L_k}" if most < L_k
             else f"up to all {L_k} keys per query")
    text = (f"Keys each query may reach: {total} of {L_q * L_k} pairs "
            f"({total / max(L_q * L_k, 1):.0%}); {reach}")
    if kind:
        text = f"{kind}. {text}"
    return text + "."


def viewer_payload(attentions: object, tokens: Sequence[str], *, pattern: object = None,
                   pattern_label: str | None = None, key_tokens: Sequence[str] | None = None,
                   note: str | None = None, layer: int = 0, head: int = 0,
                   view: str = "heat", cmap: str = "viridis",
                   rollout: dict[str, object] | None = None,
                   compress: bool = True, binary: bool = False,
                   include_sink: bool = False) -> dict[str, object]:
    """The data the viewer draws, as a JSON-ready dict (see :func:`save_html` for the
    arguments): what a page passes to ``window.hfViewer.render(data)``. ``compress=False``
    sends the 8-bit weights raw at any size (see :func:`~handformer.viz.data.encode_weights`).
    ``binary=True`` leaves them as bytes: ``"data"`` is then a ``memoryview`` of the
    ``N * H * L_q * L_k`` codes, for a transport that carries bytes beside the JSON (the
    viewer's ``render()`` takes them as a ``Uint8Array``).

    Returns:
        A dict of plain JSON values (tokens, sizes, 8-bit weights as base64, pattern bits),
        except ``"data"`` with ``binary=True``.

    Raises:
        ValueError, TypeError: for inputs that do not fit together (see the messages).
    """
    # (N, H, L_q, L_k), or N x (H, L_q, L_k) unstacked; encode_weights refuses NaN / inf
    x = as_attention_layers(attentions, check_finite=False)
    N, (H, L_q, L_k) = len(x), x[0].shape
    toks = check_tokens(tokens, L_q)
    keys = None if key_tokens is None else check_tokens(key_tokens, L_k, "key_tokens")
    if keys is None and L_q != L_k:
        raise ValueError(f"the attention is {L_q} x {L_k} (cross-attention): pass key_tokens")
    if not 0 <= layer < N:
        raise ValueError(f"layer={layer} is out of range: valid layers are 0..{N - 1}")
    if not -1 <= head < H:
        raise ValueError(f"head={head} is out of range: valid heads are 0..{H - 1} "
                         "(-1 = mean of heads)")
    if view not in ("heat", "head", "model"):
        raise ValueError(f"view must be 'heat', 'head' or 'model', got {view!r}")
    if not isinstance(include_sink, bool):
        raise ValueError(f"include_sink must be True or False, got {include_sink!r}")
    allowed = as_pattern(pattern, L_q, L_k)
    payload: dict[str, object] = {
        "version": 1, "tokens": toks, "key_tokens": keys, "layers": N, "heads": H,
        "layer": layer, "head": head, "view": view, "note": note,
        "include_sink": include_sink,  # the first key counts in the colour scales
        "colormap": _colormap_bytes(cmap), **encode_weights(x, compress=compress, binary=binary),
        "pattern": None,
        "rollout": rollout,  # handformer.viz.rollout_view.rollout_payload(), for rollout.js
    }
    if allowed is not None:
        bits = np.packbits(allowed.reshape(-1))  # (ceil(L_q * L_k / 8),)
        payload["pattern"] = {
            "bits": base64.b64encode(bits.tobytes()).decode("ascii"),
            "label": describe_pattern(allowed, pattern_label),
        }
    return payload


def render_html(attentions: object, tokens: Sequence[str], *, title: str | None = None,
                pattern: object = None, pattern_label: str | None = None,
                key_tokens: Sequence[str] | None = None, note: str | None = None,
                layer: int = 0, head: int = 0, view: str = "heat",
                cmap: str = "viridis", rollout: dict[str, object] | None = None,
                include_sink: bool = False) -> str:
    """Build the viewer page as a string.

    Args:
        attentions, tokens, title, pattern, pattern_label, key_tokens: as :func:`save_html`.
        note, layer, head, view, cmap, rollout, include_sink: as :func:`save_html`.

    Returns:
        The complete HTML document.

    Raises:
        ValueError, TypeError: for inputs that do not fit together (see the messages).
    """
    payload = viewer_payload(attentions, tokens, pattern=pattern, pattern_label=pattern_label,
                             key_tokens=key_tokens, note=note, layer=layer, head=head,
                             view=view, cmap=cmap, rollout=rollout,
                             include_sink=include_sink)
    return viewer_page(payload, title=title)


def viewer_page(payload: dict[str, object], *, title: str | None = None) -> str:
    """The viewer page around data from :func:`viewer_payload` (styles and script inlined).

    Returns:
        The complete HTML document.
    """
    title = title or "Attention"
    parts = {"TITLE": html.escape(title), "CSS": _asset("viewer.css"),
             "JS": viewer_script(),
             "DATA": _json_for_script(payload)}
    return _PLACEHOLDER.sub(lambda m: parts[m.group(1)], _asset("viewer.html"))


def save_html(attentions: object, tokens: Sequence[str], path: str | os.PathLike[str], *,
              title: str | None = None, pattern: object = None,
              pattern_label: str | None = None, key_tokens: Sequence[str] | None = None,
              note: str | None = None, layer: int = 0, head: int = 0, view: str = "heat",
              cmap: str = "viridis", rollout: dict[str, object] | None = None,
              include_sink: bool = False) -> Path:
    """Write the interactive viewer as one self-contained HTML file (atomically).

    The page has a heat-map view (canvas; stays fast at 512 tokens), a head view (lines from
    each query to the keys it attends, per head, on hover or click) and a model view (every
    layer x head). It loads nothing from the network.

    Args:
        attentions: anything :func:`handformer.viz.data.as_attention_array` accepts, e.g. a
            model output's ``.attentions`` (per-layer ``(B, H, L_q, L_k)``; batch 0 is shown).
        tokens: one string per query position.
        path: the ``.html`` file to write; its folder must exist.
        title: the page title.
        pattern: keys each query may reach, shown beside the heat map: a boolean
            ``(L_q, L_k)`` tensor/array or an attention kind with ``.pattern(L_q, L_k)``.
        pattern_label: a short description of the pattern, e.g. ``"local attention,
            window 2"``.
        key_tokens: key tokens for cross-attention (defaults to ``tokens``).
        note: a line shown under the title (model name, attention kind...).
        layer: the layer shown first.
        head: the head shown first in the heat map (-1 = mean of heads).
        view: the view shown first: ``"heat"``, ``"head"`` or ``"model"``.
        cmap: a matplotlib colour map name for the heat maps.
        rollout: a rollout view under the others
            (:func:`handformer.viz.rollout_view.rollout_payload`).
        include_sink: open with the first token in each head's colour scale (by default it
            is left out: the first token is an attention sink in most trained models, and
            its column would leave the rest dark; the page has a checkbox for it).

    Returns:
        The path written.

    Raises:
        ValueError, TypeError: for inputs that do not fit together (see the messages).
        OSError: if the file cannot be written.
    """
    page = render_html(attentions, tokens, title=title, pattern=pattern,
                       pattern_label=pattern_label, key_tokens=key_tokens, note=note,
                       layer=layer, head=head, view=view, cmap=cmap, rollout=rollout,
                       include_sink=include_sink)
    return write_atomic(path, page.encode("utf-8"))
