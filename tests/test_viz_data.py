"""handformer.viz.data: input forms, validation, quantisation and per-layer summaries."""

import base64
import re
import zlib

import numpy as np
import pytest
import torch

from handformer import Encoder, EncoderLayer
from handformer.masks import window_mask
from handformer.viz import as_attention_array, summarize
from handformer.viz.data import (
    as_attention_layers,
    as_pattern,
    check_tokens,
    encode_weights,
    quantize_weights,
)


def _encoder_out(L=7, layers=3, heads=4, B=1):
    enc = Encoder(EncoderLayer(32, heads, 64, dropout=0.0), layers).eval()
    with torch.no_grad():
        return enc(torch.randn(B, L, 32) * 3, need_weights=True)


def test_accepts_model_output_sequence_layer_and_head():
    out = _encoder_out()
    ref = torch.stack([a[0] for a in out.attentions]).numpy()  # (N, H, L, L)
    np.testing.assert_array_equal(as_attention_array(out), ref)
    np.testing.assert_array_equal(as_attention_array(out.attentions), ref)
    np.testing.assert_array_equal(as_attention_array(list(ref)), ref)  # (H, L, L) per layer
    np.testing.assert_array_equal(as_attention_array(out.attentions[1]), ref[1:2])  # (B,H,L,L)
    np.testing.assert_array_equal(as_attention_array(out.attentions[1][0]), ref[1:2])
    np.testing.assert_array_equal(as_attention_array(ref[2, 3]), ref[2:3, 3:4])  # (L, L)
    assert as_attention_array(ref[0, 0]).dtype == np.float32


def test_batch_index_selects_the_element():
    out = _encoder_out(B=3)
    got = as_attention_array(out.attentions, batch_index=2)
    np.testing.assert_array_equal(got[1], out.attentions[1][2].numpy())
    with pytest.raises(ValueError, match="batch_index=3 is out of range.*batch size 3"):
        as_attention_array(out.attentions, batch_index=3)


@pytest.mark.parametrize("bad, exc, match", [
    ("weights", TypeError, "must be a tensor"),
    ([], ValueError, "empty sequence"),
    (torch.zeros(2, 2, 2, 2, 2), ValueError, r"got shape \(2, 2, 2, 2, 2\)"),
    ([torch.zeros(1, 2, 3, 3), torch.zeros(1, 2, 4, 4)], ValueError, "all layers must match"),
    ([[0.5, 0.5]], TypeError, r"attentions\[0\] must be a torch.Tensor"),
    (torch.tensor([[float("nan"), 1.0]]), ValueError, "NaN"),
])
def test_rejects_bad_attention(bad, exc, match):
    with pytest.raises(exc, match=match):
        as_attention_array(bad)


def test_output_without_attentions_says_need_weights():
    class Out:
        attentions = None

    with pytest.raises(ValueError, match="need_weights=True"):
        as_attention_array(Out())


def test_check_tokens():
    assert check_tokens(("a", "b"), 2) == ["a", "b"]
    with pytest.raises(TypeError, match="sequence of strings"):
        check_tokens("ab", 2)
    with pytest.raises(TypeError, match="must hold strings, found int"):
        check_tokens(["a", 1], 2)
    with pytest.raises(ValueError, match="tokens has 3 entries but the attention has 2"):
        check_tokens(["a", "b", "c"], 2)


def test_pattern_from_kind_tensor_and_errors():
    class Kind:  # anything with .pattern(L_q, L_k), like handformer's attention kinds
        def pattern(self, L_q, L_k):
            return window_mask(L_q, L_k, 3)

    ref = window_mask(6, 6, 3).numpy()
    np.testing.assert_array_equal(as_pattern(Kind(), 6, 6), ref)
    np.testing.assert_array_equal(as_pattern(window_mask(6, 6, 3), 6, 6), ref)
    assert as_pattern(None, 6, 6) is None
    np.testing.assert_array_equal(as_pattern(np.ones(6, dtype=bool), 2, 6), np.ones((2, 6), bool))
    with pytest.raises(TypeError, match="boolean"):
        as_pattern(torch.ones(6, 6), 6, 6)
    with pytest.raises(ValueError, match=r"does not broadcast to \(L_q, L_k\) = \(6, 6\)"):
        as_pattern(torch.ones(5, 6, dtype=torch.bool), 6, 6)


def _decode(enc, shape):
    raw = base64.b64decode(enc["data"])
    if enc["encoding"] == "deflate":
        raw = zlib.decompress(raw)
    q = np.frombuffer(raw, dtype=np.uint8).reshape(shape).astype(np.float64)
    scale = np.asarray(enc["scale"], dtype=np.float64).reshape(shape[0], shape[1], 2)
    lo, hi = scale[..., 0, None, None], scale[..., 1, None, None]
    return lo + q / enc["levels"] * (hi - lo), (hi - lo) / (2 * enc["levels"])


