"""What the sandbox costs per program, next to a bare interpreter start measured alongside.

Prints, for ``run_program("pass")`` and for a passing ``check_program`` (two sandboxed processes),
the median wall time and the CPU time of all child processes per call, each as a ratio to a bare
``python -I -S -c pass`` run the same number of times in the same loop.
"""
from __future__ import annotations

import resource
import statistics
import subprocess
import time

from gradscope.trainers.sandbox import check_program, run_program
from gradscope.trainers.sandbox.spawn import layout

N = 20
PROMPT = 'def add(a, b):\n    """Add two numbers."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n"


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _measure(fn) -> tuple[float, float]:
    """(median wall s, mean child CPU s) per call."""
    walls, cpu0 = [], _children_cpu()
    for _ in range(N):
        t = time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t)
    return statistics.median(walls), (_children_cpu() - cpu0) / N


def main() -> None:
    exe = layout().exe
    run_program("pass")  # warm caches
    cases = {
        "bare interpreter": lambda: subprocess.run([exe, "-I", "-S", "-c", "pass"], check=True),
        "run_program": lambda: run_program("pass"),
        "check_program": lambda: check_program(PROMPT, "    return a + b\n", TEST, "add"),
    }
    results = {name: _measure(fn) for name, fn in cases.items()}
    base_wall, base_cpu = results["bare interpreter"]
    for name, (wall, cpu) in results.items():
        print(f"{name:17s} wall {wall * 1e3:6.1f} ms ({wall / base_wall:4.1f}x)   "
              f"child CPU {cpu * 1e3:6.1f} ms ({cpu / base_cpu:4.1f}x)")


if __name__ == "__main__":
    main()
