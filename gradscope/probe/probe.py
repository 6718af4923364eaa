"""The probe: per-agent Gram matrices of a training step's gradient.

A training loop declares its agents and their roles once, then wraps each optimizer step::

    probe = Probe(model, agents=["voter0", "voter1", "voter2", "aggregator"],
                  roles={"voter0": "voter", "voter1": "voter", "voter2": "voter",
                         "aggregator": "aggregator"})
    with probe.step(step=t) as s:
        for batch in micro_batches:               # gradient accumulation is fine
            token_loss = per_token_loss(model, batch)        # (B, T), weighted as in the full loss
            s.backward_tokens(token_loss, batch.agent_ids)   # (B, T) agent index per token, -1: none
    result = s.result                             # StepResult: gram (K, K), tokens (K,), method
    optimizer.step()                              # .grad is exactly what token_loss.sum().backward() leaves

Per-row losses (``s.backward_rows(row_loss, agent_of_row)``), a scalar loss that sums or averages
rows (same call), and per-agent loss terms (``s.backward({agent: loss})``, one backward per agent)
work too. Each loss term must be normalised exactly as inside the full loss, so that ``Σ_k g_k = g``.

Under torchrun (torch.distributed initialised with several ranks) the Gram is that of the global
per-agent gradients, summed over ranks: see docs/distributed.md. ``sketch=k`` measures it through a
k-dimensional random projection per parameter group (docs/probe.md, "Sketch mode"). Given the
loop's torch AdamW (``optimizer=`` or :meth:`Probe.attach`), every optimizer step is also split into
per-role updates (docs/probe.md, "Update attribution"; ``probe.last_update``).
"""
from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from gradscope.errors import ProbeError
from gradscope.peft_support import adapter_parameters
from gradscope.probe.distributed import all_reduce_max, all_reduce_sum_, check_same_setup, resolve_group, world_size
from gradscope.probe.groups import GroupSpec, assign_groups
from gradscope.probe.hooks import HooksMethod
from gradscope.probe.layers import find_layers
from gradscope.probe.method import GramMethod, token_terms
from gradscope.probe.sketch import Sketch, SketchStore, as_sketch
from gradscope.probe.split import SplitMethod
from gradscope.probe.store import FlatStore, Store, accumulation_dtype
from gradscope.probe.updates import UNITS, UpdateAttribution, UpdateResult, covered_params, unit_names
from gradscope.runfile.schema import PROBE_METHODS

#: Available ways to measure the Gram; see docs/probe.md. ``method="auto"`` picks one of them.
METHODS: dict[str, type[GramMethod]] = {"split": SplitMethod, "hooks": HooksMethod}

ParamsLike = Iterable[tuple[str, nn.Parameter]] | Iterable[nn.Parameter]


@dataclass(frozen=True)
class StepResult:
    """What the probe measured for one optimizer step.

    Attributes:
        step: the training step the caller passed.
        policy: the policy (parameter set) this optimizer step updates, or None.
        gram: (K, K) float64, ``M_kl = <g_k, g_l>`` over all probed parameters (of the gradients summed
            over the ranks when distributed; estimated from sketches in sketch mode).
        group_gram: (G, K, K) float64, the same restricted to each parameter group (``Σ_g = gram``).
        tokens: (K,) int64, tokens attributed to each agent during the step (summed over the ranks).
        method: what measured the Gram: one of ``gradscope.runfile.schema.PROBE_METHODS`` (``"hooks"``,
            ``"hooks+check"``, ``"split"``, ``"split-fallback:<reason>"``), for the run file.
        warnings: what the probe had to warn about in this step (a fallback and why, a failed
            self-check), for the run file's events.
    """

    step: int
    policy: str | None
    gram: np.ndarray
    group_gram: np.ndarray
    tokens: np.ndarray
    method: str = "split"
    warnings: tuple[str, ...] = ()

    @property
    def finite(self) -> bool:
        """False when any gradient entry was NaN or infinite."""
        return bool(np.isfinite(self.gram).all())


