"""The pluggable part of the probe: how per-agent gradient contributions are measured.

A :class:`GramMethod` sees one probed step at a time: ``begin``, any number of ``backward`` /
``backward_tokens`` calls (one per micro-batch), then ``end`` (or ``abort`` on error). After ``end``
every parameter's ``.grad`` must be what an unprobed step would have left, to fp32 rounding.
With a :class:`~gradscope.probe.store.Store` (sketch mode, data parallelism), ``end`` returns
``store.grams()``: the per-agent contributions must have gone into the store.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn

from gradscope.probe.store import Store


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

    @abstractmethod
    def backward(self, terms: Sequence[tuple[int, torch.Tensor]], retain_graph: bool) -> None:
        """Back-propagate ``Σ terms`` (scalar losses, each tagged with its agent index)."""

    def backward_tokens(self, token_loss: torch.Tensor, agent_ids: torch.Tensor, agents: Sequence[int],
                        retain_graph: bool) -> None:
        """Back-propagate ``token_loss.sum()``; ``agent_ids`` (same shape) holds each token's agent, -1 for none.

        ``agents`` lists the agent indices that own at least one token. Default: one term per agent.
        """
        self.backward(token_terms(token_loss, agent_ids, agents), retain_graph)

    @abstractmethod
    def end(self) -> np.ndarray:
        """Finish the step; return the per-group Grams, float64 of shape (n_groups, K, K)."""

    @abstractmethod
    def abort(self) -> None:
        """Leave ``.grad`` as an unprobed step interrupted at this point would have."""

    def close(self) -> None:
        """Release whatever the method attached to the model (hooks); the method is unusable afterwards."""
