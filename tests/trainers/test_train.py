"""The training stack end to end on the testbed: every workflow and task, IP and SP (resume: test_resume*.py)."""
from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gradscope.errors import ConfigError
from gradscope.runfile import open_run
from gradscope.trainers.config import TrainConfig
from gradscope.trainers.grpo import GRPOConfig, advantages
from gradscope.trainers.policy import parse_policy
from gradscope.trainers.tasks.base import Task
from gradscope.trainers.train import Trainer
from gradscope.trainers.workflows.base import Episode, Sample

GRADSCOPE = [sys.executable, "-m", "gradscope.cli"]


def small(tmp_path: Path, **kw) -> TrainConfig:
    """A run of a few seconds: 2 tasks × 4 rollouts per step."""
    defaults = dict(steps=3, tasks_per_step=2, n_held_out=4, n_train=40, eval_every=2, checkpoint_every=0,
                    out=str(tmp_path / "run.h5"), grpo=GRPOConfig(group_size=4))
    defaults.update(kw)
    return TrainConfig(**defaults)


def assert_total_matches_grad_norm(run, rtol: float = 1e-4) -> None:
    """√ΣM equals the trainer's pre-clipping gradient norm, record by record. A record whose gradient
    cancelled (identical rollouts with advantages ±a) holds only rounding noise on both sides, of
    order 1e-7 of a normal record: compared with an absolute tolerance of 1e-6 of the largest norm."""
    total = np.sqrt(np.clip(run.gram.sum(axis=(1, 2)), 0, None))
    norm = run.scalars["grad_norm"].to_numpy()
    np.testing.assert_allclose(total, norm, rtol=rtol, atol=1e-6 * max(norm.max(), 1e-30))


# ---------------------------------------------------------------- units
def test_policy_map_parsing():
    roles = ["voter", "aggregator"]
    assert parse_policy("ip", roles).role_to_adapter == {"voter": "voter", "aggregator": "aggregator"}
    assert parse_policy("sp", roles).adapters == ["shared"]
    assert parse_policy("voter=a, aggregator=a", roles).adapters == ["a"]
    with pytest.raises(ConfigError, match="unknown role 'critic'"):
        parse_policy("voter=a,critic=b", roles)
    with pytest.raises(ConfigError, match=r"no adapter for roles \['aggregator'\]"):
        parse_policy("voter=a", roles)
    with pytest.raises(ConfigError, match="bad --policy entry"):
        parse_policy("voter", roles)


def test_grpo_advantages_by_task_agent_turn():
    """Groups are (task, agent, turn); a group of one keeps A = r (verl's convention)."""
    t1, t2 = Task("t1", "math", "1+1=", "2", {}), Task("t2", "math", "2+2=", "4", {})
    s = Sample([1], [2], "x")
    eps = []
    for task, reward, turns in [(t1, 1.0, 1), (t1, 0.0, 2), (t1, 0.0, 1), (t2, 1.0, 1)]:
        ep = Episode(task, reward=reward)
        for _ in range(turns):
            ep.add("gen", "generator", "p", s, True)
        eps.append(ep)
    adv = {id(t): a for t, a in advantages(eps)}
    r = np.array([1.0, 0.0, 0.0])
    expected = (r - r.mean()) / (r.std(ddof=1) + 1e-6)
    assert [adv[id(eps[i].turns[0])] for i in range(3)] == pytest.approx(expected)
    assert adv[id(eps[1].turns[1])] == 0.0  # turn 1 exists in one episode only: A = r = 0
    assert adv[id(eps[3].turns[0])] == 1.0  # task t2 alone: A = r = 1


# ---------------------------------------------------------------- end to end
@pytest.mark.parametrize("workflow", ["voting", "eval-opt", "orch-workers"])
@pytest.mark.parametrize("task", ["math", "code"])
def test_every_workflow_and_task_runs(tmp_path, workflow, task):
    cfg = small(tmp_path, workflow=workflow, task=task, policy="ip", steps=2)
    Trainer(cfg).run()
    with open_run(cfg.out) as run:
        K = len(run.meta.agents)
        assert run.gram.shape[1:] == (K, K) and run.n_steps >= 2
        assert set(run.step) == {1, 2}
        assert run.closed
        evals = run.evals_wide()
        assert list(evals.index) == [0, 2]
        for role in run.meta.roles:
            assert 0.0 <= evals[f"format_valid/{role}"].iloc[0] <= 1.0
            assert f"length/{role}" in evals
        assert json.loads(json.dumps(run.meta.config))["workflow"] == workflow


