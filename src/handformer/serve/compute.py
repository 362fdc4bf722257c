"""What each API call computes, as plain functions of a :class:`ModelState` and a checked request.

They return JSON-ready dicts (``run`` and ``rollout`` with ``binary=True``: the viewer's
weights as bytes, for :func:`handformer.serve.wire.binary_body`) and never change shared
state: the attention kind picks a model view (:meth:`ModelState.variant`), and head ablation
is a hook context (:func:`handformer.inspect.hooks`) that lives for one forward pass in the
calling thread only.
So concurrent requests with different settings each get their own answer. The app runs them
in worker threads; tests call them directly as the reference.

Shape letters: ``N`` layers, ``H`` heads, ``L`` tokens, ``E`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from handformer.serve.state import AttentionChoice, ModelState
from handformer.serve.validation import RequestError, RunRequest
from handformer.tokenizers.labels import (
    label_words,
    next_token_labels,
    token_labels,
    unk_token_id,
    unknown_notice,
    visible,
)

__all__ = ["run", "ablate", "rollout", "encode", "ablated", "Encoded", "visible",
           "first_head", "SERVE_ADVICE", "limit_words", "request_input"]

TOP_K = 5  # next-token candidates shown for causal models
SERVE_ADVICE = "the shipped gemma3-270m does (handformer serve --model gemma3-270m)"


@contextlib.contextmanager
def ablated(model: nn.Module, heads: tuple[tuple[int, int], ...]) -> Iterator[None]:
    """Zero-ablate ``heads`` of ``model`` inside the block, for this thread / task only."""
    if not heads:
        yield
        return
    from handformer.inspect import head_ablation_hooks, hooks

    with hooks(model, head_ablation_hooks(model, heads)):
        yield


class Encoded:
    """One text as the model's input.

    Attributes:
        batch: the model's keyword inputs, ``(1, L)`` tensors.
        tokens: one display label per token
            (:func:`handformer.tokenizers.labels.token_labels` for causal models).
        notice: a sentence saying the text was cut to the model's limit, or None.
        special: per token, True for special tokens (``[CLS]``, ``[SEP]``); None if unknown.
        unknown: per token, True for the model's unknown token.
        unknown_notice: the one-line notice when more than a tenth of the tokens are
            unknown (the model does not read the script), or None.
        words: per token, the index of the whitespace-separated word it starts in (encoders;
            None: from the labels), so the head choice skips links within a word as
            ``handformer viz`` does.
    """

    def __init__(self, batch: dict[str, Tensor], tokens: list[str], notice: str | None, *,
                 special: list[bool] | None = None, unknown: list[bool] | None = None,
                 unknown_notice: str | None = None, words: list[int] | None = None) -> None:
        self.batch, self.tokens, self.notice = batch, tokens, notice
        self.special, self.words = special, words
        self.unknown = unknown if unknown is not None else [False] * len(tokens)
        self.unknown_notice = unknown_notice

    @property
    def notices(self) -> list[str]:
        """The notices about this text (cut to the limit, unknown script), in that order."""
        return [n for n in (self.notice, self.unknown_notice) if n]


def _unknown(state: ModelState, ids: list[int], special: list[bool] | None, field: str
             ) -> tuple[list[bool], str | None]:
    unk = unk_token_id(state.tokenizer)
    flags = [unk is not None and i == unk for i in ids]
    ordinary = len(ids) - (sum(special) if special else 0)
    what = "the text" if field == "text" else field
    return flags, unknown_notice(sum(flags), ordinary, model=state.name, what=what,
                                 advice=SERVE_ADVICE)


def request_input(state: ModelState, req: RunRequest) -> Encoded:
    """The request's text as model input: its ``ids`` as they are (causal models), else
    ``text`` tokenized."""
    if req.ids is None:
        return encode(state, req.text)
    return _from_ids(state, list(req.ids), "ids", state.max_tokens)


def limit_words(state: ModelState, limit: int) -> str:
    """The token limit in words: the model's own, or the one this server keeps for a model
    with this many heads (every head's weights are computed)."""
    if limit >= getattr(state, "context", limit):
        return f"the model's limit of {limit}"
    return (f"the limit of {limit} tokens this page shows for a model of {state.num_layers} x "
            f"{state.num_heads} heads (its context is {state.context})")


def _from_ids(state: ModelState, ids: list[int], field: str, limit: int) -> Encoded:
    """A causal model's input from token ids, cut to ``limit`` with a notice."""
    notice = None
    if len(ids) > limit:
        notice = (f"{field} has {len(ids)} tokens, more than {limit_words(state, limit)}; "
                  f"only the first {limit} were used")
        ids = ids[:limit]
    tokens = token_labels(state.tokenizer, ids)
    batch = {"input_ids": torch.tensor([ids], device=state.device)}  # (1, L)
    unknown, line = _unknown(state, ids, None, field)
    return Encoded(batch, tokens, notice, unknown=unknown, unknown_notice=line)


def encode(state: ModelState, text: str, field: str = "text", *,
           limit: int | None = None, chat: bool = False) -> Encoded:
    """Tokenize ``text`` for the model, cut to ``limit`` (default ``state.max_tokens``) with a
    notice. ``chat``: the text is a chat template's output, which holds its own special
    tokens (none are added).

    Raises:
        RequestError: for text the tokenizer rejects or that gives no tokens.
    """
    limit = state.max_tokens if limit is None else limit
    if state.causal:
        try:
            ids = (state.tokenizer.encode(text, add_special_tokens=False) if chat
                   else state.tokenizer.encode(text))
        except ValueError as exc:  # e.g. a character outside a char vocabulary
            raise RequestError(field, " ".join(str(exc).split())) from None
        if not ids:
            raise RequestError(field, "gives no tokens for this model's tokenizer")
        return _from_ids(state, ids, field, limit)
    tokenizer, notice = state.tokenizer, None
    try:
        encodings = tokenizer.encode_batch([text], max_length=limit, truncation=False)
    except ValueError as exc:
        if "limit" not in str(exc):
            raise RequestError(field, " ".join(str(exc).split())) from None
        full = len(tokenizer.encode(text, truncation=False))  # only to count the tokens
        encodings = tokenizer.encode_batch([text], max_length=limit)  # cut (warning filtered)
        what = "limit" if limit == state.max_tokens else "sentence-embedding limit"
        notice = (f"{field} has {full} tokens, more than the model's {what} of {limit}; only "
                  f"the first {limit} were used")
    batch = {k: v.to(state.device) for k, v in tokenizer.pad(encodings).items()}  # (1, L)
    special = [bool(s) for s in encodings[0].special_tokens_mask]
    unknown, line = _unknown(state, list(encodings[0].ids), special, field)
    from handformer.viz.head_choice import word_index

    return Encoded(batch, list(encodings[0].tokens), notice, special=special, unknown=unknown,
                   unknown_notice=line, words=word_index(text, encodings[0].offsets))


def _pattern(state: ModelState, choice: AttentionChoice, L: int) -> tuple[object, str]:
    """Keys each query may reach (for the panel beside the heat map) and its caption."""
    kind = choice.make()
    label = choice.describe().capitalize()
    if state.causal:
        return kind.pattern(L, L, causal=True), label
    if choice.kind == "linear":  # every key is reachable; the point is the cost
        return (torch.ones(L, L, dtype=torch.bool),
                "Linear attention: every query reaches every key, yet the L x L matrix is "
                "never formed")
    return (kind if choice.kind in ("local", "strided") else None), label


def _pool(state: ModelState, hidden: Tensor, enc: Encoded) -> Tensor:
    """The sentence embedding ``(E,)`` of ``(1, L, E)`` hidden states (the checkpoint's
    pooling, as :func:`handformer.embed` does)."""
    from handformer.pretrained.pooling import SentencePooling

    pooling = state.model.sentence_pooling or SentencePooling()
    return pooling(hidden, enc.batch["attention_mask"])[0]


def _embedding(state: ModelState, model: nn.Module, text: str, field: str,
               notices: list[str]) -> Tensor:
    """The sentence embedding ``(E,)`` of ``text``, cut to ``state.embed_tokens``."""
    enc = encode(state, text, field, limit=state.embed_tokens)
    notices += [n for n in enc.notices if n not in notices]
    return _pool(state, model(**enc.batch).last_hidden_state, enc)


def _cosine(a: Tensor, b: Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a[None].double(), b[None].double())[0])


