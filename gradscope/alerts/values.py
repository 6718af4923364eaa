"""Named per-step values for the rule engine, from what a run file holds.

* :meth:`StepValues.records` — one training step's Gram records (the statistics of
  ``gradscope.stats``, aggregated per step by ``gradscope.steps``), their scalars, ``nonfinite``;
* :meth:`StepValues.metrics` — per-step metrics (``update_norm/voter`` is also ``update_norm[voter]``);
* :meth:`StepValues.evals` — held-out accuracy, its running peak and the drop below it.

Value names are ``statistic[selector]`` or ``statistic``; the full list is in docs/alerts.md.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from gradscope import stats, steps

#: Evaluations in the running median behind ``acc_drop`` (the cliff detector's smoothing).
ACC_SMOOTH = 3


class StepValues:
    """Turns records, metrics and evaluations into named values; remembers what it needs across
    steps (which roles train each policy, the accuracy peak).

    Args:
        agents: (K,) agent names, the Gram's row order.
        agent_roles: (K,) each agent's role.
    """

    def __init__(self, agents: Sequence[str], agent_roles: Sequence[str]) -> None:
        self.agents, self.agent_roles = list(agents), list(agent_roles)
        self.P, self.roles = stats.role_indicator(self.agent_roles)
        self.n_per_role = self.P.sum(axis=0)
        self.role_sets: dict[str, list[str]] = {}   # policy → roles seen with a gradient in its records
        self.acc_recent: list[float] = []         # the last ACC_SMOOTH accuracies
        self.acc_peak = -np.inf

    def records(self, gram: np.ndarray, tokens: np.ndarray | None = None,
                policies: Sequence[str | None] | None = None,
                scalars: Sequence[Mapping[str, float]] | None = None) -> dict[str, float]:
        """Values of one training step from its records.

        Args:
            gram: (N, K, K) the step's Gram records (N optimizer steps).
            tokens: (N, K) tokens per agent and record (default: none counted).
            policies: (N,) policy each record updated (None / "" = untagged, set ``"all"``).
            scalars: (N,) per-record scalars (loss, grad_norm, ...) → ``opt.<name>[<policy>]``.
        """
        M = np.asarray(gram, dtype=np.float64).reshape(-1, len(self.agents), len(self.agents))
        N = len(M)
        tok = np.zeros((N, len(self.agents))) if tokens is None else np.asarray(tokens, dtype=np.float64).reshape(N, -1)
        pol = ["all" if not p else str(p) for p in (policies if policies is not None else [None] * N)]
        one = np.zeros(N, dtype=np.int64)  # every record in the same (only) step slot
        out: dict[str, float] = {}

        finite = stats.finite_mask(M)
        bad_scalars = [name for s in scalars or () for name, v in s.items() if not np.isfinite(v)]
        out["nonfinite"] = float((not finite.all()) or bool(bad_scalars))

        role_norm = stats.role_norms(M, self.P)                    # (N, R)
        present = steps.present(role_norm)
        per_role = {"grad_norm": role_norm,
                    "coherence": stats.coherence(M, self.P),
                    "amplification": stats.amplification_factor(M, self.P),
                    "signal_fraction": stats.signal_fraction(M, self.P)}
        for name, values in per_role.items():
            means = steps.step_mean(values, one, 1, present)[0]
            for j, role in enumerate(self.roles):
                if name in ("grad_norm",) or self.n_per_role[j] >= 2:
                    out[f"{name}[{role}]"] = means[j]
        norms = stats.agent_norms(M)
        for k, v in enumerate(steps.step_mean(norms, one, 1, norms > 0)[0]):
            out[f"agent_norm[{self.agents[k]}]"] = v

        for p in dict.fromkeys(pol):
            mine = np.array([q == p for q in pol])
            seen = self.role_sets.setdefault(p, [])
            seen += [r for j, r in enumerate(self.roles) if present[mine, j].any() and r not in seen]
            seen.sort(key=self.roles.index)
            out[f"total_norm[{p}]"] = steps.step_mean(stats.total_norm(M[mine]), one[mine], 1)[0]
            if len(seen) >= 2:  # a shared parameter set: shares among the roles training it
                for name, values in steps.shared_set_stats(M[mine], tok[mine], self.agent_roles, seen).items():
                    for j, v in enumerate(steps.step_mean(values, one[mine], 1)[0]):
                        out[f"{name}[{seen[j]}]"] = v
            for name in {n for i in np.flatnonzero(mine) for n in (scalars[i] if scalars else ())}:
                vals = np.array([scalars[i].get(name, np.nan) for i in np.flatnonzero(mine)], dtype=float)
                out[f"opt.{name}[{p}]"] = steps.step_mean(vals, one[mine], 1)[0]
        return out

    def metrics(self, values: Mapping[str, float]) -> dict[str, float]:
        """Per-step metrics: ``a/b`` as itself, and as ``a[b]`` when ``b`` names a role, agent or
        policy; names without ``/`` as ``metric.<name>``."""
        names = set(self.roles) | set(self.agents) | set(self.role_sets)
        out = {}
        for name, v in values.items():
            stem, _, last = name.rpartition("/")
            out[name if stem else f"metric.{name}"] = float(v)
            if stem and last in names:
                out[f"{stem}[{last}]"] = float(v)
        return out

    def evals(self, values: Mapping[str, float]) -> dict[str, float]:
        """An evaluation: ``accuracy`` (as measured), ``acc_smooth`` (median of the last 3, as the
        cliff detector smooths, so one bad evaluation is not a drop), ``acc_peak`` (running max of
        ``acc_smooth``), ``acc_drop = acc_peak − acc_smooth``, ``acc_drop_rel = acc_drop / acc_peak``,
        and every column as ``eval.<name>`` (``eval.length/voter`` also as ``eval.length[voter]``)."""
        out = {f"eval.{k}": v for k, v in self.metrics(values).items() if not k.startswith("metric.")}
        out.update({f"eval.{k}": float(v) for k, v in values.items() if "/" not in k})
        acc = float(values.get("accuracy", np.nan))
        if np.isfinite(acc):
            self.acc_recent = [*self.acc_recent, acc][-ACC_SMOOTH:]
            smooth = float(np.median(self.acc_recent))
            self.acc_peak = max(self.acc_peak, smooth)
            drop = self.acc_peak - smooth
            out.update(accuracy=acc, acc_smooth=smooth, acc_peak=self.acc_peak, acc_drop=drop,
                       acc_drop_rel=drop / self.acc_peak if self.acc_peak > 0 else 0.0)
        return out
