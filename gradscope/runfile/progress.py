"""How far a run file got: its last training step, whether its writer closed it, whether an alert
stopped it — and so whether the run finished.

A writer closes its file on every orderly exit, a SIGTERM included, so "closed" alone does not mean
"finished": a run is finished when it is closed and reached the steps it was asked for (``steps`` of
its stored config, or the caller's), or ended with an alert's ``stop`` event (not followed by a
``resume``: a stopped run resumed with more steps must reach them) — never when it ended with a
``diverged`` event (the policy could no longer be sampled), whatever step it reached. How far it got is its
last ``/metrics`` row's step, or, in a file without metrics rows (a loop that logs only gradient
records), its last gradient record's step.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from gradscope.errors import GradscopeError


@dataclass(frozen=True)
class RunProgress:
    last_step: int        # last training step with metrics; without metrics rows, with a record (0 if none)
    closed: bool          # the writer closed the file
    stopped: bool         # an alert's ``stop`` event ended the run (one after the last ``resume`` event)
    config: dict | None   # the stored config (None when the file could not be read)
    versions: dict | None = None  # the stored versions (``versions["tasks"]``: the tasks' fingerprint)
    error: str | None = None      # why the file could not be read (None when it could)
    diverged: bool = False        # a ``diverged`` event (after the last ``resume``) ended the run

    def finished(self, steps: int | None = None) -> bool:
        """Closed, and at ``steps`` (default: the stored config's ``steps``; a run file without one
        counts as finished when closed) or stopped by an alert, and did not diverge."""
        return self.unfinished(steps) is None

    def unfinished(self, steps: int | None = None) -> str | None:
        """Why the run did not finish (:meth:`finished`), in a few words; None when it did."""
        if steps is None and self.config is not None and self.config.get("steps") is not None:
            steps = int(self.config["steps"])
        if self.error is not None:
            return f"unreadable ({self.error})"
        if not self.closed:
            return "not closed by its writer (live, or killed)"
        if self.diverged:
            return "diverged (its policy could no longer be sampled)"
        if steps is not None and self.last_step < steps and not self.stopped:
            return f"closed at step {self.last_step} of {steps}"
        return None


def run_progress(path: str | os.PathLike) -> RunProgress:
    """The :class:`RunProgress` of a run file, live or not; (0, False, False, None, error=why) if it
    cannot be read."""
    from gradscope.runfile.reader import open_run

    try:
        with open_run(os.fspath(path)) as run:
            n = run.n_metrics
            rows = run.read_table("metrics", start=n - 1) if n else []
            if len(rows):
                last = int(rows[-1]["step"])
            else:
                last = int(run.read("step", -1)[0]) if run.n_steps else 0
            kinds = [k.decode() if isinstance(k, bytes) else str(k)
                     for k in (run.read_table("events")["kind"] if run.n_events else [])]
            # a stop (or divergence) counts until a resume continues the run (which may be killed before its end)
            ended = next((k for k in reversed(kinds) if k in ("stop", "diverged", "resume")), None)
            return RunProgress(last, run.closed, ended == "stop", dict(run.meta.config), dict(run.meta.versions),
                               diverged=ended == "diverged")
    except (GradscopeError, OSError, KeyError, ValueError) as exc:
        return RunProgress(0, False, False, None, error=str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
