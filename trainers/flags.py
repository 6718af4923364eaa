"""Config dataclass fields that double as command-line flags (their help text lives with them)."""
from dataclasses import field


def flag(default, help: str):
    """A dataclass field with a default and the ``--help`` text of its flag."""
    return field(default=default, metadata={"help": help})
