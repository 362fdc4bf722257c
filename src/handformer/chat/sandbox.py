"""The sandbox chat templates run in: jinja2's immutable sandbox, with a budget.

A chat template is a stranger's program (it comes inside a GGUF file or a model folder).
jinja2's :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` keeps it away from Python's
internals; this module also keeps it from running forever or exhausting memory. A
:class:`RenderBudget` bounds one rendering, and every bound is checked inside the sandbox
while the template runs, before the costly operation (never after the fact):

- ``seconds``: wall time;
- ``steps``: loop iterations, calls, filters and arithmetic operators;
- ``output``: characters written, counting the text written into macros and ``{% set %}``
  blocks as well as the prompt itself;
- ``items``: the size of any value the template builds or prints: the characters of a
  string, the items of a list, tuple or dict counted through every level of nesting;
- ``int_bits``: the size of an integer.

Where the checks sit: every ``for`` loop iterates through a counter (the code generator wraps
the loop's iterable); every operator (``+ - * / // % **``), call and filter passes a hook that
checks its operands first (``'a' * n``, ``x ** n``, ``sep.join(xs)``, ``s.replace(a, b)``,
``'%*d' % (n, 1)``, ``'{:>{}}'.format(x, n)``...); every list, tuple and dict literal, every
``~`` concatenation and every printed value is measured; every text buffer is measured before
it is joined. A refusal is a :class:`BudgetExceeded` (a jinja2
:class:`~jinja2.sandbox.SecurityError`) that says which bound was passed.
"""

from __future__ import annotations

import functools
import inspect
import math
import operator
import re
import string
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import jinja2.ext
import jinja2.utils
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

__all__ = ["RenderBudget", "BudgetExceeded", "TemplateSandbox", "metered"]


@dataclass(frozen=True)
class RenderBudget:
    """The most one rendering of a chat template may use.

    Attributes:
        seconds: wall time.
        steps: loop iterations, calls, filters and operators (a chat template takes a few
            dozen per message).
        output: characters written in all (the prompt, macros' and ``{% set %}`` blocks' text).
        items: characters of a string, or items of a list / tuple / dict through every level
            of nesting, that one value may hold.
        int_bits: bits of an integer.

    Raises:
        ValueError: for a bound that is not positive.
    """

    seconds: float = 2.0
    steps: int = 100_000
    output: int = 4_000_000
    items: int = 1_000_000
    int_bits: int = 4096

    def __post_init__(self) -> None:
        for name in ("seconds", "steps", "output", "items", "int_bits"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"RenderBudget.{name} must be a positive number, got {value!r}")


class BudgetExceeded(SecurityError):
    """A template went over its :class:`RenderBudget` (the message names the bound)."""


