"""Eval-Opt: a generator answers, an evaluator judges; refine until 'Correct' or the evaluation limit.

G → E → (refine G → E) … at most ``max_evals`` evaluations (3 for math, 2 for code in the paper);
the final answer is the generator's last answer.
"""
from __future__ import annotations

from collections.abc import Sequence

from gradscope.trainers.tasks.base import Task
from gradscope.trainers.workflows.base import Episode, Generate, Solve, Workflow
from gradscope.trainers.workflows.templates import Templates, parse_verdict


class EvalOpt(Workflow):
    name = "eval-opt"
    agents = ("generator", "evaluator")
    agent_roles = {"generator": "generator", "evaluator": "evaluator"}

    def __init__(self, templates: Templates, solve: Solve, max_evals: int = 3) -> None:
        super().__init__(templates, solve)
        self.max_evals = max_evals

    def run(self, tasks: Sequence[Task], generate: Generate) -> list[Episode]:
        episodes = [Episode(task) for task in tasks]
        prompts = [self.templates.render("solver", q=t.prompt) for t in tasks]
        shown = [""] * len(tasks)  # the generator's last output, as the evaluator sees it
        active = list(range(len(tasks)))
        for round_ in range(self.max_evals):
            answers = self._solve_all([episodes[e] for e in active], "generator", prompts, generate)
            for e, answer in zip(active, answers):
                episodes[e].answer = answer
                shown[e] = episodes[e].turns[-1].sample.text.strip()
            eval_prompts = [self.templates.render("evaluator", q=tasks[e].prompt, answer=shown[e]) for e in active]
            still = []
            for e, prompt, sample in zip(active, eval_prompts, generate("evaluator", eval_prompts)):
                verdict, valid = parse_verdict(sample.text)
                episodes[e].add("evaluator", "evaluator", prompt, sample, valid)
                if verdict is not True:  # 'Incorrect' or unparseable: refine
                    still.append((e, sample.text.strip()))
            if round_ == self.max_evals - 1:
                break
            active = [e for e, _ in still]
            prompts = [self.templates.render("refiner", q=tasks[e].prompt, answer=shown[e], verdict=v)
                       for e, v in still]
            if not active:
                break
        return episodes
