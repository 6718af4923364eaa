"""The training loop: rollouts of a workflow, GRPO updates per policy, probed, into a run file.

Training steps are numbered from 1. Every optimizer step of a probed training step is one run-file
record tagged with (step, policy); per-training-step metrics (reward, optimizer steps and update
size per policy, timings) go to ``/metrics``; evaluations on the held-out split go to ``/evals`` with
the number of completed steps (0 = the base model before any update).
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from contextlib import ExitStack, closing, nullcontext, suppress
from pathlib import Path

import numpy as np
import torch

from gradscope.alerts import Alert, Monitor, Rule, check_selectors
from gradscope.alerts.cli import collect_rules
from gradscope.alerts.watch import catch_up
from gradscope.errors import ConfigError, GradscopeError, GradscopeWarning
from gradscope.paths import kind_of
from gradscope.integrations.sinks import Sink, SinkWriter, check_sink, open_sink, parse_sinks, sink_dest
from gradscope.peft_support import adapter_parameters
from gradscope.probe import Probe
from gradscope.runfile import RunMeta, RunWriter, open_run
from gradscope.runfile.writer import check_overwrite, committed_below
from gradscope.trainers.checkpoint import (Checkpoint, check_folder, checkpoint_folder, clear_resume_points,
                                           find_checkpoint, has_resume_point, load_checkpoint, save_checkpoint)
from gradscope.trainers.config import RANGES, TrainConfig, check_resumable
from gradscope.trainers.distributed import Dist, NullWriter, world_size_from_env
from gradscope.trainers.grpo import STEP_SCALARS, GRPOUpdater
from gradscope.trainers.grpo_config import GRPO_RANGES, PER_ROLE, ROLE_BALANCE
from gradscope.trainers.models import DTYPES, LoraSpec, attach_adapters, check_model_path, load_base
from gradscope.trainers.per_role import role_values
from gradscope.trainers.policy import parse_policy
from gradscope.trainers.reward import Scorer, solver_answer
from gradscope.trainers.rollout import Diverged, Sampler
from gradscope.trainers.sandbox import unavailable_reason
from gradscope.trainers.tasks import check_answer, tasks_for
from gradscope.trainers.tasks.base import Task, TaskSet, same_tasks
from gradscope.trainers.testbed.scales import SCALES
from gradscope.trainers.workflows import WORKFLOWS, Templates
from gradscope.trainers.workflows.base import Episode, Workflow

PROBE_SPECS = ("gram", "gram,groups", "none")
UPDATE_UNITS = ("off", "role", "agent")
SOLVER_ROLES = ("voter", "generator", "worker")


def check_ranges(cfg: TrainConfig) -> None:
    """The numeric settings' checks (finite, in range; per-role ones are checked by :func:`validate`)."""
    for settings, ranges in ((cfg, RANGES), (cfg.grpo, GRPO_RANGES)):
        for name, allowed in ranges.items():
            if settings is cfg.grpo and name in PER_ROLE:
                continue  # checked role by role once the workflow's roles are known
            allowed.check(f"--{name.replace('_', '-')}", getattr(settings, name))


