"""The documentation site (mkdocs.yml) builds with ``mkdocs build --strict``, notebooks not run.

`make docs-site` builds the site with the notebooks executed; here the build checks what can
break without running them (tests/test_notebooks.py runs them): every link between pages and
every anchor, every nav entry and every page in the nav, every API reference page
(mkdocstrings reads the docstrings of src/), and the links from the pages to the code
(docs/site_hooks.py points them at GitHub, and fails on a file that does not exist). The key
pages must be in the output, the notebooks rendered, and no page may load a script, a style
sheet or a picture from another origin.

A second test builds tiny sites with the same settings to show that each of those mistakes
does fail the strict build.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from mkdocs.utils.yaml import get_yaml_loader  # the `docs` extra (make test installs it)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REPO_URL = "https://github.com/handformer/handformer"

# Pages every build must hold (as page.html: use_directory_urls is off).
KEY_PAGES = [
    "index.html", "getting-started.html", "tutorial.en.html", "tutorial.zh.html",
    "notebooks/tutorial.en.html", "notebooks/tutorial.zh.html", "errors.html",
    "benchmarks.html", "precision.html", "llms.html", "llms.zh.html", "gguf.html",
    "tokenizers.html", "inspect-llm.html", "zh/index.html",
    *(f"guide/{p.stem}.html" for p in sorted((DOCS / "guide").glob("*.md"))),
    *(f"api/{area}.html" for area in
      ("layers", "attention", "models", "pretrained", "inspect", "viz", "serve", "train")),
]


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", HANDFORMER_DOCS_EXECUTE="false")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
         "--site-dir", str(site)],
        cwd=config.parent, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr[-6000:]}"
    return out


class Assets(HTMLParser):
    """The scripts, style sheets and pictures a page loads."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag in ("script", "img", "iframe") and a.get("src"):
            self.loads.append(a["src"])
        if tag == "link" and a.get("href") and a.get("rel") in ("stylesheet", "preload",
                                                                "modulepreload", "icon"):
            self.loads.append(a["href"])


def test_site_builds_strictly_with_every_key_page(site: Path) -> None:
    missing = [page for page in KEY_PAGES if not (site / page).is_file()]
    assert not missing, f"not in the built site: {missing}"
    assert not (site / "site_hooks.py").exists() and not (site / "make_figures.py").exists()


def test_pages_load_nothing_from_another_origin(site: Path) -> None:
    checked = 0
    for page in site.rglob("*.html"):
        parser = Assets()
        parser.feed(page.read_text(encoding="utf-8"))
        for url in parser.loads:
            assert not re.match(r"(https?:)?//", url), f"{page.relative_to(site)} loads {url}"
            if not url.startswith("data:"):
                path = url.split("#")[0].split("?")[0]  # 404.html's are from the site's root
                target = (site / path.lstrip("/") if path.startswith("/") else
                          page.parent / path).resolve()
                assert target.is_file(), f"{page.relative_to(site)} loads {url}: not in the site"
            checked += 1
    assert checked > 100


def test_api_pages_document_every_public_name(site: Path) -> None:
    """Each ``::: module`` of docs/api/*.md shows every name of the module's ``__all__``."""
    import importlib

    checked = 0
    for page in sorted((DOCS / "api").glob("*.md")):
        html = (site / "api" / f"{page.stem}.html").read_text(encoding="utf-8")
        ids = set(re.findall(r'id="([\w.]+)"', html))
        for module_name in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M):
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError:  # one object listed on its own (...embed.embed)
                parent, _, attr = module_name.rpartition(".")
                assert hasattr(importlib.import_module(parent), attr), module_name
                continue
            for name in getattr(module, "__all__", []):
                obj = getattr(module, name)
                if not (callable(obj) or isinstance(obj, type)) or obj.__doc__ is None:
                    continue  # constants and submodules re-exported are not listed
                # a name that is also a submodule's is listed on its own (module.name.name)
                assert {f"{module_name}.{name}", f"{module_name}.{name}.{name}"} & ids, (
                    f"api/{page.stem}.md: {module_name}.{name} is not documented")
                checked += 1
    assert checked >= 100


