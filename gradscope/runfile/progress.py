"""How far a run file got: its last training step, whether its writer closed it, whether an alert
stopped it — and so whether the run finished.

A writer closes its file on every orderly exit, a SIGTERM included, so "closed" alone does not mean
"finished": a run is finished when it is closed and reached the steps it was asked for (``steps`` of
its stored config, or the caller's), or ended with an alert's ``stop`` event.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from gradscope.errors import GradscopeError


@dataclass(frozen=True)
class RunProgress:
    last_step: int        # last training step with metrics (0 if none)
    closed: bool          # the writer closed the file
    stopped: bool         # an alert's ``stop`` event ended the run
    config: dict | None   # the stored config (None when the file could not be read)
    versions: dict | None = None  # the stored versions (``versions["tasks"]``: the tasks' fingerprint)

    def finished(self, steps: int | None = None) -> bool:
        """Closed, and at ``steps`` (default: the stored config's ``steps``; a run file without one
        counts as finished when closed) or stopped by an alert."""
        if steps is None and self.config is not None and self.config.get("steps") is not None:
            steps = int(self.config["steps"])
        return self.closed and (steps is None or self.last_step >= steps or self.stopped)


def run_progress(path: str | os.PathLike) -> RunProgress:
    """The :class:`RunProgress` of a run file, live or not; (0, False, False, None) if it cannot be read."""
    from gradscope.runfile.reader import open_run

    try:
        with open_run(os.fspath(path)) as run:
            n = run.n_metrics
            rows = run.read_table("metrics", start=n - 1) if n else []
            kinds = run.read_table("events")["kind"] if run.n_events else []
            stopped = any((k.decode() if isinstance(k, bytes) else str(k)) == "stop" for k in kinds)
            return RunProgress(int(rows[-1]["step"]) if len(rows) else 0, run.closed, stopped,
                               dict(run.meta.config), dict(run.meta.versions))
    except (GradscopeError, OSError, KeyError, ValueError):
        return RunProgress(0, False, False, None)
