"""The sweep's progress view: one tqdm bar over all cells' training steps, with the cell counts.

``sweep  41%|████      | 1640/4000 [12:03<17:21, 2.27step/s] done 3/8 · running 2 · failed 0``

Steps of runs finished before this invocation count as done from the start, so the rate and the
ETA are this invocation's. Event lines (a run started, finished, failed) print above the bar. On a
terminal the bar refreshes every second; in a log file (nohup) every 60 s.
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm


class Progress:
    def __init__(self, n_cells: int, total_steps: int, done_steps: int, n_done: int) -> None:
        self.interval = 1.0 if sys.stderr.isatty() else 60.0
        self.n_cells, self.done, self.running, self.failed = n_cells, n_done, 0, 0
        self.bar = tqdm(total=total_steps, initial=done_steps, desc="sweep", unit="step", dynamic_ncols=True,
                        mininterval=self.interval, file=sys.stderr, smoothing=0.05)
        self._shown = time.monotonic()
        self._show()

    def _show(self) -> None:
        self.bar.set_postfix_str(f"done {self.done}/{self.n_cells} · running {self.running} · failed {self.failed}",
                                 refresh=False)

    def counts(self, done: int, running: int, failed: int) -> None:
        changed = (done, running, failed) != (self.done, self.running, self.failed)
        self.done, self.running, self.failed = done, running, failed
        self._show()
        if changed or time.monotonic() - self._shown >= self.interval:
            self.bar.refresh()
            self._shown = time.monotonic()

    def steps(self, n: int) -> None:
        """Set the number of steps done over all cells (it may only grow)."""
        if n > self.bar.n:
            self.bar.update(n - self.bar.n)

    def event(self, line: str) -> None:
        self.bar.write(line, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
