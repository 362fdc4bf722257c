"""Attention sinks (StreamingLLM): the kind against a dense masked reference, its rolling cache
against recomputing the whole sequence."""

from __future__ import annotations

import math

import pytest
import torch

import handformer as hf
from handformer.attention import LocalAttention, SinkAttention, local_attention, sink_attention
from handformer.attention.cache import cache_for
from handformer.attention.sinks import SinkWindowKVCache, sink_mask


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, sinks: int,
              causal: bool, keep: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax attention with the pattern written as loops."""
    L_q, L_k = q.shape[-2], k.shape[-2]
    allowed = torch.zeros(L_q, L_k, dtype=torch.bool)
    for i in range(L_q):
        p = i + L_k - L_q
        for j in range(L_k):
            ok = abs(p - j) <= window // 2 or j < sinks
            allowed[i, j] = ok and (j <= p or not causal)
    if keep is not None:
        allowed = allowed & keep
    scores = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(~allowed, 0.0)
    return weights @ v.double(), weights


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("L_q,L_k,window,sinks", [(12, 12, 5, 2), (4, 15, 3, 4),
                                                  (9, 9, 1, 1), (7, 7, 15, 3)])
def test_matches_a_dense_masked_reference(causal: bool, L_q: int, L_k: int, window: int,
                                          sinks: int) -> None:
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, L_q, 8), torch.randn(2, 3, L_k, 8), torch.randn(2, 3, L_k, 6)
    out, weights = sink_attention(q, k, v, window_size=window, sink_tokens=sinks,
                                  causal=causal, need_weights=True)
    ref_out, ref_w = reference(q, k, v, window, sinks, causal)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights.double(), ref_w, atol=1e-6, rtol=1e-5)
    fused, none = SinkAttention(window, sink_tokens=sinks)(q, k, v, causal=causal)
    assert none is None
    torch.testing.assert_close(fused, out, atol=1e-5, rtol=1e-5)


def test_a_key_mask_restricts_it_and_zero_sinks_is_local_attention() -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4), torch.randn(2, 2, 10, 4)
    keep = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    keep[0, ..., :3] = False  # left padding of the first sequence
    out, _ = sink_attention(q, k, v, keep, window_size=5, sink_tokens=2, causal=True)
    ref, _ = reference(q, k, v, 5, 2, True, keep[:, :, 0, :][:, :, None, :].expand(2, 1, 10, 10))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert out[0, :, :3].abs().max() == 0  # padded queries see no key: zeros, no NaN
    plain, _ = local_attention(q, k, v, window_size=5, causal=True)
    none, _ = sink_attention(q, k, v, window_size=5, sink_tokens=0, causal=True)
    torch.testing.assert_close(none, plain, atol=1e-6, rtol=1e-5)
    # the sinks matter: with them the output differs from the plain window
    assert (sink_attention(q, k, v, window_size=5, sink_tokens=2, causal=True)[0]
            - plain).abs().max() > 1e-3


def sink_lm(window: int, sinks: int) -> hf.CausalLM:
    torch.manual_seed(2)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=40, max_len=64, d_model=16, num_heads=2,
                                          num_layers=2, d_ff=32, positional="rotary"))
    for layer in model.blocks:
        layer.attn.attention = SinkAttention(window, sink_tokens=sinks)
    return model.eval()


@pytest.mark.parametrize("prefill", [1, 3, 9])
def test_cached_decoding_equals_recomputing_and_the_cache_stays_bounded(prefill: int) -> None:
    model = sink_lm(window=7, sinks=3)
    ids = torch.randint(0, 40, (2, 30))
    mask = torch.ones(2, 30, dtype=torch.long)
    mask[1, :2] = 0  # left padding
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = model.new_cache()
        assert isinstance(cache.layers[0], SinkWindowKVCache)
        steps = [model(ids[:, :prefill], attention_mask=mask[:, :prefill], cache=cache).logits]
        for i in range(prefill, 30):
            steps.append(model(ids[:, i:i + 1], attention_mask=mask[:, i:i + 1],
                               cache=cache).logits)
            assert cache.layers[0].num_keys <= 3 + 7 // 2
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    # a plain rolling window (no sinks) gives other numbers past the window
    plain = sink_lm(window=7, sinks=0)
    with torch.no_grad():
        assert (plain(ids, attention_mask=mask).logits[:, 10:] - full[:, 10:]).abs().max() > 1e-3


def test_generate_with_sinks_matches_no_cache() -> None:
    model = sink_lm(window=5, sinks=2)
    prompt = torch.randint(0, 40, (1, 6))
    with torch.no_grad():
        cached = model.generate(prompt, max_new_tokens=12)
        plain = model.generate(prompt, max_new_tokens=12, use_cache=False)
    assert torch.equal(cached, plain)


def test_pattern_and_cache_kind() -> None:
    kind = SinkAttention(5, sink_tokens=2)
    assert torch.equal(kind.pattern(6, 6, causal=True), sink_mask(6, 6, 5, 2, causal=True))
    assert isinstance(cache_for(kind), SinkWindowKVCache)
    assert not isinstance(cache_for(LocalAttention(5)), SinkWindowKVCache)
    assert "sink_tokens=2" in repr(kind)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="window_size must be odd"):
        SinkAttention(4)
    with pytest.raises(ValueError, match="sink_tokens must be a non-negative integer"):
        SinkAttention(5, sink_tokens=-1)
    with pytest.raises(ValueError, match="no static \\(fixed-shape\\) cache"):
        cache_for(SinkAttention(5), capacity=8, static=True)
    with pytest.raises(ValueError, match="does not apply dropout"):
        SinkAttention(5)(torch.randn(1, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4),
                         dropout_p=0.1)


def test_grouped_query_attention_and_softcap_in_the_kind_and_the_cache() -> None:
    """Keys/values with fewer heads: the kind equals repeating them; decoding with the cache
    through a GQA MultiHeadAttention equals recomputing; the soft-cap is applied in both."""
    from handformer.attention.functional import repeat_kv

    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    kind = SinkAttention(5, sink_tokens=2, softcap=2.0)
    grouped, _ = kind(q, k, v, causal=True, enable_gqa=True)
    repeated, _ = kind(q, repeat_kv(k, 2), repeat_kv(v, 2), causal=True)
    torch.testing.assert_close(grouped, repeated)
    uncapped, _ = SinkAttention(5, sink_tokens=2)(q, repeat_kv(k, 2), repeat_kv(v, 2),
                                                  causal=True)
    assert (uncapped - grouped).abs().max() > 1e-3

    attn = hf.MultiHeadAttention(16, 4, num_kv_heads=2, attention=kind).eval()
    x = torch.randn(2, 12, 16)
    with torch.no_grad():
        full, _ = attn(x, causal=True)
        cache = kind.new_cache()
        parts = [attn(x[:, :4], causal=True, cache=cache)[0]]
        parts += [attn(x[:, i:i + 1], causal=True, cache=cache)[0] for i in range(4, 12)]
    assert cache._k.shape[1] == 2  # the cache holds the KV heads, not the query heads
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
