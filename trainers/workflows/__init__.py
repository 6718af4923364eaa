"""The paper's three workflows (DESIGN.md): Voting, Eval-Opt, Orch-Workers."""
from gradscope.trainers.workflows.base import Episode, Sample, Turn, Workflow
from gradscope.trainers.workflows.eval_opt import EvalOpt
from gradscope.trainers.workflows.orch_workers import OrchWorkers
from gradscope.trainers.workflows.templates import Templates
from gradscope.trainers.workflows.voting import Voting

WORKFLOWS: dict[str, type[Workflow]] = {w.name: w for w in (Voting, EvalOpt, OrchWorkers)}

__all__ = ["WORKFLOWS", "Episode", "EvalOpt", "OrchWorkers", "Sample", "Templates", "Turn", "Voting", "Workflow"]
