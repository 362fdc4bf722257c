"""Sentence embeddings: ``embed(texts) -> (N, E)`` tensor.

The pipeline follows the checkpoint's sentence-transformers configuration: encode, pool over
real tokens (mean for all-MiniLM-L6-v2), L2-normalise when a ``Normalize`` module is listed.
Texts are sorted by length before batching (as sentence-transformers does) so each batch
carries little padding; the result comes back in the input order.

Shape letters: ``N`` texts, ``B`` batch, ``L`` length, ``E`` hidden size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from handformer.checks import check_positive_int
from handformer.pretrained.bert import BertModel
from handformer.pretrained.checkpoints import load_bert
from handformer.pretrained.pooling import SentencePooling
from handformer.tokenizers.wordpiece import BertTokenizer

__all__ = ["embed", "default_model"]


@functools.lru_cache(maxsize=1)
def default_model() -> tuple[BertModel, BertTokenizer]:
    """The bundled all-MiniLM-L6-v2 ``(model, tokenizer)``, loaded once per process."""
    return load_bert()


def embed(texts: str | Sequence[str], *, model: BertModel | None = None,
          tokenizer: BertTokenizer | None = None, batch_size: int = 32) -> Tensor:
    """Embed sentences with a BERT-family model.

    Args:
        texts: one text or a list of texts.
        model: a :class:`BertModel` (default: the bundled all-MiniLM-L6-v2). Its
            ``sentence_pooling`` decides the pooling; without one, mean pooling.
        tokenizer: the model's tokenizer (required when ``model`` is given).
        batch_size: texts per forward pass.

    Returns:
        ``(N, E)`` float tensor on the model's device, in the order of ``texts``
        (L2-normalised rows when the pooling config says so).

    Raises:
        TypeError: for non-string texts.
        ValueError: for an empty list or empty text, a bad ``batch_size``, or a model
            without its tokenizer.
    """
    check_positive_int("batch_size", batch_size)  # 1 .. 2**31 - 1
    if model is None:
        if tokenizer is not None:
            raise ValueError("tokenizer was given without model; pass both or neither")
        model, tokenizer = default_model()
    elif tokenizer is None:
        raise ValueError("model was given without tokenizer; pass the tokenizer load_bert "
                         "returned with it")
    pooling = model.sentence_pooling or SentencePooling()
    limit = tokenizer.max_length
    if pooling.max_seq_length is not None:
        limit = min(limit, pooling.max_seq_length)
    encodings = tokenizer.encode_batch(texts, max_length=limit)
    N = len(encodings)
    order = sorted(range(N), key=lambda i: -len(encodings[i].ids))
    device = next(model.parameters()).device
    outputs: list[Tensor] = []
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for start in range(0, N, batch_size):
                batch = tokenizer.pad([encodings[i] for i in order[start:start + batch_size]])
                batch = {k: v.to(device) for k, v in batch.items()}
                hidden = model(**batch).last_hidden_state  # (B, L, E)
                outputs.append(pooling(hidden, batch["attention_mask"]))
    finally:
        model.train(was_training)
    pooled = torch.cat(outputs)  # (N, E) in length order
    inverse = torch.argsort(torch.tensor(order, device=device))  # (N,)
    return pooled[inverse]  # outside inference mode: an ordinary tensor, usable with autograd
