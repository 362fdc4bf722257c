"""LMTokenizer: the tokenizers of GGUF files (from their metadata) and of model folders,
against transformers' tokenizers of the same files.

The two shipped files are the references: SmolLM2 (byte-level BPE, ``pre = smollm``) and
Gemma 3 (SentencePiece BPE with byte fallback, 262k pieces, merges recovered from the
vocabulary). Gemma goes through transformers once (module fixture). Tiny GGUF files written
here cover the other paths (Llama-2-style space prefix, Qwen's word split), and show where
handformer follows the file rather than transformers.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from conftest import hf_gguf_tokenizer
from handformer.tokenizers.gguf_vocab import byte_alphabet
from handformer.tokenizers.lm import LMTokenizer
from handformer.weights import CheckpointError
from tokenizer_util import (
    TEXTS,
    as_metadata,
    gemma_path,
    gguf_metadata,
    smollm2_path,
    spm_fields,
    write_tokenizer_gguf,
)

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def smol() -> tuple[LMTokenizer, object, dict]:
    path = smollm2_path()
    meta = gguf_metadata(path)
    return LMTokenizer.from_gguf_metadata(meta, source=path), hf_gguf_tokenizer(path), meta


@pytest.fixture(scope="module")
def gemma() -> tuple[LMTokenizer, object, dict]:
    path = gemma_path()
    meta = gguf_metadata(path)
    return LMTokenizer.from_gguf_metadata(meta, source=path), hf_gguf_tokenizer(path), meta


# ---- the shipped files ---------------------------------------------------------------------


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_ids_equal_transformers(which: str, request: pytest.FixtureRequest) -> None:
    ours, theirs = request.getfixturevalue(which)[:2]
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert (ours.encode(text, add_special_tokens=False)
                == theirs.encode(text, add_special_tokens=False)), text


@pytest.mark.parametrize("which", ["smol", "gemma"])
def test_decode_inverts_encode(which: str, request: pytest.FixtureRequest) -> None:
    ours, theirs = request.getfixturevalue(which)[:2]
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == text
        with_specials = ours.encode(text)
        assert (ours.decode(with_specials, skip_special_tokens=True)
                == theirs.decode(with_specials, skip_special_tokens=True)), text


def test_special_tokens_follow_the_file(smol, gemma) -> None:
    tok, theirs, meta = smol
    assert meta["tokenizer.ggml.add_bos_token"] is False  # SmolLM2's file adds no BOS
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 2, 0)
    assert (tok.bos_token_id, tok.eos_token_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert tok.encode("Hi")[0] != tok.bos_token_id and not tok.add_bos_token
    assert len(tok) == 49152 and tok.padding_side == "left"
    g, g_theirs, _ = gemma
    assert (g.bos_token_id, g.eos_token_id, g.pad_token_id, g.unk_token_id) == (2, 1, 0, 3)
    assert (g.pad_token_id, g.unk_token_id) == (g_theirs.pad_token_id, g_theirs.unk_token_id)
    assert g.encode("Hi")[0] == 2 and len(g) == 262144
    assert g.tokens("<start_of_turn>user") == ["<bos>", "<start_of_turn>", "user"]


def test_gemma_merges_and_added_tokens_equal_transformers(gemma) -> None:
    """The merges recovered from Gemma's vocabulary (no merges in the file) are transformers'
    list exactly, in order; so are the vocabulary and the added tokens."""
    ours, theirs, _ = gemma
    mine = json.loads(ours.tokenizer.to_str())
    ref = json.loads(theirs.backend_tokenizer.to_str())
    assert len(mine["model"]["merges"]) == len(ref["model"]["merges"]) > 500_000
    assert mine["model"]["merges"] == ref["model"]["merges"]
    assert mine["model"]["vocab"] == ref["model"]["vocab"]
    assert ([(t["id"], t["content"], t["special"]) for t in mine["added_tokens"]]
            == [(t["id"], t["content"], t["special"]) for t in ref["added_tokens"]])


def test_gemma_user_defined_tokens_matter(gemma) -> None:
    """Gemma's USER_DEFINED tokens (runs of newlines, tabs, spaces; HTML tags) are matched
    whole. Read as a plain SentencePiece file (space runs left as real spaces and matched
    whole, as llama.cpp does, merges ranked by the file's scores) the ids are the same; with
    the token types dropped (every token NORMAL) they are not."""
    ours, theirs, meta = gemma
    plain = LMTokenizer.from_gguf_metadata(
        meta | {"general.architecture": "llama", "tokenizer.ggml.add_space_prefix": False},
        source="gemma as a plain SentencePiece file")
    for text in TEXTS:
        assert plain.encode(text) == ours.encode(text), text
    untyped = LMTokenizer.from_gguf_metadata(
        {k: v for k, v in meta.items() if k != "tokenizer.ggml.token_type"}, source="untyped")
    text = "x\n\n\n<table>  y"
    assert ours.encode(text) == theirs(text)["input_ids"]
    assert untyped.encode(text) != ours.encode(text)


def test_smollm_splits_digits_as_the_file_says(smol) -> None:
    """``pre = smollm`` splits every digit (llama.cpp, and SmolLM2's own tokenizer.json);
    transformers' GGUF loader ignores ``pre`` here. On SmolLM2's vocabulary that changes
    nothing (it has no merges of two digits), so both agree; on one with such a merge they
    differ (see test_byte_level_pre_tokenizers)."""
    tok, theirs, meta = smol
    digit_merges = [m for m in meta["tokenizer.ggml.merges"]
                    if all(part.isdigit() for part in m.split(" "))]
    assert digit_merges == []
    assert tok.tokens("2024") == ["2", "0", "2", "4"] == theirs.tokenize("2024")


def test_to_tokens_and_batch(smol) -> None:
    tok = smol[0]
    assert tok.to_tokens("Hello world").tolist() == [tok.encode("Hello world")]
    batch = tok(["Hi", "The capital of France"])
    short = tok.encode("Hi")
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (2, 4)
    assert batch["input_ids"][0, -len(short):].tolist() == short  # left padding
    pad = 4 - len(short)
    assert batch["attention_mask"][0].tolist() == [0] * pad + [1] * len(short)
    assert (batch["input_ids"][0, :pad] == tok.pad_token_id).all()
    assert tok.to_str_tokens("Hello world") == ["Hello", " world"]
    assert tok.tokens("Hello world") == ["Hello", "Ġworld"]


# ---- tiny files: SentencePiece with a space prefix, byte-level word splits ---------------


@pytest.fixture(scope="module")
def spm_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("spm")
    return write_tokenizer_gguf(folder / "spm.gguf", arch="llama", model="llama", **spm_fields())


SPM_TEXTS = ["the cat", "the world is 猫 😀", "hello\nworld\t", "trailing  ", "",
             "a the  cat sat on the world"]


def test_spm_with_space_prefix_equals_transformers(spm_file: Path) -> None:
    ours = LMTokenizer.from_gguf_metadata(gguf_metadata(spm_file), source=spm_file)
    theirs = hf_gguf_tokenizer(spm_file)
    assert ours.add_bos_token  # llama.cpp's default for a SentencePiece file without the flag
    for text in SPM_TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    assert ours.tokens("the world is 猫")[-4:] == ["▁", "<0xE7>", "<0x8C>", "<0xAB>"]


def test_spm_space_prefix_follows_llama_cpp(spm_file: Path) -> None:
    """A text that starts with a space still gets the prefix ``▁`` (SentencePiece and
    llama.cpp do; transformers' Metaspace does not, and loses a space on the way back), and
    so does text right after a special token (llama.cpp's rule)."""
    ours = LMTokenizer.from_gguf_metadata(gguf_metadata(spm_file), source=spm_file)
    theirs = hf_gguf_tokenizer(spm_file)
    text = "  two"
    assert "".join(ours.tokens(text)) == "<s>▁▁▁two"
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
    assert theirs.decode(theirs.encode(text, add_special_tokens=False)) != text
    assert ours.tokens("</s>the") == ["<s>", "</s>", "▁the"]


def test_spm_flags_from_the_file(tmp_path: Path) -> None:
    """add_bos / add_eos / add_space_prefix as the file says; transformers prefixes a space
    to a non-Gemma SentencePiece file whatever its add_space_prefix."""
    fields = spm_fields() | {"add_bos": False, "add_eos": True, "add_space_prefix": False}
    tok = LMTokenizer.from_gguf_metadata(as_metadata("llama", "llama", fields), source="x")
    assert tok.tokens("the cat") == ["t", "he", "▁cat", "</s>"]
    assert tok.decode(tok.encode("the cat", add_special_tokens=False)) == "the cat"
    path = write_tokenizer_gguf(tmp_path / "np.gguf", arch="llama", model="llama",
                                **(spm_fields() | {"add_space_prefix": False}))
    theirs = hf_gguf_tokenizer(path)
    assert theirs.convert_ids_to_tokens(theirs("the cat")["input_ids"]) == ["<s>", "▁the", "▁cat"]
    ours = LMTokenizer.from_gguf_metadata(gguf_metadata(path), source=path)
    assert ours.tokens("the cat") == ["<s>", "t", "he", "▁cat"]


def byte_level_fields(pre: str) -> dict[str, object]:
    """A tiny byte-level BPE vocabulary with one merge of two digits."""
    letters = list(byte_alphabet().values())
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "Ġ c", "a t", "Ġc at"]
    tokens = ["<|endoftext|>", *letters, *("".join(m.split(" ")) for m in merges)]
    return {"tokens": tokens, "merges": merges, "pre": pre, "eos": 0, "bos": 0,
            "token_types": [3] + [1] * (len(tokens) - 1)}


@pytest.mark.parametrize("pre", ["qwen2", "smollm", "default"])
def test_byte_level_pre_tokenizers(pre: str, tmp_path: Path) -> None:
    fields = byte_level_fields(pre)
    path = write_tokenizer_gguf(tmp_path / "bpe.gguf", arch="qwen2", model="gpt2", **fields)
    ours = LMTokenizer.from_gguf_metadata(gguf_metadata(path), source=path)
    theirs = hf_gguf_tokenizer(path)
    for text in ["the cat 12 the<|endoftext|>", "猫 cat\n\n  the", ""]:
        assert ours.decode(ours.encode(text, add_special_tokens=False)) == text
        if pre == "smollm" and "12" in text:  # digits split, as the file says
            assert "12" not in ours.tokens(text) and "12" in theirs.tokenize(text)
        else:
            assert ours.encode(text) == theirs(text)["input_ids"], text
    assert not ours.add_bos_token  # byte-level files add no BOS unless they say so


def test_unknown_pre_tokenizer_warns(tmp_path: Path) -> None:
    meta = as_metadata("qwen2", "gpt2", byte_level_fields("mystery-pre"))
    with pytest.warns(UserWarning, match="tokenizer.ggml.pre 'mystery-pre' is not one"):
        tok = LMTokenizer.from_gguf_metadata(meta, source="x")
    assert tok.tokens(" the") == ["Ġthe"]


# ---- folders -----------------------------------------------------------------------------


def test_from_folder_equals_transformers(smol, tmp_path: Path) -> None:
    """transformers' SmolLM2 tokenizer saved as a folder (tokenizer.json, tokenizer_config.json,
    chat_template.jinja) and read back by both."""
    smol[1].save_pretrained(tmp_path)
    ours = LMTokenizer.from_folder(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == theirs(text)["input_ids"], text
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    assert ours.chat_template == smol[0].chat_template


def tiny_llama_folder(folder: Path, **config: object) -> Path:
    """A tokenizer.json whose post-processor adds BOS, plus the given tokenizer_config."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|eot|>": 3, "hi": 4, "there": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(folder / "tokenizer.json"))
    base = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "unk_token": "<unk>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(base | config))
    return folder


def test_folder_special_tokens(tmp_path: Path) -> None:
    folder = tiny_llama_folder(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    tok = LMTokenizer.from_folder(folder)
    assert tok.encode("hi there") == [1, 4, 5]  # the post-processor's BOS
    assert tok.encode("hi there", add_special_tokens=False) == [4, 5]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.unk_token_id, tok.pad_token_id) == (
        1, [2, 3], 0, None)
    assert tok(["hi", "hi there"])["input_ids"].tolist() == [[2, 1, 4], [1, 4, 5]]


def test_folder_config_flags_win(tmp_path: Path) -> None:
    """tokenizer_config.json's add_bos_token / add_eos_token override the post-processor
    (as transformers' Llama tokenizer classes rebuild theirs from the flags)."""
    tok = LMTokenizer.from_folder(tiny_llama_folder(tmp_path, add_bos_token=False,
                                                    add_eos_token=True))
    assert tok.encode("hi there") == [4, 5, 2]
    assert tok.encode("hi there", add_special_tokens=False) == [4, 5]
    same = LMTokenizer.from_folder(tiny_llama_folder(tmp_path, add_bos_token=True))
    assert same.encode("hi there") == [1, 4, 5] and same.tokenizer.post_processor is not None


def test_folder_chat_template_places(tmp_path: Path) -> None:
    folder = tiny_llama_folder(tmp_path, chat_template=[{"name": "tool", "template": "T"},
                                                        {"name": "default", "template": "D"}])
    assert LMTokenizer.from_folder(folder).chat_template == "D"
    (folder / "chat_template.jinja").write_text("J")
    assert LMTokenizer.from_folder(folder).chat_template == "J"


# ---- refusals ------------------------------------------------------------------------------


def test_malformed_metadata_is_refused() -> None:
    good = as_metadata("llama", "llama", spm_fields())
    cases = [
        ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model is missing"),
        ({"tokenizer.ggml.model": "bert"},
         "tokenizer.ggml.model is 'bert'; supported: gpt2, llama"),
        ({"tokenizer.ggml.tokens": "abc"}, "tokenizer.ggml.tokens must be a non-empty array"),
        ({"tokenizer.ggml.tokens": ["a", 3]}, "tokenizer.ggml.tokens[1] must be a string"),
        ({"tokenizer.ggml.scores": [0.0]}, "tokenizer.ggml.scores has 1 entries but"),
        ({"tokenizer.ggml.token_type": ["x"] * 297}, "tokenizer.ggml.token_type[0] must be a"),
        ({"tokenizer.ggml.bos_token_id": "1"}, "tokenizer.ggml.bos_token_id must be an "
                                                "integer, got '1'"),
        ({"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.add_bos_token": True},
         "tokenizer.ggml.add_bos_token is true but the file has no tokenizer.ggml.bos_token_id"),
        ({"tokenizer.ggml.tokens": [b"\xff"]}, "tokenizer.ggml.tokens[0] holds bytes that are "
                                                 "not UTF-8"),
    ]
    for change, message in cases:
        meta = {k: v for k, v in (good | change).items() if v is not None}
        with pytest.raises(CheckpointError, match="^f.gguf: " + _escape(message)):
            LMTokenizer.from_gguf_metadata(meta, source="f.gguf")


def test_numpy_metadata_is_read_like_lists() -> None:
    """A GGUF reader may hand over numpy arrays and scalars; they read as lists and ints."""
    import numpy as np

    meta = as_metadata("llama", "llama", spm_fields())
    arrays = {k: (np.asarray(v) if k.endswith(("scores", "token_type")) else
                  np.uint32(v) if k.endswith("_id") else v) for k, v in meta.items()}
    arrays["tokenizer.ggml.add_bos_token"] = np.bool_(True)
    plain = LMTokenizer.from_gguf_metadata(meta, source="lists")
    numpy = LMTokenizer.from_gguf_metadata(arrays, source="arrays")
    assert numpy.encode("the world 猫") == plain.encode("the world 猫")
    assert (numpy.bos_token_id, numpy.eos_token_ids) == (1, [2])


def test_malformed_merges_are_refused() -> None:
    fields = byte_level_fields("default")
    for merges, message in ((["Ġt"], "merges[0] must be two tokens separated by one space"),
                            (["x y"], "merges[0] 'x y' joins tokens that are not in")):
        meta = as_metadata("qwen2", "gpt2", fields | {"merges": merges})
        with pytest.raises(CheckpointError, match=_escape(message)):
            LMTokenizer.from_gguf_metadata(meta, source="f.gguf")
    meta = as_metadata("qwen2", "gpt2", fields)
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(CheckpointError, match="tokenizer.ggml.merges is missing"):
        LMTokenizer.from_gguf_metadata(meta, source="f.gguf")


def test_bad_calls(spm_file: Path) -> None:
    tok = LMTokenizer.from_gguf_metadata(gguf_metadata(spm_file), source=spm_file)
    with pytest.raises(TypeError, match="text must be a string, got bytes"):
        tok.encode(b"the")
    with pytest.raises(ValueError, match="id 9999 is outside the vocabulary"):
        tok.decode([4, 9999])
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("caf\udce9")
    with pytest.raises(ValueError, match="gives no tokens"):
        LMTokenizer(tok.tokenizer)(["the", ""])
    with pytest.raises(ValueError, match="padding=False but the texts have different lengths"):
        tok(["the", "the cat"], padding=False)
    assert tok(["the", "cat"], padding=False)["attention_mask"].all()
    with pytest.raises(FileNotFoundError, match="has no tokenizer: expected tokenizer.json"):
        LMTokenizer.from_folder(spm_file.parent)
    assert tok.decode(torch.tensor([tok.encode("the cat", add_special_tokens=False)])) == "the cat"


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_recovered_merges_equal_transformers_with_tied_scores() -> None:
    """The merge order with equal scores (the sorting path; Gemma's ranks are all distinct
    and need none): transformers' generate_merges as the reference, on random vocabularies."""
    import random

    from transformers.tokenization_utils_base import generate_merges

    from handformer.tokenizers.gguf_vocab import sentencepiece_merges

    rng = random.Random(0)
    for _ in range(20):
        pieces = list(dict.fromkeys("".join(rng.choice("abc▁") for _ in range(rng.randint(1, 5)))
                                    for _ in range(60)))
        scores = [float(rng.randint(-4, 0)) for _ in pieces]  # many ties
        ids = {p: i for i, p in enumerate(pieces)}
        want = generate_merges(ids, dict(zip(pieces, scores, strict=True)))
        assert sentencepiece_merges(pieces, ids, scores) == want
