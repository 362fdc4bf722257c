"""The tutorials (docs/tutorial.en.md, docs/tutorial.zh.md) run as written.

Convention (stated at the top of both tutorials):

* every ```` ```python ```` block runs, in order, in one namespace per file (so a later block
  uses what an earlier one defined), with the working directory in a temporary folder;
* a ```` ```text output ```` block placed right after a python block (blank lines between are
  allowed) must equal what that block printed: lines are compared with trailing spaces
  removed, and ``...`` in the shown output stands for any text (doctest's ELLIPSIS), for
  values that may differ between machines;
* the two tutorials hold the same code: their python blocks have the same tokens once
  comments and string literals (printed labels, which are translated) are set aside;
* every image and every relative link in them points to a file that exists.

Other blocks (```` ```bash ````, plain ```` ```text ````) are not run: the commands they show
are tested by the CLI tests.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
TUTORIALS = {"en": DOCS / "tutorial.en.md", "zh": DOCS / "tutorial.zh.md"}
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)


@dataclass
class Block:
    """One fenced code block: its info string, body, first line number and end offset."""

    info: str
    body: str
    line: int
    start: int
    end: int


def blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    return [Block(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 2,
                  m.start(), m.end()) for m in FENCE.finditer(text)]


def runnable(path: Path) -> list[tuple[Block, Block | None]]:
    """The python blocks of ``path``, each with the output block that follows it (or None)."""
    text = path.read_text(encoding="utf-8")
    found = blocks(path)
    pairs = []
    for i, block in enumerate(found):
        if block.info == "text output":
            previous = found[i - 1] if i else None
            assert previous is not None and previous.info == "python" and \
                not text[previous.end:block.start].strip(), \
                f"{path.name}:{block.line}: an output block must follow a python block directly"
        if block.info != "python":
            continue
        nxt = found[i + 1] if i + 1 < len(found) else None
        if nxt is not None and nxt.info == "text output" and not text[block.end:nxt.start].strip():
            pairs.append((block, nxt))
        else:
            pairs.append((block, None))
    return pairs


def same_output(shown: str, printed: str) -> bool:
    def norm(s: str) -> str:
        return "\n".join(line.rstrip() for line in s.strip("\n").splitlines()) + "\n"

    return doctest.OutputChecker().check_output(norm(shown), norm(printed), doctest.ELLIPSIS)


@pytest.mark.parametrize("lang", sorted(TUTORIALS))
def test_tutorial_runs_and_prints_what_it_shows(lang: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib

    matplotlib.use("Agg")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.chdir(tmp_path)
    path = TUTORIALS[lang]
    pairs = runnable(path)
    assert len(pairs) >= 20, f"{path.name}: only {len(pairs)} python blocks"
    namespace: dict[str, object] = {"__name__": f"tutorial_{lang}"}
    checked = 0
    for block, output in pairs:
        code = compile(block.body, f"{path.name}, block at line {block.line}", "exec")
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            exec(code, namespace)  # noqa: S102 - the tutorial is our own text
        if output is not None:
            checked += 1
            assert same_output(output.body, buffer.getvalue()), (
                f"{path.name}: the output shown at line {output.line} differs from what the "
                f"block at line {block.line} prints:\n--- shown\n{output.body}--- printed\n"
                f"{buffer.getvalue()}"
            )
    assert checked >= 10, f"{path.name}: only {checked} outputs checked"


def code_tokens(source: str) -> list[str]:
    skip = {tokenize.COMMENT, tokenize.STRING, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
            tokenize.DEDENT, tokenize.ENDMARKER}
    skip |= {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
             if hasattr(tokenize, n)}
    toks = tokenize.generate_tokens(io.StringIO(source).readline)
    return [t.string for t in toks if t.type not in skip]


def test_both_tutorials_hold_the_same_code() -> None:
    en, zh = (runnable(TUTORIALS[lang]) for lang in ("en", "zh"))
    assert len(en) == len(zh), f"{len(en)} python blocks in English, {len(zh)} in Chinese"
    for (a, out_a), (b, out_b) in zip(en, zh, strict=True):
        assert code_tokens(a.body) == code_tokens(b.body), (
            f"tutorial.en.md:{a.line} and tutorial.zh.md:{b.line} differ in code")
        assert (out_a is None) == (out_b is None), (
            f"output shown after tutorial.en.md:{a.line} but not tutorial.zh.md:{b.line}")


@pytest.mark.parametrize("lang", sorted(TUTORIALS))
def test_links_and_images_exist(lang: str) -> None:
    path = TUTORIALS[lang]
    text = path.read_text(encoding="utf-8")
    for block in reversed(blocks(path)):  # links inside code blocks are code, not links
        text = text[:block.start] + text[block.end:]
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]
    images = re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    assert len(images) >= 6, f"{path.name}: only {len(images)} pictures"
    assert sum("../src/handformer/" in t for t in local) >= 9, "each chapter links its source"
    for target in local:
        file = (path.parent / target.split("#")[0]).resolve()
        assert file.exists(), f"{path.name}: broken link {target}"
        if file.suffix == ".png":
            assert file.stat().st_size > 5000, f"{path.name}: {target} looks empty"
    anchors = {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    for target in targets:
        if target.startswith("#"):
            assert target[1:] in anchors, f"{path.name}: no heading for the link {target}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
