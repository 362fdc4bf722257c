"""Every tokenizer speaks one protocol (handformer.tokenizers.protocol.Tokenizer): BERT's
WordPiece, GPT-2's byte-level BPE, an LLM's tokenizer from a GGUF file, the trainer's
character vocabulary. Checked by isinstance and by behaviour: batches as (B, L) tensors padded
on the side the tokenizer names (left for causal language models), ``to_tokens`` equal to
``encode`` with its special tokens, ``tokens`` / ``to_str_tokens`` one per id, round trips."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from handformer.pretrained import BertTokenizer, TextTokenizer
from handformer.tokenizers.gguf_vocab import byte_alphabet
from handformer.tokenizers.lm import LMTokenizer
from handformer.tokenizers.protocol import Tokenizer, pad_rows
from handformer.train import CharVocab
from tokenizer_util import as_metadata, gguf_metadata, smollm2_path, spm_fields

SRC = Path(__file__).resolve().parents[1] / "src" / "handformer"
SHORT, LONG = "the cat", "the cat sat on the mat and ran"
KINDS = ["bert", "gpt2", "gguf_spm", "smollm2", "char"]


def gpt2_folder(folder: Path) -> Path:
    """GPT-2's files (vocab.json + merges.txt) for a tiny byte-level BPE vocabulary."""
    letters = list(byte_alphabet().values())
    merges = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at", "Ġ s", "Ġs at"]
    tokens = [*letters, *("".join(m.split(" ")) for m in merges), "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return folder


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    from handformer.pretrained import bundled_model_dir

    made: dict[str, object] = {}
    made["bert"] = BertTokenizer.from_dir(bundled_model_dir())  # the suite needs it installed
    made["gpt2"] = TextTokenizer.from_dir(gpt2_folder(tmp_path_factory.mktemp("gpt2")))
    made["gguf_spm"] = LMTokenizer.from_gguf_metadata(
        as_metadata("llama", "llama", spm_fields()), source="tiny.gguf")
    path = smollm2_path()
    made["smollm2"] = LMTokenizer.from_gguf_metadata(gguf_metadata(path), source=path)
    made["char"] = CharVocab(list("abcdefghijklmnopqrstuvwxyz "))
    return made


def get(tokenizers: dict[str, object], kind: str) -> object:
    return tokenizers[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_isinstance_of_the_protocol(tokenizers, kind: str) -> None:
    tok = get(tokenizers, kind)
    assert isinstance(tok, Tokenizer)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tok, name)
        assert value is None or (isinstance(value, int) and 0 <= value < len(tok)), name
    assert tok.padding_side == ("right" if kind == "bert" else "left")


def test_something_else_is_not_a_tokenizer() -> None:
    class Half:
        def encode(self, text: str) -> list[int]:
            return []

    assert not isinstance(Half(), Tokenizer)
    assert not isinstance(object(), Tokenizer)


@pytest.mark.parametrize("kind", KINDS)
def test_encode_tokens_and_to_tokens_agree(tokenizers, kind: str) -> None:
    tok = get(tokenizers, kind)
    for text in (SHORT, LONG):
        ids = tok.encode(text)
        assert all(isinstance(i, int) and 0 <= i < len(tok) for i in ids)
        to = tok.to_tokens(text)
        assert to.dtype == torch.long and to.shape == (1, len(ids))
        assert to[0].tolist() == ids  # special tokens exactly as encode adds them
        assert len(tok.tokens(text)) == len(tok.to_str_tokens(text)) == len(ids)
        assert all(isinstance(s, str) for s in tok.tokens(text) + tok.to_str_tokens(text))
        plain = tok.encode(text, add_special_tokens=False)
        assert tok.decode(plain) == text
    specials = {"bert": 2, "gpt2": 0, "gguf_spm": 1, "smollm2": 0, "char": 0}[kind]
    assert len(tok.encode(SHORT)) - len(tok.encode(SHORT, add_special_tokens=False)) == specials
    if kind == "gguf_spm":
        assert tok.to_tokens(SHORT)[0, 0] == tok.bos_token_id


@pytest.mark.parametrize("kind", KINDS)
def test_batches_pad_on_the_named_side(tokenizers, kind: str) -> None:
    tok = get(tokenizers, kind)
    batch = tok([SHORT, LONG])
    short, long = tok.encode(SHORT), tok.encode(LONG)
    L, n = len(long), len(short)
    assert n < L
    for name in ("input_ids", "attention_mask"):
        assert batch[name].shape == (2, L) and batch[name].dtype == torch.long
    assert batch["input_ids"][1].tolist() == long and batch["attention_mask"][1].all()
    ids, mask = batch["input_ids"][0].tolist(), batch["attention_mask"][0].tolist()
    if tok.padding_side == "left":  # the last column is every row's last real token
        assert ids[L - n:] == short and mask == [0] * (L - n) + [1] * n
    else:
        assert ids[:n] == short and mask == [1] * n + [0] * (L - n)
    one = tok(SHORT)  # a single text is a batch of one
    assert one["input_ids"].tolist() == [short]
    with pytest.raises(ValueError, match="padding=False but the texts have different lengths"):
        tok([SHORT, LONG], padding=False)
    assert tok([SHORT, SHORT], padding=False)["input_ids"].shape == (2, n)


def test_left_padding_keeps_the_last_position_real() -> None:
    """What batched generation reads: the logits at the last column. Padding on the right
    would put padding there for every shorter row."""
    left = pad_rows([[5], [1, 2, 3]], pad_id=0, side="left")
    right = pad_rows([[5], [1, 2, 3]], pad_id=0, side="right")
    assert left["input_ids"][:, -1].tolist() == [5, 3] and left["attention_mask"][:, -1].all()
    assert right["input_ids"][:, -1].tolist() == [0, 3]
    with pytest.raises(ValueError, match="padding_side must be one of"):
        pad_rows([[1]], pad_id=0, side="middle")


@pytest.mark.parametrize("kind", KINDS)
def test_bad_input(tokenizers, kind: str) -> None:
    tok = get(tokenizers, kind)
    with pytest.raises(TypeError, match="must be a string"):
        tok.encode(3)
    with pytest.raises((TypeError, ValueError)):
        tok([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([len(tok)])
    with pytest.raises(TypeError, match="ids must be integers"):
        tok.decode(torch.tensor([0.5]))


def test_bert_batch_api_is_kept(tokenizers) -> None:
    tok = get(tokenizers, "bert")
    (enc,) = tok.encode_batch([SHORT])
    assert enc.ids == tok.encode(SHORT) and enc.tokens == tok.tokens(SHORT)
    assert tok.pad([enc])["token_type_ids"].shape == (1, len(enc.ids))
    with pytest.warns(DeprecationWarning, match="encode_batch"):
        old = tok.encode([SHORT], max_length=8)
    assert old[0].ids == enc.ids
    assert tok.decode(tok.encode(SHORT), skip_special_tokens=True) == SHORT
    assert (tok.cls_token_id, tok.sep_token_id) == tuple(tok.encode(SHORT)[i] for i in (0, -1))


def test_char_vocab_has_no_special_tokens(tokenizers) -> None:
    tok = get(tokenizers, "char")
    assert tok.tokens("ab c") == ["a", "b", " ", "c"] and tok.chars[:2] == ["a", "b"]
    assert tok(["a", "abc"])["input_ids"].tolist() == [[0, 0, 0], [0, 1, 2]]  # pad id 0
    with pytest.raises(ValueError, match="'Z' is not in the vocabulary"):
        tok.encode("Z")


TOKENIZER_SPECIFIC = [
    (r"\._tokenizer\b", "a tokenizer's private backend"),
    (r"\.encode\(\[", "the old batch form of BertTokenizer.encode"),
    (r"getattr\([^)]*tokenizer[^)]*\)", "probing a tokenizer for optional attributes"),
    (r"isinstance\([^)]*(CharVocab|TextTokenizer|LMTokenizer)", "branching on tokenizer kind"),
]


@pytest.mark.parametrize("package", ["commands", "inspect", "serve"])
def test_commands_inspect_serve_use_the_protocol(package: str) -> None:
    found = []
    for path in sorted((SRC / package).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        for pattern, what in TOKENIZER_SPECIFIC:
            for m in re.finditer(pattern, text):
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{path.relative_to(SRC)}:{line}: {what}: {m.group(0)}")
    assert not found, "\n".join(found)
