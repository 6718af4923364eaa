"""The sweep file: YAML → fixed train flags and grid axes, every key and value checked with its location.

::

    train:                 # flags every run gets (any ``gradscope train`` flag but out/overwrite/resume)
      steps: 400
      tasks_per_step: 16
    grid:                  # axes: a value or a list of values each; runs = their product
      workflow: [voting, eval-opt]
      task: [math, code]
      policy: [ip, sp]
      scale: [0.3M, 1.5M]
      seed: [0, 1, 2]
      lr: [0.001, 0.003]   # any train flag is an axis
      variant:             # named sets of flags, one axis: cells ..._none_..., ..._kl_...
        none: {}
        kl: {kl_coef: voter=0.05}
        coherence: {coherence_reg: voter=0.5, coherence_beta: 0.8}

Keys are flag names with ``_`` or ``-``. A problem raises :class:`SweepError` whose message starts
with ``FILE:LINE:COLUMN:`` of the offending key or value.
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from pathlib import Path

import yaml

from gradscope.errors import ConfigError
from gradscope.paths import read_text_file

#: Flags the sweep sets itself for every run, and what to do instead of setting one.
RESERVED = {
    "out": "--out DIR chooses the folder",
    "overwrite": "a run it cannot resume starts afresh; --out DIR chooses another folder",
    "resume": "running the same sweep again resumes its killed runs",
}
#: An example of the variant axis, for its messages.
_VARIANT_EXAMPLE = "{none: {}, kl: {kl_coef: 0.05}}"
TOP_KEYS = ("train", "grid")
#: The grid axis of named flag sets.
VARIANT = "variant"


class SweepError(ConfigError):
    """A bad sweep file; the message starts with the location ``FILE:LINE:COL:``."""


@dataclass(frozen=True)
class Setting:
    """One flag's value with where it was written (``file:line:col``)."""

    flag: str            # TrainConfig / GRPOConfig field name
    value: object        # as YAML gave it (str, int, float, bool, list)
    where: str


@dataclass(frozen=True)
class Option:
    """One value of an axis: a flag's value, or a named variant's set of flags."""

    value: object                    # the flag's value, or the variant's name
    where: str
    settings: tuple[Setting, ...]


@dataclass(frozen=True)
class SweepSpec:
    path: Path
    train: tuple[Setting, ...]                       # fixed flags
    axes: tuple[tuple[str, tuple[Option, ...]], ...]  # (flag or "variant", options) in file order


def train_fields() -> dict[str, type | None]:
    """Every ``gradscope train`` flag (field name) → the type of its default (None for str/None)."""
    from gradscope.trainers.config import TrainConfig
    from gradscope.trainers.grpo_config import GRPOConfig

    out = {}
    for cls in (TrainConfig, GRPOConfig):
        for f in dataclasses.fields(cls):
            if f.name != "grpo":
                default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                out[f.name] = type(default)
    return out


def _where(path: Path, mark: yaml.Mark) -> str:
    return f"{path}:{mark.line + 1}:{mark.column + 1}"