def test_api_reference_comes_from_the_docstrings(site: Path) -> None:
    expected = {
        "layers": ["handformer.layers.MultiHeadAttention", "handformer.layers.EncoderLayer"],
        "attention": ["handformer.attention.local_attention", "handformer.masks.padding_mask"],
        "models": ["handformer.models.CausalLM", "handformer.models.CausalLMConfig"],
        "pretrained": ["handformer.pretrained.load_bert", "handformer.pretrained.embed.embed"],
        "inspect": ["handformer.inspect.run_with_cache", "handformer.inspect.attention_rollout"],
        "viz": ["handformer.viz.plot_attention", "handformer.viz.save_html"],
        "serve": ["handformer.serve.create_app"],
        "train": ["handformer.train.TrainConfig", "handformer.train.train"],
    }
    for area, names in expected.items():
        html = (site / "api" / f"{area}.html").read_text(encoding="utf-8")
        for name in names:
            assert f'id="{name}"' in html, f"api/{area}.html does not document {name}"
    layers = (site / "api" / "layers.html").read_text(encoding="utf-8")
    assert "Raises" in layers and "num_heads" in layers  # the docstrings' sections, rendered
    # the docstrings' Sphinx roles became code, linked across pages where the name is unique
    pages = "".join(p.read_text(encoding="utf-8") for p in (site / "api").glob("*.html"))
    assert not re.search(r":(class|func|meth|mod|attr|data|exc):<code>", pages)
    assert len(re.findall(r'<a href="\w+\.html#handformer\.[\w.]+"><code>', pages)) >= 20


def test_pages_link_the_code_on_github_and_render_the_notebooks(site: Path) -> None:
    tutorial = (site / "tutorial.en.html").read_text(encoding="utf-8")
    assert f'href="{REPO_URL}/blob/main/src/handformer/masks.py"' in tutorial
    assert 'href="../src/' not in tutorial
    # "```bash .noeval" became a highlighted block (Python-Markdown alone leaves it as text)
    assert '<code>make<span class="w"> </span>demo' in tutorial
    benchmarks = (site / "benchmarks.html").read_text(encoding="utf-8")
    assert 'src="img/bench_variants_time.png"' in benchmarks
    assert (site / "img" / "bench_variants_time.png").is_file()
    for lang, title in (("en", "Stop memorising the Transformer"), ("zh", "别再死记硬背")):
        notebook = (site / "notebooks" / f"tutorial.{lang}.html").read_text(encoding="utf-8")
        assert title in notebook and "scaled_dot_product_attention" in notebook
        picture = "seed_attention.png" if lang == "en" else "seed_attention_zh.png"
        assert f'src="../img/{picture}"' in notebook  # the site's copy, not GitHub's
        assert (site / "notebooks" / f"tutorial.{lang}.ipynb").is_file()  # the download
    home = (site / "zh" / "index.html").read_text(encoding="utf-8")
    assert 'href="../tutorial.zh.html"' in home
    assert '<a href="../index.html" hreflang="en"' in home  # the language switch


# ---- each mistake fails the strict build --------------------------------------------------


def real_settings() -> dict:
    """mkdocs.yml's validation, hooks, exclusions and Markdown extensions, for tiny sites."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"),
                       Loader=get_yaml_loader())
    return {"validation": config["validation"], "exclude_docs": config["exclude_docs"],
            "hooks": [str(ROOT / h) for h in config["hooks"]],
            "theme": {"name": "material", "font": False}}


PAGE_B = "# Page B\n\n## A section\n\nText.\n"
MISTAKES = {
    # name: (index.md, pages in the nav, what the error says)
    "link to a missing page": ("[b](missing.md)", ["index.md", "b.md"], "missing.md"),
    "link to a missing anchor": ("[b](b.md#no-such-section)", ["index.md", "b.md"],
                                 "no-such-section"),
    "link to a missing file of the code": ("[code](../src/missing.py)", ["index.md", "b.md"],
                                           "not in the repository"),
    "page left out of the nav": ("[b](b.md#a-section)", ["index.md"], "b.md"),
}


def tiny_site(tmp_path: Path, index: str, nav: list[str]) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "real.py").write_text("x = 1\n", encoding="utf-8")
    (tmp_path / "docs" / "index.md").write_text(f"# Home\n\n{index}\n", encoding="utf-8")
    (tmp_path / "docs" / "b.md").write_text(PAGE_B, encoding="utf-8")
    config = {"site_name": "tiny", "use_directory_urls": False, "nav": nav, **real_settings()}
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True), encoding="utf-8")
    return path


def test_a_tiny_site_with_the_same_settings_builds(tmp_path: Path) -> None:
    config = tiny_site(tmp_path, "[b](b.md#a-section), [code](../src/real.py#L1)",
                       ["index.md", "b.md"])
    result = mkdocs_build(config, tmp_path / "site")
    assert result.returncode == 0, result.stderr
    html = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert f'href="{REPO_URL}/blob/main/src/real.py#L1"' in html


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_mistake_fails_the_strict_build(mistake: str, tmp_path: Path) -> None:
    index, nav, says = MISTAKES[mistake]
    result = mkdocs_build(tiny_site(tmp_path, index, nav), tmp_path / "site")
    assert result.returncode != 0, f"{mistake}: the strict build passed"
    assert "WARNING" in result.stderr, result.stderr
    assert says in result.stderr[result.stderr.index("WARNING"):], result.stderr
