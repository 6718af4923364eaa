"""The pluggable part of the probe: how per-agent gradient contributions are measured.

A :class:`GramMethod` sees one probed step at a time: ``begin``, any number of ``backward`` calls
(one per micro-batch), then ``end`` (or ``abort`` on error). After ``end`` every parameter's
``.grad`` must be what an unprobed step would have left, to fp32 rounding.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn


class GramMethod(ABC):
    """Measures ``M^g_kl = <g_k, g_l>`` restricted to each parameter group ``g``.

    Args:
        params: the probed parameters, in any order.
        group_index: ``group_index[i]`` is the group of ``params[i]``; groups are ``0..n_groups-1``.
        n_agents: K.
    """

    name: str = ""

    def __init__(self, params: Sequence[nn.Parameter], group_index: Sequence[int], n_groups: int,
                 n_agents: int) -> None:
        self.params = list(params)
        self.group_index = list(group_index)
        self.n_groups = n_groups
        self.n_agents = n_agents

    @abstractmethod
    def begin(self) -> None:
        """Start a step: set aside any gradient already in ``.grad``."""

    @abstractmethod
    def backward(self, terms: Sequence[tuple[int, torch.Tensor]], retain_graph: bool) -> None:
        """Back-propagate ``Σ terms`` (scalar losses, each tagged with its agent index)."""

    @abstractmethod
    def end(self) -> np.ndarray:
        """Finish the step; return the per-group Grams, float64 of shape (n_groups, K, K)."""

    @abstractmethod
    def abort(self) -> None:
        """Leave ``.grad`` as an unprobed step interrupted at this point would have."""
