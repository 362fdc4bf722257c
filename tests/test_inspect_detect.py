"""Head detectors: detection patterns from loops, scores from the cached patterns computed
independently, and a constructed induction / previous-token head."""

from __future__ import annotations

import pytest
import torch

import handformer as hf
from handformer.inspect import (
    detect_heads,
    detection_pattern,
    detection_scores,
    hooks,
    perfect_score,
    run_with_cache,
)

V = 30


def tiny(seed: int = 0) -> hf.CausalLM:
    torch.manual_seed(seed)
    model = hf.CausalLM(hf.CausalLMConfig(vocab_size=V, max_len=64, d_model=16, num_heads=4,
                                          num_layers=2, d_ff=32))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return model.eval()


def loop_pattern(tokens: list[int], kind: str) -> torch.Tensor:
    """The detection pattern written with Python loops (the reference)."""
    L = len(tokens)
    P = torch.zeros(L, L)
    for i in range(L):
        for j in range(L):
            if kind == "previous_token":
                P[i, j] = float(j == i - 1)
            elif kind == "bos":
                P[i, j] = float(j == 0)
            elif kind == "duplicate_token":
                P[i, j] = float(j < i and tokens[j] == tokens[i])
            elif kind == "induction":
                P[i, j] = float(1 <= j <= i and tokens[j - 1] == tokens[i] and j - 1 < i)
    return P


@pytest.mark.parametrize("kind", ["previous_token", "bos", "duplicate_token", "induction"])
def test_detection_patterns_match_loops(kind: str) -> None:
    tokens = [5, 3, 5, 7, 3, 5, 5, 1]
    torch.testing.assert_close(detection_pattern(torch.tensor(tokens), kind),
                               loop_pattern(tokens, kind))


@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True), (True, True)])
def test_scores_match_an_independent_computation(flags: tuple[bool, bool]) -> None:
    exclude_bos, exclude_current = flags
    model = tiny()
    ids = torch.randint(0, V, (3, 10))
    ids[:, 5:] = ids[:, :5]  # repeats, so duplicate and induction targets exist
    scores = detect_heads(model, ids, "induction", exclude_bos=exclude_bos,
                          exclude_current_token=exclude_current)
    _, cache = run_with_cache(model, ids)
    expected = torch.zeros(2, 4, dtype=torch.float64)
    for b in range(3):
        P = loop_pattern(ids[b].tolist(), "induction").double()
        for layer in range(2):
            for h in range(4):
                A = cache["pattern", layer][b, h].double().clone()
                if exclude_bos:
                    A[:, 0] = 0
                if exclude_current:
                    A.fill_diagonal_(0)
                expected[layer, h] += (A * P).sum() / A.sum() / 3
    torch.testing.assert_close(scores, expected)
    assert scores.shape == (2, 4) and scores.dtype == torch.float64


def _ideal(pattern_of: callable) -> callable:
    """A hook that makes head 2 of its layer attend by ``pattern_of(L)`` (rows sum to 1)."""
    def hook(pattern: torch.Tensor, name: str) -> torch.Tensor:
        pattern = pattern.clone()
        pattern[:, 2] = pattern_of(pattern.shape[-1]).to(pattern)
        return pattern
    return hook


def test_a_constructed_induction_head_scores_one_half_or_one_without_bos() -> None:
    """On a random sequence repeated once, a perfect induction head (attention on the target
    where there is one, else on key 0) scores 0.5 by the "mul" score (the first half has no
    target) and 1.0 with exclude_bos."""
    model = tiny(1)
    n = 12
    first = torch.randperm(V - 1)[:n] + 1
    ids = torch.cat([first, first])[None]  # (1, 2n)

    def induction(L: int) -> torch.Tensor:
        P = loop_pattern(ids[0].tolist(), "induction")
        empty = P.sum(-1) == 0
        P[empty, 0] = 1.0  # nowhere to look: the first token
        return P / P.sum(-1, keepdim=True)

    with hooks(model, {"blocks.1.attn.hook_pattern": _ideal(induction)}):
        plain = detect_heads(model, ids, "induction")
        no_bos = detect_heads(model, ids, "induction", exclude_bos=True)
    assert plain[1, 2] == pytest.approx(0.5)
    assert no_bos[1, 2] == pytest.approx(1.0)
    others = plain.clone()
    others[1, 2] = 0
    assert others.max() < 0.5  # random heads are far from it


