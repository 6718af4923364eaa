"""Errors that the command line reports as one line and exit code 2, and the warning it prints as one line."""


class GradscopeError(Exception):
    """Base class: a problem with the user's input, reported without a traceback."""


class RunFileError(GradscopeError):
    """A run file is missing, not HDF5, of an unknown or newer schema, or lacks required fields."""


class ProbeError(GradscopeError):
    """The probe was used incorrectly (unknown agent, step not open, ...)."""


class ConfigError(GradscopeError):
    """A bad flag or configuration value (unknown workflow, role, model path, ...)."""


class TaskFileError(GradscopeError):
    """A task file (JSONL) is missing, unreadable or malformed; the message names file and line."""


class GradscopeWarning(UserWarning):
    """Something the user should know that does not stop the command (``gradscope: warning: ...``)."""
