"""GradscopeGRPOTrainer against brute force: TRL's own loss, one agent's tokens at a time."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gradscope.errors import ProbeError, RunFileError
from gradscope.integrations.trl import GradscopeGRPOTrainer
from gradscope.runfile import open_run
from tests.integrations.trl_case import ROLES, Recording, brute_force_gram, make_trainer

ROOT = Path(__file__).resolve().parents[2]


def _check_against_brute_force(trainer: Recording, method: str | None = None) -> None:
    trainer.train()
    result = trainer.gradscope_last
    M, total = brute_force_gram(trainer)
    scale = np.abs(M).max()
    assert scale > 0
    np.testing.assert_allclose(result.gram, M, rtol=0, atol=1e-5 * scale)
    log = trainer.state.log_history[0]
    # √ΣM is the norm of the step's gradient: TRL's logged grad_norm (float32) and the brute-force sum.
    assert np.sqrt(result.gram.sum()) == pytest.approx(log["grad_norm"], rel=1e-5)
    assert np.sqrt(result.gram.sum()) == pytest.approx(total, rel=1e-5)
    assert log["gradscope/grad_norm"] == pytest.approx(log["grad_norm"], rel=1e-5)
    assert {f"gradscope/norm/{r}" for r in set(ROLES.values())} <= set(log)
    assert (result.tokens > 0).sum() >= 2  # the step really had several agents
    if method:
        assert trainer.probe.measurement == method


LOSSES = [dict(loss_type=t) for t in ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "vespo")]
LOSSES += [dict(loss_type="luspo", importance_sampling_level="sequence"),
           dict(loss_type="grpo", beta=0.05, entropy_coef=0.01),          # KL to the reference + entropy bonus
           dict(loss_type="dapo", top_entropy_quantile=0.5)]


@pytest.mark.parametrize("options", LOSSES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_gram_equals_brute_force_for_every_loss_type(tmp_path, options):
    _check_against_brute_force(make_trainer(str(tmp_path), trainer_cls=Recording, **options), method="hooks")


def test_gradient_accumulation_is_one_probed_step(tmp_path):
    trainer = make_trainer(str(tmp_path), trainer_cls=Recording, per_device=8, accumulation=2)
    _check_against_brute_force(trainer)
    assert len(trainer.batches) == 2


def test_full_fine_tuning_goes_through_split(tmp_path):
    # Without LoRA the RMSNorm weights are trained too: not Linear layers, so the probe picks split.
    _check_against_brute_force(make_trainer(str(tmp_path), trainer_cls=Recording, lora=False), method="split")


def _two_agent_rollout(prompts, trainer):
    """Each completion written by two agents: its first half by its row's voter, the rest by the aggregator."""
    from tests.integrations.trl_case import deterministic_rollout

    out = deterministic_rollout(prompts, trainer)
    out["writers"] = [[f"voter{i % 3}"] * (len(c) // 2) + ["aggregator"] * (len(c) - len(c) // 2)
                      for i, c in enumerate(out["completion_ids"])]
    return out


def test_multi_agent_completions_from_the_rollout_hook(tmp_path):
    trainer = make_trainer(str(tmp_path), trainer_cls=Recording, rollout_func=_two_agent_rollout, agent="writers")
    _check_against_brute_force(trainer)
    assert all(trainer.gradscope_last.tokens > 0)


def test_probe_fallbacks_are_events_of_the_run_file(tmp_path):
    # A completion written by two agents cannot be attributed by hooks (a row's gradient mixes them): the
    # probe measures that step by split and says why; the run file keeps the reason as a probe event.
    run = tmp_path / "run.h5"
    trainer = make_trainer(str(tmp_path / "out"), rollout_func=_two_agent_rollout, agent="writers", run_file=run,
                           max_steps=1)
    with pytest.warns(RuntimeWarning, match="fell back to split"):
        trainer.train()
    assert trainer.gradscope_last.method.startswith("split-fallback:")
    with open_run(run) as r:
        events = r.events
        probe_events = events[events["kind"] == "probe"]
        assert list(probe_events["step"]) == [1] and list(probe_events["severity"]) == ["warning"]
        assert "a row holds tokens of several agents" in probe_events["message"].iloc[0]
        assert list(r.method) == [trainer.gradscope_last.method]


def test_agent_from_a_function(tmp_path):
    trainer = make_trainer(str(tmp_path), trainer_cls=Recording, agent=lambda ex: ex["agent"])
    _check_against_brute_force(trainer)


def test_run_file_and_trl_logs(tmp_path):
    run = tmp_path / "run.h5"
    trainer = make_trainer(str(tmp_path / "out"), run_file=run, max_steps=2, report_to=["tensorboard"])
    trainer.train()
    with open_run(run) as r:
        assert r.closed and r.n_steps == 2 and list(r.step) == [1, 2]
        assert r.meta.agents == list(ROLES) and r.meta.probe_method == "hooks"
        np.testing.assert_allclose(r.gram[-1], trainer.gradscope_last.gram)
        metrics = r.metrics_wide()
        np.testing.assert_allclose(np.sqrt(r.gram.sum(axis=(1, 2))), metrics["grad_norm"].to_numpy(), rtol=1e-5)
        # the statistics TRL's logs carry are the records' (export derives them), not stored again as metrics
        assert "loss" in metrics and not [n for n in metrics if str(n).startswith("gradscope/")], list(metrics)
    # report_to: TRL's own TensorBoard callback wrote the gradscope statistics beside its metrics.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (logdir,) = {p.parent for p in (tmp_path / "out").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(logdir)).Reload()
    tags = acc.Tags()["scalars"]
    assert "train/gradscope/norm/voter" in tags and "train/grad_norm" in tags
    ours = [e.value for e in acc.Scalars("train/gradscope/grad_norm")]
    theirs = [e.value for e in acc.Scalars("train/grad_norm")]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)


