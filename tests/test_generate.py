"""generate(): greedy and sampling, EOS, left padding, caches, reproducibility, bad settings."""

from __future__ import annotations

import math

import pytest
import torch

import handformer as hf
from handformer.models.generation import filter_logits

V = 29


def make(**overrides: object) -> hf.CausalLM:
    base = dict(vocab_size=V, max_len=48, d_model=16, num_heads=2, num_layers=2, d_ff=32)
    model = hf.CausalLM(hf.CausalLMConfig(**{**base, **overrides})).eval()
    with torch.no_grad():  # larger weights: well separated logits, varied greedy outputs
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(10)
    return model


def greedy_reference(model: hf.CausalLM, ids: torch.Tensor, n: int) -> torch.Tensor:
    """Recompute the whole sequence at every step, take the argmax."""
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("kind", [
    dict(), dict(attention="local", window_size=5), dict(attention="strided", stride=3),
    dict(attention="linear"), dict(positional="rotary"), dict(positional="sinusoidal"),
])
def test_greedy_equals_reference_cached_and_uncached(kind: dict) -> None:
    model = make(**kind)
    prompt = torch.randint(0, V, (2, 6))
    expected = greedy_reference(model, prompt, 12)
    assert model.generate(prompt, max_new_tokens=12).tolist() == expected.tolist()
    assert model.generate(prompt, max_new_tokens=12, use_cache=False).tolist() == \
        expected.tolist()
    assert len(set(expected[:, 6:].flatten().tolist())) > 1  # not one repeated token


def test_left_padded_batch_generates_what_each_prompt_generates_alone() -> None:
    model = make()
    a, b = torch.randint(0, V, (1, 8)), torch.randint(0, V, (1, 3))
    batch = torch.cat([a, torch.cat([torch.zeros(1, 5, dtype=torch.long), b], 1)])
    mask = torch.tensor([[1] * 8, [0] * 5 + [1] * 3])
    for use_cache in (True, False):
        out = model.generate(batch, max_new_tokens=12, attention_mask=mask,
                             use_cache=use_cache)
        assert out[0].tolist() == model.generate(a, max_new_tokens=12)[0].tolist()
        assert out[1, 5:].tolist() == model.generate(b, max_new_tokens=12)[0].tolist()


def test_eos_finishes_each_sequence_and_stops_when_all_are_done() -> None:
    model = make()
    prompt = torch.randint(0, V, (2, 4))
    free = model.generate(prompt, max_new_tokens=30)
    eos = int(free[0, 4 + 2])  # what sequence 0 emits as its third new token
    out = model.generate(prompt, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    first0 = (free[0, 4:] == eos).nonzero()[0, 0].item()
    assert out[0, 4:4 + first0 + 1].tolist() == free[0, 4:4 + first0 + 1].tolist()
    assert set(out[0, 4 + first0 + 1:].tolist()) <= {0}  # padded after its EOS
    hits1 = (free[1, 4:] == eos).nonzero()
    if len(hits1):  # both finish: generation stops at the later EOS
        assert out.shape[1] == 4 + max(first0, hits1[0, 0].item()) + 1
    else:
        assert out.shape[1] == 4 + 30 and out[1, 4:].tolist() == free[1, 4:].tolist()
    everyone = model.generate(prompt[:1], max_new_tokens=30, eos_token_id=eos)
    assert everyone.shape[1] == 4 + first0 + 1  # stops right after the EOS


def test_sampling_is_reproducible_and_respects_top_k() -> None:
    model = make()
    prompt = torch.randint(0, V, (3, 5))

    def sample(seed: int, **kw: object) -> torch.Tensor:
        return model.generate(prompt, max_new_tokens=12, do_sample=True,
                              generator=torch.Generator().manual_seed(seed), **kw)

    first = sample(1, temperature=1.5).tolist()
    assert sample(1, temperature=1.5).tolist() == first
    assert sample(2, temperature=1.5).tolist() != first
    cached, uncached = sample(3, top_k=5), sample(3, top_k=5, use_cache=False)
    assert cached.tolist() == uncached.tolist()
    with torch.no_grad():  # every sampled token is among the 3 most likely at its step
        out = sample(4, top_k=3, temperature=3.0)
        logits = model(out[:, :-1]).logits[:, 4:]  # predictions for the new tokens
    top3 = logits.topk(3, dim=-1).indices
    assert bool((top3 == out[:, 5:, None]).any(-1).all())
    greedy = model.generate(prompt, max_new_tokens=12)
    assert sample(5, top_k=1).tolist() == greedy.tolist()
    assert sample(6, top_p=1e-6).tolist() == greedy.tolist()


def test_filter_logits_top_k_and_top_p() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()
    kept = lambda out: torch.isfinite(out).squeeze(0).nonzero().flatten().tolist()  # noqa: E731
    assert kept(filter_logits(logits, top_k=2)) == [1, 3]
    assert kept(filter_logits(logits, top_p=0.79)) == [1, 3]  # 0.5 + 0.3 reaches 0.79
    assert kept(filter_logits(logits, top_p=0.81)) == [1, 2, 3]
    assert kept(filter_logits(logits, top_p=0.4)) == [1]
    assert kept(filter_logits(logits, top_p=1.0)) == [0, 1, 2, 3]
    assert kept(filter_logits(logits, top_k=3, top_p=0.6)) == [1, 3]
    renormalised = torch.softmax(filter_logits(logits, top_k=2), -1)
    assert math.isclose(float(renormalised[0, 1]), 0.5 / 0.8, rel_tol=1e-6)


def test_streamer_mode_and_zero_tokens() -> None:
    model = make().train()
    prompt = torch.randint(0, V, (2, 3))
    seen: list[torch.Tensor] = []
    out = model.generate(prompt, max_new_tokens=7, streamer=seen.append)
    assert model.training  # mode restored
    assert torch.equal(torch.stack(seen, 1), out[:, 3:])
    assert torch.equal(model.generate(prompt, max_new_tokens=0), prompt)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(max_new_tokens=-1), ValueError, "max_new_tokens must be an integer >= 0, got -1"),
    (dict(do_sample=True, temperature=0.0), ValueError, "temperature must be > 0 when sampling"),
    (dict(do_sample=True, temperature=-1), ValueError, "temperature must be > 0"),
    (dict(top_p=0.0), ValueError, r"top_p must be in \(0, 1\], got 0.0"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\], got 1.5"),
    (dict(top_k=0), ValueError, "top_k must be an integer >= 1"),
    (dict(eos_token_id=V), ValueError, r"eos_token_id must be a token id in \[0, 29\)"),
    (dict(generator=3), TypeError, "generator must be a torch.Generator"),
    (dict(max_new_tokens=44), ValueError, r"prompt \(5 tokens\) \+ max_new_tokens \(44\) = 49 "
                                          r"exceeds the context max_len=48; ask for at most 43"),
    (dict(compile=1), ValueError, "compile must be True or False, got 1"),
    (dict(compile=True, use_cache=False), ValueError, "compile=True compiles the cached "
                                                      "decoding step: it needs use_cache=True"),
])
def test_invalid_settings(kwargs: dict, error: type, message: str) -> None:
    settings = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(error, match=message):
        make().generate(torch.zeros(1, 5, dtype=torch.long), **settings)


