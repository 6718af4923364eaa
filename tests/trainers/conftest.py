"""Trainer tests share one warm-started testbed (built once, ~1 min, then cached on disk)."""
import pytest

from gradscope.trainers.testbed.cache import warm_started_model


@pytest.fixture(scope="session", autouse=True)
def testbed_warm_start():
    warm_started_model(verbose=True)


def crash_at(step: int):
    """An ``on_step`` callback that raises ``RuntimeError("crash")`` once step ``step`` is recorded."""
    def crash(at: int, metrics) -> None:
        if at == step:
            raise RuntimeError("crash")
    return crash
