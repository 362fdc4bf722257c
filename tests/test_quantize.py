"""Int8 inference (``load_lm(..., quantize="int8")``, handformer.models.quantized).

The layer against a float64 reference of the scheme it states (per-row int8 weights, float
activations); loading from a safetensors folder (written here by transformers) and from the
shipped SmolLM2 GGUF; agreement with float32 on English, Chinese and code prompts, reported
as llama.cpp reports its quantizations (top-1 agreement, mean KL, max logit difference);
hook points, the activation cache and generation on the quantized model.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from handformer.inspect import run_with_cache
from handformer.models.int8_model import Int8Embedding, quantize_model
from handformer.models.quantized import RESIDUAL_SCALE, Int8Linear, check_quantize
from handformer.pretrained import load_lm

PROMPTS = {
    "english": "The history of the printing press begins in the fifteenth century, when "
               "Johannes Gutenberg combined movable metal type, oil-based ink and a screw "
               "press. Within fifty years, presses across Europe had produced millions of "
               "books, and ideas travelled faster than ever before.",
    "chinese": "北京是中国的首都，有三千多年的历史。这座城市有许多著名的景点，比如故宫、天坛和"
               "长城。每年都有成千上万的游客来这里参观，品尝北京烤鸭。",
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
            "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\n"
            "for i in range(10):\n    print(i, fibonacci(i))\n",
}


def _outliers(w: torch.Tensor) -> torch.Tensor:
    """The columns kept exactly, by the rule stated in models/int8_weights.py: largest
    magnitude over 3 x the median column's, at most 32."""
    peak = w.double().abs().amax(dim=0)
    picked = [int(j) for j in torch.argsort(peak, descending=True)
              if peak[j] > 3 * peak.median()][:32]
    return torch.tensor(sorted(picked), dtype=torch.long)


def _reference_weight(w: torch.Tensor) -> torch.Tensor:
    """In float64: outlier columns exact; every other entry on its row's int8 grid,
    ``s_r = max|W_r| / 127`` over the other columns, ``round(W / s) * s``."""
    w = w.double()
    cols = _outliers(w)
    rest = w.clone()
    rest[:, cols] = 0
    s = rest.abs().amax(dim=1, keepdim=True) / 127
    out = torch.round(rest / s).clamp(-127, 127) * s
    out[:, cols] = w[:, cols]
    return out


def test_weight_is_the_per_row_int8_grid():
    w = torch.randn(40, 24) * torch.linspace(0.1, 5, 40)[:, None]
    layer = Int8Linear(w)
    assert layer.exact_columns is None  # no column stands out
    torch.testing.assert_close(layer.weight.double(), _reference_weight(w), atol=1e-6,
                               rtol=0)
    assert layer.weight.dtype == torch.float32 and layer.weight.shape == (40, 24)


