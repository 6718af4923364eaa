"""Fixtures for every test folder.

Tests must not depend on the testbed warm start's exact weights: its bytes differ between CPUs
(docs/training.md), so a test that needs a gradient signal fixes the rewards instead of hoping the
warm start samples some correct and some wrong answers.
"""
import pytest


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
