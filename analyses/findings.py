"""The report model: findings with severity, step ranges and evidence numbers."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("info", "warning", "critical")


@dataclass
class Finding:
    """One detected pathology.

    Attributes:
        kind: ``amplification`` | ``capture`` | ``cliff``.
        severity: ``info`` | ``warning`` | ``critical``.
        summary: one sentence for people.
        onset: the step it began; start/end: the step range it covers.
        role / policy: who caused it and in which parameter set (None when not applicable).
        evidence: named numbers (and short lists) backing the verdict.
    """

    kind: str
    severity: str
    summary: str
    onset: int
    start: int
    end: int
    role: str | None = None
    policy: str | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    """Everything ``gradscope analyze`` says about one run."""

    run: str
    summary: dict[str, Any]
    findings: list[Finding]
    notes: list[str]  # what could not be analysed, and why
    cliff_checked: bool = True  # the cliff detector ran (≥ 3 evaluations): no cliff finding means "no cliff"

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "gradscope-report/1", "run": self.run, "summary": self.summary,
                "findings": [f.to_dict() for f in self.findings], "notes": self.notes}