def validate(cfg: TrainConfig) -> tuple[type[Workflow], TaskSet, list[Rule]]:
    """Every check that can fail on user input, before any model is built (errors exit 2).
    Returns the workflow class, the tasks and the alert rules."""
    check_ranges(cfg)  # numbers first
    if cfg.workflow not in WORKFLOWS:
        raise ConfigError(f"unknown workflow {cfg.workflow!r}; use one of {sorted(WORKFLOWS)}")
    workflow = WORKFLOWS[cfg.workflow]
    roles = list(dict.fromkeys(workflow.agent_roles.values()))
    policy = parse_policy(cfg.policy, roles)
    rules = collect_rules(cfg.alert, cfg.alerts, cfg.default_alerts)
    check_selectors(rules, list(workflow.agents), [workflow.agent_roles[a] for a in workflow.agents],
                    policy.adapters)
    sinks = parse_sinks(cfg.log_to)
    if cfg.log_to.strip() and not sinks:
        raise ConfigError(f"--log-to {cfg.log_to!r} names no dashboard; use one or more of tensorboard,wandb,mlflow")
    if cfg.log_dir is not None and not sinks:
        raise ConfigError("--log-dir is the folder of the --log-to dashboards, and --log-to names none")
    if cfg.probe not in PROBE_SPECS:
        raise ConfigError(f"unknown --probe {cfg.probe!r}; use one of {PROBE_SPECS}")
    for name in PER_ROLE:
        role_values(getattr(cfg.grpo, name), roles, name.replace("_", "-"))
    if cfg.grpo.role_balance not in ROLE_BALANCE:
        raise ConfigError(f"unknown --role-balance {cfg.grpo.role_balance!r}; use one of {', '.join(ROLE_BALANCE)}")
    if cfg.probe_updates not in UPDATE_UNITS:
        raise ConfigError(f"unknown --probe-updates {cfg.probe_updates!r}; use one of {UPDATE_UNITS}")
    if cfg.probe_updates != "off" and (cfg.probe == "none" or cfg.probe_every != 1):
        raise ConfigError("--probe-updates needs every optimizer step probed (--probe-every 1, not --probe none): "
                          "the per-role moments follow every step's per-agent gradients")
    world = world_size_from_env()
    if world > 1 and any(role_values(cfg.grpo.coherence_reg, roles, "coherence-reg").values()):
        raise ConfigError("--coherence-reg is not supported under torchrun (it needs each role's global gradient)")
    if cfg.tasks_per_step % world:
        raise ConfigError(f"--tasks-per-step {cfg.tasks_per_step} must be a multiple of the {world} torchrun processes")
    check_model_path(cfg.model)
    if cfg.dtype not in ("auto", *DTYPES):
        raise ConfigError(f"unknown --dtype {cfg.dtype!r}; use auto, {', '.join(DTYPES)}")
    if cfg.scale not in SCALES:
        raise ConfigError(f"unknown --scale {cfg.scale!r}; use one of {', '.join(SCALES)}")
    out = Path(cfg.out)
    if cfg.resume and not os.path.lexists(out):  # every rank reads it (and the checkpoint) to resume
        raise ConfigError(f"--resume: {out} does not exist")
    if world_size_from_env() == 1:  # under torchrun rank 0 checks after the rendezvous (check_writer)
        check_writer(cfg)
    if cfg.task_file:  # a FIFO or a device would block or never end; a missing file: the loader says so
        with suppress(OSError):
            kind = kind_of(os.stat(cfg.task_file).st_mode)
            if kind is not None:
                raise ConfigError(f"--task-file {cfg.task_file}: is {kind}, not a file")
    tasks = tasks_for(cfg)
    if any(t.kind == "code" for t in tasks.train[:1] + tasks.held_out[:1]) and not cfg.unsafe_sandbox:
        reason = unavailable_reason()
        if reason is not None:
            raise ConfigError(f"code tasks run generated programs, and {reason}; "
                              "pass --unsafe-sandbox to run them anyway (docs/sandbox.md)")
    return workflow, tasks, rules


def check_writer(cfg: TrainConfig) -> None:
    """What only the writer (global rank 0) can check: its dashboards (a missing extra, an unusable
    ``--log-dir``) and the run file; other nodes may not see its folders."""
    for name in parse_sinks(cfg.log_to):
        check_sink(name, sink_dest(log_folder(cfg), name), new=not cfg.resume)
    check_out(cfg, Path(cfg.out))


