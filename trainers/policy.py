"""Policy routing: which LoRA adapter each role's turns are generated with and train.

``ip`` (Isolated-Policy) gives every role its own adapter, named after the role; ``sp``
(Shared-Policy) routes every role to one adapter ``shared``; an explicit map such as
``voter=a,aggregator=b`` names the adapter of every role (roles may share).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradscope.errors import ConfigError

SHARED = "shared"


@dataclass(frozen=True)
class PolicyMap:
    """role → adapter name, for every role of a workflow."""

    role_to_adapter: dict[str, str]

    @property
    def adapters(self) -> list[str]:
        """Adapter names in order of first appearance."""
        return list(dict.fromkeys(self.role_to_adapter.values()))

    def __getitem__(self, role: str) -> str:
        return self.role_to_adapter[role]

    def roles_of(self, adapter: str) -> list[str]:
        return [r for r, a in self.role_to_adapter.items() if a == adapter]


def parse_policy(spec: str, roles: Sequence[str]) -> PolicyMap:
    """Parse ``--policy``: ``ip``, ``sp`` or ``role=adapter,...`` covering exactly ``roles``."""
    spec = spec.strip()
    if spec == "ip":
        return PolicyMap({r: r for r in roles})
    if spec == "sp":
        return PolicyMap({r: SHARED for r in roles})
    mapping: dict[str, str] = {}
    for item in spec.split(","):
        role, sep, adapter = (s.strip() for s in item.partition("="))
        if not sep or not role or not adapter or not adapter.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"bad --policy entry {item!r}: use ip, sp, or role=adapter,... "
                              f"(adapter names: letters, digits, - and _)")
        if role not in roles:
            raise ConfigError(f"--policy names unknown role {role!r}; this workflow's roles are {list(roles)}")
        mapping[role] = adapter
    missing = [r for r in roles if r not in mapping]
    if missing:
        raise ConfigError(f"--policy gives no adapter for roles {missing}")
    return PolicyMap(mapping)
