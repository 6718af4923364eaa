"""The scalars gradscope sends to dashboards, under TRL-style names (``gradscope/norm/voter``).

One table of names for every way out: the TRL integration's log entries, ``gradscope train
--log-to`` and ``gradscope export``. Per training step, each statistic is the mean over the step's
records in which its subject is present (:func:`gradscope.steps.step_mean`, the rule the analyses
and alerts use), so an IP step's voter record and aggregator record do not dilute each other.

========================================  ================================================
name                                       value (docs/metrics.md)
========================================  ================================================
``gradscope/grad_norm``                     total norm √ΣM (mean over the step's records)
``gradscope/agent_norm/<agent>``            ‖g_k‖ = √M_kk
``gradscope/norm/<role>``                   ‖g_r‖ = √M^R_rr
``gradscope/share/<role>``                  contribution share s_r
``gradscope/mass_share/<role>``             gradient-mass share m_r
``gradscope/token_share/<role>``            token share
``gradscope/per_token_share/<role>``        per-token share
``gradscope/af/<role>``                     amplification factor (roles of ≥ 2 agents)
``gradscope/coherence/<role>``              AF_r / n_r
``gradscope/signal_fraction/<role>``        mean off-diagonal / mean diagonal of the role block
``gradscope/cos/<agent>/<agent>``           agent cosine (upper triangle, declaration order)
``gradscope/role_cos/<role>/<role>``        role cosine
``gradscope/<metric>``                      a per-step metric of the run file (``update_norm/<policy>``, ...)
``gradscope/eval/<name>``                   an evaluation (``eval/accuracy``, ...)
========================================  ================================================

Characters outside ``[A-Za-z0-9_./ -]`` in names become ``_`` (MLflow accepts no others); two names
that become one (agents ``a:1`` and ``a_1``) are a ConfigError (:class:`DashboardNames`). A metric
named like a statistic (TRL's ``grad_norm``) is ``gradscope/metric/<name>``, never replacing it.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from gradscope import stats, steps
from gradscope.errors import ConfigError

PREFIX = "gradscope/"
_UNSAFE = re.compile(r"[^A-Za-z0-9_./ -]")


def scalar_name(name: str) -> str:
    """``gradscope/<name>`` with characters dashboards reject replaced by ``_``."""
    return PREFIX + _UNSAFE.sub("_", name)


class DashboardNames:
    """The dashboard names of one run's values, each the name of one source only: two names that
    :func:`scalar_name` makes one are a ConfigError, never a value silently lost."""

    def __init__(self, agents: Sequence[str], agent_roles: Sequence[str]) -> None:
        self._source: dict[str, str] = {}  # tag → what it names (repr of a statistic's or metric's name)
        #: the statistics' names (of these agents and roles), which metrics never replace
        self.statistics = {self.claim(tag, tag) for tag in (statistic_names(agents, agent_roles) if agents else [])}

    def claim(self, source: str, tag: str | None = None) -> str:
        """``tag`` (default ``scalar_name(source)``), now ``source``'s; ConfigError if another's."""
        return self._claim(repr(source), scalar_name(source) if tag is None else tag)

    def _claim(self, what: str, tag: str) -> str:
        if self._source.setdefault(tag, what) != what:
            raise ConfigError(f"{self._source[tag]} and {what} both become the dashboard name {tag!r} "
                              f"(characters other than letters, digits and _ . / - space become _): rename one")
        return tag

    def metric(self, name: str, prefix: str = "") -> str:
        """A run-file metric's dashboard name (an evaluation's with ``prefix="eval/"``):
        ``gradscope/<prefix><name>``, or ``gradscope/metric/<name>`` where that is a statistic's."""
        tag = scalar_name(prefix + name)
        if tag in self.statistics:  # a metric named like a statistic (TRL's grad_norm) never replaces it
            tag = scalar_name("metric/" + name)
        # (an evaluation says so: a metric "eval/acc" and an evaluation "acc" are two values)
        return self._claim(f"evaluation {name!r}" if prefix else repr(name), tag)


