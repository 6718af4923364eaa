"""Regenerates every table of docs/reproduction.md from the sweep folders.

    python sweeps/reproduce.py                      # print every table
    python sweeps/reproduce.py --write docs/reproduction.md
    python sweeps/reproduce.py --check docs/reproduction.md   # exit 1 if a table differs or lacks a folder
    python sweeps/reproduce.py --write docs/reproduction.md --only table1.voting_math_scale  # that block only
    python sweeps/reproduce.py --figures docs/img/reproduction   # redraw FIGURES' folders' figures, copy the doc's

A table lives in the document between the lines ``<!-- table: NAME -->`` and ``<!-- /table -->``;
``--write`` replaces each block's content with the table regenerated from the folders under
``--root`` (default ``sweeps/out``, where ``gradscope sweep sweeps/NAME.yaml`` writes
``sweeps/out/NAME``); a folder missing there is read from ``sweeps/results`` (:data:`ARCHIVE`), where the
repository keeps sweep folders small enough to commit. ``NAME@A,B`` computes table ``NAME`` over
the sweeps ``A`` and ``B`` only (the scales section: ``claim1@voting_math_scale``); a plain ``NAME`` over
its default sweeps (:data:`DEFAULTS`: :data:`MAIN`, the 0.3M sweeps; ``compute``: :data:`SWEEPS`;
``table1.NAME``: NAME). A sweep named ``BUILD/NAME`` is the folder ``root/BUILD/NAME``: sweep NAME run from
another build of the warm start (another machine's), kept beside the pinned build's (``table1.BUILD/NAME``,
``claim1@BUILD/A,BUILD/B``, ``mitigations@BUILD/voting_math_cliff``).

A table is computed from all of its sweeps' folders or not at all. A folder is missing when the one
read (``--root``'s, else the archive's) does not exist or holds no finished run; a block that reads a
missing folder is never rewritten from its other folders:

* ``--write`` leaves such a block as the document has it and names it, with its missing folders, on
  stderr (exit 0). Only a block that is empty, or that already holds the line
  ``*(not run yet: sweeps/out/A, ...)*``, gets that line, naming the missing folders.
* ``--check`` (exit 0 or 1) compares every block with what its folders regenerate; a block with a missing
  folder matches only if it holds that ``not run yet`` line, naming the same folders. So it exits 0 only when every block it
  looks at was regenerated from all of its folders and is the same, or says which folders were not
  run; it names on stderr each block that differs, and why (a folder missing, or another table).
* With neither, each table is printed, or that line for a table with a missing folder.

``--only BLOCK`` limits ``--write`` or ``--check`` to the blocks named (the others are neither
rewritten nor checked).
"""
from __future__ import annotations

import argparse
import contextlib
import re
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from gradscope.alerts import DEFAULT_RULES, parse_rule
from gradscope.analyses.report import AnalysisConfig, analyze_series
from gradscope.analyses.series import RunSeries
from gradscope.errors import GradscopeError
from gradscope.figures import data
from gradscope.figures.sweepdir import folder_runs
from gradscope.figures.table import cell_table, format_cell_table, summary_table
from gradscope.runfile.progress import run_progress

HERE = Path(__file__).resolve().parent
#: The 0.3M sweeps behind the document's claim tables, in the order the document uses them.
MAIN = ("voting_math_long", "voting_math_hot", "voting_math_cliff", "workflows_math", "workflows_code")
#: Every sweep behind the document (the compute table, the per-sweep Table 1s, the figures).
SWEEPS = (*MAIN, "voting_math_scale", "voting_math_scale6")
#: The sweeps of claim 1's default table (the ones whose cells run at the testbed's default lr).
CLAIM1 = ("workflows_math", "workflows_code", "voting_math_long")
#: The sweeps a table reads when its block names none (``NAME`` without ``@``; ``table1.NAME``: NAME).
DEFAULTS = {"compute": SWEEPS, "claim1": CLAIM1, "claims23": MAIN, "claim4": MAIN, "claim5": MAIN, "leads": MAIN,
            "mitigations": ("voting_math_cliff",)}
