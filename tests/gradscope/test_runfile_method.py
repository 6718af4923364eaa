"""The per-record probe method (``/steps/method``, schema 1.1): written, read, derived into
``probe_method``, carried through resume, and absent from 1.0 files without breaking them."""
from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest

from gradscope.runfile import RunWriter, open_run
from gradscope.runfile.schema import PROBE_METHODS, methods_that_ran
from tests.gradscope.test_runfile import AGENTS, make_meta

K = len(AGENTS)


def write(path: Path, methods: list[str | None], probe_method: str = "hooks+sketch(k=64,seed=0)") -> None:
    with RunWriter(path, make_meta(probe_method=probe_method), flush_every=2) as w:
        for i, method in enumerate(methods):
            w.log_step(i, np.eye(K), np.ones(K, dtype=np.int64), method=method)


def test_methods_round_trip_and_probe_method_names_only_what_ran(tmp_path):
    path = tmp_path / "run.h5"
    write(path, ["hooks+check", "hooks", "split-fallback:per-agent-losses", None])
    with open_run(path) as run:
        assert run.method.tolist() == ["hooks+check", "hooks", "split-fallback:per-agent-losses", None]
        assert run.meta.probe_method == "hooks,split+sketch(k=64,seed=0)"
    with h5py.File(path, "r") as f:
        assert f["steps/method"].dtype == np.int8
        assert f["steps/method"][:].tolist() == [1, 0, 3, -1]
    write(path2 := tmp_path / "fallback.h5", ["split-fallback:check-failed"] * 3, probe_method="hooks")
    with open_run(path2) as run:
        assert run.meta.probe_method == "split"  # hooks was configured but never measured a record


def test_unknown_method_is_refused(tmp_path):
    with RunWriter(tmp_path / "r.h5", make_meta(), flush_every=2) as w:
        with pytest.raises(ValueError, match="unknown probe method 'magic'"):
            w.log_step(0, np.eye(K), np.ones(K), method="magic")
        assert w.n_steps == 0


def test_a_1_0_file_reads_and_resumes(tmp_path):
    """A file of schema 1.0 has no /steps/method: every record reads as not recorded, probe_method is
    the file's own, and resume writes a 1.1 file whose old records stay unrecorded."""
    path = tmp_path / "old.h5"
    write(path, ["hooks"] * 4, probe_method="hooks")
    with h5py.File(path, "r+") as f:
        del f["steps/method"]
        f.attrs["schema_version"] = "1.0"
    with open_run(path) as run:
        assert run.schema_version == "1.0" and not run.has("method")
        assert run.method.tolist() == [None] * 4 and run.meta.probe_method == "hooks"
    with RunWriter.resume(path, keep_below_step=2) as w:
        w.log_step(2, np.eye(K), np.ones(K), method="split")
    with open_run(path) as run:
        assert run.method.tolist() == [None, None, "split"]
        assert run.meta.probe_method == "split"


def test_resume_keeps_the_configured_attribute(tmp_path):
    """Resume copies the stored ``probe_method`` attribute, not the reader's narrowing of it: records a
    resume drops can no longer name their method in it (they did: ``hooks,split`` after dropping split)."""
    path = tmp_path / "run.h5"
    write(path, ["hooks", "split-fallback:mixed-rows"], probe_method="hooks")
    for keep in (1, 0):
        with RunWriter.resume(path, keep_below_step=keep):
            pass
        with h5py.File(path, "r") as f:
            assert f.attrs["probe_method"] == "hooks"
        with open_run(path) as run:
            assert run.meta.probe_method == "hooks" and run.configured_probe_method == "hooks"


def test_codes_are_only_appended():
    """Stored codes are indices: the first eight must never move."""
    assert PROBE_METHODS[:3] == ("hooks", "hooks+check", "split")
    assert methods_that_ran("hooks", np.array([-1, -1])) == "hooks"
    assert methods_that_ran("hooks+ranks(2)", np.array([0, 7, 1])) == "hooks,split+ranks(2)"
