"""Per-training-step statistics from per-optimizer-step records: the one aggregation rule.

A run file holds one record per optimizer step (several per training step under verl-style
mini-batching, each tagged with the policy it updated). A role's statistic at training step t is
the mean over that step's records in which the role is *present* (its gradient is non-zero), so a
voter policy's three records and the aggregator policy's one do not dilute each other. The
analyses (whole runs, vectorised), the alerts (one step at a time) and ``RunReader.stats(per="step")``
(pandas) all aggregate with these functions.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from gradscope import stats


def step_mean(values: np.ndarray, index: np.ndarray, n_steps: int, mask: np.ndarray | None = None) -> np.ndarray:
    """Mean of record values per training step: (N, ...) → (n_steps, ...); NaN where none counts.

    Args:
        values: (N, ...) one value (or array) per record.
        index: (N,) int, the training-step slot of each record, in ``[0, n_steps)``.
        mask: (N, ...) bool, which record values count (default: the finite ones; non-finite
            values never count).
    """
    values = np.asarray(values, dtype=float)
    ok = np.isfinite(values) if mask is None else (mask & np.isfinite(values))
    tail = values.shape[1:]
    if not len(values):
        return np.full((n_steps, *tail), np.nan)
    flat_v = np.where(ok, values, 0.0).reshape(len(values), -1)
    flat_ok = ok.reshape(len(values), -1).astype(float)
    total = np.stack([np.bincount(index, flat_v[:, c], minlength=n_steps) for c in range(flat_v.shape[1])], axis=1)
    count = np.stack([np.bincount(index, flat_ok[:, c], minlength=n_steps) for c in range(flat_v.shape[1])], axis=1)
    mean = np.divide(total, count, out=np.full_like(total, np.nan), where=count > 0)
    return mean.reshape(n_steps, *tail)


def present(role_norms: np.ndarray) -> np.ndarray:
    """(N, R) bool: the role has a non-zero gradient in the record (NaN norms count as absent)."""
    return np.nan_to_num(role_norms, nan=0.0) > 0


def component_present(role_norms: np.ndarray) -> np.ndarray:
    """(N, R + 2) bool: update components that count in a record — a role's where it has a gradient
    (:func:`present`), the two extras (unattributed, weight decay) always."""
    return np.concatenate([present(role_norms), np.ones((len(role_norms), len(stats.UPDATE_EXTRAS)), bool)], axis=1)


def shared_set_stats(gram: np.ndarray, tokens: np.ndarray, agent_roles: list[str],
                     set_roles: list[str]) -> dict[str, np.ndarray]:
    """Per-record shares of the roles training one parameter set, each (N, R_set).

    ``share`` (contribution), ``token_share`` and ``per_token_share`` among ``set_roles`` only:
    agents of other roles are dropped, so an IP run's other adapters do not enter a set's shares.
    ``gram`` (N, K, K), ``tokens`` (N, K).
    """
    keep = np.isin(np.asarray(agent_roles), set_roles)
    M = gram[:, keep][:, :, keep]
    P, _ = stats.role_indicator([r for r, k in zip(agent_roles, keep) if k], list(set_roles))
    tok = tokens[:, keep]
    # a record whose Gram is not finite is left out of every statistic, its token share too
    token_share = np.where(np.isfinite(M).all(axis=(1, 2))[:, None], stats.token_shares(tok, P), np.nan)
    return {"share": stats.contribution_shares(M, P),
            "token_share": token_share,
            "per_token_share": stats.per_token_shares(M, tok, P)}


def step_columns(columns: Mapping[str, np.ndarray], gram: np.ndarray, record_step: np.ndarray,
                 agents: Sequence[str], agent_roles: Sequence[str],
                 roles: Sequence[str] | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per-record ``stats.derive`` columns, aggregated per training step by the rule above.

    A column's value at step t is the mean over t's records in which its subject has a gradient:
    ``norm/<agent>`` where the agent's norm is > 0, ``cos/<A>|<B>`` where both agents' are,
    ``<statistic>/<role>`` where the role is :func:`present`, ``role_cos/<A>|<B>`` and
    ``update_cos/<A>|<B>`` where both roles are, ``interference/<c>|<s>`` where c's role is;
    ``total_norm`` (and any column of no agent or role: the update extras, ``total_update_norm``)
    over all of t's records. Non-finite values never count.

    Args:
        columns: name → (N,) per-record values (``stats.derive`` of ``gram``).
        gram: (N, K, K) the records' Grams; record_step: (N,) their training steps.
        roles: every role the columns may name (default: the agents' roles); a role no agent has is never
            present, so its columns are NaN. Role pairs match in either order (``role_cos`` names them in the
            agents' order of first appearance, ``update_cos`` in the run's ``roles`` order).
    Returns:
        (steps, columns): the T distinct steps, increasing, and name → (T,) per-step values.
    """
    steps, index = np.unique(np.asarray(record_step), return_inverse=True)
    agents = list(agents)
    P, roles = stats.role_indicator(list(agent_roles), None if roles is None else list(roles))
    agent_on = np.nan_to_num(stats.agent_norms(gram), nan=0.0) > 0         # (N, K)
    role_on = present(stats.role_norms(gram, P))                           # (N, R)
    subjects = {"norm": {a: agent_on[:, k] for k, a in enumerate(agents)},  # family → subject → (N,) mask
                "cos": {f"{agents[i]}|{agents[j]}": agent_on[:, i] & agent_on[:, j]
                        for i, j in zip(*np.triu_indices(len(agents), k=1))}}
    subjects["role_cos"] = subjects["update_cos"] = {f"{roles[i]}|{roles[j]}": role_on[:, i] & role_on[:, j]
                                                     for i in range(len(roles)) for j in range(len(roles)) if i != j}
    of_role = {r: role_on[:, j] for j, r in enumerate(roles)}                # every other family
    out = {}
    for name, values in columns.items():
        family, _, subject = name.partition("/")
        if family == "interference":  # <component>|<role>: where the component's role has a gradient
            subject = subject.partition("|")[0]
        out[name] = step_mean(values, index, len(steps), subjects.get(family, of_role).get(subject))
    return steps, out


def set_update_shares(update_gram: np.ndarray, unit_roles: list[str], roles: list[str],
                      set_roles: list[str]) -> np.ndarray:
    """(N, R_set) update shares ``<Δθ_r, Δθ>/‖Δθ‖²`` of the roles training one parameter set.

    ``update_gram`` (N, C, C) update-component Grams, ``unit_roles`` the role of each of its units,
    ``roles`` all roles. The share is of the whole update (weight decay and unattributed included), so
    a set's role shares sum to 1 minus those two; roles outside the set move none of its parameters.
    """
    Q, names = stats.update_indicator(unit_roles, roles)
    return stats.contribution_shares(update_gram, Q)[..., [names.index(r) for r in set_roles]]
