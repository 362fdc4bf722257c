"""Chinese text everywhere: the unknown-token notice (viz, heads, embed, the API), the head the
CLI chooses when most tokens are [UNK], and byte-level tokens labelled with their character
in /api/run, /api/generate (streamed text never splits a character) and the PNG labels."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

from handformer.cli import main
from handformer.serve import ModelState, compute
from handformer.serve.generation import Generation
from handformer.serve.validation import parse_generate, parse_run
from handformer.tokenizers.labels import token_labels
from zh_util import ZH, byte_level_bpe, reference_labels

UNKNOWN = re.compile(r"^(\d+) of (\d+) tokens of .* are the unknown token: all-MiniLM-L6-v2 "
                     r"does not know this script; the shipped gemma3-270m does \((.*)\)$")


@pytest.fixture(scope="module")
def minilm():
    return ModelState(None)


@pytest.fixture(scope="module")
def gpt2_bytes(tmp_path_factory):
    """A tiny random GPT-2 with a byte-level BPE that splits Chinese characters."""
    folder = tmp_path_factory.mktemp("gpt2-bytes")
    tok = byte_level_bpe()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=64, n_embd=16,
                                     n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder, safe_serialization=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def test_api_run_notice_for_a_script_the_model_does_not_read(minilm):
    r = compute.run(minilm, parse_run({"text": ZH}, minilm))
    lines = [n for n in r["notices"] if "unknown token" in n]
    assert len(lines) == 1
    m = UNKNOWN.match(lines[0])
    assert m, lines[0]
    assert int(m.group(1)) == r["tokens"].count("[UNK]") > 0.1 * int(m.group(2))
    assert int(m.group(2)) == len(r["tokens"]) - 2  # [CLS] and [SEP] not counted
    assert m.group(3) == "handformer serve --model gemma3-270m"
    english = compute.run(minilm, parse_run({"text": "The animal was tired"}, minilm))
    assert not english["notices"]


def test_api_ablate_and_pair_notices(minilm):
    r = compute.ablate(minilm, parse_run({"text": "the cat sat", "text_pair": ZH,
                                          "heads": [[0, 0]]}, minilm))
    assert any("tokens of text_pair are the unknown token" in n for n in r["notices"])


def test_page_opens_on_the_head_viz_chooses(minilm, tmp_path, capsys):
    seed = "The animal didn't cross the street because it was too tired"
    r = compute.run(minilm, parse_run({"text": seed, "choose_head": True}, minilm))
    assert main(["viz", seed, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    m = re.search(r"head.png shows layer (\d+), head (\d+)", out)
    assert (r["viewer"]["layer"], r["viewer"]["head"]) == (int(m.group(1)), int(m.group(2)))
    plain = compute.run(minilm, parse_run({"text": seed}, minilm))
    assert (plain["viewer"]["layer"], plain["viewer"]["head"]) == (5, 0)


def test_viz_cli_says_so_and_chooses_a_head_between_known_tokens(tmp_path, capsys):
    text = "动物没有过马路 because it was tired"
    assert main(["viz", text, "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    notes = [ln for ln in err.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and UNKNOWN.match(notes[0][6:]), err
    assert UNKNOWN.match(notes[0][6:]).group(3) == "--model gemma3-270m"
    data = json.loads(re.search(r'id="hf-data">(.*?)</script>',
                                (tmp_path / "index.html").read_text(encoding="utf-8"),
                                re.S).group(1))
    tokens = data["tokens"]
    layer, head = data["layer"], data["head"]
    # The chosen head's strongest link (outside [CLS]/[SEP]/[UNK]) joins two known words.
    assert "[UNK]" in tokens
    assert re.search(rf"head.png shows layer {layer}, head {head}", out)
    line = [ln for ln in out.splitlines() if ln.startswith(f"layer {layer}: ")][0]
    assert "[UNK]" not in line.split("strongest link")[-1]


def test_viz_cli_all_unknown_still_chooses_a_head(tmp_path, capsys):
    assert main(["viz", ZH, "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "unknown token" in err
    assert re.search(r"head.png shows layer \d+, head \d+", out)


def test_heads_and_embed_cli_notices(tmp_path, capsys):
    assert main(["heads", ZH, "the cat", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "of TEXT_A and TEXT_B are the unknown token" in err and "handformer viz" in err
    assert main(["embed", ZH, "the cat"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "of the sentences are the unknown token" in err
    assert "embeddings need a multilingual encoder" in err
    assert main(["embed", "the cat", "a dog"]) == 0
    assert capsys.readouterr().err == ""


def test_api_run_labels_byte_level_pieces(gpt2_bytes):
    state = ModelState(gpt2_bytes)
    r = compute.run(state, parse_run({"text": ZH}, state))
    assert not any("\ufffd" in t for t in r["tokens"])
    assert r["tokens"] == reference_labels(byte_level_bpe(), ZH)
    assert r["viewer"]["tokens"] == r["tokens"]
    assert not any("\ufffd" in c["token"] for c in r["next_token"])
    assert not r["notices"]  # byte-level BPE has no unknown token


def test_generate_streams_whole_characters(gpt2_bytes):
    state = ModelState(gpt2_bytes)
    gen = Generation(state, parse_generate({"text": ZH, "max_new_tokens": 24,
                                            "temperature": 1.0, "seed": 3}, state))
    start = gen.start()
    assert not any("\ufffd" in t for t in start["prompt_tokens"])
    labels, texts = [], []
    while True:
        ev = gen.step()
        if ev["event"] == "end":
            break
        for index, label in ev["relabel"].items():
            labels[int(index)] = label
        labels.append(ev["token"])
        texts.append(ev["text"])
        assert not ev["text"].endswith("\ufffd")
    ids = gen.ids
    assert labels == token_labels(state.tokenizer, ids)
    assert not any("\ufffd" in label for label in labels)
    whole = state.tokenizer.decode(ids)
    assert not any("\ufffd" in t for t in texts)
    assert "".join(texts) == whole.rstrip("\ufffd").replace("\ufffd", "<?>")
    assert sum(1 for t in texts if t == "") >= 1  # some tokens waited for their character


def test_api_run_on_ids_shows_the_generated_tokens(gpt2_bytes):
    state = ModelState(gpt2_bytes)
    ids = state.tokenizer.encode(ZH)
    by_text = compute.run(state, parse_run({"text": ZH}, state))
    by_ids = compute.run(state, parse_run({"ids": ids}, state))
    assert by_ids["tokens"] == by_text["tokens"]
    assert by_ids["next_token"] == by_text["next_token"]
    # A byte sequence that is no character (a model may generate one): labelled by its bytes,
    # where decoding and re-encoding the text would have given U+FFFD tokens.
    tok = state.tokenizer.tokenizer
    lone = [tok.token_to_id(c) for c in ("\u00e5", "a")]  # 0xE5 then "a": invalid UTF-8
    r = compute.run(state, parse_run({"ids": lone}, state))
    assert r["tokens"] == ["<0xE5>", "a"]
    again = compute.run(state, parse_run({"text": state.tokenizer.decode(lone)}, state))
    assert any("\ufffd" in t for t in again["tokens"])  # why the page sends ids