class Probe:
    """Measures the per-agent Gram of every probed step of a model.

    Args:
        model: the trained module. Its parameters are probed unless ``params`` is given.
        agents: agent names, in the order of the Gram's rows (K of them).
        roles: agent name → role name, for every agent.
        params: the parameters to probe, as ``(name, param)`` pairs or bare parameters (then named
            by position). Default: every parameter with ``requires_grad`` plus every peft LoRA
            parameter, trainable or not (peft switches inactive adapters off).
        groups: per-group Grams: None (one group ``"all"``), ``"adapter"``, ``"layer"``, a function
            name → group, or ``{group: [name prefixes]}``.
        method: how to measure: ``"hooks"`` (one backward, layer hooks; every probed parameter must
            belong to an ``nn.Linear`` / ``nn.Embedding`` of ``model``), ``"split"`` (one backward
            per agent, any model), or ``"auto"``: hooks where it covers every probed parameter, else
            split. ``method_name`` holds the one chosen.
        sketch: None (exact), or k / :class:`Sketch` (k, seed): measure the Gram of a seeded k-bucket
            CountSketch of each agent's gradient per group; memory K·k per group instead of K·P.
        process_group: whose gradients make up the step's: None (default) sums over all ranks when
            torch.distributed is initialised with more than one, a process group sums over its ranks,
            False keeps this rank's gradients only. Fixed at construction (``world_size``), and every
            rank of the group must build the probe alike and probe the same steps (collectives).
        check_every: the hooks method's self-check against split: 0 (default) on the first probed step
            with per-row or per-token losses; n > 0 also every n probed steps after it; None never.
        grad_reduced: False (default): after each backward ``.grad`` holds this rank's own gradient. True:
            the training framework shards or reduces it over the ranks during the backward (FSDP, DDP), so
            the probe cannot compare its per-agent gradients with ``.grad``: it needs the hooks method
            (split reads ``.grad``), skips the add-up check (compare √ΣM with the global gradient norm),
            and its self-check differentiates every agent on every rank. See docs/probe.md.
        optimizer: a torch AdamW / Adam to attribute the updates of, as :meth:`attach` (None: none yet).
        update_unit: ``"role"`` (default) or ``"agent"``: what the updates are split into.

    ``measurement`` describes how the Gram is measured (e.g. ``"hooks+sketch(k=256,seed=0)+ranks(2)"``),
    for the run file's ``probe_method``.
    """

    def __init__(self, model: nn.Module | None, agents: Sequence[str], roles: Mapping[str, str], *,
                 params: ParamsLike | None = None, groups: GroupSpec = None, method: str = "auto",
                 sketch: int | Sketch | None = None,
                 process_group: dist.ProcessGroup | bool | None = None, check_every: int | None = 0,
                 grad_reduced: bool = False, optimizer: torch.optim.Optimizer | None = None,
                 update_unit: str = "role") -> None:
        if len(set(agents)) != len(agents) or not agents:
            raise ProbeError(f"agents must be a non-empty list of distinct names, got {list(agents)}")
        if update_unit not in UNITS:
            raise ProbeError(f"update_unit must be one of {UNITS}, got {update_unit!r}")
        missing = [a for a in agents if a not in roles]
        if missing:
            raise ProbeError(f"no role given for agents {missing}")
        if method != "auto" and method not in METHODS:
            raise ProbeError(f"unknown probe method {method!r}; available: {sorted(METHODS) + ['auto']}")
        if check_every is not None and (not isinstance(check_every, int) or isinstance(check_every, bool)
                                        or check_every < 0):
            raise ProbeError(f"check_every must be None or an integer >= 0, got {check_every!r}")
        self.sketch = as_sketch(sketch)
        self.process_group = resolve_group(process_group)
        self.world_size = world_size(self.process_group)
        self.agents = list(agents)
        self.agent_roles = [roles[a] for a in self.agents]
        self.roles = list(dict.fromkeys(self.agent_roles))
        named = _named_params(model, params)
        if not named:
            raise ProbeError("nothing to probe: no trainable parameters")
        self.param_names = [n for n, _ in named]
        self.groups, group_index = assign_groups(self.param_names, groups)
        self.group_sizes = [0] * len(self.groups)
        for (_, p), g in zip(named, group_index):
            self.group_sizes[g] += p.numel()
        self.method_name = _choose_method(method, model, named)
        if grad_reduced and self.method_name != "hooks":
            raise ProbeError("grad_reduced=True needs the hooks method (split reads each agent's gradient from .grad, "
                             f"which is then not this rank's); got method {self.method_name!r}"
                             + (" (auto: some probed parameters are not nn.Linear / nn.Embedding weights)"
                                if method == "auto" else ""))
        params_only = [p for _, p in named]
        self.params, self.group_index, self.grad_reduced = params_only, group_index, bool(grad_reduced)
        if self.process_group is not None:
            check_same_setup(self.process_group, {
                "agents": self.agents, "roles": self.agent_roles, "parameter names": self.param_names,
                "groups": self.groups, "parameter sizes": [str(p.shape) for p in params_only],
                "accumulation dtype": str(accumulation_dtype(params_only)), "method": self.method_name,
                "sketch": str(self.sketch), "grad_reduced": str(bool(grad_reduced)),
                "check_every": str(check_every)})
        store: Store | None = None
        if self.sketch is not None:
            store = SketchStore(params_only, self.param_names, group_index, len(self.groups), len(agents),
                                self.sketch, self.process_group)
        elif self.process_group is not None:
            store = FlatStore(params_only, group_index, len(self.groups), len(agents), self.process_group)
        self._index = {a: k for k, a in enumerate(self.agents)}
        self._open = False
        self._current: ProbeStep | None = None  # the open step's handle
        self._closed = False  # close() was called
        self.last: StepResult | None = None
        self._updates: UpdateAttribution | None = None
        if optimizer is not None:  # whatever can fail, before the method takes over any layer (and an older probe's)
            _check_attachable(optimizer, params_only, grad_reduced, update_unit, self.roles, self.agents)
            self._updates = UpdateAttribution(self, store, update_unit)
            self._updates.attach(optimizer)
            store = self._updates.store
        options = ({"strict": method == "hooks", "check_every": check_every, "grad_reduced": bool(grad_reduced)}
                   if self.method_name == "hooks" else {})
        try:
            self._method = METHODS[self.method_name](params_only, group_index, len(self.groups), len(agents),
                                                     model=model, store=store, **options)
        except BaseException:
            if self._updates is not None:  # (the optimizer's step hooks)
                self._updates.close()
            raise

    @property
    def measurement(self) -> str:
        """How the Gram is measured: the method, ``+sketch(k=..,seed=..)``, ``+ranks(N)`` when summed over N ranks."""
        parts = [self.method_name]
        if self.sketch is not None:
            parts.append(str(self.sketch))
        if self.process_group is not None:
            parts.append(f"ranks({self.world_size})")
        return "+".join(parts)

    @contextmanager
    def step(self, step: int, policy: str | None = None) -> Iterator["ProbeStep"]:
        """Probe one optimizer step; ``.result`` of the yielded object is set on exit."""
        if self._closed:
            raise ProbeError("the probe is closed (its hooks are removed); make a new Probe")
        if self._method.superseded:
            raise ProbeError("the probe is closed: a newer Probe hooks the same layers (one probe per layer); use it")
        if self._open:
            raise ProbeError("a probed step is already open; steps cannot nest")
        self._open = True
        handle = self._current = ProbeStep(self, step, policy)
        if self.process_group is not None:
            self._check_same_attachments()
        if self._updates is not None:
            self._updates.begin()
        self._method.begin()
        try:
            yield handle
        except BaseException:
            self._method.abort()
            raise
        else:
            grams = self._method.end()
            record = self._method.record
            if self.process_group is not None:
                handle.tokens = all_reduce_sum_(torch.from_numpy(handle.tokens), self.process_group).numpy()
                # the ranks' records differ where one fell back or made no checked call: every rank reports
                # the highest-numbered one (a fallback over the check over plain hooks)
                record = PROBE_METHODS[all_reduce_max([PROBE_METHODS.index(record)], self.process_group)[0]]
            handle.result = self.last = StepResult(step, policy, grams.sum(axis=0), grams, handle.tokens.copy(),
                                                   record, tuple(self._method.warnings))
            if self._updates is not None:
                self._updates.collected(handle.result)
        finally:
            self._open, self._current = False, None

    def attach(self, optimizer: torch.optim.Optimizer, unit: str = "role") -> None:
        """Split every step of ``optimizer`` (torch AdamW or Adam) into per-``unit`` updates (``"role"`` or
        ``"agent"``), from the per-agent gradients of the probed step before it; :attr:`last_update` holds
        the latest. Other optimizers, and ``grad_reduced=True``, raise ProbeError (unavailable). Attach
        between probed steps, before the optimizer's first step (moments it already holds count as
        ``unattributed``).
        """
        if self._open:
            raise ProbeError("attach the optimizer between probed steps")
        _check_attachable(optimizer, self.params, self.grad_reduced, unit, self.roles, self.agents)
        if self._updates is None:
            self._updates = UpdateAttribution(self, self._method.store, unit)
            self._method.store = self._updates.store  # per-agent gradients must be kept for the optimizer step
        elif unit != self._updates.unit:
            raise ProbeError(f"updates are already split by {self._updates.unit}; cannot also split by {unit}")
        self._updates.attach(optimizer)

    def _check_same_attachments(self) -> None:
        """Every rank must have attached the same optimizers (their collectives differ otherwise): one
        all-reduce of two integers per step under several ranks, the same ProbeError on every rank if not."""
        attached = "" if self._updates is None else f"{self._updates.unit}:{len(self._updates.trackers)}"
        try:
            check_same_setup(self.process_group, {"attached optimizers": attached})
        except ProbeError:
            self._open, self._current = False, None
            raise ProbeError("the ranks attached optimizers differently (Probe.attach): every rank must attach "
                             "the same optimizers, by the same unit, before the same step") from None

    @property
    def last_update(self) -> UpdateResult | None:
        """The latest step of an attached optimizer since the last probed step began (None: none)."""
        return None if self._updates is None else self._updates.last

    def update_state(self) -> list[dict[int, torch.Tensor]] | None:
        """The per-unit first moments of the attached optimizers, to save with their own state (None: none)."""
        return None if self._updates is None else self._updates.state_dict()

    def load_update_state(self, state: list[dict[int, torch.Tensor]]) -> None:
        """Restore :meth:`update_state` (same optimizers, attached in the same order)."""
        if self._updates is None:
            raise ProbeError("no optimizer is attached: nothing to restore update-attribution state into")
        self._updates.load_state_dict(state)

    @property
    def update_unit(self) -> str | None:
        """``"role"`` / ``"agent"`` once an optimizer is attached, else None."""
        return None if self._updates is None else self._updates.unit

    def state_dict(self) -> dict[str, Any]:
        """What the probe carries from step to step (the method's self-check schedule and outcome,
        its verified layer dimensions), plain Python values for a checkpoint."""
        return {"method": self.method_name, "state": self._method.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output: the next steps are measured as the saved probe's would
        be (a resumed run's ``/steps/method`` as an uninterrupted one's). ProbeError for another method's."""
        if not isinstance(state, Mapping) or not {"method", "state"} <= set(state):
            raise ProbeError("not a probe state: load_state_dict takes what Probe.state_dict() returned "
                             "(a mapping with 'method' and 'state')")
        if state["method"] != self.method_name:
            raise ProbeError(f"the saved probe state is of method {state['method']!r}, this probe uses "
                             f"{self.method_name!r}")
        self._method.load_state_dict(state["state"])

    def close(self) -> None:
        """Remove whatever the probe attached: the hooks method's layer hooks, the optimizers' step hooks;
        the probe is unusable afterwards (``step`` raises a ProbeError)."""
        self._closed = True
        self._method.close()
        if self._updates is not None:
            self._updates.close()

    def agent_index(self, agent: str) -> int:
        try:
            return self._index[agent]
        except KeyError:
            raise ProbeError(f"unknown agent {agent!r}; declared agents are {self.agents}") from None


def _check_attachable(optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], grad_reduced: bool,
                      unit: str, roles: Sequence[str], agents: Sequence[str]) -> None:
    """ProbeError when update attribution cannot follow ``optimizer`` over ``params``, split by ``unit``."""
    if grad_reduced:  # .grad is reduced or sharded by the framework: c and the split would not follow it
        raise ProbeError("update attribution is unavailable with grad_reduced=True (FSDP, DDP reducing .grad "
                         "in the backward): it reads the optimizer's gradient and state as this rank's own")
    unit_names(unit, roles, agents)
    covered_params(optimizer, params)


