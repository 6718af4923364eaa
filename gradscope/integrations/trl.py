"""gradscope for TRL: ``GradscopeGRPOTrainer``, a ``trl.GRPOTrainer`` that probes every optimizer step.

Swap the class and name each completion's agent::

    trainer = GradscopeGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=ds,
                                   roles={"voter0": "voter", "voter1": "voter", "aggregator": "aggregator"},
                                   agent="agent", run_file="run.h5")   # "agent": a column of ds

Each optimizer step (all its gradient-accumulation micro-batches) is one probed step: the Gram of the
per-agent gradients of TRL's own loss, measured through the probe's per-token entry point
(``backward_tokens``) with the exact per-token weights TRL applies — for every loss type
(``grpo``, ``dapo``, ``dr_grpo``, ``bnpo``, ``cispo``, ``sapo``, ``luspo``, ``vespo``), KL and
entropy terms included: TRL's loss depends on the parameters only through the per-token log-probs
``ℓ`` (and entropies ``H``), so ``Σ_t (∂L/∂ℓ_t) ℓ_t + (∂L/∂H_t) H_t``, with the two partial
derivatives taken from TRL's loss and held fixed, has exactly TRL's gradient, token by token.
The statistics join TRL's logs as ``gradscope/...`` (so ``report_to`` sends them to TensorBoard,
W&B, MLflow, ...), and with ``run_file`` every record goes to a run file for ``gradscope analyze``,
``plot`` and ``watch``. With ``update_unit="role"`` (or ``"agent"``) TRL's torch AdamW is attached to
the probe (update attribution, docs/probe.md) and every record also holds the split of its
optimizer step; the record is then written after that step.

Under ``accelerate launch`` (DDP) the probed backward runs without DDP's gradient averaging and the
gradients are then summed over processes, each process' loss scaled by 1/num_processes: ``.grad``
is what DDP leaves, and the Gram is that of the global per-agent gradients (docs/distributed.md).
Not supported (a ``ProbeError`` at the first step): DeepSpeed, FSDP, fp16 loss scaling, MoE router
auxiliary losses.
"""
from __future__ import annotations

import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from accelerate.utils import DistributedType, broadcast_object_list
from trl import GRPOTrainer

from gradscope.errors import ProbeError, RunFileError
from gradscope.integrations.scalars import PREFIX, finite_items, step_scalars
from gradscope.probe import Probe, StepResult
from gradscope.probe.updates import UNITS as UPDATE_UNITS
from gradscope.runfile import RunMeta, RunWriter

#: The key under which each completion's per-token agent indices travel with TRL's batch.
AGENT_IDS = "gradscope_agent_ids"
#: TRL's prefix of an evaluation's logged metrics (``eval_loss``, ``eval_reward``, ...).
EVAL = "eval_"
#: √ΣM, logged like TRL's ``grad_norm`` (the logging window's last optimizer step, not a window mean).
GRAD_NORM = f"{PREFIX}grad_norm"

AgentSpec = str | Callable[[dict[str, Any]], Any]


def agent_ids(values: Sequence[Any], completion_mask: torch.Tensor, loss_mask: torch.Tensor,
              index: Mapping[str, int]) -> torch.Tensor:
    """(B, C) agent index of every completion token; -1 where the loss mask is 0.

    Args:
        values: per completion, an agent name (the whole completion is that agent's), a list with
            one agent name (or None: no agent) per completion token, or None (no agent's).
        completion_mask: (B, C) 1 for the completion's tokens (right-padded); a row of zeros (a
            completion TRL masked out whole, ``mask_truncated_completions``) takes any value.
        loss_mask: (B, C) 1 for the tokens the loss trains (completion mask x tool/env mask).
        index: agent name → row of the Gram.
    """
    B, C = completion_mask.shape
    ids = torch.full((B, C), -1, dtype=torch.long)
    lengths = completion_mask.sum(1).tolist()
    for b, value in enumerate(values):
        if isinstance(value, str):
            ids[b, :] = _index(index, value, b)
            continue
        if value is None:  # the whole completion is no agent's: none of its tokens may be trained
            continue
        if not isinstance(value, Sequence):
            shown = " ".join(repr(value).split())  # one line (a NumPy array's repr spans several)
            raise ProbeError(f"completion {b}: agent {shown[:80] + ('...' if len(shown) > 80 else '')} is neither an "
                             "agent name nor a list of one agent name per completion token")
        if not lengths[b]:  # masked out whole (TRL's mask_truncated_completions): it trains nothing
            continue
        names = list(value)
        if len(names) != lengths[b]:
            raise ProbeError(f"completion {b}: {len(names)} per-token agents for {lengths[b]} completion tokens")
        ids[b, :len(names)] = torch.tensor([-1 if n is None else _index(index, n, b) for n in names],
                                           dtype=torch.long)
    trained = loss_mask.to(ids.device).bool()
    orphans = (trained & (ids < 0)).any(1).nonzero().flatten().tolist()
    if orphans:
        raise ProbeError(f"completion(s) {orphans[:5]} have trained tokens without an agent")
    return ids.masked_fill(~trained, -1).to(completion_mask.device)


