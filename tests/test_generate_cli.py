"""``handformer generate`` on a GPT-2 folder (tokenizer.json) and a CausalLM folder
(character vocab.json)."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import handformer as hf
from handformer.cli import main
from handformer.commands.generate import _TextStream
from handformer.pretrained import load_gpt2
from handformer.train.data import CharVocab

transformers = pytest.importorskip("transformers")
V, EOS = 40, 39


@pytest.fixture
def gpt2_dir(tmp_path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=V, n_positions=32, n_embd=16, n_layer=1,
                                     n_head=2, bos_token_id=EOS, eos_token_id=EOS,
                                     initializer_range=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(V - 1)} | {"<|endoftext|>": EOS}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


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
    (["--top-p", "1.5"], r"top_p must be in \(0, 1\]"),
    (["--max-new-tokens", "-2"], "max_new_tokens must be an integer >= 0"),
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