#: Sweep folders kept in the repository (run files and manifest only, see sweeps/results/README.md): read where
#: ``--root`` lacks the folder.
ARCHIVE = HERE / "results"
#: The coherence of independent agents of a 3-agent role, 1/√3.
INDEPENDENT = 1 / np.sqrt(3)
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w.@,/-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def sweep_of(name: str) -> str | None:
    """The sweep (one of :data:`SWEEPS`) of a folder name ``NAME`` or ``BUILD/NAME``; None if it names none."""
    build, _, sweep = name.rpartition("/")
    return sweep if sweep in SWEEPS and (not build or re.fullmatch(r"[\w.-]+", build)) else None


class Folders:
    """The runs of the sweep folders under ``root``, or else under ``archive`` (loaded once)."""

    def __init__(self, root: Path, archive: Path | None = ARCHIVE) -> None:
        self.root, self.archive = root, archive

    def folder(self, name: str) -> Path:
        """``root/name``, else ``archive/name`` where only that exists."""
        if not (self.root / name).is_dir() and self.archive is not None and (self.archive / name).is_dir():
            return self.archive / name
        return self.root / name

    @lru_cache(maxsize=None)
    def runs(self, name: str) -> tuple[RunSeries, ...]:
        folder = self.folder(name)
        if not folder.is_dir():
            return ()
        return tuple(data.load(p)[0] for p in folder_runs(folder))

    @lru_cache(maxsize=None)
    def report(self, name: str, index: int):
        return analyze_series(self.runs(name)[index], AnalysisConfig())

    @lru_cache(maxsize=None)
    def unfinished(self, name: str) -> tuple[tuple[str, RunSeries, int], ...]:
        """(cell, run, last training step) of the runs of a folder that did not finish (killed, or closed
        by a SIGTERM before their last step)."""
        folder = self.folder(name)
        if not folder.is_dir():
            return ()
        done = set(folder_runs(folder))
        out = []
        for p in folder_runs(folder, finished_only=False):
            if p not in done:
                with contextlib.suppress(GradscopeError):
                    out.append((p.stem, data.load(p)[0], run_progress(p).last_step))
        return tuple(out)

    def reports(self, name: str) -> list:
        return [self.report(name, i) for i in range(len(self.runs(name)))]


def _missing(names: tuple[str, ...] | list[str], folders: Folders) -> str | None:
    gone = [n for n in names if not folders.runs(n)]
    return f"*(not run yet: {', '.join(f'sweeps/out/{n}' for n in gone)})*\n" if gone else None


#: A block that says its folders were not run (what :func:`_missing` writes).
NOT_RUN = re.compile(r"\*\(not run yet: [^\n]*\)\*\n?")


def block_sweeps(block: str) -> tuple[str, ...] | None:
    """The sweep folders a table block (``NAME``, ``NAME@A,B``, ``table1.NAME``) reads; None for a table
    without known defaults."""
    name, _, scope = block.partition("@")
    if scope:
        return tuple(scope.split(","))
    if name.startswith("table1."):
        return (name.removeprefix("table1."),)
    return DEFAULTS.get(name)


def _pm(values) -> str:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if not len(v):
        return "–"
    return f"{v.mean():.3f} ± {v.std(ddof=1):.3f}" if len(v) > 1 else f"{v.mean():.3f}"


def _num(v) -> str:
    return "–" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:g}"