def check_out(cfg: TrainConfig, out: Path) -> None:
    """The run file can be written: a new one, or one that ``--overwrite``/``--resume`` may replace."""
    if not cfg.resume and os.path.lexists(out) and not cfg.overwrite:
        raise ConfigError(f"{out} already exists (pass --overwrite to replace it, or --resume)")
    check_overwrite(out)  # --overwrite and --resume replace a run file, never a device, link or other file
    if not out.parent.is_dir():
        raise ConfigError(f"cannot write {out}: folder {out.parent} does not exist")
    try:  # probe writability with a fresh file of our own (O_EXCL), never touching another
        fd, probe_file = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".writable")
        os.close(fd)
        os.unlink(probe_file)
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror}") from None


def log_folder(cfg: TrainConfig) -> Path:
    """Where the ``--log-to`` dashboards write: ``--log-dir``, by default ``<out>.logs``."""
    return Path(cfg.log_dir or f"{cfg.out}.logs")


def check_checkpoints(cfg: TrainConfig, tasks: TaskSet) -> Checkpoint | None:
    """The checkpoint folder ``<out>.ckpt``, before any model is built (errors exit 2).

    A new run refuses to replace another run's resume point without ``--overwrite``. ``--resume``
    checks the settings against the run's stored config, and ``tasks`` against the tasks it was made
    on (its ``versions["tasks"]``; a file written before that was recorded: a warning that they cannot
    be checked), and returns the newest complete checkpoint,
    after checking that it was taken from this run file and that the file still holds every row it
    covers (its committed counters equal the file's rows up to its step). None: no checkpoint yet
    (a run killed before its first one starts over), allowed only while the file holds nothing
    after the base evaluation."""
    folder = checkpoint_folder(cfg.out)
    check_folder(folder)
    if not cfg.resume:
        if has_resume_point(folder) and not cfg.overwrite:
            raise ConfigError(f"{folder} holds the checkpoint of an earlier run (pass --overwrite to replace it, "
                              f"or --resume)")
        return None
    with open_run(cfg.out) as run:
        check_resumable(cfg, run.meta.config)
        check_same_tasks(cfg.out, run.meta.versions.get("tasks"), tasks)
        ckpt = find_checkpoint(folder)
        if ckpt is None:
            if committed_below(run, 1) != committed_below(run, 2**62):  # rows after the base evaluation
                raise ConfigError(f"--resume: no checkpoint in {folder}, but {cfg.out} holds training steps; "
                                  f"was the folder moved? (--overwrite starts the run over)")
            return None
        ckpt.check_world(world_size_from_env())
        if cfg.steps < ckpt.step:  # the file would keep steps past --steps, its config saying otherwise
            raise ConfigError(f"--resume: the checkpoint is at step {ckpt.step}; --steps must be at least "
                              f"{ckpt.step}, got {cfg.steps}")
        if ckpt.run_created is not None and ckpt.run_created != run.meta.created:
            raise ConfigError(f"--resume: checkpoint {ckpt.path} belongs to another run (created {ckpt.run_created}, "
                              f"{cfg.out} created {run.meta.created})")
        have = committed_below(run, ckpt.step + 1)
        for counter, want in (ckpt.committed or {}).items():
            if have[counter] != want:
                raise ConfigError(f"--resume: checkpoint {ckpt.path} covers {want} rows ({counter}) up to step "
                                  f"{ckpt.step}, but {cfg.out} holds {have[counter]}: the run file is not the one "
                                  f"the checkpoint was taken with")
    return ckpt


def check_same_tasks(out: str, stored: str | None, tasks: TaskSet) -> None:
    """ConfigError when the run file ``out`` was made on other tasks than ``tasks`` (its fingerprint
    ``stored``, :func:`same_tasks`); a GradscopeWarning (rank 0's) when that cannot be told."""
    now = tasks.fingerprint()
    same = same_tasks(stored, now)
    if same is None and os.environ.get("RANK", "0") == "0":
        warnings.warn(f"--resume: {out} does not record its tasks in this form (written before run files did, or "
                      f"by another gradscope): cannot check that these settings still give the tasks it was trained "
                      f"on", GradscopeWarning, stacklevel=2)
    elif same is False:
        raise ConfigError(f"--resume: {out} was trained on other tasks ({stored}) than its settings give now "
                          f"({now}): the task generator, split or file changed; --overwrite starts the run over")


