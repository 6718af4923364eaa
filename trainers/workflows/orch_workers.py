"""Orch-Workers: an orchestrator proposes ≤ 3 strategies, 3 workers solve (one strategy each), a
synthesizer picks one worker's answer."""
from __future__ import annotations

from collections.abc import Sequence

from gradscope.trainers.tasks.base import Task
from gradscope.trainers.workflows.base import Episode, Generate, Workflow
from gradscope.trainers.workflows.templates import pad_strategies, parse_plan

N_WORKERS = 3


class OrchWorkers(Workflow):
    name = "orch-workers"
    agents = ("orchestrator",) + tuple(f"worker{i}" for i in range(N_WORKERS)) + ("synthesizer",)
    agent_roles = {"orchestrator": "orchestrator", **{f"worker{i}": "worker" for i in range(N_WORKERS)},
                   "synthesizer": "synthesizer"}

    def run(self, tasks: Sequence[Task], generate: Generate) -> list[Episode]:
        episodes = [Episode(task) for task in tasks]
        plan_prompts = [self.templates.render("planner", q=t.prompt) for t in tasks]
        strategies = []
        for ep, prompt, sample in zip(episodes, plan_prompts, generate("orchestrator", plan_prompts)):
            plan, valid = parse_plan(sample.text, N_WORKERS)
            ep.add("orchestrator", "orchestrator", prompt, sample, valid)
            strategies.append(pad_strategies(plan, N_WORKERS))
        # Workers see different prompts (one strategy each) but share a role: one batch for all.
        prompts = [self.templates.render("solver", q=t.prompt, strategy=strategies[e][w])
                   for w in range(N_WORKERS) for e, t in enumerate(tasks)]
        candidates = self._solve_parallel(episodes, self.agents[1:1 + N_WORKERS], prompts, generate)
        self._pick(episodes, "synthesizer", candidates, generate)
        return episodes