def test_outlier_columns_are_kept_exactly():
    """Three columns ten times the rest: kept in float32 bit for bit, the others rounded on
    a grid set by the rest of their row (a grid ten times finer than the whole row's)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(50, 64, generator=g)
    w[:, [5, 17, 40]] *= 10
    layer = Int8Linear(w)
    assert layer.exact_columns.tolist() == [5, 17, 40] == _outliers(w).tolist()
    assert torch.equal(layer.weight[:, [5, 17, 40]], w[:, [5, 17, 40]])
    torch.testing.assert_close(layer.weight.double(), _reference_weight(w), atol=1e-6, rtol=0)
    rest = torch.ones(64, dtype=torch.bool)
    rest[[5, 17, 40]] = False
    step = w[:, rest].abs().amax(dim=1) / 127  # the grid of the other columns
    assert float(((layer.weight - w)[:, rest].abs() / step[:, None]).max()) <= 0.5 + 1e-4
    # at most 32 columns, the largest
    wide = torch.randn(8, 256, generator=g).sign()
    wide[:, :40] *= torch.arange(10, 50)  # 40 outliers, ascending: the last 32 stay
    assert Int8Linear(wide).exact_columns.tolist() == list(range(8, 40)) == _outliers(wide).tolist()


def _bound(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """The stated bound: ``|y - x W~^T - b| <= a_m / (255 * 128) * sum_k |W~_nk|`` with
    ``a_m`` the row's largest input magnitude (plus float32 rounding of the sums)."""
    w = layer.weight.double()
    a = x.double().abs().amax(dim=-1, keepdim=True)
    sums = x.double().abs() @ w.abs().T  # what float32 rounding is relative to
    return a / (255 * RESIDUAL_SCALE) * w.abs().sum(dim=1) + 1e-6 * sums + 1e-6


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_product_is_within_the_stated_bound(rows: int):
    """Against float64 products with the dequantized weight, on inputs with an outlier
    channel (an LLM's MLP hidden vector) and of one sign only (after a ReLU: the guard rows
    are what keep such an input's coarse row on the kernel's grid)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 48, generator=g)
    w[:, 7] *= 8  # an outlier column, exact
    layer = Int8Linear(w, torch.randn(96, generator=g))
    for x in (torch.randn(rows, 48, generator=g) * torch.logspace(-3, 0, 48),
              torch.rand(rows, 48, generator=g) + 0.5, -torch.rand(rows, 48, generator=g)):
        x[:, 11] = 300.0 if x[0, 0] > 0 else -300.0
        ref = x.double() @ layer.weight.double().T + layer.bias.double()
        out = layer(x)
        assert out.shape == (rows, 96) and out.dtype == torch.float32
        err = (out.double() - ref).abs()
        assert bool((err <= _bound(layer, x)).all()), float((err / _bound(layer, x)).max())
    zero = torch.zeros(2, 48)
    assert torch.equal(layer(zero), layer.bias.expand(2, 96))  # a zero row: the bias, no NaN


def test_the_step_runs_a_group_with_different_outlier_columns_as_one():
    from handformer.models.quantized import int8_step_linear

    g = torch.Generator().manual_seed(5)
    weights = [torch.randn(n, 32, generator=g) for n in (24, 8, 8)]
    weights[0][:, 3] *= 12
    weights[1][:, [3, 20]] *= 12
    layers = [Int8Linear(w, b) for w, b in zip(weights, (torch.randn(24), None, None),
                                                strict=True)]
    assert [None if m.exact_columns is None else m.exact_columns.tolist() for m in layers] == \
        [[3], [3, 20], None]
    x = torch.randn(1, 32, generator=g) * 4
    together = int8_step_linear(*layers)(x)
    torch.testing.assert_close(together, torch.cat([m(x) for m in layers], dim=-1),
                               atol=1e-5, rtol=1e-5)


def test_a_deep_copy_shares_the_int8_weights():
    import copy

    layer = Int8Linear(torch.randn(6, 5), torch.randn(6))
    twin = copy.deepcopy(layer)
    assert twin._packed is layer._packed and twin.bias is not layer.bias
    x = torch.randn(2, 5)
    torch.testing.assert_close(twin(x), layer(x), atol=0, rtol=0)
    shared = copy.deepcopy(layer, memo={id(layer.bias): layer.bias})  # as serve's variants
    assert shared.bias is layer.bias


def test_options_are_checked():
    assert check_quantize(None) is None and check_quantize("int8") == "int8"
    with pytest.raises(ValueError,
                       match=r"quantize must be None or one of \['int8', 'int4'\], got 'int2'"):
        check_quantize("int2")
    with pytest.raises(ValueError, match="dtype must be float32.*bfloat16"):
        check_quantize("int8", torch.bfloat16)
    with pytest.raises(ValueError, match="CPU only.*cuda"):
        check_quantize("int8", None, "cuda")
    with pytest.raises(TypeError, match="float32 inputs.*float64"):
        Int8Linear(torch.randn(4, 3))(torch.randn(2, 3, dtype=torch.float64))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=False, attention_bias=True, bos_token_id=None, eos_token_id=None)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_safetensors_folder_loads_quantized_with_the_same_names(llama_dir: Path):
    fp, _ = load_lm(llama_dir, tokenizer=False)
    q, _ = load_lm(llama_dir, tokenizer=False, quantize="int8")
    linears = {n for n, m in fp.named_modules() if type(m) is nn.Linear}
    assert linears and linears == {n for n, m in q.named_modules() if type(m) is Int8Linear}
    assert [n for n, _ in q.named_modules()] == [n for n, _ in fp.named_modules()]
    # What stays float: the norms and the biases, nothing of a weight matrix; the embedding
    # is int8 rows, dequantized as they are gathered.
    floats = {n for n, p in q.named_parameters()}
    assert floats == {n for n in dict(fp.named_parameters())
                      if not (n.endswith(".weight") and n[:-7] in linears | {"tok_emb"})}
    assert type(q.tok_emb) is Int8Embedding
    torch.testing.assert_close(q.tok_emb.weight.double(), _reference_weight(fp.tok_emb.weight))
    assert q.blocks[0].attn.q_proj.bias is not None  # loaded after its weight
    torch.testing.assert_close(q.blocks[0].attn.q_proj.bias,
                               fp.blocks[0].attn.q_proj.bias)
    for name in linears:
        torch.testing.assert_close(q.get_submodule(name).weight.double(),
                                   _reference_weight(fp.get_submodule(name).weight))
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref, out = fp(ids).logits, q(ids).logits
    assert float((out - ref).abs().max()) < 0.05 * float(ref.abs().max())
    # The same model, quantized after loading, computes the same logits.
    with torch.inference_mode():
        torch.testing.assert_close(quantize_model(fp)(ids).logits, out)


def test_generate_with_the_cache_matches_the_full_recompute(llama_dir: Path):
    q, _ = load_lm(llama_dir, tokenizer=False, quantize="int8")
    ids = torch.tensor([[3, 14, 15, 9, 26]])
    with torch.inference_mode():
        cached = q.generate(ids, max_new_tokens=6)  # the plain decoding step
        modules = q.generate(ids, max_new_tokens=6, plain_step=False)
        full = q.generate(ids, max_new_tokens=6, use_cache=False)
    assert torch.equal(cached, full) and torch.equal(modules, full)
    # The plain step takes int8 layers (their own products, nothing dequantized) and gives
    # the modules' logits.
    cache = q.new_cache()
    with torch.inference_mode():
        q(ids, cache=cache)
        step = q.plain_decode_step(cache)
        assert step is not None
        logits = step(torch.tensor([7]))
        again = q.new_cache()
        q(ids, cache=again)
        ref = q(torch.tensor([[7]]), cache=again).logits[:, -1]
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def smollm2_int8(smollm2_file):  # noqa: ANN001, ANN201
    model, _ = load_lm(smollm2_file, tokenizer=False, quantize="int8")
    return model


def test_agreement_with_float32_on_three_prompts(smollm2, smollm2_int8):
    """llama.cpp's own quantizations agree with float32 on 89-98 % of top-1 tokens; the goal
    here is >= 95 % over the three prompts, each close behind, the distributions close."""
    model, tok = smollm2
    agree = total = 0
    for name, text in PROMPTS.items():
        ids = torch.tensor([tok.encode(text)])
        with torch.inference_mode():
            ref, out = model(ids).logits[0], smollm2_int8(ids).logits[0]  # (L, V)
        same = int((ref.argmax(-1) == out.argmax(-1)).sum())
        agree, total = agree + same, total + len(ref)
        kl = F.kl_div(out.log_softmax(-1), ref.log_softmax(-1), log_target=True,
                      reduction="none").sum(-1).mean()  # KL(float32 || int8) per token
        assert same / len(ref) >= 0.9, (name, same / len(ref))
        assert float(kl) < 0.02, (name, float(kl))
        assert float((out - ref).abs().max()) < 5.0, name
    assert agree / total >= 0.95, agree / total


def test_hooks_and_cache_see_the_float_activations(smollm2, smollm2_int8):
    model, tok = smollm2
    ids = torch.tensor([tok.encode(PROMPTS["english"])[:24]])
    with torch.inference_mode():
        _, ref = run_with_cache(model, ids)
        out, cache = run_with_cache(smollm2_int8, ids)
    assert list(cache) == list(ref)
    for name in ref:
        assert cache[name].shape == ref[name].shape and cache[name].dtype == ref[name].dtype
    # The patterns are the float model's within quantization noise, rows summing to one.
    torch.testing.assert_close(cache["pattern", 3].sum(-1),
                               torch.ones_like(cache["pattern", 3].sum(-1)))
    assert float((cache["pattern", 3] - ref["pattern", 3]).abs().max()) < 0.1
    # Direct logit attribution reads W_U from the int8 head (dequantized): the final
    # residual through the final norm's weight and W_U gives the model's logits back.
    with torch.no_grad():
        resid = cache.accumulated_resid(apply_ln=True)[-1, 0, -1]  # (E,)
        direct = (resid * smollm2_int8.ln_final.weight) @ smollm2_int8.lm_head.weight.T  # (V,)
    assert float((direct - out.logits[0, -1]).abs().max()) < 0.01


@pytest.fixture(scope="module")
def llama_tok_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a character tokenizer (what the commands and the server need)."""
    import shutil

    tok = pytest.importorskip("tokenizers")
    folder = Path(shutil.copytree(llama_dir, tmp_path_factory.mktemp("tok") / "llama"))
    vocab = {chr(48 + i): i for i in range(61)}  # "0" ... "l", the model's 61 ids
    tokenizer = tok.Tokenizer(tok.models.WordLevel(vocab, unk_token="0"))
    tokenizer.pre_tokenizer = tok.pre_tokenizers.Split("", "isolated")
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_generate_command_takes_quantize(llama_tok_dir: Path,
                                         capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch):
    import handformer.pretrained.lm as lm
    from cli_util import run_cli

    seen = []
    real = lm.load_lm_with_tokenizer  # what the commands and the server load with
    monkeypatch.setattr(lm, "load_lm_with_tokenizer",
                        lambda *a, **k: seen.append(k.get("quantize")) or real(*a, **k))
    folder = llama_tok_dir
    for quantize in ("int8", "int4"):
        code, out, err = run_cli(capsys, ["generate", "--model", str(folder), "--prompt", "abc",
                                          "--max-new-tokens", "3", "--quantize", quantize])
        assert code == 0, err
        assert seen[-1] == quantize and out.strip()
    code, _, err = run_cli(capsys, ["generate", "--model", str(folder), "--prompt", "abc",
                                    "--quantize", "int2"])
    assert code == 2 and "--quantize: invalid choice: 'int2'" in err


