"""The reference pages' snippets run as they stand: docs/inspect-llm.md, docs/gguf.md and
docs/tokenizers.md (the tutorials' convention, see ``tests/test_tutorials.py``): every python
block of a page runs, in order, in one namespace per page, in a temporary folder; a
``text output`` block equals what the block above printed.

The other pages are run elsewhere: README.md, docs/index.md, docs/getting-started.md and
docs/guide/*.md by tests/test_readme.py (each block alone), the tutorials by
tests/test_tutorials.py, docs/llms.md and llms.zh.md by tests/test_llms_doc.py.

The shipped models load once per session: ``load_lm`` is memoised for the pages (same
arguments, same objects; the snippets only read the models).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

import handformer.pretrained
from test_tutorials import runnable, same_output

DOCS = Path(__file__).resolve().parent.parent / "docs"
_LOADED: dict[tuple, object] = {}


@pytest.fixture
def memo_load_lm(monkeypatch: pytest.MonkeyPatch, smollm2) -> None:  # noqa: ANN001
    from handformer.pretrained.gguf import shipped_path

    real = handformer.pretrained.load_lm
    _LOADED.setdefault((str(shipped_path("smollm2-135m-instruct")), ()), smollm2)

    def load_lm(source: object, **options: object) -> object:
        if str(source) in ("smollm2-135m-instruct", "gemma3-270m"):  # a name: its file
            source = shipped_path(str(source))
        key = (str(source), tuple(sorted(options.items())))
        if key not in _LOADED:
            _LOADED[key] = real(source, **options)
        return _LOADED[key]

    monkeypatch.setattr(handformer.pretrained, "load_lm", load_lm)


def run_page(name: str) -> dict[str, object]:
    """Run every python block of ``docs/NAME`` in order; return the namespace."""
    path = DOCS / name
    namespace: dict[str, object] = {"__name__": name}
    pairs = runnable(path)
    assert pairs, f"{name} has no python block"
    for block, output in pairs:
        code = compile(block.body, f"{name}, block at line {block.line}", "exec")
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(code, namespace)  # noqa: S102 - our own documentation
        if output is not None:
            assert same_output(output.body, buffer.getvalue()), (
                f"{name}: the output shown at line {output.line} differs from what the block "
                f"at line {block.line} prints:\n--- shown\n{output.body}--- printed\n"
                f"{buffer.getvalue()}")
    return namespace


def test_inspect_llm_page_runs(memo_load_lm: None, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ns = run_page("inspect-llm.md")
    # what its comments claim: the attributions add up to the logit and the logit difference
    logits = ns["out"].logits[:, -1].detach()
    mary, john = ns["mary"], ns["john"]
    torch.testing.assert_close(ns["head_attrs"].sum(0), logits[:, mary], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(ns["attrs"].sum(0), logits[:, mary] - logits[:, john],
                               atol=1e-3, rtol=1e-4)
    assert ns["cache"]["pattern", -1, "attn"].shape[1:] == (9, 14, 14)


def test_gguf_page_runs(memo_load_lm: None, tmp_path: Path,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ns = run_page("gguf.md")
    assert ns["f"].architecture == "gemma3" and tuple(ns["w"].shape) == (640, 2048)


def test_tokenizers_page_runs(memo_load_lm: None, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    ns = run_page("tokenizers.md")
    tok = ns["tok"]
    assert tok.tokens("a text") == ["a", "Ġtext"] and tok.padding_side == "left"
