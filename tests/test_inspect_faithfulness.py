"""Faithfulness table: Spearman against hand computations, ablation against a plain loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from handformer.inspect import attention_flow, attention_rollout
from handformer.inspect.faithfulness import METHODS, faithfulness, rank_average, spearman
from handformer.pretrained import load_bert
from pretrained_util import tiny_checkpoint


def test_rank_average_by_hand() -> None:
    # sorted: 5 (rank 1), 10 (rank 2), 20, 20 (ranks 3 and 4 -> 3.5 each)
    np.testing.assert_array_equal(rank_average([10, 20, 20, 5]), [2, 3.5, 3.5, 1])
    np.testing.assert_array_equal(rank_average(torch.tensor([1.0, 1.0, 1.0])), [2, 2, 2])


def test_spearman_by_hand() -> None:
    # x ranks 1..5; y = [5, 6, 7, 8, 7] ranks [1, 2, 3.5, 5, 3.5] (the two 7s tie).
    # dx = [-2, -1, 0, 1, 2], dy = [-2, -1, .5, 2, .5] (both means are 3):
    # sum dx dy = 4 + 1 + 0 + 2 + 1 = 8, sum dx² = 10, sum dy² = 9.5, rho = 8 / sqrt(95).
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(8 / math.sqrt(95),
                                                                        abs=1e-15)
    x = np.random.default_rng(0).normal(size=20)
    assert spearman(x, np.exp(x)) == pytest.approx(1.0)  # any increasing map keeps the ranks
    assert spearman(x, -x ** 3) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 2, 3], [4, 4, 4]))  # a constant has no ranking
    try:  # scipy is optional; when it is there, it must agree
        from scipy.stats import spearmanr
    except ImportError:
        spearmanr = None
    if spearmanr is not None:
        y = np.round(np.random.default_rng(1).normal(size=20), 1)  # ties included
        assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)
    with pytest.raises(ValueError, match="same length >= 2"):
        spearman([1, 2], [1, 2, 3])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    folder = tmp_path_factory.mktemp("bert")
    tiny_checkpoint(folder, hidden_size=16, layers=3, heads=2, intermediate=24)
    return load_bert(folder)


def embedding(model: object, ids: list[int]) -> torch.Tensor:
    """Mean-pooled last hidden state of one unpadded input (the tiny model's pooling)."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).last_hidden_state[0].mean(0).double()


@pytest.mark.parametrize("ablation", ["remove", "mask"])
def test_faithfulness_scores_and_table(tiny: tuple[object, object], ablation: str) -> None:
    model, tokenizer = tiny
    text = "the cat sat on the red mat"
    result = faithfulness(model, tokenizer, text, ablation=ablation)
    enc = tokenizer.encode_batch([text])[0]
    L = len(enc.ids)
    assert result.tokens == enc.tokens and result.methods == METHODS
    assert result.scores.shape == (4, L) and result.positions == list(range(1, L - 1))
    with torch.inference_mode():
        att = model(torch.tensor([enc.ids]), need_weights=True).attentions
    torch.testing.assert_close(result.scores[0], att[-1][0].mean(0)[0].double())
    torch.testing.assert_close(result.scores[1], attention_rollout(att)[0, 0].double())
    torch.testing.assert_close(result.scores[2], attention_flow(att)[0, 0].double())
    full = embedding(model, enc.ids)
    mask_id = enc.ids[0] if ablation == "remove" else 4  # [MASK]: SPECIALS[4]
    for j in range(L):  # one model call per ablated input, no batching, no padding
        ids = enc.ids[:j] + enc.ids[j + 1:] if ablation == "remove" else \
            enc.ids[:j] + [mask_id] + enc.ids[j + 1:]
        expected = 1 - F.cosine_similarity(embedding(model, ids), full, dim=0)
        assert result.scores[3, j].item() == pytest.approx(expected.item(), abs=1e-6)
    picked = result.scores[:, result.positions]
    assert result.correlation[0, 3].item() == pytest.approx(spearman(picked[0], picked[3]))
    torch.testing.assert_close(result.correlation.diagonal(), torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(result.correlation, result.correlation.T)
    table = result.to_markdown(scores=True)
    assert table.splitlines()[0] == "| Spearman | raw attention | rollout | flow | ablation |"
    assert f"| ablation | {result.correlation[3, 0]:.2f} |" in table and "| `[CLS]` |" in table


def test_faithfulness_mean_row(tiny: tuple[object, object]) -> None:
    model, tokenizer = tiny
    result = faithfulness(model, tokenizer, "a big dog ran fast", row="mean",
                          include_special=True)
    enc = tokenizer.encode_batch(["a big dog ran fast"])[0]
    with torch.inference_mode():
        att = model(torch.tensor([enc.ids]), need_weights=True).attentions
    torch.testing.assert_close(result.scores[1], attention_rollout(att)[0].mean(0).double())
    torch.testing.assert_close(result.scores[2],
                               attention_flow(att, rows="all")[0].mean(0).double())
    assert result.positions == list(range(len(enc.ids)))


def test_faithfulness_bad_input(tiny: tuple[object, object]) -> None:
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="row must be one of"):
        faithfulness(model, tokenizer, "the cat", row="first")
    with pytest.raises(ValueError, match="ablation must be one of"):
        faithfulness(model, tokenizer, "the cat", ablation="zero")
    with pytest.raises(ValueError, match="needs at least 2"):
        faithfulness(model, tokenizer, "cat")
    with pytest.raises(ValueError, match="over the limit max_tokens=4"):
        faithfulness(model, tokenizer, "the cat sat on the mat", flow_max_tokens=4)
