"""Sketched Grams: a fixed, seeded CountSketch of every agent's gradient, k numbers per parameter group.

Each parameter group is sketched separately, and within a group each LoRA adapter (and the non-LoRA
rest) separately: a "cell". Coordinate j of parameter ``name`` goes to bucket ``h(j)`` of k with
sign ``s(j)``; the sketch of a cell's part of a vector x is ``(Sx)_b = Σ_{j: h(j)=b} s(j) x_j`` and
the sketched Gram of a group is ``M̂_kl = Σ_cells <S g_k, S g_l>``. Cells keep agents of different
adapters (Isolated-Policy) exactly orthogonal, as they are, instead of adding sketch noise there. Properties (h, s from a random degree-3 polynomial over GF(2^31 - 1), so
the pair (h(j), s(j)) is 4-wise independent across coordinates, up to a relative bias ~2k/2^31):

* unbiased: ``E M̂_kl = M_kl``;
* ``Var M̂_kl = (M_kk M_ll + M_kl² - 2 Σ_j g_kj² g_lj²) / k  ≤  (M_kk M_ll + M_kl²) / k``;
* linear: the sketch of a sum is the sum of sketches, so gradient accumulation and ranks add up
  (every rank hashes alike: the hash depends only on the seed, the parameter's name and j);
* O(P) time per sketched vector, k values per agent and group in memory; nothing O(P) is kept
  (the hash is recomputed from the seed whenever a gradient is sketched).

See docs/probe.md ("Sketch mode") for the derived bounds on norms and cosines.
"""
from __future__ import annotations

import hashlib
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from gradscope.errors import ProbeError
from gradscope.peft_support import adapter_of
from gradscope.probe.store import CHUNK, Store

#: The Mersenne prime 2^31 - 1: hashed coordinates must be below it, products of two residues fit int64.
PRIME = (1 << 31) - 1


