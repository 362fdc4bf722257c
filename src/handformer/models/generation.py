"""Text generation for decoder-only models: greedy decoding and sampling.

Shape letters: ``B`` batch, ``L`` prompt length, ``V`` vocabulary.

One step: run the model on the new token(s) (with a :class:`~handformer.attention.cache.
DecodingCache`, or on the whole sequence without one), take the last position's logits, pick
the next token (argmax, or a sample from ``softmax(logits / temperature)`` restricted to the
``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``),
append it. A sequence that produced ``eos_token_id`` is finished: it gets ``pad_token_id``
afterwards, and generation stops when every sequence is finished.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["generate", "filter_logits"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _check_settings(do_sample: bool, temperature: float, top_k: int | None,
                    top_p: float | None) -> None:
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number, got {temperature!r}")
    if do_sample and not temperature > 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}; for "
                         "deterministic output use do_sample=False (greedy)")
    if top_k is not None:
        _check_int("top_k", top_k, 1)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def filter_logits(logits: Tensor, *, top_k: int | None = None,
                  top_p: float | None = None) -> Tensor:
    """Set to ``-inf`` the logits outside the ``top_k`` largest and outside the nucleus.

    Args:
        logits: ``(B, V)`` scores (already divided by the temperature).
        top_k: keep the ``top_k`` largest per row (ties at the threshold are kept).
        top_p: keep the smallest set of most likely tokens whose probability sum reaches
            ``top_p`` (at least one token).

    Returns:
        ``(B, V)`` filtered logits.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, V)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # probability of the tokens ranked above
        drop_sorted = before >= top_p  # the first token always stays (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # (B, V)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def generate(model: nn.Module, input_ids: Tensor, *, max_new_tokens: int,
             do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: int | None = None,
             pad_token_id: int | None = None, attention_mask: Tensor | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True,
             streamer: Callable[[Tensor], None] | None = None) -> Tensor:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    The model runs in eval mode (no dropout) and without gradients; its mode is restored.

    Args:
        model: a :class:`~handformer.CausalLM` (anything with ``config.max_len``,
            ``config.vocab_size``, ``new_cache()`` and ``forward(ids, attention_mask=,
            cache=)`` returning ``.logits``).
        input_ids: ``(B, L)`` prompts (left-padded when of different lengths).
        max_new_tokens: tokens to add (>= 0).
        do_sample: sample instead of taking the argmax (greedy).
        temperature: divides the logits before sampling (> 0 when sampling).
        top_k: sample only among the ``top_k`` most likely tokens.
        top_p: nucleus sampling threshold in (0, 1].
        eos_token_id: a sequence that emits it is finished.
        pad_token_id: written after a sequence finished (default ``eos_token_id``).
        attention_mask: ``(B, L)`` 1/0, 0 on left padding of the prompts.
        generator: a seeded ``torch.Generator`` makes sampling reproducible.
        use_cache: decode incrementally with the model's cache (same tokens, much faster).
        streamer: called with each new ``(B,)`` token tensor as soon as it is chosen.

    Returns:
        ``(B, L + n)`` prompt plus generated ids, ``n <= max_new_tokens`` (fewer when every
        sequence finished early).

    Raises:
        ValueError: for ``max_new_tokens < 0``, ``temperature <= 0`` with sampling,
            ``top_k < 1``, ``top_p`` outside (0, 1], token ids outside the vocabulary, or
            a prompt that with ``max_new_tokens`` does not fit in the context ``max_len``.
        TypeError: for a ``generator`` that is not a ``torch.Generator``.
    """
    _check_int("max_new_tokens", max_new_tokens, 0)
    _check_settings(do_sample, temperature, top_k, top_p)
    config = model.config
    for name, value in (("eos_token_id", eos_token_id), ("pad_token_id", pad_token_id)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or not 0 <= value < config.vocab_size):
            raise ValueError(f"{name} must be a token id in [0, {config.vocab_size}), "
                             f"got {value!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError("input_ids must be a (B, L) tensor of token ids, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    B, L = input_ids.shape
    if L > config.max_len:
        raise ValueError(f"the prompt has {L} tokens, longer than the context "
                         f"max_len={config.max_len}")
    if L + max_new_tokens > config.max_len:
        raise ValueError(f"prompt ({L} tokens) + max_new_tokens ({max_new_tokens}) = "
                         f"{L + max_new_tokens} exceeds the context max_len={config.max_len}; "
                         f"ask for at most {config.max_len - L} new tokens")
    pad = eos_token_id if pad_token_id is None else pad_token_id

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return _loop(model, input_ids, attention_mask, max_new_tokens, do_sample,
                         temperature, top_k, top_p, eos_token_id, pad, generator, use_cache,
                         streamer)
    finally:
        model.train(was_training)


def _loop(model: nn.Module, ids: Tensor, mask: Tensor | None, max_new_tokens: int,
          do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
          eos: int | None, pad: int | None, generator: torch.Generator | None,
          use_cache: bool, streamer: Callable[[Tensor], None] | None) -> Tensor:
    B = ids.shape[0]
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
    cache = model.new_cache() if use_cache else None
    new_ids, new_mask = ids, mask
    for _ in range(max_new_tokens):
        if cache is not None:
            out = model(new_ids, attention_mask=new_mask, cache=cache)
        else:
            out = model(ids, attention_mask=mask)
        logits = out.logits[:, -1, :].float()  # (B, V)
        if do_sample:
            logits = filter_logits(logits / temperature, top_k=top_k, top_p=top_p)
            probs = torch.softmax(logits, dim=-1)  # (B, V)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
        else:
            token = logits.argmax(dim=-1)  # (B,)
        if eos is not None:
            token = token.masked_fill(finished, pad)
        ids = torch.cat([ids, token[:, None]], dim=1)  # (B, L + 1)
        if mask is not None:
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (B, L + 1)
        new_ids, new_mask = token[:, None], None  # (B, 1); new tokens are real
        if streamer is not None:
            streamer(token)
        if eos is not None:
            finished |= token == eos
            if bool(finished.all()):
                break
    return ids
