"""Detectors over a run file: gradient amplification, shared-policy role capture, accuracy cliffs."""
from gradscope.analyses.amplification import AmplificationConfig, detect_amplification
from gradscope.analyses.capture import CaptureConfig, detect_capture
from gradscope.analyses.cliff import CliffConfig, detect_cliff, find_cliffs
from gradscope.analyses.findings import Finding, Report
from gradscope.analyses.report import AnalysisConfig, analyze_series
from gradscope.analyses.series import RunSeries

__all__ = ["AmplificationConfig", "AnalysisConfig", "CaptureConfig", "CliffConfig", "Finding", "Report",
           "RunSeries", "analyze_series", "detect_amplification", "detect_capture", "detect_cliff", "find_cliffs"]
