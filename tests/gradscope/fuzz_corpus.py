"""A seeded corpus of bad inputs for the readers, the command line and the alert-rule parser.

Every case is built from one small valid run file written by ``RunWriter``: cut short, bytes
flipped, wrong schemas, huge declared shapes, NaN/inf values, links and storage that point outside
the file, and paths that are not regular files. ``build_cases`` returns the command lines to run;
``rule_texts`` and ``yaml_files`` feed the rule parser. Used by ``test_fuzz.py``.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from gradscope.runfile import RunMeta, RunWriter
from tests.gradscope.test_runfile import _del, _set_attr

AGENTS = ["voter0", "voter1", "voter2", "aggregator"]
ROLES = ["voter", "voter", "voter", "aggregator"]
STEPS = 24


def write_base(path: Path, seed: int = 0, *, close: bool = True) -> Path:
    """A small IP Voting run: PSD Grams, per-adapter groups, scalars, evaluations that fall off a
    cliff, metrics and one event. ``close=False`` leaves it as a killed writer would."""
    rng = np.random.default_rng(seed)
    meta = RunMeta(agents=AGENTS, agent_roles=ROLES, policies=["voter", "aggregator"],
                   groups=["voter", "aggregator"], group_sizes=[96, 32], scalar_names=["loss", "lr"],
                   config={"workflow": "voting", "task": "math", "policy": "ip", "model": "testbed"},
                   seed=seed, probe_method="split")
    w = RunWriter(path, meta, flush_every=4)
    w.log_eval(0, {"accuracy": 0.4, "length/voter": 12.0})
    for step in range(1, STEPS + 1):
        for policy in ("voter", "aggregator"):
            keep = np.array([(r == policy) for r in ROLES])
            g = rng.normal(size=(4, 8)) * keep[:, None]
            gram = g @ g.T
            w.log_step(step, gram, np.where(keep, 30, 0), policy=policy,
                       group_gram=np.stack([gram * (policy == "voter"), gram * (policy == "aggregator")]),
                       scalars={"loss": float(rng.normal()), "lr": 1e-3})
        w.log_metrics(step, {"update_norm/voter": 0.01, "update_norm/aggregator": 0.02})
        if step % 2 == 0:
            w.log_eval(step, {"accuracy": 0.6 if step < 16 else 0.1})
    w.log_event(STEPS, "alert", "coherence[voter] > 0.75 for 10", severity="warning")
    if close:
        w.close()
    else:  # leave the file as a killed writer does: flushed, never marked closed
        w.flush()
        w._f.close()  # noqa: SLF001 - simulating a crash, not a clean close
    return path


# --- structural damage, applied with h5py to a copy of the base file -------------------------------

def _replace(name: str, data: object, **kw: object) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        del f[name]
        f.create_dataset(name, data=data, **kw)
    return fn


def _committed(*values: int) -> Callable[[h5py.File], None]:
    return _replace("committed", np.array(values, "<i8"))


def _fill(name: str, value: object) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        ds = f[name]
        ds[...] = value
    return fn


def _huge_rows(rows: int) -> Callable[[h5py.File], None]:
    """Every per-record dataset declares ``rows`` records (never written) and /committed agrees."""
    def fn(f: h5py.File) -> None:
        for ds in f["steps"].values():
            ds.resize(rows, axis=0)
        f["committed"][0] = rows
    return fn


def _many_agents(k: int, rows: int = 1) -> Callable[[h5py.File], None]:
    """Metadata for ``k`` agents and datasets of that record shape, chunked and never written."""
    def fn(f: h5py.File) -> None:
        names = [f"a{i}" for i in range(k)]
        f.attrs["agents"] = json.dumps(names)
        f.attrs["agent_roles"] = json.dumps(names)
        f.attrs["roles"] = json.dumps(names)
        f.attrs["groups"] = "[]"
        f.attrs["group_sizes"] = "[]"
        del f["steps/group_gram"]
        for name, shape in (("gram", (k, k)), ("tokens", (k,))):
            dtype = f[f"steps/{name}"].dtype
            del f[f"steps/{name}"]
            f["steps"].create_dataset(name, shape=(rows, *shape), maxshape=(None, *shape), dtype=dtype,
                                      chunks=(1, *(min(d, 64) for d in shape)))
        for name in ("step", "opt_step", "policy", "time", "scalars"):
            f[f"steps/{name}"].resize(rows, axis=0)
        f["committed"][0] = rows
    return fn


def _many_groups(g: int) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        f.attrs["groups"] = json.dumps([f"g{i}" for i in range(g)])
        f.attrs["group_sizes"] = json.dumps([1] * g)
        n = f["steps/gram"].shape[0]
        del f["steps/group_gram"]
        f["steps"].create_dataset("group_gram", shape=(n, g, 4, 4), maxshape=(None, g, 4, 4), dtype="<f8",
                                  chunks=(1, 1, 4, 4))
    return fn


def _compressed_zeros(rows: int) -> Callable[[h5py.File], None]:
    """A gzip-compressed Gram dataset whose ``rows`` records are stored (as zeros) in a few kB."""
    def fn(f: h5py.File) -> None:
        del f["steps/gram"]
        ds = f["steps"].create_dataset("gram", shape=(rows, 4, 4), maxshape=(None, 4, 4), dtype="<f8",
                                       chunks=(65536, 4, 4), compression="gzip", fillvalue=0.0)
        ds[: min(rows, 65536)] = 0.0
        for name in f["steps"]:  # every record dataset: the reader trims to the shortest
            if name != "gram":
                f[f"steps/{name}"].resize(rows, axis=0)
        f["committed"][0] = rows
    return fn


def _link(name: str, link: object) -> Callable[[h5py.File], None]:
    def fn(f: h5py.File) -> None:
        del f[name]
        f[name] = link
    return fn


def _external_storage(target: str) -> Callable[[h5py.File], None]:
    """/steps/gram's raw data kept in another file (HDF5 "external storage")."""
    def fn(f: h5py.File) -> None:
        n = f["steps/gram"].shape[0]
        del f["steps/gram"]
        f["steps"].create_dataset("gram", shape=(n, 4, 4), dtype="<f8", external=[(target, 0, n * 128)])
    return fn


