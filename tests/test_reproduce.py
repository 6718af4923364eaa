"""``sweeps/reproduce.py`` regenerates the tables of docs/reproduction.md from sweep folders: checked on
synthetic sweep folders (run files written with RunWriter, no training)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.figures.conftest import write_run

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def reproduce(tmp_path_factory):
    """The script, its default archive an empty folder: the synthetic folders alone are read (tests of the
    repository's own archive pass --archive)."""
    spec = importlib.util.spec_from_file_location("reproduce", ROOT / "sweeps" / "reproduce.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.ARCHIVE = tmp_path_factory.mktemp("no-archive")
    return module


def sweep_folder(root: Path, name: str, runs: dict[str, dict]) -> None:
    """A folder as ``gradscope sweep`` leaves it: runs/<cell>.h5 and cells.json."""
    (root / name / "runs").mkdir(parents=True)
    for cell, kw in runs.items():
        write_run(root / name / "runs" / f"{cell}.h5", **kw)
    cells = [{"name": c, "run": f"runs/{c}.h5", "axes": {}} for c in runs]
    (root / name / "cells.json").write_text(json.dumps({"config": name, "cells": cells}))
    (root / f"{name}.log").write_text("... sweep output ...\ncpu 3600.0 360.0 wall 9000\n")


#: A run of 40 steps stopped at step 5: 5 steps of 0.2 h rollout + update each. ``kill``: the writer
#: never closes the file; ``term``: it closes it, as on a SIGTERM (closed, yet not finished).
STOPPED = """
import os, sys
from gradscope.runfile import RunMeta, RunWriter
meta = RunMeta(agents=["voter0", "aggregator"], agent_roles=["voter", "aggregator"], policies=["shared"],
               config={"workflow": "voting", "task": "math", "model": "testbed", "policy": "sp",
                       "seed": int(sys.argv[3]), "steps": 40})
w = RunWriter(sys.argv[1], meta, flush_every=1)
for step in range(1, 6):
    w.log_metrics(step, {"time/rollout": 360.0, "time/update": 360.0})
w.flush()
if sys.argv[2] == "term":
    w.close()
os._exit(0)
"""


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sweeps")
    sweep_folder(root, "voting_math_long", {f"{p}_seed{s}": dict(policy=p, seed=s, cliff=(p == "ip" and s == 0))
                                            for p in ("ip", "sp") for s in (0, 1, 2)})
    # a 7th cell killed and an 8th closed early (SIGTERM): listed, in no other table
    manifest = root / "voting_math_long" / "cells.json"
    cells = json.loads(manifest.read_text())
    for seed, how in ((3, "kill"), (4, "term")):
        cells["cells"].append({"name": f"sp_seed{seed}", "run": f"runs/sp_seed{seed}.h5", "axes": {}})
        subprocess.run([sys.executable, "-c", STOPPED, str(root / "voting_math_long" / "runs" / f"sp_seed{seed}.h5"),
                        how, str(seed)], check=True)
    manifest.write_text(json.dumps(cells))
    sweep_folder(root, "workflows_math", {f"evalopt_{p}_seed{s}": dict(policy=p, seed=s, workflow="evalopt")
                                          for p in ("ip", "sp") for s in (0, 1)})
    return root


DOC = """# Reproduction

<!-- table: compute@voting_math_long,workflows_math -->
stale
<!-- /table -->
text between
<!-- table: claim1@workflows_math,voting_math_long -->
<!-- /table -->
<!-- table: claims23@voting_math_long,workflows_math -->
<!-- /table -->
<!-- table: claim4@voting_math_long -->
<!-- /table -->
<!-- table: claim5@voting_math_long -->
<!-- /table -->
<!-- table: mitigations -->
<!-- /table -->
<!-- table: table1.voting_math_long -->
<!-- /table -->
"""


def test_tables_are_regenerated_from_the_folders(reproduce, root, tmp_path):
    doc = tmp_path / "reproduction.md"
    doc.write_text(DOC)
    assert reproduce.main(["--root", str(root), "--check", str(doc)]) == 1
    assert reproduce.main(["--root", str(root), "--write", str(doc)]) == 0
    text = doc.read_text()
    assert "stale" not in text and "text between" in text
    assert reproduce.main(["--root", str(root), "--check", str(doc)]) == 0

    blocks = {m.group("name"): m.group("body") for m in reproduce.BLOCK.finditer(text)}
    # compute: 6 + 4 finished runs, 40 steps each; the killed and the closed-early run listed with their
    # step and 1 step hour each; 2 × 1.1 CPU hours from the logs' time lines
    compute = blocks["compute@voting_math_long,workflows_math"]
    assert "| `sweeps/voting_math_long.yaml` | 6 | 240 | sp_seed3 (5 steps), sp_seed4 (5 steps) | 2.00 | 1.10 |" in compute
    assert "| total | 10 | 400 |  | 2.00 | 2.20 |" in compute
    assert blocks["mitigations"] == "*(not run yet: sweeps/out/voting_math_cliff)*\n"  # an empty block says so
    # claim 1: one row per (workflow, task, model, policy); the cliff run is IP seed 0 and ends below base
    claim1 = blocks["claim1@workflows_math,voting_math_long"]
    assert claim1.count("| voting_math_long | voting | math | testbed | ") == 2
    assert claim1.count("| workflows_math | evalopt | math | testbed | ") == 2
    assert "| IP | 40 | 3 |" in claim1 and "| 2/3 |" in claim1 and "| 3/3 |" in claim1
    assert "Mean Δ > 0 in **" in claim1
    # claims 2-3: IP had one terminal cliff of 3, SP none
    row = next(line for line in blocks["claims23@voting_math_long,workflows_math"].splitlines()
               if line.startswith("| voting_math_long"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[6] == "1/3" and cells[10] == "0/3"
    # claim 4: the voters' coherence under IP; claim 5: SP's dominant role
    assert "| voting_math_long | voting/math | testbed | voter | – | 3 |" in blocks["claim4@voting_math_long"]
    assert "| voting_math_long | voting/math | testbed | – | voter | 3 |" in blocks["claim5@voting_math_long"]
    # Table 1 of a folder: one row per policy, 3 seeds each, the cliff counted
    t1 = blocks["table1.voting_math_long"]
    assert "| voting | math | testbed | IP | 3 |" in t1 and t1.rstrip().endswith("| 0/3 |") and "| 1/3 |" in t1


def test_unknown_table_is_an_error(reproduce, root, tmp_path):
    doc = tmp_path / "r.md"
    doc.write_text("<!-- table: nope -->\n<!-- /table -->\n")
    with pytest.raises(ValueError, match="unknown table 'nope'"):
        reproduce.main(["--root", str(root), "--write", str(doc)])


def test_a_table_can_be_scoped_to_some_sweeps(reproduce, root, tmp_path):
    doc = tmp_path / "r.md"
    doc.write_text("<!-- table: claim1@workflows_math -->\n<!-- /table -->\n<!-- table: claims23 -->\n<!-- /table -->\n"
                   "<!-- table: compute@workflows_math,voting_math_long -->\n<!-- /table -->\n")
    assert reproduce.main(["--root", str(root), "--write", str(doc)]) == 0
    blocks = {m.group("name"): m.group("body") for m in reproduce.BLOCK.finditer(doc.read_text())}
    assert "| workflows_math |" in blocks["claim1@workflows_math"]
    assert "voting_math_long" not in blocks["claim1@workflows_math"]
    # default: every 0.3M sweep (MAIN), three of which this root lacks: no table of the other two
    assert blocks["claims23"] == ("*(not run yet: sweeps/out/voting_math_hot, sweeps/out/voting_math_cliff, "
                                  "sweeps/out/workflows_code)*\n")
    compute = blocks["compute@workflows_math,voting_math_long"]
    assert "voting_math_scale" not in compute and "| total | 10 | 400 |" in compute


@pytest.mark.parametrize("name, message", [("claim1@nope", "unknown sweep 'nope'"),
                                           ("table1.voting_math_long@workflows_math", "has no sweeps to choose"),
                                           ("mitigations@workflows_math", "a table of voting_math_cliff"),
                                           ("claim1@a/b/workflows_math", "unknown sweep 'a/b/workflows_math'")])
def test_a_bad_scope_is_an_error(reproduce, root, tmp_path, name, message):
    doc = tmp_path / "r.md"
    doc.write_text(f"<!-- table: {name} -->\n<!-- /table -->\n")
    with pytest.raises(ValueError, match=message):
        reproduce.main(["--root", str(root), "--write", str(doc)])


def test_another_builds_folders_sit_beside_the_pinned_ones(reproduce, root, tmp_path):
    """BUILD/NAME is sweep NAME's folder under root/BUILD: its own tables, beside (not mixed into) the others."""
    sweep_folder(root / "epyc", "workflows_math", {f"evalopt_ip_seed{s}": dict(policy="ip", seed=s, workflow="evalopt")
                                                   for s in range(3)})
    doc = tmp_path / "r.md"
    doc.write_text("<!-- table: table1.epyc/workflows_math -->\n<!-- /table -->\n"
                   "<!-- table: claim1@epyc/workflows_math -->\n<!-- /table -->\n"
                   "<!-- table: compute@epyc/workflows_math,workflows_math -->\n<!-- /table -->\n"
                   "<!-- table: table1.workflows_math -->\n<!-- /table -->\n")
    assert reproduce.main(["--root", str(root), "--write", str(doc)]) == 0
    blocks = {m.group("name"): m.group("body") for m in reproduce.BLOCK.finditer(doc.read_text())}
    assert "| IP | 3 |" in blocks["table1.epyc/workflows_math"] and "SP" not in blocks["table1.epyc/workflows_math"]
    assert "| IP | 2 |" in blocks["table1.workflows_math"] and "| SP | 2 |" in blocks["table1.workflows_math"]
    assert "| epyc/workflows_math |" in blocks["claim1@epyc/workflows_math"]
    compute = blocks["compute@epyc/workflows_math,workflows_math"]
    assert "| `sweeps/workflows_math.yaml` (epyc) | 3 |" in compute and "| total | 7 |" in compute


def test_only_the_named_blocks_are_rewritten(reproduce, root, tmp_path):
    doc = tmp_path / "r.md"
    doc.write_text("<!-- table: claim1@workflows_math -->\nold\n<!-- /table -->\n<!-- table: claims23 -->\nold\n<!-- /table -->\n")
    assert reproduce.main(["--root", str(root), "--write", str(doc), "--only", "claim1@workflows_math"]) == 0
    blocks = {m.group("name"): m.group("body") for m in reproduce.BLOCK.finditer(doc.read_text())}
    assert "| workflows_math |" in blocks["claim1@workflows_math"] and blocks["claims23"] == "old\n"
    assert reproduce.main(["--root", str(root), "--check", str(doc), "--only", "claim1@workflows_math"]) == 0
    assert reproduce.main(["--root", str(root), "--check", str(doc)]) == 1
    with pytest.raises(ValueError, match="no table block 'claim4'"):
        reproduce.main(["--root", str(root), "--write", str(doc), "--only", "claim4"])


def test_a_table_missing_some_of_its_folders_is_not_rewritten_from_the_others(reproduce, root, tmp_path, capsys):
    """A block that reads a folder the root and the archive lack is never a table of its other folders:
    --write leaves it as it is (or, empty, says which folders were not run) and names it; --check counts it
    as differing unless it says 'not run yet'."""
    doc = tmp_path / "r.md"
    pinned = "| sweep | cell |\n|---|---|\n| voting_math_hot | the pinned row |\n"
    doc.write_text(f"<!-- table: claims23 -->\n{pinned}<!-- /table -->\n<!-- table: compute -->\n<!-- /table -->\n"
                   "<!-- table: claim1@workflows_math -->\n<!-- /table -->\n")
    assert reproduce.main(["--root", str(root), "--write", str(doc)]) == 0
    err = capsys.readouterr().err
    text = doc.read_text()
    blocks = {m.group("name"): m.group("body") for m in reproduce.BLOCK.finditer(text)}
    assert blocks["claims23"] == pinned  # not replaced by the rows of voting_math_long and workflows_math alone
    assert ("claims23: not regenerated, folders missing: voting_math_hot, voting_math_cliff, workflows_code "
            "(left as it was)") in err
    assert blocks["compute"].startswith("*(not run yet: sweeps/out/voting_math_hot,") and "| total |" not in text
    assert "| workflows_math |" in blocks["claim1@workflows_math"]
    assert reproduce.main(["--root", str(root), "--write", str(doc)]) == 0 and doc.read_text() == text
    capsys.readouterr()
    assert reproduce.main(["--root", str(root), "--check", str(doc)]) == 1
    err = capsys.readouterr().err
    assert "claims23: not checked, folders missing: voting_math_hot, voting_math_cliff, workflows_code" in err
    assert "compute:" not in err and "claim1@workflows_math:" not in err
    assert reproduce.main(["--root", str(root), "--check", str(doc), "--only", "compute",
                           "--only", "claim1@workflows_math"]) == 0


def test_only_needs_write_or_check(reproduce, root):
    with pytest.raises(SystemExit) as exit_:
        reproduce.main(["--root", str(root), "--only", "claim1"])
    assert exit_.value.code == 2


def test_a_folder_missing_under_root_is_read_from_the_archive(reproduce, root, tmp_path):
    archive = tmp_path / "results"
    sweep_folder(archive / "epyc", "voting_math_hot", {f"ip_seed{s}": dict(policy="ip", seed=s) for s in range(2)})
    folders = reproduce.Folders(root, archive)
    assert folders.folder("epyc/voting_math_hot") == archive / "epyc" / "voting_math_hot"
    assert len(folders.runs("epyc/voting_math_hot")) == 2
    assert folders.folder("voting_math_long") == root / "voting_math_long"  # root first
    assert "| `sweeps/voting_math_hot.yaml` (epyc) | 2 | 80 | – | 0.00 | 1.10 |" in reproduce.compute(
        folders, ("epyc/voting_math_hot",))
    assert reproduce.Folders(root, None).runs("epyc/voting_math_hot") == ()


def test_the_documents_tables_of_the_kept_folders_match_them(reproduce, tmp_path):
    """Every table of docs/reproduction.md whose sweeps are all kept under sweeps/results is the one those
    folders regenerate (the tables of folders not kept are checked where the sweeps are rerun)."""
    doc = ROOT / "docs" / "reproduction.md"
    kept = []
    archive = ROOT / "sweeps" / "results"
    for m in reproduce.BLOCK.finditer(doc.read_text()):
        name = m["name"]
        sweeps = name.partition("@")[2].split(",") if "@" in name else [name.partition(".")[2]]
        if all((archive / s / "cells.json").is_file() for s in sweeps):
            kept.append(name)
    assert len(kept) >= 26  # the second build's blocks (0.3M, 1.5M and 6M), the fixed code split's, Table 1s
    args = [a for name in kept for a in ("--only", name)]
    assert reproduce.main(["--root", str(tmp_path), "--archive", str(archive), "--check", str(doc), *args]) == 0


def test_figures_of_a_kept_folder_are_drawn_in_a_copy(reproduce, tmp_path):
    """--figures draws a folder read from the archive in a temporary copy: the figure is copied into the
    document's folder, the kept folder gains no figures/."""
    archive, dest = tmp_path / "results", tmp_path / "img"
    sweep_folder(archive / "xeon", "workflows_code", {f"ip_seed{s}": dict(policy="ip", seed=s) for s in range(2)})
    assert reproduce.main(["--root", str(tmp_path / "out"), "--archive", str(archive), "--figures", str(dest)]) == 0
    assert (dest / "delta_workflows_code.png").stat().st_size > 0
    assert not (archive / "xeon" / "workflows_code" / "figures").exists()