def step_scalars(gram: ArrayLike, tokens: ArrayLike, record_step: ArrayLike, agents: Sequence[str],
                 agent_roles: Sequence[str]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every gradient statistic per training step, under its dashboard name.

    Args:
        gram: (N, K, K) per-record Gram matrices; tokens: (N, K); record_step: (N,) training step of
            each record (any order).
        agents, agent_roles: (K,) names and roles.

    Returns:
        The (T,) distinct steps, increasing, and name → (T,) float64 values (NaN where the subject
        is absent from every record of the step, or no record of it is finite).
    """
    M = np.asarray(gram, dtype=np.float64)
    tok = np.asarray(tokens, dtype=np.float64)
    record_step = np.asarray(record_step, dtype=np.int64)
    if M.ndim != 3 or tok.shape != M.shape[:2] or record_step.shape != M.shape[:1]:
        raise ValueError(f"gram (N, K, K), tokens (N, K) and record_step (N,) disagree: "
                         f"{M.shape}, {tok.shape}, {record_step.shape}")
    uniq, index = np.unique(record_step, return_inverse=True)
    P, roles = stats.role_indicator(list(agent_roles))
    agent_norm, role_norm = stats.agent_norms(M), stats.role_norms(M, P)
    a_on, r_on = agent_norm > 0, steps.present(role_norm)
    cols: dict[str, tuple[np.ndarray, np.ndarray | None]] = {"grad_norm": (stats.total_norm(M), None)}
    cols.update({f"agent_norm/{a}": (agent_norm[:, k], a_on[:, k]) for k, a in enumerate(agents)})
    per_role = {"norm": role_norm, "share": stats.contribution_shares(M, P), "mass_share": stats.mass_shares(M, P),
                "token_share": stats.token_shares(tok, P), "per_token_share": stats.per_token_shares(M, tok, P),
                "af": stats.amplification_factor(M, P), "coherence": stats.coherence(M, P),
                "signal_fraction": stats.signal_fraction(M, P)}
    for name, values in per_role.items():
        cols.update({f"{name}/{r}": (values[:, j], r_on[:, j]) for j, r in enumerate(roles)})
    for name, cos, names, on in (("cos", stats.cosine(M), list(agents), a_on),
                                 ("role_cos", stats.cosine(stats.role_gram(M, P)), roles, r_on)):
        pairs: dict[str, tuple[str, str]] = {}
        for i, j in zip(*np.triu_indices(len(names), k=1)):
            tag = f"{name}/{names[i]}/{names[j]}"
            if tag in pairs:  # names holding '/': ("x/y", "z") and ("x", "y/z") would be one value
                raise ConfigError(f"the pairs {pairs[tag]} and {(names[i], names[j])} both become the dashboard name "
                                  f"{tag!r}: rename one ('/' in a name)")
            pairs[tag] = (names[i], names[j])
            cols[tag] = (cos[:, i, j], on[:, i] & on[:, j])
    names = DashboardNames((), ())  # agents a:1 and a_1: an error, not one value lost
    return uniq, {names.claim(n): steps.step_mean(v, index, len(uniq), mask) for n, (v, mask) in cols.items()}


def statistic_names(agents: Sequence[str], agent_roles: Sequence[str]) -> list[str]:
    """The dashboard names :func:`step_scalars` gives for these agents and roles (whatever the values)."""
    K = len(agents)
    with np.errstate(all="ignore"):
        return list(step_scalars(np.zeros((1, K, K)), np.zeros((1, K)), [0], agents, agent_roles)[1])


def finite_items(values: Mapping[str, float]) -> dict[str, float]:
    """The entries whose value is a finite number, as floats (dashboards chart no NaN)."""
    out = {}
    for name, value in values.items():
        try:
            v = float(value)
        except (TypeError, ValueError):
            continue
        if np.isfinite(v):
            out[name] = v
    return out
