"""Detectors over a run file: gradient amplification, shared-policy role capture, accuracy cliffs.

The names below load on first use (PEP 562), so ``gradscope.analyses.thresholds`` — all the command
line needs to build its parser — imports without numpy, pandas or scipy.
"""
from importlib import import_module

_WHERE = {
    "AmplificationConfig": "thresholds", "AnalysisConfig": "thresholds", "CaptureConfig": "thresholds",
    "CliffConfig": "thresholds", "Finding": "findings", "Report": "findings", "RunSeries": "series",
    "analyze_series": "report", "detect_amplification": "amplification", "detect_capture": "capture",
    "detect_cliff": "cliff", "find_cliffs": "cliff",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
