"""The paper's three workflows (DESIGN.md): Voting, Eval-Opt, Orch-Workers."""
from trainers.workflows.base import Episode, Sample, Turn, Workflow
from trainers.workflows.eval_opt import EvalOpt
from trainers.workflows.orch_workers import OrchWorkers
from trainers.workflows.templates import Templates
from trainers.workflows.voting import Voting

WORKFLOWS: dict[str, type[Workflow]] = {w.name: w for w in (Voting, EvalOpt, OrchWorkers)}

__all__ = ["WORKFLOWS", "Episode", "EvalOpt", "OrchWorkers", "Sample", "Templates", "Turn", "Voting", "Workflow"]
