"""The mitigations change the loss and the gradient exactly as documented (trainers/grpo.py), per role;
a role with coefficient 0 is untouched."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from gradscope.errors import ConfigError
from gradscope.peft_support import use_adapter
from gradscope.runfile import open_run
from gradscope.trainers.config import TrainConfig
from gradscope.trainers.grpo import GRPOConfig, TrainSample, advantages
from gradscope.trainers.per_role import role_spec, role_values
from gradscope.trainers.rollout import pack, token_logprobs
from gradscope.trainers.train import Trainer


def small(tmp_path, **grpo) -> TrainConfig:
    return TrainConfig(steps=1, tasks_per_step=2, n_held_out=4, n_train=40, eval_every=0, checkpoint_every=0,
                       policy="sp", out=str(tmp_path / "run.h5"), grpo=GRPOConfig(group_size=4, **grpo))


def batch_of(trainer: Trainer) -> list[TrainSample]:
    """One SP mini-batch of a real rollout (voter and aggregator samples), with old/ref log-probs; the
    adapter is first moved off its zero init, so that it differs from the base model."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.updater.params["shared"]:
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    tasks = trainer.tasks.train[:2]
    episodes = trainer.workflow.run([t for t in tasks for _ in range(4)], trainer.sampler)
    trainer.scorer.score(episodes)
    samples = [TrainSample(t, trainer.probe.agent_index(t.agent), a) for t, a in advantages(episodes)]
    if all(s.advantage == 0 for s in samples):  # every reward equal: give the loss something to push
        for i, s in enumerate(samples):
            s.advantage = 1.0 if i % 2 else -1.0
    trainer.updater._old_logprobs({"shared": samples})
    return samples


def role_rows(batch, role: str) -> torch.Tensor:
    return torch.tensor([s.turn.role == role for s in batch])


def grad_of(trainer: Trainer, loss: torch.Tensor) -> torch.Tensor:
    params = trainer.updater.params["shared"]
    grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)])


# ---------------------------------------------------------------- parsing
def test_per_role_values():
    roles = ["voter", "aggregator"]
    assert role_values(0.05, roles, "kl-coef") == {"voter": 0.05, "aggregator": 0.05}
    assert role_values("voter=0.05", roles, "kl-coef") == {"voter": 0.05, "aggregator": 0.0}
    assert role_spec("0.1") == 0.1 and role_spec(" voter = 0.05 ,aggregator=0") == "voter=0.05,aggregator=0"
    # kept exactly (it was rounded to 6 significant digits, and the rounded value trained)
    assert role_spec("voter=0.123456789,aggregator=1e-9") == "voter=0.123456789,aggregator=1e-09"
    assert role_values(role_spec("voter=0.123456789"), ["voter", "aggregator"], "kl-coef")["voter"] == 0.123456789
    with pytest.raises(ConfigError, match=r"unknown role\(s\) \['critic'\]"):
        role_values("critic=1", roles, "kl-coef")
    with pytest.raises(ConfigError, match=r"^--kl-coef voter must be a finite number >= 0, got -1.0$"):
        role_values("voter=-1", roles, "kl-coef")
    with pytest.raises(ConfigError, match=r"^--coherence-reg must be a finite number >= 0, got nan$"):
        role_values("nan", roles, "coherence-reg")
    for bad in ("voter", "voter=x", "=1", "voter=1,voter=2"):
        with pytest.raises(Exception):
            role_spec(bad)


# ---------------------------------------------------------------- KL anchor
def test_kl_anchor_adds_beta_k3_on_its_roles_tokens_only(tmp_path):
    trainer = Trainer(small(tmp_path, kl_coef="voter=0.05,aggregator=0"))
    up = trainer.updater
    batch = batch_of(trainer)
    assert all(s.ref_logprobs is not None for s in batch)  # the shared policy has an anchored role
    n_tokens = sum(len(s.turn.sample.completion_ids) for s in batch)
    (with_kl, _), _ = up._token_loss("shared", batch, n_tokens)
    up.kl = {r: 0.0 for r in up.kl}
    (plain, _), _ = up._token_loss("shared", batch, n_tokens)
    # k3 by hand: current log-probs under the adapter, reference ones with the adapter off
    ids, attn, comp = pack([s.turn.sample for s in batch], up.pad_id, trainer.model.device)
    with torch.no_grad():
        with use_adapter(trainer.model, "shared"):
            lp = token_logprobs(trainer.model, ids, attn, up.cfg.temperature)
        with trainer.model.disable_adapter():
            ref = token_logprobs(trainer.model, ids, attn, up.cfg.temperature)
    k3 = (torch.exp(ref - lp) - (ref - lp) - 1) * comp / n_tokens
    voter, agg = role_rows(batch, "voter"), role_rows(batch, "aggregator")
    torch.testing.assert_close((with_kl - plain)[voter].detach(), 0.05 * k3[voter], rtol=1e-4, atol=1e-9)
    assert torch.equal(with_kl[agg].detach(), plain[agg].detach())  # coefficient 0: the same loss...
    torch.testing.assert_close(grad_of(trainer, with_kl[agg].sum()), grad_of(trainer, plain[agg].sum()))  # ...gradient
    assert float(k3[voter].sum()) > 0


def test_no_anchor_no_reference_pass(tmp_path):
    trainer = Trainer(small(tmp_path, kl_coef="aggregator=0"))
    assert all(s.ref_logprobs is None for s in batch_of(trainer))