def _top_tokens(state: ModelState, logits: Tensor, context: Tensor
                ) -> list[dict[str, object]]:
    """The most likely next tokens, ``logits`` being ``(V,)``, after the ids ``context``
    ``(1, L)``, labelled as the prompt's tokens are (a byte of a character says so)."""
    probs = torch.softmax(logits.double(), dim=-1)  # (V,)
    top = torch.topk(probs, min(TOP_K, probs.numel()))
    ids = [int(i) for i in top.indices]
    labels = next_token_labels(state.tokenizer, context[0].tolist(), ids)
    return [{"id": i, "token": label, "prob": round(float(p), 6)}
            for i, label, p in zip(ids, labels, top.values, strict=True)]


def _header(state: ModelState, req: RunRequest) -> dict[str, object]:
    """Who answers: the model, the attention kind and the ablated heads."""
    return {"model": state.name, "model_type": "causal-lm" if state.causal else "encoder",
            "attention": req.attention.as_dict(), "heads_ablated": [list(h) for h in req.heads]}


def first_head(attentions: object, enc: Encoded, *, include_sink: bool = False
               ) -> tuple[int, int]:
    """The head ``handformer viz`` would draw for this text (the page opens on it)."""
    from handformer.viz.head_choice import choose_head

    words = getattr(enc, "words", None)  # encoders: from the text's offsets
    if words is None and enc.special is None:  # causal models: from the labels
        words = label_words(enc.tokens)
    return choose_head([a.float().cpu() for a in attentions], enc.tokens, special=enc.special,
                       words=words, unknown=enc.unknown, include_sink=include_sink)


