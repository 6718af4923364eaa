"""Which row is whose: the forwards of the model that hooks saw, their layer calls, and the rows' agents.

A :class:`Forward` is one grad-enabled forward of the model, with the agent of each of its B rows (given
with it, or taken from the loss at the backward); a :class:`Piece` is one call of a hooked layer in it,
waiting for its output gradient, with the dimension of its input that holds the rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradscope.probe.layers import Layer


@dataclass(eq=False)
class Forward:
    """One grad-enabled forward of the model: its layer calls and the agent of each of its rows."""

    tag: torch.Tensor | None = None   # (B,) agents given with the forward (s.rows), or None
    batch_dim: int | None = None      # given with the tag
    positions: int = 0                # of the model call's inputs, the most (:func:`positions`; 0: no model call seen)
    pieces: list["Piece"] = field(default_factory=list)
    consumed: bool = False            # a backward has reached it
    rows: int = 0
    agents: torch.Tensor | None = None  # (rows,) agent per row, -1 for none; set for a hooks call
    keep: torch.Tensor | None = None    # indices of the rows with an agent
    n_kept: int = 0                     # their number
    kept: torch.Tensor | None = None    # their agents
    single: int | None = None           # the agent, when every row is that agent's
    mixed: bool = False                 # rows of several agents (or of none): attribution depends on the rows
    by_agent: dict[int, torch.Tensor] = field(default_factory=dict)  # row indices per agent
    unowned: torch.Tensor | None = None  # indices of rows of no agent (their gradient must be 0)
    _onehot: torch.Tensor | None = None  # (onehot's cache)

    def onehot(self, n_agents: int, dtype: torch.dtype) -> torch.Tensor:
        """(K, rows) ``[agent(b) == k]`` in ``dtype`` (a row of no agent: a zero column), made once per forward."""
        if self._onehot is None or self._onehot.dtype != dtype:
            self._onehot = (self.agents[None, :] == torch.arange(n_agents, device=self.agents.device)[:, None]).to(dtype)
        return self._onehot

    def owned(self, per_row: torch.Tensor) -> torch.Tensor:
        """The rows with an agent of ``per_row`` (rows, ...): itself, not a gathered copy, when every row has one."""
        return per_row if self.n_kept == self.rows else per_row[self.keep]

    def attach(self, agents: torch.Tensor) -> None:
        self.rows = len(agents)
        self.agents = agents
        self.keep = (agents >= 0).nonzero().squeeze(1)
        self.kept = agents[self.keep]
        self.n_kept = len(self.keep)
        present = sorted(set(agents.tolist()))
        self.mixed = len(present) > 1
        self.single = present[0] if len(present) == 1 and present[0] >= 0 else None
        self.by_agent = {k: (agents == k).nonzero().squeeze(1) for k in present if k >= 0}
        self.unowned = (agents < 0).nonzero().squeeze(1) if -1 in present and len(present) > 1 else None
        self._onehot = None

    def release(self) -> None:
        """Let go of the calls' inputs and graph edges (see :meth:`gradscope.probe.hooks.HooksMethod._prune`)."""
        for piece in self.pieces:
            piece.inputs = piece.edge = None


@dataclass(eq=False, slots=True)
class Piece:
    """One call of a hooked layer, waiting for its output gradient."""

    layer: Layer
    forward: Forward
    inputs: torch.Tensor | None
    dim: int = 0              # the batch dimension of ``inputs``
    ambiguous: bool = False   # the batch dimension is a guess by size (see HooksMethod._match), not verified
    pooled: bool = False      # its input holds B positions, its forward more: a guess in every step
    candidates: tuple = ()    # the input's dimensions of size B
    index: int = 0            # the call's place among its layer's calls in its forward (0: the first)
    edge: object = None       # the output's GradientEdge: reachable from a loss? its gradient (self-check)
    trained: tuple | None = None  # (weight, bias) the call trained, where a probed one was frozen when it ran


class Fallback(Exception):
    """A call hooks cannot attribute: ``reason`` (a PROBE_METHODS suffix) and what to tell the user."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def positions(x: torch.Tensor | None) -> int:
    """The positions a model input holds: token ids (integers) all of them, vectors (floating point: features on
    the last axis) ``numel / d``; 0 for no tensor."""
    if x is None:
        return 0
    return x.numel() // x.shape[-1] if x.is_floating_point() and x.dim() > 1 and x.shape[-1] else x.numel()


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (a layer called now is a checkpoint's
    recomputation); torch.utils.checkpoint asks autograd the same way."""
    return torch._C._current_graph_task_id() != -1


def reachable_nodes(loss: torch.Tensor) -> set[int]:
    """ids of the autograd nodes a backward of ``loss`` reaches (a walk of its graph, only needed when
    several forwards are candidates)."""
    seen: set[int] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        stack.extend(n for n, _ in node.next_functions)
    return seen


def guessed(piece: Piece) -> str:
    """Why a call's batch dimension is a guess (:meth:`gradscope.probe.hooks.HooksMethod._match`), for messages."""
    B, dims = piece.forward.rows, piece.candidates
    why = (f"its input holds B = {B} vectors where its forward holds more positions (or the model's own call was "
           "not seen): vectors selected or routed to it (a head on the scored tokens, MoE experts) or pooled per "
           "row, which shapes cannot tell apart" if piece.pooled else
           f"several dimensions of its input, {list(dims)}, have size B = {B} (a sequence-first (T, B, d) input "
           "with T == B?)" if len(dims) > 1 else
           f"the only dimension of its input of size B = {B} is dimension {dims[0]}, not the leading one: the batch "
           "of a sequence-first (T, B, d) input, or the sequence axis of a chunk of the batch with T == B")
    return f"layer {piece.layer.name!r}: {why}; dimension {piece.dim} is taken as the batch one by its size only"


def remedy(piece: Piece) -> str:
    """What makes a guessed call attributable, for messages."""
    if piece.pooled:
        return ("if its input holds one vector per row, declare it: s.rows(agent_of_row, batch_dim=0); vectors "
                "selected or routed to it only a self-check in the same step verifies (check_every=1), or use "
                "method='split'")
    return "tag the forward with s.rows(agent_of_row, batch_dim=d)"


def by_row(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` (..., d) as (rows, T, d), without a reshape op where it already is (hundreds of calls a step)."""
    return x if x.dim() == 3 and x.shape[0] == rows else x.reshape(rows, -1, x.shape[-1])