class Trainer:
    """Builds everything from a config; :meth:`run` trains and writes the run file."""

    def __init__(self, cfg: TrainConfig, *, verbose: bool = False,
                 echo: Callable[[str], object] | None = None) -> None:
        workflow_cls, self.tasks, self.rules = validate(cfg)
        self.resume_from = check_checkpoints(cfg, self.tasks)
        self.echo = echo  # where alert lines go (None: standard error)
        self.stopped_by: Alert | None = None  # the alert whose ``stop`` ended the run
        self.diverged_at: int | None = None  # the step at which the policy could no longer be sampled
        self.stopped_after = 0                 # ... after this training step
        self.cfg = cfg = cfg.resolved()
        # One thread for the testbed: its hidden-128 matrices gain nothing from a second, and OpenMP
        # barriers stall every small op on a shared machine (2x slower with two threads, docs/training.md).
        torch.set_num_threads(cfg.threads)
        self.dist = dist = Dist.from_env(cfg.dist_timeout)  # a rendezvous: every rank has validated
        if dist.active:  # rank 0's checks of its run file and dashboards: every rank fails alike (none left waiting)
            error = None
            if dist.is_main:
                try:
                    check_writer(cfg)
                except GradscopeError as exc:  # ConfigError, or RunFileError (--overwrite onto a file no run's)
                    error = str(exc)
            if (error := dist.broadcast(error)) is not None:
                dist.close(finished=False)
                raise ConfigError(error)
        self.verbose = verbose and dist.is_main
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        # rank 0 builds the testbed's warm-start cache, the others then load it
        with dist.main_first() if cfg.model == "testbed" else nullcontext():
            base, tok, style = load_base(cfg.model, cfg.seed, verbose=self.verbose, scale=cfg.scale, dtype=cfg.dtype)
        self.policy = parse_policy(cfg.policy, list(dict.fromkeys(workflow_cls.agent_roles.values())))
        self.model = attach_adapters(base, self.policy.adapters, LoraSpec(cfg.lora_rank, cfg.lora_alpha), cfg.seed)
        if dist.rank:  # identical adapters everywhere, different rollouts on each rank
            torch.manual_seed(cfg.seed + 7919 * dist.rank)
        templates = Templates(style, tok)
        self.workflow = workflow_cls(templates, solver_answer, **(
            {"max_evals": cfg.max_evals} if cfg.workflow == "eval-opt" else {}))
        params = {a: [p for _, p in ps] for a, ps in adapter_parameters(self.model).items()}
        named = [(n, p) for ps in adapter_parameters(self.model).values() for n, p in ps]
        self.probe = Probe(self.model, list(self.workflow.agents), self.workflow.agent_roles, params=named,
                           groups="adapter" if cfg.probe == "gram,groups" else None,
                           sketch=cfg.probe_sketch or None)  # after the process group: it sums over ranks
        self.updater = GRPOUpdater(self.model, tok, self.policy, self.probe, params, cfg.grpo, cfg.seed, dist)
        if cfg.probe_updates != "off":
            for optimizer in self.updater.optimizers.values():
                self.probe.attach(optimizer, cfg.probe_updates)
        self.sampler = Sampler(self.model, tok, self.policy, max_new_tokens=cfg.max_new_tokens,
                               temperature=cfg.grpo.temperature)
        self.scorer = Scorer(unsafe=cfg.unsafe_sandbox)
        self.task_rng = random.Random(cfg.seed)

    def meta(self) -> RunMeta:
        per_group = self.cfg.probe == "gram,groups"
        return RunMeta(agents=list(self.workflow.agents),
                       agent_roles=[self.workflow.agent_roles[a] for a in self.workflow.agents],
                       roles=self.workflow.roles, policies=self.policy.adapters,
                       groups=self.probe.groups if per_group else [],
                       group_sizes=self.probe.group_sizes if per_group else [],
                       config=self.stored_config(),
                       seed=self.cfg.seed, scalar_names=STEP_SCALARS,
                       probe_method="none" if self.cfg.probe == "none" else self.probe.measurement,
                       update_unit=self.probe.update_unit or "", versions=self.base_versions())

    def base_versions(self) -> dict[str, str]:
        """The tasks' fingerprint (``versions["tasks"]``), and on the testbed its warm start's digest and
        whether it is the pinned build (``versions["testbed"]``)."""
        versions = {"tasks": self.tasks.fingerprint()}
        if self.cfg.model != "testbed":
            return versions
        from gradscope.trainers.testbed.cache import provenance  # imports transformers: not before a model

        return {**versions, "testbed": provenance(SCALES[self.cfg.scale])}

    def stored_config(self) -> dict:
        """The resolved config as the run file stores it (JSON types), with the world size."""
        return {**json.loads(json.dumps(dataclasses.asdict(self.cfg))), "world_size": self.dist.world}

    # ------------------------------------------------------------------ the loop
    def run(self, on_step: Callable[[int, dict[str, float]], None] | None = None,
            on_phase: Callable[[str], None] | None = None) -> Path:
        """Train to ``cfg.steps``, or until an alert's ``stop`` (then :attr:`stopped_by` is set, the
        step in progress is finished, checkpointed, and the last event is ``stop``).

        ``on_step(step, metrics)`` after each step (and ``on_step(0, {"eval_accuracy": ...})`` after the base
        evaluation); ``on_phase(name)`` when the work changes between
        ``"base evaluation"``, ``"training"`` and ``"evaluation"`` (for a progress display)."""
        phase = on_phase or (lambda name: None)
        cfg, out, dist = self.cfg, Path(self.cfg.out), self.dist
        ckpt_dir = checkpoint_folder(out)
        monitor = self._monitor(ckpt_dir)
        done = None  # the last step the checkpoint resumed from covers; None: start with the base evaluation
        if self.resume_from is not None:
            load_checkpoint(self.resume_from, self.model, self.updater, self)
            done = self.resume_from.step
            if dist.is_main:  # the rules' state (peaks, persistence, baselines) of the kept steps
                catch_up(out, monitor, below_step=done + 1)
        # the dashboards first: one that fails to open leaves the run file as it was (or not made)
        with ExitStack() as opened:  # a failure until the run writer exists closes the dashboards open
            sinks = self._open_sinks(opened) if dist.is_main else []
            if not dist.is_main:
                writer = NullWriter()
            elif cfg.resume:  # keeps the rows the checkpoint covers (all of them: checked), drops the rest
                writer = RunWriter.resume(out, keep_below_step=0 if done is None else done + 1,
                                          config=self.stored_config())
            else:
                writer = RunWriter(out, self.meta(), overwrite=cfg.overwrite)
                clear_resume_points(ckpt_dir)  # an earlier run's, replaced with --overwrite
            opened.pop_all()  # from here the SinkWriter closes them
        if sinks:
            writer = SinkWriter(writer, sinks, writer.meta.agents, writer.meta.agent_roles)
        monitor.writer = writer if dist.is_main else None
        step = done or 0
        with writer:
            try:
                if done is None:
                    phase("base evaluation")
                    evals = self.evaluate()
                    writer.log_eval(0, evals)
                    monitor.evals(0, evals)
                    if on_step is not None:
                        on_step(0, {"eval_accuracy": evals["accuracy"]})
                    if self._after(0, monitor, writer, ckpt_dir, scheduled=True):
                        return out  # stopped by the base evaluation: nothing trained
                for step in range((done or 0) + 1, cfg.steps + 1):
                    phase("training")
                    metrics = self.train_step(step, writer, monitor)
                    if cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps:
                        phase("evaluation")
                        evals = self.evaluate()
                        writer.log_eval(step, evals)
                        monitor.evals(step, evals)
                        metrics["eval_accuracy"] = evals["accuracy"]
                    scheduled = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 or step == cfg.steps
                    stop = self._after(step, monitor, writer, ckpt_dir, scheduled=bool(scheduled))
                    if on_step is not None:
                        on_step(step, metrics)
                    if stop:
                        break
            except Diverged as exc:  # the run cannot go on: say so in the file, which the writer then closes
                self.diverged_at = step
                writer.log_event(step, "diverged", str(exc), severity="error")
                raise
        return out

    def _open_sinks(self, stack: ExitStack) -> list[Sink]:
        """The ``--log-to`` dashboards, each in its folder under :func:`log_folder`, closed by ``stack``."""
        folder, run_name, config = log_folder(self.cfg), Path(self.cfg.out).stem, self.stored_config()
        return [stack.enter_context(closing(open_sink(name, sink_dest(folder, name), run_name=run_name, config=config)))
                for name in parse_sinks(self.cfg.log_to)]

    def _after(self, step: int, monitor: Monitor, writer: RunWriter, ckpt_dir: Path, scheduled: bool) -> Alert | None:
        """End of a step on every rank: rank 0's alert requests are broadcast (one collective), an
        alert checkpoint is saved to ``step<N>/``, the ``stop`` event recorded, ``latest/`` saved when
        scheduled or stopping (each checkpoint after flushing every row of the step); returns the
        alert that stops the run."""
        stop, asked = self.dist.broadcast((monitor.stop_requested, self._checkpoint_for))
        self._checkpoint_for = None
        if (asked is not None or scheduled or stop) and self.dist.is_main:
            writer.flush()  # a checkpoint must never run ahead of the committed run file (resume continues it)
        if asked is not None:
            path = save_checkpoint(ckpt_dir, step, self.model, self.updater, self, writer, name=f"step{step}")
            if self.dist.is_main:
                monitor.checkpointed(asked, path)
        if stop:  # the last event, before latest/ (which must cover it)
            self.stopped_by, self.stopped_after = stop, step
            writer.log_event(step, "stop", f"stopped after step {step} by [{stop.rule.label}]", severity="warning")
        if scheduled or stop:
            save_checkpoint(ckpt_dir, step, self.model, self.updater, self, writer)
        return stop

    def _monitor(self, ckpt_dir: Path) -> Monitor:
        """Alert rules on this run (rank 0 only; its writer is attached once open): every alert is
        recorded in the run file; ``checkpoint`` saves the adapters at the end of the step to
        ``<run>.ckpt/step<N>/`` (loadable with peft, and by ``--resume``)."""
        self._checkpoint_for: Alert | None = None

        def checkpoint(alert: Alert) -> None:
            self._checkpoint_for = self._checkpoint_for or alert  # saved (and reported) in _after

        wf = self.workflow
        return Monitor(self.rules if self.dist.is_main else [], list(wf.agents), [wf.agent_roles[a] for a in wf.agents],
                       policies=self.policy.adapters, checkpoint=checkpoint,
                       stop=lambda alert: None, update_unit=self.probe.update_unit or "",
                       **({"echo": self.echo} if self.echo else {}))

    def train_step(self, step: int, writer: RunWriter, monitor: Monitor | None = None) -> dict[str, float]:
        cfg = self.cfg
        t0 = time.perf_counter()
        batch = self.task_rng.sample(self.tasks.train, min(cfg.tasks_per_step, len(self.tasks.train)))
        mine = self.dist.shard(batch)  # whole GRPO groups stay on one rank
        episodes = self._sampled([t for t in mine for _ in range(cfg.grpo.group_size)])
        self.scorer.score(episodes)
        t1 = time.perf_counter()
        probed = (step - 1) % cfg.probe_every == 0 and cfg.probe != "none"
        logged, metrics = self.updater.update(step, episodes, cfg.grpo.mini_batch_size, probed)
        for o in logged:
            writer.log_step(step, o.result.gram, o.result.tokens, policy=o.policy, scalars=o.scalars,
                            group_gram=o.result.group_gram if cfg.probe == "gram,groups" else None,
                            method=o.result.method, update=o.update)
            for warning in o.result.warnings:  # a probe fallback or a failed self-check, with its reason
                writer.log_event(step, "probe", warning, severity="warning")
        metrics.update(_episode_metrics(self._everyone(episodes), prefix="train/"))
        metrics["time/rollout"], metrics["time/update"] = t1 - t0, time.perf_counter() - t1
        writer.log_metrics(step, metrics)
        if monitor is not None:
            if logged:
                monitor.step(step, np.stack([o.result.gram for o in logged]),
                             np.stack([o.result.tokens for o in logged]),
                             [o.policy for o in logged], [o.scalars for o in logged],
                             *_stack_updates(logged, len(self.probe.agents)))
            monitor.metrics(step, metrics)
        return metrics

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy and the per-role text signature, sampled with a fixed seed."""
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):  # evaluation must not move training's RNG streams
            torch.manual_seed(self.cfg.seed + 1_000_003 + self.dist.rank)
            episodes = self._sampled(self.dist.shard(self.tasks.held_out))
        self.scorer.score(episodes)
        return _episode_metrics(self._everyone(episodes), prefix="")

    def _sampled(self, tasks: list) -> list[Episode]:
        """The workflow's episodes on ``tasks`` (this rank's); when the policy cannot be sampled on any rank
        (:class:`Diverged`), every rank raises it (no rank left waiting in the next collective)."""
        try:
            episodes, failed = self.workflow.run(tasks, self.sampler), None
        except Diverged as exc:
            episodes, failed = [], str(exc)
        if self.dist.active:
            failed = next((f for f in self.dist.gather(failed) if f is not None), None)
        if failed is not None:
            raise Diverged(failed)
        return episodes

    def _everyone(self, episodes: list[Episode]) -> list[Episode]:
        """Every rank's episodes (rank order), for metrics over the whole step or held-out set."""
        return [ep for part in self.dist.gather(episodes) for ep in part] if self.dist.active else episodes