def _viewer(state: ModelState, req: RunRequest, attentions: object, enc: Encoded,
            binary: bool) -> dict[str, object]:
    """The viewer data; it opens on :func:`first_head` when the request asks for it
    (``choose_head``: the page's first answer for a model), else on the last layer."""
    from handformer.viz.html import viewer_payload

    tokens = enc.tokens
    pattern, label = _pattern(state, req.attention, len(tokens))
    note = f"{state.name} \u00b7 {req.attention.describe()}"
    if req.heads:
        note += f" \u00b7 {len(req.heads)} head{'s' * (len(req.heads) != 1)} ablated"
    layer, head = (first_head(attentions, enc, include_sink=req.include_sink)
                   if req.choose_head else (state.num_layers - 1, 0))
    payload = viewer_payload(attentions, tokens, pattern=pattern, pattern_label=label,
                             note=note, layer=layer, head=head, binary=binary,
                             include_sink=req.include_sink,
                             compress=False)  # a local connection: raw is faster than deflate
    payload["ablated"] = [list(h) for h in req.heads]
    return payload


def run(state: ModelState, req: RunRequest, *, binary: bool = False) -> dict[str, object]:
    """``/api/run``: the attention of every head on ``req.text`` (viewer data), plus the pair's
    embedding similarity (encoders) or the next-token prediction (causal models), all with
    ``req.attention`` and with ``req.heads`` ablated.

    Args:
        state: the loaded model.
        req: the checked request.
        binary: leave the viewer's 8-bit weights as bytes (``viewer["data"]`` a memoryview,
            for :func:`handformer.serve.wire.binary_body`) instead of base64 text.

    Returns:
        The answer: the model, the attention kind, tokens, notices, the viewer data, and
        ``similarity`` (encoders) or ``next_token`` (causal models).

    Raises:
        RequestError: for text the tokenizer rejects.
    """
    model = state.variant(req.attention)
    enc = request_input(state, req)
    notices = enc.notices
    result = _header(state, req) | {"tokens": enc.tokens}
    with torch.inference_mode(), ablated(model, req.heads):
        out = model(**enc.batch, need_weights=True)
        attentions = out.attentions
        if state.causal:
            result["next_token"] = _top_tokens(state, out.logits[0, -1],
                                               enc.batch["input_ids"])
        else:
            result["similarity"] = None
            if req.text_pair is not None:
                if len(enc.tokens) <= state.embed_tokens:  # the same input: reuse the pass
                    emb = _pool(state, out.last_hidden_state, enc)
                else:
                    emb = _embedding(state, model, req.text, "text", notices)
                other = _embedding(state, model, req.text_pair, "text_pair", notices)
                result["similarity"] = _cosine(emb, other)
    result["notices"] = notices
    result["viewer"] = _viewer(state, req, attentions, enc, binary)
    return result


