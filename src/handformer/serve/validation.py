"""Reading and checking request bodies: JSON objects with known fields, or a one-line error.

Every problem becomes a :class:`RequestError` that names the field, which the app answers with
status 422 (413 for a body over :data:`MAX_BODY`). Nothing here touches the file system: no
field is ever a path.

The attention options and the sampling options follow the library's rules, the same the
command line applies: :func:`~handformer.attention.registry.check_kind_options` (an option of
another kind, e.g. ``window_size`` without ``"attention": "local"``, is refused, not ignored)
and :func:`~handformer.models.generation.check_sampling` (non-finite or non-positive
temperatures and negative seeds are refused).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from handformer.attention.registry import MisplacedOption, check_kind_options
from handformer.checks import OptionError
from handformer.models.generation import check_sampling
from handformer.serve.state import KINDS, AttentionChoice, ModelState

__all__ = ["MAX_BODY", "WEIGHT_FORMATS", "RequestError", "BodyTooLarge", "RunRequest",
           "GenerateRequest", "parse_json", "parse_run", "parse_generate", "parse_weights_format",
           "check_fields", "int_field", "check_model"]

MAX_BODY = 64 * 1024  # bytes in a request body
MAX_DEPTH = 32  # levels of [ and { in a request body (the deepest field, heads, needs 3)
MAX_NEW_TOKENS = 512  # with every head's attention streamed; text only: the model's context
# How /api/run and /api/rollout send the viewer's 8-bit weights (the ``weights`` query
# parameter): base64 inside the JSON, or raw bytes after a JSON header (see serve.wire).
WEIGHT_FORMATS = ("json", "binary")

_ATTENTION_FIELDS = ("attention", "window_size", "stride", "global_tokens")
_RUN_FIELDS = {"model", "text", "ids", "text_pair", "heads", "choose_head", "include_sink",
               *_ATTENTION_FIELDS}
MAX_IDS = 8192  # token ids in one request (a causal model's text given as its tokens)
_GENERATE_FIELDS = {"model", "text", "messages", "heads", "max_new_tokens", "temperature",
                    "top_k", "top_p", "seed", "text_only", *_ATTENTION_FIELDS}
MAX_MESSAGES = 64  # turns of a chat conversation in one request
_ROLES = ("system", "user", "assistant")


class RequestError(ValueError):
    """A bad request body: ``field`` names the culprit (None for the body as a whole)."""

    def __init__(self, field: str | None, message: str) -> None:
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class BodyTooLarge(ValueError):
    """The request body is over :data:`MAX_BODY` bytes."""

    def __init__(self, size: int | None = None) -> None:
        got = f" (got {size} bytes)" if size is not None else ""
        super().__init__(f"request body is over the limit of {MAX_BODY} bytes{got}")


@dataclass(frozen=True)
class RunRequest:
    """A checked body of ``/api/run``, ``/api/ablate`` or ``/api/rollout``.

    Attributes:
        text: the text (not empty).
        text_pair: a second text (encoders: its embedding is compared with ``text``'s).
        attention: the attention setting.
        heads: ``(layer, head)`` pairs to ablate, sorted, without repeats.
        choose_head: open the viewer data on the head ``handformer viz`` would choose
            (costs a pass over every weight; the page asks for it once per model).
        ids: causal models: the text as token ids (what a generation made), instead of
            ``text`` (then the text they decode to).
        include_sink: count the first token (an attention sink) in ``choose_head`` and in the
            viewer's colour scales, as ``handformer viz --include-sink`` does.
    """

    text: str
    text_pair: str | None
    attention: AttentionChoice
    heads: tuple[tuple[int, int], ...]
    choose_head: bool = False
    ids: tuple[int, ...] | None = None
    include_sink: bool = False


@dataclass(frozen=True)
class GenerateRequest:
    """A checked body of ``/api/generate`` (``text`` is the prompt; for a chat, ``messages``
    rendered by the model's chat template, and ``chat`` is True; ``text_only``: no attention
    in the token events, and the model's context as the limit instead of the viewer's)."""

    text: str
    attention: AttentionChoice
    heads: tuple[tuple[int, int], ...]
    max_new_tokens: int
    temperature: float | None
    top_k: int | None
    top_p: float | None
    seed: int
    chat: bool = False
    text_only: bool = False


def parse_json(body: bytes) -> dict[str, object]:
    """The body as a JSON object.

    Raises:
        RequestError: for a body that is not UTF-8 JSON holding an object.
    """
    if not body.strip():
        raise RequestError(None, "the request body is empty; send a JSON object such as "
                                 '{"text": "..."}')
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(None, "the request body is not UTF-8 text") from None
    _check_depth(text)  # before the parser recurses that deep
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise RequestError(None, f"the request body is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise RequestError(None, f"the request body must be a JSON object, got "
                                 f"{type(value).__name__}")
    return value


_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[][{}:]')


def _check_depth(text: str) -> None:
    """Refuse JSON nested deeper than :data:`MAX_DEPTH`, naming the top-level field it is in
    (read from the brackets and strings alone: the parser would recurse that deep)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    depth, field, last = 0, None, None
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token in ("[", "{"):
            depth += 1
            if depth > MAX_DEPTH:
                what = f"is nested deeper than {MAX_DEPTH} levels of [ and {{"
                if field is None:
                    raise RequestError(None, f"the request body {what}")
                raise RequestError(field, f"{what}; no field needs more than 3")
        elif token in ("]", "}"):
            depth -= 1
        elif token == ":":
            if depth == 1 and last is not None:
                field = last[1:-1][:40]
        else:
            last = token


def check_fields(body: dict[str, object], allowed: set[str]) -> None:
    """Refuse a body with a field outside ``allowed`` (the first one, in sorted order).

    Args:
        body: the JSON object.
        allowed: the endpoint's field names.

    Raises:
        RequestError: naming the unknown field and listing the valid ones.
    """
    extra = sorted(set(body) - allowed)
    if extra:
        raise RequestError(extra[0], f"unknown field; valid fields are "
                                     f"{', '.join(sorted(allowed))}")


def int_field(body: dict[str, object], name: str, default: int | None, lo: int, hi: int
              ) -> int:
    """The integer field ``name`` of ``body``, in ``lo..hi``.

    An absent field takes ``default``; with no default (None), or sent as ``null``, the field
    is missing.

    Args:
        body: the JSON object.
        name: the field.
        default: its value when absent (None: the field is required).
        lo, hi: the smallest and the largest value allowed.

    Returns:
        The value.

    Raises:
        RequestError: naming the field when it is missing, not an integer, or out of range.
    """
    value = body.get(name, default)
    if value is None:
        raise RequestError(name, "is missing")
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"must be an integer, got {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise RequestError(name, f"must be in {lo}..{hi}, got {value}")
    return value


def check_model(body: dict[str, object], registry: object, served: str, what: str) -> str:
    """The ``model`` field of an endpoint that serves one model's extras (dictionaries,
    transcoders): a model the server knows, and that one.

    Args:
        body: the JSON object.
        registry: the server's models (:class:`~handformer.serve.registry.ModelRegistry`).
        served: the name of the model the extras belong to.
        what: the extras, for the message (``"dictionaries"``, ``"transcoders"``).

    Returns:
        The model's name.

    Raises:
        RequestError: naming ``model``.
    """
    name = registry.check_name(body.get("model"))
    if name != served:
        raise RequestError("model", f"the {what} are for {served!r}, not {name!r}")
    return name


def _optional_int(body: dict[str, object], name: str, default: int | None, lo: int, hi: int
                  ) -> int | None:
    """The integer field ``name`` in ``lo..hi``, or ``default`` when it is absent or ``null``
    (where :func:`int_field` calls a ``null`` field missing)."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"must be an integer, got {json.dumps(value)[:40]}")
    if not lo <= value <= hi:
        raise RequestError(name, f"must be in {lo}..{hi}, got {value}")
    return value


def _number(body: dict[str, object], name: str) -> float | None:
    """A JSON number or None (NaN and infinities pass here: the rule that follows refuses)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(name, f"must be a number, got {json.dumps(value)[:40]}")
    return value


def _integer(body: dict[str, object], name: str) -> int | None:
    """A JSON integer or None (its range is the rule's business)."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"must be an integer, got {json.dumps(value)[:40]}")
    return value


def _field_error(exc: OptionError) -> RequestError:
    """A library :class:`~handformer.checks.OptionError` as a request error on its field."""
    if isinstance(exc, MisplacedOption):
        return RequestError(exc.name, f"applies to attention {json.dumps(exc.needs)}, not "
                                      f"{json.dumps(exc.kind)}; send \"attention\": "
                                      f"{json.dumps(exc.needs)} or leave {exc.name} out")
    return RequestError(exc.name, exc.problem)


def _text(body: dict[str, object], name: str, *, required: bool) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if value is None:
        raise RequestError(name, "is missing; send the text to run the model on")
    if not isinstance(value, str):
        raise RequestError(name, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        if not required:
            return None  # an empty second box means "no pair"
        raise RequestError(name, "is empty; send some words")
    if any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise RequestError(name, "holds lone surrogate characters (not valid Unicode)")
    return value


def _attention(body: dict[str, object], state: ModelState) -> AttentionChoice:
    default = state.default_attention
    kind = body.get("attention")
    if kind is None:
        kind = default.kind
    if kind is False:
        raise RequestError("attention", 'names the attention kind; for text without attention '
                                        'weights send "text_only": true')
    if not isinstance(kind, str) or kind not in KINDS:
        raise RequestError("attention", f"must be one of {', '.join(KINDS)}, got "
                                        f"{json.dumps(kind)[:40]}")
    given = {name: _integer(body, name) for name in ("window_size", "stride", "global_tokens")}
    try:
        check_kind_options(kind, **given)  # an option of another kind is refused
        choice = AttentionChoice(kind, **{name: getattr(default, name) if value is None
                                          else value for name, value in given.items()})
        choice.make()  # the kind's own checks (odd window, bounds...)
    except OptionError as exc:
        raise _field_error(exc) from None
    return choice


def _heads(body: dict[str, object], state: ModelState) -> tuple[tuple[int, int], ...]:
    value = body.get("heads")
    if value is None:
        return ()
    N, H = state.num_layers, state.num_heads
    if not isinstance(value, list):
        raise RequestError("heads", 'must be a list of [layer, head] pairs, e.g. [[0, 1]]')
    out = set()
    for item in value:
        if (not isinstance(item, list) or len(item) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in item)):
            raise RequestError("heads", f"each entry must be a [layer, head] pair of integers, "
                                        f"got {json.dumps(item)[:40]}")
        layer, head = item
        if not (0 <= layer < N and 0 <= head < H):
            raise RequestError("heads", f"[{layer}, {head}] is out of range: layers are "
                                        f"0..{N - 1}, heads 0..{H - 1}")
        out.add((layer, head))
    return tuple(sorted(out))


def parse_run(body: dict[str, object], state: ModelState) -> RunRequest:
    """Check the body of ``/api/run``, ``/api/ablate`` or ``/api/rollout``.

    Raises:
        RequestError: naming the first bad field.
    """
    check_fields(body, _RUN_FIELDS)
    ids = _ids(body, state)
    text = _text(body, "text", required=ids is None)
    if ids is not None:
        if text is not None:
            raise RequestError("ids", "give either text or ids, not both")
        text = state.tokenizer.decode(list(ids))
    pair = _text(body, "text_pair", required=False)
    if pair is not None and state.causal:
        raise RequestError("text_pair", "applies to encoders (embedding similarity); this is "
                                        "a causal language model")
    choose, sink = body.get("choose_head", False), body.get("include_sink", False)
    for name, value in (("choose_head", choose), ("include_sink", sink)):
        if not isinstance(value, bool):
            raise RequestError(name, f"must be true or false, got {json.dumps(value)[:40]}")
    return RunRequest(text, pair, _attention(body, state), _heads(body, state), choose, ids,
                      sink)


def _ids(body: dict[str, object], state: ModelState) -> tuple[int, ...] | None:
    value = body.get("ids")
    if value is None:
        return None
    if not state.causal:
        raise RequestError("ids", "applies to causal language models; send text")
    V = state.model.config.vocab_size
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_IDS:
        raise RequestError("ids", f"must be a list of 1..{MAX_IDS} token ids")
    for i in value:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < V:
            raise RequestError("ids", f"each id must be an integer in 0..{V - 1}, got "
                                      f"{json.dumps(i)[:40]}")
    return tuple(value)


def parse_generate(body: dict[str, object], state: ModelState) -> GenerateRequest:
    """Check the body of ``/api/generate``.

    Raises:
        RequestError: naming the first bad field (or the model, for an encoder).
    """
    if not state.causal:
        raise RequestError(None, f"{state.name} is an encoder; /api/generate needs a causal "
                                 "language model folder (handformer serve --model DIR)")
    check_fields(body, _GENERATE_FIELDS)
    chat = body.get("messages") is not None
    if chat and body.get("text") is not None:
        raise RequestError("messages", "give either text (a prompt) or messages (a chat), "
                                       "not both")
    text = _chat_prompt(body, state) if chat else _text(body, "text", required=True)
    text_only = body.get("text_only", False)
    if not isinstance(text_only, bool):
        raise RequestError("text_only", f"must be true or false, got "
                                        f"{json.dumps(text_only)[:40]}")
    attention, heads = _attention(body, state), _heads(body, state)
    # Text only, a reply may run to the model's context; with attention, every token's line
    # holds every head's weights, so the viewer's limit applies.
    most = getattr(state, "context", MAX_NEW_TOKENS) if text_only else MAX_NEW_TOKENS
    max_new_tokens = _optional_int(body, "max_new_tokens", 20, 1, most)
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    top_k, seed = _integer(body, "top_k"), _integer(body, "seed")
    try:
        check_sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except OptionError as exc:
        raise _field_error(exc) from None
    return GenerateRequest(
        text, attention, heads, max_new_tokens=max_new_tokens,
        temperature=None if temperature is None else float(temperature), top_k=top_k,
        top_p=None if top_p is None else float(top_p), seed=0 if seed is None else seed,
        chat=chat, text_only=text_only)


def _chat_prompt(body: dict[str, object], state: ModelState) -> str:
    """The prompt the model's chat template makes of ``messages`` (checked first)."""
    render = state.tokenizer.apply_chat_template
    if not state.tokenizer.chat_template:
        raise RequestError("messages", f"{state.name} has no chat template; send text instead")
    value = body["messages"]
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_MESSAGES:
        raise RequestError("messages", f"must be a list of 1..{MAX_MESSAGES} "
                                       '{"role": ..., "content": ...} objects')
    messages = []
    for item in value:
        if (not isinstance(item, dict) or set(item) != {"role", "content"}
                or item["role"] not in _ROLES or not isinstance(item["content"], str)):
            raise RequestError("messages", f"each message must be {{\"role\": one of "
                                           f"{', '.join(_ROLES)}, \"content\": text}}, got "
                                           f"{json.dumps(item)[:60]}")
        if any(0xD800 <= ord(c) <= 0xDFFF for c in item["content"]):
            raise RequestError("messages", "holds lone surrogate characters (not valid Unicode)")
        messages.append({"role": item["role"], "content": item["content"]})
    try:
        text = render(messages, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template may refuse a conversation
        raise RequestError("messages", f"the chat template refused them: "
                                       f"{' '.join(str(exc).split())}") from None
    if not isinstance(text, str) or not text.strip():
        raise RequestError("messages", "the chat template made an empty prompt")
    return text


def parse_weights_format(query: list[tuple[str, str]], path: str, *,
                         accepts_weights: bool) -> str:
    """Check the query string of a POST endpoint: only ``weights``, and only where the answer
    holds attention weights.

    Args:
        query: the ``(name, value)`` pairs of the query string, in order.
        path: the endpoint, for the message (e.g. ``"/api/ablate"``).
        accepts_weights: whether the endpoint returns viewer weights (run, rollout).

    Returns:
        ``"json"`` (the default) or ``"binary"``.

    Raises:
        RequestError: naming the first unknown or repeated parameter, or a bad ``weights``.
    """
    names = [name for name, _ in query]
    for name in names:
        if name != "weights" or not accepts_weights:
            valid = "the only one is weights" if accepts_weights else f"{path} takes none"
            raise RequestError(name[:40] or "(empty)", f"unknown query parameter; {valid}")
    if names.count("weights") > 1:
        raise RequestError("weights", f"is given {names.count('weights')} times; give it once")
    value = dict(query).get("weights", "json")
    if value not in WEIGHT_FORMATS:
        raise RequestError("weights", f"must be one of {', '.join(WEIGHT_FORMATS)}, got "
                                      f"{json.dumps(value)[:40]}")
    return value
