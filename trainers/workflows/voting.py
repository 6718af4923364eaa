"""Voting: three voters answer the same prompt; an aggregator picks one of their solutions."""
from __future__ import annotations

from collections.abc import Sequence

from trainers.tasks.base import Task
from trainers.workflows.base import Episode, Generate, Workflow
from trainers.workflows.templates import parse_pick

N_VOTERS = 3


class Voting(Workflow):
    name = "voting"
    agents = tuple(f"voter{i}" for i in range(N_VOTERS)) + ("aggregator",)
    agent_roles = {**{f"voter{i}": "voter" for i in range(N_VOTERS)}, "aggregator": "aggregator"}

    def run(self, tasks: Sequence[Task], generate: Generate) -> list[Episode]:
        episodes = [Episode(task) for task in tasks]
        prompts = [self.templates.render("solver", q=t.prompt) for t in tasks]
        # One batch for all voters: same role, same prompts, independent samples.
        samples = generate("voter", prompts * N_VOTERS)
        candidates: list[list[tuple[str, str | None]]] = [[] for _ in tasks]
        for i, sample in enumerate(samples):
            e = i % len(tasks)
            answer, valid = self.solve(tasks[e], sample.text)
            episodes[e].add(f"voter{i // len(tasks)}", "voter", prompts[e], sample, valid)
            candidates[e].append((sample.text.strip(), answer))
        agg_prompts = [self.templates.render("picker", q=t.prompt, candidates=[c for c, _ in cands])
                       for t, cands in zip(tasks, candidates)]
        for ep, prompt, cands, sample in zip(episodes, agg_prompts, candidates, generate("aggregator", agg_prompts)):
            pick, valid = parse_pick(sample.text, len(cands))
            ep.add("aggregator", "aggregator", prompt, sample, valid)
            ep.answer = cands[pick][1] if pick is not None else None
        return episodes
