"""Update attribution in the trainer: one AdamW per adapter, attached to the probe (--probe-updates)."""
from __future__ import annotations

import dataclasses
import subprocess

import numpy as np
import pytest

from gradscope.runfile import open_run
from gradscope.trainers.reward import Scorer
from gradscope.trainers.train import Trainer
from tests.conftest import alternating_scores
from tests.trainers.conftest import crash_at
from tests.trainers.test_train import GRADSCOPE, small

pytestmark = pytest.mark.slow  # trainer runs of a few seconds each (tens under load)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """IP and SP, 4 steps, with rewards that give every GRPO group a signal (whatever the warm start)."""
    tmp = tmp_path_factory.mktemp("updates")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scorer, "score", alternating_scores)
        for policy in ("ip", "sp"):
            cfg = small(tmp, policy=policy, out=str(tmp / f"{policy}.h5"), probe_updates="role", steps=4,
                        checkpoint_every=2)
            Trainer(cfg).run()
            out[policy] = cfg
    return out


def test_trainer_records_update_attribution(runs):
    for policy, cfg in runs.items():
        with open_run(cfg.out) as run:
            assert run.meta.update_unit == "role"
            assert run.meta.update_components == ["voter", "aggregator", "unattributed", "weight_decay"]
            U = run.update_gram
            ok = np.isfinite(U).all(axis=(1, 2))
            assert ok.sum() >= run.n_steps - 1  # a skipped (non-finite) step would be NaN
            U = U[ok]
            total = U.sum(axis=(1, 2))
            assert (total > 0).all()
            assert (run.scalars["grad_norm"][ok] > 0).all()  # every record moved by its gradient, not only by decay
            # the split against θ before and after: fp32 rounding of θ, relative to a step of lr ≥ 1.3e-4
            assert (run.read("update_residual")[ok] < 1e-3).all()
            assert (U[:, 2, 2] <= 1e-8 * total).all()  # every step probed: nothing unattributed
            scale = run.update_grad_scale[ok]
            assert ((scale > 0) & (scale <= 1 + 1e-6)).all()  # grad_clip 1.0: c = min(1, 1 / ‖g‖)
            np.testing.assert_allclose(scale, np.minimum(1, 1 / (run.scalars["grad_norm"][ok] + 1e-6)), rtol=1e-4)
            df = run.stats()
            shares = df[[f"update_share/{c}" for c in run.meta.update_components]].to_numpy()[ok]
            np.testing.assert_allclose(shares.sum(axis=1), 1.0, rtol=1e-9)
            if policy == "ip":  # disjoint adapters: no cross-role update or interference at all
                assert (U[:, 0, 1] == 0).all()
                roles = np.array(run.meta.agent_roles)
                inter = run.update_interference[ok]
                assert (inter[:, 0][:, roles == "aggregator"] == 0).all()
                assert (inter[:, 1][:, roles == "voter"] == 0).all()
            else:
                assert (np.abs(U[:, 0, 1]) > 0).any()


def test_resume_restores_the_role_moments(runs, tmp_path, alternating_rewards):
    """Crash after step 3 (checkpoint at 2), resume: the update attribution of steps 3-4 equals the
    uninterrupted run's (the per-role moments were checkpointed with the optimizer)."""
    full = runs["sp"]
    cut = dataclasses.replace(full, out=str(tmp_path / "cut.h5"))

    with pytest.raises(RuntimeError):
        Trainer(cut).run(on_step=crash_at(3))
    Trainer(dataclasses.replace(cut, resume=True)).run()
    with open_run(full.out) as a, open_run(cut.out) as b:
        assert list(b.step) == list(a.step)
        np.testing.assert_allclose(b.update_gram, a.update_gram, rtol=1e-4, atol=1e-14)
        assert (b.update_gram[:, 2, 2] <= 1e-8 * b.update_gram.sum(axis=(1, 2))).all()


@pytest.mark.parametrize("args, message", [
    (["--probe-updates", "layer"], "unknown --probe-updates 'layer'"),
    (["--probe-updates", "role", "--probe-every", "2"], "--probe-updates needs every optimizer step probed"),
])
def test_bad_update_flags_are_one_line_and_exit_2(tmp_path, args, message):
    proc = subprocess.run(GRADSCOPE + ["train", *args, "--out", str(tmp_path / "run.h5")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
