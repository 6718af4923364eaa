"""How far the hooks method's per-agent Grams may differ from autograd's by rounding alone.

The add-up check (``Σ_kl M_kl`` against ``‖Δ.grad‖²``) and the self-check (hooks' Gram against split's) allow
the differences below; see docs/probe.md, "Add-up check" and "Self-check".
"""
from __future__ import annotations

import numpy as np
import torch


def least_precise(dtypes: set[torch.dtype]) -> torch.dtype:
    return max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else torch.float32


def add_up_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    """``(tol, eps)`` of the add-up check for gradients of ``dtype``.

    ``|Σ_kl M_kl − ‖Δ.grad‖²|`` may be at most ``tol · (Σ_k ‖g_k‖)² + eps · (S (‖Δ.grad‖ + ‖Σ_k g_k‖) + S_ghost²)``:
    the first term is rounding relative to the agents' gradients (1e-4 fp32, 1e-8 fp64, 3e-2 16-bit);
    the second is rounding relative to what was summed into them. ``S`` bounds the norm of the
    rank-one token terms ``G_t A_tᵀ`` (``Σ_calls ‖G‖_F ‖A‖_F ≥ Σ_t ‖G_t‖‖A_t‖`` per weight, root-sum-square
    over the group's weights, plus ‖.grad‖ before the step); when they cancel (two identical rows with opposite
    advantages) the gradient is rounding noise of size ``eps · S`` that no relative tolerance allows.
    ``S_ghost²`` covers ghost weights, whose Gram is summed from products of token pairs. ``eps`` is
    64 machine epsilons, at most ``tol``.
    """
    tol = {torch.float64: 1e-8, torch.float32: 1e-4}.get(dtype, 3e-2)
    return tol, min(tol, 64 * torch.finfo(dtype).eps)


def differs(a: np.ndarray, b: np.ndarray, tol: float, eps: float, magnitude: np.ndarray) -> np.ndarray:
    """(G,) whether Grams ``a`` and ``b`` (G, K, K) differ beyond rounding: entry kl by more than
    ``10 tol √(M_kk M_ll) + 10 eps S (√M_kk + √M_ll + S)`` (M: the larger diagonal; S: the group's magnitude)."""
    d = np.sqrt(np.clip(np.maximum(np.diagonal(a, axis1=1, axis2=2), np.diagonal(b, axis1=1, axis2=2)), 0, None))
    S = magnitude[:, None, None]
    allowed = 10 * tol * d[:, :, None] * d[:, None, :] + 10 * eps * S * (d[:, :, None] + d[:, None, :] + S)
    return (np.abs(a - b) > allowed + np.finfo(np.float64).tiny).any(axis=(1, 2))
