"""The ``handformer`` command's own options: ``--version``, a top-level help in users' words,
and a help that does not import torch (only the sub-command being run is imported)."""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import pytest

from handformer.cli import COMMANDS, build_parser, main

SRC = Path(__file__).resolve().parents[1] / "src"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_version_prints_the_installed_package_version(capsys) -> None:
    code, out, err = _run(capsys, "--version")
    assert code == 0 and not err
    assert out.strip() == f"handformer {importlib.metadata.version('handformer')}"


def test_top_level_help_is_plain_text_listing_every_command(capsys) -> None:
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    assert "``" not in out and ":mod:" not in out and ":func:" not in out  # no reST
    assert "handformer.commands" not in out  # no module paths in a user's help
    for name, _, summary in COMMANDS:
        # a long name's summary goes on the next line
        assert (f"    {name} " in out or f"    {name}\n" in out) and summary.split()[0] in out
    assert "--version" in out


@pytest.mark.parametrize("name", [c[0] for c in COMMANDS])
def test_each_command_help_is_plain_text(name: str, capsys) -> None:
    code, out, _ = _run(capsys, name, "--help")
    assert code == 0 and out.startswith(f"usage: handformer {name}")
    assert "``" not in out


def test_listed_names_are_the_modules_names() -> None:
    for name, module, _ in COMMANDS:
        assert importlib.import_module(module).NAME == name


def test_the_package_exports_its_names_lazily() -> None:
    import handformer

    assert set(handformer._EXPORTS) == set(handformer.__all__)
    for name in handformer.__all__:
        assert getattr(handformer, name) is not None


def _modules_after(argv: list[str]) -> set[str]:
    """The modules loaded after ``python -m handformer ARGV`` (in a fresh interpreter)."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['handformer', *{argv!r}]\n"
            "try:\n"
            "    runpy.run_module('handformer', run_name='__main__')\n"
            "except SystemExit:\n"
            "    pass\n"
            "sys.__stdout__.write('\\nMODULES ' + ' '.join(sorted(sys.modules)))\n")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120, check=True)
    line = result.stdout.rpartition("\nMODULES ")[2]
    return set(line.split())


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["chat", "--help"],
                                  ["generate", "--help"]])
def test_help_and_version_do_not_import_torch(argv: list[str]) -> None:
    modules = _modules_after(argv)
    assert "handformer.cli" in modules  # the check saw the CLI run
    assert "torch" not in modules
    assert not {m for m in modules if m.startswith("handformer.commands.")} - {
        "handformer.commands.common", f"handformer.commands.{argv[0]}",
        # generate --help lists chat's shared options and the steering options
        *(["handformer.commands.chat", "handformer.commands.steering"]
          if argv[0] == "generate" else [])}


def test_a_command_imports_only_its_own_module() -> None:
    parser = build_parser("chat")
    sub = next(a for a in parser._actions if a.dest == "command")
    assert "--model" in sub.choices["chat"].format_help()
    assert "--model" not in sub.choices["viz"].format_help()  # listed, not filled in
