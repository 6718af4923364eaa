"""``Monitor``: rules + values + actions — the alert API for any training loop.

::

    monitor = Monitor(rules, agents, agent_roles, policies=["voter", "aggregator"], writer=writer,
                      checkpoint=lambda alert: save(...), stop=lambda alert: ...)
    for step in ...:
        ...
        monitor.step(step, grams, tokens, policies, scalars)    # (N, K, K) records of the step
        monitor.metrics(step, {"update_norm/voter": 0.1})
        monitor.evals(step, {"accuracy": 0.61})
        if monitor.stop_requested: break

Actions: ``record`` — an ``alert`` event in the run file (always, when a writer is given);
``warn`` — one line on the console (``echo``) and a warning on the ``gradscope.alerts`` logger
when logging is configured; ``checkpoint`` — the callback, then (once it returns where it saved) a
console line and a ``checkpoint`` event (:meth:`Monitor.checkpointed`); ``stop`` — the callback, and :attr:`Monitor.stop_requested` is
set: the loop finishes its step, logs its own ``stop`` event and ends. ``on_alert`` is called for
every alert, whatever its actions.
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import numpy as np

from gradscope.alerts.engine import Alert, AlertEngine
from gradscope.alerts.rules import STATISTICS, Rule
from gradscope.alerts.values import StepValues
from gradscope.errors import ConfigError

log = logging.getLogger("gradscope.alerts")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Monitor:
    """Evaluates alert rules on a run's statistics as they arrive and carries out their actions.

    Args:
        rules: parsed rules (:func:`~gradscope.alerts.parse_rule`, :func:`~gradscope.alerts.load_rules`).
        agents, agent_roles: (K,) the Gram's agents and their roles.
        policies: policy names, to check rule selectors (None: not checked).
        writer: a ``RunWriter`` for ``record`` (None: nothing recorded).
        checkpoint, stop: called with the alert for those actions (None: the action only warns
            that it is unavailable here).
        on_alert: called with every alert.
        echo: where ``warn`` lines go (default: standard error).
        update_unit: ``"role"`` / ``"agent"`` when :meth:`step` is given update attribution (the run's
            ``RunMeta.update_unit``); ``""``: none.
    """

    def __init__(self, rules: Sequence[Rule], agents: Sequence[str], agent_roles: Sequence[str], *,
                 policies: Sequence[str] | None = None, writer=None,
                 checkpoint: Callable[[Alert], object] | None = None,
                 stop: Callable[[Alert], object] | None = None,
                 on_alert: Callable[[Alert], object] | None = None,
                 echo: Callable[[str], object] = _stderr, update_unit: str = "") -> None:
        self.rules = list(rules)
        self.values = StepValues(agents, agent_roles, wanted={r.statistic for r in self.rules},
                                 policies=policies or (), update_unit=update_unit)
        check_selectors(self.rules, agents, agent_roles, policies)
        self.engine = AlertEngine(self.rules)
        self.writer, self.on_alert, self.echo = writer, on_alert, echo
        self._checkpoint, self._stop = checkpoint, stop
        self.fired: list[Alert] = []
        self.stop_requested: Alert | None = None
        self._muted = False

    # --- feeding -------------------------------------------------------------------------------
    def step(self, step: int, gram: np.ndarray, tokens: np.ndarray | None = None,
             policies: Sequence[str | None] | None = None,
             scalars: Sequence[Mapping[str, float]] | None = None,
             update_gram: np.ndarray | None = None, update_interference: np.ndarray | None = None) -> list[Alert]:
        """One training step's Gram records (N, K, K) with optional tokens (N, K), policy tags,
        per-record scalars and update attribution (N, C, C), (N, C, K) (see :meth:`StepValues.records`)."""
        if len(gram) == 0 or not self.rules:
            return []
        return self.observe(step, self.values.records(gram, tokens, policies, scalars, update_gram,
                                                      update_interference))

    def metrics(self, step: int, values: Mapping[str, float]) -> list[Alert]:
        return self.observe(step, self.values.metrics(values))

    def evals(self, step: int, values: Mapping[str, float]) -> list[Alert]:
        return self.observe(step, self.values.evals(values))

    def observe(self, step: int, values: Mapping[str, float]) -> list[Alert]:
        """Any named values (``{"coherence[voter]": 0.8}``): the engine, then the actions."""
        fired = self.engine.observe(step, values)
        for alert in fired:
            self._act(alert)
        return fired

    # --- actions -------------------------------------------------------------------------------
    @contextmanager
    def muted(self) -> Iterator[None]:
        """Rules evaluate (their state moves on) but no action is taken and nothing is kept."""
        self._muted = True
        try:
            yield
        finally:
            self._muted = False

    def _act(self, alert: Alert) -> None:
        if self._muted:
            return
        self.fired.append(alert)
        actions, message = alert.rule.actions, alert.message
        if self.writer is not None:
            self.writer.log_event(alert.step, "alert", message, severity="warning")
        if {"warn", "checkpoint", "stop"} & set(actions):  # the console hears of every action taken
            self.echo(f"gradscope alert at step {alert.step}: {message}")
            if log.hasHandlers():
                log.warning("step %d: %s", alert.step, message)
        if self.on_alert is not None:
            self.on_alert(alert)
        if "checkpoint" in actions:
            if self._checkpoint is None:
                self.echo(f"gradscope alert at step {alert.step}: 'checkpoint' is not available here")
            elif (path := self._checkpoint(alert)) is not None:
                self.checkpointed(alert, path)
        if "stop" in actions and self.stop_requested is None:
            if self._stop is None:
                self.echo(f"gradscope alert at step {alert.step}: 'stop' is not available here")
            else:
                self.stop_requested = alert
                self._stop(alert)


    def checkpointed(self, alert: Alert, path: object) -> None:
        """Report a checkpoint taken for ``alert`` (a console line and a ``checkpoint`` event). Called
        when the ``checkpoint`` callback returns the path; a callback that saves later returns None
        and calls this itself once the checkpoint exists."""
        self.echo(f"gradscope alert at step {alert.step}: checkpoint saved to {path}")
        if self.writer is not None:
            self.writer.log_event(alert.step, "checkpoint", f"{path} by [{alert.rule.label}]")


def check_selectors(rules: Sequence[Rule], agents: Sequence[str], agent_roles: Sequence[str],
                    policies: Sequence[str] | None) -> None:
    """:class:`ConfigError` for a selector naming no role / agent / policy of the run."""
    roles = list(dict.fromkeys(agent_roles))
    known = {"role": roles, "agent": list(agents)}
    if policies is not None:
        known["policy"] = [*policies, "all"]
        names = [*roles, *agents, *policies]
    for rule in rules:
        if rule.selector in (None, "*"):
            continue
        kind = STATISTICS.get(rule.statistic)
        if rule.statistic.startswith("opt."):
            kind = "policy"
        if kind in ("agent pair", "role pair"):
            kind, parts = kind.split()[0], rule.selector.split("|")
            bad = [x for x in parts if x not in known[kind]] or ([] if parts[0] != parts[1] else [rule.selector])
            if bad:
                raise ConfigError(f"alert rule {rule.text!r}: {bad[0]!r} is not a pair of two different "
                                  f"{kind}s of this run ({', '.join(known[kind])})")
            continue
        if kind in known:
            choices = known[kind]
        elif ("/" in rule.statistic or rule.statistic.startswith("eval.")) and policies is not None:
            kind, choices = "role, agent or policy", names
        else:
            continue
        if rule.selector not in choices:
            raise ConfigError(f"alert rule {rule.text!r}: unknown {kind} {rule.selector!r} "
                              f"(this run has: {', '.join(dict.fromkeys(choices))})")
