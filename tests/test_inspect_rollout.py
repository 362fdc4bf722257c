"""Attention rollout against a direct float64 implementation of the paper's formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import handformer as hf
from handformer.inspect import attention_rollout, residual_attention
from handformer.pretrained import load_bert
from pretrained_util import tiny_checkpoint


def random_attentions(N: int, B: int, H: int, L: int, *, dtype: torch.dtype = torch.float64
                      ) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(B, H, L, L, dtype=dtype).softmax(dim=-1) for _ in range(N))


def paper_rollout(attentions: tuple[torch.Tensor, ...], fusion: str = "mean",
                  layers: list[int] | None = None) -> np.ndarray:
    """Abnar & Zuidema 2020, written out with numpy loops, batch element by element:
    A = fuse(heads); Â = 0.5 A + 0.5 I; rows renormalised; R_l = Â_l R_{l-1}."""
    x = [a.numpy().astype(np.float64) for a in attentions]
    layers = list(range(len(x))) if layers is None else layers
    B, _, L, _ = x[0].shape
    out = np.zeros((B, L, L))
    for b in range(B):
        R = np.eye(L)
        for i in layers:
            heads = x[i][b]
            A = {"mean": heads.mean(axis=0), "max": heads.max(axis=0),
                 "min": heads.min(axis=0)}[fusion]
            Ahat = 0.5 * A + 0.5 * np.eye(L)
            Ahat = Ahat / Ahat.sum(axis=1, keepdims=True)
            R = Ahat @ R
        out[b] = R
    return out


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
def test_rollout_equals_paper_formula(fusion: str) -> None:
    att = random_attentions(4, 2, 3, 6)
    got = attention_rollout(att, head_fusion=fusion)
    assert got.dtype == torch.float64 and got.shape == (2, 6, 6)
    np.testing.assert_allclose(got.numpy(), paper_rollout(att, fusion), rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.sum(-1).numpy(), 1.0, atol=1e-12)  # rows stay stochastic


def test_rollout_layer_selection_and_float32() -> None:
    att = random_attentions(5, 1, 2, 4)
    got = attention_rollout(att, layers=[1, 3, 4])
    np.testing.assert_allclose(got.numpy(), paper_rollout(att, layers=[1, 3, 4]), atol=1e-12)
    upto = attention_rollout(att, layers=range(2))
    np.testing.assert_allclose(upto.numpy(), paper_rollout(att[:2]), atol=1e-12)
    single = tuple(a.float() for a in att)
    f32 = attention_rollout(single)
    assert f32.dtype == torch.float32
    np.testing.assert_allclose(f32.numpy(), paper_rollout(att), atol=1e-6)


def test_identity_attention_rolls_out_to_identity() -> None:
    L = 7
    eye = torch.eye(L).expand(2, 4, L, L)  # every head of every layer attends to itself
    got = attention_rollout([eye] * 6)
    torch.testing.assert_close(got, torch.eye(L).expand(2, L, L), rtol=0, atol=0)


def test_residual_weight() -> None:
    att = random_attentions(3, 1, 2, 5)
    # residual=0: the plain product of the head-mean attentions, A_3 A_2 A_1.
    plain = attention_rollout(att, residual=0.0)
    means = [a[0].mean(0) for a in att]
    torch.testing.assert_close(plain[0], means[2] @ means[1] @ means[0])
    # residual=1: only the skip connections, the identity.
    torch.testing.assert_close(attention_rollout(att, residual=1.0)[0], torch.eye(5,
                               dtype=torch.float64))
    mats = residual_attention(att, residual=0.25)
    torch.testing.assert_close(mats[1, 0], 0.75 * means[1] + 0.25 * torch.eye(5,
                               dtype=torch.float64))


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    folder = tmp_path_factory.mktemp("bert")
    tiny_checkpoint(folder, hidden_size=16, layers=3, heads=2, intermediate=24)
    return load_bert(folder)


def test_padding_mask_gives_the_unpadded_rollout(tiny_bert: tuple[object, object]) -> None:
    model, tokenizer = tiny_bert
    texts = ["a b c d e f", "b a"]
    enc = tokenizer.encode_batch(texts)
    batch = tokenizer.pad(enc)
    with torch.inference_mode():
        padded = model(**batch, need_weights=True)
    got = attention_rollout(padded, attention_mask=batch["attention_mask"])
    for b, e in enumerate(enc):
        n = len(e.ids)
        with torch.inference_mode():
            alone = model(**tokenizer.pad([e]), need_weights=True).attentions
        torch.testing.assert_close(got[b, :n, :n], attention_rollout(alone)[0], atol=1e-5,
                                   rtol=1e-5)
        if n < got.shape[1]:
            assert torch.all(got[b, :n, n:] == 0)  # real rows give padding nothing
            torch.testing.assert_close(got[b, n:, n:], torch.eye(got.shape[1] - n))


def test_causal_lm_rollout_is_lower_triangular() -> None:
    lm = hf.CausalLM(hf.CausalLMConfig(vocab_size=23, max_len=16, d_model=8, num_heads=2,
                                       num_layers=3, d_ff=16)).eval()
    with torch.inference_mode():
        out = lm(torch.randint(0, 23, (2, 9)), need_weights=True)
    R = attention_rollout(out.attentions)
    assert torch.all(R.triu(diagonal=1) == 0)
    torch.testing.assert_close(R.sum(-1), torch.ones(2, 9))
    np.testing.assert_allclose(R.numpy(), paper_rollout(tuple(a.double() for a in
                                                               out.attentions)), atol=1e-6)


def test_rollout_bad_input() -> None:
    att = random_attentions(3, 1, 2, 4)
    with pytest.raises(ValueError, match=r"layer 3 is out of range: the model has 3 layers, "
                                         r"valid layers are 0\.\.2"):
        attention_rollout(att, layers=[0, 3])
    with pytest.raises(ValueError, match="layers must be increasing"):
        attention_rollout(att, layers=[2, 1])
    with pytest.raises(ValueError, match="head_fusion must be one of"):
        attention_rollout(att, head_fusion="sum")
    with pytest.raises(ValueError, match=r"residual must be a number in \[0, 1\]"):
        attention_rollout(att, residual=1.5)
    with pytest.raises(TypeError, match="need_weights=True"):
        attention_rollout(None)
    with pytest.raises(ValueError, match="square self-attention"):
        attention_rollout([torch.rand(1, 2, 3, 5)])
    with pytest.raises(ValueError, match=r"attentions\[1\] has shape \(1, 2, 5, 5\)"):
        attention_rollout([torch.rand(1, 2, 4, 4), torch.rand(1, 2, 5, 5)])
    with pytest.raises(ValueError, match=r"attention_mask must be \(B, L\) = \(1, 4\)"):
        attention_rollout(att, attention_mask=torch.ones(1, 5))
