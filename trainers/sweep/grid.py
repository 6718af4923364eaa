"""The grid's cells: the product of the axes, each a ``gradscope train`` command line, all checked
before any run starts.

A cell's name is its axis values in file order, ``seed`` last (``voting_math_ip_0.3M_seed0``); axes
other than workflow, task, policy, scale and variant are written ``flag=value`` (``lr=0.003``). Its
run file is ``runs/<name>.h5`` in the sweep folder.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gradscope.errors import ConfigError, GradscopeError
from gradscope.trainers.sweep.config import VARIANT, Setting, SweepError, SweepSpec

#: Axes named by their bare value in a cell's name.
BARE = ("workflow", "task", "policy", "scale", VARIANT)


@dataclass(frozen=True)
class Cell:
    name: str
    axes: dict[str, object]          # flag → value (the grid's axes only)
    argv: list[str]                  # train flags, without --out / --overwrite / --resume
    settings: tuple[Setting, ...]    # the axis values with their locations

    def where(self, message: str = "", fixed: Sequence[Setting] = ()) -> str:
        """The location of the setting a message names: the axis value or ``fixed`` (``train:``) setting
        whose flag (``--name``) it names, else the axis value or ``fixed`` setting it quotes (the longest
        value, or part of one), else the cell's first axis value ("" when it has none)."""
        for s in (*self.settings, *fixed):
            if re.search(rf"--{re.escape(s.flag.replace('_', '-'))}(?![\w-])", message):
                return s.where
        best, where = 0, self.settings[0].where if self.settings else ""
        for s in (*self.settings, *fixed):
            values = s.value if isinstance(s.value, list) else [s.value]
            parts = {p for v in values for p in [str(v), *re.split(r"[,=\s]+", str(v))]
                     if len(p) >= 2 or f"'{p}'" in message}  # a one-character value only when quoted whole
            # a fixed value counts only as a whole token: a short one ("ip", "10") would match inside words
            found = [p for p in parts if (p in message if s in self.settings else
                                          re.search(rf"(?<![\w.-]){re.escape(p)}(?![\w-])", message))]
            score = max(map(len, found), default=0)
            if score > best:
                best, where = score, s.where
        return where

    def run_path(self, folder: Path) -> Path:
        return folder / "runs" / f"{self.name}.h5"


class _Parser(argparse.ArgumentParser):
    """The train flags' parser, raising instead of exiting."""

    def error(self, message: str) -> None:
        raise ConfigError(message)


def train_parser() -> argparse.ArgumentParser:
    from gradscope.trainers.config import add_arguments

    parser = _Parser(prog="gradscope train", add_help=False)
    add_arguments(parser)
    return parser


def to_argv(setting: Setting) -> list[str]:
    """The flag as ``gradscope train`` takes it (``--no-X`` for false, a repeated flag for a list)."""
    flag = "--" + setting.flag.replace("_", "-")
    value = setting.value
    if isinstance(value, bool):
        return [flag] if value else ["--no-" + setting.flag.replace("_", "-")]
    if isinstance(value, list):
        return [tok for item in value for tok in (flag, str(item))]
    return [flag, str(value)]


def _check_value(parser: argparse.ArgumentParser, setting: Setting, kind: type | None) -> None:
    if kind is bool and not isinstance(setting.value, bool):
        raise SweepError(f"{setting.where}: {setting.flag!r} takes true or false, got {setting.value!r}")
    if kind is not bool and isinstance(setting.value, bool):
        raise SweepError(f"{setting.where}: {setting.flag!r} takes a value, not {str(setting.value).lower()}")
    try:
        parser.parse_args(to_argv(setting))
    except ConfigError as exc:
        raise SweepError(f"{setting.where}: {exc}") from None


def _label(flag: str, value: object) -> str:
    text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    text = re.sub(r"[^A-Za-z0-9._=+-]+", "-", text).strip("-") or "x"
    if flag == "seed":
        return f"seed{text}"
    return text if flag in BARE else f"{flag}={text}"


def expand(spec: SweepSpec) -> list[Cell]:
    """Every cell of the grid, each flag value checked by the train flags' own parser, then every cell's
    whole command line by the trainer's own validation (SweepError with a location on the first problem)."""
    from gradscope.trainers.sweep.config import train_fields

    fields = train_fields()
    parser = train_parser()
    for s in spec.train:
        _check_value(parser, s, fields[s.flag])
    for _, options in spec.axes:
        for option in options:
            for s in option.settings:
                _check_value(parser, s, fields[s.flag])
    fixed = [tok for s in spec.train for tok in to_argv(s)]
    axes = [axis for axis, _ in spec.axes]
    order = sorted(range(len(axes)), key=lambda i: axes[i] == "seed")  # seed last in names
    cells, names = [], set()
    for combo in itertools.product(*(options for _, options in spec.axes)):
        name = "_".join(_label(axes[i], combo[i].value) for i in order) or "run"
        if name in names:
            raise SweepError(f"{combo[-1].where}: two cells are both named {name!r} (repeated axis values?)")
        names.add(name)
        settings = tuple(s for o in combo for s in o.settings)
        argv = [tok for s in settings for tok in to_argv(s)] + fixed
        cells.append(Cell(name, {a: o.value for a, o in zip(axes, combo)}, argv, settings))
    _validate_cells(cells, parser, spec.path, spec.train)
    return cells


def cell_config(cell: Cell, parser: argparse.ArgumentParser | None = None, out: str | Path = "run.h5"):
    """The cell's TrainConfig (writing ``out``)."""
    from gradscope.trainers.config import from_settings, settings

    args = vars((parser or train_parser()).parse_args(cell.argv))
    return dataclasses.replace(from_settings({k: v for k, v in args.items() if k in settings()}), out=str(out))


def _validate_cells(cells: list[Cell], parser: argparse.ArgumentParser, path: Path,
                    fixed: Sequence[Setting] = ()) -> None:
    """The trainer's checks (workflow, policy map, alert rules, task files, ...) on every cell; an error is
    located at the setting it names or quotes (an axis value or a ``fixed`` one), else at the cell's first axis
    value."""
    from gradscope.trainers.train import check_ranges, validate

    seen: set[str] = set()
    with tempfile.TemporaryDirectory() as tmp:
        for cell in cells:
            cfg = cell_config(cell, parser, Path(tmp) / "run.h5")
            key = repr(dataclasses.replace(cfg, seed=0, steps=0))  # tasks and rules do not depend on these
            try:
                if key in seen:  # the rest was checked on a cell that differs only in seed and steps
                    check_ranges(cfg)
                else:
                    validate(cfg)
            except GradscopeError as exc:
                axes = ", ".join(f"{k}={v}" for k, v in cell.axes.items())
                where = cell.where(str(exc), fixed) or str(path)
                raise SweepError(f"{where}: cell {axes or cell.name}: {exc}") from None
            seen.add(key)
