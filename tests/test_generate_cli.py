"""``handformer generate`` on a GPT-2 folder (tokenizer.json) and a CausalLM folder
(character vocab.json)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import handformer as hf
from handformer.cli import main
from handformer.commands.generate import _TextStream
from handformer.models.causal_lm import CausalLM
from handformer.pretrained import load_gpt2
from handformer.train.data import CharVocab
from pretrained_util import tiny_gpt2_folder

transformers = pytest.importorskip("transformers")
V, EOS = 40, 39


@pytest.fixture
def gpt2_dir(tmp_path: Path) -> Path:
    return tiny_gpt2_folder(tmp_path, n_layer=1, vocab_size=V)


def test_gpt2_folder_greedy(gpt2_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "w1 w2 w3",
                 "--max-new-tokens", "10"]) == 0
    out = capsys.readouterr().out
    model, tok = load_gpt2(gpt2_dir)
    ids = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=10, eos_token_id=EOS)[0]
    new = [i for i in ids[3:].tolist() if i != EOS]
    assert out == "w1 w2 w3" + tok.decode(new) + "\n"


def test_gpt2_folder_sampling_is_seeded(gpt2_dir: Path, capsys: pytest.CaptureFixture) -> None:
    args = ["generate", "--model", str(gpt2_dir), "--prompt", "w5", "--max-new-tokens", "12",
            "--temperature", "2.0", "--top-k", "20", "--top-p", "0.95"]
    outs = []
    for seed in ("1", "1", "2"):
        assert main([*args, "--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] != outs[2]
    assert outs[0].startswith("w5")


def test_causal_lm_folder_with_char_vocab(tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    vocab = CharVocab(list("abcdefgh "))
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=len(vocab), max_len=32, d_model=16,
                                          num_heads=2, num_layers=1, d_ff=16))
    model.save_pretrained(tmp_path)
    vocab.save(tmp_path / "vocab.json")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "abc ",
                 "--max-new-tokens", "8"]) == 0
    expected = model.eval().generate(torch.tensor([vocab.encode("abc ")]), max_new_tokens=8)
    assert capsys.readouterr().out == vocab.decode(expected[0]) + "\n"


def test_streaming_prints_whole_characters_only() -> None:
    class Bytes:  # a byte-level tokenizer: id = one UTF-8 byte
        def decode(self, ids: list[int]) -> str:
            return bytes(ids).decode("utf-8", errors="replace")

    class Out:
        def __init__(self) -> None:
            self.parts: list[str] = []

        def write(self, s: str) -> None:
            self.parts.append(s)

        def flush(self) -> None:
            pass

    out = Out()
    stream = _TextStream(Bytes(), ">", None, out)
    for b in "é!".encode():
        stream(torch.tensor([b]))
    stream.finish()
    assert out.parts == [">", "é", "!", "", "\n"]  # no half character printed


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "0"], "temperature must be > 0 when sampling"),
    (["--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
    (["--temperature", "inf"], "--temperature must be a finite number > 0, got inf"),
    (["--seed", "-1"], r"--seed must be an integer in 0..2\*\*63 - 1, got -1"),
    (["--max-new-tokens", "-2"], "--max-new-tokens must be an integer >= 0, got -2"),
    (["--max-new-tokens", "40"], "exceeds the context max_len=32"),
])
def test_bad_settings_exit_2(gpt2_dir: Path, capsys: pytest.CaptureFixture, extra: list[str],
                             message: str) -> None:
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "w1", *extra]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing printed before the error
    assert captured.err.startswith("handformer generate: error: ")
    assert re.search(message, captured.err)


def test_bad_folders_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", str(tmp_path / "none"), "--prompt", "x"]) == 2
    assert "no config.json" in capsys.readouterr().err
    hf.CausalLM(hf.CausalLMConfig(vocab_size=5, max_len=8, d_model=8, num_heads=2,
                                  num_layers=1, d_ff=8)).save_pretrained(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


# ---- issue 16: the context limit, the temperature, the device --------------------------------


@pytest.fixture(scope="module")
def reverse_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real (one-step) `handformer train reverse` run: context 2 * 8 + 1 = 17 tokens."""
    run = tmp_path_factory.mktemp("reverse") / "run"
    assert main(["train", "reverse", "--steps", "1", "--layers", "1", "--d-model", "16",
                 "--heads", "2", "--d-ff", "32", "--batch-size", "4", "--eval-size", "4",
                 "--no-progress", "--threads", "1", "--out", str(run)]) == 0
    return run


