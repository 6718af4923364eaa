"""The run file: round trip, writer validation, malformed files through ``gradscope info``."""
from __future__ import annotations

import dataclasses
import json
import os
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
    """Write ``n`` random records (plus evals and events); return what was logged."""
    meta = meta or make_meta()
    rng = np.random.default_rng(seed)
    K, G = len(meta.agents), len(meta.groups)
    logged: dict[str, list[Any]] = {k: [] for k in
                                    ("step", "opt_step", "policy", "gram", "group_gram", "tokens", "scalars")}
    evals: list[tuple[int, str, float]] = []
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
            if i % 10 == 9:
                w.log_event(i // 2, "amplification", f"coherence {i}", severity="warning")
                events.append((i // 2, "amplification", "warning", f"coherence {i}"))
    return {"meta": meta, "n": n, "evals": evals, "events": events,
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
        assert list(scalars.columns) == meta.scalar_names and len(scalars) == want["n"]
        assert np.array_equal(_bits(scalars.to_numpy()), _bits(want["scalars"]))

        evals = run.evals
        assert list(evals.columns) == ["step", "name", "value"]
        assert list(evals.itertuples(index=False, name=None)) == want["evals"]
        wide = run.evals_wide()
        assert sorted(wide.columns) == ["accuracy", "length/voter"]
        assert list(wide.index) == sorted({s for s, _, _ in want["evals"]})
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
        assert f.attrs["format"] == "gradscope-run" and f.attrs["schema_version"] == "1.0"
        assert json.loads(f.attrs["agents"]) == AGENTS
        assert json.loads(f.attrs["scalar_names"]) == ["loss", "lr", "kl/voter"]
        assert json.loads(f["steps/scalars"].attrs["names"]) == ["loss", "lr", "kl/voter"]
        assert f["steps/gram"].shape == (12, 4, 4) and f["steps/gram"].dtype == np.float64
        assert f["steps/group_gram"].shape == (12, 2, 4, 4)
        assert f["steps/tokens"].dtype == np.int64 and f["steps/policy"].dtype == np.int16
        assert f["steps/step"].maxshape == (None,)
        assert list(f["committed"][()]) == [12, len(want["evals"]), len(want["events"]), 1]
        assert f["evals"].dtype.names == ("step", "name", "value")
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
        assert run.scalars.shape == (4, 0)
        assert list(run.policy) == [None] * 4
        assert run.evals.empty and run.events.empty
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
            w.log_event(0, "alert", message, severity="critical")
        assert len(caught) == 2 and all("truncated" in str(c.message) for c in caught)
    with open_run(path) as run:
        assert run.evals["name"][0] == "x" * 61 + "..."
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
        with pytest.raises(ValueError, match=match):
            w.log_step(args.pop("step"), args.pop("gram"), args.pop("tokens"), **args)
    with open_run(tmp_path / "v.h5") as run:
        assert run.n_steps == 1  # the rejected record left no trace


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


# --- gradscope info and malformed files ---------------------------------------------------------


def test_render_info(tmp_path: Path) -> None:
    path = tmp_path / "run.h5"
    want = write_random_run(path)
    text = render_info(path)
    last_acc = [v for _, name, v in want["evals"] if name == "accuracy"][-1]
    for needle in ("schema 1.0", "closed cleanly", "voter0 (voter)", "aggregator x1", "voter_lora",
                   "layer0 (4,096 params)", "split", "37 complete", "0 .. 18", "loss, lr, kl/voter",
                   f"last accuracy {last_acc:.4g}", "amplification", "total norm", "shares: voter"):
        assert needle in text, f"{needle!r} missing from:\n{text}"


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
    "bad_metadata": (lambda good, d: _modify(good, d / "json.h5", _set_attr("agents", "[not json")),
                     "invalid run metadata"),
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
