"""Parameter groups: which slice of the trainable parameters each per-group Gram covers."""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

from gradscope.errors import ProbeError
from gradscope.peft_support import adapter_of

#: A grouping: a named rule, a function from parameter name to group, or explicit name prefixes.
GroupSpec = str | Callable[[str], str] | Mapping[str, Sequence[str]] | None

_LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)\.")


def by_adapter(name: str) -> str:
    """Group LoRA parameters by adapter; everything else is ``"base"``."""
    return adapter_of(name) or "base"


def by_layer(name: str) -> str:
    """Group by transformer block index (``layer0``, ``layer1``, ...); everything else is ``"other"``."""
    match = _LAYER.search("." + name)
    return f"layer{int(match.group(1))}" if match else "other"


_RULES: dict[str, Callable[[str], str]] = {"adapter": by_adapter, "layer": by_layer}


def assign_groups(names: Sequence[str], spec: GroupSpec) -> tuple[list[str], list[int]]:
    """Map each parameter name to a group.

    Returns ``(group_names, index)`` where ``index[i]`` is the group of ``names[i]``; group names are
    in order of first appearance. ``spec=None`` puts everything in one group ``"all"``.
    """
    if spec is None:
        rule: Callable[[str], str] = lambda _: "all"  # noqa: E731
    elif isinstance(spec, str):
        if spec not in _RULES:
            raise ProbeError(f"unknown parameter grouping {spec!r}; use one of {sorted(_RULES)}")
        rule = _RULES[spec]
    elif isinstance(spec, Mapping):
        rule = _prefix_rule(spec)
    elif callable(spec):
        rule = spec
    else:
        raise ProbeError(f"groups must be None, one of {sorted(_RULES)}, a function name → group or a mapping "
                         f"{{group: [name prefixes]}}; got {type(spec).__name__} {spec!r}")
    groups: list[str] = []
    index: list[int] = []
    for name in names:
        group = rule(name)
        if group not in groups:
            groups.append(group)
        index.append(groups.index(group))
    return groups, index


def _prefix_rule(prefixes: Mapping[str, Sequence[str]]) -> Callable[[str], str]:
    bad = [group for group, starts in prefixes.items()
           if isinstance(starts, str) or not all(isinstance(s, str) for s in starts)]
    if bad:  # a string is a sequence of one-character prefixes: "lm_head" would match every "l..." name
        raise ProbeError(f"groups: the prefixes of group {bad[0]!r} must be a list of strings, got "
                         f"{prefixes[bad[0]]!r}")

    def rule(name: str) -> str:
        for group, starts in prefixes.items():
            if any(name.startswith(s) for s in starts):
                return group
        raise ProbeError(f"parameter {name!r} matches no group prefix; add it to a group")

    return rule
