"""Every public module is on the API pages, and every documented parameter is documented.

Read without building the site (tests/test_docs_site.py builds it):

* a module under src/handformer whose dotted name has no part starting with ``_`` is on the
  site when a page of docs/api/ renders it (``::: handformer.x.y``, or an object inside it),
  or renders a package whose ``__all__`` re-exports one of its names (``::: handformer.attention``
  shows ``local_attention`` of ``handformer.attention.local``); a package whose ``__all__``
  holds only names of modules on the site (``handformer`` itself) adds nothing to show;
* every parameter of a public function or class (the names in ``__all__`` of ``handformer``
  and of each of its packages) is named in its docstring's ``Args:`` (or ``Attributes:`` of a
  dataclass), as the site's pages show them; several parameters may share one entry
  (``x, y: ...``).
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))
DIRECTIVE = re.compile(r"^::: *([\w.]+)", re.M)
SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Attributes|Keyword Args|"
                     r"Keyword Arguments|Other Parameters):\s*$")


def public_modules() -> list[str]:
    """Every module whose name has no ``_`` part, but the old paths of moved modules (which
    forward to their new homes, with a warning, for one release)."""
    from handformer.pretrained._moved import MOVED

    names = []
    for path in sorted((SRC / "handformer").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts) and ".".join(parts) not in MOVED:
            names.append(".".join(parts))
    return names


def packages() -> list[str]:
    return [name for name in public_modules()
            if (SRC / name.replace(".", "/") / "__init__.py").is_file()]


def rendered() -> set[str]:
    return {name for page in API_PAGES for name in DIRECTIVE.findall(page.read_text("utf-8"))}


def home(obj: object) -> str | None:
    """The module an exported object is defined in (a module: itself)."""
    return obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)


def on_the_site(directives: set[str]) -> set[str]:
    covered = set(directives)
    for name in directives:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an object inside a module: ::: handformer.pretrained.embed.embed
            covered.add(name.rpartition(".")[0])
            continue
        covered.update(home(getattr(module, n)) for n in getattr(module, "__all__", ()))
    for name in packages():  # re-exports only: on the site where what it exports is
        package = importlib.import_module(name)
        exported = {home(getattr(package, n)) for n in getattr(package, "__all__", ())}
        if exported and exported <= covered:
            covered.add(name)
    return covered


def documented(doc: str | None) -> set[str]:
    """The names the ``Args:``-like sections of a Google-style docstring document."""
    names: set[str] = set()
    lines = inspect.cleandoc(doc or "").splitlines()
    i = 0
    while i < len(lines):
        section = SECTION.match(lines[i])
        i += 1
        if not section:
            continue
        base, item = len(section.group(1)), None
        while i < len(lines):
            line = lines[i]
            indent = len(line) - len(line.lstrip())
            if line.strip() and indent <= base:
                break  # the next section
            if line.strip() and (item is None or indent == item):
                item = indent
                head = re.sub(r"\(.*?\)", "", line.strip().split(":", 1)[0])
                names.update(n.strip().strip("`").lstrip("*") for n in head.split(","))
            i += 1
    return names


def undocumented(obj: object) -> list[str]:
    if inspect.isclass(obj):
        own_init = obj.__dict__.get("__init__")
        docs = documented(obj.__doc__) | documented(getattr(own_init, "__doc__", None))
    else:
        docs = documented(obj.__doc__)
    try:
        params = inspect.signature(obj).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin)
        return []
    return [p.name for p in params if p.name not in ("self", "cls") and p.name not in docs
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def test_every_public_module_is_on_an_api_page() -> None:
    assert API_PAGES, "no docs/api/*.md"
    covered = on_the_site(rendered())
    missing = [m for m in public_modules() if m not in covered]
    assert not missing, ("public modules on no API page (add `::: module` to a docs/api/ page "
                         f"or re-export a name through a rendered package): {missing}")


@pytest.mark.parametrize("package", packages())
def test_every_parameter_of_the_public_api_is_documented(package: str) -> None:
    module = importlib.import_module(package)
    problems = []
    for name in getattr(module, "__all__", ()):
        obj = getattr(module, name)
        if callable(obj) and not inspect.ismodule(obj) and home(obj).startswith("handformer"):
            missing = undocumented(obj)
            if missing:
                problems.append(f"{package}.{name}: {missing} not in its docstring's Args")
    assert not problems, "\n".join(problems)


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """The docstring reader finds grouped and typed entries and stops at the next section,
    and a module on no page is reported."""
    doc = """Summary.

    Args:
        q, k, v: tensors, described on
            two lines (``not: a name``).
        scale (float): a number.

    Returns:
        out: not a parameter.
    """
    assert documented(doc) == {"q", "k", "v", "scale"}

    def f(q: int, k: int, v: int, scale: float, softcap: float | None = None) -> None:
        pass

    f.__doc__ = doc
    assert undocumented(f) == ["softcap"]
    assert "handformer.norms" not in on_the_site({"handformer.layers", "handformer.attention"})
    assert "handformer.attention.local" in on_the_site({"handformer.attention"})
