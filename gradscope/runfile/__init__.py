"""The run file: a versioned, SWMR-readable HDF5 file holding one record per optimizer step.

Schema and protocol: ``docs/format.md``. Write with :class:`RunWriter`, read with :func:`open_run`.
"""
from gradscope.runfile.reader import RunReader, open_run
from gradscope.runfile.schema import SCHEMA_VERSION, RunMeta
from gradscope.runfile.writer import RunWriter

__all__ = ["SCHEMA_VERSION", "RunMeta", "RunReader", "RunWriter", "open_run"]
