"""``handformer train``: bad inputs exit 2 with one clear line; an lm run loads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from handformer.cli import main
from handformer.models.causal_lm import CausalLM
from handformer.train.data import CharVocab

TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--d-ff", "64", "--no-progress",
        "--threads", "1"]


def _error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("handformer train: error: "), err
    assert "Traceback" not in err
    return err


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    return path


def test_missing_empty_and_short_text(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = ["--out", str(tmp_path / "run")]
    err = _error(capsys, ["lm", "--text", str(tmp_path / "nope.txt"), *out])
    assert "nope.txt does not exist" in err
    (tmp_path / "empty.txt").write_text("")
    assert "is empty" in _error(capsys, ["lm", "--text", str(tmp_path / "empty.txt"), *out])
    (tmp_path / "short.txt").write_text("x" * 300)
    err = _error(capsys, ["lm", "--text", str(tmp_path / "short.txt"), "--block-size", "64",
                          *out])
    assert "300 characters, shorter than one block" in err and "at least 650" in err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 500)
    assert "not UTF-8" in _error(capsys, ["lm", "--text", str(tmp_path / "latin1.txt"), *out])
    assert "needs --text" in _error(capsys, ["lm", *out])
    assert not (tmp_path / "run").exists()  # nothing was created


@pytest.mark.parametrize("argv, words", [
    (["translate"], ["unknown task 'translate'", "reverse"]),
    (["reverse", "--lr=-0.001"], ["lr must be a positive number", "-0.001"]),
    (["reverse", "--d-model", "30", "--heads", "4"], ["d_model=30", "num_heads=4"]),
    (["reverse", "--heads", "0"], ["num_heads must be a positive integer"]),
    (["reverse", "--steps", "0"], ["steps must be a positive integer"]),
    (["reverse", "--dropout", "1.5"], ["dropout"]),
    (["reverse", "--attention", "local"], ["window_size"]),
    (["reverse", "--schedule", "step"], ["schedule must be one of"]),
    (["reverse", "--batch-size", "10", "--grad-accum", "3"], ["not divisible by grad_accum"]),
    (["reverse", "--precision", "fp16", "--device", "cpu"], ["fp16", "CUDA"]),
    (["reverse", "--text", "x.txt"], ["--text is only used by task 'lm'"]),
    ([], ["give a TASK"]),
])
def test_invalid_options(argv: list[str], words: list[str], tmp_path: Path,
                         capsys: pytest.CaptureFixture) -> None:
    err = _error(capsys, [*argv, "--out", str(tmp_path / "run")])
    for word in words:
        assert word in err


def test_resume_of_a_folder_that_is_not_a_run(tmp_path: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    err = _error(capsys, ["--resume", str(tmp_path)])
    assert "is not a handformer run folder (no train.json)" in err
    err = _error(capsys, ["--resume", str(tmp_path / "missing")])
    assert "not a handformer run folder" in err


def test_lm_run_loads_back_and_guards_its_folder(text_file: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "lm"
    argv = ["lm", "--text", str(text_file), "--block-size", "16", "--steps", "30",
            "--batch-size", "8", "--warmup", "5", "--eval-every", "15", "--eval-size", "16",
            "--grad-accum", "2", "--label-smoothing", "0.1", "--positional", "rotary",
            "--attention", "local", "--window-size", "5", *TINY]
    assert main(["train", *argv, "--out", str(run_dir)]) == 0
    assert "finished at step 30" in capsys.readouterr().out
    for name in ("train.json", "config.json", "model.safetensors", "vocab.json",
                 "metrics.jsonl", "summary.json", "loss.png", "attention.png"):
        assert (run_dir / name).is_file(), name
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [15, 30] and "accuracy" not in evals[0]
    assert evals[-1]["loss"] < records[0]["loss"]  # it learned something
    # what `handformer generate --model RUN_DIR` / `viz --model RUN_DIR` load
    model = CausalLM.from_pretrained(run_dir)
    vocab = CharVocab.load(run_dir / "vocab.json")
    assert model.config.vocab_size == len(vocab) and model.config.attention == "local"
    ids = torch.tensor([vocab.encode("the quick")])
    out = model.generate(ids, max_new_tokens=5)
    assert vocab.decode(out[0]).startswith("the quick") and out.shape[1] == 14
    # a second run into the same folder is refused; a resume with other options too
    err = _error(capsys, [*argv, "--out", str(run_dir)])
    assert "already holds a run" in err and "--resume" in err
    err = _error(capsys, ["--resume", str(run_dir), "--d-model", "64"])
    assert "--d-model 64 differs from the run's d_model=32" in err
    assert "sort" in _error(capsys, ["sort", "--resume", str(run_dir)])


# ---- issue 16: options that would be ignored are refused ------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["reverse", "--window-size", "5"],
     "--window-size 5 applies to --attention local, not --attention full; add --attention "
     "local or leave --window-size out"),
    (["reverse", "--attention", "linear", "--stride", "3"],
     "--stride 3 applies to --attention strided, not --attention linear; add --attention "
     "strided or leave --stride out"),
    (["reverse", "--attention", "local", "--window-size", "5", "--stride", "3"],
     "--stride 3 applies to --attention strided, not --attention local"),
])
def test_pattern_option_of_another_kind_is_refused_in_cli_words(
        argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    err = _error(capsys, [*argv, "--out", str(tmp_path / "run")])
    assert message in err and "leave it None" not in err
    assert not (tmp_path / "run").exists()


def test_resume_with_steps_below_the_runs_step_is_refused(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", "reverse", "--steps", "3", "--batch-size", "4", "--eval-size", "4",
                 *TINY, "--out", str(run_dir)]) == 0
    capsys.readouterr()
    saved = (run_dir / "train.json").read_text()
    err = _error(capsys, ["--resume", str(run_dir), "--steps", "2"])
    assert ("--steps 2 is below the step the run has reached (3, its newest checkpoint "
            "step-00000003); a resumed run continues from there: give --steps 4 or more, or "
            "leave --steps out") in err
    assert (run_dir / "train.json").read_text() == saved  # the run's options unchanged
    assert main(["train", "--resume", str(run_dir), "--steps", "3"]) == 0  # done already
    assert "finished at step 3" in capsys.readouterr().out