class ProbeStep:
    """The handle of an open probed step: attribute loss terms to agents with ``backward``."""

    def __init__(self, probe: Probe, step: int, policy: str | None) -> None:
        self._probe = probe
        self.step = step
        self.policy = policy
        self.tokens = np.zeros(len(probe.agents), dtype=np.int64)
        self.result: StepResult | None = None

    def _method(self) -> GramMethod:
        """The probe's method, for a call of this step: only while its ``with`` block is open (after it, a
        backward would add to ``.grad`` what no Gram holds)."""
        if self._probe._current is not self:
            raise ProbeError(f"step {self.step} is not open: its with block has ended (call backward inside it)")
        return self._probe._method

    def backward(self, losses: Mapping[str, torch.Tensor], tokens: Mapping[str, int] | None = None, *,
                 retain_graph: bool = False) -> None:
        """Back-propagate ``Σ_agent losses[agent]`` as ``loss.backward()`` would, attributed per agent.

        Args:
            losses: agent name → scalar loss term (normalised as inside the full loss).
            tokens: agent name → number of tokens behind its term, added to the step's counts.
            retain_graph: keep the graph after the last term, as in ``Tensor.backward``.
        """
        method = self._method()
        terms = []
        for agent, loss in losses.items():
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise ProbeError(f"loss term of {agent!r} must be a scalar tensor, got "
                                 f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}")
            terms.append((self._probe.agent_index(agent), loss))
        counts = np.zeros_like(self.tokens)
        for agent, n in (tokens or {}).items():
            counts[self._probe.agent_index(agent)] += int(n)
        if any(loss.requires_grad for _, loss in terms):
            method.backward(terms, retain_graph)
        self.tokens += counts

    @contextmanager
    def rows(self, agent_of_row: torch.Tensor | Sequence[int | str], batch_dim: int | None = None) -> Iterator[None]:
        """Tag the forwards inside the block: row b of their batch belongs to ``agent_of_row[b]``.

        Args:
            agent_of_row: (B,) agent index (or name) of each row of the batch; -1 (or None) for a row
                of no agent, whose loss must be 0.
            batch_dim: which dimension of each hooked layer's input is the batch (default: the one of
                size B, taken unchecked only when it is the leading one and no other has size B; a guess
                otherwise, which the self-check verifies or, where no check runs, split measures).

        Tagged forwards are matched to their rows whatever order the losses are concatenated in, and
        any number of them may precede one backward (e.g. one forward per role).
        """
        if batch_dim is not None and (type(batch_dim) is not int or batch_dim < 0):
            raise ProbeError(f"batch_dim must be a non-negative dimension index of the layers' inputs, got {batch_dim!r}")
        method = self._method()
        agents = self._agents(agent_of_row)
        with method.tag(agents, batch_dim):
            yield

    def backward_rows(self, row_loss: torch.Tensor, agent_of_row: torch.Tensor | Sequence[int | str], *,
                      tokens: torch.Tensor | Sequence[int] | None = None, retain_graph: bool = False) -> None:
        """Back-propagate a loss whose rows (the model's batch rows) each belong to one agent.

        Args:
            row_loss: (B,) per-row loss, already weighted as in the full loss (``loss = row_loss.sum()``),
                or a scalar that is a sum or mean of per-row losses (a framework's loss): hooks then
                attributes each row's share, but split cannot split a scalar, so a scalar needs the
                hooks method and rows it can match (else a ProbeError says so).
            agent_of_row: (B,) agent index (or name) of each row; -1 (or None) for none (zero loss).
            tokens: (B,) tokens of each row, added to its agent's count (default: none counted).
            retain_graph: keep the graph, as in ``Tensor.backward``.
        """
        method = self._method()
        agents = self._agents(agent_of_row)
        _tensor(row_loss, "row_loss")
        if row_loss.dim() not in (0, 1) or (row_loss.dim() == 1 and len(row_loss) != len(agents)):
            raise ProbeError(f"row_loss must be a scalar or have shape ({len(agents)},) like agent_of_row, "
                             f"got {tuple(row_loss.shape)}")
        if row_loss.dim() == 1 and bool((row_loss.detach()[agents < 0] != 0).any()):
            raise ProbeError("rows with agent -1 carry non-zero loss; mask them out or attribute them")
        counts = np.zeros_like(self.tokens)
        if tokens is not None:
            per_row = torch.as_tensor(tokens).reshape(-1)
            if len(per_row) != len(agents):
                raise ProbeError(f"tokens must have one count per row ({len(agents)}), got {len(per_row)}")
            counts += np.bincount(agents[agents >= 0].cpu().numpy(), per_row[agents.cpu() >= 0].cpu().numpy(),
                                  minlength=len(self.tokens)).astype(np.int64)
        if row_loss.requires_grad:
            present = sorted(set(agents[agents >= 0].tolist()))
            terms = None if row_loss.dim() == 0 else (lambda: token_terms(row_loss, agents.to(row_loss.device),
                                                                          present))
            method.backward_rows(row_loss, agents, terms, retain_graph)
        self.tokens += counts

    def backward_tokens(self, token_loss: torch.Tensor, agent_ids: torch.Tensor, *,
                        retain_graph: bool = False) -> None:
        """Back-propagate ``token_loss.sum()``, attributing each token to the agent that wrote it.

        Args:
            token_loss: (B, T) per-token loss, already weighted as in the full loss.
            agent_ids: (B, T) integer agent index per token; -1 for tokens of no agent (prompt,
                padding), whose loss must be 0. One agent's tokens may span many sequences.
        """
        method = self._method()
        _tensor(token_loss, "token_loss")
        _tensor(agent_ids, "agent_ids")
        if token_loss.shape != agent_ids.shape:
            raise ProbeError(f"token_loss {tuple(token_loss.shape)} and agent_ids {tuple(agent_ids.shape)} "
                             "must have the same shape")
        _integers(agent_ids, "agent_ids")
        if agent_ids.numel() and int(agent_ids.min()) < -1:  # as backward_rows and rows(): only -1 means no agent
            raise ProbeError(f"agent ids must be in [-1, {len(self.tokens) - 1}], got {int(agent_ids.min())}")
        unowned = agent_ids < 0
        if bool((token_loss.detach()[unowned] != 0).any()):
            raise ProbeError("tokens with agent id -1 carry non-zero loss; mask them out or attribute them")
        counts = torch.bincount(agent_ids[~unowned].reshape(-1), minlength=len(self.tokens))
        if counts.numel() > len(self.tokens):
            raise ProbeError(f"agent id {counts.numel() - 1} out of range for {len(self.tokens)} agents")
        if token_loss.requires_grad:
            agents = [k for k, n in enumerate(counts.tolist()) if n > 0]
            method.backward_rows(token_loss, _row_agents(agent_ids), lambda: token_terms(token_loss, agent_ids, agents),
                                 retain_graph)
        self.tokens += counts.cpu().numpy()

    def _agents(self, agent_of_row: torch.Tensor | Sequence[int | str]) -> torch.Tensor:
        """(B,) int64 agent indices from indices or names (-1 / None: no agent)."""
        if isinstance(agent_of_row, torch.Tensor):
            agents = _integers(agent_of_row, "agent_of_row").reshape(-1).long()
        else:
            agents = torch.tensor([self._agent(a) for a in agent_of_row], dtype=torch.long)
        if len(agents) and (int(agents.max()) >= len(self.tokens) or int(agents.min()) < -1):
            raise ProbeError(f"agent ids must be in [-1, {len(self.tokens) - 1}], got {agents.tolist()[:8]}...")
        return agents

    def _agent(self, a: object) -> int:
        """An agent index from one entry of a sequence: a name, an integer index, or None (no agent: -1)."""
        if a is None:
            return -1
        if isinstance(a, str):
            return self._probe.agent_index(a)
        if isinstance(a, numbers.Integral) and not isinstance(a, (bool, np.bool_)):
            return int(a)
        if isinstance(a, torch.Tensor) and a.dim() == 0:  # an entry of list(agent_tensor)
            return int(_integers(a, "agent_of_row"))
        raise ProbeError(f"an agent must be a name, an integer index or None, got {a!r} ({type(a).__name__})")


