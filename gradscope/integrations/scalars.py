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

Characters outside ``[A-Za-z0-9_./ -]`` in names become ``_`` (MLflow accepts no others).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike

from gradscope import stats, steps

PREFIX = "gradscope/"
_UNSAFE = re.compile(r"[^A-Za-z0-9_./ -]")


def scalar_name(name: str) -> str:
    """``gradscope/<name>`` with characters dashboards reject replaced by ``_``."""
    return PREFIX + _UNSAFE.sub("_", name)


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
        for i, j in zip(*np.triu_indices(len(names), k=1)):
            cols[f"{name}/{names[i]}/{names[j]}"] = (cos[:, i, j], on[:, i] & on[:, j])
    return uniq, {scalar_name(n): steps.step_mean(v, index, len(uniq), mask) for n, (v, mask) in cols.items()}


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
