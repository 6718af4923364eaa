"""Config dataclass fields that double as command-line flags (their help text lives with them)."""
from dataclasses import field


def flag(default, help: str):
    """A dataclass field with a default and the ``--help`` text of its flag (a list default makes a
    repeatable flag)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})
