"""Incremental decoding: feeding tokens through a cache equals recomputing the whole sequence,
for every attention kind, with left padding; caches stay within their memory bounds."""

from __future__ import annotations

import pytest
import torch

import handformer as hf
from handformer.attention.cache import (
    KVCache,
    LinearStateCache,
    StaticKVCache,
    WindowKVCache,
    cache_for,
)

V, T = 29, 17  # vocabulary, sequence length
KINDS = {
    "full": dict(attention="full"),
    "local1": dict(attention="local", window_size=1),
    "local3": dict(attention="local", window_size=3),
    "local7": dict(attention="local", window_size=7),
    "strided": dict(attention="strided", stride=3),
    "linear": dict(attention="linear"),
    "rotary": dict(attention="full", positional="rotary"),
    "sinusoidal-local": dict(attention="local", window_size=5, positional="sinusoidal"),
}


def make(**overrides: object) -> hf.CausalLM:
    base = dict(vocab_size=V, max_len=40, d_model=16, num_heads=2, num_layers=2, d_ff=32)
    config = hf.CausalLMConfig(**{**base, **overrides})
    return hf.CausalLM(config).eval()


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (3, T))
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :9] = 0
    return ids, mask


def decode(model: hf.CausalLM, ids: torch.Tensor, mask: torch.Tensor | None,
           chunks: list[int], **cache_options: object
           ) -> tuple[torch.Tensor, hf.attention.cache.DecodingCache]:
    """Feed ``ids`` in pieces of the given sizes (then one token at a time) through a cache."""
    cache = model.new_cache(**cache_options)
    logits, start = [], 0
    sizes = chunks + [1] * (ids.shape[1] - sum(chunks))
    for n in sizes:
        piece_mask = None if mask is None else mask[:, start:start + n]
        logits.append(model(ids[:, start:start + n], attention_mask=piece_mask,
                            cache=cache).logits)
        start += n
    return torch.cat(logits, dim=1), cache


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("chunks", [[], [6], [5, 3]], ids=["steps", "prefill6", "chunks"])
def test_incremental_equals_full_recomputation(kind: str, chunks: list[int]) -> None:
    model = make(**KINDS[kind])
    ids, mask = left_padded_batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        stepped, cache = decode(model, ids, mask, chunks)
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=1e-5)
    assert cache.seen == T
    assert cache.next_positions.tolist() == mask.sum(1).tolist()


@pytest.mark.parametrize("kind", ["full", "strided", "rotary", "linear", "local3"])
@pytest.mark.parametrize("options", [dict(capacity=T), dict(capacity=T + 5, static=True)],
                         ids=["preallocated", "static"])
@pytest.mark.parametrize("chunks", [[], [5, 3]], ids=["steps", "chunks"])
def test_preallocated_and_static_caches_equal_full_recomputation(
        kind: str, options: dict, chunks: list[int]) -> None:
    model = make(**KINDS[kind])
    ids, mask = left_padded_batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        stepped, cache = decode(model, ids, mask, chunks, **options)
    torch.testing.assert_close(stepped, full, atol=1e-5, rtol=1e-5)
    static = options.get("static", False) and KINDS[kind]["attention"] == "full"
    assert isinstance(cache.layers[0], StaticKVCache) == static
    assert all(c.seen == T for c in cache.layers)


def test_a_preallocated_cache_is_written_in_place_and_grows_past_its_capacity() -> None:
    model = make()
    cache = model.new_cache(capacity=12)
    ids = torch.randint(0, V, (2, 14))
    with torch.no_grad():
        model(ids[:, :4], cache=cache)
        layer = cache.layers[0]
        storage = layer._k.data_ptr()
        assert layer.nbytes() == 2 * (2 * 2 * 12 * 8) * 4  # k and v, (B, H, 12, D) float32
        for i in range(4, 12):
            model(ids[:, i:i + 1], cache=cache)
            assert layer._k.data_ptr() == storage  # no reallocation up to the capacity
        model(ids[:, 12:], cache=cache)  # past it: grows, as an unsized cache does
    assert layer.num_keys == 14 and layer._k.data_ptr() != storage


