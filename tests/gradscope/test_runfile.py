"""The run file: round trip, writer validation, resume, malformed files through ``gradscope info``."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

from gradscope.errors import RunFileError
from gradscope.runfile import SCHEMA_VERSION, RunMeta, RunReader, RunWriter, open_run
from gradscope.runfile.info import render_info
from gradscope.runfile.progress import run_progress
from gradscope.runfile.writer import RESUME_SUFFIX

ROOT = Path(__file__).resolve().parents[2]
AGENTS = ["voter0", "voter1", "voter2", "aggregator"]
ROLES = ["voter", "voter", "voter", "aggregator"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _bits(a: Any) -> np.ndarray:
    """float64 as uint64, so that equality is bitwise (NaN == NaN)."""
    return np.ascontiguousarray(a, dtype=np.float64).view(np.uint64)


def make_meta(**over: Any) -> RunMeta:
    kw: dict[str, Any] = dict(agents=AGENTS, agent_roles=ROLES, policies=["voter_lora", "agg_lora"],
                              groups=["layer0", "layer1"], group_sizes=[4096, 8192],
                              config={"lr": 1e-3, "workflow": "voting", "nested": {"k": [1, 2]}},
                              seed=11, probe_method="split", scalar_names=["loss", "lr", "kl/voter"])
    kw.update(over)
    return RunMeta(**kw)


def write_random_run(path: Path, n: int = 37, flush_every: int = 5, seed: int = 0,
                     meta: RunMeta | None = None) -> dict[str, Any]:
    """Write ``n`` random records (plus evals, metrics and events); return what was logged."""
    meta = meta or make_meta()
    rng = np.random.default_rng(seed)
    K, G = len(meta.agents), len(meta.groups)
    logged: dict[str, list[Any]] = {k: [] for k in
                                    ("step", "opt_step", "policy", "gram", "group_gram", "tokens", "scalars")}
    evals: list[tuple[int, str, float]] = []
    metrics: list[tuple[int, str, float]] = []
    events: list[tuple[int, str, str, str]] = []
    with RunWriter(path, meta, flush_every=flush_every) as w:
        for i in range(n):
            gram = rng.normal(size=(K, K)) * 10.0 ** rng.integers(-8, 8)
            if i == 4:
                gram[1, 2] = np.nan  # NaN is data
            tokens = rng.integers(0, 10_000, size=K)
            policy = None if i % 4 == 3 else meta.policies[i % 2] if meta.policies else None
            group = rng.normal(size=(G, K, K)) if G and i % 3 else None
            scalars = {name: float(rng.normal()) for name in meta.scalar_names if rng.uniform() < 0.7}
            opt_step = 100 + 3 * i if i >= 30 else None  # explicit after 30, auto before
            w.log_step(i // 2, gram, tokens, opt_step=opt_step, policy=policy, group_gram=group,
                       scalars=scalars)
            logged["step"].append(i // 2)
            logged["opt_step"].append(i if opt_step is None else opt_step)
            logged["policy"].append(policy)
            logged["gram"].append(gram)
            logged["group_gram"].append(group if group is not None else np.full((G, K, K), np.nan))
            logged["tokens"].append(tokens)
            logged["scalars"].append([scalars.get(s, np.nan) for s in meta.scalar_names])
            if i % 6 == 0:
                values = {"accuracy": float(rng.uniform()), "length/voter": float(rng.integers(5, 50))}
                w.log_eval(i // 2, values)
                evals += [(i // 2, k, v) for k, v in values.items()]
            if i % 2 == 1:  # end of a training step (two records each)
                values = {"reward/mean": float(rng.normal()), "update_norm/voter_lora": float(rng.uniform()),
                          "opt_steps/voter_lora": 2.0}
                if i % 8 == 1:
                    values["time/eval_s"] = np.nan  # NaN is data here too
                w.log_metrics(i // 2, values)
                metrics += [(i // 2, k, v) for k, v in values.items()]
            if i % 10 == 9:
                w.log_event(i // 2, "amplification", f"coherence {i}", severity="warning")
                events.append((i // 2, "amplification", "warning", f"coherence {i}"))
    return {"meta": meta, "n": n, "evals": evals, "metrics": metrics, "events": events,
            **{k: np.array(v, dtype=object if k == "policy" else None) for k, v in logged.items()}}


# --- round trip ---------------------------------------------------------------------------------


def test_round_trip_is_exact(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    want = write_random_run(path)
    with open_run(path) as run:
        assert run.closed and run.n_steps == want["n"]
        assert run.schema_version == SCHEMA_VERSION
        meta = run.meta
        expected_meta = dataclasses.replace(want["meta"], created=meta.created, versions=meta.versions,
                                            flush_every=5)
        assert meta == expected_meta
        assert meta.created and "python" in meta.versions and "h5py" in meta.versions
        assert np.array_equal(run.step, want["step"]) and run.step.dtype == np.int64
        assert np.array_equal(run.opt_step, want["opt_step"])
        assert list(run.policy) == list(want["policy"])
        assert np.array_equal(_bits(run.gram), _bits(want["gram"]))
        assert np.array_equal(_bits(run.group_gram), _bits(want["group_gram"]))
        assert np.array_equal(run.tokens, want["tokens"]) and run.tokens.dtype == np.int64
        assert np.all(np.diff(run.time) >= 0)
        scalars = run.scalars
        assert list(scalars.columns) == ["step", "policy", *meta.scalar_names] and len(scalars) == want["n"]
        assert np.array_equal(scalars["step"], want["step"])
        assert np.array_equal(_bits(scalars[meta.scalar_names].to_numpy()), _bits(want["scalars"]))

        evals = run.evals
        assert list(evals.columns) == ["step", "name", "value"]
        assert list(evals.itertuples(index=False, name=None)) == want["evals"]
        wide = run.evals_wide()
        assert sorted(wide.columns) == ["accuracy", "length/voter"]
        assert list(wide.index) == sorted({s for s, _, _ in want["evals"]})
        metrics = run.metrics
        assert run.n_metrics == len(want["metrics"]) == len(metrics)
        assert list(metrics.columns) == ["step", "name", "value"]
        assert metrics["step"].dtype == np.int64 and metrics["value"].dtype == np.float64
        got = list(metrics.itertuples(index=False, name=None))
        assert [(s, k) for s, k, _ in got] == [(s, k) for s, k, _ in want["metrics"]]
        assert np.array_equal(_bits([v for *_, v in got]), _bits([v for *_, v in want["metrics"]]))
        mwide = run.metrics_wide()
        assert sorted(mwide.columns) == ["opt_steps/voter_lora", "reward/mean", "time/eval_s",
                                         "update_norm/voter_lora"]
        assert list(mwide.index) == sorted({s for s, _, _ in want["metrics"]})
        for s, k, v in want["metrics"]:
            assert _bits(mwide.loc[s, k]) == _bits(v)
        events = run.events
        assert list(events.columns) == ["step", "time", "kind", "severity", "message"]
        assert list(events[["step", "kind", "severity", "message"]].itertuples(index=False, name=None)) \
            == want["events"]

        stats = run.stats()
        assert list(stats.columns[:3]) == ["step", "opt_step", "policy"]
        assert {"total_norm", "share/voter", "share/aggregator", "coherence/voter"} <= set(stats.columns)
        assert len(stats) == want["n"]
        assert np.isnan(stats["total_norm"][4])  # the NaN record: NaN statistics, no exception
        assert np.isfinite(stats["total_norm"].drop(index=4)).all()
        assert np.array_equal(run.read("gram", -3), run.gram[-3:])


def test_plain_h5py_layout(tmp_path: Path) -> None:
    """The layout docs/format.md promises, read without gradscope."""
    path = tmp_path / "run.h5"
    want = write_random_run(path, n=12, flush_every=4)
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "gradscope-run" and f.attrs["schema_version"] == SCHEMA_VERSION
        assert json.loads(f.attrs["agents"]) == AGENTS
        assert json.loads(f.attrs["scalar_names"]) == ["loss", "lr", "kl/voter"]
        assert json.loads(f["steps/scalars"].attrs["names"]) == ["loss", "lr", "kl/voter"]
        assert f["steps/gram"].shape == (12, 4, 4) and f["steps/gram"].dtype == np.float64
        assert f["steps/group_gram"].shape == (12, 2, 4, 4)
        assert f["steps/tokens"].dtype == np.int64 and f["steps/policy"].dtype == np.int16
        assert f["steps/step"].maxshape == (None,)
        assert list(f["committed"][()]) == [12, len(want["evals"]), len(want["events"]),
                                            len(want["metrics"]), 1]
        assert list(f["committed"].attrs["fields"]) == ["n_steps", "n_evals", "n_events", "n_metrics",
                                                        "closed"]
        assert f["evals"].dtype.names == ("step", "name", "value")
        assert f["metrics"].dtype == f["evals"].dtype and f["metrics"].maxshape == (None,)
        assert f["metrics"].dtype["name"] == np.dtype("S64") and f["metrics"].dtype["value"] == np.float64
        assert f["metrics"][1]["name"] == b"update_norm/voter_lora" and f["metrics"][1]["step"] == 0
        assert f["events"].dtype.names == ("step", "time", "kind", "severity", "message")


def test_minimal_metadata(tmp_path: Path) -> None:
    """No groups, scalars or policies: the optional parts are absent or empty, not errors."""
    path = tmp_path / "min.h5"
    meta = RunMeta(agents=["a"], agent_roles=["solo"])
    with RunWriter(path, meta, flush_every=3) as w:
        for i in range(4):
            w.log_step(i, [[float(i)]], [i])
    with open_run(path) as run:
        assert run.meta.roles == ["solo"] and run.meta.seed is None
        assert run.group_gram is None
        assert run.scalars.shape == (4, 2)  # step and policy only
        assert list(run.policy) == [None] * 4
        assert run.evals.empty and run.events.empty and run.metrics.empty and run.n_metrics == 0
        assert run.metrics_wide().empty and run.evals_wide().empty
        assert np.array_equal(run.gram[:, 0, 0], [0.0, 1.0, 2.0, 3.0])
    assert "4 complete" in render_info(path)


def test_empty_run(tmp_path: Path) -> None:
    path = tmp_path / "empty.h5"
    RunWriter(path, make_meta()).close()
    with open_run(path) as run:
        assert run.closed and run.n_steps == 0 and run.gram.shape == (0, 4, 4)
        assert run.stats().empty
    assert "0 complete" in render_info(path)


def test_flush_cadence_and_commit_counter(tmp_path: Path) -> None:
    w = RunWriter(tmp_path / "f.h5", make_meta(), flush_every=4)
    gram, tokens = np.eye(4), np.ones(4, dtype=int)
    for i in range(3):
        w.log_step(i, gram, tokens)
    assert (w.n_steps, w.n_committed) == (3, 0)
    w.log_step(3, gram, tokens)
    assert (w.n_steps, w.n_committed) == (4, 4)
    w.log_step(4, gram, tokens)
    w.flush()
    assert w.n_committed == 5
    w.close()
    w.close()  # idempotent
    assert w.closed
    with pytest.raises(ValueError, match="closed"):
        w.log_step(5, gram, tokens)
    with open_run(tmp_path / "f.h5") as run:
        assert run.n_steps == 5 and run.closed


def test_exception_in_block_still_closes(tmp_path: Path) -> None:
    path = tmp_path / "interrupted.h5"
    with pytest.raises(KeyboardInterrupt):
        with RunWriter(path, make_meta(), flush_every=100) as w:
            for i in range(7):
                w.log_step(i, np.eye(4), np.ones(4, dtype=int))
            raise KeyboardInterrupt
    with open_run(path) as run:
        assert run.closed and run.n_steps == 7


def test_strings_are_truncated_by_rule(tmp_path: Path) -> None:
    path = tmp_path / "strings.h5"
    long_name = "x" * 70
    message = "é" * 200  # 400 UTF-8 bytes; 2-byte characters must not be split
    with RunWriter(path, make_meta()) as w:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            w.log_eval(0, {long_name: 1.0})
            w.log_metrics(0, {long_name: 2.0})
            w.log_event(0, "alert", message, severity="critical")
        assert len(caught) == 3 and all("truncated" in str(c.message) for c in caught)
        assert all(c.filename == __file__ for c in caught)  # the warning points at the caller
    with open_run(path) as run:
        assert run.evals["name"][0] == "x" * 61 + "..."
        assert run.metrics["name"][0] == "x" * 61 + "..."
        got = run.events["message"][0]
        assert got == "é" * 126 + "..." and len(got.encode()) <= 256
        assert run.events["severity"][0] == "critical"


# --- writer validation --------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(gram=np.eye(3)), r"gram must have shape \(4, 4\)"),
    (dict(gram=np.ones((4, 4, 1))), "gram must have shape"),
    (dict(gram="abc"), "gram must be numeric"),
    (dict(tokens=np.ones(5, dtype=int)), r"tokens must have shape \(4,\)"),
    (dict(tokens=[1, 2, -1, 3]), "tokens must be >= 0"),
    (dict(tokens=[1.5, 2, 1, 3]), "whole numbers"),
    (dict(tokens=[float("nan"), 2, 1, 3]), "whole numbers"),  # (no NumPy cast warning before it)
    (dict(scalars={"loss": 1.0, "acc": 2.0}), "undeclared scalar 'acc'"),
    (dict(scalars={"loss": "high"}), "must be a number"),
    (dict(policy="nope"), "unknown policy 'nope'"),
    (dict(group_gram=np.ones((3, 4, 4))), r"group_gram must have shape \(2, 4, 4\)"),
    (dict(step=1.5), "step must be an integer"),
    (dict(opt_step="3"), "opt_step must be an integer"),
])
def test_log_step_validation(tmp_path: Path, kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = dict(step=0, gram=np.eye(4), tokens=np.ones(4, dtype=int))
    args.update(kwargs)
    with RunWriter(tmp_path / "v.h5", make_meta(), flush_every=1) as w:
        # Same scalar names as the "high" case: that one then takes the cached-columns path.
        w.log_step(0, np.eye(4), np.ones(4, dtype=int), scalars={"loss": 0.5})
        with pytest.raises(ValueError, match=match), warnings.catch_warnings():
            warnings.simplefilter("error")
            w.log_step(args.pop("step"), args.pop("gram"), args.pop("tokens"), **args)
    with open_run(tmp_path / "v.h5") as run:
        assert run.n_steps == 1  # the rejected record left no trace


def test_log_metrics_validation(tmp_path: Path) -> None:
    w = RunWriter(tmp_path / "m.h5", make_meta())
    w.log_metrics(0, {"ok": 1})
    with pytest.raises(ValueError, match="metric 'bad' must be a number"):
        w.log_metrics(1, {"fine": 1.0, "bad": "high"})
    with pytest.raises(ValueError, match="eval 'bad' must be a number"):
        w.log_eval(1, {"bad": None})
    with pytest.raises(ValueError, match="step must be an integer"):
        w.log_metrics(1.5, {"x": 1.0})
    w.log_metrics(2, {})  # nothing to log is fine
    w.close()
    with pytest.raises(ValueError, match="log_metrics on a closed RunWriter"):
        w.log_metrics(3, {"x": 1.0})
    with open_run(tmp_path / "m.h5") as run:
        # Rejected calls left no rows, not even the valid entries logged with a bad one.
        assert list(run.metrics.itertuples(index=False, name=None)) == [(0, "ok", 1.0)]


def test_many_pending_rows_are_flushed(tmp_path: Path) -> None:
    """More than 1024 pending metric rows are written without waiting for the next record."""
    path = tmp_path / "many.h5"
    w = RunWriter(path, make_meta(), flush_every=1000)
    w.log_metrics(0, {f"m{j}": float(j) for j in range(1500)})
    assert w.n_committed == 0 and w._tables["metrics"].n == 1500 and not w._tables["metrics"].rows
    w.close()
    with open_run(path) as run:
        assert run.n_metrics == 1500 and run.metrics_wide().shape == (1, 1500)


def test_group_gram_needs_declared_groups(tmp_path: Path) -> None:
    with RunWriter(tmp_path / "g.h5", make_meta(groups=[], group_sizes=[])) as w:
        with pytest.raises(ValueError, match="no parameter groups"):
            w.log_step(0, np.eye(4), np.ones(4, dtype=int), group_gram=np.ones((1, 4, 4)))


@pytest.mark.parametrize("over, match", [
    (dict(agent_roles=["voter"]), "agent_roles has 1 entries"),
    (dict(agents=["a", "a", "b", "c"]), "agents must be unique"),
    (dict(roles=["voter"]), "missing from RunMeta.roles"),
    (dict(group_sizes=[1]), "group_sizes has 1 entries"),
    (dict(config={"f": object()}), "JSON-serialisable"),
    (dict(agents=[], agent_roles=[]), "at least one agent"),
])
def test_meta_validation(over: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_meta(**over)


@pytest.mark.parametrize("over, match", [
    (dict(agents=["a", "b|c", "a|b", "c"]), r"agents must not contain '\|'"),  # cos/a|b|c would be two pairs'
    (dict(agent_roles=["v|w", "v|w", "v|w", "aggregator"], roles=["v|w", "aggregator"]), r"roles must not contain"),
    (dict(policies=["all", "voter"]), r"must not name a policy 'all'"),  # the untagged records' set in analyses
])
def test_a_new_run_refuses_the_pair_separator_in_names(tmp_path: Path, over: dict[str, Any], match: str) -> None:
    """Agents "a", "b|c", "a|b", "c" gave one column cos/a|b|c to two pairs (derive returned 18 columns of 19);
    a file written before the rule still reads."""
    meta = make_meta(**over)
    with pytest.raises(ValueError, match=match):
        RunWriter(tmp_path / "new.h5", meta)
    assert not (tmp_path / "new.h5").exists()


def test_refuses_overwrite_and_bad_paths(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    RunWriter(path, make_meta()).close()
    with pytest.raises(RunFileError, match="already exists"):
        RunWriter(path, make_meta())
    RunWriter(path, make_meta(), overwrite=True).close()
    with pytest.raises(RunFileError, match="cannot create run file"):
        RunWriter(tmp_path / "no" / "such" / "dir.h5", make_meta())
    with pytest.raises(RunFileError, match="is a directory"):
        RunWriter(tmp_path, make_meta(), overwrite=True)
    with pytest.raises(ValueError, match="flush_every"):
        RunWriter(tmp_path / "x.h5", make_meta(), flush_every=0)


def test_versions_do_not_import_torch(tmp_path: Path) -> None:
    """Filling versions and rendering info must not import torch (slow, and not needed)."""
    path = tmp_path / "run.h5"
    write_random_run(path, n=3)
    code = ("import sys; from gradscope.runfile.schema import library_versions; v = library_versions(); "
            "from gradscope.runfile.info import render_info; render_info(sys.argv[1]); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(v)")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         cwd=ROOT, env=_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "python" in out.stdout


# --- resume -------------------------------------------------------------------------------------

STEP_DATASETS = ("step", "opt_step", "policy", "time", "gram", "group_gram", "tokens", "scalars")


def _snapshot(path: Path) -> tuple[RunMeta, dict[str, np.ndarray], dict[str, np.ndarray]]:
    with open_run(path) as run:
        return (run.meta, {name: run.read(name) for name in STEP_DATASETS},
                {t: run.read_table(t) for t in ("evals", "metrics", "events")})


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality, for plain and structured arrays alike."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("keep, flush_every", [(0, None), (9, None), (17, 4), (1000, 3)])
def test_resume_a_closed_run(tmp_path: Path, keep: int, flush_every: int | None) -> None:
    path = tmp_path / "run.h5"
    write_random_run(path)  # 37 records at steps 0..18, explicit opt_steps from record 30 on
    meta, old, old_tables = _snapshot(path)
    kept = old["step"] < keep
    n_kept = int(kept.sum())

    w = RunWriter.resume(path, keep_below_step=keep, flush_every=flush_every)
    assert not Path(str(path) + RESUME_SUFFIX).exists()
    assert w.path == str(path) and w.n_steps == w.n_committed == n_kept
    assert w.flush_every == (flush_every or 5)
    with w:
        for j in range(6):
            w.log_step(keep + j // 2, np.eye(4) * j, np.full(4, j), policy="agg_lora", scalars={"loss": -j})
        w.log_eval(keep, {"accuracy": 0.5})
        w.log_metrics(keep, {"reward/mean": 1.5})
        w.log_event(keep + 1, "alert", "after the resume")

    with open_run(path) as run:
        assert run.closed and run.n_steps == n_kept + 6
        assert run.meta == dataclasses.replace(meta, flush_every=flush_every or 5)
        for name, values in old.items():  # kept records: bit for bit, opt_step and time included
            assert _same(run.read(name)[:n_kept], values[kept]), name
        assert list(run.step[n_kept:]) == [keep + j // 2 for j in range(6)]
        assert list(run.policy[n_kept:]) == ["agg_lora"] * 6
        last_opt = int(old["opt_step"][kept][-1]) if n_kept else -1
        assert list(run.opt_step[n_kept:]) == list(range(last_opt + 1, last_opt + 7))  # continuous
        old_events = old_tables["events"]
        t_kept = max([0.0, *old["time"][kept], *old_events["time"][old_events["step"] < keep]])
        assert np.all(np.diff(run.time) >= 0) and np.all(run.time[n_kept:] >= t_kept)
        n_rows = {}
        for t, table in old_tables.items():  # kept rows bit for bit, later ones dropped
            rows = table[table["step"] < keep]
            n_rows[t] = len(rows)
            assert _same(run.read_table(t)[: len(rows)], rows), t
        assert list(run.evals.iloc[n_rows["evals"]:].itertuples(index=False, name=None)) \
            == [(keep, "accuracy", 0.5)]
        assert list(run.metrics.iloc[n_rows["metrics"]:].itertuples(index=False, name=None)) \
            == [(keep, "reward/mean", 1.5)]
        events = run.events.iloc[n_rows["events"]:]
        assert list(events[["step", "kind", "severity"]].itertuples(index=False, name=None)) \
            == [(keep, "resume", "info"), (keep + 1, "alert", "info")]
        message = events["message"].iloc[0]
        assert message.startswith(f"resumed below step {keep}: kept {n_kept} records, dropped {37 - n_kept}; "
                                  f"rows kept/dropped: evals ")
        dropped = {t: len(old_tables[t]) - n_rows[t] for t in n_rows}
        for t in ("evals", "metrics", "events"):
            assert f"{t} {n_rows[t]}/{dropped[t]}" in message, message
        assert events["time"].iloc[0] >= t_kept
    text = render_info(path)
    assert f"{n_kept + 6} complete" in text and "closed cleanly" in text and "reward/mean" in text


def test_resume_repeatedly(tmp_path: Path) -> None:
    """Resume events are rows like any other: a later resume further back drops earlier ones."""
    path = tmp_path / "run.h5"
    write_random_run(path)
    with RunWriter.resume(path, keep_below_step=12) as w:
        w.log_step(12, np.eye(4), np.ones(4, dtype=int))
    with RunWriter.resume(path, keep_below_step=14):
        pass
    with open_run(path) as run:
        assert run.n_steps == 25 and list(run.opt_step[-2:]) == [23, 24]
        resumes = run.events[run.events["kind"] == "resume"]
        assert list(resumes["step"]) == [12, 14]
        assert "kept 25 records, dropped 0" in resumes["message"].iloc[1]
    with RunWriter.resume(path, keep_below_step=5):
        pass
    with open_run(path) as run:
        assert run.n_steps == 10 and list(run.events["kind"]) == ["amplification", "resume"]
        assert "kept 10 records, dropped 15" in run.events["message"].iloc[1]


def _flush_every(path: Path, value: int) -> None:
    with h5py.File(path, "r+") as f:
        f.attrs["flush_every"] = np.int64(value)


@pytest.mark.parametrize("stored, line", [
    (-5, "info: flush every    -5 (invalid: not a number of records >= 1; a resume refuses it)"),
    (10**12, "info: flush every    1000000000000 (invalid: buffers of 424.7 TiB in memory, over the read budget of "
             "256.0 MiB; a resume refuses it)"),
])
def test_an_invalid_stored_flush_every_is_read_but_not_resumed(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch, stored: int,
                                                                line: str) -> None:
    """flush_every only told the writer how often to flush: a damaged one (negative, or more records than the
    buffers' memory allows) is read like any file, with info saying it is invalid; a resume that would take it as
    its records per flush is one line, exit 2, the file unchanged (it was taken silently as 10, or a MemoryError
    traceback); an explicit flush_every resumes it."""
    from gradscope.cli import main

    monkeypatch.setenv("GRADSCOPE_READ_BUDGET", str(256 << 20))
    path = tmp_path / "run.h5"
    write_random_run(path, n=12)
    _flush_every(path, stored)
    before = path.read_bytes()
    with pytest.raises(RunFileError) as raised:
        RunWriter.resume(path, keep_below_step=3)
    message = str(raised.value)
    assert message.startswith(f"{path}: cannot resume: its flush_every attribute is {stored}: ") and \
        message.endswith("; the run file is unchanged (set the attribute to a record count, e.g. 10, to resume it)") \
        and "\n" not in message, message
    assert path.read_bytes() == before and not os.path.exists(str(path) + RESUME_SUFFIX)
    capsys.readouterr()
    assert main(["info", str(path)]) == 0 and main(["analyze", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "info: " + next(ln for ln in out.splitlines() if ln.startswith("flush every")) == line
    with RunWriter.resume(path, keep_below_step=3, flush_every=4) as w:
        assert w.flush_every == 4
    with open_run(path) as run:
        assert run.meta.flush_every == 4 and run.n_steps == 6


def test_a_run_file_that_records_no_flush_every_resumes_with_the_default(tmp_path: Path) -> None:
    """flush_every 0 (RunMeta's default: not recorded) or absent: info shows —, a resume flushes every 10 records."""
    for case in ("zero", "absent"):
        path = tmp_path / f"{case}.h5"
        write_random_run(path, n=12)
        if case == "zero":
            _flush_every(path, 0)
        else:
            with h5py.File(path, "r+") as f:
                del f.attrs["flush_every"]
        assert "flush every    —" in render_info(path).splitlines()
        with RunWriter.resume(path, keep_below_step=3) as w:
            assert w.flush_every == 10
        with open_run(path) as run:
            assert run.meta.flush_every == 10


def test_resume_replaces_a_stale_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    write_random_run(path)
    path.chmod(0o640)
    tmp = Path(str(path) + RESUME_SUFFIX)
    tmp.write_bytes(b"left behind by a resume that was killed")
    RunWriter.resume(path, keep_below_step=5).close()
    assert not tmp.exists() and (path.stat().st_mode & 0o777) == 0o640
    with open_run(path) as run:
        assert run.n_steps == 10 and run.closed


def test_resume_failures_leave_the_original(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "run.h5"
    write_random_run(path)
    original = path.read_bytes()
    tmp = Path(str(path) + RESUME_SUFFIX)

    def assert_intact() -> None:
        assert path.read_bytes() == original
        assert not tmp.exists()

    # Nothing (readable) to resume: one line, nothing created.
    with pytest.raises(RunFileError, match="no such file"):
        RunWriter.resume(tmp_path / "missing.h5", keep_below_step=3)
    bad = tmp_path / "bad.h5"
    bad.write_text("hello\n")
    with pytest.raises(RunFileError, match="not an HDF5 file") as err:
        RunWriter.resume(bad, keep_below_step=3)
    assert "\n" not in str(err.value) and str(bad) in str(err.value)
    cut = tmp_path / "cut.h5"
    cut.write_bytes(original[: len(original) // 2])
    with pytest.raises(RunFileError, match="truncated"):
        RunWriter.resume(cut, keep_below_step=3)
    newer = _modify(path, tmp_path / "v17.h5", _set_attr("schema_version", "1.7"))
    newer_bytes = newer.read_bytes()
    with pytest.raises(RunFileError, match="newer than this gradscope writes"):
        RunWriter.resume(newer, keep_below_step=3)
    assert bad.read_text() == "hello\n" and newer.read_bytes() == newer_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.h5", "cut.h5", "run.h5", "v17.h5"]

    # Bad arguments.
    with pytest.raises(ValueError, match="keep_below_step must be an integer"):
        RunWriter.resume(path, keep_below_step="3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flush_every"):
        RunWriter.resume(path, keep_below_step=3, flush_every=0)
    assert_intact()

    # The temporary path is taken by a directory (not ours to remove).
    tmp.mkdir()
    with pytest.raises(RunFileError, match="is a directory"):
        RunWriter.resume(path, keep_below_step=3)
    assert tmp.is_dir() and path.read_bytes() == original
    tmp.rmdir()

    # Failures after the temporary file exists: it is removed, the original is untouched.
    def fail_replace(src: Any, dst: Any) -> None:
        assert Path(src) == tmp and tmp.exists()
        raise OSError(18, "Invalid cross-device link")

    with monkeypatch.context() as m:
        m.setattr(os, "replace", fail_replace)
        with pytest.raises(RunFileError, match="cannot resume, the run file is unchanged .*cross-device"):
            RunWriter.resume(path, keep_below_step=3)
    assert_intact()

    def damaged(self: RunReader, name: str) -> np.ndarray:
        raise RunFileError(f"{self.path}: damaged run file, failed reading /{name}")

    with monkeypatch.context() as m:
        m.setattr(RunReader, "read_table", damaged)
        with pytest.raises(RunFileError, match="damaged run file"):
            RunWriter.resume(path, keep_below_step=3)
    assert_intact()

    def interrupted(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(RunWriter, "log_event", interrupted)
        with pytest.raises(KeyboardInterrupt):
            RunWriter.resume(path, keep_below_step=3)
    assert_intact()

    # And after all that it still resumes.
    RunWriter.resume(path, keep_below_step=3).close()
    with open_run(path) as run:
        assert run.n_steps == 6 and run.events["kind"].tolist() == ["resume"]


# --- gradscope info and malformed files ---------------------------------------------------------


def test_render_info(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    want = write_random_run(path)
    text = render_info(path)
    last_acc = [v for _, name, v in want["evals"] if name == "accuracy"][-1]
    n_metrics = len(want["metrics"])
    for needle in (f"schema {SCHEMA_VERSION}", "closed cleanly", "voter0 (voter)", "aggregator x1", "voter_lora",
                   "layer0 (4,096 params)", "split", "37 complete", "0 .. 18", "loss, lr, kl/voter",
                   f"last accuracy {last_acc:.4g}", "amplification", "total norm", "shares: voter",
                   f"{n_metrics} rows at 18 steps; 4 names: reward/mean, update_norm/voter_lora, "
                   f"opt_steps/voter_lora, time/eval_s"):
        assert needle in text, f"{needle!r} missing from:\n{text}"


def test_render_info_abbreviates_metric_names(tmp_path: Path) -> None:
    path = tmp_path / "many.h5"
    with RunWriter(path, make_meta()) as w:
        w.log_metrics(3, {f"metric{j}": j for j in range(30)})
    line = [ln for ln in render_info(path).splitlines() if ln.startswith("metrics")]
    assert line == ["metrics        30 rows at 1 steps; 30 names: metric0, metric1, metric2, metric3, "
                    "metric4, metric5, metric6, metric7, ... (+22 more)"], line
    RunWriter(tmp_path / "none.h5", make_meta()).close()
    lines = render_info(tmp_path / "none.h5").splitlines()
    assert any(ln.split() == ["metrics", "0", "rows"] for ln in lines)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_render_info_reads_non_finite_statistics_as_missing(tmp_path: Path, bad: float) -> None:
    """A last record whose Gram is non-finite and that has no update attribution, and a non-finite last
    accuracy: every value reads ``—``, as every missing value in ``info`` (the total norm and gradient shares
    were printed ``nan`` beside update shares printed ``—`` on the same line)."""
    path = tmp_path / "bad.h5"
    with RunWriter(path, make_meta(update_unit="role")) as w:
        w.log_step(0, np.eye(4), [1, 1, 1, 1], policy="voter_lora")
        w.log_step(1, np.full((4, 4), bad), [1, 1, 1, 1], policy="voter_lora")  # update=None: NaN
        w.log_eval(1, {"accuracy": bad})
    text = render_info(path)
    lines = {ln[:14].strip(): ln[15:] for ln in text.splitlines()}
    assert lines["last record"] == ("step 1, policy voter_lora: total norm —; shares: voter —, aggregator —; "
                                    "update shares: voter —, aggregator —, unattributed —, weight_decay —"), text
    assert lines["evals"] == "1 rows at 1 steps; last accuracy — at step 1", text
    assert not re.search(r"\b(nan|inf)\b", text, re.IGNORECASE), text


def _modify(src: Path, dst: Path, fn: Any) -> Path:
    dst.write_bytes(src.read_bytes())
    with h5py.File(dst, "r+") as f:
        fn(f)
    return dst


def _set_attr(name: str, value: Any) -> Any:
    def fn(f: h5py.File) -> None:
        f.attrs[name] = value
    return fn


def _del(name: str) -> Any:
    def fn(f: h5py.File) -> None:
        if name in f:
            del f[name]
        else:
            del f.attrs[name]
    return fn


def _short_committed(f: h5py.File) -> None:
    """/committed of four counters, as before /metrics existed."""
    del f["committed"]
    f["committed"] = np.array([200, 0, 0, 1], "<i8")


def _three_agents(f: h5py.File) -> None:
    """Metadata that is consistent in itself but disagrees with the datasets' record shapes."""
    f.attrs["agents"] = json.dumps(["a", "b", "c"])
    f.attrs["agent_roles"] = json.dumps(["r", "r", "r"])
    f.attrs["roles"] = json.dumps(["r"])


# case -> (file builder, words the error line must contain)
BAD_FILES: dict[str, tuple[Any, str]] = {
    "nonexistent": (lambda good, d: d / "nope.h5", "no such file"),
    "text": (lambda good, d: (d / "t.h5").write_text("hello\n") and d / "t.h5", "not an HDF5 file"),
    "empty": (lambda good, d: (d / "e.h5").write_bytes(b"") or d / "e.h5", "not an HDF5 file"),
    "truncated": (lambda good, d: (d / "cut.h5").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
                  and d / "cut.h5", "truncated"),
    "plain_hdf5": (lambda good, d: h5py.File(d / "plain.h5", "w").close() or d / "plain.h5",
                   "not a gradscope run file"),
    "wrong_format": (lambda good, d: _modify(good, d / "fmt.h5", _set_attr("format", "other")),
                     "not a gradscope run file"),
    "missing_version": (lambda good, d: _modify(good, d / "nover.h5", _del("schema_version")),
                        "schema_version"),
    "unparseable_version": (lambda good, d: _modify(good, d / "bad.h5", _set_attr("schema_version", "banana")),
                            "unparseable schema_version"),
    "one_part_version": (lambda good, d: _modify(good, d / "one.h5", _set_attr("schema_version", "1")),
                         "unparseable schema_version"),
    "newer_major": (lambda good, d: _modify(good, d / "v2.h5", _set_attr("schema_version", "2.0")),
                    "newer"),
    "missing_dataset": (lambda good, d: _modify(good, d / "nogram.h5", _del("steps/gram")),
                        "missing required datasets: /steps/gram"),
    "missing_committed": (lambda good, d: _modify(good, d / "nocommit.h5", _del("committed")),
                          "missing required datasets: /committed"),
    "missing_metrics": (lambda good, d: _modify(good, d / "nometrics.h5", _del("metrics")),
                        "missing required datasets: /metrics"),
    "short_committed": (lambda good, d: _modify(good, d / "short.h5", _short_committed),
                        "/committed has shape (4,), expected (5,)"),
    "bad_metadata": (lambda good, d: _modify(good, d / "json.h5", _set_attr("agents", "[not json")),
                     "invalid run metadata"),
    # (a traceback, exit 1, from info, compare and table)
    "versions_not_an_object": (lambda good, d: _modify(good, d / "vers.h5", _set_attr("versions", '"abc"')),
                               "RunMeta.versions must be a mapping"),
    "config_not_an_object": (lambda good, d: _modify(good, d / "conf.h5", _set_attr("config", "[1, 2]")),
                             "RunMeta.config must be a mapping"),
    "wrong_record_shape": (lambda good, d: _modify(good, d / "k.h5", _three_agents),
                           "has record shape"),
}


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Run ``gradscope info`` on every bad file at once (subprocesses in parallel: fast)."""
    d = tmp_path_factory.mktemp("bad")
    good = d / "good.h5"
    write_random_run(good, n=200, flush_every=10)
    paths = {case: build(good, d) for case, (build, _) in BAD_FILES.items()}
    paths["newer_minor"] = _modify(good, d / "v17.h5", _set_attr("schema_version", "1.7"))
    procs = {case: subprocess.Popen([sys.executable, "-m", "gradscope.cli", "info", str(p)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=ROOT, env=_env())
             for case, p in paths.items()}
    results = {}
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=60)
        results[case] = (paths[case], subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_is_one_line_error(cli_results: dict[str, Any], case: str) -> None:
    path, res = cli_results[case]
    assert "Traceback" not in res.stdout + res.stderr, res.stderr
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradscope: error:"), res.stderr
    assert str(path) in lines[0] and BAD_FILES[case][1] in lines[0], lines[0]


def test_newer_minor_version_is_read(cli_results: dict[str, Any]) -> None:
    _, res = cli_results["newer_minor"]
    assert res.returncode == 0, res.stderr
    assert "schema 1.7" in res.stdout and "200 complete" in res.stdout


def test_open_run_raises_run_file_error(tmp_path: Path) -> None:
    bad = tmp_path / "x.h5"
    bad.write_text("not hdf5")
    with pytest.raises(RunFileError, match="not an HDF5 file"):
        open_run(bad)
    with pytest.raises(RunFileError, match="no such file"):
        RunReader(tmp_path / "missing.h5")


def test_read_table_from_an_offset(tmp_path):
    meta = RunMeta(agents=["a", "b"], agent_roles=["r", "r"], roles=["r"])
    with RunWriter(tmp_path / "t.h5", meta) as w:
        for step in range(5):
            w.log_eval(step, {"accuracy": step / 10})
    with open_run(tmp_path / "t.h5") as run:
        whole = run.read_table("evals")
        assert len(whole) == 5
        np.testing.assert_array_equal(run.read_table("evals", start=2), whole[2:])
        assert len(run.read_table("evals", start=9)) == 0


def test_a_stop_counts_until_a_resume(tmp_path):
    """A run an alert stopped is finished; resumed with more steps and then killed (closed by SIGTERM
    before its end) it is not: the old `stop` event no longer counts (it did, and a sweep skipped it)."""
    path = tmp_path / "run.h5"
    with RunWriter(path, RunMeta(agents=["a"], agent_roles=["solo"], config={"steps": 10})) as w:
        for step in (1, 2):
            w.log_metrics(step, {"x": 1.0})
        w.log_event(2, "stop", "stopped after step 2")
    assert run_progress(path).stopped and run_progress(path).finished()
    with RunWriter.resume(path, keep_below_step=3) as w:
        w.log_metrics(3, {"x": 1.0})
    progress = run_progress(path)
    assert not progress.stopped and progress.unfinished() == "closed at step 3 of 10"
    with RunWriter.resume(path, keep_below_step=4) as w:
        w.log_metrics(4, {"x": 1.0})
        w.log_event(4, "stop", "stopped after step 4")
    assert run_progress(path).finished()


def test_a_diverged_run_is_unfinished_whatever_step_it_reached(tmp_path):
    """A run whose last step's evaluation diverged wrote that step's metrics: it read as finished (a sweep
    skipped it). A resume that then reaches the end finishes it."""
    path = tmp_path / "run.h5"
    with RunWriter(path, RunMeta(agents=["a"], agent_roles=["solo"], config={"steps": 2})) as w:
        for step in (1, 2):
            w.log_metrics(step, {"x": 1.0})
        w.log_event(2, "diverged", "the policy's next-token probabilities are not finite", severity="error")
    progress = run_progress(path)
    assert progress.diverged and not progress.finished()
    assert progress.unfinished() == "diverged (its policy could no longer be sampled)"
    with RunWriter.resume(path, keep_below_step=2) as w:
        w.log_metrics(2, {"x": 1.0})
    assert run_progress(path).finished()


def test_a_run_file_reads_under_another_hdf5_driver(tmp_path):
    """HDF5_DRIVER=stdio: the reader sized reads by the open file's descriptor, which only the default driver
    has (every file read as damaged, 'Bad file descriptor')."""
    path = tmp_path / "run.h5"
    write_random_run(path, n=5)
    code = ("import sys; from gradscope.runfile import open_run\n"
            "with open_run(sys.argv[1]) as run: print(run._f.driver, run.n_steps, run.replaced())")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HDF5_DRIVER": "stdio"})
    assert out.returncode == 0 and out.stdout.split() == ["stdio", "5", "False"], out.stderr