@pytest.mark.parametrize("L, encoding", [(9, "raw"), (300, "deflate")])
def test_encode_weights_round_trip_within_half_a_step(L, encoding):
    x = torch.softmax(torch.randn(2, 3, L, L, dtype=torch.float64) * 4, -1).numpy()
    enc = encode_weights(x.astype(np.float32))
    assert enc["encoding"] == encoding and enc["levels"] == 255
    back, tol = _decode(enc, x.shape)
    assert np.all(np.abs(back - x) <= tol + 1e-6)


def test_encode_weights_negative_values_and_constant_head():
    x = np.zeros((1, 2, 4, 4), dtype=np.float32)
    x[0, 0] = np.linspace(-1, 2, 16).reshape(4, 4)
    enc = encode_weights(x)
    assert enc["scale"][0] == [-1.0, 2.0] and enc["scale"][1] == [0.0, 0.0]
    back, tol = _decode(enc, x.shape)
    assert np.all(np.abs(back - x) <= tol + 1e-6)


def test_encode_weights_uses_fewer_levels_to_fit_the_budget():
    x = np.random.default_rng(0).random((1, 1, 700, 700), dtype=np.float32)  # incompressible
    big = encode_weights(x)
    small = encode_weights(x, max_bytes=len(big["data"]) // 2)
    assert big["levels"] == 255 and small["levels"] in (63, 15)
    assert len(small["data"]) < len(big["data"])
    back, tol = _decode(small, x.shape)
    assert np.all(np.abs(back - x) <= tol + 1e-6)


def test_summarize_matches_a_direct_computation():
    out = _encoder_out(L=6, layers=2, heads=4)
    tokens = ["[CLS]", "a", "b", "c", "d", "[SEP]"]
    got = summarize(out, tokens)
    for n, s in enumerate(got):
        a = out.attentions[n][0].double()  # (H, L, L)
        received = a.sum(dim=(0, 1))
        assert s.top_key == int(received.argmax())
        assert s.top_key_share == pytest.approx(float(received.max() / received.sum()))
        best = max(((h, i, j) for h in range(4) for i in range(1, 5) for j in range(1, 5)
                    if i != j), key=lambda t: float(a[t]))
        assert s.link[:3] == best and s.link[3] == pytest.approx(float(a[best]), abs=1e-6)
        assert s.describe(tokens).startswith(f"layer {n}: most attention to {tokens[s.top_key]}")


def test_summarize_words_and_min_distance():
    x = np.zeros((1, 1, 4, 4), dtype=np.float32)
    x[0, 0, 1, 2] = 0.9  # same word (pieces of one word)
    x[0, 0, 0, 1] = 0.6  # neighbouring words
    x[0, 0, 3, 0] = 0.3  # far apart
    words = [0, 1, 1, 2]
    sink = {"include_sink": True}  # these links touch the first position
    assert summarize(x, list("abcd"), **sink)[0].link[:3] == (0, 1, 2)
    assert summarize(x, list("abcd"), words=words, **sink)[0].link[:3] == (0, 0, 1)
    s = summarize(x, list("abcd"), words=words, min_distance=2, **sink)[0]
    assert s.link == (0, 3, 0, pytest.approx(0.3))
    assert "strongest link d -> a 0.30 (head 0)" in s.describe(list("abcd"))
    assert summarize(x, list("abcd"), special=[True, False, False, True],
                     **sink)[0].link[:3] == (0, 1, 2)
    # by default the first position is an attention sink: no link to or from it
    assert summarize(x, list("abcd"), words=words)[0].link is None
    with pytest.raises(ValueError, match="include_sink must be True or False"):
        summarize(x, list("abcd"), include_sink=1)
    with pytest.raises(ValueError, match="min_distance must be an int >= 1"):
        summarize(x, list("abcd"), min_distance=0)
    with pytest.raises(ValueError, match="self-attention"):
        summarize(np.zeros((2, 3)), ["a", "b"])


def test_other_handformer_models():
    from handformer.models.causal_lm import CausalLM
    from handformer.models.causal_lm_config import CausalLMConfig
    from handformer.models.decoder import DecoderOutput
    from handformer.viz import plot_heads, render_html

    config = CausalLMConfig(vocab_size=50, max_len=32, d_model=32, num_heads=4, num_layers=2,
                            d_ff=64, attention="local", window_size=3)
    lm = CausalLM(config).eval()
    with torch.no_grad():
        out = lm(torch.randint(0, 50, (1, 9)), need_weights=True)
    x = as_attention_array(out)  # (2, 4, 9, 9), causal and local: zero outside the band
    assert x.shape == (2, 4, 9, 9)
    allowed = window_mask(9, 9, 3, causal=True).numpy()
    assert np.all(x[..., ~allowed] == 0)
    assert plot_heads(out, [str(i) for i in range(9)]).axes
    assert "hf-data" in render_html(out, [str(i) for i in range(9)])

    dec = DecoderOutput(torch.zeros(1, 3, 8), self_attentions=(torch.rand(1, 2, 3, 3),),
                        cross_attentions=(torch.rand(1, 2, 3, 5),))
    with pytest.raises(TypeError, match="pass one of its fields: cross_attentions, "
                                        "self_attentions"):
        as_attention_array(dec)
    assert as_attention_array(dec.cross_attentions).shape == (1, 2, 3, 5)


def _plain_codes(x: np.ndarray, levels: int) -> np.ndarray:
    """Reference: whole-array float32 passes, per head ``rint((x - lo) * (levels / span))``."""
    lo = np.minimum(x.min(axis=(2, 3), keepdims=True), np.float32(0))
    hi = x.max(axis=(2, 3), keepdims=True)
    span = np.where(hi > lo, hi - lo, np.float32(1))
    return np.rint((x - lo) * (np.float32(levels) / span)).astype(np.uint8)


@pytest.mark.parametrize("shape", [(2, 3, 9, 9), (1, 40, 7, 5), (2, 2, 600, 600)])
@pytest.mark.parametrize("levels", [255, 63, 15])
def test_quantize_weights_blocks_give_the_plain_codes(shape, levels):
    # (2, 2, 600, 600): a head of 360 000 values is split into blocks; (1, 40, 7, 5): many
    # small heads share a block
    rng = np.random.default_rng(sum(shape) + levels)
    x = (rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 50.0], size=shape[:2] + (1, 1))
         ).astype(np.float32)
    x[0, 0] = 0.25  # a constant head
    codes, lo, hi = quantize_weights(x, levels)
    assert codes.dtype == np.uint8 and codes.shape == shape
    assert np.array_equal(codes, _plain_codes(x, levels))
    assert np.array_equal(lo, np.minimum(x.min(axis=(2, 3)), 0)) and np.array_equal(
        hi, x.max(axis=(2, 3)))
    layers = [x[n].copy() for n in range(shape[0])]  # per-layer input: the same codes
    assert np.array_equal(quantize_weights(layers, levels)[0], codes)


