"""Update attribution in the run file (schema 1.2): round trip, NaN for records without it, resume,
validation, and files of schemas 1.0 and 1.1 (no update attribution) still read."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from gradscope import stats
from gradscope.runfile import RunWriter, open_run
from tests.gradscope.test_runfile import AGENTS, ROLES, _bits, make_meta, write_random_run

COMPONENTS = ["voter", "aggregator", "unattributed", "weight_decay"]


def random_update(rng: np.random.Generator, C: int = 4, K: int = 4) -> SimpleNamespace:
    X = rng.normal(size=(C, 30))
    return SimpleNamespace(components=COMPONENTS[:C] if C == 4 else None, gram=X @ X.T,
                           interference=rng.normal(size=(C, K)), grad_scale=float(rng.uniform()),
                           residual=float(rng.uniform()) * 1e-7)


def test_update_fields_round_trip_and_derive(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    rng = np.random.default_rng(0)
    meta = make_meta(update_unit="role")
    assert meta.update_components == COMPONENTS
    logged = []
    with RunWriter(path, meta, flush_every=3) as w:
        for i in range(8):
            update = None if i == 5 else random_update(rng)
            w.log_step(i, rng.normal(size=(4, 4)), [1, 2, 3, 4], policy="voter_lora", update=update)
            logged.append(update)
    with open_run(path) as run:
        assert run.meta.update_unit == "role" and run.meta.update_components == COMPONENTS
        for i, u in enumerate(logged):
            if u is None:
                assert np.isnan(run.update_gram[i]).all() and np.isnan(run.update_interference[i]).all()
                assert np.isnan(run.update_grad_scale[i])
                continue
            assert np.array_equal(_bits(run.update_gram[i]), _bits(u.gram))
            assert np.array_equal(_bits(run.update_interference[i]), _bits(u.interference))
            assert run.update_grad_scale[i] == u.grad_scale and run.read("update_residual", i, i + 1)[0] == u.residual
        df = run.stats()
        u = logged[0]
        shares = u.gram.sum(1) / u.gram.sum()
        for j, c in enumerate(COMPONENTS):
            assert df[f"update_share/{c}"][0] == pytest.approx(shares[j])
            assert df[f"role_update_norm/{c}"][0] == pytest.approx(np.sqrt(u.gram[j, j]))
        assert df["total_update_norm"][0] == pytest.approx(np.sqrt(u.gram.sum()))
        # interference by role: rows aggregated over components, columns over the agents of a role
        assert df["interference/voter|voter"][0] == pytest.approx(u.interference[0, :3].sum())
        assert df["interference/weight_decay|aggregator"][0] == pytest.approx(u.interference[3, 3])
        assert df["update_cos/voter|aggregator"][0] == pytest.approx(u.gram[0, 1] / np.sqrt(u.gram[0, 0] * u.gram[1, 1]))
        assert np.isnan(df["update_share/voter"][5]) and np.isfinite(df["share/voter"][5])
    with h5py.File(path, "r") as f:
        assert json.loads(f["steps/update_gram"].attrs["components"]) == COMPONENTS
        assert f["steps/update_interference"].shape == (8, 4, 4)
    w = RunWriter.resume(path, keep_below_step=4)  # the update datasets are copied like the others
    w.close()
    with open_run(path) as run:
        assert run.n_steps == 4 and np.array_equal(_bits(run.update_gram[3]), _bits(logged[3].gram))


def test_per_agent_units(tmp_path: Path) -> None:
    """update_unit='agent': C = K + 2; statistics aggregate the agents' components into roles."""
    path = tmp_path / "agents.h5"
    rng = np.random.default_rng(1)
    X = rng.normal(size=(6, 40))
    update = SimpleNamespace(gram=X @ X.T, interference=rng.normal(size=(6, 4)), grad_scale=1.0, residual=0.0)
    meta = make_meta(update_unit="agent")
    assert meta.update_components == [*AGENTS, "unattributed", "weight_decay"]
    with RunWriter(path, meta) as w:
        w.log_step(0, np.eye(4), [1, 1, 1, 1], update=update)
    with open_run(path) as run:
        df = run.stats()
    voter = X[:3].sum(0)
    assert df["role_update_norm/voter"][0] == pytest.approx(np.linalg.norm(voter))
    assert df["update_share/voter"][0] == pytest.approx(voter @ X.sum(0) / (X.sum(0) @ X.sum(0)))
    Q, names = stats.update_indicator(ROLES, ["voter", "aggregator"])
    assert names == COMPONENTS and Q.shape == (6, 4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(update=SimpleNamespace(gram=np.eye(3), interference=np.zeros((3, 4)), grad_scale=1, residual=0)),
     r"update gram must have shape \(4, 4\)"),
    (dict(update=SimpleNamespace(components=["a", "b", "unattributed", "weight_decay"], gram=np.eye(4),
                                 interference=np.zeros((4, 4)), grad_scale=1, residual=0)), "differ from the run"),
    (dict(update=SimpleNamespace(gram=np.eye(4))), "must have gram, interference"),
])
def test_update_validation(tmp_path: Path, kwargs, match) -> None:
    with RunWriter(tmp_path / "v.h5", make_meta(update_unit="role")) as w:
        with pytest.raises(ValueError, match=match):
            w.log_step(0, np.eye(4), [1, 1, 1, 1], **kwargs)
        assert w.n_steps == 0


