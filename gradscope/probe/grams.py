"""(K, K) Grams of per-agent gradients from the forms the hooks method keeps them in.

Dense: the (K, m) per-agent gradients themselves. Ghost: a Linear weight's token rows ``(A, G, agent)``,
whose Gram never forms a d_out × d_in matrix. Touched rows: an embedding's ``(ids, G, agent)``, summed on
the distinct ids only.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def in_float64(gram_of: Callable[..., torch.Tensor], rows: list[torch.Tensor], K: int) -> torch.Tensor | None:
    """``gram_of(*rows, K)`` with its float rows in float64 (rarely: accumulate.PRECISE_BELOW); None when a float row is
    all zeros (the Gram is then exactly zero: no float64 copy)."""
    if not all(bool(r.any()) for r in rows if r.is_floating_point()):
        return None
    return gram_of(*[r.double() if r.is_floating_point() else r for r in rows], K)


def flat_gram(flat: torch.Tensor, K: int) -> torch.Tensor:
    """(K, K) ``flat flatᵀ`` of per-agent gradients flat (K, m)."""
    return flat @ flat.T


def ghost_gram(A: torch.Tensor, G: torch.Tensor, agents: torch.Tensor, K: int) -> torch.Tensor:
    """``M_kl = Σ_{i∈k, j∈l} (A Aᵀ)_ij (G Gᵀ)_ij`` for token rows A (N, d_in), G (N, d_out); (K, K) float64."""
    S = (A @ A.T).double() * (G @ G.T).double()
    P = F.one_hot(agents, K).double()
    return P.T @ S @ P


def touched_rows_gram(ids: torch.Tensor, G: torch.Tensor, agents: torch.Tensor, K: int) -> torch.Tensor:
    """Embedding Gram from token rows: per-agent gradients on the U distinct ids only, (K, U·d)."""
    uniq, inv = torch.unique(ids, return_inverse=True)
    R = G.new_zeros(K * len(uniq), G.shape[-1]).index_add_(0, agents * len(uniq) + inv, G)
    R = R.view(K, -1)
    return (R @ R.T).double()
