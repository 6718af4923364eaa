"""The reader's pandas views: ``scalars`` with step and policy, ``stats(per="record" | "step")``.

The per-step view is checked against a brute-force loop over records and against the detectors'
own per-step series (``RunSeries``): one aggregation rule for both.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gradscope.analyses.series import RunSeries
from gradscope.runfile import RunMeta, RunWriter, open_run
from gradscope.stats import derive
from tests.analyses import synthetic as syn


@pytest.fixture(scope="module")
def ip_run(tmp_path_factory) -> Path:
    """Voting under IP: per step three voter records and one aggregator record (real Grams), the
    voters coherent from step 20; every 7th voter record all-zero (a mini-batch without advantage)."""
    T = 40
    series = syn.make_series(syn.VOTING, T, rho={"voter": np.where(np.arange(T) >= 20, 0.9, 0.0)},
                             norm={"voter": 2.0}, policy="ip", seed=4, dim=16)
    series.gram[::7] = np.where(series.record_policy[::7, None, None] == "voter", 0.0, series.gram[::7])
    path = tmp_path_factory.mktemp("pandas") / "ip.h5"
    syn.write_run(series, path)
    return path


def _brute_per_step(run) -> dict[int, dict[str, float]]:
    """Each derive() column per step: the mean over the step's records where its subject has a gradient."""
    agents, roles_of = run.meta.agents, run.meta.agent_roles
    roles = list(dict.fromkeys(roles_of))
    out: dict[int, dict[str, float]] = {}
    for step in sorted(set(run.step.tolist())):
        rows = np.flatnonzero(run.step == step)
        cols = [derive(run.gram[i], run.tokens[i], agents, roles_of) for i in rows]

        def agent_on(i, a):
            return run.gram[i][agents.index(a), agents.index(a)] > 0

        def role_on(i, r):
            idx = [k for k, x in enumerate(roles_of) if x == r]
            return run.gram[i][np.ix_(idx, idx)].sum() > 0

        def counts(i, name):
            family, _, subject = name.partition("/")
            if family == "total_norm":
                return True
            if family == "norm":
                return agent_on(i, subject)
            if family in ("cos", "role_cos"):
                a, b = subject.split("|")
                on = agent_on if family == "cos" else role_on
                return on(i, a) and on(i, b)
            assert subject in roles
            return role_on(i, subject)

        out[step] = {}
        for name in cols[0]:
            vals = [float(c[name]) for c, i in zip(cols, rows) if counts(i, name) and np.isfinite(c[name])]
            out[step][name] = float(np.mean(vals)) if vals else np.nan
    return out


def test_stats_per_step_is_the_detectors_rule(ip_run: Path) -> None:
    with open_run(ip_run) as run:
        per_record = run.stats()
        df = run.stats(per="step")
        brute = _brute_per_step(run)
        series = RunSeries.from_reader(run)
    assert len(per_record) == run.n_steps == 4 * 40
    assert list(df.columns[:2]) == ["step", "records"] and df["step"].is_monotonic_increasing
    assert list(df["step"]) == sorted(brute) and (df["records"] == 4).all()
    assert list(df.columns[2:]) == list(per_record.columns[3:])
    for _, row in df.iterrows():
        want = brute[int(row["step"])]
        for name, value in want.items():
            assert np.isclose(row[name], value, equal_nan=True), (int(row["step"]), name, row[name], value)
    r = series.roles.index("voter")
    np.testing.assert_allclose(df["coherence/voter"], series.coherence[:, r], equal_nan=True)
    np.testing.assert_allclose(df["role_norm/voter"], series.role_norm[:, r])
    np.testing.assert_allclose(df["af/voter"], series.amplification[:, r])
    # Under IP a record holds one role: its share is 1 wherever the role trains, not 1/0 alternating.
    assert np.allclose(df["share/voter"], 1.0) and np.allclose(df["share/aggregator"], 1.0)
    assert set(np.round(per_record["share/aggregator"], 6)) == {0.0, 1.0}  # what made the record view zigzag
    assert df["coherence/voter"].iloc[25:].mean() > 0.8 > df["coherence/voter"].iloc[:15].mean()


