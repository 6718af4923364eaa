"""Per-agent gradient probes: the Gram matrix of a step's per-agent gradients."""
from gradscope.probe.probe import METHODS, Probe, ProbeStep, StepResult
from gradscope.probe.sketch import Sketch
from gradscope.probe.updates import UpdateResult

__all__ = ["METHODS", "Probe", "ProbeStep", "Sketch", "StepResult", "UpdateResult"]
