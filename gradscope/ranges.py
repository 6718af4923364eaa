"""Allowed values of numeric settings: one ``Range`` checks a flag on the command line (as an
argparse type) and a config field in Python (``Range.check``), with the same one-line message."""
from __future__ import annotations

import argparse
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradscope.errors import ConfigError


@dataclass(frozen=True)
class Range:
    """A finite number within optional bounds.

    Attributes:
        lo, hi: the bounds (None: unbounded on that side).
        whole: an integer setting (a float, a bool or ``"1.5"`` is refused).
        lo_open, hi_open: the bound itself is excluded (``> 0`` rather than ``>= 0``).
    """

    lo: float | None = None
    hi: float | None = None
    whole: bool = False
    lo_open: bool = False
    hi_open: bool = False

    def __str__(self) -> str:
        kind = "a whole number" if self.whole else "a finite number"
        lo, hi = (None if b is None else f"{b:d}" if self.whole else f"{b:g}" for b in (self.lo, self.hi))
        if lo is not None and hi is not None:
            return f"{kind} in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"
        if lo is not None:
            return f"{kind} {'>' if self.lo_open else '>='} {lo}"
        if hi is not None:
            return f"{kind} {'<' if self.hi_open else '<='} {hi}"
        return kind

    def accepts(self, value: Any) -> bool:
        """Whether ``value`` (a Python or numpy number; never a bool) is allowed."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral if self.whole else numbers.Real):
            return False
        if not isinstance(value, numbers.Integral) and not math.isfinite(value):  # ints: finite, may not fit a float
            return False
        if self.lo is not None and (value < self.lo or self.lo_open and value == self.lo):
            return False
        return not (self.hi is not None and (value > self.hi or self.hi_open and value == self.hi))

    def check(self, flag: str, value: Any) -> None:
        """Raise :class:`ConfigError` ``"<flag> must be <range>, got <value>"`` unless allowed."""
        if not self.accepts(value):
            raise ConfigError(f"{flag} must be {self}, got {value!r}")

    @property
    def arg(self) -> Callable[[str], int | float]:
        """An argparse ``type=``: parses the text and checks it; a bad value is argparse's one-line
        usage error ``argument --flag: must be ..., got ...``."""
        def parse(text: str) -> int | float:
            try:
                value: int | float = int(text) if self.whole else float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}") from None
            if not self.accepts(value):
                raise argparse.ArgumentTypeError(f"must be {self}, got {text!r}")
            return value

        parse.__name__ = "whole number" if self.whole else "number"
        return parse


#: Figure resolution (dots per inch) of PNG output: print quality at least, and a bound that keeps a
#: two-column figure's pixel buffer to a few hundred MB (``--dpi 100000`` was a ``std::bad_alloc``).
DPI = Range(200, 1200, whole=True)
#: Seconds between looks at a live file (``watch --poll``): a day at most, which also keeps
#: ``time.sleep`` within its range; and seconds to wait (``--wait``, ``--idle``).
POLL = Range(0, 86_400, lo_open=True)
WAIT = Range(0)
#: Counts of steps, evaluations or records: at least 1; and whole numbers where 0 means "off" or "default".
COUNT = Range(1, whole=True)
WHOLE = Range(0, whole=True)
