"""How a run and a missing value read, the same in every command and figure.

* A missing number or value (None, NaN, ±inf, pandas' NA) reads ``—`` in text and Markdown; JSON
  writes ``null`` (``analyze --json``), CSV an empty cell.
* A run is described by its config's ``workflow``, ``task``, ``policy`` and ``model`` (the run file's
  ``config`` attribute), each ``unknown`` when the config does not hold it: nothing is guessed from
  the records. A model path is shown by its last component.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

MISSING = "—"
UNKNOWN = "unknown"
DESCRIBED = ("workflow", "task", "policy", "model")


def is_missing(value: Any) -> bool:
    """None, a non-finite real number, or pandas' NA."""
    if value is None:
        return True
    if isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral):
        return not math.isfinite(float(value))
    return type(value).__name__ == "NAType"  # pandas.NA, without importing pandas


def number(value: Any, spec: str = ".3f") -> str:
    """``value`` formatted with ``spec``, or :data:`MISSING`."""
    return MISSING if is_missing(value) else format(value, spec)


def text(value: Any) -> str:
    """``str(value)``, or :data:`MISSING`."""
    return MISSING if is_missing(value) else str(value)


def describe(config: Mapping[str, Any] | None) -> dict[str, str]:
    """``workflow``, ``task``, ``policy``, ``model`` from a run's config; :data:`UNKNOWN` where absent
    or empty. ``ip`` / ``sp`` are lower-cased; a model path becomes its last component."""
    config = config or {}
    out = {}
    for key in DESCRIBED:
        value = config.get(key)
        value = "" if is_missing(value) else str(value).strip()
        if key == "policy" and value.lower() in ("ip", "sp"):
            value = value.lower()
        if key == "model" and value:
            value = PurePath(value.rstrip("/\\")).name or value
        out[key] = value or UNKNOWN
    return out


def policy_label(policy: str) -> str:
    """``IP`` / ``SP`` upper-cased for figures and tables; a sharing map or ``unknown`` as written."""
    return policy.upper() if policy in ("ip", "sp") else policy
