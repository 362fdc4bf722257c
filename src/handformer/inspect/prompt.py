"""Text conveniences for looking inside a causal LM (TransformerLens' names).

* :func:`to_str_tokens` / :func:`to_tokens` / :func:`to_single_token`: a text as the model
  sees it, from any tokenizer of the protocol (``tokenizer.to_str_tokens`` / ``to_tokens``
  when it has them, else ``encode`` and ``decode``; special tokens are added exactly as
  ``encode`` adds them).
* :func:`test_prompt`: how the model ranks an answer after a prompt: the answer's rank,
  logit and probability at each of its tokens, and the top-k tokens there.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TextIO

import torch
from torch import Tensor, nn

__all__ = ["encode", "to_str_tokens", "to_tokens", "to_single_token", "test_prompt", "AnswerRank"]


def encode(tokenizer: object, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=...)``; a tokenizer whose ``encode`` takes
    no such keyword adds no special tokens and is called without it."""
    import inspect

    try:
        takes = "add_special_tokens" in inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        takes = True
    if takes:
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=add_special_tokens)]
    return [int(i) for i in tokenizer.encode(text)]


def to_str_tokens(tokenizer: object, text: str) -> list[str]:
    """The tokens of ``text`` as strings (one per id of ``tokenizer.encode(text)``).

    Args:
        tokenizer, text: a handformer tokenizer (:class:`~handformer.pretrained.Tokenizer`)
            and the text it splits.
    """
    return list(tokenizer.to_str_tokens(text))  # the tokenizer protocol


def to_tokens(tokenizer: object, text: str) -> Tensor:
    """``(1, L)`` token ids of ``text`` (special tokens as ``tokenizer.encode`` adds them).

    Args:
        tokenizer, text: a handformer tokenizer and the text it encodes.
    """
    return tokenizer.to_tokens(text)  # the tokenizer protocol


def to_single_token(tokenizer: object, text: str) -> int:
    """The id of a text that is one token (no special tokens added).

    Args:
        tokenizer, text: a handformer tokenizer and the text, one token of it.

    Raises:
        ValueError: when ``text`` is several tokens or none (naming them).
    """
    ids = encode(tokenizer, text, add_special_tokens=False)
    if len(ids) != 1:
        pieces = [tokenizer.decode([i]) for i in ids]
        raise ValueError(f"{text!r} is {len(ids)} tokens {pieces}, not one; pick a text that is "
                         "a single token (often with a leading space: ' Paris')")
    return int(ids[0])


@dataclass(frozen=True)
class AnswerRank:
    """How the model ranks one answer token after what precedes it.

    Attributes:
        token: the answer token (string).
        token_id: its id.
        rank: 0 = the model's top choice.
        logit: its logit.
        prob: its probability.
        top: the top-k ``(token, logit, prob)`` at that position.
    """

    token: str
    token_id: int
    rank: int
    logit: float
    prob: float
    top: list[tuple[str, float, float]]


def test_prompt(model: nn.Module, tokenizer: object, prompt: str, answer: str, *,
                prepend_space: bool = True, top_k: int = 10, file: TextIO | None = None
                ) -> list[AnswerRank]:
    """Print how ``model`` ranks ``answer`` after ``prompt``, token by token.

    The prompt is tokenized as ``tokenizer.encode`` does (with its special tokens), the answer
    without special tokens and, with ``prepend_space``, with a leading space (``" Paris"``:
    how a word mid-sentence is usually tokenized). The model runs once on prompt + answer.

    Args:
        model: a causal LM.
        tokenizer: its tokenizer (the protocol: ``encode``, ``decode``).
        prompt: the text before the answer.
        answer: the expected continuation (one or more tokens).
        prepend_space: put a space before the answer if it has none.
        top_k: how many top tokens to show per answer token.
        file: where to print (default stdout).

    Returns:
        One :class:`AnswerRank` per answer token.

    Raises:
        ValueError: for an empty prompt or answer, or ``top_k`` < 1.
    """
    if not prompt or not answer:
        raise ValueError("test_prompt needs a non-empty prompt and answer")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    out = sys.stdout if file is None else file
    if prepend_space and not answer.startswith(" "):
        answer = " " + answer
    prompt_ids = [int(i) for i in to_tokens(tokenizer, prompt)[0]]
    answer_ids = encode(tokenizer, answer, add_special_tokens=False)
    if not answer_ids:
        raise ValueError(f"the answer {answer!r} has no tokens")
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + answer_ids], device=device)  # (1, L)
    with torch.no_grad():
        logits = model(ids).logits[0].float()  # (L, V)
    piece = _shown(tokenizer, [], prompt_ids)
    print(f"Tokenized prompt: {piece}", file=out)
    answer_pieces = _shown(tokenizer, prompt_ids, answer_ids)
    print(f"Tokenized answer: {answer_pieces}", file=out)
    ranks = []
    for n, token_id in enumerate(answer_ids):
        row = logits[len(prompt_ids) - 1 + n]  # (V,) the prediction of answer token n
        probs = row.softmax(-1)
        rank = int((row > row[token_id]).sum())
        top = row.topk(min(top_k, row.shape[0]))
        context = prompt_ids + answer_ids[:n]
        best = [(text, float(row[i]), float(probs[i])) for text, i in zip(
            _shown(tokenizer, context, [int(i) for i in top.indices], each=True), top.indices,
            strict=True)]
        result = AnswerRank(answer_pieces[n], token_id, rank, float(row[token_id]),
                            float(probs[token_id]), best)
        ranks.append(result)
        print(f"Performance on answer token:\nRank: {rank:<8} Logit: {result.logit:5.2f} "
              f"Prob: {100 * result.prob:6.2f}% Token: |{result.token}|", file=out)
        for k, (text, logit, prob) in enumerate(best):
            print(f"Top {k}th token. Logit: {logit:5.2f} Prob: {100 * prob:6.2f}% Token: "
                  f"|{text}|", file=out)
    print(f"Ranks of the answer tokens: {[(r.token, r.rank) for r in ranks]}", file=out)
    return ranks


test_prompt.__test__ = False  # a TransformerLens name, not a test for pytest to collect


def _shown(tokenizer: object, context: list[int], ids: list[int], *, each: bool = False
           ) -> list[str]:
    """Each token decoded alone, as TransformerLens prints it, except a piece of a character
    (U+FFFD alone): that gets its label (``"动·1/3"``, ``"byte 1/3 of a character (E5)"``, see
    :mod:`handformer.tokenizers.labels`). ``ids`` follow ``context`` in turn, or, with
    ``each``, each one on its own after it (candidates)."""
    from handformer.tokenizers.labels import next_token_labels, token_labels

    texts = [tokenizer.decode([i]) for i in ids]
    if not any("\ufffd" in t for t in texts):
        return texts
    if each:
        labels = next_token_labels(tokenizer, context, ids)
    else:
        labels = token_labels(tokenizer, [*context, *ids])[len(context):]
    return [label if "\ufffd" in t else t for t, label in zip(texts, labels, strict=True)]
