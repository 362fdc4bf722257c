"""QK attribution and factored OV/QK on tiny float64 models: the source pairs sum to the head's
score as the real model computes it (RoPE, QK-norm and GQA included); the factored views give
the real head's scores and outputs."""

from __future__ import annotations

import pytest
import torch

from graph_util import GPT2, LLAMA, tiny
from handformer.attention.functional import soft_cap
from handformer.features.qk import FactoredMatrix, head_ov, head_qk, qk_attribution
from handformer.inspect import run_with_cache


@pytest.mark.parametrize("kind", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_pairs_sum_to_the_real_score(kind: dict) -> None:
    model, tcs, ids = tiny(kind)
    layer, head, q, k = 2, 3, 5, 2
    qk = qk_attribution(model, tcs, ids, layer=layer, head=head, query_pos=q, key_pos=k)
    _, cache = run_with_cache(model, ids[None], names=f"blocks.{layer}.attn.hook_attn_scores")
    real = cache[f"blocks.{layer}.attn.hook_attn_scores"][0, head, q, k]  # after soft-cap
    cap = kind.get("attn_softcap")
    summed = qk.pairs.sum()
    assert float(soft_cap(summed, cap)) == pytest.approx(float(real), abs=1e-10)
    assert float(summed) == pytest.approx(qk.score, abs=1e-10)
    assert qk.pairs.shape == (len(qk.labels), len(qk.labels))
    assert (qk.pairs[:-1, :-1].abs() > 1e-6).sum() > 50  # many source pairs take part
    assert len(qk.top(3)) == 3
    with pytest.raises(ValueError, match="key_pos"):
        qk_attribution(model, tcs, ids, layer=1, head=0, query_pos=1, key_pos=2)


def test_factored_qk_at_an_offset_and_ov_give_the_real_head() -> None:
    kind = dict(LLAMA, qk_norm=False, sandwich_norm=False)
    model, _, ids = tiny(kind)
    layer, head, q, k = 1, 2, 5, 1
    names = [f"blocks.{layer}.hook_resid_pre", f"blocks.{layer}.attn.hook_attn_scores",
             f"blocks.{layer}.attn.hook_pattern", f"blocks.{layer}.attn.hook_result"]
    _, cache = run_with_cache(model, ids[None], names=names)
    h = model.blocks[layer].ln1(cache[names[0]])[0]  # (L, E) the attention's input
    QK = head_qk(model, layer, head, offset=k - q)
    score = h[q] @ QK.AB @ h[k] / 4 ** 0.5  # head_dim 4: scale 1/2
    assert float(soft_cap(score, 20.0)) == pytest.approx(float(cache[names[1]][0, head, q, k]),
                                                         abs=1e-10)
    wrong = head_qk(model, layer, head, offset=0)  # RoPE matters: another offset, another score
    assert abs(float(h[q] @ wrong.AB @ h[k] / 2 - score)) > 1e-4
    OV = head_ov(model, layer, head)
    out = cache[names[2]][0, head, q] @ (h @ OV.AB)  # (E,) pattern-weighted OV (no biases)
    assert torch.allclose(out, cache[names[3]][0, q, head], atol=1e-10)
    U, S, V = OV.svd()
    assert torch.allclose(U @ torch.diag(S) @ V.T, OV.AB, atol=1e-10)
    full = torch.linalg.eigvals(OV.AB)
    top = full[full.abs().argsort(descending=True)[:4]]
    assert torch.allclose(OV.eigenvalues.abs().sort().values, top.abs().sort().values,
                          atol=1e-8)
    with pytest.raises(ValueError, match="offset"):
        head_qk(model, layer, head)
    with pytest.raises(ValueError, match="inner|A \\(m, r\\)"):
        FactoredMatrix(torch.zeros(3, 2), torch.zeros(3, 3))