class _Meter:
    """What one rendering has used so far."""

    def __init__(self, limits: RenderBudget) -> None:
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds
        self.steps = 0
        self.written = 0
        # Sizes of lists, tuples and dicts measured before (they cannot change inside the
        # immutable sandbox), by id, with the object to keep its id: shared parts are
        # walked once. The objects it keeps alive hold at most 2 x items in all.
        self.sizes: dict[int, tuple[object, int]] = {}
        self.cached = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.limits.steps:
            raise BudgetExceeded(f"it takes more than {self.limits.steps} steps (loop "
                                 "iterations, calls, filters, operators), above the "
                                 "sandbox's limit")
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise BudgetExceeded(f"it runs for more than {self.limits.seconds:g} s, above the "
                                 "sandbox's limit")

    def write(self, n: int) -> None:
        self.written += n
        if self.written > self.limits.output:
            raise BudgetExceeded(f"it writes more than {self.limits.output} characters, above "
                                 "the sandbox's limit")

    def check_int(self, value: int) -> None:
        if value.bit_length() > self.limits.int_bits:
            raise BudgetExceeded(f"an integer of {value.bit_length()} bits is above the "
                                 f"sandbox's limit of {self.limits.int_bits} bits")

    def check_items(self, n: int, what: str) -> None:
        if n > self.limits.items:
            raise BudgetExceeded(f"{what} of {n} items is above the sandbox's limit of "
                                 f"{self.limits.items} items")

    def size(self, value: object) -> int:
        """The items ``value`` holds through every level (a string counts its characters, at
        least 1; any other value 1, plus its items), counted only until they pass the limit;
        integers are checked on the way."""
        if isinstance(value, (str, bytes, bytearray)):
            return max(1, len(value))
        known = self.sizes.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        limit, total, seen, mutable = self.limits.items, 1, 0, False
        stack = [value]
        while stack and total <= limit:
            v = stack.pop()  # counted as 1 already
            seen += 1
            if not seen & 4095:
                self.check_time()
            if isinstance(v, (str, bytes, bytearray)):
                total += max(0, len(v) - 1)
            elif isinstance(v, int):
                if not isinstance(v, bool):
                    self.check_int(v)
            elif v is not value and (known := self.sizes.get(id(v))) is not None \
                    and known[0] is v:
                total += known[1] - 1
            elif isinstance(v, (list, tuple, set, frozenset, dict, jinja2.utils.Namespace)):
                if isinstance(v, jinja2.utils.Namespace):  # the one mutable container
                    mutable = True
                    v = object.__getattribute__(v, "_Namespace__attrs")
                items = [*v, *v.values()] if isinstance(v, dict) else v
                total += len(items)
                if total <= limit:
                    stack.extend(items)
            elif isinstance(v, range):
                total += len(v)
        if not mutable and total <= limit and isinstance(value, (list, tuple, dict)):
            if self.cached + total > 2 * limit:
                self.sizes.clear()
                self.cached = 0
            self.sizes[id(value)] = (value, total)
            self.cached += total
        return total

    def check_size(self, value: object, what: str) -> int:
        """The size of ``value`` (:meth:`size`), refused above the limit."""
        n = self.size(value)
        if n > self.limits.items:
            raise BudgetExceeded(f"{what} holds more than {self.limits.items} items (characters "
                                 "of a string, items of a list through every level), above "
                                 "the sandbox's limit")
        return n


_ACTIVE: ContextVar[_Meter | None] = ContextVar("handformer_template_meter", default=None)


def _meter() -> _Meter:
    """The current rendering's meter (a fresh default one outside :func:`metered`: a template
    rendered with the environment directly still has the default budget, per call)."""
    meter = _ACTIVE.get()
    return _Meter(RenderBudget()) if meter is None else meter


@contextmanager
def metered(limits: RenderBudget) -> Iterator[_Meter]:
    """Meter every template rendered in this block against ``limits``."""
    token = _ACTIVE.set(_Meter(limits))
    try:
        yield _ACTIVE.get()
    finally:
        _ACTIVE.reset(token)


# ---- what an operation would build, estimated before it runs --------------------------------

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_widths(meter: _Meter, numbers: list[str], what: str) -> None:
    for number in numbers:
        if number and number.isdigit() and int(number) > meter.limits.items:
            raise BudgetExceeded(f"{what} asks for a width of {number}, above the sandbox's "
                                 f"limit of {meter.limits.items} items")


def _check_percent(meter: _Meter, fmt: str) -> None:
    """``fmt % args``: the widths and precisions written in ``fmt`` (``*`` ones come from
    the arguments, which are checked as integers)."""
    widths = [n for m in _PERCENT_SPEC.finditer(fmt) for n in m.groups() if n]
    _check_widths(meter, widths, "a % format")


def _check_format(meter: _Meter, fmt: str) -> None:
    """``fmt.format(...)``: the numbers in each field's format spec."""
    try:
        specs = [spec for _, _, spec, _ in string.Formatter().parse(fmt) if spec]
    except ValueError:
        return  # a malformed format string fails by itself
    _check_widths(meter, [n for spec in specs for n in re.findall(r"\d+", spec)],
                  "a format string")


def _check_joined(meter: _Meter, sep: object, items: list[object]) -> None:
    n = len(sep) * max(0, len(items) - 1) if isinstance(sep, (str, bytes)) else 0
    meter.check_items(n, "a joined text")  # the separators alone, before the items
    meter.check_items(n + meter.size(items), "a joined text")


def _check_replaced(meter: _Meter, s: object, old: object, new: object,
                    count: object = -1) -> None:
    if not (isinstance(s, str) and isinstance(old, str) and isinstance(new, str)):
        return
    found = len(s) + 1 if old == "" else s.count(old)
    if isinstance(count, int) and 0 <= count < found:
        found = count
    meter.check_items(len(s) + found * max(0, len(new) - len(old)), "a replaced text")


def _check_power(meter: _Meter, left: object, right: object) -> None:
    if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        bits = int(right * math.log2(abs(left))) + 1  # of the result, at most
        if bits > meter.limits.int_bits:
            raise BudgetExceeded(f"a power of about {bits} bits ({left.bit_length()}-bit base, "
                                 f"exponent {right}) is above the sandbox's limit of "
                                 f"{meter.limits.int_bits} bits")


def _check_product(meter: _Meter, left: object, right: object) -> None:
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
            each = meter.size(seq) - (0 if isinstance(seq, str) else 1)  # not the container
            n = max(1, each) * max(0, times)
            if n > meter.limits.items:
                raise BudgetExceeded(f"a {type(seq).__name__} of length {len(seq)} repeated "
                                     f"{times} times is above the sandbox's limit of "
                                     f"{meter.limits.items} items")
            return
    if isinstance(left, int) and isinstance(right, int):
        bits = left.bit_length() + right.bit_length()
        if bits > meter.limits.int_bits:
            raise BudgetExceeded(f"a product of up to {bits} bits is above the sandbox's "
                                 f"limit of {meter.limits.int_bits} bits")


