"""Chat templates: a conversation turned into the prompt text an instruction-tuned model expects.

A model's chat template is a Jinja program shipped inside its files (``tokenizer_config.json``
or a GGUF file's ``tokenizer.chat_template``). It is a stranger's code, so it runs in jinja2's
:class:`~jinja2.sandbox.ImmutableSandboxedEnvironment`: no attribute starting with ``_``
(``__class__``, ``__globals__``, ...), no unsafe callables, no mutation of the messages. Any such
reach is refused at once with one line (not silently rendered as empty text). A rendering also
has a budget (:class:`~handformer.chat.sandbox.RenderBudget`: wall time, loop
iterations and calls, characters written, the size of strings, lists and integers it builds),
checked inside the sandbox as the template runs: a template that would loop for ever or fill
the memory is refused in one line naming the file, within about the budget's time.

What a template sees: ``messages`` (a list of ``{"role", "content"}``),
``add_generation_prompt``, the special tokens (``bos_token``, ``eos_token``, ...), the helpers
``raise_exception(message)`` and ``strftime_now(format)``, the filter ``tojson`` (plain
``json.dumps``, not HTML-escaped) and ``namespace``. Blocks trim their newline and leading
spaces (``trim_blocks``, ``lstrip_blocks``), as the templates on the Hub are written for.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from handformer.chat.sandbox import RenderBudget

__all__ = ["render_chat_template", "check_messages", "ChatTemplateError"]

MAX_JSON_INDENT = 16  # tojson(indent=...): more only multiplies the text


class ChatTemplateError(ValueError):
    """A chat template that does not compile, fails, reaches outside its sandbox or goes over
    its budget: no prompt can be made with it."""


def render_chat_template(template: str, messages: Sequence[Mapping[str, str]], *,
                         add_generation_prompt: bool = True, source: str | None = None,
                         budget: RenderBudget | None = None, **special: object) -> str:
    """Render ``template`` for ``messages`` in a sandbox, within ``budget``.

    Args:
        template: the Jinja chat template.
        messages: the conversation, each ``{"role": str, "content": str}`` (other keys are
            passed to the template as they are).
        add_generation_prompt: end with the opening of the assistant's turn, so the model
            writes the answer next.
        source: where the template comes from (a file or folder), named in errors.
        budget: the most the rendering may use (default: ``RenderBudget()``, 2 s, 100,000
            steps, 4 M characters written, values of 1 M items, integers of 4096 bits).
        **special: more template variables, e.g. ``bos_token="<s>"``.

    Returns:
        The prompt text.

    Raises:
        TypeError: if ``template`` is not a string.
        ValueError: for malformed messages.
        ChatTemplateError: (a ValueError) for a template that does not compile, one that calls
            ``raise_exception`` or fails otherwise, one that reaches outside the sandbox or
            goes over its budget.
    """
    import jinja2

    from handformer.chat.sandbox import RenderBudget, metered

    if not isinstance(template, str):
        raise TypeError(f"template must be a string, got {type(template).__name__}")
    if not isinstance(add_generation_prompt, bool):
        raise TypeError(f"add_generation_prompt must be True or False, got "
                        f"{add_generation_prompt!r}")
    if budget is None:
        budget = RenderBudget()
    elif not isinstance(budget, RenderBudget):
        raise TypeError(f"budget must be a RenderBudget, got {type(budget).__name__}")
    messages = check_messages(messages)
    where = "" if source is None else f"{source}: "
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{where}chat template does not compile: line {exc.lineno}: "
                                f"{exc.message}") from None
    except (RecursionError, MemoryError, SyntaxError) as exc:  # e.g. 10,000 nested "("
        raise ChatTemplateError(f"{where}chat template does not compile: "
                                f"{type(exc).__name__}: {_one_line(exc)}") from None
    try:
        with metered(budget) as meter:
            pieces = []
            for piece in compiled.generate(messages=messages,
                                           add_generation_prompt=add_generation_prompt,
                                           **special):
                meter.check_time()  # the prompt's length: concat below
                pieces.append(piece)
            return compiled.environment.concat(pieces)
    except jinja2.sandbox.SecurityError as exc:  # the budget's refusals included
        raise ChatTemplateError(f"{where}chat template refused by the sandbox: "
                                f"{_one_line(exc)}") from None
    except jinja2.TemplateError as exc:  # raise_exception(...) and other template failures
        raise ChatTemplateError(f"{where}chat template failed: {_one_line(exc)}") from None
    except MemoryError:  # what the budget did not foresee: still one line
        raise ChatTemplateError(f"{where}chat template failed: it ran out of memory") from None
    except Exception as exc:  # noqa: BLE001 - a stranger's program: any failure is its own
        raise ChatTemplateError(f"{where}chat template failed: {type(exc).__name__}: "
                                f"{_one_line(exc)}") from None


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


def _tojson(value: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    width = len(indent) if isinstance(indent, str) else indent
    if isinstance(width, int) and width > MAX_JSON_INDENT:
        raise ValueError(f"tojson's indent must be at most {MAX_JSON_INDENT}, got {indent!r}")
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
    from jinja2.sandbox import SecurityError

    from handformer.chat.sandbox import TemplateSandbox

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

    env = TemplateSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[jinja2.ext.loopcontrols])
    env.add_filter("tojson", _tojson)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=Namespace)
    return env