def _stack_updates(logged: Sequence, n_agents: int) -> tuple[np.ndarray, np.ndarray] | tuple[()]:
    """(N, C, C) update Grams and (N, C, K) interference of the logged steps, NaN where a step has none
    (skipped); () without update attribution."""
    shapes = {o.update.gram.shape[0] for o in logged if o.update is not None}
    if not shapes:
        return ()
    C = shapes.pop()
    grams = [np.full((C, C), np.nan) if o.update is None else o.update.gram for o in logged]
    inter = [np.full((C, n_agents), np.nan) if o.update is None else o.update.interference for o in logged]
    return np.stack(grams), np.stack(inter)


def _episode_metrics(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """accuracy (mean final reward); per role: mean output length (chars), format-valid rate,
    and for solver roles on math tasks, the fraction of their own answers that are correct."""
    out = {f"{prefix}accuracy": float(np.mean([ep.reward for ep in episodes]))}
    lengths, valid, right = defaultdict(list), defaultdict(list), defaultdict(list)
    for ep in episodes:
        for turn in ep.turns:
            lengths[turn.role].append(len(turn.sample.text))
            valid[turn.role].append(turn.valid)
            if turn.role in SOLVER_ROLES and ep.task.kind == "math":
                right[turn.role].append(_math_correct(ep.task, turn.sample.text))
    for role in lengths:
        out[f"{prefix}length/{role}"] = float(np.mean(lengths[role]))
        out[f"{prefix}format_valid/{role}"] = float(np.mean(valid[role]))
    for role, hits in right.items():
        out[f"{prefix}accuracy/{role}"] = float(np.mean(hits))
    return out


def _math_correct(task: Task, text: str) -> bool:
    answer, _ = solver_answer(task, text)
    return answer is not None and check_answer(task, answer)