def test_an_unprobed_run_says_so(tmp_path):
    """--probe none: no record, and the file's probe_method says none (it said hooks: the method never used)."""
    cfg = small(tmp_path, probe="none", steps=2)
    Trainer(cfg).run()
    with open_run(cfg.out) as run:
        assert run.n_steps == 0 and run.meta.probe_method == "none" and run.closed
        assert list(run.evals_wide().index) == [0, 2]


def test_ip_and_sp_gram_structure_and_probe_matches_trainer(tmp_path, alternating_rewards):
    """IP: voter–aggregator entries are exactly 0; SP: they are not. The probe's total norm equals
    the trainer's own pre-clipping grad norm, record by record; a 3-voter role takes 3× the steps."""
    runs = {}
    for policy in ("ip", "sp"):
        cfg = small(tmp_path, policy=policy, out=str(tmp_path / f"{policy}.h5"), probe="gram,groups")
        Trainer(cfg).run()
        runs[policy] = open_run(cfg.out)
    ip, sp = runs["ip"], runs["sp"]
    voters = [i for i, r in enumerate(ip.meta.agent_roles) if r == "voter"]
    agg = ip.meta.agent_roles.index("aggregator")
    assert np.all(ip.gram[:, voters, agg] == 0)
    both = (sp.gram[:, agg, agg] > 0) & (sp.gram[:, voters, voters].max(axis=1) > 0)
    assert both.sum() >= 3  # records where both roles pushed (a mini-batch may hold no aggregator sample)
    assert np.all(np.abs(sp.gram[both][:, voters, agg]).max(axis=1) > 0)
    assert ip.meta.groups == ["voter", "aggregator"] and sp.meta.groups == ["shared"]
    np.testing.assert_allclose(ip.group_gram.sum(axis=1), ip.gram, rtol=1e-12)
    for run in (ip, sp):
        assert_total_matches_grad_norm(run)
    metrics = ip.metrics_wide()
    assert (metrics["opt_steps/voter"] == 3 * metrics["opt_steps/aggregator"]).all()
    assert (sp.metrics_wide()["opt_steps/shared"] == 4).all()
    assert set(ip.policy) == {"voter", "aggregator"}


def test_checkpoint_adapters_load_with_peft(tmp_path):
    from peft import PeftModel

    from gradscope.trainers.testbed.cache import warm_started_model

    cfg = small(tmp_path, steps=1)
    trainer = Trainer(cfg)
    trainer.run()
    folder = Path(cfg.out + ".ckpt") / "latest" / "adapters"
    model = PeftModel.from_pretrained(warm_started_model(), folder / "voter", adapter_name="voter")
    trained = dict(trainer.model.named_parameters())
    for name, p in model.named_parameters():
        if ".lora_B.voter." in name:
            assert torch.equal(p, trained[name].detach())