def _virtual(target: str) -> Callable[[h5py.File], None]:
    """/steps/gram as a virtual dataset whose source lives in another file."""
    def fn(f: h5py.File) -> None:
        n = f["steps/gram"].shape[0]
        del f["steps/gram"]
        layout = h5py.VirtualLayout(shape=(n, 4, 4), dtype="<f8")
        layout[:] = h5py.VirtualSource(target, "gram", shape=(n, 4, 4))
        f["steps"].create_virtual_dataset("gram", layout, fillvalue=0.0)
    return fn


def _deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


def structural(fifo: str, other: str) -> dict[str, Callable[[h5py.File], None]]:
    """Named damage functions (``fifo``: a FIFO no one writes; ``other``: another valid run file)."""
    cases: dict[str, Callable[[h5py.File], None]] = {
        "no_format": _del("format"),
        "format_array": _set_attr("format", np.arange(3)),
        "format_other": _set_attr("format", "hdf5-run"),
        "version_2": _set_attr("schema_version", "2.0"),
        "version_0": _set_attr("schema_version", "0.9"),
        "version_int": _set_attr("schema_version", 1),
        "version_array": _set_attr("schema_version", np.array([1, 0])),
        "version_huge": _set_attr("schema_version", "1." + "9" * 5000),
        "agents_not_json": _set_attr("agents", "[voter0"),
        "agents_number": _set_attr("agents", "17"),
        "agents_dict": _set_attr("agents", '{"a": 1}'),
        "agents_empty": _set_attr("agents", "[]"),
        "agents_nested": _set_attr("agents", _deep_json(100_000)),
        "agents_dupes": _set_attr("agents", json.dumps(["v"] * 4)),
        "agents_int_array": _set_attr("agents", np.arange(4)),
        "roles_mismatch": _set_attr("agent_roles", json.dumps(["voter"] * 3)),
        "roles_missing": _set_attr("roles", json.dumps(["voter"])),
        "config_list": _set_attr("config", "[1, 2]"),
        "config_nested": _set_attr("config", '{"a": ' + _deep_json(50_000) + "}"),
        "config_bad_utf8": _set_attr("config", np.void(b"\xff\xfe{}")),
        "seed_text": _set_attr("seed", "zero"),
        "seed_inf": _set_attr("seed", np.inf),
        "seed_nan": _set_attr("seed", np.nan),
        "seed_array": _set_attr("seed", np.arange(5)),
        "flush_every_huge": _set_attr("flush_every", np.float64(1e300)),
        "group_sizes_text": _set_attr("group_sizes", '["x", "y"]'),
        "group_sizes_huge": _set_attr("group_sizes", "[1e400, 2]"),
        "scalar_names_many": _set_attr("scalar_names", json.dumps([f"s{i}" for i in range(5000)])),
        "policies_many": _set_attr("policies", json.dumps([f"p{i}" for i in range(30_000)])),
        "no_agents": _del("agents"),
        "no_steps_group": _del("steps"),
        "no_gram": _del("steps/gram"),
        "no_group_gram": _del("steps/group_gram"),
        "no_evals": _del("evals"),
        "no_committed": _del("committed"),
        "gram_strings": _replace("steps/gram", np.array([b"x" * 8] * 48).reshape(3, 4, 4)),
        "gram_int": _replace("steps/gram", np.ones((48, 4, 4), "<i4"), maxshape=(None, 4, 4)),
        "gram_scalar": _replace("steps/gram", 1.0),
        "gram_compound": _replace("steps/gram", np.zeros((48, 4, 4), [("a", "<f8")])),
        "step_float": _replace("steps/step", np.linspace(0, 1e300, 48)),
        "step_strings": _replace("steps/step", np.array([b"1"] * 48)),
        "tokens_float_nan": _replace("steps/tokens", np.full((48, 4), np.nan)),
        "policy_float": _replace("steps/policy", np.full(48, 0.5)),
        "evals_wrong_dtype": _replace("evals", np.zeros(5, "<f8")),
        "evals_2d": _replace("evals", np.zeros((3, 3), "<f8")),
        "events_missing_field": _replace("events", np.zeros(2, [("step", "<i8")])),
        "metrics_name_int": _replace("metrics", np.zeros(3, [("step", "<i8"), ("name", "<i8"), ("value", "<f8")])),
        "committed_short": _committed(5, 1),
        "committed_float": _replace("committed", np.array([1.5, 2.0, 0.0, 0.0, 1.0])),
        "committed_nan": _replace("committed", np.array([np.nan] * 5)),
        "committed_strings": _replace("committed", np.array([b"a"] * 5)),
        "committed_2d": _replace("committed", np.zeros((5, 5), "<i8")),
        "committed_scalar": _replace("committed", np.int64(3)),
        "committed_negative": _committed(-5, -1, -1, -1, 1),
        "committed_huge": _committed(2**62, 2**62, 2**62, 2**62, 1),
        "committed_int64_min": _committed(-(2**63), 0, 0, 0, 2**63 - 1),
        "rows_1e6": _huge_rows(10**6),
        "rows_1e12": _huge_rows(10**12),
        "agents_20000": _many_agents(20_000),
        "agents_3000_rows_500": _many_agents(3000, rows=500),
        "groups_5000": _many_groups(5000),
        "gzip_zeros_1e7": _compressed_zeros(10**7),
        "gram_nan": _fill("steps/gram", np.nan),
        "gram_inf": _fill("steps/gram", np.inf),
        "gram_neg_inf": _fill("steps/gram", -np.inf),
        "gram_huge": _fill("steps/gram", 1e308),
        "gram_negative": _fill("steps/gram", -1.0),
        "gram_zero": _fill("steps/gram", 0.0),
        "tokens_negative": _fill("steps/tokens", -7),
        "tokens_max": _fill("steps/tokens", np.iinfo(np.int64).max),
        "step_int_max": _fill("steps/step", np.iinfo(np.int64).max),
        "step_int_min": _fill("steps/step", np.iinfo(np.int64).min),
        "step_descending": lambda f: f["steps/step"].__setitem__(slice(None), np.arange(48)[::-1]),
        "step_all_same": _fill("steps/step", 3),
        "policy_out_of_range": _fill("steps/policy", 999),
        "time_nan": _fill("steps/time", np.nan),
        "scalars_inf": _fill("steps/scalars", np.inf),
        "group_gram_nan": _fill("steps/group_gram", np.nan),
        "evals_nan": lambda f: f["evals"].__setitem__("value", np.full(f["evals"].shape, np.nan)),
        "evals_inf": lambda f: f["evals"].__setitem__("value", np.full(f["evals"].shape, np.inf)),
        "evals_step_huge": lambda f: f["evals"].__setitem__("step", np.full(f["evals"].shape, 2**62)),
        "evals_step_negative": lambda f: f["evals"].__setitem__(
            "step", -np.arange(f["evals"].shape[0], dtype=np.int64) * 10**15),
        "evals_name_bad_utf8": lambda f: f["evals"].__setitem__("name", np.full(f["evals"].shape, b"\xff\xfe")),
        "events_message_bad_utf8": lambda f: f["events"].__setitem__(
            "message", np.full(f["events"].shape, b"\xc3" * 256)),
        "metrics_value_nan": lambda f: f["metrics"].__setitem__("value", np.full(f["metrics"].shape, np.nan)),
        "soft_link_loop": _link("steps/gram", h5py.SoftLink("/steps/gram")),
        "soft_link_dangling": _link("steps/gram", h5py.SoftLink("/nowhere")),
        "soft_link_group": _link("steps", h5py.SoftLink("/evals")),
        "external_link_fifo": _link("steps/gram", h5py.ExternalLink(fifo, "/gram")),
        "external_group_fifo": _link("steps", h5py.ExternalLink(fifo, "/steps")),
        "external_committed_urandom": _link("committed", h5py.ExternalLink("/dev/urandom", "/c")),
        "external_link_other_run": _link("steps", h5py.ExternalLink(other, "/steps")),
        "external_link_self": _link("evals", h5py.ExternalLink(".", "/evals")),
        "external_storage_fifo": _external_storage(fifo),
        "external_storage_urandom": _external_storage("/dev/urandom"),
        "virtual_fifo": _virtual(fifo),
        "virtual_other": _virtual(other),
    }
    return cases