def test_stats_per_bad_value(ip_run: Path) -> None:
    with open_run(ip_run) as run, pytest.raises(ValueError, match="'record' or 'step'"):
        run.stats(per="optimizer")


def test_stats_per_step_of_an_empty_run(tmp_path: Path) -> None:
    RunWriter(tmp_path / "e.h5", RunMeta(agents=["a", "b"], agent_roles=["r", "r"])).close()
    with open_run(tmp_path / "e.h5") as run:
        df = run.stats(per="step")
    assert df.empty and list(df.columns[:2]) == ["step", "records"]


def test_scalars_carry_step_and_policy(tmp_path: Path) -> None:
    meta = RunMeta(agents=["a", "b"], agent_roles=["r", "s"], policies=["p", "q"],
                   scalar_names=["loss", "step", "lr"])
    with RunWriter(tmp_path / "s.h5", meta) as w:
        for i in range(6):
            w.log_step(i // 2, np.eye(2), [1, 1], policy=["p", "q", None][i % 3],
                       scalars={"loss": float(i), "step": 10.0 * i})
    with open_run(tmp_path / "s.h5") as run:
        sc = run.scalars
    assert list(sc.columns) == ["step", "policy", "loss", "scalar/step", "lr"]
    assert list(sc["step"]) == [0, 0, 1, 1, 2, 2] and sc["step"].dtype == np.int64
    assert list(sc["policy"].fillna("-")) == ["p", "q", "-", "p", "q", "-"]  # untagged: missing
    assert list(sc["loss"]) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and sc["lr"].isna().all()
    assert list(sc["scalar/step"]) == [10.0 * i for i in range(6)]
    per_step = sc.groupby("step")["loss"].mean()  # the documented pattern: one point per training step
    assert list(per_step) == [0.5, 2.5, 4.5]


@pytest.mark.parametrize("roles", [["voter", "aggregator"], ["aggregator", "voter"], ["critic", "aggregator", "voter"]])
def test_update_columns_per_step_whatever_the_order_of_roles(tmp_path: Path, roles: list[str]) -> None:
    """A step's ``update_cos`` is the mean over its records in which both roles have a gradient, in any order of
    ``RunMeta.roles``: named in that order, it matched no subject and averaged every record (0.40, not 0.80);
    a role no agent holds got 0 per step, not NaN."""
    import types
    path = tmp_path / "run.h5"
    meta = RunMeta(agents=["v0", "v1", "agg"], agent_roles=["voter", "voter", "aggregator"], roles=roles,
                   update_unit="role")
    components = [*roles, "unattributed", "weight_decay"]

    def update(parts: dict[str, list[float]]) -> types.SimpleNamespace:
        D = np.array([parts.get(c, [0.0, 0.0]) for c in components])
        return types.SimpleNamespace(gram=D @ D.T, interference=np.zeros((len(components), 3)),
                                     grad_scale=1.0, residual=0.0)
    with RunWriter(path, meta) as w:
        g = np.array([[1.0, 0], [1.0, 0], [0, 0]])  # the voters only
        w.log_step(0, g @ g.T, [1, 1, 0], update=update({"voter": [1.0, 0]}))
        g = np.array([[1.0, 0], [1.0, 0], [0, 1.0]])  # both roles; their updates at cosine 0.8
        w.log_step(0, g @ g.T, [1, 1, 1], update=update({"voter": [1.0, 0], "aggregator": [0.8, 0.6]}))
    with open_run(path) as run:
        per_step = run.stats(per="step")
    pair = "aggregator|voter" if roles.index("aggregator") < roles.index("voter") else "voter|aggregator"
    assert per_step[f"update_cos/{pair}"][0] == pytest.approx(0.8)
    assert per_step["role_update_norm/voter"][0] == pytest.approx(1.0)
    if "critic" in roles:
        assert np.isnan(per_step["role_update_norm/critic"][0])
        assert np.isnan(per_step["update_cos/critic|aggregator"][0])