def test_logging_windows_evaluations_and_an_existing_run_file(tmp_path):
    """logging_steps=2: gradscope/grad_norm is the window's last step's √ΣM, as TRL's grad_norm is (it was the
    window's mean: 3-18 % off); the other statistics are window means. TRL's evaluations reach the run
    file's /evals (without their eval_ prefix). A second train() into the same run file is refused with a
    hint the trainer can follow."""
    from tests.integrations.trl_case import dataset

    run = tmp_path / "run.h5"
    norms = []

    class Norms(GradscopeGRPOTrainer):
        def _finish_step(self):
            super()._finish_step()
            norms.append(float(np.sqrt(self.gradscope_last.gram.sum())))
    trainer = make_trainer(str(tmp_path / "out"), run_file=run, max_steps=4, logging_steps=2, trainer_cls=Norms,
                           eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=16, eval_dataset=dataset())
    trainer.train()
    train_logs = [log for log in trainer.state.log_history if "loss" in log]
    assert [log["step"] for log in train_logs] == [2, 4] and len(norms) == 4
    for log, last in zip(train_logs, (norms[1], norms[3])):
        assert log["gradscope/grad_norm"] == pytest.approx(log["grad_norm"], rel=1e-5)
        assert log["gradscope/grad_norm"] == pytest.approx(last, rel=1e-6)
    assert norms[0] != pytest.approx(norms[1], rel=1e-3)  # else the mean would pass as well
    with open_run(run) as r:
        evals = r.evals_wide()
    eval_logs = [log for log in trainer.state.log_history if "eval_loss" in log]
    assert list(evals.index) == [log["step"] for log in eval_logs] == [4]
    np.testing.assert_allclose(evals["reward"].to_numpy(), [log["eval_reward"] for log in eval_logs])
    with pytest.raises(RunFileError, match=r"run\.h5: already exists; .*never replaces a run file: pass another run_file"):
        trainer.train()


def test_update_attribution_in_the_run_file(tmp_path):
    """update_unit="role": TRL's AdamW is attached; the record of its one step splits the actual
    parameter change (θ read before and after train())."""
    run = tmp_path / "run.h5"
    trainer = make_trainer(str(tmp_path / "out"), run_file=run, max_steps=1, update_unit="role", weight_decay=0.1)
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    before = torch.cat([p.detach().reshape(-1).double() for p in params])
    trainer.train()
    step = torch.cat([p.detach().reshape(-1).double() for p in params]) - before
    with open_run(run) as r:
        assert r.meta.update_unit == "role" and r.n_steps == 1
        assert r.meta.update_components == ["voter", "aggregator", "unattributed", "weight_decay"]
        U, inter = r.update_gram[0], r.update_interference[0]
        grad_norm = r.metrics_wide()["grad_norm"].to_numpy()[0]
        scale = r.update_grad_scale[0]
    np.testing.assert_allclose(U, trainer.probe.last_update.gram)
    assert U.sum() == pytest.approx(float(step @ step), rel=1e-4)  # Σ_ab U_ab = ‖Δθ‖²
    assert abs(U[2, 2]) <= 1e-8 * U.sum() and U[3, 3] > 0       # every step probed; decay acted
    assert U[0, 0] > 0 and U[1, 1] > 0                            # both roles moved the parameters
    assert scale == pytest.approx(min(1.0, 1.0 / (grad_norm + 1e-6)), rel=1e-4)  # TRL's clipping at 1.0
    assert np.isfinite(inter).all()


