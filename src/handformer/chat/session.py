"""A conversation with an instruct model: the chat template, the history, streamed replies.

:class:`ChatSession` keeps the messages of one conversation. Each :meth:`~ChatSession.send`
renders the whole history with the tokenizer's chat template (the model was trained on
exactly that layout: role markers, end-of-turn tokens), generates until an end token, streams
the reply as whole characters and appends it to the history. ``handformer chat`` and
``handformer generate --chat`` are thin loops around it.

The tokenizer is anything that speaks handformer's tokenizer protocol and has a chat
template (``chat_template`` and ``apply_chat_template``, as
:class:`~handformer.tokenizers.lm.LMTokenizer` has). A base model's tokenizer has no
template: such a model continues text (``generate --prompt``); it does not chat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from handformer.models.generation import check_sampling, stop_position

__all__ = ["ChatSession", "check_chat_model", "TextStream"]


def check_chat_model(tokenizer: object, source: str = "this model") -> None:
    """Refuse a tokenizer without a chat template, in one line.

    Args:
        tokenizer: the model's tokenizer (a chat template is ``chat_template`` and
            ``apply_chat_template``).
        source: the model's name, for the message.

    Raises:
        ValueError: when ``tokenizer`` has no chat template (a base model).
    """
    if getattr(tokenizer, "chat_template", None) is None or not hasattr(
            tokenizer, "apply_chat_template"):
        raise ValueError(f"{source} has no chat template (a base model, not an instruct "
                         "model): it continues text, it does not chat; use "
                         "`handformer generate --prompt TEXT` instead")


class TextStream:
    """Turn generated token ids into text as they come: whole characters only (a byte-level
    token may hold part of one), end tokens left out.

    Args:
        tokenizer: decodes ids (``decode(ids)``).
        stop_ids: ids that end the text (not shown).
        on_text: called with each new piece of text.
        stop: strings that end the text (not shown; text that may begin one is held back).
    """

    def __init__(self, tokenizer: object, stop_ids: set[int],
                 on_text: Callable[[str], None] | None, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop_ids, self.on_text = tokenizer, stop_ids, on_text
        self.stop = list(stop)
        self.ids: list[int] = []
        self.shown = 0  # characters passed to on_text so far
        self.stopped = False

    def __call__(self, token: torch.Tensor) -> None:
        """Take the next ``(1,)`` token tensor (generate's streamer)."""
        if self.stopped:
            return
        token_id = int(token[0])
        if token_id in self.stop_ids:
            self.stopped = True
            return
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):  # else an incomplete UTF-8 character: wait for more
            end, self.stopped = stop_position(text, self.stop)
            self._show(text[:end])

    def _show(self, text: str) -> None:
        if self.on_text is not None and len(text) > self.shown:
            self.on_text(text[self.shown:])
        self.shown = max(self.shown, len(text))

    def text(self) -> str:
        """All the text so far (flushing what was held back)."""
        text = self.tokenizer.decode(self.ids) if self.ids else ""
        end, stopped = stop_position(text, self.stop)
        text = text[:end] if stopped else text
        self._show(text)
        return text


class ChatSession:
    """One conversation with an instruct model.

    Args:
        model: a :class:`~handformer.CausalLM`.
        tokenizer: its tokenizer, with a chat template.
        system: an optional system message, kept at the top of the history.
        max_new_tokens: the most tokens a reply may have (fewer where the context ends).
        temperature, top_k, top_p: sampling settings (greedy when all are None).
        seed: seeds sampling (each reply draws from one generator, so a conversation replays
            the same).
        source: the model's name, for messages.
        stop: strings that end a reply (left out of it).
        repetition_penalty: as :func:`~handformer.models.generation.generate` applies it
            (None: off).

    Raises:
        ValueError: for a tokenizer without a chat template, ``max_new_tokens < 1`` or
            sampling settings ``generate`` refuses.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: object, *, system: str | None = None,
                 max_new_tokens: int = 256, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int = 0,
                 source: str = "this model", stop: Sequence[str] | None = None,
                 repetition_penalty: float | None = None) -> None:
        check_chat_model(tokenizer, source)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
                or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system must be a string or None, got {type(system).__name__}")
        self.model, self.tokenizer, self.source = model, tokenizer, source
        self.system = system
        self.max_new_tokens = max_new_tokens
        self.sampling = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
        check_sampling(repetition_penalty=repetition_penalty)
        self.stop = [] if stop is None else list(stop)
        self.repetition_penalty = 1.0 if repetition_penalty is None else repetition_penalty
        self.generator = torch.Generator(device=_device(model)).manual_seed(seed)
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [] if self.system is None else [
            {"role": "system", "content": self.system}]

    def stop_ids(self) -> set[int]:
        """The ids that end a reply: the tokenizer's end tokens (end of turn, end of text)."""
        ids = getattr(self.tokenizer, "eos_token_ids", None)
        if ids:
            return set(ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return set() if eos is None else {eos}

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of ``messages`` rendered with the template, ready for the reply."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template writes the special tokens itself (a BOS where the model wants one).
        return self.tokenizer.encode(text, add_special_tokens=False)

    def send(self, text: str, *, on_text: Callable[[str], None] | None = None) -> str:
        """Add a user message, generate the reply, add it to the history and return it.

        Args:
            text: the user's message.
            on_text: called with each new piece of the reply as it is generated.

        Returns:
            The reply's text (without the end token).

        Raises:
            ValueError: for a message that is not a non-empty string, or a conversation that
                no longer fits in the model's context (``reset`` it).
        """
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"the message must be non-empty text, got {text!r}")
        messages = [*self.messages, {"role": "user", "content": text}]
        ids = self.prompt_ids(messages)
        max_len = self.model.config.max_len
        room = max_len - len(ids)
        if room < 1:
            raise ValueError(f"the conversation is {len(ids)} tokens, as long as the "
                             f"context max_len={max_len} of {self.source}; reset it "
                             "(/reset in `handformer chat`)")
        stops = self.stop_ids()
        stream = TextStream(self.tokenizer, stops, on_text, self.stop)
        do_sample = any(v is not None for v in self.sampling.values())
        temperature = self.sampling["temperature"]
        self.model.generate(
            torch.tensor([ids], device=_device(self.model)),
            max_new_tokens=min(self.max_new_tokens, room), do_sample=do_sample,
            temperature=1.0 if temperature is None else temperature,
            top_k=self.sampling["top_k"], top_p=self.sampling["top_p"],
            eos_token_id=sorted(stops) or None, generator=self.generator, streamer=stream,
            repetition_penalty=self.repetition_penalty, stop=self.stop or None,
            tokenizer=self.tokenizer)
        reply = stream.text()
        self.messages = [*messages, {"role": "assistant", "content": reply}]
        return reply


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device
