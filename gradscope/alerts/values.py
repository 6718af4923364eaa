"""Named per-step values for the rule engine, from what a run file holds.

* :meth:`StepValues.records` — one training step's Gram records (the statistics of
  ``gradscope.stats``, aggregated per step by ``gradscope.steps``), their scalars, ``nonfinite``,
  and with update attribution the update statistics (``update_share[voter]``, ...);
* :meth:`StepValues.metrics` — per-step metrics (``update_norm/voter`` is also ``update_norm[voter]``);
* :meth:`StepValues.evals` — held-out accuracy, its running peak and the drop below it.

Value names are ``statistic[selector]`` or ``statistic``; the full list is in docs/alerts.md.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

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
        update_unit: ``"role"`` / ``"agent"``: what the records' update components are (``""``: none).
    """

    def __init__(self, agents: Sequence[str], agent_roles: Sequence[str],
                 wanted: Collection[str] | None = None, policies: Sequence[str] = (),
                 update_unit: str = "") -> None:
        self.agents, self.agent_roles = list(agents), list(agent_roles)
        self.policies = list(policies)  # known up front (metrics may name them before any record)
        self.P, self.roles = stats.role_indicator(self.agent_roles)
        self.unit_roles = {"role": self.roles, "agent": self.agent_roles}.get(update_unit)
        self.n_per_role = self.P.sum(axis=0)
        self.wanted = None if wanted is None else set(wanted)  # statistic names to compute (None: all)
        self.role_sets: dict[str, list[str]] = {}   # policy → roles seen with a gradient in its records
        self.acc_recent: list[float] = []         # the last ACC_SMOOTH accuracies
        self.acc_peak = -np.inf

    def _want(self, *names: str) -> bool:
        return self.wanted is None or any(n in self.wanted for n in names)

    def records(self, gram: np.ndarray, tokens: np.ndarray | None = None,
                policies: Sequence[str | None] | None = None,
                scalars: Sequence[Mapping[str, float]] | None = None,
                update_gram: np.ndarray | None = None,
                update_interference: np.ndarray | None = None) -> dict[str, float]:
        """Values of one training step from its records (only the ``wanted`` statistics).

        Args:
            gram: (N, K, K) the step's Gram records (N optimizer steps).
            tokens: (N, K) tokens per agent and record (default: none counted).
            policies: (N,) policy each record updated (None / "" = untagged, set ``"all"``).
            scalars: (N,) per-record scalars (loss, grad_norm, ...) → ``opt.<name>[<policy>]``.
            update_gram, update_interference: (N, C, C) and (N, C, K) update attribution of the
                records (NaN where not logged); only with an ``update_unit``.
        """
        M = np.asarray(gram, dtype=np.float64).reshape(-1, len(self.agents), len(self.agents))
        N = len(M)
        pol = ["all" if not p else str(p) for p in (policies if policies is not None else [None] * N)]
        bad_scalars = any(np.isinf(v) for s in scalars or () for v in s.values())  # (NaN: not logged)
        out = {"nonfinite": float(not stats.finite_mask(M).all() or bad_scalars)}
        present = steps.present(stats.role_norms(M, self.P))     # (N, R)
        out.update(self._roles(M, present))
        out.update(self._agents(M, present))
        UG = None
        if update_gram is not None and self.unit_roles is not None:
            UG = np.asarray(update_gram, dtype=np.float64).reshape(N, *np.shape(update_gram)[-2:])
            out.update(self._updates(UG, np.asarray(update_interference, dtype=np.float64).reshape(
                N, *np.shape(update_interference)[-2:]), present))
        for p in dict.fromkeys(pol):
            mine = np.array([q == p for q in pol])
            seen = self.role_sets.setdefault(p, [])
            seen += [r for j, r in enumerate(self.roles) if present[mine, j].any() and r not in seen]
            seen.sort(key=self.roles.index)
            tok = None if tokens is None else np.asarray(tokens, dtype=np.float64).reshape(N, -1)[mine]
            _largest(out, self._policy(p, M[mine], tok, seen, [scalars[i] for i in np.flatnonzero(mine)]
                                       if scalars else []))
            if UG is not None and len(seen) >= 2 and self._want("update_share", "update_share_gap"):
                _largest(out, self._update_shares(M[mine], tok, UG[mine], seen))
        return out

    def _updates(self, UG: np.ndarray, UI: np.ndarray, present: np.ndarray) -> dict[str, float]:
        """Per-role update norms and update cosines (over records where the roles have a gradient), and
        interference between roles (over records where the updating role has one)."""
        one, R = np.zeros(len(UG), dtype=np.int64), len(self.roles)
        Q, _ = stats.update_indicator(self.unit_roles, self.roles)
        out = {}
        if self._want("role_update_norm"):
            norms = steps.step_mean(stats.role_norms(UG, Q)[:, :R], one, 1, present)[0]
            out.update({f"role_update_norm[{r}]": norms[j] for j, r in enumerate(self.roles)})
        masks = {"update_cosine": present[:, :, None] & present[:, None, :],  # both roles trained
                 "interference": np.repeat(present[:, :, None], R, axis=2)}  # the updating role trained
        for name, values in (("update_cosine", lambda: stats.cosine(stats.role_gram(UG, Q))[:, :R, :R]),
                             ("interference", lambda: stats.interference(UI, Q, self.P)[:, :R, :R])):
            if not self._want(name):
                continue
            mean = steps.step_mean(values(), one, 1, masks[name])[0]
            for i, j in zip(*np.triu_indices(R, k=1)):
                out[f"{name}[{self.roles[i]}|{self.roles[j]}]"] = mean[i, j]
                if name == "interference":  # not symmetric: r's update on s's loss, both ways
                    out[f"{name}[{self.roles[j]}|{self.roles[i]}]"] = mean[j, i]
        return out

    def _update_shares(self, M: np.ndarray, tokens: np.ndarray | None, UG: np.ndarray,
                       roles: list[str]) -> dict[str, float]:
        """One shared set's update shares and their gap to the gradient (contribution) shares."""
        one = np.zeros(len(M), dtype=np.int64)
        upd = steps.set_update_shares(UG, self.unit_roles, self.roles, roles)
        grad = steps.shared_set_stats(M, np.zeros(M.shape[:2]) if tokens is None else tokens,
                                      self.agent_roles, roles)["share"]
        out = {}
        for name, values in (("update_share", upd), ("update_share_gap", upd - grad)):
            for j, v in enumerate(steps.step_mean(values, one, 1)[0]):
                out[f"{name}[{roles[j]}]"] = v
        return out

    def _roles(self, M: np.ndarray, present: np.ndarray) -> dict[str, float]:
        """Per-role statistics: mean over the step's records in which the role is present."""
        families = {"grad_norm": lambda: stats.role_norms(M, self.P),
                    "mass_share": lambda: stats.mass_shares(M, self.P),
                    "coherence": lambda: stats.coherence(M, self.P),
                    "amplification": lambda: stats.amplification_factor(M, self.P),
                    "signal_fraction": lambda: stats.signal_fraction(M, self.P)}
        out = {}
        for name, compute in families.items():
            if not self._want(name):
                continue
            means = steps.step_mean(compute(), np.zeros(len(M), dtype=np.int64), 1, present)[0]
            for j, role in enumerate(self.roles):
                if name in ("grad_norm", "mass_share") or self.n_per_role[j] >= 2:
                    out[f"{name}[{role}]"] = means[j]
        return out

    def _agents(self, M: np.ndarray, present: np.ndarray) -> dict[str, float]:
        """Agent norms and the agent / role cosines (over records where both have a gradient)."""
        one = np.zeros(len(M), dtype=np.int64)
        norms = stats.agent_norms(M)
        out = {}
        if self._want("agent_norm"):
            for k, v in enumerate(steps.step_mean(norms, one, 1, norms > 0)[0]):
                out[f"agent_norm[{self.agents[k]}]"] = v
        for name, gram, names, has in (("cosine", lambda: M, self.agents, norms > 0),
                                       ("role_cosine", lambda: stats.role_gram(M, self.P), self.roles, present)):
            if not self._want(name):
                continue
            cos = steps.step_mean(stats.cosine(gram()), one, 1, has[:, :, None] & has[:, None, :])[0]
            for i, j in zip(*np.triu_indices(len(names), k=1)):
                out[f"{name}[{names[i]}|{names[j]}]"] = cos[i, j]
        return out

    def _policy(self, policy: str, M: np.ndarray, tokens: np.ndarray | None, roles: list[str],
                scalars: list[Mapping[str, float]]) -> dict[str, float]:
        """One policy's records: its total norm, shares if two or more roles train it, its scalars."""
        one = np.zeros(len(M), dtype=np.int64)
        out = {}
        if self._want("total_norm"):
            out[f"total_norm[{policy}]"] = steps.step_mean(stats.total_norm(M), one, 1)[0]
        if len(roles) >= 2 and self._want("share", "token_share", "per_token_share"):
            tok = np.zeros(M.shape[:2]) if tokens is None else tokens
            for name, values in steps.shared_set_stats(M, tok, self.agent_roles, roles).items():
                if tokens is None and name != "share":  # no token counts: no token statistics
                    continue
                for j, v in enumerate(steps.step_mean(values, one, 1)[0]):
                    out[f"{name}[{roles[j]}]"] = v
        for name in dict.fromkeys(n for s in scalars for n in s):
            if self._want(f"opt.{name}"):
                vals = np.array([s.get(name, np.nan) for s in scalars], dtype=float)
                out[f"opt.{name}[{policy}]"] = steps.step_mean(vals, one, 1)[0]
        return out

    def metrics(self, values: Mapping[str, float]) -> dict[str, float]:
        """Per-step metrics: ``a/b`` as itself, and as ``a[b]`` when ``b`` names a role, agent or
        policy; names without ``/`` as ``metric.<name>``."""
        names = set(self.roles) | set(self.agents) | set(self.policies) | set(self.role_sets)
        out = {}
        for name, v in values.items():
            stem, _, last = name.rpartition("/")
            out[name if stem else f"metric.{name}"] = float(v)
            if stem and last in names:
                out[f"{stem}[{last}]"] = float(v)
        return out

    def evals(self, values: Mapping[str, float]) -> dict[str, float]:
        """An evaluation: ``accuracy`` (as measured), ``acc_smooth`` (median of the last 3, from the third
        evaluation on, as the cliff detector smooths, so one bad evaluation is not a drop), ``acc_peak`` (running max of
        ``acc_smooth``), ``acc_drop = acc_peak − acc_smooth``, ``acc_drop_rel = acc_drop / acc_peak``,
        and every column as ``eval.<name>`` (``eval.length/voter`` also as ``eval.length[voter]``)."""
        out = {f"eval.{k}": v for k, v in self.metrics(values).items() if not k.startswith("metric.")}
        out.update({f"eval.{k}": float(v) for k, v in values.items() if "/" not in k})
        acc = float(values.get("accuracy", np.nan))
        if np.isfinite(acc):
            out["accuracy"] = acc
            self.acc_recent = [*self.acc_recent, acc][-ACC_SMOOTH:]
            if len(self.acc_recent) < ACC_SMOOTH:  # a median of two is their mean: one bad evaluation would drop
                return out
            smooth = float(np.median(self.acc_recent))
            self.acc_peak = max(self.acc_peak, smooth)
            drop = self.acc_peak - smooth
            out.update(acc_smooth=smooth, acc_peak=self.acc_peak, acc_drop=drop,
                       acc_drop_rel=drop / self.acc_peak if self.acc_peak > 0 else 0.0)
        return out


def _largest(out: dict[str, float], values: Mapping[str, float]) -> None:
    """``out.update(values)``, keeping the larger where both name a value: a role training several shared
    parameter sets gets its largest share (of any set) under ``share[role]`` (and the other per-set values)."""
    for name, v in values.items():
        if name in out and not np.isnan(out[name]) and not v > out[name]:
            continue
        out[name] = v