def _md(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def _variant(s: RunSeries) -> str:
    c = data.flat_config(s)
    parts = []
    if str(c.get("kl_coef", 0)) not in ("0", "0.0"):
        parts.append(f"KL {c['kl_coef']}")
    if str(c.get("coherence_reg", 0)) not in ("0", "0.0"):
        parts.append(f"coherence {c['coherence_reg']}")
    if c.get("role_balance", "none") != "none":
        parts.append(f"balance {c['role_balance']}")
    return ", ".join(parts) or "none"


# ------------------------------------------------------------------ tables
def table1(name: str):
    def make(folders: Folders) -> str:
        runs = folders.runs(name)
        if not runs:
            return _missing([name], folders)
        extra = data.varying_keys(runs, exclude=("seed",))
        keys = ["workflow", "task", "model", "policy", *extra]
        return format_cell_table(cell_table(summary_table(runs, extra), keys), keys, "md")
    return make


def compute(folders: Folders, names: tuple[str, ...] = SWEEPS) -> str:
    """Runs, training steps and compute of every sweep. Finished runs are the ones every other table
    holds; a run killed before its end (run file never closed) is listed with the step it reached and
    left out of the other tables. Step hours: the run files' ``time/rollout + time/update`` summed over
    every run, finished or not (one process with one torch thread each; evaluations not included).
    CPU hours: the sweep log's ``/usr/bin/time`` line(s), when the sweep ran to its end under it."""
    rows, total_cpu, total_hours = [], 0.0, 0.0
    for name in names:
        runs = folders.runs(name)
        killed = folders.unfinished(name)
        hours = sum(_step_seconds(s) for s in (*runs, *(s for _, s, _ in killed))) / 3600
        total_hours += hours
        log = folders.folder(name).with_name(f"{Path(name).name}.log")
        cpu = None
        if log.is_file():
            found = re.findall(r"cpu ([\d.]+) ([\d.]+) wall ([\d.]+)", log.read_text(errors="replace"))
            if found:
                cpu = sum(float(u) + float(s) for u, s, _ in found) / 3600
                total_cpu += cpu
        steps = sum(int(s.steps[-1]) if len(s.steps) else 0 for s in runs)
        gone = ", ".join(f"{cell} ({step} steps)" for cell, _, step in killed) or "–"
        build = name.rpartition("/")[0]
        rows.append([f"`sweeps/{sweep_of(name)}.yaml`" + (f" ({build})" if build else ""), len(runs), steps, gone,
                     f"{hours:.2f}",
                     "–" if cpu is None else f"{cpu:.2f}"])
    rows.append(["total", sum(r[1] for r in rows), sum(r[2] for r in rows), "", f"{total_hours:.2f}",
                 f"{total_cpu:.2f}"])
    return _md(["sweep", "finished runs", "training steps", "killed before the end (steps reached)",
                "step hours", "CPU hours (sweep log)"], rows)


def _step_seconds(s: RunSeries) -> float:
    m = s.metrics
    return float(sum(m[c].sum() for c in ("time/rollout", "time/update") if c in m.columns))


def claim1(folders: Folders, names: tuple[str, ...] = CLAIM1) -> str:
    """Does MARL beat the base model? Per cell (policy at default settings): Δ = final − base."""
    rows, beats, cells = [], 0, 0
    for name in names:
        runs = [s for s in folders.runs(name) if _variant(s) == "none"]
        groups: dict[tuple, list[RunSeries]] = {}
        for s in runs:
            d = data.describe(s)
            groups.setdefault((d["workflow"], d["task"], d["model"], d["policy"]), []).append(s)
        for (wf, task, model, policy), ss in groups.items():
            t = summary_table(ss)
            delta, peak = t["delta"].astype(float), (t["peak"] - t["base"]).astype(float)
            cells += 1
            beats += bool(delta.mean() > 0)
            rows.append([name, wf, task, model, policy.upper(), int(ss[0].steps[-1]), len(ss), _pm(t["base"]),
                         _pm(delta), f"{int((delta > 0).sum())}/{len(ss)}", _pm(peak)])
    if not rows:
        return _missing(names, folders)
    out = _md(["sweep", "workflow", "task", "model", "policy", "steps", "seeds", "base", "Δ final − base",
               "seeds Δ > 0", "peak − base"], rows)
    return out + f"\nMean Δ > 0 in **{beats} of {cells}** cells.\n"


def _drop_before(acc: pd.Series, until: int) -> float:
    """Largest fall of the accuracy below its running peak among evaluations at steps ≤ ``until``."""
    a = acc[acc.index <= until].to_numpy(dtype=float)
    return float(np.max(np.maximum.accumulate(a) - a)) if len(a) else np.nan


def claims23(folders: Folders, names: tuple[str, ...] = MAIN) -> str:
    """IP vs SP: peak, final, cliff rate, the largest early drop (first half of the run)."""
    rows = []
    for name in names:
        runs = [s for s in folders.runs(name) if _variant(s) == "none"]
        groups: dict[tuple, dict[str, list[RunSeries]]] = {}
        for s in runs:
            d = data.describe(s)
            lr = data.flat_config(s).get("lr")
            groups.setdefault((d["workflow"], d["task"], d["model"], lr), {}).setdefault(d["policy"], []).append(s)
        for (wf, task, model, lr), by in groups.items():
            if not {"ip", "sp"} <= set(by):
                continue
            cells = []
            for policy in ("ip", "sp"):
                ss = by[policy]
                t = summary_table(ss)
                half = int(ss[0].steps[-1]) // 2
                early = [_drop_before(s.accuracy, half) for s in ss]
                cliffs = int(sum(bool(c) for c in t["cliff"].dropna()))
                cells += [_pm(t["peak"]), _pm(t["final"]), f"{cliffs}/{len(ss)}", _pm(early)]
            rows.append([name, f"{wf}/{task}", model, _num(lr), *cells])
    if not rows:
        return _missing(names, folders)
    return _md(["sweep", "cell", "model", "lr", "IP peak", "IP final", "IP cliffs", "IP early drop",
                "SP peak", "SP final", "SP cliffs", "SP early drop"], rows)


def claim4(folders: Folders, names: tuple[str, ...] = MAIN) -> str:
    """Same-role amplification under IP: coherence of the multi-agent roles, and the update channel."""
    rows = []
    for name in names:
        for i, s in enumerate(folders.runs(name)):
            d = data.describe(s)
            if d["policy"] != "ip" or _variant(s) != "none":
                continue
            for r, role in enumerate(s.roles):
                if s.n_agents[r] < 2:
                    continue
                coh = s.coherence[:, r]
                coh = coh[np.isfinite(coh)]
                if not len(coh):
                    continue
                q = max(1, len(coh) // 4)
                found = sum(f.kind == "amplification" and f.role == role for f in folders.report(name, i).findings)
                ratio = _update_ratio(s, role)
                rows.append((name, f"{d['workflow']}/{d['task']}", d["model"], role, data.flat_config(s).get("lr"),
                             float(np.median(coh)), float(np.percentile(coh, 90)), float(np.mean(coh > 0.75)),
                             float(np.median(coh[:q])), float(np.median(coh[-q:])), found, ratio))
    if not rows:
        return _missing(names, folders)
    df = pd.DataFrame(rows, columns=["sweep", "cell", "model", "role", "lr", "median", "p90", "above", "first",
                                     "last", "found", "ratio"])
    out = []
    for (sweep, cell, model, role, lr), g in df.groupby(["sweep", "cell", "model", "role", "lr"], sort=False,
                                                        dropna=False):
        out.append([sweep, cell, model, role, _num(lr), len(g), f"{g['median'].mean():.3f}", f"{g['p90'].mean():.3f}",
                    f"{g['above'].mean():.3f}", f"{g['first'].mean():.3f} → {g['last'].mean():.3f}",
                    int(g["found"].sum()), f"{g['ratio'].mean():.2f}" if g["ratio"].notna().any() else "–"])
    return _md(["sweep", "cell", "model", "role", "lr", "runs", "coherence median", "p90", "steps > 0.75",
                "first → last quarter", "amplification findings", "update ratio"], out) + (
        f"\nIndependent agents: coherence 1/√3 = {INDEPENDENT:.3f}. Update ratio: median over steps of the "
        "role's policy `update_rel` over the other policies' median (IP: the role's adapter moves this many "
        "times as far, relative to its norm, per training step).\n")


def _update_ratio(s: RunSeries, role: str) -> float:
    m = s.metrics
    cols = {c.split("/", 1)[1]: m[c].to_numpy(dtype=float) for c in m.columns if c.startswith("update_rel/")}
    if role not in cols or len(cols) < 2:
        return np.nan
    others = np.nanmedian(np.stack([v for p, v in cols.items() if p != role], axis=1), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = cols[role] / others
    ratio = ratio[np.isfinite(ratio)]
    return float(np.median(ratio)) if len(ratio) else np.nan


def claim5(folders: Folders, names: tuple[str, ...] = MAIN) -> str:
    """SP capture: the dominant role's contribution, token and per-token shares; capture findings."""
    rows = []
    for name in names:
        for i, s in enumerate(folders.runs(name)):
            d = data.describe(s)
            if d["policy"] != "sp" or _variant(s) != "none" or not s.shared_sets:
                continue
            st = s.set_stats(next(iter(s.shared_sets)))
            share = np.nanmedian(st["share"], axis=0)
            j = int(np.nanargmax(share))
            found = [f for f in folders.report(name, i).findings if f.kind == "capture"]
            rows.append((name, f"{d['workflow']}/{d['task']}", d["model"], data.flat_config(s).get("lr"),
                         str(st["roles"][j]), float(share[j]), float(np.nanmedian(st["token_share"][:, j])),
                         float(np.nanmedian(st["per_token_share"][:, j])), len(found),
                         ",".join(sorted({f.evidence["explained_by"] for f in found}))))
    if not rows:
        return _missing(names, folders)
    df = pd.DataFrame(rows, columns=["sweep", "cell", "model", "lr", "role", "share", "tok", "ptok", "n", "why"])
    out = []
    for (sweep, cell, model, lr, role), g in df.groupby(["sweep", "cell", "model", "lr", "role"], sort=False,
                                                        dropna=False):
        out.append([sweep, cell, model, _num(lr), role, len(g), f"{g['share'].mean():.3f}", f"{g['tok'].mean():.3f}",
                    f"{g['ptok'].mean():.3f}", int(g["n"].sum()), ", ".join(sorted({w for w in g["why"] if w})) or "–"])
    return _md(["sweep", "cell", "model", "lr", "dominant role", "runs", "contribution share", "token share",
                "per-token share", "capture findings", "explained by"], out)


#: The default rules, and candidates for an earlier or more specific warning (docs/reproduction.md).
CANDIDATE_RULES = (*DEFAULT_RULES, *(parse_rule(text, name=name) for name, text in (
    ("update-jump", "update_rel[*] > 2x median(20) for 3"),
    ("grad-jump", "grad_norm[*] > 3x median(20) for 3"),
)))


def _early_warning():
    import importlib.util

    spec = importlib.util.spec_from_file_location("alerts_early_warning",
                                                  HERE.parent / "benchmarks" / "alerts_early_warning.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def leads(folders: Folders, names: tuple[str, ...] = MAIN) -> str:
    """Which signal leads the cliffs, by how much, and how often it fires on runs without a cliff:
    every run of every sweep, the alert rules replayed as ``gradscope watch`` would (causal), and the
    analyser's lead indicators (which signal left its pre-peak baseline first)."""
    measure = _early_warning().measure
    rows, signals = [], {}
    for name in names:
        for i, s in enumerate(folders.runs(name)):
            if len(s.accuracy) < 3:
                continue
            report = folders.report(name, i)
            rows.append(measure(s.name, CANDIDATE_RULES, report))
            for f in report.findings:
                if f.kind == "cliff":
                    for lead in f.evidence["lead_indicators"]:  # share[voter@shared] → share[voter]
                        signals.setdefault(re.sub(r"@[^\]]*", "", lead["signal"]), []).append(lead["lead"])
    if not rows:
        return _missing(names, folders)
    cliff = [r for r in rows if r["onset"] is not None]
    healthy = [r for r in rows if r["onset"] is None]
    out = []
    for rule in CANDIDATE_RULES:
        leads_ = [r["onset"] - r["first"][rule.name] for r in cliff if rule.name in r["first"]]
        before = [x for x in leads_ if x >= 0]
        alarms = sum(rule.name in r["first"] for r in healthy)
        out.append([f"`{rule.name}`", f"`{rule.text}`", f"{len(before)}/{len(cliff)}",
                    f"{np.median(before):g}" if before else "–", f"{len(leads_) - len(before)}",
                    f"{alarms}/{len(healthy)}" + (f" ({alarms / len(healthy):.0%})" if healthy else "")])
    table = _md(["rule", "condition", "fired before the onset (cliff runs)", "median lead (steps)",
                 "fired after the onset", "fired on runs without a cliff"], out)
    sig = [[f"`{k}`", len(v), sum(x > 0 for x in v), f"{np.median([x for x in v if x > 0]):g}"
            if any(x > 0 for x in v) else "–"] for k, v in sorted(signals.items(), key=lambda kv: -len(kv[1]))]
    return table + "\n" + _md(["signal (analyser)", "cliff runs where it moved", "... before the onset",
                               "median lead (steps)"], sig)


def mitigations(folders: Folders, names: tuple[str, ...] = ("voting_math_cliff",)) -> str:
    """Each mitigation against none, per policy, over the one sweep that A/B-tests them (voting_math_cliff)."""
    _mitigations_scope(names)
    runs = folders.runs(names[0])
    if not runs:
        return _missing(names, folders)
    groups: dict[tuple, list[RunSeries]] = {}
    for s in runs:
        groups.setdefault((data.policy_of(s), _variant(s)), []).append(s)
    rows = []
    for (policy, variant), ss in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "none", kv[0][1])):
        t = summary_table(ss)
        cliffs = int(sum(bool(c) for c in t["cliff"].dropna()))
        rows.append([policy.upper(), variant, len(ss), f"{cliffs}/{len(ss)}", _pm(t["peak"]), _pm(t["final"]),
                     _pm(t["delta"])])
    return _md(["policy", "mitigation", "seeds", "cliffs", "peak", "final", "Δ final − base"], rows)


def _mitigations_scope(names: tuple[str, ...]) -> None:
    if len(names) != 1 or sweep_of(names[0]) != "voting_math_cliff":
        raise ValueError(f"mitigations is a table of voting_math_cliff (or BUILD/voting_math_cliff), not {','.join(names)}")


TABLES = {
    "compute": compute,
    "claim1": claim1,
    "claims23": claims23,
    "claim4": claim4,
    "claim5": claim5,
    "leads": leads,
    "mitigations": mitigations,
    **{f"table1.{name}": table1(name) for name in SWEEPS},
}


def regenerate(text: str, folders: Folders, extra: dict | None = None, only: set[str] | None = None,
               keep: bool = False, missing: dict | None = None) -> str:
    """The document with every table block replaced, or only the blocks named in ``only`` (unknown
    names or sweeps: ValueError). A block one of whose folders is missing (no finished run under the root
    or the archive) becomes the ``not run yet`` line naming them, never a table of its other folders; with
    ``keep`` (``--write``) it is left as it is unless it is empty or already that line. ``missing``, when
    given, gets block name → (its missing folders, whether the block was left as it is)."""
    tables = {**TABLES, **(extra or {})}
    if only is not None and (absent := only - {m.group("name") for m in BLOCK.finditer(text)}):
        raise ValueError(f"--only: no table block {sorted(absent)[0]!r} in the document")

    def replace(m: re.Match) -> str:
        block = m.group("name")
        if only is not None and block not in only:
            return m.group(0)
        name, _, scope = block.partition("@")
        if name.startswith("table1.") and name not in tables and sweep_of(name.removeprefix("table1.")):
            tables[name] = table1(name.removeprefix("table1."))  # another build's folder
        if name not in tables:
            raise ValueError(f"unknown table {name!r} in the document; known: {', '.join(tables)}")
        names = tuple(scope.split(",")) if scope else None
        if names is not None:
            if unknown := [n for n in names if sweep_of(n) is None]:
                raise ValueError(f"unknown sweep {unknown[0]!r} in table {block!r}; known: {', '.join(SWEEPS)}"
                                 " (or BUILD/NAME)")
            if name.startswith("table1."):
                raise ValueError(f"table {name!r} has no sweeps to choose (in {block!r})")
        if name == "mitigations":
            _mitigations_scope(names or DEFAULTS["mitigations"])
        needed = block_sweeps(block) if name in TABLES or name.startswith("table1.") else None
        if gone := [n for n in needed or () if not folders.runs(n)]:
            body = m.group("body")
            kept = keep and bool(body.strip()) and not NOT_RUN.fullmatch(body)
            if missing is not None:
                missing[block] = (gone, kept)
            return m.group(0) if kept else m.group(1) + _missing(gone, folders) + m.group(4)
        return m.group(1) + (tables[name](folders) if names is None else tables[name](folders, names)) + m.group(4)

    return BLOCK.sub(replace, text)


#: The figures docs/reproduction.md shows: file name there → (sweep folder, figure of its ``figures/``).
FIGURES = {
    "delta_workflows_math.png": ("workflows_math", "delta.png"),
    "delta_workflows_code.png": ("xeon/workflows_code", "delta.png"),  # the split with no held-out prompt trained on
    "ipsp_voting_math_long.png": ("voting_math_long", "ipsp_voting_math_testbed-0.3M.png"),
    "ipsp_voting_math_scale.png": ("voting_math_scale", "ipsp_voting_math_testbed-1.5M.png"),
    "ipsp_voting_math_scale6.png": ("voting_math_scale6", "ipsp_voting_math_testbed-6M.png"),
    "cliffs_voting_math_cliff.png": ("voting_math_cliff", "cliffs.png"),
    "ipsp_voting_math_cliff_balance.png": (
        "voting_math_cliff", "ipsp_voting_math_testbed-0.3M_kl_coef=0.0_coherence_reg=0.0_role_balance=update.png"),
}


def copy_figures(folders: Folders, dest: Path) -> None:
    """Redraw each sweep folder's figures (``gradscope plot sweep``) and copy the document's into ``dest``; a
    folder read from the archive is redrawn in a temporary copy (the kept folders hold no figures)."""
    import shutil
    import tempfile

    from gradscope.figures.sweepdir import write_report

    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        drawn = {}
        for name in sorted({folder for folder, _ in FIGURES.values()}):
            folder = folders.folder(name)
            if not folder.is_dir():
                continue
            if folders.archive is not None and folder == folders.archive / name:
                copy = Path(tmp) / name
                shutil.copytree(folder, copy)
                folder = copy
            write_report(folder)
            drawn[name] = folder
        for target, (name, figure) in FIGURES.items():
            source = drawn[name] / "figures" / figure if name in drawn else folders.folder(name) / "figures" / figure
            if source.is_file():
                shutil.copyfile(source, dest / target)
                print(f"copied {name}/figures/{figure} -> {dest / target}")
            else:
                print(f"not copied: {name}/figures/{figure} (not run yet)", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=HERE / "out", help="folder of the sweep folders (a folder it "
                        "lacks is read from sweeps/results, where the repository keeps some)")
    parser.add_argument("--archive", type=Path, default=ARCHIVE, help="where a folder that --root lacks is read "
                        "from (default: sweeps/results)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", type=Path, help="rewrite the tables of this document in place (a block one of "
                      "whose folders is missing is left as it is, and named on stderr)")
    mode.add_argument("--check", type=Path, help="exit 1 if a table of this document is not the one its folders "
                      "regenerate, or one of its folders is missing (unless the block says 'not run yet')")
    parser.add_argument("--only", metavar="BLOCK", action="append", help="--write/--check only this table block (its "
                        "name as in the document, e.g. claim1@voting_math_scale; repeatable): the others stay as they are")
    parser.add_argument("--figures", type=Path, help="also redraw the sweep folders' figures and copy the "
                        "document's (FIGURES) into this folder")
    args = parser.parse_args(argv)
    if args.only and not (args.write or args.check):
        parser.error("--only needs --write or --check")
    folders = Folders(args.root, args.archive)
    if args.figures:
        copy_figures(folders, args.figures)
    if args.write or args.check:
        doc = args.write or args.check
        old = doc.read_text()
        missing: dict[str, tuple[list[str], bool]] = {}
        new = regenerate(old, folders, only=set(args.only) if args.only else None, keep=bool(args.write),
                         missing=missing)
        if args.write:
            doc.write_text(new)
            for block, (gone, kept) in missing.items():
                print(f"{doc}: {block}: not regenerated, folders missing: {', '.join(gone)} ("
                      + ("left as it was" if kept else "marked 'not run yet'") + ")", file=sys.stderr)
            kept = sum(k for _, k in missing.values())
            print(f"wrote {doc} ({len(BLOCK.findall(new))} tables"
                  + (f"; {kept} left as they were, a folder missing" if kept else "") + ")")
            return 0
        differ = [o["name"] for o, n in zip(BLOCK.finditer(old), BLOCK.finditer(new)) if o["body"] != n["body"]]
        for block in differ:
            why = (f"not checked, folders missing: {', '.join(missing[block][0])}" if block in missing
                   else "differs from the table its folders regenerate")
            print(f"{doc}: {block}: {why}", file=sys.stderr)
        if differ:
            print(f"{doc}: {len(differ)} table(s) differ from the sweep folders' or lack a folder", file=sys.stderr)
            return 1
        print(f"{doc}: every table matches the sweep folders"
              + (f" ({len(missing)} marked 'not run yet')" if missing else ""))
        return 0
    for name, make in TABLES.items():
        gone = [n for n in block_sweeps(name) or () if not folders.runs(n)]
        print(f"<!-- table: {name} -->\n{_missing(gone, folders) if gone else make(folders)}<!-- /table -->\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
