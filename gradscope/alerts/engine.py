"""The rule engine: feed it named values step by step, get :class:`Alert` s back.

It knows nothing about Grams or files: any training loop can call
``engine.observe(step, {"coherence[voter]": 0.8, "acc_drop": 0.02})``. Each (rule, value name)
pair is one state machine — persistence counts consecutive observations that meet the condition,
and after firing the pair stays quiet until the condition has been false ``cooldown`` times in a
row (one alert per episode).
"""
from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from gradscope.alerts.rules import Rule

_AGGREGATES = {"median": np.median, "mean": np.mean, "min": np.min, "max": np.max}


def min_history(rule: Rule) -> int:
    """Previous values an aggregate threshold needs before the rule can fire: min(N, 5)."""
    return min(rule.window, 5)


#: Pair statistics whose order matters (``interference[A|B]``: A's update on B's loss).
ORDERED = frozenset({"interference"})


@dataclass(frozen=True)
class Alert:
    """A rule that fired. ``key`` is the concrete value it fired on (``coherence[voter]``);
    ``since`` the first step of the run of observations that met the condition."""

    rule: Rule
    key: str
    step: int
    value: float
    reference: float
    since: int

    @property
    def message(self) -> str:
        r = self.rule
        if r.statistic == "nonfinite":
            cond = "non-finite gradient statistics or scalars"
        else:
            ref = f"{_num(self.reference)}" if r.aggregate is None else \
                f"{_num(r.threshold)}x {r.aggregate}({r.window}) = {_num(self.reference)}"
            cond = f"{self.key} = {_num(self.value)} {r.op} {ref}"
        run = f" for {r.persist} observations since step {self.since}" if r.persist > 1 else ""
        return f"[{r.name or 'alert'}] {cond}{run} (rule: {r.text})"


def _num(x: float) -> str:
    return f"{x:.4g}"


@dataclass
class _State:
    history: deque
    run: int = 0          # consecutive observations meeting the condition
    since: int = 0
    quiet: int = 0        # consecutive observations not meeting it
    armed: bool = True


@dataclass
class AlertEngine:
    """Evaluates ``rules`` on every :meth:`observe`; returns the alerts that fire, in rule order."""

    rules: list[Rule]
    _states: dict[tuple[int, str], _State] = field(default_factory=dict, init=False, repr=False)

    def keys(self, rule: Rule, values: Iterable[str]) -> list[str]:
        """The value names ``rule`` applies to among ``values``."""
        if rule.selector is None:
            return [rule.statistic] if rule.statistic in values else []
        if rule.selector == "*":
            prefix = rule.statistic + "["
            return [k for k in values if k.startswith(prefix) and k.endswith("]")]
        orders = [rule.selector]
        if rule.statistic not in ORDERED:  # a symmetric pair (a cosine) in either order
            orders.append("|".join(reversed(rule.selector.split("|"))))
        for sel in orders:
            if (key := f"{rule.statistic}[{sel}]") in values:
                return [key]
        return []

    def observe(self, step: int, values: Mapping[str, float]) -> list[Alert]:
        """One observation of each named value at ``step``. Names absent from ``values`` (and NaN
        values) are not observed, so their rules keep their state."""
        fired = []
        for i, rule in enumerate(self.rules):
            for key in self.keys(rule, values):
                value = float(values[key])
                if math.isnan(value):
                    continue
                alert = self._update(i, rule, key, step, value)
                if alert is not None:
                    fired.append(alert)
        return fired

    def _update(self, i: int, rule: Rule, key: str, step: int, value: float) -> Alert | None:
        st = self._states.get((i, key))
        if st is None:
            st = self._states[(i, key)] = _State(history=deque(maxlen=max(rule.window, 1)))
        if rule.statistic == "nonfinite":
            met, reference = value > 0, 0.0
        elif rule.aggregate is not None:
            if len(st.history) < min_history(rule):
                met, reference = False, math.nan
            else:
                reference = rule.threshold * float(_AGGREGATES[rule.aggregate](st.history))
                met = rule.compare(value, reference)
            if not met and math.isfinite(value):  # the baseline holds normal values only, so a
                st.history.append(value)          # persisting excursion is not its own reference
            if math.isnan(reference):
                return None
        else:
            reference = rule.threshold
            met = rule.compare(value, reference)
        if met:
            st.since = step if st.run == 0 else st.since
            st.run += 1
            st.quiet = 0
        else:
            st.run = 0
            st.quiet += 1
            if st.quiet >= rule.cooldown:
                st.armed = True
        if st.armed and st.run >= rule.persist:
            st.armed = False
            return Alert(rule, key, step, value, reference, st.since)
        return None
