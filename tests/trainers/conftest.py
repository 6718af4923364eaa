"""Trainer tests share one warm-started testbed (built once, ~1 min, then cached on disk)."""
import pytest

from gradscope.trainers.testbed.cache import warm_started_model


@pytest.fixture(scope="session", autouse=True)
def testbed_warm_start():
    warm_started_model(verbose=True)


def alternating_scores(self, episodes) -> None:
    """``Scorer.score`` replaced: rewards 1, 0, 1, 0, ... in episode order."""
    for i, ep in enumerate(episodes):
        ep.reward = float(i % 2 == 0)


@pytest.fixture
def alternating_rewards(monkeypatch):
    """Rewards 1, 0, 1, 0, ... in episode order, so every GRPO group of two or more rollouts has a
    non-zero advantage whatever the warm start's accuracy: for tests that need a gradient signal."""
    from gradscope.trainers.reward import Scorer

    monkeypatch.setattr(Scorer, "score", alternating_scores)


def crash_at(step: int):
    """An ``on_step`` callback that raises ``RuntimeError("crash")`` once step ``step`` is recorded."""
    def crash(at: int, metrics) -> None:
        if at == step:
            raise RuntimeError("crash")
    return crash
