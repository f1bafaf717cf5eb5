"""The jinja2 sandbox chat templates run in: transformers' environment, hardened against
templates written by strangers.

jinja2's `ImmutableSandboxedEnvironment` already refuses unsafe attributes and mutation; this
adds limits on what a template may cost. A render has a deadline and an output cap; every call,
filter, operator, `range` step and output piece checks them, so a runaway loop or recursion
stops at the deadline (and, on the main thread, an alarm stops even a loop that calls nothing).
Values a single step would make larger than the cap (`'a' * 10**8`, `x ** 10**9`,
`'{:999999999}'.format(1)`, `center(10**9)`, `lipsum(n=10**6)`, a join or replace that would
explode) are refused before they are made.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.exceptions import SecurityError
from jinja2.nodes import EvalContext
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

__all__ = ["MAX_OUTPUT_CHARS", "MAX_SECONDS", "TemplateLimit", "environment", "render"]

MAX_SECONDS = 10.0  # a chat template rendering longer than this is refused
MAX_OUTPUT_CHARS = 16 << 20  # and one whose output, or any value it builds, is longer
MAX_INT_BITS = 1 << 16  # integers a template computes stay below 2**65536
_CHECK_EVERY = 1024  # range steps between two looks at the clock
_WIDTH = re.compile(r"\d+")
_SIZED_METHODS = {"ljust", "rjust", "center", "zfill"}


class TemplateLimit(SecurityError):
    """A chat template went past its time or size limit."""


class _Budget:
    """One render's deadline and output count."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.steps = 0
        self.output = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"rendering took longer than {MAX_SECONDS:g} s")

    def step(self) -> None:
        self.steps += 1
        if self.steps % _CHECK_EVERY == 0:
            self.tick()

    def emit(self, piece: str) -> None:
        self.output += len(piece)
        if self.output > MAX_OUTPUT_CHARS:
            raise TemplateLimit(f"its output is longer than {MAX_OUTPUT_CHARS} characters")
        self.step()


def _too_long(what: str, length: int) -> None:
    if length > MAX_OUTPUT_CHARS:
        raise TemplateLimit(f"{what} would be {length} long (at most {MAX_OUTPUT_CHARS})")


def _check_size(value) -> None:
    if isinstance(value, (str, list, tuple, dict)):
        _too_long("a value", len(value))
    elif isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > MAX_INT_BITS:
        raise TemplateLimit(f"an integer of {value.bit_length()} bits (at most {MAX_INT_BITS})")


def _check_widths(spec: str) -> None:
    """Refuse a format string with a width or precision beyond the cap."""
    for digits in _WIDTH.findall(spec):
        if len(digits) > 9 or int(digits) > MAX_OUTPUT_CHARS:
            raise TemplateLimit(f"format width {digits[:12]}{'...' if len(digits) > 12 else ''} is too large")


def _length(value) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else len(str(value))


def _joined(separator: str, items):
    """`items` as a sequence (an iterator is read once, here, and the sequence is what gets
    joined), after refusing a join whose result would pass the cap."""
    items = items if isinstance(items, (list, tuple, str)) else list(items)
    _too_long("a join", len(separator) * max(len(items) - 1, 0) + sum(_length(i) for i in items))
    return items


def _check_binop(op: str, left, right) -> None:
    numbers = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
    if op == "**" and numbers and right > 0:
        if max(abs(left).bit_length(), 1) * right > MAX_INT_BITS and abs(left) > 1:
            raise TemplateLimit(f"{left} ** {right} is too large")
    elif op == "*":
        if numbers and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimit("a product of that size is too large")
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _too_long("a repetition", len(seq) * max(n, 0))
    elif op == "+" and all(isinstance(v, (str, list, tuple)) for v in (left, right)):
        _too_long("a concatenation", len(left) + len(right))
    elif op == "%" and isinstance(left, str):
        _check_widths(left)


