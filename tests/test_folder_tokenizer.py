"""One function decides which tokenizer a checkpoint folder has (handformer.tokenizers.loading):
load_lm, the commands and the server all go through it, a handformer train run's character
vocab.json included (the commands and the server used to fall back to it on their own)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import handformer as hf
from handformer.commands.generate import load_model_and_tokenizer
from handformer.pretrained.lm import load_lm, load_lm_with_tokenizer
from handformer.serve.state import _load_causal
from handformer.tokenizers.chars import CharVocab, is_char_vocab
from handformer.tokenizers.loading import folder_tokenizer, require_tokenizer

CHARS = list("abcdefgh ")


def _run(folder: Path, *, char_vocab: bool) -> Path:
    """A folder as ``handformer train`` writes it: CausalLM weights (+ its vocab.json)."""
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=len(CHARS), max_len=16, d_model=8,
                                          num_heads=2, num_layers=1, d_ff=8))
    model.save_pretrained(folder)
    if char_vocab:
        CharVocab(CHARS).save(folder / "vocab.json")
    return folder


def test_a_runs_character_vocabulary_comes_back_from_every_loader(tmp_path: Path) -> None:
    run = _run(tmp_path / "run", char_vocab=True)
    config = json.loads((run / "config.json").read_text())
    found = folder_tokenizer(run, config)
    assert isinstance(found, CharVocab) and found.chars == CHARS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "has no tokenizer" warning any more
        _, tok = load_lm(run)
    assert isinstance(tok, CharVocab) and tok.chars == CHARS
    for _, tok in (load_lm_with_tokenizer(run), load_model_and_tokenizer(run),
                   _load_causal(run, "cpu")):
        assert isinstance(tok, CharVocab) and tok.decode(tok.encode("bad cab")) == "bad cab"


def test_a_folder_without_a_tokenizer_is_one_error_everywhere(tmp_path: Path) -> None:
    run = _run(tmp_path / "bare", char_vocab=False)
    with pytest.warns(UserWarning, match="has no tokenizer.*load_lm returns the model with "
                                         "tokenizer None"):
        assert load_lm(run)[1] is None  # load_lm itself still warns and returns None
    messages = set()
    for load in (load_lm_with_tokenizer, load_model_and_tokenizer,
                 lambda d: _load_causal(d, "cpu")):
        with pytest.raises(ValueError, match="has no tokenizer: expected tokenizer.json, or "
                                             r"vocab.json \+ merges.txt") as info:
            load(run)
        messages.add(str(info.value))
    assert len(messages) == 1  # the commands and the server say the same thing
    assert "nor a character vocab.json" in messages.pop()


def test_a_gpt2_vocab_without_merges_is_not_a_character_vocabulary(tmp_path: Path) -> None:
    """GPT-2's vocab.json (token -> id) has a token "kind" too; without merges.txt the error
    names the missing file (the commands used to say "not a character vocabulary")."""
    run = _run(tmp_path / "half", char_vocab=False)
    (run / "vocab.json").write_text(json.dumps({"kind": 0, "a": 1}), encoding="utf-8")
    assert not is_char_vocab(run / "vocab.json")
    config = json.loads((run / "config.json").read_text())
    assert folder_tokenizer(run, config) is None
    with pytest.raises(ValueError, match="vocab.json is there but merges.txt is missing"):
        load_lm_with_tokenizer(run)


def test_require_tokenizer_passes_a_tokenizer_through(tmp_path: Path) -> None:
    vocab = CharVocab(CHARS)
    assert require_tokenizer(vocab, tmp_path) is vocab
    with pytest.raises(ValueError, match=f"{tmp_path} has no tokenizer"):
        require_tokenizer(None, tmp_path)
