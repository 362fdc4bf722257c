"""The snippets of the README and of the site pages its details moved to run as written, and
every option they name shows what it needs.

The pages (:data:`PAGES`): README.md, and the documentation site's home, getting-started and
guide pages (docs/index.md, docs/getting-started.md, docs/guide/*.md), which hold what the
README used to. Convention (as for the tutorials, see tests/test_tutorials.py, but one snippet
at a time):

* every ```` ```python ```` block of these pages runs on its own, in a fresh namespace, with
  the working directory in a temporary folder: a reader copies one snippet, so each one must be
  complete (its imports, its inputs);
* an HTML comment right before a block (invisible on GitHub) may say what the block needs
  from outside: ``<!-- readme-test: needs path/to/gpt2-folder -->`` makes this test write a
  tiny random checkpoint of that kind at that path first (the known needs are in
  :data:`NEEDS`), so the block still runs for real; ``<!-- readme-test: skip REASON -->``
  leaves a block out, with its reason. Keep such exceptions rare;
* an attention kind named in a snippet comes with what it needs: ``attention="local"`` with
  ``window_size=...`` and ``attention="strided"`` with ``stride=...`` (each such mention is
  built as a ``CausalLMConfig``), ``--attention local`` with ``--window-size`` and
  ``--attention strided`` with ``--stride`` on the same line.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from test_tutorials import Block, blocks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, DOCS / "index.md", DOCS / "getting-started.md",
         *sorted((DOCS / "guide").glob("*.md"))]
MARKER = re.compile(r"<!--\s*readme-test:\s*(needs|skip)\b\s*(.*?)\s*-->", re.S)


def _gpt2_folder(folder: Path) -> None:
    """A tiny random GPT-2 checkpoint (transformers layout) with a word-level tokenizer.json."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=40, n_positions=64, n_embd=16, n_layer=1,
                                     n_head=2, bos_token_id=39, eos_token_id=39)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(39)} | {"<|endoftext|>": 39}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(folder / "tokenizer.json"))


# What a `<!-- readme-test: needs PATH -->` marker may ask for: PATH -> how to make it.
NEEDS: dict[str, Callable[[Path], None]] = {"path/to/gpt2-folder": _gpt2_folder}