# ---------------------------------------------------------------- command line
@pytest.mark.parametrize("args, message", [
    (["--workflow", "debate"], "unknown workflow 'debate'"),
    (["--policy", "voter=a,critic=b"], "unknown role 'critic'"),
    (["--model", "/nonexistent/model"], "not a local Hugging Face model folder"),
    (["--task-file", "BAD"], ":2:"),
    (["--out", "/nonexistent-dir/run.h5"], "does not exist"),
    (["--probe", "everything"], "unknown --probe"),
    (["--steps", "0"], "--steps must be a whole number >= 1, got 0"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "#### 2"}\n{not json\n')
    args = [str(bad) if a == "BAD" else a for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "run.h5")]
    proc = subprocess.run(GRADSCOPE + ["train", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradscope: error:") and message in lines[0], proc.stderr
    assert not (tmp_path / "run.h5").exists()


def test_existing_run_file_is_not_overwritten(tmp_path):
    out = tmp_path / "run.h5"
    out.write_bytes(b"precious")
    proc = subprocess.run(GRADSCOPE + ["train", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "already exists" in proc.stderr
    assert out.read_bytes() == b"precious"


@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_ctrl_c_leaves_a_readable_run_file(tmp_path, inherited):
    """SIGINT after 10 training steps (read from the progress bar, not the run file) ends the run with exit 130
    and a closed, readable run file — also when the trainer was started with SIGINT ignored (inherited from a
    parent that ignores it, as `nohup` or a background job does)."""
    import re
    import threading

    out = tmp_path / "run.h5"
    ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if inherited == "ignored" else None
    proc = subprocess.Popen(GRADSCOPE + ["train", "--steps", "500", "--tasks-per-step", "2", "--group-size", "4",
                                         "--n-held-out", "4", "--eval-every", "0", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=ignore)
    chunks: list[str] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stderr.read(64), "")), daemon=True)
    reader.start()
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
        if any(int(n) >= 10 for n in re.findall(r"\(training\):.*?(\d+)/500", "".join(chunks))):
            break
    assert proc.poll() is None, "the run ended before it could be interrupted:\n" + "".join(chunks)[-2000:]
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    err = "".join(chunks)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    with open_run(out) as run:
        assert run.closed and run.n_steps >= 10
        assert np.isfinite(run.gram).all()


def test_local_model_path_and_chat_templates(tmp_path):
    """--model PATH loads a local folder (no download) and uses the chat template when it has one."""
    from gradscope.trainers.testbed.model import build_testbed_model
    from gradscope.trainers.testbed.tokenizer import build_tokenizer

    folder = tmp_path / "model"
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    build_testbed_model(seed=3).save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = small(tmp_path, model=str(folder), steps=1, max_new_tokens=8, lora_rank=4, lora_alpha=8)
    trainer = Trainer(cfg)
    assert trainer.workflow.templates.style == "chat"
    prompt = trainer.workflow.templates.render("picker", q="2+2=", candidates=["4", "5"])
    assert prompt.startswith("<system>") and "Candidate 2:\n5" in prompt and prompt.endswith("<assistant>")
    trainer.run()
    with open_run(cfg.out) as run:
        assert run.meta.config["model"] == str(folder) and run.meta.config["lora_rank"] == 4
        assert run.n_steps >= 1


def test_testbed_uses_one_thread_unless_told(tmp_path):
    """One intra-op thread by default for the testbed (--threads N to change it), recorded in the run file."""
    before = torch.get_num_threads()
    try:
        trainer = Trainer(small(tmp_path, steps=1))
        assert torch.get_num_threads() == 1 and trainer.cfg.threads == 1
        trainer.run()
        with open_run(trainer.cfg.out) as run:
            assert run.meta.config["threads"] == 1
        Trainer(small(tmp_path, steps=1, threads=2, overwrite=True))
        assert torch.get_num_threads() == 2
        with pytest.raises(ConfigError, match="--threads"):
            Trainer(small(tmp_path, threads=-1, overwrite=True))
    finally:
        torch.set_num_threads(before)


def test_progress_shows_the_base_evaluation_as_its_own_phase(tmp_path, monkeypatch):
    """The trainer reports its phases in order, and the CLI's bar names them; a resumed run has no
    base evaluation."""
    from gradscope.trainers import cli

    phases: list[str] = []
    cfg = small(tmp_path, steps=2, eval_every=1)
    Trainer(cfg, echo=lambda line: None).run(on_phase=phases.append)
    assert phases == ["base evaluation", "training", "evaluation", "training", "evaluation"]
    shown: list[str] = []
    monkeypatch.setattr("tqdm.tqdm.set_description", lambda bar, desc=None, refresh=True: shown.append(desc))
    cli.run_with_progress(Trainer(small(tmp_path, steps=3, eval_every=1, resume=True), echo=lambda line: None))
    assert shown == ["voting/math/ip (training)", "voting/math/ip (evaluation)"]


def test_only_global_rank_zero_checks_where_it_writes(tmp_path, monkeypatch):
    """Multi-node: a node other than rank 0's need not see --out's folder (was: every rank checked it). Under
    torchrun no rank checks it before the rendezvous; rank 0 then runs check_writer, and every rank raises its
    error (test_distributed_train.py)."""
    from gradscope.trainers.train import check_writer, validate

    cfg = TrainConfig(out=str(tmp_path / "elsewhere" / "run.h5"), tasks_per_step=2, n_train=8, n_held_out=4)
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in ("1", "0"):
        monkeypatch.setenv("RANK", rank)
        validate(cfg)
    with pytest.raises(ConfigError, match="folder .*elsewhere does not exist"):
        check_writer(cfg)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="folder .*elsewhere does not exist"):
        validate(cfg)


def test_on_step_reports_the_base_evaluation_first(tmp_path):
    """The progress bar showed eval_acc '-' until the first evaluation after step 0."""
    cfg = TrainConfig(steps=2, tasks_per_step=2, n_held_out=4, n_train=16, eval_every=0, checkpoint_every=0,
                      out=str(tmp_path / "run.h5"), grpo=GRPOConfig(group_size=2))
    calls = []
    Trainer(cfg).run(on_step=lambda step, metrics: calls.append((step, "train/accuracy" in metrics,
                                                                 metrics.get("eval_accuracy"))))
    with open_run(cfg.out) as run:
        acc = run.evals_wide()["accuracy"]
    assert calls == [(0, False, acc[0]), (1, True, None), (2, True, acc[2])]