def _tensor(x: object, name: str) -> None:
    """Refuse anything but a tensor for ``name``, with a ProbeError rather than an AttributeError later."""
    if not isinstance(x, torch.Tensor):
        raise ProbeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _integers(ids: torch.Tensor, name: str) -> torch.Tensor:
    """``ids``, refused unless of an integer dtype (a float 1.7 or a bool is no agent index)."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ProbeError(f"{name} must be integers, got {ids.dtype}")
    return ids


def _row_agents(agent_ids: torch.Tensor) -> torch.Tensor | None:
    """(B,) the agent of each row (-1: no agent tokens), or None if some row holds two agents' tokens."""
    ids = agent_ids.reshape(agent_ids.shape[0], -1)
    hi = ids.max(1).values
    lo = torch.where(ids < 0, hi[:, None], ids).min(1).values
    return None if bool((lo != hi).any()) else hi


def _choose_method(method: str, model: nn.Module | None, named: list[tuple[str, nn.Parameter]]) -> str:
    """``method`` itself, or for ``"auto"`` hooks when it covers every probed parameter, else split."""
    if method not in ("hooks", "auto"):
        return method
    if model is None:
        if method == "hooks":
            raise ProbeError("method='hooks' needs the model (its layers are hooked); pass it or use method='split'")
        return "split"
    _, uncovered = find_layers(model, [p for _, p in named])
    if uncovered and method == "hooks":
        names = [f"{named[i][0]} ({why})" for i, why in uncovered.items()]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise ProbeError(f"method='hooks' attributes the weights and biases of exactly nn.Linear and nn.Embedding "
                         f"(not sparse, not scale_grad_by_freq) layers, each held by one module (peft LoRA included); "
                         f"{len(names)} probed parameter(s) are not: {shown}. Use method='split' (or 'auto', which "
                         "then picks split)")
    return "split" if uncovered else "hooks"


