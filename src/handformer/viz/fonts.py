"""Fonts for the PNG pictures: DejaVu Sans (matplotlib's own) first, then a CJK font.

The CJK font comes from the optional extra ``pip install handformer[zh]`` (the package
``noto-cjk-sans-otc``: Google's Noto Sans CJK, SIL Open Font License 1.1), with no apt and no
root. Its file is handed to matplotlib's font manager with ``addfont`` before the first
picture, so a font cache written before the package was installed does not hide it. Without
it, a CJK font the system has (``fonts-noto-cjk``, WenQuanYi, SimHei, ...) is used; without
any, Chinese characters show as boxes and :func:`handformer.viz.save_figure` says which extra
brings them.

Column labels: Chinese, Japanese and Korean text is written top to bottom with upright
characters, so :func:`upright_column_label` stacks wide characters one per line instead of
turning the label sideways.
"""

from __future__ import annotations

import functools
import importlib.util
import unicodedata
from pathlib import Path

__all__ = ["ZH_EXTRA", "FONT_PACKAGE", "packaged_cjk_font", "font_families", "has_wide",
           "upright_column_label"]

ZH_EXTRA = "pip install handformer[zh]"
FONT_PACKAGE = "noto_cjk_sans_otc"  # import name of the extra's font package
_FONT_FILE = "NotoSansCJK-Regular.ttc"
# The face of the collection for Chinese (simplified forms); the collection also holds JP,
# KR, TC and HK faces, each with every CJK character.
PACKAGED_FAMILY = "Noto Sans CJK SC"

# Fonts with CJK glyphs a system may have, tried when the extra is not installed.
SYSTEM_CJK_FAMILIES = ("Noto Sans CJK SC", "Noto Sans CJK JP", "Noto Sans SC",
                       "Source Han Sans SC", "WenQuanYi Zen Hei", "WenQuanYi Micro Hei",
                       "Droid Sans Fallback", "AR PL UMing CN", "SimHei", "Microsoft YaHei",
                       "PingFang SC", "Hiragino Sans GB", "Arial Unicode MS")


def packaged_cjk_font() -> Path | None:
    """The font file of the ``zh`` extra, or None when the package is not installed.

    Found without importing the package (its folder is enough).
    """
    try:
        spec = importlib.util.find_spec(FONT_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _FONT_FILE
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=1)
def font_families() -> tuple[str, ...]:
    """matplotlib's ``font.family`` list for pictures with token labels: DejaVu Sans, then
    one CJK family (the ``zh`` extra's, registered here, else the first one installed).

    Returns:
        The family names, DejaVu Sans first.
    """
    from matplotlib import font_manager

    path = packaged_cjk_font()
    if path is not None:
        known = {f.fname for f in font_manager.fontManager.ttflist}
        if str(path) not in known:
            font_manager.fontManager.addfont(str(path))  # every face of the collection
        return ("DejaVu Sans", PACKAGED_FAMILY)
    installed = {f.name for f in font_manager.fontManager.ttflist}
    return ("DejaVu Sans", *[name for name in SYSTEM_CJK_FAMILIES if name in installed][:1])


def _wide(ch: str) -> bool:
    return unicodedata.east_asian_width(ch) in ("W", "F")


def has_wide(text: str) -> bool:
    """True if ``text`` holds a wide (CJK) character."""
    return any(_wide(ch) for ch in text)


def upright_column_label(label: str) -> str:
    """A column label written top to bottom: each wide character on its own line, runs of
    other characters kept together (``"动·1/2"`` -> ``"动\\n·1/2"``).

    Args:
        label: the token label.

    Returns:
        The label with line breaks, for a tick label drawn without rotation.
    """
    lines: list[str] = []
    for ch in label:
        if _wide(ch) or not lines or _wide(lines[-1][-1]):
            lines.append(ch)
        else:
            lines[-1] += ch
    return "\n".join(lines)
