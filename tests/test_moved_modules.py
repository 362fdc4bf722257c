"""The tokenizer and chat modules moved out of handformer.pretrained (to handformer.tokenizers
and handformer.chat); their old import paths still work for one release, with a warning."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from handformer.pretrained._moved import MOVED

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_warns_and_gives_the_same_objects(old: str, new: str) -> None:
    sys.modules.pop(old, None)  # imported before: import it afresh, so that it warns
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}: import from there"):
        shim = importlib.import_module(old)
    moved = importlib.import_module(new)
    assert shim.__all__ == moved.__all__ and shim.__all__
    for name in moved.__all__:
        assert getattr(shim, name) is getattr(moved, name), name
    other = next(n for n in vars(moved) if n not in moved.__all__ and not n.startswith("__"))
    assert getattr(shim, other) is getattr(moved, other)  # not only the public names
    with pytest.raises(AttributeError):
        shim.no_such_name  # noqa: B018


def test_the_warning_names_the_importing_line(tmp_path: Path) -> None:
    """stacklevel: the warning points at the user's import, not at handformer's shim."""
    old = "handformer.pretrained.token_labels"
    sys.modules.pop(old, None)
    user = tmp_path / "user_code.py"
    user.write_text(f"import {old}\n", encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.warns(DeprecationWarning) as record:
            importlib.import_module("user_code")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("user_code", None)
    assert [Path(w.filename).name for w in record] == ["user_code.py"]


def test_every_old_path_is_a_shim_and_nothing_inside_imports_one() -> None:
    """Each old path is a file that forwards to its new home, and handformer's own code
    imports only the new paths (an old one would warn at every user's import)."""
    for old, new in MOVED.items():
        path = SRC / (old.replace(".", "/") + ".py")
        text = path.read_text(encoding="utf-8")
        package, _, module = new.rpartition(".")
        assert f"from {package} import {module} as _new" in text, path
    olds = set(MOVED)
    for path in (SRC / "handformer").rglob("*.py"):
        if path.name == "_moved.py":  # the table of old paths itself
            continue
        text = path.read_text(encoding="utf-8")
        used = [old for old in olds if f"{old} import" in text or f"import {old}" in text
                or f'"{old}"' in text or f'_sibling("{old.rpartition(".")[2]}")' in text]
        assert not used, f"{path} imports {used}"
