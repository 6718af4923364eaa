"""GRPO as in the paper, optimised as in verl: per-policy mini-batches, one optimizer step each.

* Reward: the episode's binary final outcome, copied to every turn of every agent.
* Advantage: normalised within groups keyed by ``(task, agent, turn)``:
  ``A = (r − mean) / (std + 1e-6)``; a group of one keeps ``A = r`` (verl's convention).
* Loss: the clipped surrogate with asymmetric clipping ``[1 − clip_low, 1 + clip_high]``, averaged
  over the completion tokens of a mini-batch ("token-mean"); optional k3 KL to the base model.
* Each policy's samples (one adapter's turns) are shuffled and split into ``ceil(n /
  mini_batch_size)`` near-equal mini-batches (n samples over all ranks); each mini-batch is one
  probed optimizer step. A role with three agents therefore takes about three times the optimizer
  steps of a one-agent role.

Mitigations (docs/training.md, "Mitigations"), each per role:

* ``kl_coef`` — per-role KL anchor: each token's loss gains ``β_role · k3`` with
  ``k3 = exp(ref − lp) − (ref − lp) − 1`` against the adapter-free base model.
* ``coherence_reg`` — per-role coherence regulariser: at each optimizer step the gradient of role
  r's tokens, ``g_r``, is scaled by ``c_r = 1 − λ_r · max(0, cos(g_r, ḡ_r))`` where ``ḡ_r`` is the EMA
  (decay ``coherence_beta``) of the role's past raw gradients (``c_r = 1`` at its first step); applied
  by scaling the role's token losses, so the probe measures the scaled gradient.
* ``role_balance`` — ``steps``: a policy's samples are split into the number of mini-batches one
  agent slot's samples would take, ``ceil(n / (mini_batch_size · slots))`` (slots: agents routed to
  the policy), so every policy takes the same number of optimizer steps; ``update``: the usual
  mini-batches, each optimizer step at ``lr · n_slot / n_policy`` (n_slot: that per-slot count), so
  every policy's learning-rate budget ``lr × steps`` per training step is one slot's.
"""
from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from gradscope.peft_support import use_adapter
from gradscope.probe import Probe, StepResult, UpdateResult
from gradscope.stats import cosine
from gradscope.trainers.distributed import Dist
from gradscope.trainers.grpo_config import ROLE_BALANCE, GRPOConfig
from gradscope.trainers.per_role import role_values
from gradscope.trainers.policy import PolicyMap
from gradscope.trainers.rollout import pack, token_logprobs
from gradscope.trainers.workflows.base import Episode, Turn

#: Scalars logged with every optimizer step (the run file's per-record scalars).
STEP_SCALARS = ["loss", "clip_frac", "grad_norm", "lr", "samples", "tokens", "kl"]


@dataclass
class TrainSample:
    turn: Turn
    agent: int         # index into the probe's agents
    advantage: float
    old_logprobs: torch.Tensor | None = None  # (T_completion,)
    ref_logprobs: torch.Tensor | None = None


def advantages(episodes: Sequence[Episode]) -> list[tuple[Turn, float]]:
    """Every turn with its GRPO advantage, grouped by (task, agent, turn index)."""
    groups: dict[tuple, list[tuple[Turn, float]]] = defaultdict(list)
    for ep in episodes:
        for turn in ep.turns:
            groups[(ep.task.id, turn.agent, turn.turn)].append((turn, ep.reward))
    out = []
    for members in groups.values():
        rewards = np.array([r for _, r in members])
        if len(members) == 1:
            out.append((members[0][0], float(rewards[0])))
            continue
        mean, std = rewards.mean(), rewards.std(ddof=1)
        out += [(turn, float((r - mean) / (std + 1e-6))) for turn, r in members]
    return out


@dataclass
class OptimizerStep:
    """One probed optimizer step, as the trainer logs it."""

    policy: str
    result: StepResult
    scalars: dict[str, float]
    update: UpdateResult | None = None  # the step's update attribution (probe.attach; None: off or skipped)


