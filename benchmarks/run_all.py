"""Every performance figure of the project, one script: `make bench`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

HERE = Path(__file__).parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    for name in ("bench_writer", "bench_analyze", "bench_probe", "bench_peers", "bench_updates", "bench_alerts",
                 "comm_volume", "bench_sandbox", "bench_scales", "bench_hook_overhead"):
        print(f"== {name}")
        _load(name).main()


if __name__ == "__main__":
    main()