def test_prompt_longer_than_context() -> None:
    with pytest.raises(ValueError, match="the prompt has 49 tokens, longer than the context "
                                         "max_len=48"):
        make().generate(torch.zeros(1, 49, dtype=torch.long), max_new_tokens=1)


def test_compile_refuses_kinds_without_fixed_shape_caches() -> None:
    for kind in (dict(attention="local", window_size=3), dict(attention="strided", stride=2)):
        with pytest.raises(ValueError, match="compile=True supports attention='full' and "
                                             "'linear'"):
            make(**kind).generate(torch.zeros(1, 5, dtype=torch.long), max_new_tokens=2,
                                  compile=True)


@pytest.mark.parametrize("kind", [dict(), dict(attention="linear"), dict(positional="rotary")])
def test_decode_step_equals_forward_on_the_whole_sequence(kind: dict) -> None:
    """The trusted step generate runs (no per-call checks) computes forward's logits."""
    model = make(**kind)
    ids, mask = torch.randint(0, V, (2, 9)), torch.tensor([[1] * 9, [0] * 3 + [1] * 6])
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits  # (2, 9, V)
        for capacity in (None, 9):
            cache = model.new_cache(capacity=capacity)
            model(ids[:, :5], attention_mask=mask[:, :5], cache=cache)
            steps = [model.decode_step(ids[:, i:i + 1], cache) for i in range(5, 9)]
            torch.testing.assert_close(torch.stack(steps, 1), full[:, 5:], atol=1e-5, rtol=1e-5)
            assert cache.seen == 9 and cache.next_positions.tolist() == [9, 6]


def test_generate_returns_an_ordinary_tensor() -> None:
    """The loop runs under inference_mode; what it returns can still be edited in place."""
    out = make().generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=4)
    assert not out.is_inference()
    out[0, 0] = 1


def test_dropout_is_skipped_when_it_is_the_identity_and_drops_in_training() -> None:
    """The layers' Dropout returns its input at once in eval mode or with p = 0 (no module
    call on the decoding path) and is nn.Dropout otherwise."""
    x = torch.ones(4, 1000)
    drop = hf.layers.Dropout(0.5)
    torch.manual_seed(0)
    out = drop(x)
    torch.manual_seed(0)
    assert torch.equal(out, torch.nn.functional.dropout(x, 0.5, training=True))
    assert 0.3 < float((out == 0).float().mean()) < 0.7
    assert drop.eval()(x) is x and hf.layers.Dropout(0.0)(x) is x
    assert isinstance(make().blocks[0].dropout1, torch.nn.Dropout)
