"""The docs against a real run file, and their references.

* Every name in a block marked ``<!-- names: KIND -->`` (the convention of docs/format.md, "Names in
  these docs") exists in the run file a few steps of ``Trainer`` write, as a KIND.
* The "Reading a run" examples of docs/format.md run on that file.
* Wherever the docs or the README name "the paper" they cite it (arXiv 2605.24202) in the same
  paragraph, and they never point outside the repository (the design notes are not shipped).
"""
from __future__ import annotations

import re
from pathlib import Path

import h5py
import pytest

from gradscope.runfile import open_run
from gradscope.trainers.config import TrainConfig
from gradscope.trainers.grpo import GRPOConfig
from gradscope.trainers.train import Trainer

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!--\s*names:\s*([\w:-]+)(?:\s+column\s+(\d+))?\s*-->\s*$")
LIST_ITEM = re.compile(r"^\s*(?:[*+-]|\d+\.)\s")
NAME = re.compile(r"[A-Za-z_/][A-Za-z0-9_/<>|\-]*")
PLACEHOLDER = re.compile(r"<[^<>]+>")
KINDS = ("datasets", "attributes", "scalars", "metrics", "evals", "columns:scalars", "columns:stats",
         "columns:stats-per-step", "columns:evals")


@pytest.fixture(scope="module")
def run_file(tmp_path_factory) -> Path:
    """Two IP training steps of Voting on math, evaluated at every step, with per-adapter Grams and
    update attribution (every optional dataset the docs name)."""
    out = tmp_path_factory.mktemp("docs") / "run.h5"
    cfg = TrainConfig(workflow="voting", task="math", policy="ip", steps=2, tasks_per_step=2, n_train=20,
                      n_held_out=4, eval_every=1, checkpoint_every=0, probe="gram,groups", out=str(out),
                      probe_updates="role", grpo=GRPOConfig(group_size=2))
    Trainer(cfg).run()
    return out


def real_names(path: Path) -> dict[str, set[str]]:
    with h5py.File(path, "r") as f:
        paths = set()
        f.visit(lambda name: paths.add("/" + name))
        attributes = set(f.attrs)
    with open_run(path) as run:
        return {"datasets": paths, "attributes": attributes, "scalars": set(run.meta.scalar_names),
                "metrics": set(run.metrics["name"]), "evals": set(run.evals["name"]),
                "columns:scalars": set(run.scalars.columns), "columns:stats": set(run.stats().columns),
                "columns:stats-per-step": set(run.stats(per="step").columns),
                "columns:evals": set(run.evals.columns) | set(run.metrics.columns)}


def marked_names(text: str) -> list[tuple[str, int, str]]:
    """(kind, line number, token) of every name-like backticked token in a marked block."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        m = MARKER.match(line)
        if not m:
            continue
        kind, column = m.group(1), int(m.group(2) or 1)
        assert kind in KINDS, f"line {i + 1}: unknown names kind {kind!r}"
        block: list[tuple[int, str]] = []
        for j in range(i + 1, len(lines)):
            nxt = lines[j]
            if not nxt.strip() or nxt.lstrip().startswith("#") or MARKER.match(nxt) or \
                    (block and LIST_ITEM.match(nxt)):
                break
            block.append((j + 1, nxt))
        assert block, f"line {i + 1}: a names marker with nothing after it"
        for lineno, text_ in block:
            if text_.lstrip().startswith("|"):  # a table row: one column
                cells = re.split(r"(?<!\\)\|", text_.strip())
                text_ = cells[column].replace("\\|", "|") if column < len(cells) else ""
            for token in re.findall(r"`([^`]+)`", text_):
                if NAME.fullmatch(token) and (kind != "datasets" or token.startswith("/")):
                    out.append((kind, lineno, token))
    return out


def exists(token: str, names: set[str]) -> bool:
    parts = PLACEHOLDER.split(token)
    pattern = "[^/|]+".join(re.escape(p) for p in parts)
    return any(re.fullmatch(pattern, name) for name in names)


def test_every_name_in_the_docs_is_in_a_real_run_file(run_file: Path) -> None:
    names = real_names(run_file)
    checked, missing = [], []
    for doc in DOCS:
        for kind, lineno, token in marked_names(doc.read_text()):
            checked.append(kind)
            if not exists(token, names[kind]):
                missing.append(f"{doc.relative_to(ROOT)}:{lineno}: {kind} {token!r}")
    assert not missing, "names the run file does not have:\n" + "\n".join(missing)
    assert set(checked) == set(KINDS), f"kinds never checked: {set(KINDS) - set(checked)}"
    assert len(checked) >= 60, len(checked)


def test_the_checker_catches_a_wrong_name(run_file: Path) -> None:
    """The convention can fail: a stale name (the old ``eval_accuracy`` metric, ``reward/mean``) or a
    placeholder that matches nothing is reported."""
    names = real_names(run_file)
    doc = "<!-- names: metrics -->\n* `train/accuracy`, `eval_accuracy`, `reward/mean`, `update_norm/<policy>`, " \
          "`length/<role>`\n\n`not/checked`\n"
    found = marked_names(doc)
    assert [t for _, _, t in found] == ["train/accuracy", "eval_accuracy", "reward/mean", "update_norm/<policy>",
                                        "length/<role>"]
    assert [exists(t, names["metrics"]) for _, _, t in found] == [True, False, False, True, False]
    table = "<!-- names: columns:stats column 3 -->\n| a | b | c |\n|---|---|---|\n| x | `y` | `cos/<A>\\|<B>` |\n"
    assert [t for _, _, t in marked_names(table)] == ["cos/<A>|<B>"]
    assert exists("cos/<A>|<B>", names["columns:stats"]) and not exists("cos/<A>", names["columns:stats"])


def _reading_examples() -> list[str]:
    text = (ROOT / "docs" / "format.md").read_text()
    section = text.split("\n## Reading a run\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def test_format_md_reading_examples_run(run_file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    examples = _reading_examples()
    assert len(examples) == 2
    for code in examples:
        exec(compile(code.replace('"run.h5"', repr(str(run_file))), "docs/format.md", "exec"), {})
    plt.close("all")


def _paragraphs(text: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", text) if p.strip()]


def test_the_paper_is_cited_and_nothing_points_outside() -> None:
    uncited, outside = [], []
    for doc in DOCS:
        text = doc.read_text()
        for para in _paragraphs(text):
            if re.search(r"\bthe paper\b", para, re.IGNORECASE) and "arXiv 2605.24202" not in para:
                uncited.append(f"{doc.relative_to(ROOT)}: {para[:80]!r}")
        if re.search(r"DESIGN\.md|\.\./shared", text):
            outside.append(str(doc.relative_to(ROOT)))
    assert not uncited, "'the paper' without arXiv 2605.24202:\n" + "\n".join(uncited)
    assert not outside, f"docs pointing outside the repository: {outside}"