@dataclass(frozen=True)
class Sketch:
    """Sketch mode of the probe: ``k`` buckets per parameter group, hashes drawn from ``seed``.

    Every rank and every step must use the same ``seed`` (the default 0 is fine).
    """

    k: int
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ProbeError(f"sketch size k must be a positive integer, got {self.k!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ProbeError(f"sketch seed must be a non-negative integer, got {self.seed!r}")

    def __str__(self) -> str:
        return f"sketch(k={self.k},seed={self.seed})"


def as_sketch(sketch: int | Sketch | None) -> Sketch | None:
    """``Probe(sketch=...)``: None, a bucket count k, or a :class:`Sketch`."""
    if sketch is None or isinstance(sketch, Sketch):
        return sketch
    if isinstance(sketch, numbers.Integral) and not isinstance(sketch, bool):
        return Sketch(int(sketch))
    raise ProbeError(f"sketch must be None, a bucket count k or a Sketch(k, seed), got {sketch!r}")


def hash_coefficients(seed: int, name: str) -> tuple[int, int, int, int]:
    """The degree-3 polynomial of one parameter: four residues mod :data:`PRIME` from (seed, name)."""
    digest = hashlib.blake2b(f"gradscope-sketch\0{seed}\0{name}".encode(), digest_size=32).digest()
    return tuple(int.from_bytes(digest[8 * i:8 * i + 8], "little") % PRIME for i in range(4))  # type: ignore


def poly_hash(coeffs: tuple[int, int, int, int], coords: torch.Tensor) -> torch.Tensor:
    """``poly(j) mod PRIME`` of coordinates ``coords`` (int64, each < PRIME), in ``[0, PRIME)``."""
    c3, c2, c1, c0 = coeffs
    v = coords * c3                      # Horner; every product < 2^62
    v.add_(c2).remainder_(PRIME)
    v.mul_(coords).add_(c1).remainder_(PRIME)
    return v.mul_(coords).add_(c0).remainder_(PRIME)


def signed_buckets(coeffs: tuple[int, int, int, int], coords: torch.Tensor, k: int) -> torch.Tensor:
    """``(h(j), s(j))`` of coordinates ``coords`` (int64, each < PRIME) folded into one index in ``[0, 2k)``:
    bucket ``v mod k``, sign -1 when ``v >= k``, where ``v = poly(j) mod PRIME mod 2k``."""
    return poly_hash(coeffs, coords).remainder_(2 * k)


class SketchStore(Store):
    """A (C, K, k) float64 sketch of every agent's gradient, per cell (parameter group × LoRA adapter).

    Args:
        names: the probed parameters' names (they key the hash, so they must match across ranks).
        sketch: bucket count and seed.
        (the rest as :class:`gradscope.probe.store.Store`)
    """

    def __init__(self, params: Sequence[nn.Parameter], names: Sequence[str], group_index: Sequence[int],
                 n_groups: int, n_agents: int, sketch: Sketch, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(params, group_index, n_groups, n_agents, group)
        too_big = [n for n, p in zip(names, self.params) if p.numel() >= PRIME]
        if too_big:
            raise ProbeError(f"sketch mode hashes at most 2^31 - 2 values per parameter; {too_big[0]} has more")
        self.k = sketch.k
        self.coeffs = [hash_coefficients(sketch.seed, n) for n in names]
        cells = [(g, adapter_of(n) or "") for g, n in zip(self.group_index, names)]
        self.cells = list(dict.fromkeys(cells))          # (group, adapter) per cell
        self.cell_index = [self.cells.index(c) for c in cells]
        self.state = torch.zeros(len(self.cells), n_agents, self.k, dtype=torch.float64, device=self.device)

    def zero(self) -> None:
        self.state.zero_()

    def _fold(self, signed: torch.Tensor) -> torch.Tensor:
        """(..., 2k) signed-bucket sums → (..., k) sketch in float64."""
        return (signed[..., :self.k] - signed[..., self.k:]).double()

    def _project(self, i: int, values: torch.Tensor, start: int) -> torch.Tensor:
        """(a, k) float64 sketches of rows ``values`` (a, m), coordinates ``[start, start + m)`` of ``params[i]``."""
        out = torch.zeros(values.shape[0], self.k, dtype=torch.float64, device=self.device)
        for lo in range(0, values.shape[1], CHUNK):
            chunk = values[:, lo:lo + CHUNK].to(self.device, self.dtype)
            coords = torch.arange(start + lo, start + lo + chunk.shape[1], device=self.device)
            index = signed_buckets(self.coeffs[i], coords, self.k)
            out += self._fold(chunk.new_zeros(chunk.shape[0], 2 * self.k).index_add_(1, index, chunk))
        return out

    def add(self, i: int, agents: Sequence[int], values: torch.Tensor, start: int = 0) -> None:
        self.state[self.cell_index[i], list(agents)] += self._project(i, values, start)

    def scatter(self, i: int, agents: torch.Tensor, coords: torch.Tensor, values: torch.Tensor) -> None:
        index = agents.to(self.device) * (2 * self.k) + signed_buckets(self.coeffs[i], coords.to(self.device), self.k)
        signed = torch.zeros(self.n_agents * 2 * self.k, dtype=self.dtype, device=self.device)
        signed.index_add_(0, index, values.to(self.device, self.dtype))
        self.state[self.cell_index[i]] += self._fold(signed.view(self.n_agents, 2 * self.k))

    def blocks(self, g: int) -> Iterator[torch.Tensor]:
        for c, (group, _) in enumerate(self.cells):
            if group == g:
                yield self.state[c]

    def norms_sq(self, grads: Iterable[tuple[int, torch.Tensor]]) -> np.ndarray:
        images = torch.zeros(len(self.cells), self.k, dtype=torch.float64, device=self.device)
        for i, grad in grads:
            images[self.cell_index[i]] += self._project(i, grad.reshape(1, -1), 0)[0]
        out = np.zeros(self.n_groups)
        np.add.at(out, [g for g, _ in self.cells], images.square().sum(1).cpu().numpy())
        return out

    def _buffers(self) -> list[torch.Tensor]:
        return [self.state]
