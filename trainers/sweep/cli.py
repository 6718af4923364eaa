"""``gradscope sweep CONFIG.yaml [--jobs N] [--out DIR]``: check the whole grid, then run its cells."""
from __future__ import annotations

import shlex
import shutil
import signal
from pathlib import Path

from gradscope.errors import ConfigError
from gradscope.trainers.sweep.config import load_spec
from gradscope.trainers.sweep.grid import expand
from gradscope.trainers.sweep.scheduler import (Outcome, check_folder, folder_lock, make_folder, plan, run_cells,
                                              write_manifest)


def sweep_main(config: str, out: str | None, jobs: int, dry_run: bool = False) -> tuple[Path, Outcome | None]:
    """Run the sweep of ``config`` into ``out`` (default ``sweeps/out/<config stem>``); every check
    (file, flags, values, cells, run files of other settings) passes before the first run starts.
    Returns the folder and the outcome (None for a dry run, which only lists the cells)."""
    if jobs < 1:
        raise ConfigError("--jobs must be >= 1")
    spec = load_spec(config)
    cells = expand(spec)
    folder = Path(out) if out else Path("sweeps") / "out" / Path(config).stem
    check_folder(folder, cells)
    if dry_run:
        for cell in cells:
            print(f"{cell.name}: {shlex.join(['gradscope', 'train', *cell.argv, '--out', str(cell.run_path(folder))])}")
        return folder, None
    make_folder(folder)
    signal.signal(signal.SIGTERM, _interrupt)  # like Ctrl-C: every run is interrupted and closes its file
    # SIGINT too when inherited ignored (`&` in a script, nohup), as `gradscope train` does
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with folder_lock(folder):
        planned = plan(cells, folder)
        write_manifest(folder, cells, Path(config))
        copy = folder / "sweep.yaml"
        if not copy.exists() or not copy.samefile(config):
            shutil.copyfile(config, copy)
        outcome = run_cells(planned, folder, jobs)
    return folder, outcome


def _interrupt(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt
