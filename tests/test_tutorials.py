"""The tutorials (docs/tutorial.en.md, docs/tutorial.zh.md) run as written.

Convention (stated at the top of both tutorials):

* every ```` ```python ```` block runs, in order, in one namespace per file (so a later block
  uses what an earlier one defined), with the working directory in a temporary folder;
* a ```` ```text output ```` block placed right after a python block (blank lines between are
  allowed) must equal what that block printed: lines are compared with trailing spaces
  removed, and ``...`` in the shown output stands for any text (doctest's ELLIPSIS), for
  values that may differ between machines;
* the two tutorials hold the same code: their python blocks have the same tokens once
  comments and string literals (printed labels, plot titles, example sentences, which are
  translated) are set aside;
* except for blocks marked as one language's own, ```` ```python zh-only ```` in the Chinese
  tutorial or ```` ```python en-only ```` in the English one: they run (and their output blocks
  are checked) in their own tutorial only, and are left out of the comparison. They are for
  what differs on purpose: the Chinese tutorial shows Gemma 3 270M reading a Chinese sentence
  where the English one only has MiniLM, which reads English alone. Three guards keep the
  exception an exception (``test_language_only_blocks_are_guarded``): a tutorial's own blocks
  are a minority (at most ``MAX_OWN_SHARE`` of its python blocks); a tutorial may only mark its
  own language; and the shared code runs on the same names in both tutorials: a shared block
  never reads a name whose latest binding is a language-only block in one tutorial and shared
  code in the other (so an own block cannot feed the shared code different data). A name that
  both tutorials bind in their own blocks (say the Gemma model, loaded where each first needs
  it) may be read by shared code;
* every image and every relative link in them points to a file that exists.

Other blocks (```` ```bash ````, plain ```` ```text ````) are not run: the commands they show
are tested by the CLI tests. The English tutorial runs here; both run as notebooks in
tests/test_notebooks.py (the Chinese one only there).
"""

from __future__ import annotations

import ast
import builtins
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
PYTHON = "python"  # the info string of a shared block; "python zh-only": the Chinese one's own
MAX_OWN_SHARE = 0.2  # at most this share of a tutorial's python blocks may be its own


@dataclass
class Block:
    """One fenced code block: its info string, body, first line number and end offset."""

    info: str
    body: str
    line: int
    start: int
    end: int

    @property
    def is_python(self) -> bool:
        """A block that runs: ```` ```python ```` or ```` ```python <lang>-only ````."""
        return self.info == PYTHON or self.own is not None

    @property
    def own(self) -> str | None:
        """The language of a ```` ```python <lang>-only ```` block; None for any other."""
        m = re.fullmatch(rf"{PYTHON} ([a-z]+)-only", self.info)
        return m.group(1) if m else None


def blocks(path: Path) -> list[Block]:
    return blocks_of(path.read_text(encoding="utf-8"))


def blocks_of(text: str) -> list[Block]:
    return [Block(m.group(1).strip(), m.group(2), text.count("\n", 0, m.start()) + 2,
                  m.start(), m.end()) for m in FENCE.finditer(text)]


def runnable(path: Path) -> list[tuple[Block, Block | None]]:
    """The python blocks of ``path`` (shared and own), each with the output block that follows
    it (or None)."""
    return runnable_of(path.read_text(encoding="utf-8"), path.name)


def runnable_of(text: str, name: str) -> list[tuple[Block, Block | None]]:
    found = blocks_of(text)
    pairs = []
    for i, block in enumerate(found):
        if block.info == "text output":
            previous = found[i - 1] if i else None
            assert previous is not None and previous.is_python and \
                not text[previous.end:block.start].strip(), \
                f"{name}:{block.line}: an output block must follow a python block directly"
        if block.info.startswith(PYTHON) and not block.is_python:
            raise AssertionError(f"{name}:{block.line}: unknown info string {block.info!r} "
                                 f"(a python block is {PYTHON!r} or '{PYTHON} <lang>-only')")
        if not block.is_python:
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


# The English tutorial runs here, in this process (the quick loop: no Jupyter kernel); both
# run, with the same output checks, as notebooks in tests/test_notebooks.py. The Chinese one
# runs there only: its shared code is the English code (tested below) and its own blocks load
# Gemma 3, which made this in-process run a duplicate of 33 s in the suite.
@pytest.mark.parametrize("lang", ["en"])
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


def differences(en_text: str, zh_text: str) -> list[str]:
    """What breaks the same-code rule between the two tutorials' texts (empty when none)."""
    en, zh = runnable_of(en_text, "tutorial.en.md"), runnable_of(zh_text, "tutorial.zh.md")
    shared_en = [(b, out) for b, out in en if b.own is None]
    shared_zh = [(b, out) for b, out in zh if b.own is None]
    problems = []
    if len(shared_en) != len(shared_zh):
        problems.append(f"{len(shared_en)} shared python blocks in English, "
                        f"{len(shared_zh)} in Chinese")
    for (a, out_a), (b, out_b) in zip(shared_en, shared_zh, strict=False):
        if code_tokens(a.body) != code_tokens(b.body):
            problems.append(f"tutorial.en.md:{a.line} and tutorial.zh.md:{b.line} differ in code "
                            "(mark a block that differs on purpose ```python <lang>-only)")
        if (out_a is None) != (out_b is None):
            problems.append(f"output shown after only one of tutorial.en.md:{a.line} and "
                            f"tutorial.zh.md:{b.line}")
    return problems


