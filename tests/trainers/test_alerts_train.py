"""Alerts inside ``gradscope train``: stop, checkpoint, non-finite gradients, bad rules."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gradscope.runfile import open_run
from gradscope.runfile.progress import run_progress
from gradscope.trainers.grpo import GRPOConfig
from gradscope.trainers.train import Trainer

from .test_train import GRADSCOPE, small


def test_stop_ends_a_real_run_cleanly(tmp_path):
    out = tmp_path / "run.h5"
    proc = subprocess.run([*GRADSCOPE, "train", "--steps", "6", "--tasks-per-step", "2", "--group-size", "4",
                           "--n-held-out", "4", "--eval-every", "0", "--checkpoint-every", "0", "--out", str(out),
                           "--alert", "train/accuracy >= 0 for 2: stop"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "stopped after step 2 by alert" in proc.stdout
    with open_run(out) as run:
        assert run.closed
        assert sorted(set(run.step)) == [1, 2]
        events = run.events
        assert events["kind"].iloc[-1] == "stop" and events["step"].iloc[-1] == 2
        assert "train/accuracy" in events["message"][events["kind"] == "alert"].iloc[0]
    assert (Path(str(out) + ".ckpt") / "latest" / "state.pt").is_file()  # resumable from the stop
    analyze = subprocess.run([*GRADSCOPE, "analyze", str(out)], capture_output=True, text=True, timeout=120)
    assert analyze.returncode == 0, analyze.stderr


def test_checkpoint_action_writes_loadable_adapters(tmp_path, alternating_rewards):
    from peft import PeftModel

    from gradscope.trainers.testbed.cache import warm_started_model

    cfg = small(tmp_path, steps=2, default_alerts=False,
                alert=["grad_norm[voter] > 0 cooldown 100: checkpoint", "accuracy >= 0 cooldown 100: checkpoint"])
    trainer = Trainer(cfg, echo=lambda line: None)
    at_step: dict[int, dict[str, torch.Tensor]] = {}
    trainer.run(on_step=lambda step, _: at_step.setdefault(step, {
        n: p.detach().clone() for n, p in trainer.model.named_parameters() if ".lora_" in n}))
    folder = Path(cfg.out + ".ckpt") / "step1" / "adapters"
    loaded = PeftModel.from_pretrained(warm_started_model(), folder / "voter", adapter_name="voter")
    compared = 0
    for name, p in loaded.named_parameters():
        if ".lora_B.voter." in name:
            assert torch.equal(p, at_step[1][name]) and not torch.equal(p, at_step[2][name])
            compared += 1
    assert compared > 0
    assert (Path(cfg.out + ".ckpt") / "step0" / "state.pt").is_file()  # fired by the base evaluation
    with open_run(cfg.out) as run:
        ev = run.events
        assert ev["kind"].tolist() == ["alert", "checkpoint"] * 2 and ev["step"].tolist() == [0, 0, 1, 1]


def test_nonfinite_fires_on_an_injected_nan_gradient(tmp_path):
    cfg = small(tmp_path, steps=4, eval_every=0, alert=["nonfinite: stop"])
    lines: list[str] = []
    trainer = Trainer(cfg, echo=lines.append)
    poisoned = {"on": False}

    def poison(module, args, output):  # NaN into the backward pass only: sampling stays finite
        if poisoned["on"] and output.requires_grad:
            output.register_hook(lambda g: g * float("nan"))

    layer = trainer.model.base_model.model.model.layers[0].mlp
    layer.register_forward_hook(poison)
    update = trainer.updater.update

    def update_with_nan(step, *args):
        poisoned["on"] = step == 2
        try:
            return update(step, *args)
        finally:
            poisoned["on"] = False

    trainer.updater.update = update_with_nan
    trainer.run()
    assert trainer.stopped_by is not None and trainer.stopped_after == 2
    assert trainer.stopped_by.rule.statistic == "nonfinite"
    with open_run(cfg.out) as run:
        assert run.closed
        finite = np.isfinite(run.gram).all(axis=(1, 2))
        assert finite[run.step == 1].all() and not finite[run.step == 2].any()
        kinds = run.events["kind"].tolist()
        assert kinds[-1] == "stop" and "alert" in kinds
    assert any("non-finite" in line for line in lines)
    # the optimizer skipped the NaN step: the adapters are still finite
    assert all(torch.isfinite(p).all() for n, p in trainer.model.named_parameters() if ".lora_" in n)


def test_nonfinite_stops_a_run_whose_forward_turned_nan(tmp_path):
    """lr 1e6: step 1 leaves the weights finite but huge, step 2's log-probabilities are NaN, also on prompt
    and padding tokens, whose loss is masked out (it was multiplied by 0: NaN, which the probe refused as
    loss of no agent, exit 2). Now the gradient is NaN, the optimizer step skipped, `nonfinite` fires."""
    cfg = small(tmp_path, steps=4, eval_every=0, grpo=GRPOConfig(group_size=4, lr=1e6), alert=["nonfinite: stop"])
    trainer = Trainer(cfg, echo=lambda line: None)
    trainer.run()
    assert trainer.stopped_by is not None and trainer.stopped_by.rule.statistic == "nonfinite"
    with open_run(cfg.out) as run:
        assert run.closed and run.events["kind"].tolist()[-1] == "stop"
        assert not np.isfinite(run.gram[run.step == trainer.stopped_after]).all()


def test_a_policy_that_cannot_be_sampled_ends_the_run_with_one_line(tmp_path):
    """lr 1e20: step 2's rollout draws from NaN probabilities (torch.multinomial raised, a traceback and exit 1
    with no trace in the run file). Now: one line, exit 1, a `diverged` event, the file closed and unfinished."""
    out = tmp_path / "run.h5"
    proc = subprocess.run([*GRADSCOPE, "train", "--steps", "4", "--tasks-per-step", "2", "--group-size", "2",
                           "--n-held-out", "4", "--n-train", "20", "--eval-every", "0", "--lr", "1e20",
                           "--out", str(out), "--alert", "nonfinite: stop"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("gradscope: error:")]
    assert len(errors) == 1 and "training diverged at step 2" in errors[0] and "Traceback" not in proc.stderr
    with open_run(out) as run:
        assert run.closed and sorted(set(run.step)) == [1]
        assert run.events["kind"].tolist()[-1] == "diverged" and run.events["step"].tolist()[-1] == 2
    assert run_progress(out).unfinished() == "diverged (its policy could no longer be sampled)"


@pytest.mark.parametrize("args, message", [
    (["--alert", "coherence[voter] >> 0.75"], "at column 19, '>'"),
    (["--alert", "coherence[votr] > 0.75"], "unknown role 'votr'"),
    (["--alert", "update_norm[voter] > 1", "--policy", "sp"], "unknown policy 'voter'"),
    (["--alerts", "BAD"], "not valid YAML"),
    (["--alerts", "MISSING"], "cannot read alert file"),
])
def test_bad_rules_exit_2_before_training(tmp_path, args, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- acc_drop > 0.1\n- [unclosed\n")
    args = [str(bad) if a == "BAD" else str(tmp_path / "missing.yaml") if a == "MISSING" else a for a in args]
    proc = subprocess.run([*GRADSCOPE, "train", *args, "--out", str(tmp_path / "run.h5")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradscope: error:") and message in lines[0], proc.stderr
    assert not (tmp_path / "run.h5").exists()