def test_static_cache_refuses_more_than_its_capacity_and_sizes_are_checked() -> None:
    model = make()
    cache = model.new_cache(capacity=6, static=True)
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match="the static cache holds 6 tokens: 4 cached \\+ 3 "
                                             "new do not fit"):
            model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"capacity must be an integer in \[1, max_len=40\], "
                                         "got 41"):
        model.new_cache(capacity=41)
    with pytest.raises(ValueError, match="static=True needs a capacity"):
        model.new_cache(static=True)
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        KVCache(0)


@pytest.mark.parametrize("kind", ["full", "local3", "linear"])
def test_incremental_without_padding(kind: str) -> None:
    model = make(**KINDS[kind])
    ids = torch.randint(0, V, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(decode(model, ids, None, [])[0], model(ids).logits,
                                   atol=1e-5, rtol=1e-5)


def test_cache_kinds_are_chosen_per_attention() -> None:
    assert isinstance(make().new_cache().layers[0], KVCache)
    assert isinstance(make(**KINDS["strided"]).new_cache().layers[0], KVCache)
    local = make(**KINDS["local7"]).new_cache().layers[1]
    assert isinstance(local, WindowKVCache) and local.keep_last == 3
    assert isinstance(make(**KINDS["linear"]).new_cache().layers[0], LinearStateCache)
    with pytest.raises(TypeError, match="attention kind"):
        cache_for("full")


@pytest.mark.parametrize("window", [1, 3, 7])
def test_local_cache_is_a_bounded_rolling_window(window: int) -> None:
    model = make(attention="local", window_size=window)
    cache = model.new_cache()
    ids = torch.randint(0, V, (2, 30))
    sizes = []
    with torch.no_grad():
        model(ids[:, :12], cache=cache)  # a prompt longer than the window
        for i in range(12, 30):
            assert all(c.num_keys <= window for c in cache.layers)
            model(ids[:, i:i + 1], cache=cache)
            sizes.append(cache.nbytes())
    assert all(c.num_keys == window // 2 for c in cache.layers)
    assert len(set(sizes[1:])) == 1  # memory does not grow with the length


def test_full_cache_grows_and_linear_state_is_constant() -> None:
    ids = torch.randint(0, V, (2, 30))
    full, linear = make(), make(attention="linear")
    caches = full.new_cache(), linear.new_cache()
    with torch.no_grad():
        for model, cache in zip((full, linear), caches, strict=True):
            model(ids[:, :5], cache=cache)
    linear_bytes = caches[1].nbytes()
    state = caches[1].layers[0]
    assert state.S.shape == (2, 2, 8, 8) and state.z.shape == (2, 2, 8)
    with torch.no_grad():
        for i in range(5, 30):
            full(ids[:, i:i + 1], cache=caches[0])
            linear(ids[:, i:i + 1], cache=caches[1])
            assert caches[1].nbytes() == linear_bytes
    assert caches[0].layers[0].num_keys == 30
    assert caches[1].layers[0].num_keys == 0


def test_cached_attention_weights_match_the_last_rows() -> None:
    model = make()
    ids, mask = left_padded_batch()
    with torch.no_grad():
        full = model(ids, attention_mask=mask, need_weights=True).attentions
        cache = model.new_cache()
        model(ids[:, :-1], attention_mask=mask[:, :-1], cache=cache)
        last = model(ids[:, -1:], attention_mask=mask[:, -1:], cache=cache,
                     need_weights=True).attentions
    for f, step in zip(full, last, strict=True):
        torch.testing.assert_close(step, f[:, :, -1:, :], atol=1e-6, rtol=1e-5)
        assert f[2, :, -1, :9].abs().max() == 0  # left padding is never attended


def test_cache_errors() -> None:
    mha = hf.MultiHeadAttention(16, 2)
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="needs causal=True"):
        mha(x, cache=KVCache())
    with pytest.raises(TypeError, match="boolean key mask"):
        mha(x, causal=True, cache=KVCache(), mask=torch.zeros(2, 1, 1, 3))
    with pytest.raises(ValueError, match="does not broadcast"):
        mha(x, causal=True, cache=KVCache(), mask=torch.ones(2, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="window_size must be a positive integer"):
        WindowKVCache(0)
    linear = hf.MultiHeadAttention(16, 2, attention=make(attention="linear").blocks[0]
                                   .attn.attention)
    with pytest.raises(ValueError, match="no per-key weights"):
        linear(x, causal=True, cache=LinearStateCache(), need_weights=True)
    model = make()
    cache = model.new_cache()
    model(torch.zeros(2, 3, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="the cache holds a batch of 2, input_ids has 1"):
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match="new_cache"):
        model(torch.zeros(2, 1, dtype=torch.long), cache=make(num_layers=1).new_cache())
    with pytest.raises(ValueError, match=r"41 tokens \(3 cached \+ 38 new\) exceed"):
        model(torch.zeros(2, 38, dtype=torch.long), cache=cache)


def test_gradients_flow_through_a_cache() -> None:
    model = make()
    ids = torch.randint(0, V, (2, 8))
    cache = model.new_cache()
    a = model(ids[:, :5], cache=cache).logits
    b = model(ids[:, 5:], cache=cache).logits
    torch.cat([a, b], 1).square().sum().backward()
    cached_grad = model.tok_emb.weight.grad.clone()
    model.zero_grad()
    model(ids).logits.square().sum().backward()
    torch.testing.assert_close(cached_grad, model.tok_emb.weight.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [1, 5, 9])
def test_a_window_pushed_one_token_at_a_time_rolls_in_place(window: int) -> None:
    """The plain step's one-token push writes a ring of ``window // 2 + 1`` slots in place;
    each step it hands out the held keys and the new one (rotated once it wraps), which is
    the window of a cat-and-cut reference as a set, row for row; after any number of steps
    a two-token push and the module path (``attend``) see the same window, oldest first, as a
    cache that never used the ring."""
    from handformer.attention.cache_bounded import WindowKVCache
    from handformer.attention.local import LocalAttention

    keep = window // 2
    g = torch.Generator().manual_seed(window)
    kind = LocalAttention(window)
    ring, plain = WindowKVCache(window), WindowKVCache(window)
    prompt_k, prompt_v = torch.randn(2, 3, 6, 4, generator=g), torch.randn(2, 3, 6, 4, generator=g)
    q = torch.randn(2, 3, 6, 4, generator=g)
    for cache in (ring, plain):
        cache.attend(kind, q, prompt_k, prompt_v)
    history_k = [prompt_k[:, :, i] for i in range(6)]
    for step in range(3 * (keep + 1) + 2):  # wraps the ring several times
        k, v = torch.randn(2, 3, 1, 4, generator=g), torch.randn(2, 3, 1, 4, generator=g)
        keys, values, mask = ring.push(k, v)
        history_k.append(k[:, :, 0])
        expected = torch.stack(history_k[-(keep + 1):], dim=2)  # (B, H, keep + 1, D)
        assert mask is None and keys.shape == expected.shape == values.shape
        # the same keys as a set: sort each (batch, head)'s rows by their first feature
        order = keys[..., 0].argsort(dim=-1)[..., None].expand_as(keys)
        ref_order = expected[..., 0].argsort(dim=-1)[..., None].expand_as(expected)
        assert torch.equal(keys.gather(2, order), expected.gather(2, ref_order))
        plain.attend(kind, torch.randn(2, 3, 1, 4, generator=g), k, v)
        assert ring.num_keys == plain.num_keys == min(keep, 6 + step + 1)
        assert ring.seen == plain.seen
    k3, v3 = torch.randn(2, 3, 2, 4, generator=g), torch.randn(2, 3, 2, 4, generator=g)
    pushed, plain_pushed = ring.push(k3, v3), plain.push(k3, v3)  # two tokens: in order
    assert torch.equal(pushed[0], plain_pushed[0]) and torch.equal(pushed[1], plain_pushed[1])
    q2 = torch.randn(2, 3, 3, 4, generator=g)
    k2, v2 = torch.randn(2, 3, 3, 4, generator=g), torch.randn(2, 3, 3, 4, generator=g)
    out_ring, _ = ring.attend(kind, q2, k2, v2)  # back on the module path: in order again
    out_plain, _ = plain.attend(kind, q2, k2, v2)
    assert torch.equal(out_ring, out_plain)
    assert ring.nbytes() == plain.nbytes()  # the ring is gone: the window alone
