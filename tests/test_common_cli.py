"""What every sub-command shares (``handformer.commands.common`` and ``handformer.cli.main``):
``--device`` resolution, warnings shown as one-line notes, a quiet exit when the reader of
stdout goes away (``handformer viz ... | head -1``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from handformer.cli import EXIT_BROKEN_PIPE, main
from handformer.commands.common import UsageError, resolve_device
from pretrained_util import tiny_checkpoint


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bert")
    tiny_checkpoint(folder, hidden_size=16, layers=1, heads=2, intermediate=16)
    return folder


# ---- --device --------------------------------------------------------------------------------


def test_resolve_device_names(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UsageError, match=r"--device cuda:2: there are only 2 CUDA devices "
                                         r"\(cuda:0..cuda:1\)"):
        resolve_device("cuda:2")
    with pytest.raises(UsageError, match="--device must be auto, cpu, cuda or cuda:N, got 'gpu'"):
        resolve_device("gpu")


@pytest.mark.parametrize("cuda_build, why", [
    (None, "has no CUDA support"),
    ("12.4", "no CUDA GPU is visible (check nvidia-smi and CUDA_VISIBLE_DEVICES)"),
])
def test_cuda_absent_says_why(monkeypatch: pytest.MonkeyPatch, cuda_build: str | None,
                              why: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    with pytest.raises(UsageError) as info:
        resolve_device("cuda")
    assert str(info.value).startswith("--device cuda: ") and why in str(info.value)
    assert str(info.value).endswith("use --device cpu (or auto, which falls back to the CPU)")


@pytest.mark.parametrize("command", ["embed", "viz", "heads"])
def test_every_model_command_refuses_absent_cuda_in_one_line(
        command: str, bert_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out_dir = tmp_path / "out"
    extra = {"embed": [], "viz": ["--out", str(out_dir)], "heads": ["--out", str(out_dir)]}[command]
    texts = ["the cat", "a dog"] if command == "heads" else ["the cat"]  # heads: TEXT_A TEXT_B
    assert main([command, *texts, "--model", str(bert_dir), "--device", "cuda", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"handformer {command}: error: --device cuda: ")
    assert not out_dir.exists()  # refused before anything was written


def test_model_commands_run_with_device_cpu(bert_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    assert main(["embed", "the cat", "a dog", "--model", str(bert_dir), "--json"]) == 0
    default = capsys.readouterr().out
    assert main(["embed", "the cat", "a dog", "--model", str(bert_dir), "--json",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out == default
    assert main(["viz", "the cat sat", "--model", str(bert_dir), "--out", str(tmp_path),
                 "--device", "cpu"]) == 0
    assert (tmp_path / "index.html").is_file()
    assert main(["heads", "the cat", "a dog", "--model", str(bert_dir), "--out", str(tmp_path),
                 "--device", "cpu"]) == 0
    assert (tmp_path / "heads.png").is_file()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_embed_on_cuda_matches_cpu(bert_dir: Path, capsys: pytest.CaptureFixture) -> None:
    vectors = []
    for device in ("cpu", "cuda"):
        assert main(["embed", "the cat", "a dog", "--model", str(bert_dir), "--json",
                     "--device", device]) == 0
        vectors.append(torch.tensor([r["embedding"] for r in
                                     json.loads(capsys.readouterr().out)]))
    torch.testing.assert_close(vectors[1], vectors[0], atol=1e-5, rtol=1e-4)


# ---- warnings become one-line notes ----------------------------------------------------------


def test_embed_long_text_prints_a_one_line_note(bert_dir: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    """The tokenizer warns that the text was cut to the model's 64 positions; the command
    shows it as one `note:` line on stderr, not a Python warning with a source path, and the
    JSON on stdout stays valid."""
    long = "the cat sat on the mat " * 40
    assert main(["embed", long, "short", "--model", str(bert_dir), "--json"]) == 0
    out, err = capsys.readouterr()
    assert [r["sentence"] for r in json.loads(out)] == [long, "short"]
    assert err.count("\n") == 1 and err.startswith("note: 1 text(s) longer than 64 tokens"), err
    assert "truncated to 64" in err
    assert "UserWarning" not in err and ".py:" not in err


# ---- a reader that goes away -----------------------------------------------------------------


class _ClosedPipe:
    """A stdout whose reader has gone away: every write fails with EPIPE."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_broken_pipe_in_process_is_quiet(bert_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    code = main(["viz", "the cat sat", "--model", str(bert_dir), "--out", str(tmp_path)])
    monkeypatch.undo()
    assert code == EXIT_BROKEN_PIPE == 141
    assert capsys.readouterr().err == ""  # no "[Errno 32] Broken pipe"


@pytest.mark.parametrize("argv", [["viz", "the cat sat", "--model", "{bert}", "--out", "{tmp}"],
                                  ["--help"]])
def test_broken_pipe_subprocess_exits_quietly(argv: list[str], bert_dir: Path,
                                              tmp_path: Path) -> None:
    """`handformer viz ... | head -1`, made deterministic: the read end of stdout is closed
    before the command writes anything. Exit 141 (128 + SIGPIPE, as the shell reports for
    Unix tools) and nothing on stderr. stdout is block-buffered, as for any user (without
    PYTHONUNBUFFERED), so the failure comes at the final flush too."""
    argv = [a.format(bert=bert_dir, tmp=tmp_path) for a in argv]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run([sys.executable, "-m", "handformer", *argv], stdout=write,
                                stderr=subprocess.PIPE, timeout=300, env=env)
    finally:
        os.close(write)
    assert result.returncode == 141, result.stderr.decode()
    assert result.stderr == b""
