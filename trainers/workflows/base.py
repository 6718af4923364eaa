"""What a workflow produces: episodes made of turns, each turn written by one agent.

A workflow is a fixed graph of agents. It runs many episodes at once, stage by stage, so each stage
is one batched generation per role. Every turn keeps its agent, role and turn index: the GRPO group
key is ``(task, agent, turn)`` and the probe attributes the turn's tokens to its agent.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gradscope.trainers.tasks.base import Task
from gradscope.trainers.workflows.templates import Templates, parse_pick


@dataclass
class Sample:
    """One generated completion. ids are token ids; ``logprobs`` (old policy) are filled later."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str


@dataclass
class Turn:
    agent: str
    role: str
    turn: int  # index of this agent's turn within the episode (Eval-Opt refines: 0, 1, 2)
    prompt: str
    sample: Sample
    valid: bool  # the output followed the role's format


@dataclass
class Episode:
    task: Task
    turns: list[Turn] = field(default_factory=list)
    answer: str | None = None  # the workflow's final answer (None: no valid final answer)
    reward: float = 0.0

    def add(self, agent: str, role: str, prompt: str, sample: Sample, valid: bool) -> Turn:
        turn = Turn(agent, role, sum(t.agent == agent for t in self.turns), prompt, sample, valid)
        self.turns.append(turn)
        return turn


#: ``generate(role, prompts) -> samples``: batched sampling with the policy routed to ``role``.
Generate = Callable[[str, Sequence[str]], list[Sample]]
#: ``solve(task, text) -> (answer, valid)``: the answer a solver's output states, if any.
Solve = Callable[[Task, str], tuple[str | None, bool]]


class Workflow(ABC):
    """A multi-agent workflow. Subclasses set ``name``, ``agents`` and ``agent_roles``."""

    name: str = ""
    agents: tuple[str, ...] = ()
    agent_roles: dict[str, str] = {}

    def __init__(self, templates: Templates, solve: Solve) -> None:
        self.templates = templates
        self.solve = solve

    @property
    def roles(self) -> list[str]:
        return list(dict.fromkeys(self.agent_roles[a] for a in self.agents))

    @abstractmethod
    def run(self, tasks: Sequence[Task], generate: Generate) -> list[Episode]:
        """One episode per task (repeat a task in ``tasks`` for a GRPO group)."""

    def _solve_parallel(self, episodes: Sequence[Episode], agents: Sequence[str], prompts: Sequence[str],
                        generate: Generate) -> list[list[tuple[str, str | None]]]:
        """Same-role agents answer in one batch; ``prompts`` lists agent 0's prompt per episode, then
        agent 1's, ... Returns each episode's candidates as (shown text, stated answer)."""
        role = self.agent_roles[agents[0]]
        n = len(episodes)
        candidates: list[list[tuple[str, str | None]]] = [[] for _ in episodes]
        for i, (prompt, sample) in enumerate(zip(prompts, generate(role, prompts))):
            ep = episodes[i % n]
            answer, valid = self.solve(ep.task, sample.text)
            ep.add(agents[i // n], role, prompt, sample, valid)
            candidates[i % n].append((sample.text.strip(), answer))
        return candidates

    def _pick(self, episodes: Sequence[Episode], agent: str, candidates: Sequence[list[tuple[str, str | None]]],
              generate: Generate) -> None:
        """A picker chooses one candidate per episode; its answer becomes the episode's answer."""
        role = self.agent_roles[agent]
        prompts = [self.templates.render("picker", q=ep.task.prompt, candidates=[c for c, _ in cands])
                   for ep, cands in zip(episodes, candidates)]
        for ep, prompt, cands, sample in zip(episodes, prompts, candidates, generate(role, prompts)):
            pick, valid = parse_pick(sample.text, len(cands))
            ep.add(agent, role, prompt, sample, valid)
            ep.answer = cands[pick][1] if pick is not None else None

    def _solve_all(self, episodes: Sequence[Episode], agent: str, prompts: Sequence[str],
                   generate: Generate) -> list[str | None]:
        """One solver turn per episode for ``agent``; returns each stated answer."""
        role = self.agent_roles[agent]
        answers = []
        for ep, prompt, sample in zip(episodes, prompts, generate(role, prompts)):
            answer, valid = self.solve(ep.task, sample.text)
            ep.add(agent, role, prompt, sample, valid)
            answers.append(answer)
        return answers
