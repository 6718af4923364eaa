"""``gradscope analyze`` and ``gradscope compare`` end to end, in subprocesses, on real run files.

Files are written with ``RunWriter`` from the synthetic generator: a run with a planted cliff (and
the aggregator capturing the shared parameters 5 steps before it), a healthy one, and partial or
malformed ones — a writer SIGKILLed mid-run, one killed before its first flush, no evaluation
records, a single step, NaN Gram entries, an empty (closed, no records) file, a non-HDF5 file and
a missing path. Partial files must give exit 0 and a report whose notes say what could not be
analysed; bad input exits 2 with one line; nothing ever prints a traceback.

Every command runs once, concurrently, in a module fixture; the tests check the results.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.analyses import synthetic as syn

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and SWMR semantics are POSIX")

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["COLUMNS"] = "120"
    return env


def _killed_writer(path: Path, at_least: int, sleep_s: float) -> int:
    """Run the slow synthetic writer in a subprocess and SIGKILL it once it has committed
    ``at_least`` records (0: as soon as the file exists). Returns the last count it reported."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.analyses.synthetic", "slow-writer", str(path),
                             str(sleep_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=_env())
    assert proc.stdout is not None
    reported = 0
    for line in proc.stdout:
        if line.startswith("committed"):
            reported = int(line.split()[1])
        if (line.startswith("ready") and at_least == 0) or reported >= at_least > 0:
            break
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the writer finished before it was killed"
    return reported


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("runs")
    out = {name: d / f"{name}.h5" for name in ("cliff", "healthy", "noevals", "single", "nan", "empty",
                                                "killed", "killed_early", "ip")}
    cliff = syn.cliff_run(0)
    syn.write_run(cliff, out["cliff"])
    syn.write_run(syn.cliff_run(0, cliff=False), out["healthy"])
    syn.write_run(syn.cliff_run(0, policy="ip"), out["ip"])
    syn.write_run(syn.with_evals(cliff, cliff.evals.iloc[:0]), out["noevals"])
    one = syn.make_series(syn.VOTING, 1, seed=0, evals=syn.eval_frame([0], [0.4]), first_step=1)
    syn.write_run(one, out["single"])
    bad = syn.cliff_run(0)
    bad.gram = bad.gram.copy()
    bad.gram[::9, 0, 1] = np.nan
    bad.gram[5::9, 2, 2] = np.inf
    syn.write_run(bad, out["nan"])
    empty = syn.make_series(syn.VOTING, 0, seed=0)
    syn.write_run(empty, out["empty"])
    _killed_writer(out["killed"], 60, 0.01)
    _killed_writer(out["killed_early"], 0, 5.0)  # first flush would be 25 s away: nothing committed
    (d / "not_hdf5.h5").write_text("this is not an HDF5 file\n")
    out["not_hdf5"] = d / "not_hdf5.h5"
    out["missing"] = d / "missing.h5"
    return out


def _commands(f: dict[str, Path]) -> dict[str, list[str]]:
    a = ["analyze"]
    return {
        "text": a + [f["cliff"]],
        "json": a + [f["cliff"], "--json"],
        "md": a + [f["cliff"], "--md"],
        "fail_cliff": a + [f["cliff"], "--fail-on", "cliff"],
        "fail_healthy": a + [f["healthy"], "--fail-on", "cliff,capture,amplification"],
        "fail_loose": a + [f["cliff"], "--fail-on", "cliff", "--min-drop", "0.9"],
        "fail_bogus": a + [f["cliff"], "--fail-on", "bogus"],
        "missing": a + [f["missing"]],
        "not_hdf5": a + [f["not_hdf5"]],
        "killed": a + [f["killed"], "--json"],
        "killed_text": a + [f["killed"]],
        "killed_early": a + [f["killed_early"], "--json"],
        "noevals": a + [f["noevals"], "--json", "--fail-on", "cliff"],
        "single": a + [f["single"], "--json"],
        "single_md": a + [f["single"], "--md"],
        "nan": a + [f["nan"], "--json"],
        "empty": a + [f["empty"]],
        "ip": a + [f["ip"], "--json"],
        "compare": ["compare", f["cliff"], f["healthy"]],
        "compare_md": ["compare", f["cliff"], f["healthy"], f["killed"], "--md"],
        "compare_missing": ["compare", f["cliff"], f["missing"]],
    }