def load_spec(path: str | Path) -> SweepSpec:
    """Parse and check the file's structure and flag names (values: :mod:`.grid`)."""
    path = Path(path)
    text = read_text_file(path, "sweep file")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = _where(path, mark) if mark is not None else str(path)
        raise SweepError(f"{where}: bad YAML: {getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(root, yaml.MappingNode):
        where = _where(path, root.start_mark) if root is not None else f"{path}:1:1"
        raise SweepError(f"{where}: a sweep file is a mapping with the keys {', '.join(TOP_KEYS)}")
    fields = train_fields()
    sections: dict[str, tuple[Setting, ...]] = {}
    axes: list[tuple[str, tuple[Setting, ...]]] = []
    for key_node, value_node in root.value:
        key = key_node.value
        if key not in TOP_KEYS:
            raise SweepError(f"{_where(path, key_node.start_mark)}: unknown key {key!r}; "
                             f"a sweep file has {', '.join(TOP_KEYS)}")
        if key in sections:
            raise SweepError(f"{_where(path, key_node.start_mark)}: {key!r} given twice")
        if not isinstance(value_node, yaml.MappingNode):
            raise SweepError(f"{_where(path, value_node.start_mark)}: {key!r} must be a mapping of flag: value")
        if key == "train":
            sections[key] = _settings(path, value_node, fields)
            continue
        sections[key] = ()  # the grid's settings are its axes; recorded so that a second `grid:` is refused
        seen: list[str] = []
        for flag_node, v_node in value_node.value:
            if flag_node.value == VARIANT and key == "grid":
                if VARIANT in seen:
                    raise SweepError(f"{_where(path, flag_node.start_mark)}: {VARIANT!r} given twice")
                seen.append(VARIANT)
                axes.append((VARIANT, _variants(path, v_node, fields)))
                continue
            flag = _flag_name(path, flag_node, fields, seen)
            seen.append(flag)
            values = v_node.value if isinstance(v_node, yaml.SequenceNode) else [v_node]
            if not values:
                raise SweepError(f"{_where(path, v_node.start_mark)}: axis {flag!r} has no values")
            options = []
            for n in values:
                setting = Setting(flag, _value(path, n, flag, fields[flag]), _where(path, n.start_mark))
                options.append(Option(setting.value, setting.where, (setting,)))
            axes.append((flag, tuple(options)))
    fixed = sections.get("train", ())
    owner = {s.flag: "a fixed train flag" for s in fixed}
    for axis, options in axes:
        flags = {s.flag for o in options for s in o.settings}
        for o in options:
            for s in o.settings:
                if s.flag in owner:
                    raise SweepError(f"{s.where}: {s.flag!r} is both {owner[s.flag]} and in the grid axis {axis!r}")
        owner.update({f: f"in the grid axis {axis!r}" for f in flags})
    return SweepSpec(path, fixed, tuple(axes))


def _settings(path: Path, node: yaml.MappingNode, fields: dict) -> tuple[Setting, ...]:
    """``flag: value`` pairs of a mapping (the fixed flags, or one variant's)."""
    items, seen = [], []
    for flag_node, v_node in node.value:
        flag = _flag_name(path, flag_node, fields, seen)
        seen.append(flag)
        items.append(Setting(flag, _value(path, v_node, flag, fields[flag]), _where(path, v_node.start_mark)))
    return tuple(items)


def _variants(path: Path, node: yaml.Node, fields: dict) -> tuple[Option, ...]:
    """The ``variant`` axis: a mapping of names to mappings of flags (``{}`` for none)."""
    where = _where(path, node.start_mark)
    if not isinstance(node, yaml.MappingNode):
        raise SweepError(f"{where}: {VARIANT!r} must be a mapping of name: {{flag: value}} (e.g. {_VARIANT_EXAMPLE})")
    if not node.value:
        raise SweepError(f"{where}: axis {VARIANT!r} has no values (name: {{flag: value}} each, e.g. "
                         f"{_VARIANT_EXAMPLE})")
    options, names = [], set()
    for name_node, flags_node in node.value:
        name, at = str(name_node.value), _where(path, name_node.start_mark)
        if name in names:
            raise SweepError(f"{at}: variant {name!r} given twice")
        names.add(name)
        if not isinstance(flags_node, yaml.MappingNode):
            raise SweepError(f"{_where(path, flags_node.start_mark)}: variant {name!r} must be a mapping of "
                             "flag: value ({} for none)")
        options.append(Option(name, at, _settings(path, flags_node, fields)))
    return tuple(options)


def _flag_name(path: Path, node: yaml.Node, fields: dict, seen: list[str]) -> str:
    name = str(node.value).strip().replace("-", "_")
    where = _where(path, node.start_mark)
    if name in RESERVED:
        raise SweepError(f"{where}: {name!r} is set by the sweep for every run ({RESERVED[name]})")
    if name not in fields:
        close = difflib.get_close_matches(name, list(fields), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SweepError(f"{where}: unknown train flag {node.value!r}{hint}")
    if name in seen:
        raise SweepError(f"{where}: {name!r} given twice")
    return name


def _value(path: Path, node: yaml.Node, flag: str, kind: type | None) -> object:
    """The Python value of a flag's YAML node: a scalar, or a list of scalars for a repeatable flag."""
    where = _where(path, node.start_mark)
    if isinstance(node, yaml.SequenceNode) and kind is list:
        return [_scalar(path, n, flag) for n in node.value]
    if not isinstance(node, yaml.ScalarNode):
        raise SweepError(f"{where}: {flag!r} takes a single value here, not a "
                         f"{'list' if isinstance(node, yaml.SequenceNode) else 'mapping'}")
    value = _scalar(path, node, flag)
    return [value] if kind is list else value


def _scalar(path: Path, node: yaml.Node, flag: str) -> object:
    where = _where(path, node.start_mark)
    if not isinstance(node, yaml.ScalarNode):
        raise SweepError(f"{where}: {flag!r}: expected a single value")
    value = _construct(node)
    if value is None:
        raise SweepError(f"{where}: {flag!r} has no value")
    return value


def _construct(node: yaml.ScalarNode) -> object:
    """The scalar as PyYAML's safe loader reads it (bool, int, float, str, None)."""
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()
