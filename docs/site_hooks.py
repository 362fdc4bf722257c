"""MkDocs hooks for the documentation site (mkdocs.yml, ``hooks:``); not a page.

The Markdown pages under docs/ are also read on GitHub and run by the test suite, so they are
written for that: links to the code (``../src/handformer/masks.py``) and fenced blocks with the
tests' info strings (```` ```bash .noeval ````, ```` ```text output ````). On the site:

* a relative link that leaves docs/ but stays in the repository points at the file on GitHub
  (``REPO_URL``); a link to a file that does not exist is a warning, which ``mkdocs build
  --strict`` turns into a failure, as MkDocs does for links between pages;
* a fence's extra words after the language are dropped (Python-Markdown would not see a
  fence otherwise); ```` ```text output ```` blocks get the title "output";
* the notebooks point their pictures and links at GitHub (they are read on Colab too): on the
  site, those that name a file of the site point at it instead, so the notebook pages load
  nothing from another origin and their links stay on the site;
* the docstrings' Sphinx roles (``:class:`~handformer.CausalLM```), which mkdocstrings shows
  as written, become code, linked to the object's entry in the API reference where exactly one
  entry has that name.

Code blocks are left as they are: only the prose between fences is rewritten.

With ``extra.execute_notebooks`` on (``HANDFORMER_DOCS_EXECUTE=true``, what ``make docs-site``
sets), each notebook page is first executed top to bottom in a Jupyter kernel (``python3``, on
CPU, as tests/test_notebooks.py runs them), each in a fresh temporary folder, so what the
tutorial writes (``runs/reverse``, ``head.png``, ...) never meets an earlier run or the other
notebook, and nothing lands in docs/; mkdocs-jupyter then renders the executed copy. A cell
that fails stops the build with the notebook, the cell and the error.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority

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


GITHUB_DOCS = re.compile(
    r'(src|href)="(?:https://raw\.githubusercontent\.com/handformer/handformer/main|'
    r'https://github\.com/handformer/handformer/(?:blob|raw)/main)/docs/([^"#?]+)(#[^"]*)?"')


def on_page_content(html: str, page, config, files) -> str:
    """In a notebook page, GitHub URLs of files of the site become links into the site."""
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    from mkdocs.utils import get_relative_url

    def local(m: re.Match) -> str:
        target = files.get_file_from_path(m.group(2))
        if target is None:
            return m.group(0)
        url = get_relative_url(target.url, page.url)
        return f'{m.group(1)}="{url}{m.group(3) or ""}"'

    return GITHUB_DOCS.sub(local, html)


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


# ---- Sphinx roles in the API reference ---------------------------------------------------------

ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):<code>(~?)([\w.\s]+)(\(\))?</code>")
API_ID = re.compile(r'id="(handformer\.[\w.]+)"')


@event_priority(50)  # before mkdocs-autorefs' on_env, while the pages' HTML can still change
def on_env(env, config, files):
    """``:role:`target``` in the API pages: a link to the one entry named so, else code."""
    from mkdocs.utils import get_relative_url

    pages = [f.page for f in files.documentation_pages()
             if f.page is not None and f.page.content and f.src_uri.startswith("api/")]
    where: dict[str, str] = {}  # documented name -> url of its page
    for page in pages:
        for ident in API_ID.findall(page.content):
            where.setdefault(ident, page.url)
    by_last: dict[str, list[str]] = defaultdict(list)
    for ident in where:
        by_last[ident.rsplit(".", 1)[-1]].append(ident)

    def resolve(target: str, page) -> str | None:
        if target in where:
            return target
        found = by_last.get(target.rsplit(".", 1)[-1], [])
        found = [i for i in found if i.endswith("." + target)] or \
            ([] if "." in target and not target.startswith("handformer.") else found)
        here = [i for i in found if where[i] == page.url]
        found = here or found
        return found[0] if len(found) == 1 else None

    for page in pages:
        def link(m: re.Match, page=page) -> str:
            tilde, target, call = m.groups()
            target = re.sub(r"\s+", "", target)  # a name wrapped over two docstring lines
            code = f"<code>{target.rsplit('.', 1)[-1] if tilde else target}{call or ''}</code>"
            ident = resolve(target, page)
            if ident is None:
                return code
            return f'<a href="{get_relative_url(where[ident], page.url)}#{ident}">{code}</a>'

        page.content = ROLE.sub(link, page.content)
    return env


# ---- executing the notebooks ------------------------------------------------------------------

_executed: list[Path] = []  # the temporary folders of this build, removed after it


def _execute(source: Path, root: Path) -> Path:
    """Run the notebook at ``source`` in a fresh folder; the path of the executed copy."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    folder = Path(tempfile.mkdtemp(prefix="handformer-docs-"))
    _executed.append(folder)
    work = folder / "work"
    work.mkdir()
    notebook = nbformat.read(source, as_version=4)
    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # ipykernel's default: inline figures
    env["CUDA_VISIBLE_DEVICES"] = ""  # on CPU, so the outputs are the tutorial's
    env["IPYTHONDIR"] = str(folder / ".ipython")  # no user profile or startup files
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"),
                                                      env.get("PYTHONPATH")]))
    client = NotebookClient(notebook, kernel_name="python3", timeout=1200, startup_timeout=120,
                            resources={"metadata": {"path": str(work)}})
    log.info("Executing %s in %s", source.name, work)
    try:
        client.execute(env=env)
    except CellExecutionError as exc:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
        raise PluginError(f"{source.name} failed when executed:\n{text}") from None
    executed = folder / source.name
    nbformat.write(notebook, executed)
    return executed


@event_priority(-100)  # after mkdocs-jupyter has made the notebooks pages
def on_files(files, config):
    """With ``extra.execute_notebooks``, point each notebook page at its executed copy."""
    if not config["extra"].get("execute_notebooks"):
        return files
    root = _repo_root(config)
    for file in files:
        if file.src_uri.endswith(".ipynb") and file.abs_src_path is not None:
            file.abs_src_path = str(_execute(Path(file.abs_src_path), root))
    return files


def on_post_build(config):
    while _executed:
        shutil.rmtree(_executed.pop(), ignore_errors=True)


def on_build_error(error):
    on_post_build(None)
