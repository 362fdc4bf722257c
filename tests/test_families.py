"""Modern decoder families loaded with ``load_lm`` against transformers (test-only reference).

For each family (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3) a tiny random checkpoint is
written here by transformers itself: fewer KV heads than query heads, every norm and bias
moved off its default, windows shorter than the input, a mix of sliding and full layers,
and (for some) a ``config.json`` in the older spelling (``rope_theta`` / ``rope_scaling``, no
``layer_types``). Then:

* logits within 1e-4 of transformers' eager attention in float32; in bfloat16, within a few
  bfloat16 roundings (2^-8) of transformers' bfloat16 and on average about as far from the
  float32 logits as transformers' bfloat16 (within 1.25x);
* in float64 within 1e-10 of a reference whose RMSNorm, RoPE angles and softmax are patched
  (here, with ``monkeypatch``) to stay in float64 -- transformers casts all three to float32
  even for float64 inputs;
* every layer's ``hook_pattern`` within 1e-5 of ``output_attentions``;
* greedy generation of 24 tokens identical; cached decoding equal to recomputing; a
  left-padded row equal to the same prompt alone;
* mutations: switching one feature off in handformer's config (QK-norm, Gemma's ``1 +``, the
  soft-caps, the window, the embedding scale, the local RoPE base, the sandwich norms) makes
  the float32 comparison fail -- so the tests above do check each of them.
"""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from handformer import CausalLM  # noqa: E402
from handformer.inspect import run_with_cache  # noqa: E402
from handformer.pretrained import load_lm  # noqa: E402

V = 101  # vocabulary
L = 20  # test input length: longer than every window below
TOL32, TOL64, TOL_PATTERN = 1e-4, 1e-10, 1e-5


def _common(**extra: object) -> dict:
    return {**dict(vocab_size=V, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                   initializer_range=0.15, rms_norm_eps=1e-5, bos_token_id=None,
                   eos_token_id=None, pad_token_id=None), **extra}