def test_default_length_fits_the_context_of_a_train_run(reverse_run: Path,
                                                         capsys: pytest.CaptureFixture) -> None:
    """The training guide's `generate --model runs/reverse` without --max-new-tokens: the
    default (50) is cut to the 8 tokens that fit after a 9-token prompt, with a one-line note."""
    capsys.readouterr()
    assert main(["generate", "--model", str(reverse_run), "--prompt", "31415926>"]) == 0
    out, err = capsys.readouterr()
    model = CausalLM.from_pretrained(reverse_run).eval()
    vocab = CharVocab.load(reverse_run / "vocab.json")
    assert model.config.max_len == 17
    expected = model.generate(torch.tensor([vocab.encode("31415926>")]), max_new_tokens=8)
    assert out == vocab.decode(expected[0].tolist()) + "\n" and len(out) == 18
    assert err == ("note: stopped at the model's context limit: 9 prompt + 8 new = 17 tokens "
                   "(without --max-new-tokens, generate makes up to 50 tokens, as many as "
                   "fit)\n")
    # A prompt that fills the context: nothing to generate, said so; exit 0.
    assert main(["generate", "--model", str(reverse_run), "--prompt", "3141592653589793>"]) == 0
    out, err = capsys.readouterr()
    assert out == "3141592653589793>\n" and "fills the model's context of 17 tokens" in err
    # Asked for explicitly, a length that fits makes no note; one that does not is refused
    # in the command line's words.
    assert main(["generate", "--model", str(reverse_run), "--prompt", "31415926>",
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["generate", "--model", str(reverse_run), "--prompt", "31415926>",
                 "--max-new-tokens", "9"]) == 2
    err = capsys.readouterr().err
    assert err == ("handformer generate: error: the prompt (9 tokens) + --max-new-tokens 9 = "
                   "18 exceeds the context max_len=17; give --max-new-tokens 8 or less, or "
                   "leave it out to generate what fits\n")


def test_no_note_when_the_default_fits(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """With a 64-token context the default 50 new tokens fit: all 50, and no note."""
    vocab = CharVocab(list("ab"))
    folder = tmp_path / "wide"
    hf.CausalLM(hf.CausalLMConfig(vocab_size=2, max_len=64, d_model=8, num_heads=2,
                                  num_layers=1, d_ff=8)).save_pretrained(folder)
    vocab.save(folder / "vocab.json")
    assert main(["generate", "--model", str(folder), "--prompt", "ab"]) == 0
    out, err = capsys.readouterr()
    assert len(out) == 2 + 50 + 1 and err == ""


def test_temperature_zero_says_what_to_do_on_the_command_line(
        gpt2_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "w1",
                 "--temperature", "0"]) == 2
    err = capsys.readouterr().err
    assert err == ("handformer generate: error: --temperature must be > 0 when sampling, got "
                   "0.0; for greedy (deterministic) output leave out --temperature, --top-k "
                   "and --top-p: greedy decoding is the default\n")
    assert "do_sample" not in err  # a Python argument means nothing on the command line


def test_cuda_asked_for_and_absent_is_one_clear_line(gpt2_dir: Path,
                                                      capsys: pytest.CaptureFixture,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "w1", "--device",
                 "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("handformer generate: error: --device cuda: ")
    assert captured.err.endswith("use --device cpu (or auto, which falls back to the CPU)\n")
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "w1 w2", "--device", "cpu",
                 "--max-new-tokens", "4"]) == 0
    on_cpu = capsys.readouterr().out
    assert main(["generate", "--model", str(gpt2_dir), "--prompt", "w1 w2", "--device", "auto",
                 "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out == on_cpu  # auto = the CPU here


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_generate_on_cuda_equals_cpu(gpt2_dir: Path, capsys: pytest.CaptureFixture) -> None:
    outs = []
    for device in ("cpu", "cuda"):
        assert main(["generate", "--model", str(gpt2_dir), "--prompt", "w1 w2", "--device",
                     device, "--max-new-tokens", "12"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