@pytest.fixture(scope="module")
def results(files: dict[str, Path]) -> dict[str, subprocess.CompletedProcess]:
    procs = {name: subprocess.Popen([sys.executable, "-m", "gradscope.cli", *map(str, args)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                    env=_env())
             for name, args in _commands(files).items()}
    out = {}
    deadline = time.monotonic() + 120
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        out[name] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    for name, r in out.items():
        assert "Traceback" not in r.stdout + r.stderr, f"{name}: {r.stderr}"
    return out


def _json(r: subprocess.CompletedProcess) -> dict:
    def no_constant(c: str) -> None:
        raise AssertionError(f"non-standard JSON constant {c}")
    return json.loads(r.stdout, parse_constant=no_constant)


def _ok(r: subprocess.CompletedProcess, code: int = 0) -> None:
    assert r.returncode == code, f"{r.args}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-2000:]}"


def _one_line_error(r: subprocess.CompletedProcess) -> str:
    _ok(r, 2)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gradscope: error: "), r.stderr
    assert r.stdout == ""
    return lines[0]


# ------------------------------------------------------------------ formats
def test_text_report(results) -> None:
    r = results["text"]
    _ok(r)
    text = " ".join(r.stdout.split())  # rich wraps long titles
    assert text.startswith("gradscope analysis of ")
    assert "[critical] cliff: accuracy (median of 3 evaluations) fell" in text and "onset step 120" in text
    assert "'aggregator' dominates the shared parameters 'shared'" in text
    assert "explained by per-token gradient" in text
    assert "first signal: grad_norm[aggregator] 5 steps earlier" in text


def test_json_report(results, files) -> None:
    r = results["json"]
    _ok(r)
    rep = _json(r)
    assert rep["schema"] == "gradscope-report/1"
    assert rep["run"] == str(files["cliff"])
    assert set(rep) == {"schema", "run", "summary", "findings", "notes"}
    s = rep["summary"]
    assert s["workflow"] == "voting" and s["policy"] == "sp" and s["steps"] == 200 and s["records"] == 200
    assert s["roles"] == ["voter", "aggregator"] and s["dominant_share"]["shared"]["role"] in ("voter", "aggregator")
    kinds = {f["kind"]: f for f in rep["findings"]}
    assert set(kinds) == {"cliff", "capture"}
    for f in rep["findings"]:
        assert set(f) == {"kind", "severity", "summary", "onset", "start", "end", "role", "policy", "evidence"}
        assert f["severity"] in ("info", "warning", "critical") and f["start"] <= f["onset"] <= f["end"]
    cliff, capture = kinds["cliff"], kinds["capture"]
    assert cliff["onset"] == 120 and cliff["severity"] == "critical"  # final 0.15 < base 0.3
    assert cliff["evidence"]["lead_indicators"][0] == {**cliff["evidence"]["lead_indicators"][0],
                                                       "signal": "grad_norm[aggregator]", "lead": 5}
    assert capture["role"] == "aggregator" and capture["policy"] == "shared" and capture["onset"] == 115
    assert capture["evidence"]["explained_by"] == "per-token gradient"
    assert rep["notes"] == []


def test_markdown_report(results) -> None:
    r = results["md"]
    _ok(r)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("## gradscope analysis: `")
    assert "| kind | severity | role | steps | finding |" in lines
    assert any(line.startswith("| cliff | critical |") for line in lines)
    assert any(line.startswith("| capture |") and "aggregator" in line for line in lines)
    assert "**cliff** (run) evidence:" in r.stdout


# ------------------------------------------------------------------ exit codes
def test_fail_on(results) -> None:
    _ok(results["fail_cliff"], 1)
    _ok(results["fail_healthy"], 0)
    _ok(results["fail_loose"], 0)   # thresholds are flags: no cliff needs a 0.9 drop
    assert "no pathology found" in results["fail_healthy"].stdout
    assert "bogus" in _one_line_error(results["fail_bogus"])


def test_bad_files_exit_2_with_one_line(results, files) -> None:
    assert str(files["missing"]) in _one_line_error(results["missing"])
    assert "not an HDF5 file" in _one_line_error(results["not_hdf5"])
    assert str(files["missing"]) in _one_line_error(results["compare_missing"])


# ------------------------------------------------------------------ partial and malformed runs
def test_killed_writer(results) -> None:
    r = results["killed"]
    _ok(r)
    rep = _json(r)
    n = rep["summary"]["records"]
    assert 60 <= n < 200 and n % 5 == 0
    assert any("not closed" in note and f"{n} complete records" in note for note in rep["notes"]), rep["notes"]
    _ok(results["killed_text"])
    assert "note: the run file was not closed" in results["killed_text"].stdout


def test_killed_before_the_first_flush(results) -> None:
    r = results["killed_early"]
    _ok(r)
    rep = _json(r)
    assert rep["summary"]["records"] == 0 and rep["findings"] == []
    notes = " | ".join(rep["notes"])
    assert "not closed" in notes and "no gradient records" in notes and "0 accuracy evaluation" in notes


def test_no_eval_records(results) -> None:
    r = results["noevals"]
    _ok(r)  # --fail-on cliff: nothing to fail on, cliff detection did not run
    rep = _json(r)
    assert any("0 accuracy evaluation(s): cliff detection needs at least 3" in n for n in rep["notes"])
    assert "capture" in {f["kind"] for f in rep["findings"]}  # the gradient side is still analysed


def test_single_step(results) -> None:
    rep = _json(results["single"])
    _ok(results["single"])
    notes = " | ".join(rep["notes"])
    assert "only 1 step(s) with gradient records" in notes and "1 accuracy evaluation(s)" in notes
    assert rep["findings"] == [] and rep["summary"]["records"] == 1
    _ok(results["single_md"])
    assert "Not analysed:" in results["single_md"].stdout


def test_nan_gram_entries(results) -> None:
    r = results["nan"]
    _ok(r)
    rep = _json(r)
    bad = len(range(0, 200, 9)) + len(range(5, 200, 9))
    assert any(f"{bad} record(s) with non-finite Gram entries were left out" in n for n in rep["notes"])
    assert {"cliff", "capture"} <= {f["kind"] for f in rep["findings"]}


def test_empty_run(results) -> None:
    r = results["empty"]
    _ok(r)
    assert "note: no gradient records" in r.stdout and "note: 0 accuracy evaluation(s)" in r.stdout


def test_isolated_policy_run(results) -> None:
    rep = _json(results["ip"])
    _ok(results["ip"])
    assert {f["kind"] for f in rep["findings"]} == {"cliff"}  # no shared set: no capture
    assert any("no parameter set is shared" in n for n in rep["notes"])
    assert rep["findings"][0]["evidence"]["lead_indicators"][0]["signal"] == "grad_norm[aggregator]"


# ------------------------------------------------------------------ compare
def test_compare(results, files) -> None:
    r = results["compare"]
    _ok(r)
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3  # header + one row per run
    header = lines[0]
    for col in ("run", "peak", "final", "cliff (onset)", "max coherence", "dominant share"):
        assert col in header
    cliff_row = next(line for line in lines[1:] if line.startswith(str(files["cliff"])))
    healthy_row = next(line for line in lines[1:] if line.startswith(str(files["healthy"])))
    assert "yes (120)" in cliff_row and " no " in f" {healthy_row} "
    # peak/final columns hold the summary's numbers
    rep = _json(results["json"])
    assert f"{rep['summary']['peak']:.3f}" in cliff_row and f"{rep['summary']['final']:.3f}" in cliff_row


def test_compare_markdown(results, files) -> None:
    r = results["compare_md"]
    _ok(r)
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 5 and lines[1].startswith("|---")
    assert lines[0].startswith("| run |") and all(line.startswith("| ") for line in lines[2:])
    assert str(files["killed"]) in lines[4]


# ------------------------------------------------------------------ the file helper itself
@pytest.mark.parametrize("policy", ["sp", "ip"])
def test_write_run_round_trip(tmp_path: Path, policy: str) -> None:
    """``synthetic.write_run`` stores exactly the series: same arrays, same report."""
    from gradscope.analyses.cli import load
    from gradscope.analyses.report import analyze_series

    series = syn.cliff_run(1, policy=policy)
    path = tmp_path / "run.h5"
    syn.write_run(series, path, flush_every=7)
    loaded, closed = load(str(path))
    assert closed
    assert loaded.agents == series.agents and loaded.agent_roles == series.agent_roles
    assert np.array_equal(loaded.gram, series.gram) and np.array_equal(loaded.tokens, series.tokens)
    assert np.array_equal(loaded.record_step, series.record_step)
    assert loaded.record_policy.tolist() == series.record_policy.tolist()
    assert np.allclose(loaded.evals[series.evals.columns].to_numpy(), series.evals.to_numpy())
    assert loaded.evals.index.tolist() == series.evals.index.tolist()
    a, b = analyze_series(loaded), analyze_series(series)
    assert [(f.kind, f.role, f.onset) for f in a.findings] == [(f.kind, f.role, f.onset) for f in b.findings]