# ---------------------------------------------------------------- coherence regulariser
def test_coherence_regulariser_scales_the_roles_gradient(tmp_path):
    lam, beta = 0.5, 0.9
    trainer = Trainer(small(tmp_path, coherence_reg=f"voter={lam}", coherence_beta=beta))
    up = trainer.updater
    batch = batch_of(trainer)
    n_tokens = sum(len(s.turn.sample.completion_ids) for s in batch)
    (raw, _), _ = up._token_loss("shared", batch, n_tokens)
    voter, agg = role_rows(batch, "voter"), role_rows(batch, "aggregator")
    g_voter, g_agg = grad_of(trainer, raw[voter].sum()), grad_of(trainer, raw[agg].sum())
    assert float(g_voter.norm()) > 0

    first = up._coherence_scaled("shared", batch, raw)  # no history yet: c = 1, the EMA starts at g
    assert torch.equal(first, raw)
    torch.testing.assert_close(up.coherence_ema["voter"], g_voter)
    assert "aggregator" not in up.coherence_ema  # λ = 0: never measured

    rng = torch.Generator().manual_seed(0)
    other = torch.randn(g_voter.shape, generator=rng)
    for ema, expected_cos in [(g_voter.clone(), 1.0), (-g_voter, None), (other, None)]:
        up.coherence_ema["voter"] = ema.clone()
        cos = float(g_voter.double() @ ema.double()) / float(g_voter.double().norm() * ema.double().norm())
        c = 1 - lam * max(0.0, cos)
        if expected_cos is not None:
            assert cos == pytest.approx(expected_cos) and c == pytest.approx(0.5)
        scaled = up._coherence_scaled("shared", batch, raw)
        torch.testing.assert_close(scaled[voter], c * raw[voter])
        assert torch.equal(scaled[agg], raw[agg])  # coefficient 0: untouched
        torch.testing.assert_close(grad_of(trainer, scaled.sum()), c * g_voter + g_agg, rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(up.coherence_ema["voter"], beta * ema + (1 - beta) * g_voter)
    assert up._scales["voter"][-2] == 1.0  # an opposed history (cos < 0) is not penalised


# ---------------------------------------------------------------- role balance
@pytest.mark.parametrize("mode, steps, lr_ratio", [("none", (3, 1), 1.0), ("steps", (1, 1), 1.0),
                                                    ("update", (3, 1), 1 / 3)])
def test_role_balance(tmp_path, mode, steps, lr_ratio):
    """Voting IP: 3 voters' samples vs the aggregator's; mini-batch = one agent slot's samples."""
    cfg = dataclasses.replace(small(tmp_path, role_balance=mode), policy="ip")
    Trainer(cfg).run()
    with open_run(cfg.out) as run:
        m = run.metrics_wide().iloc[0]
        assert (m["opt_steps/voter"], m["opt_steps/aggregator"]) == steps
        lr = run.scalars["lr"].to_numpy()
        policies = np.asarray(run.policy)
        assert lr[policies == "voter"] == pytest.approx(lr_ratio * lr[policies == "aggregator"][0])


def test_lr_warms_up_linearly_over_warmup_steps(tmp_path):
    """Training steps count from 1: step s runs at lr · min(1, s / warmup_steps) (was (s + 1) / warmup_steps:
    --warmup-steps 2 gave no warm-up at all)."""
    cfg = dataclasses.replace(small(tmp_path, warmup_steps=3, lr=1e-3), steps=4)
    Trainer(cfg).run()
    with open_run(cfg.out) as run:
        lr = run.scalars.assign(step=run.step).groupby("step")["lr"].agg(["min", "max"])
    assert lr["min"].tolist() == lr["max"].tolist() == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3, 1e-3])


def test_mitigated_run_resumes_exactly(tmp_path, alternating_rewards):
    """The coherence EMAs are part of the checkpoint: 2 steps + resume to 4 = 4 steps in one go."""
    grpo = dict(kl_coef="voter=0.05", coherence_reg="voter=0.5,aggregator=0.2", role_balance="update")
    full = dataclasses.replace(small(tmp_path, **grpo), steps=4, out=str(tmp_path / "full.h5"))
    whole = Trainer(full)
    whole.run()
    cut = dataclasses.replace(full, steps=2, out=str(tmp_path / "cut.h5"))
    Trainer(cut).run()
    resumed = Trainer(dataclasses.replace(cut, steps=4, resume=True))
    resumed.run()
    emas = whole.updater.coherence_ema
    assert set(emas) == {"voter", "aggregator"} and all(float(e.norm()) > 0 for e in emas.values())
    for role, ema in emas.items():  # a fresh EMA at step 3 would differ: it restarts at step 3's gradient
        torch.testing.assert_close(resumed.updater.coherence_ema[role], ema, rtol=1e-5, atol=1e-12)
    with open_run(full.out) as a, open_run(cut.out) as b:
        np.testing.assert_allclose(b.gram, a.gram, rtol=1e-5, atol=1e-12)
        scales = [run.metrics_wide()[[f"coherence_scale/{r}" for r in emas]] for run in (a, b)]
        np.testing.assert_allclose(scales[1].to_numpy(), scales[0].to_numpy(), rtol=1e-5)


def test_per_role_values_in_config_files_and_stored_configs(tmp_path):
    from gradscope.trainers.config import load_config_file, stored_settings

    good, bad = tmp_path / "run.yaml", tmp_path / "bad.yaml"
    good.write_text("kl_coef: voter=0.05\ngrpo:\n  coherence_reg: 0.5\n")
    assert load_config_file(str(good))[0] == {"kl_coef": "voter=0.05", "coherence_reg": 0.5}
    assert stored_settings({"grpo": {"kl_coef": "voter=0.05,aggregator=0"}})["kl_coef"] == "voter=0.05,aggregator=0"
    bad.write_text("kl_coef: voter=\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:1: kl_coef: bad per-role value 'voter='"):
        load_config_file(str(bad))