def test_previous_token_and_bos_heads() -> None:
    model = tiny(2)
    ids = torch.randint(0, V, (2, 9))

    def previous(L: int) -> torch.Tensor:
        P = torch.diag(torch.ones(L - 1), -1)
        P[0, 0] = 1.0
        return P

    with hooks(model, {"blocks.0.attn.hook_pattern": _ideal(previous)}):
        scores = detect_heads(model, ids, "previous_token")
        current = detect_heads(model, ids, "previous_token", exclude_current_token=True)
    assert scores[0, 2] == pytest.approx(8 / 9)  # row 0 has no previous token
    assert current[0, 2] == pytest.approx(1.0)
    sink = torch.zeros(9, 9)
    sink[:, 0] = 1.0
    with hooks(model, {"blocks.1.attn.hook_pattern": _ideal(lambda L: sink)}):
        assert detect_heads(model, ids, "bos")[1, 2] == pytest.approx(1.0)
        custom = detect_heads(model, ids, sink)
    assert custom[1, 2] == pytest.approx(1.0)


def test_a_list_of_sequences_gives_the_mean() -> None:
    model = tiny(3)
    seqs = [torch.randint(0, V, (L,)) for L in (6, 9, 6, 11)]
    together = detect_heads(model, seqs, "duplicate_token", batch_size=2)
    alone = torch.stack([detect_heads(model, s, "duplicate_token") for s in seqs]).mean(0)
    torch.testing.assert_close(together, alone)


@pytest.mark.parametrize("kind", ["previous_token", "bos", "duplicate_token", "induction"])
def test_detection_scores_of_cached_patterns_are_detect_heads(kind: str) -> None:
    model = tiny(4)
    ids = torch.randint(0, V, (12,))
    ids[6:] = ids[:6]
    _, cache = run_with_cache(model, ids[None])
    patterns = torch.stack([cache["pattern", layer][0] for layer in range(2)])  # (N, H, L, L)
    for flags in ((False, False), (True, True)):
        torch.testing.assert_close(
            detection_scores(patterns, ids, kind, exclude_bos=flags[0],
                             exclude_current_token=flags[1]),
            detect_heads(model, ids, kind, exclude_bos=flags[0],
                         exclude_current_token=flags[1]))
    with pytest.raises(ValueError, match=r"patterns must be \(\.\.\., H, L, L\)"):
        detection_scores(patterns[..., :5, :5], ids, kind)


def test_perfect_score_is_the_share_of_queries_with_a_target() -> None:
    tokens = torch.tensor([0, 7, 8, 9, 7, 8, 9])  # a leading token, then 3 tokens twice
    assert perfect_score(tokens, "induction") == pytest.approx(3 / 7)
    assert perfect_score(tokens, "previous_token") == pytest.approx(6 / 7)
    assert perfect_score(tokens, "bos") == 1.0
    assert perfect_score(tokens, "duplicate_token") == pytest.approx(3 / 7)


def test_bad_inputs() -> None:
    model = tiny()
    ids = torch.randint(0, V, (1, 5))
    with pytest.raises(ValueError, match="kind must be one of"):
        detect_heads(model, ids, "copying")
    with pytest.raises(ValueError, match=r"custom detection pattern must be \(L, L\)"):
        detect_heads(model, ids, torch.ones(4, 4))
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        detect_heads(model, ids, "bos", batch_size=0)