@pytest.mark.parametrize("bad, words", [
    (np.zeros((2, 3, 4), np.float32), "float32 (N, H, L_q, L_k)"),
    (np.zeros((1, 1, 4, 4), np.float64), "float32"),
    ([np.zeros((2, 4, 4), np.float32), np.zeros((2, 4, 5), np.float32)], "one shape"),
    (np.zeros((1, 1, 0, 4), np.float32), "not empty"),
])
def test_quantize_weights_refuses_bad_input(bad, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        quantize_weights(bad)
    with pytest.raises(ValueError, match="levels must be an int in 1..255, got 256"):
        quantize_weights(np.zeros((1, 1, 2, 2), np.float32), 256)


def test_binary_encoding_holds_the_codes_as_bytes():
    x = torch.softmax(torch.randn(2, 3, 300, 300) * 4, -1).numpy()
    text, raw = encode_weights(x, compress=False), encode_weights(x, binary=True)
    assert isinstance(raw["data"], memoryview) and raw["data"].readonly
    assert raw["encoding"] == "raw" and raw["levels"] == 255 and raw["scale"] == text["scale"]
    assert bytes(raw["data"]) == base64.b64decode(text["data"])
    assert bytes(raw["data"]) == _plain_codes(x, 255).tobytes()


def test_attention_layers_are_not_stacked_and_are_checked():
    weights = [torch.softmax(torch.randn(1, 2, 5, 5), -1) for _ in range(3)]
    layers = as_attention_layers(weights)
    assert len(layers) == 3 and all(y.shape == (2, 5, 5) for y in layers)
    assert all(np.shares_memory(y, w.numpy()) for y, w in zip(layers, weights, strict=True))
    assert np.array_equal(as_attention_array(weights), np.stack(layers))
    weights[2][0, 1, 3, 3] = float("nan")
    with pytest.raises(ValueError, match=r"attentions holds NaN or infinite values \(layer 2\)"):
        as_attention_layers(weights)
    with pytest.raises(ValueError, match="attentions is empty"):
        as_attention_layers([torch.zeros(2, 0, 5)])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_viewer_data_refuses_nan_and_infinities(bad):
    from handformer.viz.html import viewer_payload

    weights = [torch.softmax(torch.randn(1, 2, 4, 4), -1) for _ in range(2)]
    weights[1][0, 0, 2, 1] = bad  # checked once, by the quantiser
    with pytest.raises(ValueError, match=r"attentions holds NaN or infinite values \(layer 1\)"):
        viewer_payload(weights, list("abcd"))
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_weights(torch.stack(weights)[:, 0].numpy())
