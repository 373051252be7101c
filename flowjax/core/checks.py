"""Value checks for config dataclasses, each failing with one line that names the field.

A check maps a value to what is expected (a phrase) or None when the value is fine. A
dataclass's ``__post_init__`` runs its checks with ``check_fields``, which raises
``FieldError("gamma", -1.0, "expected a finite number >= 0")``; whoever built the
dataclass from a run config re-raises it with the config path
(``config.methods.flow.gamma=-1.0: expected a finite number >= 0``, ``FieldError.at``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any, Callable, Sequence

import numpy as np

Check = Callable[[Any], "str | None"]  # value -> what is expected, or None when fine


class FieldError(ValueError):
    """A bad value of one dataclass field: ``<field>=<value!r>: <expected>``."""

    def __init__(self, field: str, value: Any, expected: str):
        self.field, self.value, self.expected = field, plain(value), expected
        super().__init__(f"{field}={self.value!r}: {expected}")

    def at(self, prefix: str) -> ValueError:
        """The same error for a config path: ``config.<prefix><field>=<value!r>: ...``."""
        return ValueError(f"config.{prefix}{self.field}={self.value!r}: {self.expected}")


def is_digits(text: str) -> bool:
    """Whether ``text`` is ASCII digits only: ``str.isdigit`` also passes "²", which
    ``int`` refuses (a traceback where a one-line error was due)."""
    return text.isascii() and text.isdigit()


def first_line(error: BaseException) -> str:
    """An exception's message cut to its first line (its type's name when it has none),
    for a one-line error that quotes a library's multi-line one."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


def plain(value: Any) -> Any:
    """Sequences as tuples so messages read like the ``--config.x=(...)`` a user types."""
    return tuple(value) if isinstance(value, list) else value


def check_fields(config: Any, checks: dict[str, Check]) -> None:
    """Raises ``FieldError`` for the first field of ``config`` its check rejects."""
    for name, check in checks.items():
        value = getattr(config, name)
        expected = check(value)
        if expected is not None:
            raise FieldError(name, value, expected)


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value))


def integer(minimum: int) -> Check:
    return lambda v: None if is_int(v) and v >= minimum else f"expected an integer >= {minimum}"


def optional_integer(minimum: int) -> Check:
    """None (a default derived elsewhere) or an integer >= minimum."""
    return lambda v: (None if v is None or (is_int(v) and v >= minimum)
                      else f"expected None or an integer >= {minimum}")


def optional_cap(value: Any) -> str | None:
    if value is None or (is_int(value) and value >= 1):
        return None
    return "expected None (no cap) or an integer >= 1"


def positive(value: Any) -> str | None:
    if not (is_number(value) and value > 0):
        return "expected a finite number > 0"
    with np.errstate(over="ignore"):
        as_float32 = np.float32(value)  # what the run computes with
    if not (np.isfinite(as_float32) and as_float32 > 0):
        return "expected a finite number > 0 that stays so in float32 (1.4e-45 to 3.4e38)"
    return None


def non_negative(value: Any) -> str | None:
    return None if is_number(value) and value >= 0 else "expected a finite number >= 0"


@dataclasses.dataclass(frozen=True)
class Interval:
    low: float
    high: float
    closed_low: bool = True
    closed_high: bool = False
    optional: bool = False

    def __call__(self, value: Any) -> str | None:
        if value is None and self.optional:
            return None
        if is_number(value):
            above = value >= self.low if self.closed_low else value > self.low
            below = value <= self.high if self.closed_high else value < self.high
            if above and below:
                return None
        text = (f"{'[' if self.closed_low else '('}{self.low:g}, {self.high:g}"
                f"{']' if self.closed_high else ')'}")
        return f"expected {'None or ' if self.optional else ''}a number in {text}"


def one_of(choices: Sequence[Any]) -> Check:
    return lambda v: None if v in choices else f"expected one of {list(choices)}"


def widths(value: Any) -> str | None:
    if isinstance(value, (tuple, list)) and value and all(is_int(w) and w >= 1 for w in value):
        return None
    return "expected a non-empty sequence of integer widths >= 1"


@dataclasses.dataclass(frozen=True)
class FolderProblem:
    """Why a path cannot become (or be) a directory this process writes.

    Attributes:
      kind: ``"file"`` (the path is a file), ``"under_file"`` (a file lies on its way)
        or ``"not_writable"`` (the nearest existing folder cannot be written).
      blocker: the file or folder in the way.
    """

    kind: str
    blocker: str

    def __str__(self) -> str:
        return {"file": "is a file", "under_file": f"lies under the file {self.blocker}",
                "not_writable": f"{self.blocker} is not writable"}[self.kind]


def new_folder_problem(folder: str, writable: bool = True) -> FolderProblem | None:
    """Why ``folder`` cannot become (or be) a directory this process writes, or None."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        return FolderProblem("file", folder)
    existing = os.path.normpath(folder)  # named as given: a relative path stays relative
    while not os.path.exists(existing):
        existing = os.path.dirname(existing) or "."
    if not os.path.isdir(existing):
        return FolderProblem("under_file", existing)
    if writable and not os.access(existing, os.W_OK | os.X_OK):
        return FolderProblem("not_writable", existing)
    return None
