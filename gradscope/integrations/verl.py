"""gradscope for verl: a Gram record per optimizer step of verl's actor (docs/integrations.md, "verl").

verl (0.9) updates the actor in ``TrainingWorker.train_mini_batch``: one ``engine.train_batch`` per
mini-batch, i.e. ``forward_backward_batch`` (micro-batches: ``forward_step`` then ``loss.backward()``)
and ``optimizer_step``. :class:`VerlProbe` wraps those three methods of one engine instance:

* ``forward_backward_batch`` (training only) is one probed step (``Probe.step``), tagged with the
  training step and the policy;
* ``forward_step`` runs the engine's forward and verl's loss unchanged, then back-propagates the
  loss itself, attributed per agent: the loss reaches the model only through the logits ``z``
  (B, T, V), so with ``w = ∂loss/∂z`` the per-token surrogate ``ℓ_bt = Σ_v w_btv z_btv`` has exactly
  the loss's gradient (``.grad`` is the unprobed step's), and the probe's hooks split it by the row's
  agent (``backward_tokens``). The engine's own ``loss.backward()`` then sees a detached copy;
* ``optimizer_step`` runs verl's (clipping, skip on a non-finite norm) and records the step.

Each row's agent comes from a non-tensor field of the batch (``agent_field``, default
``agent_name``), its role from ``role_field`` (default ``role``), else ``roles``, else the agent
name. Under FSDP/data parallelism the probe sums the ranks' per-agent contributions; verl scales each
rank's loss by the data-parallel size D (FSDP averages gradients), so the summed Gram is divided by
D². FSDP leaves in ``.grad`` the reduced shard, not the rank's own gradient, so the probe is built
with ``grad_reduced=True`` there and √ΣM is compared with verl's ``grad_norm`` instead. Rank 0
writes the run file and evaluates the alert rules.

Switch it on for ``python -m verl.trainer.main_ppo`` by starting it through this module instead::

    python -m gradscope.integrations.verl gradscope.run=/shared/run.h5 <verl overrides...>

or, in your own process, ``VerlProbe(engine, VerlSettings(...))`` after ``engine.initialize()``.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradscope.alerts import Alert, Monitor, check_selectors
from gradscope.alerts.cli import collect_rules
from gradscope.errors import ConfigError, GradscopeError
from gradscope.probe import Probe
from gradscope.probe.layers import supported
from gradscope.probe.probe import StepResult
from gradscope.runfile import RunMeta, RunWriter

#: The worker processes read their settings (JSON) from this environment variable.
SETTINGS_ENV = "GRADSCOPE_VERL"
#: verl imports the modules listed here in every process that imports verl (its plugin hook).
VERL_MODULES_ENV = "VERL_USE_EXTERNAL_MODULES"
PLUGIN = "gradscope.integrations.verl"
#: Per-record scalars (names as in ``gradscope train``'s records): all global over the ranks.
SCALARS = ["loss", "grad_norm", "lr", "samples", "tokens"]
#: What the launcher says when verl or hydra cannot be imported.
MISSING_EXTRA = "the verl launcher needs verl and hydra: pip install 'gradscope[verl]'"
#: √ΣM may differ from verl's grad_norm by this relative amount (bf16 compute) before it is reported.
NORM_TOLERANCE = 0.05


class StopTraining(GradscopeError):
    """An alert asked to ``stop``: raised by the actor update on every rank after the run file is closed."""


@dataclass
class VerlSettings:
    """The ``gradscope.*`` keys of the verl config (docs/integrations.md)."""

    enabled: bool = True
    run: str = ""                      # the run file (.h5) that global rank 0 writes
    agent_field: str = "agent_name"    # non-tensor batch field naming each row's agent
    role_field: str = "role"           # non-tensor batch field naming each row's role (optional)
    agents: list = field(default_factory=list)   # Gram row order; empty: the agents of the first update
    roles: dict = field(default_factory=dict)    # agent → role, where the batch has no role field
    policy: str = "actor"              # the policy name of the actor's optimizer steps
    groups: str = ""                   # "", "layer" or "adapter": per-group Grams
    sketch: int = 0                    # 0: exact Gram; k: CountSketch with k buckets per group
    alert: list = field(default_factory=list)    # alert rules (docs/alerts.md)
    alerts: str = ""                   # a YAML file of alert rules
    default_alerts: bool = True
    overwrite: bool = False
    flush_every: int = 10

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, rules: bool = True) -> VerlSettings:
        """Validated settings; :class:`ConfigError` (one line) naming a bad or unknown key. ``rules=False``
        leaves the alert rules (and their file) to the probe's first update, where an error on any rank
        stops every rank alike."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(names))
        if unknown:
            raise ConfigError(f"unknown gradscope setting(s) {unknown}; known: {sorted(names)}")
        kwargs = {}
        for key, value in values.items():
            default = names[key].default if names[key].default is not dataclasses.MISSING else names[key].default_factory()
            kwargs[key] = _coerce(key, value, type(default))
        settings = cls(**kwargs)
        settings.check(rules=rules)
        return settings

    def check(self, rules: bool = True) -> None:
        if self.enabled and not self.run:
            raise ConfigError("gradscope.run: give the run file to write (e.g. gradscope.run=/shared/run.h5)")
        for key in ("policy", "agent_field"):  # an empty name would match no field / name no policy
            if not getattr(self, key):
                raise ConfigError(f"gradscope.{key} must not be empty (default {getattr(VerlSettings, key)!r})")
        if self.policy == "all":
            raise ConfigError("gradscope.policy must not be 'all' (analyses name the untagged records' set so)")
        if self.groups not in ("", "layer", "adapter"):
            raise ConfigError(f"gradscope.groups must be '', 'layer' or 'adapter', got {self.groups!r}")
        if self.sketch < 0 or self.flush_every < 1:
            raise ConfigError("gradscope.sketch must be >= 0 and gradscope.flush_every >= 1")
        if len(set(self.agents)) != len(self.agents):
            raise ConfigError(f"gradscope.agents must be distinct, got {self.agents}")
        comma = next((a for a in self.agents if "," in a), None)
        if comma is not None:  # "voter0,voter1" given as a string is one name: never what was meant
            raise ConfigError(f"gradscope.agents: {comma!r} is one name with a comma; give a list, "
                              f"gradscope.agents=[{comma}]")
        if rules:  # a bad rule fails here, once
            collect_rules(self.alert, self.alerts or None, self.default_alerts)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def _coerce(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if isinstance(value, bool):
            return value
    elif kind is list and isinstance(value, (list, tuple)) and all(map(_is_name, value)):
        return [str(v) for v in value]
    elif kind is list and isinstance(value, str):
        return [value]
    elif kind is dict and isinstance(value, Mapping) and all(map(_is_name, value.values())):
        return {str(k): str(v) for k, v in value.items()}
    elif kind is int and not isinstance(value, bool):
        try:
            return int(str(value))
        except ValueError:
            pass
    elif kind is str and isinstance(value, (str, int, float)):
        return str(value)
    kinds = {bool: "true or false", int: "an integer", str: "a string", list: "a list of names",
             dict: "a mapping of names to names"}
    raise ConfigError(f"gradscope.{key} must be {kinds[kind]}, got {value!r}")


def _is_name(value: Any) -> bool:
    """A value that reads as a name (``voter0``, ``1``), not a list or mapping to be stringified."""
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


class VerlProbe:
    """Probe every optimizer step of one verl training engine (an initialised ``FSDPEngine``).

    Args:
        engine: the actor's engine (``TrainingWorker.engine``), after ``initialize()``.
        settings: what to record and where; ``settings.run`` is written by global rank 0 only.
        echo: where alert lines go (default: standard error).

    Every rank of the engine's data-parallel group must build one and run the same updates. Wrap
    each training step's updates in :meth:`training_step` (the worker plug-in does it around
    ``train_mini_batch``); records are written and alerts evaluated when it exits.
    """

    def __init__(self, engine: Any, settings: VerlSettings, echo: Callable[[str], object] | None = None) -> None:
        # coerced and checked as from the config; the rules at the first update (a rank's node may lack their file)
        settings = VerlSettings.from_mapping(dataclasses.asdict(settings), rules=False)
        self.engine, self.settings, self.echo = engine, settings, echo
        if getattr(engine, "scaler", None) is not None:
            raise ConfigError("gradscope: fp16 loss scaling is not supported by the verl hook; use bf16 or fp32")
        self.dp = int(engine.get_data_parallel_size())
        self.group = engine.get_data_parallel_group() if self.dp > 1 else None
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        self.step = 0
        self.probe: Probe | None = None
        self.writer: RunWriter | None = None
        self.monitor: Monitor | None = None
        self.records: list[tuple[StepResult, dict[str, float]]] = []
        self._open_step = None        # the probed step (ProbeStep) of the running forward_backward_batch
        self._batch_scalars: dict[str, float] = {}
        self._logits: torch.Tensor | None = None
        self._pending: dict[str, Alert | None] = {"stop": None, "checkpoint": None}
        self._warned_norm = False
        self._wrap()

    # ------------------------------------------------------------------ wrapping the engine
    def _wrap(self) -> None:
        engine = self.engine
        fbb, fstep, ostep = engine.forward_backward_batch, engine.forward_step, engine.optimizer_step

        @functools.wraps(fbb)
        def forward_backward_batch(data, loss_function, forward_only=False):
            if forward_only:
                return fbb(data, loss_function, forward_only=True)
            return self._probed_batch(fbb, data, loss_function)

        @functools.wraps(fstep)
        def forward_step(micro_batch, loss_function, forward_only):
            if forward_only or self._open_step is None or loss_function is None:
                return fstep(micro_batch, loss_function=loss_function, forward_only=forward_only)
            return self._probed_micro_batch(fstep, micro_batch, loss_function)

        @functools.wraps(ostep)
        def optimizer_step():
            return self._optimizer_step(ostep)

        engine.forward_backward_batch, engine.forward_step, engine.optimizer_step = (
            forward_backward_batch, forward_step, optimizer_step)
        self._handle = engine.module.register_forward_hook(self._keep_logits)

    def _keep_logits(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        if self._open_step is not None and torch.is_grad_enabled():
            self._logits = getattr(output, "logits", None)

    # ------------------------------------------------------------------ one optimizer step
    def _probed_batch(self, fbb: Callable, data: Any, loss_function: Callable) -> Any:
        from verl.utils import tensordict_utils as tu

        for key, why in (("use_remove_padding", "packed micro-batches put several agents in one row"),
                         ("use_fused_kernels", "fused kernels never form the logits")):
            if tu.get_non_tensor_data(data=data, key=key, default=key == "use_remove_padding"):
                raise ConfigError(f"gradscope: the verl hook needs {key}=False "
                                  f"(actor_rollout_ref.model.{key}=False): {why}")
        if self.probe is None:
            self._build(data)
        else:  # every rank stops alike (one rank alone raising would leave the others in FSDP's collectives)
            self._agree(self._unknown_agents(data))
        with self.probe.step(self.step, policy=self.settings.policy) as s:
            self._open_step = s
            try:
                output = fbb(data, loss_function, forward_only=False)
            finally:
                self._open_step, self._logits = None, None
        local = torch.tensor([float(sum(output.get("loss", []) or [0.0])), float(data.batch_size[0])],
                             dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(local, group=self.group)
        self._batch_scalars = {"loss": float(local[0]) / self.dp, "samples": float(local[1]),
                               "tokens": float(tu.get_non_tensor_data(data=data, key="batch_num_tokens",
                                                                      default=float("nan")))}
        return output

    def _probed_micro_batch(self, fstep: Callable, micro_batch: Any, loss_function: Callable) -> Any:
        kept: dict[str, Any] = {}

        def keep_loss(model_output, data, dp_group=None):
            loss, metrics = loss_function(model_output=model_output, data=data, dp_group=dp_group)
            kept["loss"], kept["data"] = loss, data
            return loss, metrics

        loss, output = fstep(micro_batch, loss_function=keep_loss, forward_only=False)
        logits = self._logits
        if logits is None or "loss" not in kept or logits.dim() != 3:
            raise GradscopeError("gradscope: the verl hook did not see the model's (B, T, V) logits for this "
                                 "micro-batch (fused kernels or a custom model output?)")
        if not kept["loss"].requires_grad:
            return loss, output
        # The loss reaches the model only through the logits: its gradient is that of Σ w·z, w = ∂loss/∂z.
        (w,) = torch.autograd.grad(kept["loss"], logits)
        # (B, T) Σ_v w·z as a batched dot product (no (B, T, V) temporary); its gradient is exactly w.
        token_loss = (w.unsqueeze(-2) @ logits.unsqueeze(-1)).flatten(-3)
        agent_ids = self._token_agents(kept["data"], token_loss.detach() != 0)
        self._open_step.backward_tokens(token_loss, agent_ids)
        return loss.detach().requires_grad_(), output  # the engine's loss.backward() reaches no parameter

    def _token_agents(self, data: Any, carries_loss: torch.Tensor) -> torch.Tensor:
        """(B, T) agent index of every logit position that predicts a response token under verl's loss
        mask, or carries loss (``carries_loss``, (B, T) bool); -1 elsewhere."""
        from verl.workers.utils.padding import no_padding_2_padding

        B, T = carries_loss.shape
        device = carries_loss.device
        rows = torch.tensor([self.probe.agent_index(a) for a in self._row_agents(data)[0]], device=device)
        lengths = data["input_ids"].offsets().diff().tolist()
        flat = torch.arange(B * T, device=device).view(B, T)
        packed = torch.cat([flat[b, :n] for b, n in enumerate(lengths)])
        where = no_padding_2_padding(packed, data)                            # (B, R) logit position per slot
        mask = data["loss_mask"]
        mask = (torch.nested.to_padded_tensor(mask, 0) if mask.is_nested else mask).to(torch.bool)
        owned = carries_loss.reshape(-1).clone()
        owned[where[mask]] = True
        ids = rows[:, None].expand(B, T).reshape(-1).clone()
        ids[~owned] = -1
        return ids.view(B, T)

    def _optimizer_step(self, ostep: Callable) -> Any:
        lr = float(self.engine.optimizer.param_groups[0]["lr"])
        grad_norm = ostep()
        result = self.probe.last if self.probe is not None else None
        if result is not None and result.step == self.step:
            scale = 1.0 / self.dp ** 2  # each rank's loss carries a factor D that FSDP's averaging removes
            result = dataclasses.replace(result, gram=result.gram * scale, group_gram=result.group_gram * scale)
            scalars = {**self._batch_scalars, "grad_norm": float(grad_norm), "lr": lr}
            self.records.append((result, scalars))
            self._check_norm(result, float(grad_norm))
            self.probe.last = None
        return grad_norm

    def _check_norm(self, result: StepResult, grad_norm: float) -> None:
        """√ΣM must be verl's pre-clip gradient norm: a probed weight used outside its layer, or a loss
        reaching the model other than through the logits, would break it. Reported once, as an event."""
        total = math.sqrt(max(float(result.gram.sum()), 0.0))
        if self._warned_norm or not (math.isfinite(total) and math.isfinite(grad_norm)) or grad_norm == 0:
            return
        if abs(total / grad_norm - 1) > NORM_TOLERANCE:
            self._warned_norm = True
            message = (f"sqrt(sum M) = {total:.4g} but verl's grad_norm = {grad_norm:.4g}: the Gram does not add "
                       "up to the gradient (a probed weight used outside its layer, or a loss term not "
                       "through the logits)")
            warnings.warn("gradscope: " + message, RuntimeWarning, stacklevel=2)
            if self.writer is not None:
                self.writer.log_event(self.step, "probe", message, severity="warning")

    # ------------------------------------------------------------------ agents, probe, run file
    def _row_agents(self, data: Any) -> tuple[list[str], list[str] | None]:
        """Each row's agent and role (or None): a non-tensor field of the batch, or a key of its
        ``extra_fields`` column of dicts (verl's v1 trainer keeps agent-loop extra fields there)."""
        s = self.settings
        agents = _field(data, s.agent_field)
        if agents is None:
            raise ConfigError(f"gradscope: the actor batch has no non-tensor field {s.agent_field!r} naming each "
                              f"row's agent (gradscope.agent_field); fields: {sorted(data.keys())}")
        unnamed = sum(1 for a in agents if not _is_name(a) or str(a) in ("", "nan"))
        if unnamed:
            raise ConfigError(f"gradscope: {unnamed} of {len(agents)} rows have no agent in {s.agent_field!r} "
                              f"(None, empty or NaN); every row the actor trains on needs one")
        roles = _field(data, s.role_field)
        agents, roles = [str(a) for a in agents], None if roles is None else [str(r) for r in roles]
        piped = sorted({n for n in agents + (roles or []) if "|" in n})
        if piped:  # the run file's pair columns (cos/<A>|<B>) would be ambiguous
            raise ConfigError(f"gradscope: agent and role names must not contain '|': {piped}")
        return agents, roles

    def _unknown_agents(self, data: Any) -> str | None:
        """This rank's reason to stop before a step: rows without an agent, or of an agent the Gram lacks."""
        try:
            agents, _ = self._row_agents(data)
        except Exception as exc:  # noqa: BLE001 (returned, to stop every rank alike)
            return _one_line(exc)
        unknown = sorted(set(agents) - set(self.probe.agents))
        if unknown:
            return (f"gradscope: rows of agents {unknown} first seen after the first update; the Gram's agents are "
                    f"{self.probe.agents} (list every agent in gradscope.agents)")
        return None

    def _agree(self, error: str | None) -> None:
        """Raise this rank's ``error``, or any other rank's, as a :class:`ConfigError` on every rank."""
        if dist.is_initialized() and dist.get_world_size() > 1:
            errors: list = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            error = next((e for e in errors if e), None)
        if error:
            raise ConfigError(error)

    def _build(self, data: Any) -> None:
        """The probe (every rank alike), and on rank 0 the run file and the alert monitor."""
        s = self.settings
        error = None
        try:
            agents, roles = self._row_agents(data)
        except Exception as exc:  # noqa: BLE001 (whatever one rank raises, every rank stops with it)
            error = _one_line(exc)
        self._agree(error)
        role_of = dict(s.roles)
        pairs = [list(zip(agents, roles or [role_of.get(a, a) for a in agents]))]
        if self.group is not None:
            gathered: list = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(gathered, pairs[0], group=self.group)
            pairs = gathered
        for agent, role in (p for part in pairs for p in part):
            if role_of.setdefault(agent, role) != role:
                raise ConfigError(f"gradscope: agent {agent!r} has rows of two roles, {role_of[agent]!r} and {role!r}")
        seen = list(dict.fromkeys(a for part in pairs for a, _ in part))
        order = list(s.agents) or seen
        missing = [a for a in seen if a not in order]  # (an agent only in gradscope.roles has no rows: no matter)
        if missing:
            raise ConfigError(f"gradscope: rows of agents {missing} not listed in gradscope.agents {order}")
        roles_of = {a: role_of.get(a, a) for a in order}
        self.probe = Probe(self.engine.module, order, roles_of, params=_probed_params(self.engine.module),
                           groups=s.groups or None, sketch=s.sketch or None,
                           method="hooks", grad_reduced=self.group is not None,
                           process_group=self.group if self.group is not None else False)
        agent_roles = [roles_of[a] for a in order]
        # Whatever fails on one rank only (the alerts file on its node, rank 0's run file) stops every rank
        # alike: the rules are read and checked against the run's roles and agents on every rank before
        # rank 0 creates the run file.
        error, rules = None, []
        try:
            rules = collect_rules(s.alert, s.alerts or None, s.default_alerts)
            check_selectors(rules, order, agent_roles, [s.policy])
        except Exception as exc:  # noqa: BLE001
            error = _one_line(exc)
        self._agree(error)
        if self.is_main:
            try:
                meta = RunMeta(agents=order, agent_roles=agent_roles, policies=[s.policy],
                               groups=self.probe.groups if s.groups else [],
                               group_sizes=self.probe.group_sizes if s.groups else [],
                               config={"verl": _versions(), "gradscope": dataclasses.asdict(s),
                                       "data_parallel": self.dp},
                               probe_method=self.probe.measurement, scalar_names=SCALARS)
                self.writer = RunWriter(s.run, meta, flush_every=s.flush_every, overwrite=s.overwrite)
                self.monitor = Monitor(rules, order, agent_roles, policies=[s.policy], writer=self.writer,
                                       checkpoint=self._request_checkpoint, stop=self._request_stop,
                                       **({"echo": self.echo} if self.echo else {}))
            except Exception as exc:  # noqa: BLE001
                error = _one_line(exc)
        self._agree(error)

    def _request_checkpoint(self, alert: Alert) -> None:
        self._pending["checkpoint"] = self._pending["checkpoint"] or alert  # saved at the end of the step

    def _request_stop(self, alert: Alert) -> None:
        self._pending["stop"] = alert

    # ------------------------------------------------------------------ training steps
    @contextmanager
    def training_step(self) -> Iterator[None]:
        """One training step's actor updates: writes its records, ‖Δθ‖ metrics and alerts on exit."""
        self.step += 1
        self.records = []
        before = [p.detach().clone() for _, p in _probed_params(self.engine.module)]
        yield
        params = [p.detach() for _, p in _probed_params(self.engine.module)]
        delta_sq = _global_sum([(a - b).double().square().sum() for a, b in zip(params, before)])
        norm_sq = _global_sum([b.double().square().sum() for b in before])
        p = self.settings.policy
        metrics = {f"update_norm/{p}": math.sqrt(delta_sq), f"update_rel/{p}": math.sqrt(delta_sq / max(norm_sq, 1e-30)),
                   f"opt_steps/{p}": float(len(self.records))}
        if self.writer is not None:
            for result, scalars in self.records:
                self.writer.log_step(self.step, result.gram, result.tokens, policy=result.policy, scalars=scalars,
                                     group_gram=result.group_gram if self.settings.groups else None,
                                     method=result.method)
            self.writer.log_metrics(self.step, metrics)
        if self.monitor is not None:
            if self.records:
                self.monitor.step(self.step, np.stack([r.gram for r, _ in self.records]),
                                  np.stack([r.tokens for r, _ in self.records]),
                                  [r.policy for r, _ in self.records], [s for _, s in self.records])
            self.monitor.metrics(self.step, metrics)
        if self.writer is not None:
            self.writer.flush()
        self._act_on_alerts()

    def _act_on_alerts(self) -> None:
        """Rank 0's checkpoint/stop requests reach every rank (one broadcast); a checkpoint is verl's
        own (``engine.save_checkpoint``, collective), a stop closes the run file and raises."""
        pending = [self._pending["checkpoint"], self._pending["stop"]]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(pending, src=0)
        checkpoint, stop = pending
        self._pending = {"stop": None, "checkpoint": None}
        if checkpoint is not None:
            path = f"{self.settings.run}.ckpt/step{self.step}"
            self.engine.save_checkpoint(path, global_step=self.step)
            if self.monitor is not None:
                self.monitor.checkpointed(checkpoint, path)
        if stop is not None:
            if self.writer is not None:
                self.writer.log_event(self.step, "stop", f"stopped after step {self.step} by [{stop.rule.label}]",
                                      severity="warning")
            self.close()
            raise StopTraining(f"gradscope: alert [{stop.rule.label}] asked to stop after step {self.step}")

    def close(self) -> None:
        """Close the run file (rank 0) and give the engine back as it was (methods, hooks)."""
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.probe is not None:
            self.probe.close()
            self.probe = None
        for name in ("forward_backward_batch", "forward_step", "optimizer_step"):
            self.engine.__dict__.pop(name, None)  # the class's method again
        self._handle.remove()


def _one_line(exc: BaseException) -> str:
    """An exception as one line: gradscope's own as their message, others with their type."""
    text = str(exc) if isinstance(exc, GradscopeError) else f"gradscope: {type(exc).__name__}: {exc}"
    return " ".join(text.split())


def _as_list(values: Any) -> list:
    return values.tolist() if hasattr(values, "tolist") else list(values)


def _field(data: Any, name: str) -> list | None:
    """The non-tensor field ``name`` of a batch as a list, else that key of each row's ``extra_fields``
    dict (None if neither has it)."""
    if name in data.keys():
        return _as_list(data[name])
    if "extra_fields" in data.keys():
        extras = _as_list(data["extra_fields"])
        if extras and all(isinstance(e, Mapping) and name in e for e in extras):
            return [e[name] for e in extras]
    return None


def _probed_params(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The trainable weights of the model's ``nn.Linear`` / ``nn.Embedding`` layers (with LoRA: the adapters)."""
    out = []
    for name, m in module.named_modules():
        if supported(m):
            out += [(f"{name}.{n}", p) for n, p in m.named_parameters(recurse=False) if p.requires_grad]
    return out


def _global_sum(values: Sequence[torch.Tensor]) -> float:
    """Σ of per-parameter sums; FSDP shards (DTensors) are summed over their mesh."""
    total = 0.0
    for v in values:
        total += float(v.full_tensor() if hasattr(v, "full_tensor") else v)
    return total


def _versions() -> dict[str, str]:
    import verl

    return {"verl": getattr(verl, "__version__", "?")}


# ---------------------------------------------------------------------- the worker plug-in and launcher
def settings_from_env() -> VerlSettings | None:
    """The settings the launcher put in ``GRADSCOPE_VERL`` (JSON), or None when it is unset."""
    text = os.environ.get(SETTINGS_ENV)
    if not text:
        return None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{SETTINGS_ENV} is not JSON: {exc}") from None
    settings = VerlSettings.from_mapping(values, rules=False)  # the launcher read them; a worker's node may not
    if settings.enabled and not Path(settings.run).is_absolute():  # each Ray worker has its own directory
        raise ConfigError(f"{SETTINGS_ENV}: gradscope.run must be an absolute path, got {settings.run!r}")
    return settings


def attach(worker: Any, settings: VerlSettings) -> VerlProbe:
    """Probe a verl ``TrainingWorker``'s engine; each ``train_mini_batch`` call is one training step."""
    probe = VerlProbe(worker.engine, settings)
    mini_batch = worker.train_mini_batch

    @functools.wraps(mini_batch)
    def train_mini_batch(*args, **kwargs):
        with probe.training_step():
            return mini_batch(*args, **kwargs)

    worker.train_mini_batch = train_mini_batch
    worker.gradscope = probe
    atexit.register(probe.close)
    return probe


def install() -> None:
    """Patch verl's ``TrainingWorker.train_mini_batch`` (once per process) so that the first update of a
    language-model worker attaches a :class:`VerlProbe` when ``GRADSCOPE_VERL`` enables it. Runs when
    this module is imported with ``GRADSCOPE_VERL`` set (verl imports it in every process through
    ``VERL_USE_EXTERNAL_MODULES``, or ``actor_rollout_ref.model.external_lib``)."""
    from verl.workers.engine_workers import TrainingWorker

    original = TrainingWorker.train_mini_batch
    if getattr(original, "__gradscope__", False):
        return

    @functools.wraps(original)
    def train_mini_batch(self, *args, **kwargs):
        settings = settings_from_env()
        if (settings is None or not settings.enabled or getattr(self, "gradscope", None) is not None
                or getattr(self.config, "model_type", "language_model") != "language_model"):
            return original(self, *args, **kwargs)
        attach(self, settings)
        return self.train_mini_batch(*args, **kwargs)  # the instance's probed version

    train_mini_batch.__gradscope__ = True
    TrainingWorker.train_mini_batch = train_mini_batch


def split_overrides(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """``gradscope.KEY=VALUE`` (or ``+gradscope.KEY=VALUE``) overrides as settings, and the other arguments.

    Values use Hydra's override grammar (``gradscope.agents=[voter0,voter1]``,
    ``gradscope.roles={voter0:voter,voter1:voter}``).
    """
    try:
        from hydra.core.override_parser.overrides_parser import OverridesParser
    except ImportError:
        raise ConfigError(MISSING_EXTRA) from None

    ours, rest = [], []
    for arg in argv:
        (ours if arg.lstrip("+").startswith("gradscope.") else rest).append(arg)
    values: dict[str, Any] = {}
    if ours:
        try:
            parsed = OverridesParser.create().parse_overrides([a.lstrip("+") for a in ours])
        except Exception as exc:  # hydra's OverrideParseException and friends: one line
            raise ConfigError(f"bad gradscope override: {' '.join(str(exc).split())}") from None
        for override in parsed:
            key = override.key_or_group.split(".", 1)[1]
            if override.is_sweep_override():  # a=x,y is a hydra sweep, not a list
                choices = getattr(override.value(), "list", None)  # a ChoiceSweep's; a range(...) has none
                raise ConfigError(f"{override.input_line!r} is a hydra sweep (a comma outside brackets); give a "
                                  f"list: gradscope.{key}=[{','.join(map(str, choices or ['...']))}]")
            values[key] = override.value()
    return values, rest


def prepare(argv: Sequence[str]) -> tuple[VerlSettings, list[str]]:
    """Validate the gradscope overrides and hand them to every Ray worker verl starts (its runtime
    environment's variables): ``GRADSCOPE_VERL`` (the settings) and ``VERL_USE_EXTERNAL_MODULES`` (this
    module). Returns the settings and verl's own arguments."""
    values, rest = split_overrides(argv)
    settings = VerlSettings.from_mapping(values)
    settings.run = str(Path(settings.run).resolve()) if settings.run else ""
    if settings.enabled and Path(settings.run).is_dir():
        raise ConfigError(f"gradscope.run: {settings.run} is a folder; give the run file (.h5) to write")
    if settings.enabled and Path(settings.run).exists() and not settings.overwrite:
        raise ConfigError(f"gradscope.run: {settings.run} already exists (gradscope.overwrite=true replaces it)")
    if settings.enabled and not Path(settings.run).parent.is_dir():  # else only rank 0's worker would find out
        raise ConfigError(f"gradscope.run: cannot write {settings.run}: folder {Path(settings.run).parent} "
                          f"does not exist")
    try:
        from verl.trainer.constants_ppo import PPO_RAY_RUNTIME_ENV
    except ImportError:
        raise ConfigError(MISSING_EXTRA) from None

    env = PPO_RAY_RUNTIME_ENV["env_vars"]
    env[SETTINGS_ENV] = settings.to_json()
    modules = [m for m in os.environ.get(VERL_MODULES_ENV, "").split(",") if m]
    env[VERL_MODULES_ENV] = ",".join(dict.fromkeys([*modules, PLUGIN]))
    for key in (SETTINGS_ENV, VERL_MODULES_ENV):  # verl forwards only variables the driver does not have
        os.environ.pop(key, None)
    return settings, rest


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m gradscope.integrations.verl [gradscope.KEY=VALUE ...] <verl main_ppo overrides>``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        _, rest = prepare(argv)
    except GradscopeError as exc:
        print(f"gradscope: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    from verl.trainer.main_ppo import main as verl_main

    sys.argv = [sys.argv[0], *rest]
    verl_main()
    return 0


if os.environ.get(SETTINGS_ENV):
    install()

if __name__ == "__main__":
    sys.exit(main())