def _named_params(model: nn.Module | None, params: ParamsLike | None) -> list[tuple[str, nn.Parameter]]:
    if params is not None:
        items = list(params)
        pairs = [isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor) for item in items]
        bare = [isinstance(item, torch.Tensor) for item in items]
        if not (all(pairs) or all(bare)):
            raise ProbeError("params must be all (name, parameter) pairs or all parameters, not a mix or anything "
                             f"else; got {sorted({type(item).__name__ for item in items})}")
        named = ([(str(n), p) for n, p in items] if all(pairs)
                 else [(f"param{i}", p) for i, p in enumerate(items)])
    elif model is None:
        raise ProbeError("give a model or an explicit params list")
    else:
        lora = {id(p) for ps in adapter_parameters(model).values() for _, p in ps}
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad or id(p) in lora]
    seen: set[int] = set()
    unique = []
    for name, p in named:  # tied weights appear once
        if id(p) not in seen:
            seen.add(id(p))
            unique.append((name, p))
    twice = sorted(n for n, c in Counter(n for n, _ in unique).items() if c > 1)
    if twice:  # a name keys the parameter's groups, state and sketch hashes: two would share them
        raise ProbeError(f"params: two parameters are both named {twice[0]!r}; give each (name, param) pair a name of "
                         "its own (e.g. from model.named_parameters(), not each submodule's)")
    return unique
