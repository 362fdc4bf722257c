"""MkDocs hooks for the documentation site (mkdocs.yml, ``hooks:``); not a page.

The Markdown pages under docs/ are also read on GitHub and run by the test suite, so they are
written for that: links to the code (``../src/handformer/masks.py``) and fenced blocks with the
tests' info strings (```` ```bash .noeval ````, ```` ```text output ````). On the site:

* a relative link that leaves docs/ but stays in the repository points at the file on GitHub
  (``REPO_URL``); a link to a file that does not exist is a warning, which ``mkdocs build
  --strict`` turns into a failure, as MkDocs does for links between pages;
* a fence's extra words after the language are dropped (Python-Markdown would not see a
  fence otherwise); ```` ```text output ```` blocks get the title "output".

Code blocks are left as they are: only the prose between fences is rewritten.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

REPO_URL = "https://github.com/handformer/handformer"
BRANCH = "main"

log = logging.getLogger("mkdocs.plugins.handformer")

FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,})([^\n]*)\n.*?^\1\2[ \t]*$", re.M | re.S)
INFO = re.compile(r"^([\w+.-]+)[ \t]+([^{\n]*)$")
# [text](../path#anchor) and ![alt](../path): only links that start by leaving the page's folder
LINK = re.compile(r"(\]\()(\.\./[^)\s#]*)(#[^)\s]*)?(\))")


def _repo_root(config) -> Path:
    return Path(config["config_file_path"]).resolve().parent


def _outside_link(match: re.Match, page_dir: Path, docs: Path, root: Path, src: str) -> str:
    target = (page_dir / match.group(2)).resolve()
    anchor = match.group(3) or ""
    if target == docs or docs in target.parents:
        return match.group(0)  # inside docs/: MkDocs checks it
    if root != target and root not in target.parents:
        log.warning("Doc file '%s' links to '%s', outside the repository", src, match.group(2))
        return match.group(0)
    if not target.exists():
        log.warning("Doc file '%s' links to '%s', which is not in the repository", src,
                    match.group(2))
        return match.group(0)
    kind = "tree" if target.is_dir() else "blob"
    url = f"{REPO_URL}/{kind}/{BRANCH}/{target.relative_to(root).as_posix()}{anchor}"
    return f"{match.group(1)}{url}{match.group(4)}"


def _fence(match: re.Match) -> str:
    indent, fence, info = match.group(1), match.group(2), match.group(3).strip()
    m = INFO.match(info)
    if not m:
        return match.group(0)
    lang, extra = m.group(1), m.group(2).strip()
    new = f'{lang} title="output"' if (lang, extra) == ("text", "output") else lang
    first_line_end = match.group(0).index("\n")
    return f"{indent}{fence}{new}{match.group(0)[first_line_end:]}"


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Rewrite links out of docs/ to GitHub and the tests' fence info strings."""
    if page.file.abs_src_path is None:
        return markdown
    docs = Path(config["docs_dir"]).resolve()
    root = _repo_root(config)
    page_dir = Path(page.file.abs_src_path).resolve().parent
    out, last = [], 0
    for fence in FENCE.finditer(markdown):
        prose = markdown[last:fence.start()]
        out.append(LINK.sub(lambda m: _outside_link(m, page_dir, docs, root, page.file.src_uri),
                            prose))
        out.append(_fence(fence))
        last = fence.end()
    out.append(LINK.sub(lambda m: _outside_link(m, page_dir, docs, root, page.file.src_uri),
                        markdown[last:]))
    return "".join(out)
