"""Text generation for decoder-only models: greedy decoding and sampling.

Shape letters: ``B`` batch, ``L`` prompt length, ``V`` vocabulary.

One step: run the model on the new token(s) (with a :class:`~handformer.attention.cache.
DecodingCache`, or on the whole sequence without one), take the last position's logits, pick
the next token (argmax, or a sample from ``softmax(logits / temperature)`` restricted to the
``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``),
append it. A sequence that produced ``eos_token_id`` (or whose new text holds one of the
``stop`` strings) is finished: it gets ``pad_token_id`` afterwards, and generation stops when
every sequence is finished. ``repetition_penalty`` lowers the logits of the tokens already
in the sequence, as transformers' ``RepetitionPenaltyLogitsProcessor`` does (before the
temperature): a positive logit is divided by it, a negative one multiplied.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from handformer.checks import OptionError, check_non_negative_int, check_seed
from handformer.hooks import hooks_active
from handformer.models.quantized import Int8Linear

__all__ = ["generate", "filter_logits", "check_sampling", "apply_repetition_penalty",
           "stop_position"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise OptionError(name, f"must be an integer >= {minimum}, got {value!r}")
    return check_non_negative_int(name, value)  # at most MAX_INT


def check_sampling(*, temperature: object = None, top_k: object = None, top_p: object = None,
                   seed: object = None, repetition_penalty: object = None) -> None:
    """The one rule for sampling options, used by :func:`generate`, ``handformer generate``
    and the server's ``/api/generate`` (None = not given).

    * ``temperature``: a finite number > 0 (NaN, infinities, 0 and negatives refused);
    * ``top_k``: an integer in ``1 .. 2**31 - 1``;
    * ``top_p``: a number in ``(0, 1]``;
    * ``seed``: an integer in ``0 .. 2**63 - 1`` (:func:`handformer.checks.check_seed`);
    * ``repetition_penalty``: a finite number > 0 (1 = no penalty).

    Raises:
        ValueError: an :class:`~handformer.checks.OptionError` naming the first bad option.
    """
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise OptionError("temperature", f"must be a number, got {temperature!r}")
        if not temperature > 0:  # also NaN
            raise OptionError("temperature", f"must be > 0 when sampling, got {temperature}; "
                                             "for deterministic output use greedy decoding "
                                             "(no temperature, top_k or top_p)")
        if not math.isfinite(temperature):
            raise OptionError("temperature", f"must be a finite number > 0, got {temperature}")
    if top_k is not None:
        _check_int("top_k", top_k, 1)
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0 < top_p <= 1):
        raise OptionError("top_p", f"must be in (0, 1], got {top_p!r}")
    if seed is not None:
        check_seed(seed)
    if repetition_penalty is not None and (
            isinstance(repetition_penalty, bool)
            or not isinstance(repetition_penalty, (int, float))
            or not math.isfinite(repetition_penalty) or not repetition_penalty > 0):
        raise OptionError("repetition_penalty", f"must be a finite number > 0 (1 = no "
                                                f"penalty), got {repetition_penalty!r}")


def apply_repetition_penalty(logits: Tensor, ids: Tensor, penalty: float) -> Tensor:
    """Penalize the tokens already present, as transformers' repetition penalty does.

    Args:
        logits: ``(B, V)`` next-token scores.
        ids: ``(B, N)`` the tokens so far (prompt included).
        penalty: > 1 discourages repeats, < 1 encourages them, 1 changes nothing.

    Returns:
        ``(B, V)`` logits where each token of ``ids`` has its logit divided by ``penalty``
        if positive, multiplied by it if negative (once, however often it occurred).
    """
    score = logits.gather(-1, ids)  # (B, N)
    score = torch.where(score < 0, score * penalty, score / penalty)
    return logits.scatter(-1, ids, score)  # repeated ids write the same value


def stop_position(text: str, stop: Sequence[str]) -> tuple[int, bool]:
    """How much of a generated ``text`` may be shown, given ``stop`` strings.

    Returns:
        ``(end, stopped)``: where the first stop string starts and True when one occurs
        (the text ends there; the stop string is not shown, as in llama.cpp and Ollama);
        else ``len(text)`` less the longest tail that could begin a stop string (held
        back until later text decides), and False.
    """
    found = [i for i in (text.find(s) for s in stop) if i >= 0]
    if found:
        return min(found), True
    held = max((k for s in stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                if text.endswith(s[:k])), default=0)
    return len(text) - held, False


def _check_stop(stop: object, tokenizer: object) -> list[str]:
    """``stop`` as a list of non-empty strings (empty for None); they need a tokenizer."""
    if stop is None:
        return []
    if isinstance(stop, str) or not isinstance(stop, (list, tuple)) or not all(
            isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop must be a list of non-empty strings, got {stop!r:.80}")
    if stop and not callable(getattr(tokenizer, "decode", None)):
        raise ValueError("stop strings need the tokenizer (tokenizer=..., with decode(ids)) "
                         "to read the generated text")
    return list(stop)


def _check_settings(do_sample: bool, temperature: float, top_k: int | None,
                    top_p: float | None) -> None:
    if not isinstance(do_sample, bool):
        raise ValueError(f"do_sample must be True or False, got {do_sample!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number, got {temperature!r}")
    if do_sample:
        check_sampling(temperature=temperature, top_k=top_k, top_p=top_p)
        return
    if not math.isfinite(temperature):  # unused by greedy decoding, but never accepted
        raise OptionError("temperature", f"must be a finite number, got {temperature}")
    check_sampling(top_k=top_k, top_p=top_p)


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
             top_p: float | None = None, eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, attention_mask: Tensor | None = None,
             generator: torch.Generator | None = None, use_cache: bool = True,
             streamer: Callable[[Tensor], None] | None = None, plain_step: bool = True,
             compile: bool = False, compile_backend: str = "inductor",
             repetition_penalty: float = 1.0, stop: Sequence[str] | None = None,
             tokenizer: object = None) -> Tensor:
    """Generate up to ``max_new_tokens`` tokens after each prompt.

    The model runs in eval mode (no dropout) and under ``torch.inference_mode``; its mode is
    restored. The arguments are checked once, here; the steps then run without per-call
    checks, with a cache allocated for the prompt plus ``max_new_tokens`` tokens and written
    in place. The prompt goes through the modules; each new token after it through
    :meth:`~handformer.CausalLM.plain_decode_step` (the same arithmetic as plain tensor
    functions, without the modules' call overhead) where the model allows it (a CausalLM
    with full attention, no hooks listening), else through the modules
    (:meth:`~handformer.CausalLM.decode_step`).

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
        eos_token_id: a sequence that emits it is finished; a list or tuple of ids for
            models with several end tokens (an instruct model's end of turn and end of text).
        pad_token_id: written after a sequence finished (default ``eos_token_id``, the first
            one of a list).
        attention_mask: ``(B, L)`` 1/0, 0 on left padding of the prompts.
        generator: a seeded ``torch.Generator`` makes sampling reproducible.
        use_cache: decode incrementally with the model's cache (same tokens, much faster).
        streamer: called with each new ``(B,)`` token tensor as soon as it is chosen.
        plain_step: decode with the plain-function step where it applies (the default);
            False runs every step through the modules (the same tokens, slower).
        compile: run each decoding step as one graph compiled by ``torch.compile``, on
            fixed-shape caches (:class:`~handformer.attention.cache.StaticKVCache`): the
            first call compiles (a minute or so with Inductor on a small CPU), later calls
            with the same model, batch size and cache size reuse it. Same tokens as the
            eager default, up to rounding. Needs ``use_cache`` and a
            :class:`~handformer.CausalLM` whose attention is full or linear, not quantized
            (``quantize="int8"`` / ``"int4"``: their eager step is their fast path).
        compile_backend: the ``torch.compile`` backend (``"inductor"``; ``"aot_eager"``
            traces the same graph without code generation, for tests).
        repetition_penalty: divides the positive logits (multiplies the negative ones) of
            every token already in the sequence, prompt included, before the temperature
            (transformers' definition; 1 = off, > 1 discourages repeats).
        stop: strings that finish a sequence once its new text holds one (decoded with
            ``tokenizer``). The returned ids include the token that completed it; cut the
            text with :func:`stop_position`.
        tokenizer: decodes ids (``decode(list_of_ids)``); needed with ``stop``.

    Returns:
        ``(B, L + n)`` prompt plus generated ids, ``n <= max_new_tokens`` (fewer when every
        sequence finished early).

    Raises:
        ValueError: for ``max_new_tokens < 0``, ``temperature <= 0`` with sampling,
            ``top_k < 1``, ``top_p`` outside (0, 1], ``repetition_penalty`` not a finite
            number > 0, ``stop`` not a list of non-empty strings (or without a tokenizer,
            or with several prompts and nothing to pad with), token ids outside the
            vocabulary, a
            prompt that with ``max_new_tokens`` does not fit in the context ``max_len``,
            or ``compile=True`` without a cache, with an attention kind it cannot compile or
            on a quantized model.
        TypeError: for a ``generator`` that is not a ``torch.Generator``.
    """
    _check_int("max_new_tokens", max_new_tokens, 0)
    _check_settings(do_sample, temperature, top_k, top_p)
    check_sampling(repetition_penalty=repetition_penalty)
    stops = _check_stop(stop, tokenizer)
    config = model.config
    eos_ids = _eos_ids(eos_token_id)
    for name, value in [("eos_token_id", i) for i in eos_ids] + [("pad_token_id", pad_token_id)]:
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
    if not isinstance(plain_step, bool):
        raise ValueError(f"plain_step must be True or False, got {plain_step!r}")
    run = _compiled_run(model, compile, compile_backend, use_cache)
    pad = (eos_ids[0] if eos_ids else None) if pad_token_id is None else pad_token_id
    eos = torch.tensor(eos_ids, dtype=torch.long, device=input_ids.device) if eos_ids else None
    if stops and B > 1 and pad is None:
        raise ValueError("stop with several prompts needs pad_token_id (or eos_token_id) to "
                         "fill the sequences that stopped")
    ends = _Ends(eos, stops, tokenizer, L, float(repetition_penalty))

    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            ids = _loop(model, input_ids, attention_mask, max_new_tokens, do_sample,
                        temperature, top_k, top_p, ends, pad, generator, use_cache,
                        streamer, run, plain_step and run is None)
    finally:
        model.train(was_training)
    return ids.clone()  # an ordinary tensor: inference-mode tensors refuse in-place edits


# One compiled forward pass per model class and backend; torch.compile keeps a graph per
# model, batch size and cache size under it (and recompiles for a new one).
_COMPILED: dict[tuple[type, str], Callable[..., tuple[Tensor, object]]] = {}


def _compiled_run(model: nn.Module, compile: bool, backend: str, use_cache: bool
                  ) -> Callable[..., tuple[Tensor, object]] | None:
    """``model.run`` compiled for decoding steps (None when ``compile`` is False)."""
    if not isinstance(compile, bool):
        raise ValueError(f"compile must be True or False, got {compile!r}")
    if not compile:
        return None
    if not use_cache:
        raise ValueError("compile=True compiles the cached decoding step: it needs "
                         "use_cache=True")
    if not isinstance(backend, str):
        raise ValueError(f"compile_backend must be a torch.compile backend name, got "
                         f"{backend!r}")
    if not hasattr(model, "decode_step") or not hasattr(model, "run"):
        raise ValueError(f"compile=True needs a model with decode_step() and run() (a "
                         f"handformer CausalLM), got {type(model).__name__}")
    if getattr(model, "_tensor_parallel", None) is not None:  # handformer.distributed
        raise ValueError("compile=True does not compile a tensor-parallel model (its "
                         "collectives run in forward hooks); use compile=False")
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        raise ValueError("compile=True does not compile a quantized model (quantize='int8' "
                         "or 'int4': torch.compile cannot trace its kernels and embedding); "
                         "use compile=False, whose decoding step is the quantized fast path")
    kind = getattr(model.config, "attention", None)
    if kind not in ("full", "linear"):
        raise ValueError(f"compile=True supports attention='full' and 'linear' (caches of "
                         f"a fixed shape), not attention={kind!r}; use compile=False")
    key = (type(model), backend)
    if key not in _COMPILED:
        # Inductor's C++ wrapper calls the step's ~70 kernels from C++ rather than Python
        # (a quarter of a millisecond less per step of a 4-layer model; longer to compile).
        options = {"cpp_wrapper": True} if backend == "inductor" else None
        # dynamic=None: the first graph has fixed sizes; a second batch or cache size makes
        # torch.compile build one with symbolic sizes that serves all later ones (instead of
        # one graph per size, up to its recompile limit).
        _COMPILED[key] = torch.compile(type(model).run, backend=backend, fullgraph=True,
                                       options=options)
    compiled = _COMPILED[key]
    calls = 0

    def run(*args: object, **kwargs: object) -> tuple[Tensor, object]:
        # The first step checks torch.compile's guards (about 1,700 of them for a 4-layer
        # model: every module's type, mode and hooks, every tensor's shape) and picks the
        # graph; nothing they test changes between the steps of one generate() call (same
        # model, caches, shapes and modes), so the later steps skip them (a quarter of a
        # millisecond per step on a 2-core CPU).
        nonlocal calls
        calls += 1
        if calls == 1:
            return compiled(model, *args, **kwargs)
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return compiled(model, *args, **kwargs)

    return run


def _static_capacity(needed: int, max_len: int) -> int:
    """Room for ``needed`` tokens, rounded up to a multiple of 256 (at most ``max_len``), so
    that prompts of similar lengths share one compiled graph."""
    return min(max_len, -(-needed // 256) * 256)


def _loop(model: nn.Module, ids: Tensor, mask: Tensor | None, max_new_tokens: int,
          do_sample: bool, temperature: float, top_k: int | None, top_p: float | None,
          ends: _Ends, pad: int | None, generator: torch.Generator | None,
          use_cache: bool, streamer: Callable[[Tensor], None] | None,
          run: Callable[..., tuple[Tensor, object]] | None, plain: bool) -> Tensor:
    B, L = ids.shape
    out = ids.new_empty(B, L + max_new_tokens)  # prompt + new tokens, filled step by step
    out[:, :L] = ids
    finished = torch.zeros(B, dtype=torch.bool, device=ids.device)
    cache = None
    if use_cache:
        needed = L + max_new_tokens
        cache = (model.new_cache(capacity=_static_capacity(needed, model.config.max_len),
                                 static=True) if run is not None
                 else _new_cache(model, needed))
    step = getattr(model, "decode_step", None)
    keeps_last = "logits_to_keep" in inspect.signature(model.forward).parameters
    fast = None  # the plain step, built after the prompt filled the cache
    token = ids[:, -1]  # (B,) the last token so far
    n = L
    for i in range(max_new_tokens):
        if cache is None:  # recompute the whole sequence (mask grows with it)
            logits = model(out[:, :n], attention_mask=mask).logits[:, -1]
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (B, n + 1)
        elif i == 0:  # the prompt, checked by forward (the LM head on its last token only)
            last = {"logits_to_keep": 1} if keeps_last else {}
            logits = model(ids, attention_mask=mask, cache=cache, **last).logits[:, -1]
            if plain and hasattr(model, "plain_decode_step"):
                fast = model.plain_decode_step(cache)
        elif fast is not None and not hooks_active():  # (hooks listen to the modules only)
            logits = fast(token)  # (B, V)
        elif step is not None:  # trusted step: its inputs were checked above
            logits = step(token[:, None], cache, run)  # token (B,) -> (B, 1)
        else:
            logits = model(token[:, None], cache=cache).logits[:, -1]
        logits = logits.float()  # (B, V)
        if ends.penalty != 1.0:
            logits = apply_repetition_penalty(logits, out[:, :n], ends.penalty)
        if do_sample:
            logits = filter_logits(logits / temperature, top_k=top_k, top_p=top_p)
            probs = torch.softmax(logits, dim=-1)  # (B, V)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)  # (B,)
        else:
            token = logits.argmax(dim=-1)  # (B,)
        if ends.active and pad is not None:
            token = token.masked_fill(finished, pad)
        out[:, n] = token
        n += 1
        if streamer is not None:
            streamer(token)
        if ends.active:
            finished |= ends.finished(token, out[:, :n])
            if bool(finished.all()):
                break
    return out[:, :n]


class _Ends:
    """What finishes a sequence: an end token, or a stop string in its new text; and the
    repetition penalty (carried along with them to keep ``_loop``'s arguments few)."""

    def __init__(self, eos: Tensor | None, stop: list[str], tokenizer: object, prompt_len: int,
                 penalty: float) -> None:
        self.eos, self.stop, self.tokenizer = eos, stop, tokenizer
        self.prompt_len, self.penalty = prompt_len, penalty
        self.active = eos is not None or bool(stop)

    def finished(self, token: Tensor, ids: Tensor) -> Tensor:
        """``(B,)`` True where ``token`` (``(B,)``) ends its sequence; ``ids`` is ``(B, n)``."""
        done = torch.isin(token, self.eos) if self.eos is not None else \
            torch.zeros_like(token, dtype=torch.bool)
        if self.stop:
            new = ids[:, self.prompt_len:].tolist()  # (B, n - L) the generated ids
            hits = [stop_position(self.tokenizer.decode(row), self.stop)[1] for row in new]
            done |= torch.tensor(hits, device=token.device)
        return done


def _eos_ids(eos_token_id: object) -> list:
    """``eos_token_id`` as a list of ids (empty for None); the values are checked by the
    caller. A list, tuple or set must not be empty."""
    if eos_token_id is None:
        return []
    if isinstance(eos_token_id, (list, tuple, set, frozenset)):
        if not eos_token_id:
            raise ValueError("eos_token_id must be a token id or a non-empty list of ids, "
                             "got an empty list")
        return sorted(eos_token_id) if isinstance(eos_token_id, (set, frozenset)) \
            else list(eos_token_id)
    return [eos_token_id]


def _new_cache(model: nn.Module, capacity: int):  # noqa: ANN202 - the model's cache type
    """A cache with room for ``capacity`` tokens (models whose new_cache takes no size: theirs)."""
    if "capacity" in inspect.signature(model.new_cache).parameters:
        return model.new_cache(capacity=capacity)
    return model.new_cache()