def page_name(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def python_blocks(page: Path) -> list[tuple[Block, str | None, str | None]]:
    """``(block, needs, skip)`` per python block of ``page``: the marker right before it."""
    text = page.read_text(encoding="utf-8")
    found, previous_end = [], 0
    for block in blocks(page):
        between = text[previous_end:block.start]
        previous_end = block.end
        if block.info != "python":
            continue
        marker = MARKER.search(between.rstrip().rsplit("\n", 1)[-1])  # the line right before
        kind, value = (marker.group(1), marker.group(2)) if marker else (None, None)
        found.append((block, value if kind == "needs" else None,
                      value if kind == "skip" else None))
    return found


# (page, block, needs, skip) for every python block of every page
BLOCKS = [(page, *found) for page in PAGES for found in python_blocks(page)]


def test_pages_exist_and_hold_the_snippets() -> None:
    assert all(page.exists() for page in PAGES)
    assert len(PAGES) >= 10, "docs/guide/ holds the README's details"
    in_readme = sum(1 for page, *_ in BLOCKS if page == README)
    assert in_readme >= 3 and len(BLOCKS) - in_readme >= 7


def test_markers_are_rare_and_explained() -> None:
    markers = sum(len(MARKER.findall(page.read_text(encoding="utf-8"))) for page in PAGES)
    used = sum(1 for _, _, needs, skip in BLOCKS if needs or skip)
    assert markers == used, "every readme-test marker sits on the line before a block"
    assert used <= 2
    for _, _, needs, skip in BLOCKS:
        if needs is not None:
            assert needs in NEEDS, f"unknown need {needs!r}; known: {sorted(NEEDS)}"
        if skip is not None:
            assert len(skip.split()) >= 3, "a skipped block says why"


@pytest.mark.parametrize("page, block, needs, skip", BLOCKS,
                         ids=[f"{page.stem}-line-{b.line}" for page, b, _, _ in BLOCKS])
def test_readme_snippet_runs(page: Path, block: Block, needs: str | None, skip: str | None,
                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if skip is not None:
        pytest.skip(f"{page_name(page)}:{block.line}: {skip}")
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    if needs is not None:
        (tmp_path / needs).mkdir(parents=True)
        NEEDS[needs](tmp_path / needs)
    code = compile(block.body, f"{page_name(page)}, block at line {block.line}", "exec")
    exec(code, {"__name__": f"readme_{block.line}"})  # noqa: S102 - the pages are our own text
    import matplotlib.pyplot as plt

    plt.close("all")


# ---- options named in snippets show what they need ----------------------------------------

KIND_IN_PYTHON = re.compile(r"""attention="(\w+)"((?:\s*,\s*\w+\s*=\s*[\w.]+)*)""")
NEEDED_FLAG = {"local": "--window-size", "strided": "--stride"}


def _python_mentions() -> list[tuple[str, str, dict[str, object]]]:
    """``(where, kind, options)`` for each ``attention="kind", name=value, ...`` in a python
    block, comments included (``# or attention="local", window_size=65``)."""
    found = []
    for page, block, _, _ in BLOCKS:
        for offset, line in enumerate(block.body.splitlines()):
            for m in KIND_IN_PYTHON.finditer(line):
                options = {}
                for pair in filter(None, (p.strip() for p in m.group(2).split(","))):
                    name, value = (s.strip() for s in pair.split("="))
                    options[name] = ast.literal_eval(value)
                found.append((f"{page_name(page)}:{block.line + offset}", m.group(1), options))
    return found


def test_every_attention_kind_in_a_python_snippet_is_complete() -> None:
    """Each `attention="kind", ...` shown builds a valid CausalLMConfig as written."""
    from handformer import CausalLMConfig

    mentions = _python_mentions()
    assert {kind for _, kind, _ in mentions} >= {"full", "local", "strided", "linear"}
    for line, kind, options in mentions:
        try:
            CausalLMConfig(vocab_size=10, max_len=16, d_model=8, num_heads=2, num_layers=1,
                           d_ff=8, attention=kind, **options)
        except (TypeError, ValueError) as exc:
            raise AssertionError(f"{line}: attention={kind!r} with {options} is "
                                 f"incomplete: {exc}") from None


def test_every_attention_flag_in_a_command_shows_what_it_needs() -> None:
    checked = 0
    for page in PAGES:
        for block in blocks(page):
            if block.info not in ("bash", "sh", "shell"):
                continue
            for offset, line in enumerate(block.body.splitlines()):
                for kind, flag in NEEDED_FLAG.items():
                    if re.search(rf"--attention[ =]{kind}\b|\bor {kind}\b", line):
                        checked += 1
                        assert flag in line, (f"{page_name(page)}:{block.line + offset}: {kind} "
                                              f"attention without {flag}: {line.strip()}")
    assert checked >= 2 and "--attention local" in README.read_text(encoding="utf-8")


# ---- the README's links ---------------------------------------------------------------------

LINK = re.compile(r"\]\(([^)\s]+)\)|<img src=\"([^\"]+)\"")


def test_readme_links_point_at_files_that_exist() -> None:
    """The README is mostly links into docs/ now: each relative one names a real file."""
    text = README.read_text(encoding="utf-8")
    targets = [a or b for a, b in LINK.findall(text)]
    relative = [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    assert len(relative) >= 20
    for target in relative:
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"
    for page in PAGES[2:]:  # getting started and every guide page (not the site's home)
        assert f"]({page_name(page)}" in text, f"README.md does not link {page_name(page)}"
