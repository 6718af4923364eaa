"""Amplification through the update channel (``detect_update_amplification``) on labelled synthetic runs:
IP Voting whose per-training-step metrics plant a voter adapter that moves k times as far as the
aggregator's, from a known step, under multiplicative noise."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from gradscope.analyses import AnalysisConfig, analyze_series
from gradscope.analyses.amplification import AmplificationConfig, detect_update_amplification
from tests.analyses import synthetic as syn

T = 80


def metrics(ratio: np.ndarray, voter_steps: float = 3.0, seed: int = 0, noise: float = 0.3,
            zero_every: int = 0) -> pd.DataFrame:
    """update_rel/aggregator ≈ 0.004 · lognormal noise; update_rel/voter = ratio × that level × noise."""
    rng = np.random.default_rng(seed)
    agg = 0.004 * np.exp(noise * rng.standard_normal(T))
    voter = ratio * 0.004 * np.exp(noise * rng.standard_normal(T))
    if zero_every:
        agg[::zero_every] = 0.0  # steps where every aggregator advantage was 0: it did not move
    return pd.DataFrame({"update_rel/voter": voter, "update_rel/aggregator": agg,
                         "opt_steps/voter": np.full(T, voter_steps), "opt_steps/aggregator": np.ones(T)},
                        index=pd.Index(np.arange(1, T + 1), name="step"))


def run(m: pd.DataFrame, policy: str = "ip", seed: int = 0):
    series = syn.make_series(syn.VOTING, T, policy=policy, seed=seed, first_step=1)
    series.metrics = m
    return series


def test_a_planted_update_ratio_is_found_with_its_decomposition():
    ratio = np.where(np.arange(1, T + 1) >= 30, 6.0, 1.0)
    found = detect_update_amplification(run(metrics(ratio)))
    assert len(found) == 1
    f = found[0]
    assert (f.kind, f.role, f.policy, f.evidence["channel"]) == ("amplification", "voter", "voter", "update")
    assert abs(f.onset - 30) <= 3 and f.end == T
    assert f.evidence["update_ratio"] == pytest.approx(6.0, rel=0.2)
    assert f.evidence["optimizer_step_ratio"] == pytest.approx(3.0)
    assert f.evidence["per_step_ratio"] == pytest.approx(2.0, rel=0.2)
    assert f.severity == "warning"  # each of its steps is also ≥ 2× larger, beyond the step count
    assert "moves" in f.summary and "3.0x the optimizer steps" in f.summary


def test_explained_by_the_step_count_alone_is_info():
    found = detect_update_amplification(run(metrics(np.full(T, 3.0), voter_steps=3.0)))
    assert len(found) == 1 and found[0].severity == "info"
    assert found[0].evidence["per_step_ratio"] == pytest.approx(1.0, rel=0.2)


@pytest.mark.parametrize("seed", range(10))
def test_precision_and_recall_over_noisy_runs(seed):
    """Positive: ratio 4 from step 20 (30 % noise on each policy, one aggregator step in 5 without
    movement); negative: ratio 1.2 throughout, or 3 on alternate steps only (never 80 % of a window)."""
    positive = detect_update_amplification(run(metrics(np.where(np.arange(T) >= 19, 4.0, 1.0), seed=seed,
                                                        zero_every=5), seed=seed))
    assert [f.role for f in positive] == ["voter"] and abs(positive[0].onset - 20) <= 5
    assert detect_update_amplification(run(metrics(np.full(T, 1.2), seed=seed), seed=seed)) == []
    alternate = np.where(np.arange(T) % 2 == 0, 3.0, 1.0)
    assert detect_update_amplification(run(metrics(alternate, noise=0.05, seed=seed), seed=seed)) == []


def test_not_applicable_without_separate_policies_or_metrics():
    ratio = np.full(T, 6.0)
    sp = run(metrics(ratio).rename(columns=lambda c: c.replace("voter", "shared")).drop(
        columns=["update_rel/aggregator", "opt_steps/aggregator"]), policy="sp")
    assert detect_update_amplification(sp) == []                       # one shared policy: nothing to compare
    assert detect_update_amplification(run(pd.DataFrame())) == []      # no metrics (another framework's run)
    one_agent = run(metrics(ratio).rename(columns={"update_rel/voter": "update_rel/aggregator",
                                                   "update_rel/aggregator": "update_rel/voter"}))
    assert detect_update_amplification(one_agent) == []                # the aggregator (1 agent) moving more
    loose = AmplificationConfig(update_ratio=8.0)
    assert detect_update_amplification(run(metrics(ratio)), loose) == []  # the threshold is a flag


def test_analyze_reports_it_next_to_the_gradient_channel():
    report = analyze_series(run(metrics(np.full(T, 6.0))), AnalysisConfig())
    channels = [f.evidence["channel"] for f in report.findings if f.kind == "amplification"]
    assert channels == ["update"]
