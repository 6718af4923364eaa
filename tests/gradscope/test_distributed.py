"""The probe under torchrun (2 ranks, CPU, gloo): the Gram of the global per-agent gradients.

One torchrun launch (``dist_child.py``) runs every case of ``dist_cases.py`` with the global batch
split over two ranks; each is compared with the same case run here in one process on the whole
batch: exact Grams to 1e-5 relative (split and hooks; IP, SP, and a fully trained embedding + head),
sketched Grams likewise (the sketch is a fixed linear map, so ranks add up exactly), token counts
exactly, and the ranks' summed ``.grad`` with the one-process gradient.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.gradscope.dist_cases import CASES, case_name, run_case
from tests.gradscope.dist_child import EMPTY_RANK_CASES
from tests.gradscope.test_probe import rel_err

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("dist_child.py")
TIMEOUT_S = 240
ALL_ROWS = [list(range(8))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict[str, np.ndarray]]:
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}", str(CHILD), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [dict(np.load(out / f"rank{r}.npz")) for r in (0, 1)]


def _identity(n: int) -> int:
    return n


@pytest.mark.parametrize("case", EMPTY_RANK_CASES, ids=case_name)
def test_a_rank_with_no_rows_takes_part_in_the_step(ranks, case):
    """Rank 1 holds no rows and calls nothing inside the step (distributed.md allows it): on hooks' first,
    self-checked step it skipped the check's collective, and gloo aborted the job."""
    _, single, _ = run_case(case, ALL_ROWS, _identity)
    for rank in ranks:
        assert rel_err(rank[f"empty-rank/{case_name(case)}/gram"], single["gram"]) < 1e-5


@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_two_ranks_give_the_one_process_gram(ranks, case):
    probe, single, grad = run_case(case, ALL_ROWS, _identity)
    name = case_name(case)
    for rank in ranks:
        assert rel_err(rank[f"{name}/gram"], single["gram"]) < 1e-5
        assert rel_err(rank[f"{name}/group_gram"], single["group_gram"]) < 1e-5
        assert rank[f"{name}/tokens"].tolist() == single["tokens"].tolist()
        np.testing.assert_allclose(rank[f"{name}/grad"], grad.numpy(), rtol=1e-5, atol=1e-7)
        assert str(rank[f"{name}/measurement"]) == probe.measurement + "+ranks(2)"
        assert int(rank[f"{name}/fallbacks"]) == 0  # hooks attributed every row itself
    if case[1] == "ip":  # rank 0 never touched the aggregator; still exactly orthogonal to the voters
        assert np.all(single["gram"][:3, 3] == 0) and np.all(ranks[0][f"{name}/gram"][:3, 3] == 0)


def test_a_rank_that_re_arms_the_check_alone_does_not_abort_the_job(ranks):
    """The check schedule and the recorded method are the ranks' together: a rank that guessed a batch dimension
    re-armed the check for itself only (a gloo abort at the next step's end), and each rank recorded its own
    method (the run file, written by rank 0, missed rank 1's fallback)."""
    methods = [rank["rearm/methods"].tolist() for rank in ranks]
    # step 2: the check runs on both ranks and catches the guess (dimension 0 is the sequence): split from then on
    assert methods[0] == methods[1] == ["hooks+check", "split-fallback:unmatched-rows", "split-fallback:check-failed"]


def test_explicit_group_and_refused_mismatch(ranks):
    name = case_name(CASES[0])
    for rank in ranks:
        np.testing.assert_allclose(rank["explicit-group/gram"], rank[f"{name}/gram"], rtol=1e-12)
        assert "ranks built their probes differently (agents, roles differ)" in str(rank["mismatch"])
        assert "ranks built their probes differently (roles differ)" in str(rank["mismatch-roles"])
        assert "ranks built their probes differently (accumulation dtype differ)" in str(rank["mismatch-dtype"])
        assert str(rank["mismatch-attach"]) == ("the ranks attached optimizers differently (Probe.attach): every rank "
                                                "must attach the same optimizers, by the same unit, before the same step")
