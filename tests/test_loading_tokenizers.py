"""Tokenizers rebuilt from the files a folder has agree with transformers on every layout:

* GPT-2 folders with ``vocab.json`` + ``merges.txt`` and no ``tokenizer.json`` get the
  byte-level BPE tokenizer (checked against transformers' ``GPT2Tokenizer`` and against a
  plain-Python byte-level BPE written here from the algorithm's description); with no
  tokenizer files ``load_gpt2`` says so;
* a BERT folder with only ``vocab.txt`` keeps ``[CLS]``, ``[MASK]``, ... whole, like its
  ``tokenizer.json`` and transformers' ``BertTokenizer`` / ``BertTokenizerFast``.
"""

from __future__ import annotations

import json
import shutil
import warnings
from functools import lru_cache
from pathlib import Path

import pytest
import regex
import torch
import transformers
from tokenizers import ByteLevelBPETokenizer

from handformer.cli import main
from handformer.pretrained import BertTokenizer, TextTokenizer, bundled_model_dir, load_gpt2

EOT = "<|endoftext|>"
CORPUS = ["Hello world, hello there! It's the world's best.", "The cat sat on the mat.",
          "naïve café — 日本語 😀 over the moon", "  spaces   and\ttabs\nnew lines\n\n",
          "numbers 12345 and 3.14, we'll see", "don't stop; they've gone"] * 10
TEXTS = ["Hello world, hello there!", " leading space and trailing  ", "It's 3.14159 isn't it",
         "naïve café — 日本語 😀 unseen Ωmega ⅷ", "tabs\t\tand\n\nlines  ",
         f"one{EOT}two {EOT} three", "  ", "\U0001f600\U0001f600!?"]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vocab.json + merges.txt of a byte-level BPE trained here (no downloads)."""
    folder = tmp_path_factory.mktemp("bpe")
    trainer = ByteLevelBPETokenizer()
    trainer.train_from_iterator(CORPUS, vocab_size=400, min_frequency=1, special_tokens=[EOT])
    trainer.save_model(str(folder))
    return folder


# ---- an independent byte-level BPE (GPT-2's published algorithm, in plain Python) ----------

# contractions, letters, digits, other symbols (each with one leading space), then whitespace
SPLIT = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
                      r"|\s+(?!\S)|\s+")


@lru_cache(maxsize=1)
def byte_chars() -> dict[int, str]:
    """Each byte -> a printable character: printable Latin-1 bytes stand for themselves, the
    others are shifted to code points from 256 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def reference_encode(text: str, folder: Path) -> list[int]:
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    lines = (folder / "merges.txt").read_text(encoding="utf-8").splitlines()
    ranks = {tuple(line.split()): i for i, line in enumerate(
        line for line in lines if line and not line.startswith("#version"))}
    ids: list[int] = []
    for k, chunk in enumerate(text.split(EOT)):
        if k:
            ids.append(vocab[EOT])
        for piece in SPLIT.findall(chunk):
            word = [byte_chars()[b] for b in piece.encode("utf-8")]
            while len(word) > 1:  # merge the best-ranked adjacent pair, left to right
                pairs = [(ranks.get((a, b), 1 << 60), i)
                         for i, (a, b) in enumerate(zip(word, word[1:], strict=False))]
                rank, _ = min(pairs)
                if rank == 1 << 60:
                    break
                pair = min(p for p in pairs if p[0] == rank)
                merged, i = [], 0
                target = (word[pair[1]], word[pair[1] + 1])
                while i < len(word):
                    if i + 1 < len(word) and (word[i], word[i + 1]) == target:
                        merged.append(word[i] + word[i + 1])
                        i += 2
                    else:
                        merged.append(word[i])
                        i += 1
                word = merged
            ids.extend(vocab[w] for w in word)
    return ids


def test_byte_level_bpe_matches_transformers_and_the_reference(bpe_dir: Path) -> None:
    ours = TextTokenizer.from_dir(bpe_dir)
    assert ours is not None
    theirs = transformers.GPT2Tokenizer.from_pretrained(bpe_dir)
    vocab = json.loads((bpe_dir / "vocab.json").read_text(encoding="utf-8"))
    assert len(ours) == len(vocab) and ours.eos_token_id == vocab[EOT] == theirs.eos_token_id
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text) == reference_encode(text, bpe_dir), text
        assert ours.decode(ids) == text == theirs.decode(ids)
    assert ours.encode(f"a{EOT}b").count(vocab[EOT]) == 1  # kept whole, never split
    assert len(ours.encode(CORPUS[0])) < len(CORPUS[0]) // 2  # merges were applied


