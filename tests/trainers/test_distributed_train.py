"""``gradscope train`` under torchrun (2 CPU ranks, gloo): stop, resume, a killed rank."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from gradscope.runfile import open_run

from .test_train import GRADSCOPE, assert_total_matches_grad_norm

pytestmark = pytest.mark.slow
SMALL = ["--tasks-per-step", "2", "--group-size", "4", "--n-held-out", "4", "--n-train", "40"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
            "--monitor-interval=0.5", "-m", "gradscope.cli", "train", *SMALL, *args]


def structure(path: Path) -> dict:
    """Every dataset's dtype and trailing shape, and the run's metadata: what must not depend on
    the number of processes."""
    out = {}
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        f.visititems(lambda name, obj: out.__setitem__(name, (str(obj.dtype), obj.shape[1:]))
                     if isinstance(obj, h5py.Dataset) else None)
    with open_run(path) as run:
        m = run.meta
        out["meta"] = (m.agents, m.agent_roles, m.roles, m.policies, m.scalar_names)
        out["records per step and policy"] = sorted(zip(run.step.tolist(), run.policy.tolist()))
    return out


def test_two_ranks_stop_cleanly_with_a_global_gram(tmp_path):
    out = tmp_path / "ddp.h5"
    proc = subprocess.run(torchrun("--steps", "6", "--eval-every", "0", "--checkpoint-every", "0", "--out", str(out),
                                   "--alert", "train/accuracy >= 0 for 2: stop"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("stopped after step 2 by alert") == 1  # rank 0 only
    with open_run(out) as run:
        assert run.closed and sorted(set(run.step)) == [1, 2]
        assert run.events["kind"].iloc[-1] == "stop"
        # the Gram is of the global gradient: its total equals the all-reduced gradient's norm
        assert_total_matches_grad_norm(run, rtol=1e-5)
        assert run.meta.config["world_size"] == 2 and run.meta.probe_method == "hooks+ranks(2)"
        assert (run.scalars["samples"] == 8 * 3 / 3).all()  # 2 tasks × 4 rollouts; 3 voters → 3 mini-batches
    single = tmp_path / "single.h5"
    proc = subprocess.run([*GRADSCOPE, "train", *SMALL, "--steps", "2", "--eval-every", "0", "--checkpoint-every",
                           "0", "--out", str(single)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert structure(out) == structure(single)
    with open_run(single) as run:
        assert run.meta.probe_method == "hooks"


def test_two_ranks_resume_with_the_same_world_size(tmp_path):
    out = tmp_path / "ddp.h5"
    first = subprocess.run(torchrun("--steps", "2", "--eval-every", "0", "--checkpoint-every", "1", "--out", str(out)),
                           capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    alone = subprocess.run([*GRADSCOPE, "train", *SMALL, "--steps", "4", "--resume", "--out", str(out)],
                           capture_output=True, text=True, timeout=300)
    assert alone.returncode == 2 and "made by 2 processes, this run has 1" in alone.stderr, alone.stderr
    again = subprocess.run(torchrun("--steps", "4", "--eval-every", "0", "--resume", "--out", str(out)),
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    with open_run(out) as run:
        assert run.closed and sorted(set(run.step)) == [1, 2, 3, 4]
        assert (run.events["kind"] == "resume").sum() == 1


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in env if e.startswith(b"RANK=")]
    return ranks[0] if ranks else None


@pytest.mark.parametrize("overwrite, message", [
    (False, "{out} already exists (pass --overwrite to replace it, or --resume)"),
    (True, "{out}: not a gradscope run file; refusing to replace it"),  # a RunFileError, not a ConfigError
])
def test_a_run_file_only_rank_0_can_refuse_fails_every_rank_at_once(tmp_path, overwrite, message):
    """Only rank 0 checks --out: it exited 2 while rank 1 waited in the rendezvous, until torchrun killed it
    ~30 s later, silent. Now rank 0 checks after the rendezvous and every rank prints the line, exit 2."""
    out = tmp_path / "exists.h5"
    out.write_bytes(b"")
    job = subprocess.run(torchrun("--steps", "2", "--out", str(out), *(["--overwrite"] if overwrite else [])),
                         capture_output=True, text=True, timeout=300)
    line = "gradscope: error: " + message.format(out=out)
    # both ranks say it (rank 1 said nothing: torchrun killed it in the rendezvous); torchrun may stop the second
    # rank with SIGTERM once the first exited 2, after its line. (The traceback in stderr is torchrun's own.)
    assert job.stderr.count(line) == 2 and job.stderr.count("gradscope: error:") == 2, job.stderr  # (may share a line)
    assert job.returncode != 0 and "exitcode  : 2" in job.stderr, job.stderr
    assert out.read_bytes() == b""


def test_a_killed_rank_ends_the_job_without_hanging(tmp_path):
    out = tmp_path / "ddp.h5"
    job = subprocess.Popen(torchrun("--steps", "500", "--eval-every", "0", "--out", str(out)),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:  # wait for committed records
            if out.exists():
                try:
                    with open_run(out) as run:
                        if run.n_steps >= 10:
                            break
                except Exception:
                    pass
            time.sleep(0.5)
        else:
            pytest.fail("no records within 240 s")
        workers = {_rank_of(p): p for p in _children(job.pid)}
        os.kill(workers[1], signal.SIGKILL)
        t0 = time.time()
        job.wait(timeout=60)  # stated bound: torchrun tears the job down within seconds
        ended = time.time() - t0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0
    assert ended < 60
    with open_run(out) as run:  # readable; rank 0 closed it on the way out (gloo: see distributed.md)
        assert run.closed and run.n_steps >= 10
        assert np.isfinite(run.gram).all()


@pytest.mark.parametrize("k", [256])
def test_sketched_probe_in_training(tmp_path, k, alternating_rewards):
    """--probe-sketch K: the run file says so; IP adapters stay exactly orthogonal; the sketched
    total norm is close to the trainer's exact gradient norm (sd ≈ 1/√(2k) relative)."""
    from gradscope.trainers.train import Trainer

    from .test_train import small

    cfg = small(tmp_path, steps=2, probe_sketch=k, default_alerts=False)
    Trainer(cfg).run()
    with open_run(cfg.out) as run:
        assert run.meta.probe_method == f"hooks+sketch(k={k},seed=0)"
        voters = [i for i, r in enumerate(run.meta.agent_roles) if r == "voter"]
        agg = run.meta.agent_roles.index("aggregator")
        assert (run.gram[:, voters, agg] == 0).all()
        norm = run.scalars["grad_norm"].to_numpy()
        signal = norm > 1e-6 * norm.max()  # not a record whose gradient cancelled to rounding noise
        assert signal.sum() >= len(norm) // 2
        rel = np.sqrt(np.clip(run.gram.sum(axis=(1, 2)), 0, None))[signal] / norm[signal] - 1
        assert np.abs(rel).max() < 5 / np.sqrt(2 * k) and np.abs(rel).max() > 0  # sketched, not exact