def test_update_without_unit_and_bad_units_are_refused(tmp_path: Path) -> None:
    with RunWriter(tmp_path / "plain.h5", make_meta()) as w:
        with pytest.raises(ValueError, match="no update attribution"):
            w.log_step(0, np.eye(4), [1, 1, 1, 1], update=random_update(np.random.default_rng(0)))
    with pytest.raises(ValueError, match="update_unit must be one of"):
        make_meta(update_unit="layer")
    with pytest.raises(ValueError, match="clashes with an update component"):
        make_meta(agents=["a", "weight_decay"], agent_roles=["r", "weight_decay"], update_unit="role")


def test_schema_1_0_file_is_read(tmp_path: Path) -> None:
    """A file as gradscope wrote it before update attribution: schema 1.0, no update_unit attribute."""
    path = tmp_path / "old.h5"
    want = write_random_run(path, n=6)
    with h5py.File(path, "r+") as f:
        f.attrs["schema_version"] = "1.0"
        del f.attrs["update_unit"]
        del f["steps/method"]  # 1.1's
    with open_run(path) as run:
        assert run.schema_version == "1.0" and run.meta.update_unit == "" and run.meta.update_components == []
        assert run.update_gram is None and run.update_interference is None and run.update_grad_scale is None
        assert np.array_equal(_bits(run.gram), _bits(want["gram"]))
        assert "update_share/voter" not in run.stats().columns


def test_info_shows_update_attribution(tmp_path: Path) -> None:
    from gradscope.runfile.info import render_info

    path = tmp_path / "run.h5"
    u = random_update(np.random.default_rng(2))
    with RunWriter(path, make_meta(update_unit="role")) as w:
        w.log_step(0, np.eye(4), [1, 1, 1, 1], update=u)
    text = render_info(path)
    assert "split by role into voter, aggregator, unattributed, weight_decay" in text
    assert f"update shares: voter {u.gram[0].sum() / u.gram.sum():.2f}" in text
    shares = [u.gram[c].sum() / u.gram.sum() for c in range(4)]  # every component's, summing to 1
    assert text.split("update shares: ")[1].split("\n")[0] == ", ".join(
        f"{c} {v:.2f}" for c, v in zip(["voter", "aggregator", "unattributed", "weight_decay"], shares))
    assert "(no update attribution)" in render_info(write_random_run(tmp_path / "p.h5", n=2) and tmp_path / "p.h5")
