"""Chat templates: a conversation turned into the prompt text an instruction-tuned model expects.

A model's chat template is a Jinja program shipped inside its files (``tokenizer_config.json``
or a GGUF file's ``tokenizer.chat_template``). It is a stranger's code, so it runs in jinja2's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment`: no attribute starting with ``_``
(``__class__``, ``__globals__``, ...), no unsafe callables, no mutation of the messages. Any such
reach is refused at once with one line (not silently rendered as empty text), and so are
string or list repetitions and powers large enough to exhaust memory.

What a template sees: ``messages`` (a list of ``{"role", "content"}``),
``add_generation_prompt``, the special tokens (``bos_token``, ``eos_token``, ...), the helpers
``raise_exception(message)`` and ``strftime_now(format)``, the filter ``tojson`` (plain
``json.dumps``, not HTML-escaped) and ``namespace``. Blocks trim their newline and leading
spaces (``trim_blocks``, ``lstrip_blocks``), as the templates on the Hub are written for.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache

__all__ = ["render_chat_template", "check_messages", "MAX_REPEAT"]

MAX_REPEAT = 1_000_000  # longest string / list a template may build by repetition
MAX_EXPONENT = 1_000


def render_chat_template(template: str, messages: Sequence[Mapping[str, str]], *,
                         add_generation_prompt: bool = True, **special: object) -> str:
    """Render ``template`` for ``messages`` in a sandbox.

    Args:
        template: the Jinja chat template.
        messages: the conversation, each ``{"role": str, "content": str}`` (other keys are
            passed to the template as they are).
        add_generation_prompt: end with the opening of the assistant's turn, so the model
            writes the answer next.
        **special: more template variables, e.g. ``bos_token="<s>"``.

    Returns:
        The prompt text.

    Raises:
        TypeError: if ``template`` is not a string.
        ValueError: for malformed messages, a template that does not compile, one that calls
            ``raise_exception``, or one that reaches outside the sandbox.
    """
    import jinja2

    if not isinstance(template, str):
        raise TypeError(f"template must be a string, got {type(template).__name__}")
    if not isinstance(add_generation_prompt, bool):
        raise TypeError(f"add_generation_prompt must be True or False, got "
                        f"{add_generation_prompt!r}")
    messages = check_messages(messages)
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: line {exc.lineno}: {exc.message}"
                         ) from None
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **special)
    except jinja2.sandbox.SecurityError as exc:
        raise ValueError(f"chat template refused by the sandbox: {_one_line(exc)}") from None
    except jinja2.TemplateError as exc:  # raise_exception(...) and other template failures
        raise ValueError(f"chat template failed: {_one_line(exc)}") from None


def check_messages(messages: object) -> list[dict[str, object]]:
    """A conversation as a list of fresh dicts, each with string ``role`` and ``content``.

    Raises:
        TypeError: if ``messages`` is not a list of dicts.
        ValueError: naming the message and the field that is missing or not a string.
    """
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                        f"{type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty; give at least one {'role', 'content'} message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                            f"{type(message).__name__}")
        for field in ("role", "content"):
            if field not in message:
                raise ValueError(f"messages[{i}] has no {field!r}; each message is "
                                 "{'role': 'user', 'content': '...'}")
            if not isinstance(message[field], str):
                raise ValueError(f"messages[{i}][{field!r}] must be a string, got "
                                 f"{type(message[field]).__name__}")
        out.append(dict(message))
    return out


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _raise_exception(message: object) -> None:
    import jinja2

    raise jinja2.TemplateError(str(message))


def _tojson(value: object, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(template: str) -> object:
    """The compiled template (cached: a chat loop renders the same template every turn)."""
    return _environment().from_string(template)


@lru_cache(maxsize=1)
def _environment() -> object:
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` refusing names that start with ``_`` (stored attributes would
        otherwise shadow the object's own)."""

        def __init__(*args: object, **kwargs: object) -> None:  # noqa: N805 - jinja's trick
            self, rest = args[0], args[1:]
            for name in dict(*rest, **kwargs):
                Namespace.check(name)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, name: str, value: object) -> None:
            Namespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    class Sandbox(ImmutableSandboxedEnvironment):
        """Refuses every unsafe attribute at once, and bounds ``*`` and ``**``."""

        intercepted_binops = frozenset({"*", "**"})

        def unsafe_undefined(self, obj: object, attribute: str) -> object:
            raise SecurityError(f"access to attribute {attribute!r} of "
                                f"{type(obj).__name__!r} object is unsafe")

        def call_binop(self, context: object, operator_name: str, left: object, right: object
                       ) -> object:
            if operator_name == "**":
                if isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
                    raise SecurityError(f"exponent {right} is above the sandbox's limit of "
                                        f"{MAX_EXPONENT}")
                return operator.pow(left, right)
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                        and len(seq) * times > MAX_REPEAT:
                    raise SecurityError(f"a {type(seq).__name__} of length {len(seq)} "
                                        f"repeated {times} times is above the sandbox's "
                                        f"limit of {MAX_REPEAT} items")
            return operator.mul(left, right)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=Namespace)
    return env
