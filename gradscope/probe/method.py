"""The pluggable part of the probe: how per-agent gradient contributions are measured.

A :class:`GramMethod` sees one probed step at a time: ``begin``, any number of ``backward`` /
``backward_rows`` calls (one per micro-batch), then ``end`` (or ``abort`` on error). After ``end``
every parameter's ``.grad`` must be what an unprobed step would have left, to fp32 rounding.
With a :class:`~gradscope.probe.store.Store` (sketch mode, data parallelism), ``end`` returns
``store.grams()``: the per-agent contributions must have gone into the store.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from gradscope.errors import ProbeError
from gradscope.probe.store import Store


#: Per-agent scalar loss terms, each tagged with its agent index.
Terms = Sequence[tuple[int, torch.Tensor]]


def token_terms(token_loss: torch.Tensor, agent_ids: torch.Tensor,
                agents: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
    """Per-agent scalar loss terms ``(k, Σ token_loss[agent_ids == k])`` for the given agents."""
    return [(k, token_loss[agent_ids == k].sum()) for k in agents]


class GramMethod(ABC):
    """Measures ``M^g_kl = <g_k, g_l>`` restricted to each parameter group ``g``.

    Args:
        params: the probed parameters, in any order.
        group_index: ``group_index[i]`` is the group of ``params[i]``; groups are ``0..n_groups-1``.
        n_agents: K.
        model: the module the parameters belong to (methods that hook layers need it), or None.
        store: where to put materialised per-agent contributions, and so how the Gram is formed and
            whether ranks are summed; None: the method's exact single-process default.
    """

    name: str = ""
    #: a newer probe took this one's layers over (hooks): the probe is closed
    superseded: bool = False

    def __init__(self, params: Sequence[nn.Parameter], group_index: Sequence[int], n_groups: int,
                 n_agents: int, *, model: nn.Module | None = None, store: Store | None = None) -> None:
        self.params = list(params)
        self.group_index = list(group_index)
        self.n_groups = n_groups
        self.n_agents = n_agents
        self.store = store

    @abstractmethod
    def begin(self) -> None:
        """Start a step: set aside any gradient already in ``.grad``."""

    #: What measured the step that just ended (a name of ``gradscope.runfile.schema.PROBE_METHODS``).
    record: str = "split"
    #: Warnings of the step that just ended (fallbacks, a failed self-check), for the run file.
    warnings: Sequence[str] = ()

    @abstractmethod
    def backward(self, terms: Terms, retain_graph: bool) -> None:
        """Back-propagate ``Σ terms`` (scalar losses, each tagged with its agent index)."""

    def backward_rows(self, loss: torch.Tensor, row_agents: torch.Tensor | None,
                      terms: Callable[[], Terms] | None, retain_graph: bool) -> None:
        """Back-propagate ``loss.sum()``, a loss whose rows (the model's batch rows) each belong to one agent.

        ``row_agents``: (B,) the agent of each row (-1: none), None when a row mixes agents;
        ``terms()``: the per-agent loss terms, None for a scalar loss (which cannot be split).
        Default (split): one backward per term.
        """
        if terms is None:
            raise ProbeError(f"method {self.name!r} cannot split a scalar loss by agent; pass per-row losses "
                             "(backward_rows with a (B,) loss) or per-token losses")
        self.backward(terms(), retain_graph)

    def tag(self, agents: torch.Tensor, batch_dim: int | None = None) -> AbstractContextManager[None]:
        """Forwards inside the block have row b of agent ``agents[b]`` (only hooks needs to know)."""
        return nullcontext()

    @abstractmethod
    def end(self) -> np.ndarray:
        """Finish the step; return the per-group Grams, float64 of shape (n_groups, K, K)."""

    @abstractmethod
    def abort(self) -> None:
        """Leave ``.grad`` as an unprobed step interrupted at this point would have."""

    def state_dict(self) -> dict[str, Any]:
        """What the method carries from step to step (plain Python values), for a checkpoint: a
        method restored with :meth:`load_state_dict` measures the next steps as this one would."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output (of a method of the same kind on the same model)."""

    def close(self) -> None:
        """Release whatever the method attached to the model (hooks); the method is unusable afterwards."""