def _index(index: Mapping[str, int], name: Any, row: int) -> int:
    try:
        return index[name]
    except (KeyError, TypeError):
        raise ProbeError(f"completion {row}: agent {name!r} is not one of the declared agents "
                         f"{list(index)}") from None


class GradscopeGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` plus a gradscope :class:`~gradscope.probe.Probe` on every optimizer step.

    Args (besides ``GRPOTrainer``'s, all keyword-only):
        roles: agent name → role, for every agent (the Gram's rows follow this order).
        agent: where each completion's agent comes from: a column name — of the dataset, or an extra
            field a ``rollout_func`` returns — or a function of the example (a dict of its columns
            and extra fields). The value is an agent name, or for multi-agent completions a list of
            one agent name (None: no agent) per completion token.
        run_file: write every record (and TRL's logged metrics) to this run file (main process); it
            must not exist yet (a ``RunFileError`` when ``train`` starts, never an overwrite).
        probe_options: more :class:`~gradscope.probe.Probe` arguments (``groups``, ``method``,
            ``sketch``, ``params``).
        update_unit: ``"role"`` or ``"agent"``: attribute every optimizer step to those units
            (``Probe.attach``; needs a torch AdamW / Adam optimizer, else a ``ProbeError`` when ``train``
            creates it); None (default): no update attribution.

    After each optimizer step, :attr:`gradscope_last` holds its :class:`~gradscope.probe.StepResult`
    (the Gram of the global per-agent gradients, the same on every process).
    """

    def __init__(self, *args: Any, roles: Mapping[str, str], agent: AgentSpec = "agent",
                 run_file: str | os.PathLike[str] | None = None,
                 probe_options: Mapping[str, Any] | None = None, update_unit: str | None = None,
                 **kwargs: Any) -> None:
        if not isinstance(roles, Mapping) or not all(isinstance(a, str) and isinstance(r, str)
                                                     for a, r in roles.items()):
            raise ProbeError(f"roles must map each agent's name to its role's name (str → str), got {roles!r}")
        if not isinstance(probe_options, (Mapping, type(None))):
            raise ProbeError(f"probe_options must be a mapping of Probe's keyword options, got {probe_options!r}")
        options = set(inspect.signature(Probe).parameters) - {"model", "agents", "roles"}  # (the trainer gives those)
        unknown = sorted(set(probe_options or {}) - options)
        if unknown:
            raise ProbeError(f"probe_options: Probe has no option {unknown[0]!r}; its options are {sorted(options)}")
        super().__init__(*args, **kwargs)
        if self.aux_loss_enabled:
            raise ProbeError("the MoE router auxiliary loss is not attributable to agents; set "
                             "output_router_logits=False in the model config to probe this model")
        self.gradscope_roles = dict(roles)
        self.gradscope_agents = list(roles)
        self._agent = agent
        self._agent_index = {a: k for k, a in enumerate(self.gradscope_agents)}
        self.probe = Probe(self.accelerator.unwrap_model(self.model), self.gradscope_agents, self.gradscope_roles,
                           **dict(probe_options or {}))
        self.gradscope_last: StepResult | None = None
        if update_unit not in (None, *UPDATE_UNITS):
            raise ProbeError(f"update_unit must be one of {UPDATE_UNITS} or None, got {update_unit!r}")
        self._update_unit = update_unit
        self._unlogged: StepResult | None = None  # probed, its optimizer step not yet taken
        self._grad_norm: float | None = None  # √ΣM of the last probed step, until the next training log
        self._run_file = None if run_file is None else os.fspath(run_file)
        self._writer: RunWriter | None = None
        self._window: ExitStack | None = None
        self._handle: Any = None
        self._forward: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._ids: torch.Tensor | None = None
        self._grouped = (probe_options or {}).get("groups") is not None  # the run file keeps the group Grams

    # ------------------------------------------------------------------ the run file
    def run_meta(self) -> RunMeta:
        """The run file's metadata: agents, roles, how the Gram is measured, TRL's main settings."""
        config = {"trainer": "trl.GRPOTrainer", "loss_type": self.loss_type, "beta": self.beta,
                  "num_generations": self.num_generations, "learning_rate": self.args.learning_rate,
                  "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
                  "world_size": self.accelerator.num_processes}
        return RunMeta(agents=self.gradscope_agents, agent_roles=[self.gradscope_roles[a] for a in self.gradscope_agents],
                       roles=self.probe.roles, probe_method=self.probe.measurement, config=config, seed=self.args.seed,
                       update_unit=self._update_unit or "",
                       groups=self.probe.groups if self._grouped else [],
                       group_sizes=self.probe.group_sizes if self._grouped else [])

    def create_optimizer(self, *args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(*args, **kwargs)
        if self._update_unit is not None and self.probe.update_unit is None:  # once, whatever train() runs
            self.probe.attach(optimizer, self._update_unit)
            # registered after the probe's own hook: the step's split is ready when this one runs
            optimizer.register_step_post_hook(lambda *_: self._log_unlogged())
        return optimizer

    def train(self, *args: Any, **kwargs: Any) -> Any:
        if self._run_file is None:
            return super().train(*args, **kwargs)
        exists = [self.accelerator.is_main_process and os.path.lexists(self._run_file)]
        if self.accelerator.num_processes > 1:  # the main process' answer: every process refuses, none waits
            broadcast_object_list(exists)
        if exists[0]:  # (RunWriter's own message suggests overwrite=True, not ours to give)
            raise RunFileError(f"{self._run_file}: already exists; GradscopeGRPOTrainer never replaces a run file: "
                               "pass another run_file (one per train() call, also when resuming) or move this one")
        if not self.accelerator.is_main_process:
            return super().train(*args, **kwargs)
        with RunWriter(self._run_file, self.run_meta(), flush_every=1) as self._writer:  # live for gradscope watch
            try:
                return super().train(*args, **kwargs)
            finally:
                self._writer = None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # transformers evaluates at the last step whenever evaluation is on: the end-of-training summary is then
        # logged in eval mode, where TRL merges (and we take) none of the last window's training metrics
        summary = "train_runtime" in logs and not self.model.training and bool(self._metrics["train"])
        if summary:
            self.model.train()
        try:
            self._log(logs, start_time)
        finally:
            if summary:
                self.model.eval()

    def _log(self, logs: dict[str, float], start_time: float | None) -> None:
        regular = "loss" in logs  # the Trainer's log every logging_steps (loss, grad_norm, learning_rate, ...)
        # TRL merges its training metrics of the window into a log made in training mode: also into the
        # end-of-train summary (train_runtime, ...) when max_steps is not a multiple of logging_steps
        window = set(self._metrics["train"]) if self.model.training else set()
        training = regular or bool(window)
        if training and self._grad_norm is not None:  # as TRL's grad_norm: the window's last optimizer step
            logs[GRAD_NORM] = self._grad_norm
            self._grad_norm = None
        super().log(logs, start_time)
        if self._writer is None:
            return
        if training:  # not the gradscope/ statistics merged in: the run file holds their records, export derives them
            ours = {k: v for k, v in logs.items() if (regular or k in window) and not k.startswith(PREFIX)}
            self._writer.log_metrics(self.state.global_step, finite_items(ours))
        else:
            evals = {k[len(EVAL):]: v for k, v in logs.items() if k.startswith(EVAL) and isinstance(v, (int, float))}
            if evals:
                self._writer.log_eval(self.state.global_step, finite_items(evals))

    # ------------------------------------------------------------------ agents of the completions
    def _agent_of(self, example: dict[str, Any]) -> Any:
        if callable(self._agent):
            return self._agent(example)
        if self._agent not in example:
            raise ProbeError(f"no column or rollout field {self._agent!r} naming the agent; the examples "
                             f"have {sorted(example)}")
        return example[self._agent]

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        output = super()._generate_and_score_completions(inputs)  # rollout fields are merged into inputs
        if not self.model.training:  # an evaluation trains nothing: its completions need no agent
            return output
        loss_mask = output["completion_mask"] * output.get("tool_mask", 1)
        output[AGENT_IDS] = agent_ids([self._agent_of(x) for x in inputs], output["completion_mask"], loss_mask,
                                      self._agent_index)
        return output

    # ------------------------------------------------------------------ the probed backward
    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # reference and old log-probs
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)
        # the loss' forward, possibly in chunks of rows: tag its rows with their agents
        with self._handle.rows(self._ids.max(1).values) if self._handle is not None and self._ids is not None \
                else nullcontext():
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._forward = (out[0], out[1])
        return out

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> torch.Tensor:
        self._ids = inputs.get(AGENT_IDS)
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def training_step(self, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        if self._window is None:  # the first micro-batch of an optimizer step
            self._window = ExitStack()
            self._handle = self._window.enter_context(self.probe.step(self.state.global_step + 1))
        try:
            with self._probed_backward(model):
                loss = super().training_step(model, inputs, num_items_in_batch)
        except BaseException:
            window, self._window, self._handle = self._window, None, None
            window.__exit__(*sys.exc_info())  # the probe leaves .grad as the interrupted step would
            raise
        if self.accelerator.sync_gradients:  # the last micro-batch: clipping and the optimizer come next
            self._finish_step()
        return loss

    @contextmanager
    def _probed_backward(self, model: Any) -> Iterator[None]:
        """Route ``accelerator.backward`` through the probe; keep DDP from averaging (we sum at the end)."""
        accelerator = self.accelerator
        accelerator.backward = self._backward  # an instance attribute shadows the method
        try:
            with accelerator.no_sync(model) if accelerator.num_processes > 1 else nullcontext():
                yield
        finally:
            del accelerator.backward

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        accelerator = self.accelerator
        if (kwargs or accelerator.scaler is not None
                or accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU,
                                                        DistributedType.MULTI_GPU)):
            raise ProbeError(f"GradscopeGRPOTrainer supports plain and DDP training (fp32/bf16) only, not "
                             f"{accelerator.distributed_type} / fp16 loss scaling / {sorted(kwargs)}")
        if self._forward is None or self._ids is None:
            raise ProbeError("no probed forward to attribute: TRL's loss did not go through "
                             "_get_per_token_logps_and_entropies (unsupported TRL version?)")
        loss = loss / accelerator.gradient_accumulation_steps  # as Accelerator.backward scales it
        tensors = [t for t in self._forward if t is not None and t.requires_grad]
        grads = torch.autograd.grad(loss, tensors, allow_unused=True)
        token_loss = sum(g.detach() * t for g, t in zip(grads, tensors) if g is not None)
        self._forward = None
        if accelerator.num_processes > 1:  # the processes' gradients are summed, not averaged
            token_loss = token_loss / accelerator.num_processes
        self._handle.backward_tokens(token_loss, self._ids)

    def _finish_step(self) -> None:
        window, self._window = self._window, None
        window.close()
        result = self.gradscope_last = self._handle.result
        self._handle = None  # its step is closed: a later forward with grad (no training step) is not tagged
        if self.accelerator.num_processes > 1:
            self._sum_gradients()
        summary = probe_summary(result, self.gradscope_agents, self.gradscope_roles)
        self._grad_norm = summary.pop(GRAD_NORM, None)  # logged as TRL logs its grad_norm (see log)
        for name, value in summary.items():
            self._metrics["train"][name].append(value)  # TRL averages them over the logging window
        if self._writer is not None:
            self._unlogged = result
            if self._update_unit is None:
                self._log_unlogged()

    def _log_unlogged(self) -> None:
        """Write the probed step's record (with update attribution: after its optimizer step)."""
        result, self._unlogged = self._unlogged, None
        if result is not None and self._writer is not None:
            update = None if self._update_unit is None else self.probe.last_update
            self._writer.log_step(result.step, result.gram, result.tokens, method=result.method, update=update,
                                  group_gram=result.group_gram if self._grouped else None)
            for warning in result.warnings:  # a probe fallback or a failed self-check, with its reason
                self._writer.log_event(result.step, "probe", warning, severity="warning")

    def _sum_gradients(self) -> None:
        """Sum ``.grad`` of the trained parameters over the processes in one flat collective (a
        parameter without a gradient takes part with zeros and keeps None if no process has one)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([torch.zeros(p.numel() + 1, device=p.device, dtype=torch.float32) if p.grad is None
                          else torch.cat([p.grad.detach().reshape(-1).float(), p.grad.new_ones(1, dtype=torch.float32)])
                          for p in params])
        flat = self.accelerator.reduce(flat, reduction="sum")
        offset = 0
        for p in params:
            n = p.numel()
            if flat[offset + n] > 0:
                p.grad = flat[offset:offset + n].view_as(p).to(p.dtype).clone()
            offset += n + 1


def probe_summary(result: StepResult, agents: Sequence[str], roles: Mapping[str, str]) -> dict[str, float]:
    """The ``gradscope/...`` scalars of one probed step (what :class:`GradscopeGRPOTrainer` logs)."""
    _, cols = step_scalars(result.gram[None], result.tokens[None], [result.step], list(agents),
                           [roles[a] for a in agents])
    return finite_items({n: v[0] for n, v in cols.items()})