def test_load_gpt2_uses_vocab_and_merges(bpe_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    vocab_size = len(json.loads((bpe_dir / "vocab.json").read_text(encoding="utf-8")))
    config = transformers.GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=16,
                                     n_layer=1, n_head=2, eos_token_id=0, bos_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path, safe_serialization=True)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(bpe_dir / name, tmp_path / name)
    model, tokenizer = load_gpt2(tmp_path)
    assert isinstance(tokenizer, TextTokenizer)
    assert tokenizer.encode("Hello world") == reference_encode("Hello world", bpe_dir)
    ids = torch.tensor([tokenizer.encode("The cat sat")])
    out = model.generate(ids, max_new_tokens=5)
    # the generate command takes the same folder (before: "not a character vocabulary")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "The cat sat",
                 "--max-new-tokens", "5"]) == 0
    new = [i for i in out[0, ids.shape[1]:].tolist() if i != 0]
    assert capsys.readouterr().out == "The cat sat" + tokenizer.decode(new) + "\n"

    # without merges.txt no tokenizer can be made, and load_gpt2 says so (and why)
    (tmp_path / "merges.txt").unlink()
    with pytest.warns(UserWarning, match="vocab.json is there but merges.txt is missing"):
        _, none = load_gpt2(tmp_path)
    assert none is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_gpt2(tmp_path, tokenizer=False)[1] is None  # asked for no tokenizer


def test_unreadable_bpe_files_are_an_error(bpe_dir: Path, tmp_path: Path) -> None:
    shutil.copy(bpe_dir / "merges.txt", tmp_path / "merges.txt")
    (tmp_path / "vocab.json").write_text("[1, 2", encoding="utf-8")
    with pytest.raises(ValueError, match="vocab.json \\+ merges.txt are not a readable BPE"):
        TextTokenizer.from_dir(tmp_path)


# ---- BERT: vocab.txt alone keeps the special tokens -------------------------------------------

SPECIAL_TEXTS = ["[CLS] [MASK] the cat [SEP]", "a[MASK]b", "[mask] stays text", "[PAD][UNK]hello",
                 "[CLS]", "Where is the [MASK]? On the mat.", "[SEP][SEP] x [MASK]."]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The bundled folder's tokenizer files in both layouts."""
    root = tmp_path_factory.mktemp("layouts")
    out = {}
    for layout, drop in (("tokenizer.json", "vocab.txt"), ("vocab.txt", "tokenizer.json")):
        folder = root / layout
        folder.mkdir()
        for name in ("tokenizer.json", "vocab.txt", "tokenizer_config.json",
                     "special_tokens_map.json", "config.json"):
            if name != drop:
                shutil.copy(bundled_model_dir() / name, folder / name)
        out[layout] = folder
    return out


@pytest.mark.parametrize("layout", ["tokenizer.json", "vocab.txt"])
def test_special_tokens_agree_with_transformers_on_both_layouts(layouts: dict[str, Path],
                                                                layout: str) -> None:
    ours = BertTokenizer.from_dir(layouts[layout])
    references = [transformers.BertTokenizerFast.from_pretrained(layouts[layout])]
    if layout == "vocab.txt":
        references.append(transformers.BertTokenizer.from_pretrained(layouts[layout]))
    for text in SPECIAL_TEXTS:
        got = ours.encode_batch([text])[0].ids
        for ref in references:
            assert got == ref(text)["input_ids"], (text, type(ref).__name__)
    assert ours.tokens("[CLS] [MASK]") == ["[CLS]", "[CLS]", "[MASK]", "[SEP]"]


def test_both_layouts_give_the_same_ids(layouts: dict[str, Path]) -> None:
    a = BertTokenizer.from_dir(layouts["tokenizer.json"])
    b = BertTokenizer.from_dir(layouts["vocab.txt"])
    texts = [*SPECIAL_TEXTS, "Ünïcödé ÀCCENTS stripped", "中文字符 mixed", "pair one"]
    for x, y in zip(a(texts, texts[::-1]).values(), b(texts, texts[::-1]).values(), strict=True):
        assert torch.equal(x, y)
