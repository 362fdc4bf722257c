"""Tokenizers for the Chinese-text tests, built in the test (no downloads): a byte-level BPE
that splits Chinese characters over tokens, a SentencePiece-style BPE with byte fallback, and
reference labels from the tokenizers library's offsets."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from handformer.tokenizers.labels import visible

ZH = "动物没有过马路，因为它太累了"
EOS = "<|endoftext|>"  # id 0 of byte_level_bpe()


def byte_level_bpe(vocab_size: int = 270) -> Tokenizer:
    """A GPT-2-style byte-level BPE: 256 byte tokens + a few merges learnt on Chinese."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([ZH * 20, "the animal was tired " * 20], trainer)
    return tok


def byte_fallback_bpe() -> Tokenizer:
    """A SentencePiece-style BPE: a few words, ``<0x00>``..``<0xFF>`` for everything else."""
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "n": 3, "▁a": 4, "物": 5}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("▁", "a")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return tok


def reference_labels(tok: Tokenizer, text: str) -> list[str]:
    """Labels from the tokenizers library's offsets (which characters each token came from):
    a character covered by n tokens is ``c·k/n`` in the k-th; whole characters run together,
    pieces are joined to them with ``+``."""
    enc = tok.encode(text)
    labels = []
    for t, (start, end) in enumerate(enc.offsets):
        parts: list[tuple[str, bool]] = []
        for c in range(start, end):
            owners = [u for u, (s, e) in enumerate(enc.offsets) if s <= c < e]
            if len(owners) == 1:
                if parts and parts[-1][1]:
                    parts[-1] = (parts[-1][0] + visible(text[c]), True)
                else:
                    parts.append((visible(text[c]), True))
            else:
                parts.append((f"{text[c]}·{owners.index(t) + 1}/{len(owners)}", False))
        labels.append("+".join(p for p, _ in parts))
    return labels