def _check_arguments(meter: _Meter, args: tuple[object, ...], kwargs: Mapping[str, object],
                     what: str) -> None:
    """Every argument a call or filter gets: sizes, and no integer above ``items`` (a width,
    a count: what ``center``, ``ljust``, ``zfill``, ``batch`` would allocate)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            meter.check_int(value)
            if abs(value) > meter.limits.items:
                raise BudgetExceeded(f"{what} gets the number {value}, above the sandbox's "
                                     f"limit of {meter.limits.items} items")
        elif not isinstance(value, (LoopContext, jinja2.runtime.Undefined)):
            meter.check_size(value, f"an argument of {what}")


def _check_method(meter: _Meter, method: object, args: tuple[object, ...],
                  kwargs: Mapping[str, object]) -> tuple[object, ...]:
    """The string methods whose result can outgrow their arguments (the arguments, with a
    generator given to ``join`` made a list)."""
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, (str, bytes)):
        return args
    if name == "join" and args:
        items = list(args[0])
        _check_joined(meter, owner, items)
        return (items, *args[1:])
    if name == "replace" and len(args) >= 2:
        _check_replaced(meter, owner, *args[:3])
    elif name == "expandtabs":
        size = (args or [kwargs.get("tabsize", 8)])[0]
        if isinstance(size, int):
            meter.check_items(len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t")
                              * max(0, size), "an expanded text")
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        meter.check_items(len(owner) * max(1, longest), "a translated text")
    return args


# ---- the filters, each behind a guard ---------------------------------------------------------

# Filters that neither print nor copy what they are given beyond its top level: their input
# is not measured again (a template calls ``messages|length`` in every turn).
_CHEAP_FILTERS = frozenset({"length", "count", "first", "last", "default", "d", "attr", "items",
                            "map", "select", "reject", "selectattr", "rejectattr", "list",
                            "sort", "unique", "reverse", "dictsort", "groupby", "min", "max",
                            "batch", "slice", "random", "sum", "int", "float", "abs", "round",
                            "safe", "tojson"})


def _filter_join(meter: _Meter, a: dict[str, object]) -> None:
    a["value"] = items = list(a["value"])  # a generator is read once, here
    _check_joined(meter, a["d"], items)


def _filter_indent(meter: _Meter, a: dict[str, object]) -> None:
    s, width = a["s"], a["width"]
    if isinstance(s, str):
        w = width if isinstance(width, int) else len(str(width))
        meter.check_items(len(s) + (s.count("\n") + 1) * max(0, w), "an indented text")


def _filter_replace(meter: _Meter, a: dict[str, object]) -> None:
    count = -1 if a["count"] is None else a["count"]
    _check_replaced(meter, a["s"], a["old"], a["new"], count)


def _filter_wordwrap(meter: _Meter, a: dict[str, object]) -> None:
    s, wrap = a["s"], a["wrapstring"]
    if isinstance(s, str):
        meter.check_items(len(s) * (1 + (len(wrap) if isinstance(wrap, str) else 1)),
                          "a wrapped text")


def _filter_format(meter: _Meter, a: dict[str, object]) -> None:
    if isinstance(a["value"], str):
        _check_percent(meter, a["value"])


# Checks of the filters whose result can outgrow their input, given the bound arguments.
_FILTER_CHECKS: dict[str, Callable[[_Meter, dict[str, object]], None]] = {
    "join": _filter_join, "indent": _filter_indent, "replace": _filter_replace,
    "wordwrap": _filter_wordwrap, "format": _filter_format}


def _guard_filter(name: str, fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` behind the budget: a step, its arguments checked, its result measured."""
    passes = getattr(fn, "jinja_pass_arg", None) is not None  # context / environment first
    check, cheap = _FILTER_CHECKS.get(name), name in _CHEAP_FILTERS
    signature = inspect.signature(fn) if check is not None else None

    @functools.wraps(fn)  # keeps jinja_pass_arg
    def guarded(*args: object, **kwargs: object) -> object:
        meter = _meter()
        meter.step()
        if check is not None:  # what this filter would build, first
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            check(meter, bound.arguments)
            args, kwargs = bound.args, bound.kwargs
        data = args[1:] if passes else args
        if data:
            _check_arguments(meter, data[1:], kwargs, f"filter {name}")
            if not cheap:
                meter.check_size(data[0], f"the input of filter {name}")
        result = fn(*args, **kwargs)
        if isinstance(result, (str, list, tuple, dict, int)):
            meter.check_size(result, f"the result of filter {name}")
        return result

    return guarded


# ---- the environment ----------------------------------------------------------------------------


