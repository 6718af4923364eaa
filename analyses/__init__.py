"""Detectors over a run file: gradient amplification, shared-policy role capture, accuracy cliffs."""
from analyses.amplification import AmplificationConfig, detect_amplification
from analyses.capture import CaptureConfig, detect_capture
from analyses.cliff import CliffConfig, detect_cliff, find_cliffs
from analyses.findings import Finding, Report
from analyses.report import AnalysisConfig, analyze_series
from analyses.series import RunSeries

__all__ = ["AmplificationConfig", "AnalysisConfig", "CaptureConfig", "CliffConfig", "Finding", "Report",
           "RunSeries", "analyze_series", "detect_amplification", "detect_capture", "detect_cliff", "find_cliffs"]
