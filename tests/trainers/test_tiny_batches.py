"""The smallest batch shapes and degenerate advantages train on every workflow and task.

GRPO with groups of two often gives an agent two identical rollouts with advantages ±a, whose
gradients cancel: the step's gradient is rounding noise, and the probe's add-up check once mistook
that for a probed weight used outside its layer (`train --tasks-per-step 2 --group-size 2` stopped at
step 2). Asserted: behaviour (the run finishes, every record is there, the probe's total agrees with
the trainer's gradient norm), never a particular accuracy, so any warm start passes.
"""
from __future__ import annotations

import numpy as np
import pytest

from gradscope.runfile import open_run
from gradscope.trainers import grpo
from gradscope.trainers.config import TrainConfig
from gradscope.trainers.grpo import GRPOConfig
from gradscope.trainers.train import Trainer

from .test_train import assert_total_matches_grad_norm

WORKFLOWS = ["voting", "eval-opt", "orch-workers"]
TASKS = ["math", "code"]


def tiny(tmp_path, workflow: str, task: str, tasks_per_step: int, group_size: int, **grpo_kw) -> TrainConfig:
    return TrainConfig(workflow=workflow, task=task, steps=4, tasks_per_step=tasks_per_step, n_held_out=2,
                       n_train=20, eval_every=0, checkpoint_every=0, default_alerts=False,
                       out=str(tmp_path / f"{workflow}-{task}-{tasks_per_step}x{group_size}.h5"),
                       grpo=GRPOConfig(group_size=group_size, **grpo_kw))


SHAPES = [(task, shape) for task in TASKS for shape in [(2, 2)]] + [("math", (1, 2)), ("math", (3, 1))]


@pytest.mark.slow
@pytest.mark.parametrize("workflow", WORKFLOWS)
@pytest.mark.parametrize("task,shape", SHAPES, ids=[f"{t}-{a}x{b}" for t, (a, b) in SHAPES])
def test_tiny_batches_train_four_steps(tmp_path, workflow, task, shape):
    """(tasks per step, group size): 2×2 on every workflow and task, 1×2 and 3×1 on every workflow."""
    cfg = tiny(tmp_path, workflow, task, *shape)
    Trainer(cfg).run()
    with open_run(cfg.out) as run:
        assert run.closed and set(run.step) == {1, 2, 3, 4}
        assert np.isfinite(run.gram).all()
        assert_total_matches_grad_norm(run)


def _doubled(signs: tuple[float, ...]):
    """Advantages that give every turn once per sign, with advantage ±1."""
    def advantages(episodes):
        return [(turn, sign) for turn, _ in grpo_advantages(episodes) for sign in signs]
    return advantages


grpo_advantages = grpo.advantages


@pytest.mark.slow
@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("workflow", WORKFLOWS)
def test_zero_and_cancelling_advantages_train(tmp_path, monkeypatch, workflow, task):
    """All-zero advantages: every record's Gram and norm are exactly 0. Every turn twice with
    advantages +1 and -1 in one mini-batch (no shuffling): each agent's gradient cancels to rounding
    noise; the run goes on and both the probe and the trainer see noise, far below the gradient of
    the same turns twice with +1."""
    runs = {}
    for kind, advantages in [("zero", _doubled((0.0,))), ("cancelling", _doubled((1.0, -1.0))),
                             ("reference", _doubled((1.0, 1.0)))]:
        monkeypatch.setattr(grpo, "advantages", advantages)
        cfg = tiny(tmp_path, workflow, task, 2, 2, shuffle=False, mini_batch_size=10_000)
        cfg.out = str(tmp_path / f"{kind}.h5")
        Trainer(cfg).run()
        runs[kind] = open_run(cfg.out)
    zero, cancelling, reference = runs["zero"], runs["cancelling"], runs["reference"]
    for run in runs.values():
        assert run.closed and set(run.step) == {1, 2, 3, 4}
    assert (zero.gram == 0).all() and (zero.scalars["grad_norm"] == 0).all()
    assert_total_matches_grad_norm(reference)
    signal = reference.scalars["grad_norm"].min()
    assert signal > 0
    assert cancelling.scalars["grad_norm"].max() < 1e-4 * signal
    assert np.sqrt(np.abs(cancelling.gram).max()) < 1e-4 * signal


def test_recorded_method_is_the_one_that_ran(tmp_path, monkeypatch, alternating_rewards):
    """The trainer's records say hooks (the first one self-checked); a forced fallback is recorded as
    split with its reason, a warning event says why, and probe_method names only split."""
    from gradscope.probe import hooks, rows

    cfg = tiny(tmp_path, "voting", "math", 2, 2)
    Trainer(cfg).run()
    with open_run(cfg.out) as run:
        assert run.method[0] == "hooks+check" and set(run.method[1:]) == {"hooks"}
        assert run.meta.probe_method == "hooks" and "probe" not in set(run.events["kind"])

    def unmatched(self, live, row_agents, *_):
        raise rows.Fallback("unmatched-rows", "forced by the test")
    monkeypatch.setattr(hooks.HooksMethod, "_match", unmatched)
    cfg = tiny(tmp_path, "voting", "math", 2, 2)
    cfg.out = str(tmp_path / "forced.h5")
    with pytest.warns(RuntimeWarning, match="forced by the test"):
        Trainer(cfg).run()
    with open_run(cfg.out) as run:
        assert set(run.method) == {"split-fallback:unmatched-rows"}
        assert run.meta.probe_method == "split"
        probe_events = run.events[run.events["kind"] == "probe"]
        assert len(probe_events) and probe_events["message"].str.contains("forced by the test").all()
        assert_total_matches_grad_norm(run)
