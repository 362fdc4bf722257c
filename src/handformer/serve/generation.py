"""``/api/generate``: continue a prompt one token at a time, each with the attention that chose it.

A :class:`Generation` is advanced by :meth:`Generation.step` calls; the app runs each call in a
worker thread and sends its event as one JSON line as soon as it is ready. Every step is a
complete forward pass inside its own hook context (ablation) on the request's own model view
and decoding cache, so nothing is shared with other requests. Full and strided attention decode
with the KV cache (it holds every key, so the weights cover the whole text); local and linear
attention rerun the whole text each step, because their caches keep no per-key weights
(a rolling window, a running sum).

Shape letters: ``N`` layers, ``H`` heads, ``L`` tokens so far, ``V`` vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from handformer.models.generation import filter_logits
from handformer.serve.compute import ablated, encode, limit_words
from handformer.serve.state import ModelState
from handformer.serve.validation import GenerateRequest
from handformer.tokenizers.labels import TextStream, token_labels

__all__ = ["Generation"]

DIGITS = 4  # decimals of the attention weights sent per token
RELABEL = 8  # generated tokens relabelled each step (a character spans at most 4 bytes)


class Generation:
    """One streaming generation (greedy, or sampling with ``temperature`` / ``top_k`` /
    ``top_p``, seeded by ``seed``).

    Args:
        state: the server's model.
        req: the checked request.

    Raises:
        RequestError: for a prompt the tokenizer rejects.
    """

    def __init__(self, state: ModelState, req: GenerateRequest) -> None:
        self.state, self.req = state, req
        self.model = state.variant(req.attention)
        # Text only, the model's context is the limit; with attention, the viewer's.
        self.limit = state.context if req.text_only else state.max_tokens
        self.enc = encode(state, req.text, chat=req.chat, limit=self.limit)
        ids = self.enc.batch["input_ids"]  # (1, L)
        self.room = self.limit - ids.shape[1]
        self.budget = min(req.max_new_tokens, self.room)
        self.sample = any(v is not None for v in (req.temperature, req.top_k, req.top_p))
        self.generator = torch.Generator(device=state.device).manual_seed(req.seed)
        self.eos = state.tokenizer.eos_token_id
        # Every kind decodes with its cache when no weights are sent; with weights only full and
        # strided do (the others' caches keep no per-key weights).
        cached = req.text_only or req.attention.kind in ("full", "strided")
        self.cache = self.model.new_cache() if cached else None
        self.pending: Tensor = ids  # what the next forward reads, (1, T)
        self.ids: list[int] = []
        self.labels: list[str] = []  # the label sent for each generated token
        self.stream = TextStream(state.tokenizer, skip=() if self.eos is None else (self.eos,))
        self.done = False

    def start(self) -> dict[str, object]:
        """The first event: who answers, the prompt's tokens, any notice."""
        notices = self.enc.notices
        if self.budget < self.req.max_new_tokens:
            notices.append(f"max_new_tokens cut to {self.budget}: the prompt leaves room for "
                           f"{self.room} tokens within "
                           f"{limit_words(self.state, self.limit)}")
        if self.budget <= 0:
            self.done = True
        return {"event": "start", "model": self.state.name, "model_type": "causal-lm",
                "attention": self.req.attention.as_dict(),
                "heads_ablated": [list(h) for h in self.req.heads],
                "prompt": self.req.text, "chat": self.req.chat, "text_only": self.req.text_only,
                "prompt_ids": self.enc.batch["input_ids"][0].tolist(),
                "prompt_tokens": self.enc.tokens, "notices": notices}

    def step(self) -> dict[str, object]:
        """The next token (``event: "token"``), or ``event: "end"`` when finished.

        A token event holds ``token`` (its label: a piece of a character is labelled with the
        whole character once it is complete, ``"动·1/2"``), ``text`` (the text completed by this
        token: empty while a character is still incomplete, never half of one), ``relabel``
        (``{index: label}`` for earlier generated tokens whose label changed now that their
        character is complete), and ``attention``: per layer, per head, the weights of the
        query that chose the token over every earlier token (``N x H x L``; left out for a
        ``text_only`` request, whose forward passes compute no weights).
        """
        if self.done:
            cut = self.budget < self.req.max_new_tokens
            return self._end("context" if cut else "max_new_tokens")
        with torch.inference_mode(), ablated(self.model, self.req.heads):
            out = self.model(self.pending, cache=self.cache, need_weights=not self.req.text_only)
        new = torch.tensor([[0]], device=self.state.device)  # (1, 1), the id set below
        logits = out.logits[0, -1].float()  # (V,)
        if self.sample:
            t = 1.0 if self.req.temperature is None else self.req.temperature
            scores = filter_logits((logits / t)[None], top_k=self.req.top_k,
                                   top_p=self.req.top_p)[0]
            token = int(torch.multinomial(torch.softmax(scores, -1), 1,
                                          generator=self.generator))
        else:
            token = int(logits.argmax())
        self.ids.append(token)
        new[0, 0] = token
        self.pending = new if self.cache is not None else torch.cat([self.pending, new], 1)
        finished = token == self.eos or len(self.ids) >= self.budget
        if finished:
            self.done = True
        first = max(0, len(self.ids) - RELABEL)
        window = token_labels(self.state.tokenizer, self.ids[first:])
        relabel = {}
        for index, label in enumerate(window[:-1], start=first):
            if self.labels[index] != label:
                self.labels[index] = relabel[str(index)] = label
        self.labels.append(window[-1])
        text = self.stream.push(token)
        if finished:
            text += self.stream.finish()
        event = {"event": "token", "index": len(self.ids) - 1, "id": token,
                 "token": window[-1], "text": text, "relabel": relabel,
                 "prob": round(float(torch.softmax(logits.double(), -1)[token]), 6),
                 "eos": token == self.eos}
        if not self.req.text_only:
            rows = torch.stack([a[0, :, -1, :].float() for a in out.attentions])  # (N, H, L)
            event["attention"] = (torch.round(rows * 10**DIGITS) / 10**DIGITS).tolist()
        return event

    def _end(self, reason: str) -> dict[str, object]:
        if self.ids and self.ids[-1] == self.eos:
            reason = "eos"
        return {"event": "end", "reason": reason, "generated": len(self.ids),
                "text": self.state.tokenizer.decode([i for i in self.ids if i != self.eos])
                .replace("\ufffd", "<?>")}
