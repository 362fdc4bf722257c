"""Which heads matter (``handformer heads``): for the similarity of two sentences (an
encoder), for a causal LM's log-probability of a continuation, or for its preference of one
next token over another (the logit difference).

Shape letters: ``N`` layers, ``H`` heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from handformer.inspect.ablation import head_ablation_sweep, head_means
from handformer.pretrained.bert import BertModel
from handformer.pretrained.pooling import SentencePooling
from handformer.tokenizers.wordpiece import BertTokenizer

__all__ = ["HeadEffects", "pair_similarity_effects", "continuation_effects", "logit_diff_effects"]


@dataclass
class HeadEffects:
    """Every head's effect on a metric when it is ablated.

    Attributes:
        effects: ``(N, H)`` float64, ``metric(ablated) - metric(clean)``.
        clean: the metric of the unablated model.
        metric: what was measured, in words.
        mode: ``"zero"`` or ``"mean"``.
    """

    effects: Tensor
    clean: float
    metric: str
    mode: str

    def top(self, k: int = 5) -> list[tuple[int, int, float]]:
        """The ``k`` heads with the largest absolute effect: ``(layer, head, effect)``."""
        flat = self.effects.nan_to_num(0.0).abs().flatten()
        order = torch.argsort(flat, descending=True)[:k]
        H = self.effects.shape[1]
        return [(int(i) // H, int(i) % H, float(self.effects.flatten()[i])) for i in order]


def pair_similarity_effects(model: BertModel, tokenizer: BertTokenizer, text_a: str,
                            text_b: str, *, mode: str = "zero", batch_size: int = 16,
                            progress: bool | None = None) -> HeadEffects:
    """The change in the cosine similarity of two sentence embeddings when each head is
    ablated alone (pooled the way :func:`handformer.pretrained.embed` pools).

    Args:
        model: a :class:`BertModel` (put in eval mode for the sweep).
        tokenizer: its tokenizer.
        text_a, text_b: the two sentences.
        mode: ``"zero"``, or ``"mean"`` (each head's mean output over both sentences).
        batch_size: ablations per forward pass.
        progress: show a progress bar (default: on a terminal, for long sweeps).

    Returns:
        :class:`HeadEffects`.

    Raises:
        ValueError: for empty texts or an unknown mode.
    """
    model.eval()
    pooling = model.sentence_pooling or SentencePooling()
    device = next(model.parameters()).device
    enc = {k: v.to(device) for k, v in tokenizer([text_a, text_b]).items()}
    mask = enc["attention_mask"]

    def cosine(out: object) -> Tensor:
        e = pooling(out.last_hidden_state, mask)  # (2, E)
        return torch.cosine_similarity(e[0], e[1], dim=0)

    means = head_means(model, enc) if mode == "mean" else None
    effects = head_ablation_sweep(model, enc, cosine, mode=mode, means=means,
                                  batch_size=batch_size, progress=progress)
    with torch.no_grad():
        clean = float(cosine(model(**enc)))
    return HeadEffects(effects, clean, "cosine similarity of the two embeddings", mode)


def _encode(tokenizer: object, text: str, *, special: bool) -> list[int]:
    """Token ids, with the tokenizer's special tokens (BOS) only where asked for: tokenizers
    of the protocol take ``add_special_tokens``; the plain ones add none anyway."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=special))  # type: ignore[attr-defined]
    except TypeError:
        return list(tokenizer.encode(text))  # type: ignore[attr-defined]


def continuation_effects(model: nn.Module, tokenizer: object, prompt: str, continuation: str,
                         *, mode: str = "zero", batch_size: int = 16,
                         progress: bool | None = None) -> HeadEffects:
    """The change in a causal LM's log-probability of ``continuation`` after ``prompt`` when
    each head is ablated alone.

    Args:
        model: a :class:`~handformer.CausalLM` (put in eval mode for the sweep).
        tokenizer: its tokenizer (``encode``).
        prompt, continuation: the text and what follows it.
        mode: ``"zero"``, or ``"mean"`` (each head's mean output over the text).
        batch_size: ablations per forward pass.
        progress: show a progress bar (default: on a terminal, for long sweeps).

    Returns:
        :class:`HeadEffects` of ``sum log p(continuation token | everything before it)``, in
        nats.

    Raises:
        ValueError: for a text that gives no tokens, or one longer than the model's context.
    """
    model.eval()
    first = _encode(tokenizer, prompt, special=True)
    rest = _encode(tokenizer, continuation, special=False)
    if not first or not rest:
        raise ValueError("the prompt and the continuation must each give at least one token")
    max_len = model.config.max_len  # type: ignore[attr-defined]
    if len(first) + len(rest) > max_len:
        raise ValueError(f"prompt + continuation = {len(first) + len(rest)} tokens, more than "
                         f"the model's context of {max_len}")
    device = next(model.parameters()).device
    ids = torch.tensor([first + rest], device=device)  # (1, T)
    targets = ids[0, len(first):]  # (C,)

    def logprob(out: object) -> Tensor:
        logits = out.logits[0, len(first) - 1:-1].double()  # (C, V): each predicts the next
        return logits.log_softmax(-1).gather(-1, targets[:, None]).sum()

    means = head_means(model, ids) if mode == "mean" else None
    effects = head_ablation_sweep(model, ids, logprob, mode=mode, means=means,
                                  batch_size=batch_size, progress=progress)
    with torch.no_grad():
        clean = float(logprob(model(ids)))
    return HeadEffects(effects, clean, "log-probability of the continuation", mode)


def logit_diff_effects(model: nn.Module, tokenizer: object, prompt: str, answer: str,
                       wrong: str, *, mode: str = "zero", batch_size: int = 16,
                       progress: bool | None = None) -> HeadEffects:
    """The change of ``logit(answer) - logit(wrong)`` after ``prompt`` when each head of a
    causal LM is ablated alone.

    Args:
        model: a causal LM (put in eval mode for the sweep).
        tokenizer: its tokenizer (the protocol: ``encode``, ``decode``).
        prompt: the text before the next token.
        answer, wrong: two texts of one token each (``" Mary"``, ``" John"``).
        mode: ``"zero"``, or ``"mean"`` (each head's mean output over the prompt).
        batch_size: ablations per forward pass.
        progress: show a progress bar (default: on a terminal, for long sweeps).

    Returns:
        :class:`HeadEffects` of the logit difference.

    Raises:
        ValueError: for an empty prompt, an answer or wrong token that is not one token, or an
            unknown mode.
    """
    from handformer.inspect.prompt import to_single_token, to_tokens

    if not prompt.strip():
        raise ValueError("the prompt is empty")
    right_id, wrong_id = to_single_token(tokenizer, answer), to_single_token(tokenizer, wrong)
    model.eval()
    device = next(model.parameters()).device
    ids = to_tokens(tokenizer, prompt).to(device)  # (1, L)

    def logit_diff(out: object) -> Tensor:
        last = out.logits[:, -1]  # (B, V)
        return (last[:, right_id] - last[:, wrong_id]).mean()

    means = head_means(model, ids) if mode == "mean" else None
    effects = head_ablation_sweep(model, ids, logit_diff, mode=mode, means=means,
                                  batch_size=batch_size, progress=progress)
    with torch.no_grad():
        clean = float(logit_diff(model(ids)))
    return HeadEffects(effects, clean, f"logit({answer!r}) - logit({wrong!r})", mode)