# name -> (transformers config class, its arguments, edits to config.json after saving)
CASES: dict[str, tuple[str, dict, dict]] = {
    "llama": ("LlamaConfig", _common(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 2.0,
                         "original_max_position_embeddings": 16}),
        # the older spelling: rope_theta + rope_scaling
        {"rope_parameters": None, "rope_theta": 5000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 2.0, "original_max_position_embeddings": 16}}),
    "mistral": ("MistralConfig", _common(sliding_window=6, tie_word_embeddings=True,
                                          head_dim=16), {}),
    "qwen2": ("Qwen2Config", _common(use_sliding_window=True, sliding_window=7,
                                      max_window_layers=1, tie_word_embeddings=False), {}),
    "qwen3": ("Qwen3Config", _common(
        head_dim=16, use_sliding_window=True, sliding_window=5, tie_word_embeddings=True,
        layer_types=["full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "linear", "rope_theta": 20000.0, "factor": 2.0}), {}),
    "gemma2": ("Gemma2Config", _common(
        head_dim=16, query_pre_attn_scalar=24, sliding_window=5,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0, num_hidden_layers=4),
        {"layer_types": None}),  # Gemma 2's alternation, as older files have it
    "gemma3": ("Gemma3TextConfig", _common(
        head_dim=16, query_pre_attn_scalar=20, sliding_window=4, num_hidden_layers=5),
        # older spelling: sliding_window_pattern, rope_theta, rope_local_base_freq, rope_scaling
        {"layer_types": None, "_sliding_window_pattern": None, "sliding_window_pattern": 3,
         "rope_parameters": None, "rope_theta": 400000.0, "rope_local_base_freq": 3000.0,
         "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
}


def _perturb(model: torch.nn.Module, seed: int) -> None:
    """Move every norm weight and bias away from its default (ones / zeros)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))


def _write(name: str, folder: Path) -> Path:
    cls, kwargs, edits = CASES[name]
    config = getattr(transformers, cls)(**kwargs)
    torch.manual_seed(zlib.crc32(name.encode()) % 1000)  # not hash(): salted per process
    model = transformers.AutoModelForCausalLM.from_config(config)
    _perturb(model, len(name))
    model.save_pretrained(folder)
    path = folder / "config.json"
    data = json.loads(path.read_text())
    for key, value in edits.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return folder


def _reference(folder: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    name = request.param
    folder = _write(name, tmp_path_factory.mktemp(name))
    ids = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(1))
    ref = _reference(folder)
    with torch.no_grad():
        out = ref(ids, output_attentions=True)
    model, _ = load_lm(folder, tokenizer=False)
    return {"name": name, "folder": folder, "ids": ids, "ref": ref, "model": model,
            "logits": out.logits, "attentions": out.attentions}


def _logits(model: CausalLM, ids: torch.Tensor, **kwargs: object) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kwargs).logits


def test_config_features(case: dict) -> None:
    """The loaded config carries each family's features (read from the file, not the name)."""
    c = case["model"].config
    name = case["name"]
    assert c.num_kv_heads == 2 and c.num_heads == 4 and c.norm == "rms" and c.mlp == "gated"
    assert c.qk_norm == (name in ("qwen3", "gemma3"))
    assert c.sandwich_norm == name.startswith("gemma")
    assert c.norm_offset == (1.0 if name.startswith("gemma") else 0.0)
    expected_types = {
        "llama": None, "mistral": ["local"] * 3, "qwen2": ["full", "local", "local"],
        "qwen3": ["full", "local", "full"], "gemma2": ["local", "full"] * 2,
        "gemma3": ["local", "local", "full", "local", "local"]}[name]
    assert c.layer_types == expected_types
    window = {"mistral": 6, "qwen2": 7, "qwen3": 5, "gemma2": 5, "gemma3": 4}.get(name)
    assert c.window_size == (None if window is None else 2 * window - 1)
    assert window is None or window < L  # the input outruns every window
    if name == "gemma2":
        assert (c.attn_softcap, c.final_softcap) == (2.0, 3.0)
        assert c.attn_scale == pytest.approx(24 ** -0.5)
    if name == "gemma3":
        assert (c.rotary_base, c.rotary_local_base) == (400000.0, 3000.0)
        assert c.rotary_scaling == {"rope_type": "linear", "factor": 2.0}
    if name == "llama":
        assert c.qkv_bias and c.out_bias and c.mlp_bias and not c.tie_weights
        assert c.rotary_scaling["rope_type"] == "llama3"
    if name == "qwen2":
        assert c.qkv_bias and not c.out_bias


def test_logits_float32(case: dict) -> None:
    ours = _logits(case["model"], case["ids"])
    torch.testing.assert_close(ours, case["logits"], atol=TOL32, rtol=0)


def test_hook_pattern_equals_output_attentions(case: dict) -> None:
    with torch.no_grad():
        _, cache = run_with_cache(case["model"], case["ids"], names="blocks.*.attn.hook_pattern")
    theirs = case["attentions"]
    assert len(cache) == len(theirs)
    for i, expected in enumerate(theirs):
        pattern = cache[f"blocks.{i}.attn.hook_pattern"]
        torch.testing.assert_close(pattern, expected, atol=TOL_PATTERN, rtol=0,
                                   msg=lambda m, i=i: f"layer {i}: {m}")


# ---- bfloat16 against transformers in bfloat16 ---------------------------------------------

# bfloat16 keeps 8 significant bits: relative rounding 2^-8 (eps) at most, per operation
EPS_BF16 = 2.0 ** -8
# every logit within this many eps of transformers' bfloat16, relative to the largest logit:
# both sides round each of ~8 steps per layer (weights, products, residual sums, the logits)
# independently; measured up to 14 eps over 9 random checkpoints of each family
TOL_BF16_EPS = 32
# and on average about as close to the float32 result as transformers' own bfloat16 (measured
# 0.80-1.11 of its mean error over 9 random checkpoints of each family: handformer rounds at
# other points, and keeps RoPE and attention scores in float32 too)
TOL_BF16_MEAN = 1.25


def test_logits_bfloat16(case: dict) -> None:
    """In bfloat16, handformer agrees with transformers' bfloat16 (eager attention) to a few
    bfloat16 roundings, and is about as close to the float32 logits as transformers is."""
    ids = case["ids"]
    ref = _reference(case["folder"], torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ref.parameters())
    model, _ = load_lm(case["folder"], dtype=torch.bfloat16, tokenizer=False)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with torch.no_grad():
        theirs = ref(ids).logits.double()
    ours = _logits(model, ids)
    assert ours.dtype == torch.bfloat16
    ours, exact = ours.double(), case["logits"].double()
    scale = exact.abs().max().item()
    gap = (ours - theirs).abs().max().item()
    assert gap <= TOL_BF16_EPS * EPS_BF16 * scale, (gap / (EPS_BF16 * scale), "eps")
    ours_error, their_error = (ours - exact).abs().mean(), (theirs - exact).abs().mean()
    assert ours_error <= TOL_BF16_MEAN * their_error, (ours_error, their_error)
    # bfloat16 is really in use: its error is thousands of times float32's tolerance
    assert their_error > 10 * TOL32


def test_greedy_decoding_bfloat16_matches_recomputing(case: dict) -> None:
    """The decoding step (blocked bfloat16 kernel where the CPU has one) against the modules
    recomputing the whole sequence, in bfloat16: same logits to bfloat16 rounding."""
    model, _ = load_lm(case["folder"], dtype=torch.bfloat16, tokenizer=False)
    prompt = case["ids"][:1, :8]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=12)
        full = model(out[:, :-1]).logits[0, 7:].double()  # (12, V): what chose each token
    scale = full.abs().max().item()
    chosen = full.gather(-1, out[0, 8:, None])[:, 0]  # the generated tokens' logits
    # each generated token is the recompute's argmax, up to a near-tie within rounding
    assert ((full.max(-1).values - chosen) <= 4 * EPS_BF16 * scale).all()


# ---- float64 against a reference kept in float64 -------------------------------------------


def _modeling_modules() -> list[object]:
    import importlib

    return [importlib.import_module(f"transformers.models.{m}.modeling_{m}")
            for m in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")]


def _rms_forward(offset: float):  # noqa: ANN202
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + getattr(
            self, "variance_epsilon", getattr(self, "eps", None)))
        return x * scale * (offset + self.weight)
    return forward


def _rotary_forward(self, x: torch.Tensor, position_ids: torch.Tensor,  # noqa: ANN001
                    layer_type: str | None = None):  # noqa: ANN202
    prefix = "" if layer_type is None else f"{layer_type}_"
    inv_freq = getattr(self, f"{prefix}inv_freq").to(torch.float64)
    scaling = getattr(self, f"{prefix}attention_scaling")
    freqs = position_ids[..., None].to(torch.float64) * inv_freq  # (B, L, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(x.dtype), (emb.sin() * scaling).to(x.dtype)


def _softmax64(original):  # noqa: ANN001, ANN202
    def softmax(x: torch.Tensor, dim: int | None = None, *args: object,
                dtype: torch.dtype | None = None, **kwargs: object) -> torch.Tensor:
        if x.dtype == torch.float64:
            dtype = None
        return original(x, dim, *args, dtype=dtype, **kwargs)
    return softmax


@pytest.fixture
def float64_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' norms, RoPE angles and eager softmax kept in float64 for float64 models.

    The RoPE frequencies stay as the checkpoint defines them (computed in float32 by
    transformers, and by handformer with ``rotary_freq_dtype="float32"``); the angles
    ``position * frequency``, their cos and sin are float64."""
    for module in _modeling_modules():
        for name, cls in vars(module).items():
            if not isinstance(cls, type) or cls.__module__ != module.__name__:
                continue
            if name.endswith("RMSNorm"):
                monkeypatch.setattr(cls, "forward",
                                    _rms_forward(1.0 if name.startswith("Gemma") else 0.0))
            elif name.endswith("RotaryEmbedding"):
                monkeypatch.setattr(cls, "forward", _rotary_forward)
    monkeypatch.setattr(torch.nn.functional, "softmax",
                        _softmax64(torch.nn.functional.softmax))


@pytest.mark.usefixtures("float64_transformers")
def test_logits_float64(case: dict) -> None:
    ref = _reference(case["folder"], torch.float64)
    assert all(p.dtype == torch.float64 for p in ref.parameters())
    ids = case["ids"]
    with torch.no_grad():
        expected = ref(ids).logits
    model, _ = load_lm(case["folder"], dtype=torch.float64, tokenizer=False)
    ours = _logits(model, ids)
    torch.testing.assert_close(ours, expected, atol=TOL64, rtol=0)
    # and the float64 reference is that much closer than float32 arithmetic would be
    assert (case["logits"].double() - expected).abs().max() > 100 * TOL64


def test_unpatched_float64_reference_is_only_float32_exact(case: dict) -> None:
    """Why the reference above is patched: transformers rounds norms, RoPE and softmax to
    float32 even in a float64 model."""
    ref = _reference(case["folder"], torch.float64)
    model, _ = load_lm(case["folder"], dtype=torch.float64, tokenizer=False)
    with torch.no_grad():
        gap = (_logits(model, case["ids"]) - ref(case["ids"]).logits).abs().max().item()
    assert 100 * TOL64 < gap < TOL32


# ---- generation --------------------------------------------------------------------------


def test_greedy_generation_matches(case: dict) -> None:
    prompt = case["ids"][:1, :8]
    with torch.no_grad():
        theirs = case["ref"].generate(prompt, max_new_tokens=24, do_sample=False,
                                      attention_mask=torch.ones_like(prompt))
        ours = case["model"].generate(prompt, max_new_tokens=24)
    assert ours.tolist() == theirs.tolist()
    # and with the cache off (every step recomputes the sequence)
    assert case["model"].generate(prompt, max_new_tokens=24, use_cache=False).tolist() == \
        ours.tolist()


def test_cached_decoding_equals_recomputing(case: dict) -> None:
    model, ids = case["model"], case["ids"]
    full = _logits(model, ids)
    cache = model.new_cache()
    steps = [_logits(model, ids[:, :9], cache=cache)]
    for t in range(9, L):  # past every window: the rolling caches drop keys
        steps.append(_logits(model, ids[:, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_left_padded_row_equals_alone(case: dict) -> None:
    model, ids = case["model"], case["ids"]
    short = ids[1:, :11]
    batch = torch.stack([ids[0, :17], torch.cat([torch.zeros(6, dtype=torch.long), short[0]])])
    mask = torch.ones_like(batch)
    mask[1, :6] = 0
    padded = _logits(model, batch, attention_mask=mask)
    alone = _logits(model, short)
    torch.testing.assert_close(padded[1:, 6:], alone, atol=1e-5, rtol=0)
    with torch.no_grad():
        together = model.generate(batch, attention_mask=mask, max_new_tokens=12)
        single = model.generate(short, max_new_tokens=12)
    assert together[1, 6:].tolist() == single[0].tolist()


# ---- mutations: each feature the tests above rely on ------------------------------------

MUTATIONS = {
    "qwen3": [{"qk_norm": False}, {"layer_types": None, "window_size": None}],
    "gemma3": [{"qk_norm": False}, {"rotary_local_base": None},
               {"layer_types": None, "window_size": None}, {"embed_scale": None}],
    "gemma2": [{"norm_offset": 0.0}, {"attn_softcap": None}, {"final_softcap": None},
               {"sandwich_norm": False}, {"attn_scale": None}],
    "mistral": [{"layer_types": None, "window_size": None}],
    "llama": [{"rotary_scaling": None}, {"mlp_bias": False}],
    "qwen2": [{"layer_types": None, "window_size": None}, {"qkv_bias": False}],
}


def _mutated(model: CausalLM, changes: dict) -> CausalLM:
    """The same weights under a config with ``changes`` (weights a change drops are left
    out)."""
    config = dataclasses.replace(model.config, **changes)
    other = CausalLM(config).eval()
    state = model.state_dict()
    other.load_state_dict({k: v for k, v in state.items() if k in other.state_dict()},
                          strict=False)
    return other


def test_each_feature_is_checked(case: dict) -> None:
    for changes in MUTATIONS[case["name"]]:
        other = _mutated(case["model"], changes)
        gap = (_logits(other, case["ids"]) - case["logits"]).abs().max().item()
        assert gap > 100 * TOL32, (changes, gap)  # test_logits_float32 would fail