def test_both_tutorials_hold_the_same_code() -> None:
    en, zh = (TUTORIALS[lang].read_text(encoding="utf-8") for lang in ("en", "zh"))
    assert differences(en, zh) == []


def reads_and_binds(statement: ast.stmt) -> tuple[set[str], set[str]]:
    """The global names a top-level statement reads (other than those it binds) and binds."""
    stored = {n.id for n in ast.walk(statement)
              if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store | ast.Del)}
    params = {a.arg for n in ast.walk(statement) if isinstance(n, ast.arguments)
              for a in (*n.posonlyargs, *n.args, *n.kwonlyargs, n.vararg, n.kwarg) if a}
    loaded = {n.id for n in ast.walk(statement)
              if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        binds = {statement.name}  # what it stores inside are its own locals
    elif isinstance(statement, ast.Import | ast.ImportFrom):
        binds = {(a.asname or a.name).split(".")[0] for a in statement.names}
    else:
        binds = stored
    return loaded - stored - params - set(dir(builtins)), binds


def origins(text: str, name: str) -> list[dict[str, str]]:
    """For each shared python block, where each name it reads was last bound: ``"shared"``
    (by shared code) or ``"own"`` (by a block of this tutorial's own)."""
    bound: dict[str, str] = {}
    per_block = []
    for block, _ in runnable_of(text, name):
        kind = "shared" if block.own is None else "own"
        read_here: dict[str, str] = {}
        for statement in ast.parse(block.body).body:
            reads, binds = reads_and_binds(statement)
            for n in reads:
                if n in bound:
                    read_here.setdefault(n, bound[n])
            bound.update(dict.fromkeys(binds, kind))
        if kind == "shared":
            per_block.append(read_here)
    return per_block


def guard_problems(en_text: str, zh_text: str) -> list[str]:
    """What breaks the guards on the tutorials' own blocks (see the module docstring)."""
    problems = []
    for lang, text in (("en", en_text), ("zh", zh_text)):
        pairs = runnable_of(text, f"tutorial.{lang}.md")
        own = [b for b, _ in pairs if b.own is not None]
        for b in own:
            if b.own != lang:
                problems.append(f"tutorial.{lang}.md:{b.line}: a {b.own}-only block")
        if len(own) > MAX_OWN_SHARE * len(pairs):
            problems.append(f"tutorial.{lang}.md: {len(own)} of {len(pairs)} python blocks are "
                            f"its own, more than {MAX_OWN_SHARE:.0%}")
    reads_en, reads_zh = origins(en_text, "tutorial.en.md"), origins(zh_text, "tutorial.zh.md")
    for i, (a, b) in enumerate(zip(reads_en, reads_zh, strict=False)):
        for n in sorted(set(a) | set(b)):
            if "own" in (a.get(n), b.get(n)) and a.get(n) != b.get(n):
                where = "English" if a.get(n) == "own" else "Chinese"
                problems.append(f"shared block {i + 1} reads {n!r}, last bound by the {where} "
                                "tutorial's own code but not by the other's")
    return problems


def test_language_only_blocks_are_guarded() -> None:
    en, zh = (TUTORIALS[lang].read_text(encoding="utf-8") for lang in ("en", "zh"))
    assert guard_problems(en, zh) == []
    own = [b for lang in ("en", "zh") for b, _ in runnable(TUTORIALS[lang]) if b.own]
    assert own, "no language-only blocks: the guards check nothing (drop them with the marker)"


def test_the_same_code_rule_catches_a_one_sided_change() -> None:
    """The checks above fail when they should: shared code changed on one side only, a change
    hidden by marking the block as one language's own, and an own block feeding shared code."""
    en, zh = (TUTORIALS[lang].read_text(encoding="utf-8") for lang in ("en", "zh"))
    shared = [b for b, _ in runnable_of(zh, "zh") if b.own is None]
    target = next(b for b in shared if "animal, street, tired = " in b.body)
    changed = target.body.replace("animal, street, tired = ", "animal, tired, street = ", 1)
    zh_changed = zh[:target.start] + zh[target.start:target.end].replace(target.body, changed)
    zh_changed += zh[target.end:]
    assert any("differ in code" in p for p in differences(en, zh_changed))
    hidden = zh_changed.replace(f"```python\n{changed}", f"```python zh-only\n{changed}", 1)
    assert any("shared python blocks" in p for p in differences(en, hidden))
    feeding = zh.replace('```python\nit = tokens.index("it")\n',
                         '```python zh-only\ntokens = list("动物没有过马路")\n```\n\n'
                         '```python\nit = tokens.index("it")\n', 1)
    assert feeding != zh and differences(en, feeding) == []
    assert any("reads 'tokens'" in p for p in guard_problems(en, feeding))
    wrong_language = zh.replace("```python\n", "```python en-only\n", 1)
    assert any("a en-only block" in p for p in guard_problems(en, wrong_language))


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