def _check_method(obj, args) -> tuple:
    """Refuse a str method call whose result would pass the cap; the arguments to call it with."""
    owner, name = getattr(obj, "__self__", None), getattr(obj, "__name__", "")
    if not isinstance(owner, str):
        return args
    if name in _SIZED_METHODS and args and isinstance(args[0], int):
        _too_long(f"str.{name}", args[0])
    elif name == "expandtabs" and args and isinstance(args[0], int):
        _too_long("str.expandtabs", len(owner) + owner.count("\t") * args[0])
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _too_long("str.replace", len(owner) + (len(owner) // max(len(args[0]), 1) + 1) * len(args[1]))
    elif name == "join" and args:
        return (_joined(owner, args[0]), *args[1:])
    return args


class Sandbox(ImmutableSandboxedEnvironment):
    """transformers' template environment with jinja2's immutable sandbox and cost limits."""

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.budget: _Budget | None = None

    def _spend(self) -> None:
        if self.budget is not None:
            self.budget.step()

    def unsafe_undefined(self, obj, attribute):
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call_binop(self, context, op, left, right):
        self._spend()
        _check_binop(op, left, right)
        return super().call_binop(context, op, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
        __self._spend()
        for value in (*args, *kwargs.values()):
            _check_size(value)
        args = _check_method(__obj, args)
        result = super().call(__context, __obj, *args, **kwargs)
        _check_size(result)
        return result

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        spec = value.__self__

        def checked(*args, **kwargs):
            _check_widths(spec)
            return wrapped(*args, **kwargs)

        return checked

    def range(self, *args):
        """jinja2's bounded range, stepping the budget as a loop walks it."""
        for i in safe_range(*args):
            self._spend()
            yield i


class _TemplateDict:
    """``dict`` for templates without the type itself (``dict.update(x, ...)`` would bypass immutability)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's ``namespace`` without underscore-prefixed attributes (as transformers does), and
    no value beyond the size cap (a namespace is how a template grows a value across a loop)."""

    def __init__(*args, **kwargs):  # jinja2's signature trick, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name, value in attrs.items():
            _TemplateNamespace._check(name, value)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name, value):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} is unsafe")
        _check_size(value)


def _checked_filter(name: str, function):
    """A filter that refuses arguments beyond the cap and results beyond it."""

    def checked(*args, **kwargs):
        first = next((i for i, a in enumerate(args) if not isinstance(a, (jinja2.Environment, Context, EvalContext))), len(args))
        values = args[first:]  # the filtered value, then the filter's arguments
        for value in (*values[1:], *kwargs.values()):
            if isinstance(value, int) and not isinstance(value, bool):
                _too_long(f"filter {name}'s argument", value)
            _check_size(value)
        if name == "format" and values and isinstance(values[0], str):
            _check_widths(values[0])
        if name == "join" and values:
            separator = values[1] if len(values) > 1 else kwargs.get("d", "")
            args = (*args[:first], _joined(str(separator), values[0]), *values[1:])
        result = function(*args, **kwargs)
        _check_size(result)
        return result

    checked.__dict__.update(getattr(function, "__dict__", {}))  # keeps jinja2's pass_context / pass_environment marks
    checked.__name__ = name
    return checked


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100):  # noqa: A002 - jinja2's names
    if n > 100 or max > 1000:
        raise TemplateLimit(f"lipsum(n={n}, max={max}) is too large")
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)


def environment(source: str, error: type[Exception]) -> Sandbox:
    """The environment one template is compiled in; `error` is what raise_exception raises."""

    def raise_exception(message):
        raise error(f"chat template {source} raised: {message}")

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # like transformers: no HTML escaping, json.dumps options exposed
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _checked_filter(name, f) for name, f in env.filters.items()}
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace, range=env.range, lipsum=_lipsum)
    return env


def render(template: jinja2.Template, **variables) -> str:
    """The template's output, within the time and size limits (TemplateLimit past them)."""
    env = template.environment
    env.budget = budget = _Budget(MAX_SECONDS)
    alarm = threading.current_thread() is threading.main_thread() and signal.getitimer(signal.ITIMER_REAL)[0] == 0

    def expire(signum, frame):
        raise TemplateLimit(f"rendering took longer than {MAX_SECONDS:g} s")

    previous = signal.signal(signal.SIGALRM, expire) if alarm else None
    if alarm:
        signal.setitimer(signal.ITIMER_REAL, MAX_SECONDS + 1.0)
    try:
        pieces = []
        for piece in template.generate(**variables):
            budget.emit(piece)
            pieces.append(piece)
        return "".join(pieces)
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        env.budget = None