class _Generator(CodeGenerator):
    """jinja2's code generator, with loops counted and literals and ``~`` measured."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._loop_iters: set[int] = set()  # ids of the for loops' iterables

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        self._loop_iters.add(id(node.iter))
        super().visit_For(node, frame)

    def visit(self, node: nodes.Node, *args: object, **kwargs: object) -> object:
        if id(node) not in self._loop_iters:
            return super().visit(node, *args, **kwargs)
        self._loop_iters.discard(id(node))
        self.write("environment.counted(")  # a loop's iterable: one step per item
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.joined((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def _measured(self, visit: Callable[..., None], node: nodes.Expr, frame: Frame) -> None:
        if getattr(node, "ctx", "load") != "load":  # an assignment target
            visit(node, frame)
            return
        self.write("environment.measured(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._measured(super().visit_List, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        self._measured(super().visit_Tuple, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._measured(super().visit_Dict, node, frame)


_BINOPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
           "//": operator.floordiv, "%": operator.mod, "**": operator.pow}


class TemplateSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, metered by the :class:`RenderBudget` of the
    :func:`metered` block it renders in (options as for jinja2's environments)."""

    code_generator_class = _Generator
    intercepted_binops = frozenset(_BINOPS)

    def __init__(self, **options: object) -> None:
        # Nothing is evaluated while compiling (jinja folds constant expressions, filters
        # included, unless told not to): all of it runs under the budget.
        super().__init__(finalize=self._printed, optimized=False, **options)
        self.globals.pop("lipsum", None)  # lipsum(n) writes n paragraphs: not for prompts
        self.filters = {name: _guard_filter(name, fn) for name, fn in self.filters.items()}

    def add_filter(self, name: str, fn: Callable[..., object]) -> None:
        """Add a filter, behind the same guard as the built-in ones."""
        self.filters[name] = _guard_filter(name, fn)

    # Hooks the generated code calls (see _Generator) ------------------------------------------

    @staticmethod
    def counted(iterable: object) -> Iterator[object]:
        """A loop's items, one step each."""
        meter = _meter()
        meter.step()
        for item in iterable:
            meter.step()
            yield item

    @staticmethod
    def joined(values: tuple[object, ...]) -> str:
        """``a ~ b ~ ...``, measured first."""
        meter = _meter()
        meter.step()
        meter.check_items(sum(meter.size(v) for v in values), "a ~ concatenation")
        return "".join(map(str, values))

    @staticmethod
    def measured(value: object) -> object:
        """A list, tuple or dict literal, measured."""
        _meter().check_size(value, "a literal")
        return value

    @staticmethod
    @jinja2.pass_context  # never called while compiling
    def _printed(context: object, value: object) -> object:
        """What ``{{ ... }}`` prints: measured and counted as written."""
        meter = _meter()
        meter.write(meter.check_size(value, "a printed value"))
        return value

    def concat(self, pieces: object) -> str:  # type: ignore[override] - jinja's "".join
        """Every text buffer (the prompt, a macro's or a ``{% set %}`` block's text), measured
        before it is joined."""
        pieces = list(pieces)
        total = sum(len(p) for p in pieces)
        if total > _meter().limits.output:
            raise BudgetExceeded(f"it writes a text of {total} characters, above the "
                                 f"sandbox's limit of {_meter().limits.output}")
        return "".join(pieces)

    # jinja2's sandbox hooks ------------------------------------------------------------------

    def call_binop(self, context: object, operator_name: str, left: object, right: object
                   ) -> object:
        meter = _meter()
        meter.step()
        if operator_name == "**":
            _check_power(meter, left, right)
        elif operator_name == "*":
            _check_product(meter, left, right)
        elif operator_name == "+" and isinstance(left, (str, list, tuple)) \
                and type(left) is type(right):
            meter.check_items(meter.size(left) + meter.size(right), f"a {type(left).__name__}")
        elif operator_name == "%" and isinstance(left, str):
            _check_percent(meter, left)
            _check_arguments(meter, right if isinstance(right, tuple) else (right,), {},
                             "a % format")
        result = _BINOPS[operator_name](left, right)
        if isinstance(result, int) and not isinstance(result, bool):
            meter.check_int(result)
        elif isinstance(result, str):
            meter.check_items(len(result), "a str")
        return result

    def call(__self, __context: object, __obj: object, *args: object,  # noqa: N805 - jinja's
             **kwargs: object) -> object:
        meter = _meter()
        meter.step()
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (__self.counted(args[0]), *args[1:])
        else:
            name = getattr(__obj, "__name__", None) or getattr(__obj, "name", None) or "a call"
            args = _check_method(meter, __obj, args, kwargs)  # what it would build, first
            _check_arguments(meter, args, kwargs, f"{name}()")
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, (str, list, tuple, dict, int)):
            meter.check_size(result, "the result of a call")
        return result

    def wrap_str_format(self, value: object) -> Callable[..., str] | None:
        """``str.format`` / ``format_map`` (jinja2 wraps them when they are looked up): the
        widths in the format string checked first."""
        wrapper = super().wrap_str_format(value)
        if wrapper is not None:
            _check_format(_meter(), value.__self__)
        return wrapper

    def unsafe_undefined(self, obj: object, attribute: str) -> object:
        raise SecurityError(f"access to attribute {attribute!r} of "
                            f"{type(obj).__name__!r} object is unsafe")
