"""Attention kinds by name: the one place a name and its options become a kind.

The command line (``--attention local --window-size 7``), the server's JSON API
(``{"attention": "local", "window_size": 7}``) and the Python loaders
(``load_bert(attention="local", window_size=7)``) all go through :func:`attention_kind`, so
they accept the same names and options and refuse the same mistakes:

* ``"full"`` -> :class:`FullAttention`, ``"linear"`` -> :class:`LinearAttention` (no options);
* ``"local"`` -> ``LocalAttention(window_size)``, ``window_size`` default 5 (two keys on each
  side of the query);
* ``"strided"`` -> ``StridedAttention(stride, global_tokens=...)``, defaults stride 3 and 1
  global token (BERT's ``[CLS]``).

An option given with another kind (``window_size`` with ``"full"``) is refused
(:class:`MisplacedOption`), never ignored.
"""

from __future__ import annotations

from collections.abc import Callable

from handformer.attention.kinds import AttentionKind, FullAttention
from handformer.attention.linear import LinearAttention
from handformer.attention.local import LocalAttention
from handformer.attention.sparse import StridedAttention
from handformer.checks import OptionError

__all__ = ["KIND_NAMES", "KIND_OPTIONS", "KIND_DEFAULTS", "MisplacedOption", "attention_kind",
           "check_kind_options", "resolve_attention"]

KIND_NAMES = ("full", "local", "strided", "linear")
# Each option and the kind it belongs to.
KIND_OPTIONS = {"window_size": "local", "stride": "strided", "global_tokens": "strided"}
KIND_DEFAULTS = {"window_size": 5, "stride": 3, "global_tokens": 1}


class MisplacedOption(OptionError):
    """An option of one attention kind given with another (it would be ignored).

    Attributes:
        name: the option (``window_size``, ``stride``, ``global_tokens``).
        value: its value.
        kind: the kind asked for.
        needs: the kind the option belongs to.
    """

    def __init__(self, name: str, value: object, kind: str, needs: str) -> None:
        self.value, self.kind, self.needs = value, kind, needs
        super().__init__(name, f"applies to attention {needs!r}, not {kind!r}")

    def __str__(self) -> str:
        return (f"{self.name}={self.value!r} {self.problem}; pass attention={self.needs!r} "
                f"or leave {self.name} out")


def check_kind_options(kind: object, **options: object) -> str:
    """Check an attention kind name and the options given with it (None = not given).

    Args:
        kind: one of :data:`KIND_NAMES`.
        **options: ``window_size``, ``stride``, ``global_tokens`` (None = not given).

    Returns:
        ``kind``.

    Raises:
        ValueError: an :class:`OptionError` for an unknown kind (``name`` = ``"attention"``)
            or an unknown option; a :class:`MisplacedOption` for an option of another kind.
    """
    if not isinstance(kind, str) or kind not in KIND_NAMES:
        raise OptionError("attention", f"must be one of {', '.join(KIND_NAMES)}, got {kind!r}")
    for name, value in options.items():
        if name not in KIND_OPTIONS:
            raise OptionError(name, f"is not an attention option; the options are "
                                    f"{', '.join(KIND_OPTIONS)}")
        if value is not None and KIND_OPTIONS[name] != kind:
            raise MisplacedOption(name, value, kind, KIND_OPTIONS[name])
    return kind


def attention_kind(kind: str | AttentionKind, *, window_size: int | None = None,
                   stride: int | None = None, global_tokens: int | None = None
                   ) -> AttentionKind:
    """The attention kind called ``kind``, built with its options.

    Args:
        kind: ``"full"``, ``"local"``, ``"strided"`` or ``"linear"``, or an
            :class:`AttentionKind` (returned as it is; then no option may be given).
        window_size: the window of ``"local"`` (odd; default 5).
        stride: the stride of ``"strided"`` (default 3).
        global_tokens: leading tokens every query sees with ``"strided"`` (default 1).

    Returns:
        A new :class:`AttentionKind`.

    Raises:
        ValueError: an :class:`OptionError` naming the argument: an unknown name, an option
            given with a kind it does not belong to (:class:`MisplacedOption`), or a value
            the kind refuses (an even or too large window, a stride of 0...).
    """
    options = {"window_size": window_size, "stride": stride, "global_tokens": global_tokens}
    if isinstance(kind, AttentionKind):
        given = [name for name, value in options.items() if value is not None]
        if given:
            raise OptionError(given[0], f"is for attention given by name (e.g. "
                                        f"attention={KIND_OPTIONS[given[0]]!r}); "
                                        f"{type(kind).__name__} already holds its options")
        return kind
    check_kind_options(kind, **options)
    value = {name: KIND_DEFAULTS[name] if v is None else v for name, v in options.items()}
    if kind == "local":
        return LocalAttention(value["window_size"])
    if kind == "strided":
        return StridedAttention(value["stride"], global_tokens=value["global_tokens"])
    if kind == "linear":
        return LinearAttention()
    return FullAttention()


def resolve_attention(attention: object, *, window_size: int | None = None,
                      stride: int | None = None, global_tokens: int | None = None
                      ) -> AttentionKind | Callable[[], AttentionKind] | None:
    """What a model or loader's ``attention=`` argument means (see :func:`attention_kind`).

    Args:
        attention: None (full attention), a name, an :class:`AttentionKind` or a zero-argument
            factory returning one.
        window_size, stride, global_tokens: options of a kind given by name.

    Returns:
        None, an :class:`AttentionKind`, or the factory.

    Raises:
        TypeError: for anything else as ``attention``.
        ValueError: an :class:`OptionError` as :func:`attention_kind` raises it, or options
            given with ``None`` (full attention) or a factory.
    """
    options = {"window_size": window_size, "stride": stride, "global_tokens": global_tokens}
    if attention is None:
        check_kind_options("full", **options)
        return None
    if isinstance(attention, (str, AttentionKind)):
        return attention_kind(attention, **options)
    if callable(attention):
        given = [name for name, value in options.items() if value is not None]
        if given:
            raise OptionError(given[0], "is for attention given by name (e.g. "
                                        f"attention={KIND_OPTIONS[given[0]]!r}), not with a "
                                        "factory")
        return attention
    raise TypeError(f"attention must be None, a name ({', '.join(map(repr, KIND_NAMES))}), an "
                    f"attention kind or a factory, got {type(attention).__name__}")
