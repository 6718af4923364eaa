"""Config dataclass fields that double as command-line flags (their help text lives with them)."""
from dataclasses import field


def flag(default, help: str, type=None):
    """A dataclass field with a default and the ``--help`` text of its flag (a list default makes a
    repeatable flag); ``type``: the flag's argparse type when it is not the default's."""
    metadata = {"help": help, **({"type": type} if type is not None else {})}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)
