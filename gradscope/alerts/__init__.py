"""Alerts while a run is going: rules over per-step statistics, and actions (docs/alerts.md).

The names below load on first use (PEP 562): the command line imports ``gradscope.alerts.cli`` for
its flags without loading numpy or the engine.
"""
from importlib import import_module

_WHERE = {"Alert": "engine", "AlertEngine": "engine", "Monitor": "monitor", "check_selectors": "monitor",
          "DEFAULT_RULES": "rules", "Rule": "rules", "load_rules": "rules", "parse_rule": "rules",
          "StepValues": "values"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
