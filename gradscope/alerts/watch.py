"""``gradscope watch``: follow a run file written by any process and raise alerts as it grows.

The file is opened as a SWMR reader and polled. A training step is evaluated once it is complete,
i.e. once anything of a later step is visible (every flush commits all tables together) or the
writer has closed the file; within a step the order is records, metrics, evaluations — the
trainer's own order, so ``watch`` fires on the same steps as ``gradscope train --alert``.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from gradscope.alerts.engine import Alert
from gradscope.alerts.monitor import Monitor
from gradscope.alerts.rules import Rule
from gradscope.errors import RunFileError
from gradscope.runfile import RunReader, open_run, schema


class Follower:
    """Feeds a (live or finished) run file into a :class:`Monitor`, one :meth:`poll` at a time."""

    def __init__(self, run: RunReader, monitor: Monitor) -> None:
        self.run, self.monitor = run, monitor
        self.next = {"records": 0, schema.EVALS: 0, schema.METRICS: 0}
        self.last_step = -1   # last training step evaluated

    def poll(self, below_step: int | None = None) -> list[Alert]:
        """Evaluate every newly completed step; returns the alerts fired. With ``below_step``: only the
        steps before it, which the caller knows to be complete (a resumed run's checkpoint covers them),
        also the last one a killed writer left."""
        run = self.run.refresh()
        closed = run.closed
        rec_step = run.read("step", self.next["records"])
        tables = {t: run.read_table(t, start=self.next[t]) for t in (schema.EVALS, schema.METRICS)}
        seen = [int(a.max()) for a in (rec_step, *(t["step"] for t in tables.values())) if len(a)]
        if not seen:
            return []
        # a live or killed writer's last step may be incomplete, unless the caller vouches for it
        horizon = below_step - 1 if below_step is not None else np.inf if closed else max(seen) - 1
        items: list[tuple[int, int, object]] = []
        n_rec = int(np.searchsorted(rec_step, horizon, side="right")) if np.isfinite(horizon) else len(rec_step)
        if n_rec:
            lo = self.next["records"]
            fields = ("gram", "tokens", "scalars", "policy") + (
                ("update_gram", "update_interference") if run.meta.update_unit else ())
            recs = {name: run.read(name, lo, lo + n_rec) for name in fields}
            pol = run.policy_names(recs["policy"])
            for s in np.unique(rec_step[:n_rec]):
                m = rec_step[:n_rec] == s
                # NaN = not logged by the writer (RunWriter fills missing scalars so), not a NaN value
                scal = [{k: v for k, v in zip(run.meta.scalar_names, row) if not np.isnan(v)}
                        for row in recs["scalars"][m]]
                updates = (recs["update_gram"][m], recs["update_interference"][m]) if run.meta.update_unit else ()
                items.append((int(s), 0, (recs["gram"][m], recs["tokens"][m], list(pol[m]), scal, *updates)))
            self.next["records"] += n_rec
        for order, table in ((1, schema.METRICS), (2, schema.EVALS)):
            rows = tables[table]
            n = next((i for i, s in enumerate(rows["step"]) if s > horizon), len(rows))  # rows are in step order
            by_step: dict[int, dict[str, float]] = {}
            for row in rows[:n]:
                by_step.setdefault(int(row["step"]), {})[row["name"].decode("utf-8", "replace")] = float(row["value"])
            items += [(s, order, v) for s, v in by_step.items()]
            self.next[table] += n
        fired = []
        for s, order, payload in sorted(items, key=lambda it: (it[0], it[1])):
            if order == 0:
                fired += self.monitor.step(s, *payload)
            elif order == 1:
                fired += self.monitor.metrics(s, payload)
            else:
                fired += self.monitor.evals(s, payload)
            self.last_step = max(self.last_step, s)
        return fired


def watch(path: str, rules: Sequence[Rule], *, poll: float = 1.0, idle: float = 0.0,
          echo: Callable[[str], object] = print) -> list[Alert]:
    """Follow ``path`` until its writer closes it (or nothing new arrives for ``idle`` seconds,
    when ``idle`` > 0); returns every alert fired. Alerts are printed through ``echo``.

    When the path comes to name another file (``gradscope train --resume`` renames a new file over it;
    ``--overwrite`` starts another run), the new file is followed: its steps before its last ``resume``
    event are replayed with actions muted, as the resumed trainer replays them, then followed as usual."""
    def follow(run: RunReader) -> Follower:
        meta = run.meta
        return Follower(run, Monitor(rules, meta.agents, meta.agent_roles, policies=meta.policies, echo=echo,
                                     update_unit=meta.update_unit))

    run = open_run(path)
    try:
        follower, fired = follow(run), []
        echo(f"watching {path}: {len(run.meta.agents)} agents, roles {', '.join(dict.fromkeys(run.meta.agent_roles))}; "
             f"{len(rules)} rules")
        quiet_since = time.monotonic()
        while True:
            before = dict(follower.next)
            follower.poll()
            replaced = run.replaced()
            if run.closed and not replaced:
                last = "no step" if follower.last_step < 0 else f"last step {follower.last_step}"
                fired += follower.monitor.fired
                echo(f"writer closed {path} ({last}): {len(fired)} alerts")
                return fired
            if replaced:
                try:
                    new = open_run(path)
                except RunFileError:  # not readable (yet: a writer that has not started SWMR mode): quiet
                    new = None
                if new is not None:
                    run.close()
                    run, fired = new, fired + follower.monitor.fired
                    follower = follow(run)
                    events = run.events
                    resumes = events["step"][events["kind"] == "resume"]
                    start = int(resumes.iloc[-1]) if len(resumes) else 0
                    with follower.monitor.muted():
                        follower.poll(below_step=start)
                    echo(f"{path} was replaced: following the new file from step {start}")
                    quiet_since = time.monotonic()
                    continue
            if follower.next != before:
                quiet_since = time.monotonic()
            elif idle > 0 and time.monotonic() - quiet_since >= idle:
                fired += follower.monitor.fired
                echo(f"nothing new in {path} for {idle:g} s and the writer has not closed it (killed?); "
                     f"{len(fired)} alerts")
                return fired
            time.sleep(poll)
    finally:
        run.close()


def catch_up(path: str, monitor: Monitor, below_step: int) -> None:
    """Feed ``monitor`` the steps before ``below_step`` of a run file with its actions muted: a
    resumed run's rules continue from the state they had (accuracy peak, persistence, baselines)."""
    with open_run(path) as run, monitor.muted():
        Follower(run, monitor).poll(below_step=below_step)