def ablate(state: ModelState, req: RunRequest) -> dict[str, object]:
    """``/api/ablate``: the effect of zero-ablating ``req.heads`` on the output.

    Encoders: the cosine similarity of the two texts' embeddings with and without the
    ablation (without ``text_pair``: the cosine between ``text``'s embedding with and
    without it). Causal models: the next-token distribution with and without it.
    """
    model = state.variant(req.attention)
    notices: list[str] = []
    result = _header(state, req)
    with torch.inference_mode():
        if state.causal:
            enc = request_input(state, req)
            notices += enc.notices
            clean = model(**enc.batch).logits[0, -1]  # (V,)
            with ablated(model, req.heads):
                dirty = model(**enc.batch).logits[0, -1]
            p, q = torch.log_softmax(clean.double(), -1), torch.log_softmax(dirty.double(), -1)
            best = int(clean.argmax())
            return result | {
                "metric": "next_token", "notices": notices,
                "clean": _top_tokens(state, clean, enc.batch["input_ids"]),
                "ablated": _top_tokens(state, dirty, enc.batch["input_ids"]),
                "top_token_prob": {"clean": float(p[best].exp()), "ablated": float(q[best].exp())},
                "kl_divergence": float((p.exp() * (p - q)).sum())}
        emb = _embedding(state, model, req.text, "text", notices)
        with ablated(model, req.heads):
            emb_ablated = _embedding(state, model, req.text, "text", [])
        if req.text_pair is None:
            value = _cosine(emb, emb_ablated)
            return result | {"metric": "self_similarity", "notices": notices,
                             "clean": 1.0, "ablated": value, "delta": value - 1.0}
        other = _embedding(state, model, req.text_pair, "text_pair", notices)
        with ablated(model, req.heads):
            other_ablated = _embedding(state, model, req.text_pair, "text_pair", [])
    clean, value = _cosine(emb, other), _cosine(emb_ablated, other_ablated)
    return result | {"metric": "similarity", "notices": notices, "clean": clean,
                     "ablated": value, "delta": value - clean}


def rollout(state: ModelState, req: RunRequest, *, binary: bool = False
            ) -> dict[str, object]:
    """``/api/rollout``: attention rollout through each layer, as viewer data (layer ``l``
    of the picture = rollout through layers ``0..l``; one "head" per layer): Abnar &
    Zuidema's heads averaged, ``0.5 A + 0.5 I``, multiplied through the layers
    (:func:`handformer.inspect.attention_rollout`).

    Args:
        state: the loaded model.
        req: the checked request.
        binary: leave the viewer's weights as bytes (see :func:`run`).

    Returns:
        The answer: the model, the attention kind, tokens, notices and the viewer data.

    Raises:
        RequestError: for text the tokenizer rejects.
    """
    from handformer.inspect import attention_rollout
    from handformer.viz.html import viewer_payload

    model = state.variant(req.attention)
    enc = request_input(state, req)
    with torch.inference_mode(), ablated(model, req.heads):
        attentions = model(**enc.batch, need_weights=True).attentions
    rolled = [attention_rollout(attentions, layers=range(layer + 1))[0]  # (L, L) each
              for layer in range(len(attentions))]
    stack = [r.float()[None, None] for r in rolled]  # N x (1, 1, L, L): one "head" per layer
    note = f"{state.name} \u00b7 {req.attention.describe()} \u00b7 attention rollout"
    result = _header(state, req) | {"tokens": enc.tokens, "notices": enc.notices}
    result["viewer"] = viewer_payload(stack, enc.tokens, note=note,
                                      layer=state.num_layers - 1, compress=False,
                                      binary=binary)
    return result
