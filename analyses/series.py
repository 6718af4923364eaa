"""``RunSeries``: what every detector reads — a run's per-record Grams, aggregated per training step.

A run file holds one record per optimizer step (several per training step under verl-style
mini-batching, each tagged with the policy it updated). Detectors work on training steps: a role's
statistic at step t is the mean over that step's records in which the role is *present* (its
gradient is non-zero), so a voter policy's three records and the aggregator policy's one do not
dilute each other.

Shared parameter sets are read off the records, not the trainer's config, so runs of any framework
work: the roles of a policy are those with non-zero gradient in its records (all records untagged:
one set ``"all"``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import pandas as pd

from gradscope import stats, steps
from gradscope.runfile import RunReader


@dataclass
class RunSeries:
    """A run as arrays. Shapes: N records, K agents, R roles, T training steps, E evaluations.

    Attributes:
        agents, agent_roles: (K,) names and each agent's role.
        gram: (N, K, K) per-record Gram; record_step (N,); record_policy (N,) names ("" = untagged).
        tokens: (N, K) tokens per agent per record.
        evals: wide evaluation table, index = step (0 = base), columns e.g. ``accuracy``,
            ``length/<role>``, ``format_valid/<role>``; may be empty.
        metrics: wide per-training-step metrics (``update_norm/<policy>``, ...); may be empty.
        config: the run's config (workflow, policy, model...), for reports.
        name: a label (usually the file path).
        update_gram, update_interference: (N, C, C), (N, C, K) update attribution (NaN where a record
            has none), or None when the run has none; update_unit: ``"role"`` / ``"agent"`` / ``""``.
    """

    agents: list[str]
    agent_roles: list[str]
    gram: np.ndarray
    record_step: np.ndarray
    record_policy: np.ndarray
    tokens: np.ndarray
    evals: pd.DataFrame = field(default_factory=pd.DataFrame)
    metrics: pd.DataFrame = field(default_factory=pd.DataFrame)
    config: dict = field(default_factory=dict)
    name: str = ""
    update_gram: np.ndarray | None = None
    update_interference: np.ndarray | None = None
    update_unit: str = ""
    _set_stats: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_reader(cls, run: RunReader, name: str = "") -> "RunSeries":
        return cls(agents=list(run.meta.agents), agent_roles=list(run.meta.agent_roles), gram=run.gram,
                   record_step=np.asarray(run.step), record_policy=np.array([p or "" for p in run.policy], dtype=str),
                   tokens=run.tokens, evals=run.evals_wide(), metrics=run.metrics_wide(),
                   config=dict(run.meta.config or {}), name=name, update_gram=run.update_gram,
                   update_interference=run.update_interference, update_unit=run.meta.update_unit)

    # ------------------------------------------------------------------ structure
    @cached_property
    def roles(self) -> list[str]:
        return list(dict.fromkeys(self.agent_roles))

    @cached_property
    def P(self) -> np.ndarray:
        """(K, R) agent→role indicator."""
        return stats.role_indicator(self.agent_roles, self.roles)[0]

    @cached_property
    def n_agents(self) -> np.ndarray:
        """(R,) agents per role."""
        return self.P.sum(axis=0).astype(int)

    @cached_property
    def steps(self) -> np.ndarray:
        """(T,) training steps with gradient records, increasing."""
        return np.unique(self.record_step)

    @cached_property
    def _step_index(self) -> np.ndarray:
        return np.searchsorted(self.steps, self.record_step)

    @cached_property
    def finite(self) -> np.ndarray:
        """(N,) records whose Gram is finite."""
        return stats.finite_mask(self.gram)

    @cached_property
    def role_sets(self) -> dict[str, list[str]]:
        """policy → roles trained by it (non-zero gradient in its records)."""
        present = steps.present(self.record_role_norm)
        out = {}
        for policy in dict.fromkeys(self.record_policy.tolist()):
            mask = self.record_policy == policy
            out[policy or "all"] = [r for j, r in enumerate(self.roles) if present[mask, j].any()]
        return out

    @cached_property
    def shared_sets(self) -> dict[str, list[str]]:
        """The parameter sets trained by two or more roles (where role capture can happen)."""
        return {p: roles for p, roles in self.role_sets.items() if len(roles) >= 2}

    # ------------------------------------------------------------------ per-record statistics
    @cached_property
    def record_role_norm(self) -> np.ndarray:
        """(N, R)."""
        return stats.role_norms(self.gram, self.P)

    def per_step(self, values: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """Mean over each training step's records: (N, ...) → (T, ...) (:func:`gradscope.steps.step_mean`)."""
        return steps.step_mean(values, self._step_index, len(self.steps), mask)

    @cached_property
    def role_norm(self) -> np.ndarray:
        """(T, R) per-role gradient norm, mean over records where the role is present."""
        norms = self.record_role_norm
        return self.per_step(norms, norms > 0)

    @cached_property
    def coherence(self) -> np.ndarray:
        """(T, R) coherence AF_r / n_r (NaN for one-agent roles and steps without the role)."""
        return self.per_step(stats.coherence(self.gram, self.P), self.record_role_norm > 0)

    @cached_property
    def amplification(self) -> np.ndarray:
        """(T, R) amplification factor."""
        return self.per_step(stats.amplification_factor(self.gram, self.P), self.record_role_norm > 0)

    @cached_property
    def agent_cosine(self) -> np.ndarray:
        """(T, K, K) mean agent cosine per step, over records where both agents have a gradient
        (NaN where they never do together); the diagonal is 1 where the agent is present."""
        present = stats.agent_norms(self.gram) > 0
        return self.per_step(stats.cosine(self.gram), present[:, :, None] & present[:, None, :])

    def set_stats(self, policy: str) -> dict[str, np.ndarray]:
        """Per-step statistics of the roles sharing ``policy``'s parameters, each (T, R_p):
        contribution ``share``, ``token_share``, ``per_token_share`` (records of that policy).
        Computed once per policy (three readers need them)."""
        if policy not in self._set_stats:
            self._set_stats[policy] = self._compute_set_stats(policy)
        return self._set_stats[policy]

    def _compute_set_stats(self, policy: str) -> dict[str, np.ndarray]:
        roles = self.role_sets[policy]
        mask = (self.record_policy == ("" if policy == "all" else policy))[:, None]
        per_record = steps.shared_set_stats(self.gram, self.tokens, self.agent_roles, roles)
        if self.has_updates:
            per_record["update_share"] = steps.set_update_shares(self.update_gram, self.unit_roles, self.roles, roles)
        out = {name: self.per_step(values, mask) for name, values in per_record.items()}
        out["roles"] = np.array(roles)
        return out

    # ------------------------------------------------------------------ update attribution
    @property
    def has_updates(self) -> bool:
        """Whether the run recorded update attribution (``update_share`` joins :meth:`set_stats`)."""
        return self.update_gram is not None and bool(self.update_unit)

    @cached_property
    def unit_roles(self) -> list[str]:
        """The role of each unit of the update components (roles, or agents' roles)."""
        return self.roles if self.update_unit == "role" else self.agent_roles

    @cached_property
    def update_Q(self) -> np.ndarray:
        """(C, R + 2) component indicator (:func:`gradscope.stats.update_indicator`)."""
        return stats.update_indicator(self.unit_roles, self.roles)[0]

    @cached_property
    def role_update_norm(self) -> np.ndarray:
        """(T, R) per-role update norm ‖Δθ_r‖, mean over records where the role has a gradient."""
        norms = stats.role_norms(self.update_gram, self.update_Q)[:, :len(self.roles)]
        return self.per_step(norms, self.record_role_norm > 0)

    @cached_property
    def record_interference(self) -> np.ndarray:
        """(N, R + 2, R) ``<Δθ_a, g_s>`` of each record by component a (roles, unattributed, weight
        decay) and role s; NaN where a's role has no gradient in the record (the extras: never)."""
        per_record = stats.interference(self.update_interference, self.update_Q, self.P)
        return np.where(steps.component_present(self.record_role_norm)[:, :, None], per_record, np.nan)

    @cached_property
    def role_interference(self) -> np.ndarray:
        """(T, R + 2, R) :attr:`record_interference`, mean over each step's records."""
        return self.per_step(self.record_interference)

    @cached_property
    def accuracy(self) -> pd.Series:
        """Held-out accuracy by evaluation step, finite values only (empty when the run has no evaluations)."""
        if "accuracy" in self.evals:
            acc = self.evals["accuracy"]
            return acc[np.isfinite(acc.to_numpy(dtype=float))]
        return pd.Series(dtype=float)
