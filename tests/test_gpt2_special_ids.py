"""A GPT-2 folder that keeps transformers' default special ids (``bos_token_id =
eos_token_id = 50256`` in config.json and generation_config.json) with a retrained 300-token
vocabulary loads, as transformers loads it: the ids outside the vocabulary are left out with
a one-line warning, and the model and tokenizer agree with transformers'."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from handformer.pretrained import load_gpt2, load_lm
from pretrained_util import tiny_gpt2_folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tiny_gpt2_folder(tmp_path_factory.mktemp("gpt2-300"), vocab_size=300)
    for name in ("config.json", "generation_config.json"):
        data = json.loads((path / name).read_text())
        data.update(bos_token_id=50256, eos_token_id=50256)  # GPT2Config's defaults
        (path / name).write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("load", [load_lm, load_gpt2])
def test_loads_as_transformers_does(load: object, folder: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, tokenizer = load(folder)
    notes = [str(w.message) for w in caught if "50256" in str(w.message)]
    assert len(notes) == 1 and "\n" not in notes[0], notes  # one line
    assert notes[0] == (f"{folder}: special token ids outside the vocabulary (0 ... 299) left "
                        "out: bos_token_id 50256, eos_token_id 50256")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    their_tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"))
    text = "w1 w7 w298 w42"
    ids = tokenizer.encode(text)
    assert ids == their_tok(text)["input_ids"]
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits
    torch.testing.assert_close(model(torch.tensor([ids])).logits, expected,
                               rtol=1e-5, atol=1e-5)
    assert tokenizer.bos_token_id == 299  # GPT-2's convention: <|endoftext|> for both
    assert 50256 not in (tokenizer.eos_token_ids or [])
    # the vocabulary's own <|endoftext|> (id 299) still ends generation
    assert tokenizer.eos_token_id == 299 == their_tok.convert_tokens_to_ids("<|endoftext|>")


def test_generate_runs_on_it(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from cli_util import run_cli

    code, out, err = run_cli(capsys, ["generate", "--model", str(folder), "--prompt", "w1 w2",
                                      "--max-new-tokens", "3"])
    assert code == 0 and out.startswith("w1 w2")
    assert err.count("note: ") == 1 and "bos_token_id 50256" in err