def test_serve_state_loads_int8_and_its_variants_share_the_weights(llama_tok_dir: Path):
    from handformer.serve.state import AttentionChoice, ModelState

    state = ModelState(str(llama_tok_dir), quantize="int8")
    local = state.variant(AttentionChoice("local", window_size=3))
    base_q = state.model.blocks[0].attn.q_proj
    assert type(base_q) is Int8Linear
    assert local.blocks[0].attn.q_proj._packed is base_q._packed


def test_a_group_makes_one_product_for_its_members_and_no_stale_one():
    """q/k/v packed together: the first member called with an input computes all three, the
    others take their rows; an input changed in place between them (its version moves) is
    computed again, not served from the first product."""
    from handformer.models.int8_weights import quantize_tensor
    from handformer.models.quantized import Int8Group

    g = torch.Generator().manual_seed(7)
    weights = [torch.randn(n, 16, generator=g) for n in (12, 4, 4)]
    q, k, v = Int8Linear.group([quantize_tensor(w) for w in weights], [None, torch.ones(4),
                                                                        None])
    assert q._group is k._group is v._group and q._packed is v._packed
    calls = []
    real = Int8Group.product
    Int8Group.product = lambda self, x: calls.append(1) or real(self, x)
    try:
        h = torch.randn(2, 3, 16, generator=g)
        outs = [q(h), k(h), v(h)]
        assert len(calls) == 1
        for out, layer in zip(outs, (q, k, v), strict=True):
            ref = h.double() @ layer.weight.double().T
            ref = ref if layer.bias is None else ref + layer.bias.double()
            assert out.shape == (2, 3, layer.out_features) and out.is_contiguous()
            assert bool(((out.double() - ref).abs() <= _bound(layer, h.reshape(-1, 16))
                         .view(2, 3, -1)).all())
        before = q(h)
        h.mul_(2.0)  # changed between q and k: k must not take its rows from q's product
        torch.testing.assert_close(k(h), k(h.clone()), atol=0, rtol=0)
        assert len(calls) == 4  # q; k (a new product); k(h.clone()) (another input)
        assert not torch.equal(before, q(h))
    finally:
        Int8Group.product = real