def test_update_attribution_needs_adam(tmp_path):
    trainer = make_trainer(str(tmp_path), update_unit="role", optim="sgd")
    with pytest.raises(ProbeError, match="update attribution is unavailable for SGD"):
        trainer.train()
    with pytest.raises(ProbeError, match="update_unit must be one of"):
        make_trainer(str(tmp_path), update_unit="layer")


def test_unknown_agent_is_a_clear_error(tmp_path):
    trainer = make_trainer(str(tmp_path), agent=lambda ex: "juror")
    with pytest.raises(ProbeError, match="agent 'juror' is not one of the declared agents"):
        trainer.train()


def test_missing_agent_column_is_a_clear_error(tmp_path):
    trainer = make_trainer(str(tmp_path), agent="speaker")
    with pytest.raises(ProbeError, match="no column or rollout field 'speaker'"):
        trainer.train()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_accelerate_two_processes_equal_one(tmp_path):
    """accelerate launch --num_processes 2 on CPU (gloo): the Gram of the global batch."""
    base = [sys.executable, "-m", "tests.integrations.trl_case"]
    one, two = tmp_path / "one.npz", tmp_path / "two.npz"
    subprocess.run([*base, str(one), "--per-device", "16"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port()), "-m", "tests.integrations.trl_case"]
    done = subprocess.run([*launch, str(two), "--per-device", "8"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    a, b = np.load(one), np.load(two)
    assert int(a["world"]) == 1 and int(b["world"]) == 2 and str(b["measurement"]) == "hooks+ranks(2)"
    np.testing.assert_array_equal(a["tokens"], b["tokens"])
    np.testing.assert_allclose(b["gram"], a["gram"], rtol=0, atol=1e-5 * np.abs(a["gram"]).max())
    assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=1e-5)
    assert np.sqrt(b["gram"].sum()) == pytest.approx(float(b["grad_norm"]), rel=1e-5)


@pytest.mark.slow
def test_an_existing_run_file_stops_every_process(tmp_path):
    """Under accelerate launch the main process checks the run file and every process refuses (the
    others used to go on training and wait for it)."""
    run = tmp_path / "run.h5"
    run.write_bytes(b"")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
              "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
              "--main_process_port", str(_free_port()), "-m", "tests.integrations.trl_case"]
    done = subprocess.run([*launch, str(tmp_path / "out.npz"), "--per-device", "8", "--run-file", str(run)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    for rank in (0, 1):
        assert f"rank {rank}: {run}: already exists;" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]
    assert run.read_bytes() == b""


def test_agent_ids_of_masked_out_unnamed_and_bad_values():
    """A completion TRL masked out whole (mask_truncated_completions) takes any value; None: no agent's (its
    trained tokens an error); a value neither a name nor a per-token list: a ProbeError naming it."""
    from gradscope.integrations.trl import agent_ids

    index = {"voter0": 0, "aggregator": 1}
    completion = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 0, 0]])
    ids = agent_ids([["voter0", "voter0", "aggregator"], ["voter0"] * 4, "aggregator"], completion, completion, index)
    assert ids.tolist() == [[0, 0, 1, -1], [-1] * 4, [1, 1, -1, -1]]
    untrained = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    ids = agent_ids(["voter0", "voter0", None], untrained, untrained, index)
    assert ids.tolist() == [[0, 0, 0, -1], [-1] * 4, [-1] * 4]
    with pytest.raises(ProbeError, match=r"completion\(s\) \[2\] have trained tokens without an agent"):
        agent_ids(["voter0", "voter0", None], completion, completion, index)
    with pytest.raises(ProbeError, match="completion 0: agent 3 is neither an agent name nor a list"):
        agent_ids([3, "voter0", "voter0"], completion, completion, index)


