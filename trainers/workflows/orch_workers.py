"""Orch-Workers: an orchestrator proposes ≤ 3 strategies, 3 workers solve (one strategy each), a
synthesizer picks one worker's answer."""
from __future__ import annotations

from collections.abc import Sequence

from trainers.tasks.base import Task
from trainers.workflows.base import Episode, Generate, Workflow
from trainers.workflows.templates import pad_strategies, parse_pick, parse_plan

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
        candidates: list[list[tuple[str, str | None]]] = [[] for _ in tasks]
        for i, (prompt, sample) in enumerate(zip(prompts, generate("worker", prompts))):
            e = i % len(tasks)
            answer, valid = self.solve(tasks[e], sample.text)
            episodes[e].add(f"worker{i // len(tasks)}", "worker", prompt, sample, valid)
            candidates[e].append((sample.text.strip(), answer))
        syn_prompts = [self.templates.render("picker", q=t.prompt, candidates=[c for c, _ in cands])
                       for t, cands in zip(tasks, candidates)]
        for ep, prompt, cands, sample in zip(episodes, syn_prompts, candidates, generate("synthesizer", syn_prompts)):
            pick, valid = parse_pick(sample.text, len(cands))
            ep.add("synthesizer", "synthesizer", prompt, sample, valid)
            ep.answer = cands[pick][1] if pick is not None else None
        return episodes
