"""Per-role coefficients of the mitigation flags: ``0.05`` (every role) or ``voter=0.05,aggregator=0``.

:func:`role_spec` is the flags' argparse type (syntax only: a plain number stays a float, a map is
returned in a canonical ``role=value,...`` form); :func:`role_values` resolves a spec against a
workflow's roles (roles a map does not name get 0) and rejects unknown roles.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradscope.errors import ConfigError
from gradscope.ranges import Range

#: Allowed value of every role's coefficient (also the flags' entry in ``GRPO_RANGES``).
COEF = Range(0)


def _parse(spec: float | str) -> float | dict[str, float]:
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return float(spec)
    text = str(spec).strip()
    try:
        return float(text)
    except ValueError:
        pass
    out: dict[str, float] = {}
    for item in text.split(","):
        role, sep, value = (s.strip() for s in item.partition("="))
        try:
            number = float(value)
        except ValueError:
            sep = ""
        if not sep or not role:
            raise ConfigError(f"bad per-role value {item.strip()!r} in {text!r}: use a number (every role) or "
                              "role=number,... (e.g. voter=0.05,aggregator=0)")
        if role in out:
            raise ConfigError(f"role {role!r} given twice in {text!r}")
        out[role] = number
    return out


def role_spec(text: str) -> float | str:
    """argparse type of a per-role flag: a float, or the map written ``role=value,...``."""
    try:
        parsed = _parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return parsed if isinstance(parsed, float) else ",".join(f"{r}={_exact(v)}" for r, v in parsed.items())


def _exact(v: float) -> str:
    """``v`` written short (``0.05``, ``0``) where that is exact, else in full (``0.123456789``)."""
    short = f"{v:g}"
    return short if float(short) == v else repr(v)


def role_values(spec: float | str, roles: Sequence[str], flag: str) -> dict[str, float]:
    """role → coefficient for every role (0 for roles a map leaves out); ConfigError on an unknown
    role or a value that is negative or not finite."""
    parsed = _parse(spec)
    if isinstance(parsed, float):
        values = {r: parsed for r in roles}
    else:
        unknown = [r for r in parsed if r not in roles]
        if unknown:
            raise ConfigError(f"--{flag} names unknown role(s) {unknown}; this workflow's roles are {list(roles)}")
        values = {r: parsed.get(r, 0.0) for r in roles}
    for role, value in values.items():
        COEF.check(f"--{flag}" if isinstance(parsed, float) else f"--{flag} {role}", value)
    return values
