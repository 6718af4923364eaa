"""``gradscope sweep``: a YAML grid of training runs, one process per cell, resumable (docs/sweep.md)."""