def test_quantize_model_packs_each_layer_s_projections(llama_dir: Path):
    fp, _ = load_lm(llama_dir, tokenizer=False)
    q = quantize_model(fp)
    attn, ff = q.blocks[0].attn, q.blocks[0].mlp
    assert attn.q_proj._group is attn.k_proj._group is attn.v_proj._group
    assert ff.gate_proj._group is ff.up_proj._group is not ff.down_proj._group
    assert attn.out_proj._group is not attn.q_proj._group


def test_the_kernel_input_is_k_and_the_exact_rest_of_u():
    """The rows handed to the kernel: ``k = round(u)`` within [-127, 127] and ``r = 128 (u -
    k)`` to the bit, for ``u = x / (a / 127.5)`` as float32 computes it (written as ``u`` and
    ``128 u`` by one division and ``r = 128 u - 128 k``: both exact only as the module doc
    says). Rows whose largest entry is negative, positive, tiny, and a row of zeros."""
    from handformer.models.quantized import _Stacked

    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 40, generator=g) * torch.logspace(-4, 1, 40)
    x[0, 3], x[1, 9], x[2] = -50.0, 50.0, x[2] * 1e-20
    x = torch.cat([x, torch.zeros(1, 40)])
    stacked = _Stacked(5, 40)
    a = stacked.fill(x)
    assert torch.equal(a, x.abs().amax(dim=1, keepdim=True).clamp_min(1e-30))
    u = (x / (a / 127.5)).double()  # float32 division, then exact in float64
    k = torch.round(u).clamp(-127, 127)
    assert torch.equal(stacked.rows[:5].double(), k)
    assert torch.equal(stacked.rows[5:].double(), 128 * (u - k))
    assert float(stacked.rows[5:].abs().max()) <= 64 and float(k.abs().max()) == 127


def test_the_step_s_shared_buffers_give_fresh_products():
    """One step's int8 functions share their input buffers (one per batch and input size):
    called in turn with other inputs and batch sizes, each still gives the bits of a product
    made with a buffer of its own."""
    from handformer.models.quantized import int8_step_linear

    g = torch.Generator().manual_seed(13)
    first, second = Int8Linear(torch.randn(24, 32, generator=g)), Int8Linear(
        torch.randn(8, 32, generator=g), torch.randn(8, generator=g))
    scratch: dict = {}
    steps = [int8_step_linear(m, scratch=scratch) for m in (first, second)]
    for rows in (1, 2, 1, 3):
        for layer, step in zip((first, second), steps, strict=True):
            x = torch.randn(rows, 32, generator=g) * 3
            assert torch.equal(step(x), layer(x))
    assert sorted(scratch) == [(1, 32), (2, 32), (3, 32)]


def test_torch_function_modes_still_see_the_kernel():
    """The kernel is called with subclasses' ``__torch_function__`` off (a lookup on its
    packed weight cost 10 us a call), not with torch-function modes off."""
    from torch.overrides import TorchFunctionMode

    seen = []

    class Watch(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    layer = Int8Linear(torch.randn(8, 16))
    with Watch():
        layer(torch.randn(1, 16))
    assert any("quantized." in name for name in seen), seen


def test_a_layer_runs_under_autograd_as_before():
    """Inputs that require grad (a float model's norms feed an int8 layer outside
    ``torch.no_grad``): the kernel's rows are written in place, which autograd refuses for
    tensors in its graph, so they are written from detached inputs; the output is the same."""
    g = torch.Generator().manual_seed(17)
    layer = Int8Linear(torch.randn(8, 16, generator=g), torch.randn(8, generator=g))
    x = torch.randn(3, 16, generator=g, requires_grad=True)
    out = layer(x)
    with torch.inference_mode():
        ref = layer(x.detach())
    assert torch.equal(out.detach(), ref)


@pytest.mark.parametrize("rows", [1, 5])
def test_a_matrix_in_pieces_gives_the_bits_of_one_piece(rows: int, monkeypatch):
    """A matrix packed in several pieces (Gemma 3's LM head: six) gives the bits of the same
    matrix in one piece, each piece's products combined into its own columns."""
    from handformer.models import quantized

    g = torch.Generator().manual_seed(23)
    w, b = torch.randn(70, 32, generator=g), torch.randn(70, generator=g)
    whole = Int8Linear(w, b)
    monkeypatch.setattr(quantized, "_PIECE_BYTES", 32 * 16)  # 16 rows a piece: 5 pieces
    pieces = Int8Linear(w, b)
    assert len(whole._packed) == 1 and len(pieces._packed) == 5
    x = torch.randn(rows, 32, generator=g) * 3
    assert torch.equal(pieces(x), whole(x))
