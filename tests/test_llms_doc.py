"""docs/llms.md and its Chinese section docs/llms.zh.md run as written (the tutorials'
convention, see ``tests/test_tutorials.py``): every python block runs, in order, in one
namespace per page, in a temporary folder; a ``text output`` block equals what the block above
printed; the Chinese page holds the same code as the English "From GPT-2 to Llama and Gemma"
section, which needs the English page's earlier blocks (the tiny Llama) first."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from test_tutorials import code_tokens, runnable, same_output

DOCS = Path(__file__).resolve().parent.parent / "docs"
EN, ZH = DOCS / "llms.md", DOCS / "llms.zh.md"
SECTION = "## From GPT-2 to Llama and Gemma"

pytest.importorskip("transformers")


def _run(pairs: list, namespace: dict, name: str) -> int:
    checked = 0
    for block, output in pairs:
        code = compile(block.body, f"{name}, block at line {block.line}", "exec")
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(code, namespace)  # noqa: S102 - our own documentation
        if output is not None:
            checked += 1
            assert same_output(output.body, buffer.getvalue()), (
                f"{name}: the output shown at line {output.line} differs from what the block "
                f"at line {block.line} prints:\n--- shown\n{output.body}--- printed\n"
                f"{buffer.getvalue()}")
    return checked


def _section_start(path: Path, heading: str) -> int:
    text = path.read_text(encoding="utf-8")
    return text[:text.index(heading)].count("\n") + 1


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_page_runs_and_prints_what_it_shows(lang: str, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    en = runnable(EN)
    start = _section_start(EN, SECTION)
    before = [p for p in en if p[0].line < start]
    namespace: dict[str, object] = {"__name__": f"llms_{lang}"}
    if lang == "en":
        assert _run(en, namespace, EN.name) >= 10
    else:  # the section alone, after the English blocks it stands on
        _run(before, namespace, EN.name)
        assert _run(runnable(ZH), namespace, ZH.name) >= 7


def test_chinese_section_holds_the_same_code() -> None:
    start = _section_start(EN, SECTION)
    en = [p for p in runnable(EN) if p[0].line > start]
    zh = runnable(ZH)
    assert len(en) == len(zh), f"{len(en)} python blocks in English, {len(zh)} in Chinese"
    for (a, out_a), (b, out_b) in zip(en, zh, strict=True):
        assert code_tokens(a.body) == code_tokens(b.body), (
            f"llms.md:{a.line} and llms.zh.md:{b.line} differ in code")
        assert (out_a is None) == (out_b is None)
