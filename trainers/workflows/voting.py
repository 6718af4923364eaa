"""Voting: three voters answer the same prompt; an aggregator picks one of their solutions."""
from __future__ import annotations

from collections.abc import Sequence

from gradscope.trainers.tasks.base import Task
from gradscope.trainers.workflows.base import Episode, Generate, Workflow

N_VOTERS = 3


class Voting(Workflow):
    name = "voting"
    agents = tuple(f"voter{i}" for i in range(N_VOTERS)) + ("aggregator",)
    agent_roles = {**{f"voter{i}": "voter" for i in range(N_VOTERS)}, "aggregator": "aggregator"}

    def run(self, tasks: Sequence[Task], generate: Generate) -> list[Episode]:
        episodes = [Episode(task) for task in tasks]
        prompts = [self.templates.render("solver", q=t.prompt) for t in tasks]
        # One batch for all voters: same role, same prompts, independent samples.
        candidates = self._solve_parallel(episodes, self.agents[:N_VOTERS], prompts * N_VOTERS, generate)
        self._pick(episodes, "aggregator", candidates, generate)
        return episodes