class GRPOUpdater:
    """Holds one AdamW per adapter (over that adapter's parameters, built explicitly) and the probe."""

    def __init__(self, model, tokenizer, policy: PolicyMap, probe: Probe, adapter_params: dict[str, list],
                 cfg: GRPOConfig, seed: int, dist: Dist = Dist()) -> None:
        self.model, self.policy, self.probe, self.cfg, self.dist = model, policy, probe, cfg, dist
        self.pad_id = tokenizer.pad_token_id
        self.params = adapter_params
        self.optimizers = {a: torch.optim.AdamW(self.params[a], lr=cfg.lr, weight_decay=cfg.weight_decay)
                           for a in policy.adapters}
        self.rng = random.Random(seed)
        roles = list(policy.role_to_adapter)
        self.kl = role_values(cfg.kl_coef, roles, "kl-coef")
        self.coherence = role_values(cfg.coherence_reg, roles, "coherence-reg")
        #: role → EMA of its raw per-optimizer-step gradient (flat, over its adapter's parameters)
        self.coherence_ema: dict[str, torch.Tensor] = {}
        self._scales: dict[str, list[float]] = defaultdict(list)  # role → c_r of this training step
        self.slots = {a: sum(policy[r] == a for r in probe.agent_roles) for a in policy.adapters}

    def lr_at(self, step: int) -> float:
        """The learning rate of training step ``step`` (from 1): linear warm-up to ``lr`` at ``warmup_steps``."""
        return self.cfg.lr * min(1.0, step / max(1, self.cfg.warmup_steps))

    def update(self, step: int, episodes: Sequence[Episode], mini_batch_size: int,
               probe_this_step: bool) -> tuple[list[OptimizerStep], dict[str, float]]:
        """All optimizer steps of one training step. Returns the probed steps and per-step metrics."""
        samples = [TrainSample(t, self.probe.agent_index(t.agent), a) for t, a in advantages(episodes)]
        by_adapter: dict[str, list[TrainSample]] = defaultdict(list)
        for s in samples:
            by_adapter[self.policy[s.turn.role]].append(s)
        self._old_logprobs(by_adapter)
        logged: list[OptimizerStep] = []
        metrics: dict[str, float] = {}
        self._scales.clear()
        for adapter in self.policy.adapters:
            batch = by_adapter.get(adapter, [])
            if self.cfg.shuffle:
                self.rng.shuffle(batch)
            chunks, lr_factor = self._plan(adapter, batch, mini_batch_size)
            for group in self.optimizers[adapter].param_groups:
                group["lr"] = self.lr_at(step) * lr_factor
            before = torch.cat([p.detach().reshape(-1) for p in self.params[adapter]]).clone()
            n_steps = 0
            for chunk in chunks:
                logged_step = self._optimizer_step(step, adapter, chunk, probe_this_step)
                n_steps += 1
                if logged_step is not None:
                    logged.append(logged_step)
            after = torch.cat([p.detach().reshape(-1) for p in self.params[adapter]])
            delta = float((after - before).norm())
            metrics[f"opt_steps/{adapter}"] = n_steps
            metrics[f"update_norm/{adapter}"] = delta
            metrics[f"update_rel/{adapter}"] = delta / max(float(before.norm()), 1e-12)
        for role, scales in self._scales.items():
            metrics[f"coherence_scale/{role}"] = float(np.mean(scales))
        return logged, metrics

    def _plan(self, adapter: str, batch: list[TrainSample], size: int) -> tuple[list[list[TrainSample]], float]:
        """The policy's mini-batches and its learning-rate factor under ``role_balance``."""
        n_global = int(self.dist.sum([len(batch)])[0])
        per_slot = -(-n_global // (size * self.slots[adapter]))
        if self.cfg.role_balance == "steps":
            return self._mini_batches(batch, per_slot), 1.0
        n = -(-n_global // size)
        factor = per_slot / n if self.cfg.role_balance == "update" and n else 1.0
        return self._mini_batches(batch, n), factor

    @staticmethod
    def _mini_batches(batch: list[TrainSample], n: int) -> list[list[TrainSample]]:
        """``n`` mini-batches of near-equal size. Under data parallelism every rank takes the same
        number of optimizer steps (each a collective), each with its near-equal share of its local
        samples (possibly none)."""
        cuts = np.linspace(0, len(batch), n + 1).round().astype(int)
        return [batch[a:b] for a, b in zip(cuts[:-1], cuts[1:])]

    @torch.no_grad()
    def _old_logprobs(self, by_adapter: dict[str, list[TrainSample]]) -> None:
        for adapter, batch in by_adapter.items():
            for start in range(0, len(batch), 256):
                chunk = batch[start:start + 256]
                with use_adapter(self.model, adapter):
                    old = self._completion_logprobs(chunk)
                ref = None
                if any(self.kl[r] > 0 for r in self.policy.roles_of(adapter)):
                    with self.model.disable_adapter():
                        ref = self._completion_logprobs(chunk)
                for i, s in enumerate(chunk):
                    s.old_logprobs = old[i]
                    s.ref_logprobs = None if ref is None else ref[i]

    def _completion_logprobs(self, chunk: Sequence[TrainSample]) -> list[torch.Tensor]:
        ids, attn, comp = pack([s.turn.sample for s in chunk], self.pad_id, self.model.device)
        lp = token_logprobs(self.model, ids, attn, self.cfg.temperature)
        return [row[m.bool()].detach() for row, m in zip(lp, comp)]

    def _optimizer_step(self, step: int, adapter: str, batch: Sequence[TrainSample],
                        probe_this_step: bool) -> OptimizerStep | None:
        """One AdamW step on ``batch``; the loss is normalised by the mini-batch's token count over
        all ranks, and gradients are summed over ranks before clipping."""
        cfg, dist = self.cfg, self.dist
        optimizer = self.optimizers[adapter]
        optimizer.zero_grad(set_to_none=True)
        n_local = sum(len(s.turn.sample.completion_ids) for s in batch)
        n_tokens = int(dist.sum([n_local])[0])
        totals = np.zeros(3)  # loss, clipped tokens, kl over this rank's tokens
        result = None
        with self.probe.step(step, policy=adapter) if probe_this_step else nullcontext() as probed:
            if batch:
                token_loss, totals = self._token_loss(adapter, batch, n_tokens, probed)
                token_loss = (self._coherence_scaled(adapter, batch, token_loss[0]), token_loss[1])
                if probed is not None:
                    probed.backward_tokens(token_loss[0], token_loss[1])
                else:
                    token_loss[0].sum().backward()
        if probed is not None:
            result = probed.result
        dist.sum_grads(self.params[adapter])
        grad_norm = _clip(self.params[adapter], cfg.grad_clip)
        if math.isfinite(grad_norm):
            optimizer.step()
        else:  # a NaN/inf gradient would poison the adapter and AdamW's moments: skip, keep the record
            optimizer.zero_grad(set_to_none=True)
        if result is None:
            return None
        update = self.probe.last_update  # None when the step was skipped or nothing is attached
        loss, clipped, kl, samples = dist.sum([*totals, len(batch)])  # one collective for all four
        return OptimizerStep(adapter, result, {
            "loss": loss, "clip_frac": clipped / max(n_tokens, 1), "grad_norm": grad_norm,
            "lr": optimizer.param_groups[0]["lr"], "samples": int(samples),
            "tokens": n_tokens, "kl": kl / max(n_tokens, 1)}, update)

    def _token_loss(self, adapter: str, batch: Sequence[TrainSample], n_tokens: int, probed=None
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor], np.ndarray]:
        """((B, T) per-token loss already divided by the global ``n_tokens``, (B, T) agent ids with
        -1 off the completions), and this rank's (loss, clipped tokens, KL) sums. The forward is tagged
        with its rows' agents for the probe (batch first: the hooks cannot guess it when T == B)."""
        cfg = self.cfg
        ids, attn, comp = pack([s.turn.sample for s in batch], self.pad_id, self.model.device)
        mask = comp.bool()
        old = torch.zeros(comp.shape, device=ids.device)
        old[mask] = torch.cat([s.old_logprobs for s in batch])
        adv = torch.tensor([s.advantage for s in batch], device=ids.device)[:, None]
        agent_ids = torch.tensor([s.agent for s in batch], device=ids.device)[:, None].expand_as(comp).clone()
        agent_ids[~mask] = -1
        rows = probed.rows([s.agent for s in batch], batch_dim=0) if probed is not None else nullcontext()
        with use_adapter(self.model, adapter), rows:
            lp = token_logprobs(self.model, ids, attn, cfg.temperature)
        ratio = torch.exp(lp - old)
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        token_loss = -torch.minimum(ratio * adv, clipped * adv)
        kl_sum = 0.0
        if batch[0].ref_logprobs is not None:  # some role of this policy is anchored
            ref = torch.zeros_like(old)
            ref[mask] = torch.cat([s.ref_logprobs for s in batch])
            kl = torch.exp(ref - lp) - (ref - lp) - 1  # k3 estimator, ≥ 0
            coef = torch.tensor([self.kl[s.turn.role] for s in batch], device=ids.device)[:, None]
            token_loss = token_loss + coef * kl
            kl_sum = float((kl.detach() * mask).sum())
        # where, not a product: a diverged policy's NaN log-probabilities on prompt and padding tokens must not
        # become NaN losses of no agent (the gradient is non-finite anyway: the `nonfinite` alert says so)
        token_loss = torch.where(mask, token_loss, 0.0) / max(n_tokens, 1)
        n_clipped = float((((ratio - clipped).abs() > 0) & mask).sum())
        return (token_loss, agent_ids), np.array([float(token_loss.detach().sum()), n_clipped, kl_sum])


    def _coherence_scaled(self, adapter: str, batch: Sequence[TrainSample], token_loss: torch.Tensor) -> torch.Tensor:
        """``token_loss`` (B, T) with each regularised role's rows scaled by its ``c_r`` (module doc);
        the raw role gradients (one extra backward per regularised role) update the EMAs."""
        roles = [r for r in dict.fromkeys(s.turn.role for s in batch) if self.coherence[r] > 0]
        if not roles:
            return token_loss
        params = self.params[adapter]
        row_role = [s.turn.role for s in batch]
        scale = torch.ones(len(batch), 1, device=token_loss.device)
        for role in roles:
            rows = torch.tensor([r == role for r in row_role], device=token_loss.device)
            grads = torch.autograd.grad(token_loss[rows].sum(), params, retain_graph=True, allow_unused=True)
            g = torch.cat([(gr if gr is not None else torch.zeros_like(p)).reshape(-1)
                           for gr, p in zip(grads, params)]).detach()
            ema = self.coherence_ema.get(role)
            c = 1.0
            if ema is not None:
                pair = torch.stack([g, ema]).double()  # float64: an fp32 cosine of g with itself reads 1 + 1e-6
                cos = float(cosine((pair @ pair.T).cpu().numpy())[0, 1])
                c = 1.0 - self.coherence[role] * max(0.0, cos)
                ema.mul_(self.cfg.coherence_beta).add_(g, alpha=1 - self.cfg.coherence_beta)
            else:
                self.coherence_ema[role] = g.clone()
            scale[rows] = c
            self._scales[role].append(c)
        return token_loss * scale


def _clip(params: Sequence[torch.nn.Parameter], max_norm: float) -> float:
    """Global grad norm before clipping (NaN-safe: a non-finite norm is reported, not raised)."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in grads])))


__all__ = ["GRPOConfig", "GRPOUpdater", "OptimizerStep", "STEP_SCALARS", "advantages"]