def test_groups_reach_the_run_file(tmp_path):
    """probe_options={"groups": ...}: the run file declares the groups and keeps each record's group Grams."""
    run = tmp_path / "run.h5"
    trainer = make_trainer(str(tmp_path / "out"), run_file=run, max_steps=1, probe_options={"groups": "layer"})
    trainer.train()
    with open_run(run) as r:
        assert r.meta.groups == trainer.probe.groups and len(r.meta.groups) >= 2
        assert r.meta.group_sizes == trainer.probe.group_sizes
        np.testing.assert_allclose(r.group_gram[-1], trainer.gradscope_last.group_gram)
        np.testing.assert_allclose(r.group_gram[-1].sum(0), r.gram[-1], rtol=1e-6)


@pytest.mark.parametrize("evaluate", [False, True])
def test_the_last_partial_logging_window_reaches_the_run_file(tmp_path, evaluate):
    """max_steps=3, logging_steps=2: TRL puts step 3's metrics into its end-of-train summary (beside
    train_runtime, ...); the run file gets them at step 3, not the summary's own entries — also when
    transformers evaluates at the last step (the summary is then logged in eval mode, where TRL merged
    none of them: they, step 3's statistics and gradscope/grad_norm were lost)."""
    from tests.integrations.trl_case import dataset
    run = tmp_path / "run.h5"
    evaluation = dict(eval_strategy="steps", eval_steps=3, per_device_eval_batch_size=16,
                      eval_dataset=dataset()) if evaluate else {}
    trainer = make_trainer(str(tmp_path / "out"), run_file=run, max_steps=3, logging_steps=2, **evaluation)
    trainer.train()
    assert not trainer._metrics["train"] and trainer.model.training is not evaluate  # (the mode left as it was)
    summary = trainer.state.log_history[-1]
    assert "train_runtime" in summary and "reward" in summary and "loss" not in summary
    assert summary["gradscope/grad_norm"] == pytest.approx(np.sqrt(trainer.gradscope_last.gram.sum()), rel=1e-6)
    with open_run(run) as r:
        metrics = r.metrics_wide()
    assert list(metrics.index) == [2, 3]
    assert metrics.loc[3, "reward"] == pytest.approx(summary["reward"])
    assert "train_runtime" not in metrics and "train_loss" not in metrics
    assert not [n for n in metrics if str(n).startswith("gradscope/")]


def test_the_run_file_is_live_and_an_evaluation_needs_no_agent_column(tmp_path):
    """The writer flushed every 10 records, so `gradscope watch` on a TRL run saw nothing for 9 steps; and an
    eval_dataset without the agent column stopped training at the first evaluation (it trains nothing)."""
    from transformers import TrainerCallback

    from tests.integrations.trl_case import dataset
    run, seen = tmp_path / "run.h5", {}
    reader = "import sys; from gradscope.runfile import open_run; r = open_run(sys.argv[1]); print(r.n_steps)"

    class Live(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            out = subprocess.run([sys.executable, "-c", reader, str(run)], capture_output=True, text=True, timeout=120)
            seen[state.global_step] = out.stdout.strip() or out.stderr.strip()[-300:]

    trainer = make_trainer(str(tmp_path / "out"), run_file=run, max_steps=2, eval_strategy="steps", eval_steps=1,
                           per_device_eval_batch_size=16, eval_dataset=dataset().remove_columns("agent"),
                           callbacks=[Live()])
    trainer.train()
    assert seen == {1: "1", 2: "2"}
    assert [log["step"] for log in trainer.state.log_history if "eval_loss" in log] == [1, 2]


def test_bad_roles_and_probe_options_are_one_line_errors(tmp_path):
    for roles in (["voter0", "aggregator"], {0: "voter", 1: "aggregator"}):
        with pytest.raises(ProbeError, match="roles must map each agent's name to its role's name"):
            GradscopeGRPOTrainer(model=None, roles=roles)
    with pytest.raises(ProbeError, match="probe_options: Probe has no option 'bogus'"):
        GradscopeGRPOTrainer(model=None, roles=ROLES, probe_options={"bogus": 1})