# --- the corpus ------------------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    argv: list[str]
    #: exit codes allowed; 0 only where the input is valid
    codes: frozenset[int] = frozenset({0, 2})


def _commands(path: str, base: str, out: Path, rng: random.Random, plot: bool, valid: bool) -> list[list[str]]:
    """What an input goes through: ``info``, one of the other reading commands, now and then a plot
    (a damaged file: any kind; a valid one: the kinds that draw any single run)."""
    cmds = [["info", path], rng.choice([["analyze", path, "--json"], ["compare", base, path],
                                        ["table", path, "--format", rng.choice(["md", "csv", "latex"])],
                                        ["watch", path, "--poll", "0.01", "--idle", "0.05"]])]
    if plot:
        kind = rng.choice(["cliffs", "alignment"] if valid else ["cliffs", "shares", "alignment", "ip-vs-sp", "sweep"])
        runs = [path] if kind in ("shares", "alignment") else [base, path]
        cmds.append(["plot", kind, *runs, "--out", str(out / f"fig{rng.randrange(10**9)}"), "--dpi", "200"])
    return cmds


def build_cases(root: Path, seed: int = 0, n_bytes: int = 60, plot_every: int = 12) -> list[Case]:
    """Write the damaged inputs under ``root`` and return the command lines to run on them."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    base = write_base(root / "base.h5", seed)
    other = write_base(root / "other.h5", seed + 1)
    live = write_base(root / "killed.h5", seed + 2, close=False)
    fifo = root / "fifo"
    os.mkfifo(fifo)
    out = root / "out"
    raw = base.read_bytes()
    inputs: dict[str, Path] = {}

    for name, fn in structural(str(fifo), str(other)).items():
        p = root / f"s_{name}.h5"
        shutil.copyfile(base, p)
        with h5py.File(p, "r+") as f:
            fn(f)
        inputs[name] = p
    for i in range(n_bytes):
        data = bytearray(raw)
        kind = rng.choice(["truncate", "flip", "flip_head", "zero_block", "append"])
        if kind == "truncate":
            data = data[: rng.randrange(len(data))]
        elif kind in ("flip", "flip_head"):
            hi = min(len(data), 4096) if kind == "flip_head" else len(data)
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(hi)] ^= 1 << rng.randrange(8)
        elif kind == "zero_block":
            at = rng.randrange(len(data))
            data[at:at + rng.randint(1, 512)] = bytes(min(512, len(data) - at))[: len(data[at:at + 512])]
        else:
            data += bytes(rng.randrange(256) for _ in range(rng.randint(1, 4096)))
        p = root / f"b{i:03d}_{kind}.h5"
        p.write_bytes(bytes(data))
        inputs[f"bytes{i}_{kind}"] = p

    (root / "dir.h5").mkdir()
    os.symlink(base, root / "link_to_base.h5")
    os.symlink(fifo, root / "link_to_fifo.h5")
    os.symlink(root / "missing.h5", root / "dangling.h5")
    (root / "empty.h5").write_bytes(b"")
    (root / "text.h5").write_text("not a run file\n")
    (root / "urandom_copy.h5").write_bytes(rng.randbytes(8192))
    (root / "sig_then_junk.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + rng.randbytes(4096))
    specials = {"fifo": fifo, "dir": root / "dir.h5", "urandom": Path("/dev/urandom"), "devnull": Path("/dev/null"),
                "link_to_fifo": root / "link_to_fifo.h5", "dangling": root / "dangling.h5",
                "empty": root / "empty.h5", "text": root / "text.h5", "random_bytes": root / "urandom_copy.h5",
                "signature_then_junk": root / "sig_then_junk.h5", "missing": root / "missing.h5"}
    inputs.update(specials)

    cases: list[Case] = []
    for i, (name, p) in enumerate(sorted(inputs.items())):
        for argv in _commands(str(p), str(base), out, rng, plot=i % plot_every == 0, valid=False):
            cases.append(Case(f"{name}:{argv[0]}", argv))
    for name, p in (("valid", base), ("symlink_to_valid", root / "link_to_base.h5"), ("killed", live)):
        for argv in _commands(str(p), str(base), out, rng, plot=name == "valid", valid=True):
            cases.append(Case(f"{name}:{argv[0]}", argv, frozenset({0})))
    cases += flag_cases(str(base), out)
    return cases


#: (flag, values) of every numeric command-line flag with values that must be refused.
BAD_FLAGS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "analyze": (["--window", "--within"], ("0", "-3", "nan", "1e3", "9" * 5000)),
    "analyze ": (["--coherence", "--fraction", "--min-drop", "--min-rel-drop", "--norm-ratio"],
                 ("nan", "inf", "-inf", "-1", "1e400", "x")),
    "analyze  ": (["--share"], ("nan", "inf", "-1e400", "")),
    "compare": (["--window", "--within"], ("0", "-1", "nan")),
    "plot": (["--dpi"], ("100000", "0", "-5", "nan", "1e9")),
    "plot ": (["--smooth", "--window"], ("0", "-2", "nan", "1.5")),
    "watch": (["--poll"], ("0", "-1", "nan", "inf")),
    "watch ": (["--wait", "--idle"], ("-1", "nan", "inf")),
    "demo": (["--steps", "--jobs"], ("0", "-1", "nan")),
}


def flag_cases(base: str, out: Path) -> list[Case]:
    cases = []
    for cmd, (flags, values) in BAD_FLAGS.items():
        cmd = cmd.strip()
        for flag in flags:
            for value in values:
                argv = {"analyze": ["analyze", base], "compare": ["compare", base],
                        "plot": ["plot", "cliffs", base, "--out", str(out / "flag")],
                        "watch": ["watch", base], "demo": ["demo", "--out", str(out / "demo")]}[cmd]
                cases.append(Case(f"flag:{cmd}{flag}={value}", [*argv, f"{flag}={value}"], frozenset({2})))
    return cases


# --- alert rules ------------------------------------------------------------------------------------

_RULE_ATOMS = ["coherence", "share", "acc_drop", "cosine", "nonfinite", "grad_norm", "opt.lr", "eval.",
               "metric.x", "train/accuracy", "[", "]", "(", ")", ":", ",", "*", "|", ">", ">=", "<", "<=",
               "=", "==", "!", "for", "cooldown", "median", "mean", "x", "3x", "0.75", "1e999", "-1e999",
               "nan", "inf", "-0", "0", "1", "10", "99999999999999999999999999", "9" * 5000, "1e-400",
               "warn", "record", "checkpoint", "stop", "voter", "voter0|voter1", "é", "\x00", "\n", "\t",
               "'", '"', "#", "\\", "٣", "𝟙", "ｘ", " "]
VALID_RULES = ["coherence[voter] > 0.75 for 10: warn,stop", "acc_drop > 0.1", "nonfinite",
               "grad_norm[*] > 3x median(50) cooldown 5: record", "cosine[voter0|voter1] >= 0.9",
               "metric.update_norm/voter > 0.01 for 3: checkpoint"]


def rule_texts(seed: int = 0, n: int = 300) -> list[str]:
    """Random token soups and single-edit mutants of valid rules."""
    rng = random.Random(seed)
    out = ["", " ", ":", "for", "x", "[" * 10_000, "coherence[" + "a" * 100_000 + "] > 1"]
    while len(out) < n:
        if rng.random() < 0.5:
            out.append(" ".join(rng.choice(_RULE_ATOMS) for _ in range(rng.randint(1, 12))))
            continue
        text = list(rng.choice(VALID_RULES))
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(text) + 1)
            op = rng.choice(["insert", "delete", "replace"])
            atom = rng.choice(_RULE_ATOMS)
            if op == "insert":
                text[at:at] = list(atom)
            elif op == "delete" and text:
                del text[min(at, len(text) - 1)]
            else:
                text[at:at + 1] = list(atom)
        out.append("".join(text))
    return out


def yaml_files(root: Path, fifo: Path, seed: int = 0) -> list[Path]:
    """Malformed (and a few valid) alert files."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    texts = [
        "", "alerts:", "alerts: 5", "- 5", "- [1, 2]", "- {rule: 5}", "- {rule: acc_drop > 0.1, extra: 1}",
        "- {name: x}", "- {rule: acc_drop > 0.1, name: [1, 2]}", "{a: 1}", "'just a string'", "- null",
        "- !!python/object/apply:os.system ['true']", "- &a [*a]", "key: [unclosed", "\t- tab", "- acc_drop >",
        "- 'coherence[voter] > 1e999'", "- 'acc_drop > 0.1 for 99999999999999999999999'",
        "alerts:\n  - acc_drop > 0.1\n  - bogus rule here", "- " + "[" * 500 + "]" * 500,
        "a: &a [" + ",".join(["*a"] * 8) + "]\nb: &b [" + ",".join(["*a"] * 8) + "]\nc: [" + ",".join(["*b"] * 8) + "]",
        "lol: &l1 [x, x, x, x, x, x, x, x, x]\n" + "\n".join(
            f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(2, 10)) + "\nalerts: [*l9]",
        "- - &l1 [x, x, x, x, x, x, x, x, x]\n" + "".join(  # an alias bomb as the first entry
            f"  - &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]\n" for i in range(2, 10)),
        "- acc_drop > 0.1\n" * 2000, "%YAML 9.9\n---\n- nonfinite", "--- \n- nonfinite\n--- \n- nonfinite",
        "- nonfinite", "alerts:\n  - {rule: 'acc_drop > 0.1', name: cliff}",
    ]
    paths = []
    for i, text in enumerate(texts):
        p = root / f"rules{i:02d}.yaml"
        p.write_text(text)
        paths.append(p)
    for i in range(12):
        p = root / f"rules_bytes{i:02d}.yaml"
        data = bytearray(rng.choice(texts[:-3]).encode() or b"-")
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        p.write_bytes(bytes(data))
        paths.append(p)
    (root / "binary.yaml").write_bytes(b"\xff\xfe\x00\x00" + rng.randbytes(512))
    (root / "folder.yaml").mkdir()
    return [*paths, root / "binary.yaml", root / "folder.yaml", root / "missing.yaml", fifo, Path("/dev/urandom")]
