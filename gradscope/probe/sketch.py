"""Sketched Grams: a fixed, seeded CountSketch of every agent's gradient, k numbers per parameter group.

Each parameter group is sketched separately, and within a group each LoRA adapter (and the non-LoRA
rest) separately: a "cell". Coordinate j of parameter ``name`` goes to bucket ``h(j)`` of k with
sign ``s(j)`` (for large matrices h and s are tensor-structured, see :class:`SketchStore`); the sketch of a cell's part of a vector x is ``(Sx)_b = Σ_{j: h(j)=b} s(j) x_j`` and
the sketched Gram of a group is ``M̂_kl = Σ_cells <S g_k, S g_l>``. Cells keep agents of different
adapters (Isolated-Policy) exactly orthogonal, as they are, instead of adding sketch noise there. Properties (h, s from a random degree-3 polynomial over GF(2^31 - 1), so
the pair (h(j), s(j)) is 4-wise independent across coordinates, up to a relative bias ~2k/2^31):

* unbiased: ``E M̂_kl = M_kl``;
* ``Var M̂_kl = (M_kk M_ll + M_kl² - 2 Σ_j g_kj² g_lj²) / k  ≤  (M_kk M_ll + M_kl²) / k`` (CountSketch);
  tensor-hashed matrices X = g_k, Y = g_l: ``Var ≈ (‖X‖²‖Y‖² + ⟨X,Y⟩² + ‖XYᵀ‖² + ‖XᵀY‖² +
  tr((XYᵀ)²) + tr((XᵀY)²)) / k ≤ 3 (M_kk M_ll + M_kl²) / k`` to first order in 1/k (3× for rank-one
  X = Y; about 1× for matrices summed from many tokens);
* linear: the sketch of a sum is the sum of sketches, so gradient accumulation and ranks add up
  (every rank hashes alike: the hash depends only on the seed, the parameter's name and shape, k and j —
  and, for a bias folded into its weight's sketch, on that weight's: see :meth:`SketchStore.folds_bias`);
* O(P) time per sketched vector, k values per agent and group in memory; nothing O(P) is kept
  (the hash is recomputed from the seed whenever a gradient is sketched; a tensor-hashed matrix keeps
  O(d_out + d_in) values, its rows' and columns' buckets; parameters of at most :data:`KEEP_BELOW`
  values keep theirs).

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
#: Parameters hashed coordinate by coordinate with at most this many values (biases not folded into their weight's
#: sketch, norms' scales, small LoRA factors) keep their signed buckets instead of rehashing them at every sketch.
KEEP_BELOW = 1 << 13
#: A CountSketch of a d-wide axis gathers each of its ⌈d/k⌉ slot blocks separately below this many (see _gathered_sum).
LOOP_BELOW = 4
#: The add-up check compares sketches at this many of their Fourier frequencies (:meth:`SketchStore.sums`).
CHECK_FREQUENCIES = 8
#: TensorSketch transforms this many values (tokens × k) at a time: small enough to stay in cache.
FFT_VALUES = 1 << 16


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


def bucket_positions(seed: int, name: str, n: int, k: int) -> np.ndarray:
    """(n,) int64: a uniformly random injection of ``[0, n)`` into ``[0, ⌈n/k⌉ k)``, drawn from (seed, name);
    coordinate j's bucket is ``position[j] mod k``. Buckets hold ⌈n/k⌉ slots each, so two coordinates
    share one with probability ``(⌈n/k⌉ - 1) / (⌈n/k⌉ k - 1) < 1/k``, and a CountSketch is ⌈n/k⌉ gathers
    of k coordinates. NumPy's ``RandomState`` stream is frozen, so every rank and version draws alike."""
    digest = hashlib.blake2b(f"gradscope-buckets\0{seed}\0{name}".encode(), digest_size=16).digest()
    rng = np.random.RandomState(np.frombuffer(digest, dtype="<u4"))
    return rng.permutation(-(-n // k) * k)[:n].astype(np.int64)


class SketchStore(Store):
    """A (C, K, k) float64 sketch of every agent's gradient, per cell (parameter group × LoRA adapter).

    Each parameter is hashed one of two ways, fixed by its shape (so alike on every rank):

    * vectors and matrices whose per-token products are cheap (LoRA factors, biases; see
      :func:`_tensor_hashed`): CountSketch of the flattened coordinates, ``(h, s)`` 4-wise independent —
      except a bias paired with a tensor-hashed weight (:meth:`folds_bias`), which takes the weight's row hash;
    * larger matrices (d_out, d_in) (full-width weights; >2-D ones as (shape[0], rest)): the
      tensor-structured hash ``h(i, j) = (h_r(i) + h_c(j)) mod k``, ``s(i, j) = s_r(i) s_c(j)`` with
      independent row and column hashes (signs 4-wise independent, buckets from
      :func:`bucket_positions`). The sketch of an outer product ``g aᵀ`` is then the circular
      convolution of the CountSketches of ``g`` and ``a`` (TensorSketch), so per-token products are
      sketched by FFT without ever forming them (:meth:`add_outer`). Only O(d_out + d_in) values are
      kept: the rows' and columns' buckets (as signed buckets and as gathers) and the add-up check's
      forms, about 20 (d_out + d_in) with F = 8. A non-finite value makes hooks' whole sketch of such
      a matrix non-finite (the FFT spreads it); split's dense path keeps it in its buckets (and in those
      reading empty gather slots, which multiply by 0, when it sits in row or column 0).

    Args:
        names: the probed parameters' names (they key the hash, so they must match across ranks).
        sketch: bucket count and seed.
        (the rest as :class:`gradscope.probe.store.Store`)
    """

    def __init__(self, params: Sequence[nn.Parameter], names: Sequence[str], group_index: Sequence[int],
                 n_groups: int, n_agents: int, sketch: Sketch, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(params, group_index, n_groups, n_agents, group)
        too_big = [n for n, p in zip(names, self.params) if max(_matrix_shape(p)) >= PRIME or p.numel() >= PRIME]
        if too_big:
            raise ProbeError(f"sketch mode hashes at most 2^31 - 2 values per parameter; {too_big[0]} has more")
        self.names, self.sketch, self.k = list(names), sketch, sketch.k
        self.coeffs = [hash_coefficients(sketch.seed, n) for n in names]
        self.tensor = [_tensor_hashed(p, self.k) for p in self.params]
        self._tables: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # see _axis
        self._kept: dict[int, torch.Tensor] = {}  # i → signed buckets of a parameter of at most KEEP_BELOW values
        self._forms: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # i → the add-up check's r_f, [Re c_f, Im c_f]
        cells = [(g, adapter_of(n) or "") for g, n in zip(self.group_index, names)]
        self.cells = list(dict.fromkeys(cells))          # (group, adapter) per cell
        self.cell_index = [self.cells.index(c) for c in cells]
        # a tensor-hashed Linear weight's bias is hashed as the weight's extra column (see folds_bias)
        index = {n: i for i, n in enumerate(self.names)}
        self.row_hash_of = {b: w for b, n in enumerate(self.names) if n.endswith("bias")
                            for w in [index.get(n[:-4] + "weight")] if w is not None and self.tensor[w]
                            and self.params[b].dim() == 1 and self.params[b].numel() == _matrix_shape(self.params[w])[0]
                            and self.cell_index[b] == self.cell_index[w]}
        self.state = torch.zeros(len(self.cells), n_agents, self.k, dtype=torch.float64, device=self.device)

    def zero(self) -> None:
        self.state.zero_()

    def small(self, i: int) -> bool:
        """CountSketched parameters take whole per-agent products; tensor-hashed ones per-token factors."""
        return not self.tensor[i]

    def local_copy(self) -> "SketchStore":
        copy = SketchStore(self.params, self.names, self.group_index, self.n_groups, self.n_agents, self.sketch)
        copy._tables, copy._kept, copy._forms = self._tables, self._kept, self._forms  # the same hashes
        return copy

    def _fold(self, signed: torch.Tensor) -> torch.Tensor:
        """(..., 2k) signed-bucket sums → (..., k) sketch in float64."""
        return (signed[..., :self.k] - signed[..., self.k:]).double()

    def _axis_hashes(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensor-hashed ``params[i]``: signed buckets (in ``[0, 2k)``) of its rows and of its columns."""
        return self._axis(i, 0)[0], self._axis(i, 1)[0]

    def _axis(self, i: int, axis: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows (``axis`` 0) or columns (1) of tensor-hashed ``params[i]``: their signed buckets (n,) in
        ``[0, 2k)``, and the same map as a gather: ``index`` (m, k) and ``sign`` (m, k) with
        ``(C x)_b = Σ_q sign[q, b] x[index[q, b]]`` (slots no coordinate fills: index 0, sign 0)."""
        if (i, axis) not in self._tables:
            n, k = _matrix_shape(self.params[i])[axis], self.k
            name = f"{self.names[i]}\0{('rows', 'cols')[axis]}"
            position = torch.from_numpy(bucket_positions(self.sketch.seed, name, n, k)).to(self.device)
            negative = signed_buckets(hash_coefficients(self.sketch.seed, name),
                                      torch.arange(n, device=self.device), k) >= k
            signed = position % k + k * negative
            m = -(-n // k)
            index = torch.zeros(m * k, dtype=torch.long, device=self.device)
            index[position] = torch.arange(n, device=self.device)
            sign = torch.zeros(m * k, dtype=self.dtype, device=self.device)
            sign[position] = 1 - 2 * negative.to(self.dtype)
            self._tables[i, axis] = (signed, index.view(m, k), sign.view(m, k))
        return self._tables[i, axis]

    def folds_bias(self, weight: int, bias: int) -> bool:
        """A tensor-hashed weight's bias — paired by name (``name.bias`` with ``name.weight``: Linear, Conv,
        ``in_proj_bias`` with ``in_proj_weight``), d_out values, same cell — is hashed as the weight's extra
        column, with column bucket 0 and sign +1 (coordinate i by the weight's row hash ``(h_r(i), s_r(i))``),
        so the TensorSketch of the augmented token factors ``[A_t, 1]`` sketches both, the bias adding the
        ``C_r G_t`` already formed (their convolution with the unit vector e_0). It shares a bucket with any
        given column with probability exactly 1/k (its bucket difference is that column's uniform ``h_c``), and
        the constant sign only ever meets itself in a square, so the tensor-hashed bounds, which assume 1/k,
        hold for ``[W, b]``."""
        return self.row_hash_of.get(bias) == weight

    def _signed_index(self, i: int, coords: torch.Tensor) -> torch.Tensor:
        """Signed bucket in ``[0, 2k)`` of flattened coordinates ``coords`` (int64) of ``params[i]``."""
        if i in self.row_hash_of:
            return self._axis(self.row_hash_of[i], 0)[0][coords]
        if not self.tensor[i]:
            return signed_buckets(self.coeffs[i], coords, self.k)
        cols = _matrix_shape(self.params[i])[1]
        h_rows, h_cols = self._axis_hashes(i)
        return self._combine(h_rows[coords // cols], h_cols[coords % cols])

    def _combine(self, r: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        """Signed bucket of (row, column) from their signed buckets (broadcasting): ``(h_r + h_c) mod k``,
        negative when exactly one of the two signs is."""
        k = self.k
        return (r % k + c % k) % k + k * ((r >= k) ^ (c >= k))

    def _range_index(self, i: int, start: int, m: int) -> torch.Tensor:
        """Signed buckets of the coordinates ``[start, start + m)``: for a tensor-hashed matrix, built from
        the rows they span (broadcast) instead of per-coordinate division."""
        if i in self.row_hash_of:
            return self._axis(self.row_hash_of[i], 0)[0][start:start + m]
        if not self.tensor[i]:
            if self.params[i].numel() > KEEP_BELOW:
                return signed_buckets(self.coeffs[i], torch.arange(start, start + m, device=self.device), self.k)
            if i not in self._kept:
                self._kept[i] = signed_buckets(self.coeffs[i], torch.arange(self.params[i].numel(),
                                                                            device=self.device), self.k)
            return self._kept[i][start:start + m]
        cols = _matrix_shape(self.params[i])[1]
        h_rows, h_cols = self._axis_hashes(i)
        r0, r1 = start // cols, -(-(start + m) // cols)
        block = self._combine(h_rows[r0:r1, None], h_cols[None, :]).reshape(-1)
        return block[start - r0 * cols:start - r0 * cols + m]

    def _project(self, i: int, values: torch.Tensor, start: int) -> torch.Tensor:
        """(a, k) float64 sketches of rows ``values`` (a, m), coordinates ``[start, start + m)`` of ``params[i]``."""
        a = values.shape[0]
        if self.tensor[i] and start == 0 and values.shape[1] == self.params[i].numel():
            return self._project_matrices(i, values)
        out = torch.zeros(a, self.k, dtype=torch.float64, device=self.device)
        offsets = torch.arange(a, device=self.device)[:, None] * (2 * self.k)
        for lo in range(0, values.shape[1], CHUNK):
            chunk = values[:, lo:lo + CHUNK].to(self.device, self.dtype)
            index = self._range_index(i, start + lo, chunk.shape[1])
            signed = torch.bincount((index + offsets).reshape(-1), chunk.reshape(-1), minlength=a * 2 * self.k)
            out += self._fold(signed.view(a, 2 * self.k))
        return out

    def _project_matrices(self, i: int, values: torch.Tensor) -> torch.Tensor:
        """(a, k) sketches of ``a`` whole tensor-hashed matrices (a, rows·cols): each matrix's rows CountSketched
        (``C_r X``, k × cols, by gathers of whole rows, or an index_add of them for many rows per bucket), then its columns (``Z = C_r X C_cᵀ``, k × k), then Z's
        entries summed by (row bucket + column bucket) mod k (:func:`_wrap_diagonals`): no index per value.
        O(rows·cols + k·cols + k²): for k above the row count, :meth:`_project_matrices_rolled`
        (O(rows·(cols + k)))."""
        rows, cols = _matrix_shape(self.params[i])
        k = self.k
        if k > rows:
            return self._project_matrices_rolled(i, values)
        signed, index, sign = self._axis(i, 0)
        out = torch.empty(values.shape[0], k, dtype=torch.float64, device=self.device)
        for a, X in enumerate(values.reshape(-1, rows, cols).to(self.device, self.dtype)):
            if len(index) < LOOP_BELOW:  # whole rows gathered, signed and added: C_r X, (k, cols)
                R = X.index_select(0, index[0]).mul_(sign[0, :, None])
                for q in range(1, len(index)):
                    R.addcmul_(X.index_select(0, index[q]), sign[q, :, None])
            else:                        # many rows per bucket: each added once to its signed bucket's row
                R = X.new_zeros(2 * k, cols).index_add_(0, signed, X)
                R = R[:k] - R[k:]
            out[a] = _wrap_diagonals(self._count_sketch(R, i, 1))                 # C_r X C_cᵀ, (k, k)
        return out

    def _project_matrices_rolled(self, i: int, values: torch.Tensor) -> torch.Tensor:
        """As :meth:`_project_matrices`, by each row's CountSketch over the columns, rolled by the row's bucket
        and signed (``TS(X) = Σ_i s_r(i) roll(C_c x_i, h_r(i))``): one index per row and bucket."""
        rows, cols = _matrix_shape(self.params[i])
        k, a = self.k, values.shape[0]
        Y = self._count_sketch(values.reshape(a * rows, cols), i, 1)            # (a·rows, k)
        bucket, sign = self._buckets(i, 0)
        Y = Y * sign.repeat(a)[:, None]
        shifted = bucket.repeat(a)[:, None] + torch.arange(k, device=self.device)
        index = shifted % k + (torch.arange(a, device=self.device) * k).repeat_interleave(rows)[:, None]
        return torch.bincount(index.reshape(-1), Y.reshape(-1), minlength=a * k).view(a, k).double()

    def add(self, i: int, agents: Sequence[int], values: torch.Tensor, start: int = 0) -> None:
        self.state[self.cell_index[i], list(agents)] += self._project(i, values, start)

    def scatter(self, i: int, agents: torch.Tensor, coords: torch.Tensor, values: torch.Tensor) -> None:
        index = agents.to(self.device) * (2 * self.k) + self._signed_index(i, coords.to(self.device))
        signed = torch.zeros(self.n_agents * 2 * self.k, dtype=self.dtype, device=self.device)
        signed.index_add_(0, index, values.to(self.device, self.dtype))
        self.state[self.cell_index[i]] += self._fold(signed.view(self.n_agents, 2 * self.k))

    def add_outer(self, i: int, agents: torch.Tensor, G: torch.Tensor, A: torch.Tensor,
                  bias: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """TensorSketch: agent k's sketch of ``Σ_{t of k} G_t A_tᵀ`` is ``IFFT(Σ_t FFT(C_r G_t) · FFT(C_c A_t))``
        (agents: (N,) indices in ``[0, K)``; with ``bias``, also ``Σ_{t of k} G_t`` for ``params[bias]``, see
        :meth:`folds_bias`),
        O(N (d_out + d_in + k log k)); no outer product is formed. Tokens go a chunk at a time; returns
        ``(‖G‖_F, ‖A‖_F)`` (float64 scalars), taken from each chunk while it is in cache."""
        if bias is not None and not self.folds_bias(i, bias):
            raise ProbeError(f"sketch: {self.names[bias]} is not folded into {self.names[i]}'s sketch")
        if not self.tensor[i]:  # a small matrix: its per-agent products, hashed coordinate by coordinate
            present = agents.unique().tolist()
            self.add(i, present, torch.stack([G[agents == k].T.to(self.dtype) @ A[agents == k].to(self.dtype)
                                              for k in present]).flatten(1))
            return None
        agents = agents.to(self.device)
        bins = self.k // 2 + 1
        spectrum = torch.zeros(self.n_agents, bins * 2, dtype=self.dtype, device=self.device)  # (re, im) pairs
        squares = torch.zeros(2, dtype=torch.float64, device=self.device)
        # the bias as A's extra column (bucket 0, sign +1: folds_bias) adds u_t ⊛ e_0 = u_t: summed as it is
        bias_sketch = None if bias is None else torch.zeros(self.n_agents, self.k, dtype=self.dtype, device=self.device)
        step = max(1, FFT_VALUES // self.k)
        for lo in range(0, len(agents), step):
            g, a = (X[lo:lo + step].to(self.device, self.dtype) for X in (G, A))
            u, v = self._count_sketch(g, i, 0), self._count_sketch(a, i, 1)    # (n, k)
            squares += torch.stack([torch.linalg.vector_norm(g), torch.linalg.vector_norm(a)]).double().square()
            product = torch.fft.rfft(u, dim=1) * torch.fft.rfft(v, dim=1)   # (n, k/2+1) complex
            # summed by agent as real pairs: index_add of contiguous real rows is ~5x faster than of complex ones
            spectrum.index_add_(0, agents[lo:lo + step], torch.view_as_real(product).reshape(len(product), -1))
            if bias_sketch is not None:
                bias_sketch.index_add_(0, agents[lo:lo + step], u)
        spectrum = torch.view_as_complex(spectrum.double().view(self.n_agents, bins, 2))
        sketch = torch.fft.irfft(spectrum, n=self.k, dim=1)
        self.state[self.cell_index[i]] += sketch if bias_sketch is None else sketch + bias_sketch.double()
        g_norm, a_norm = squares.sqrt()
        return g_norm, a_norm

    def _buckets(self, i: int, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Bucket (in ``[0, k)``) and sign (±1) of each row (``axis`` 0) or column (1) of tensor-hashed ``params[i]``."""
        signed = self._axis(i, axis)[0]
        return signed % self.k, (1 - 2 * (signed >= self.k)).to(self.dtype)

    def _count_sketch(self, X: torch.Tensor, i: int, axis: int) -> torch.Tensor:
        """(n, k): the CountSketch of each row of X (n, d) under the signed buckets of ``params[i]``'s rows
        (``axis`` 0) or columns (1), by gathers of columns (:func:`_gathered_sum`)."""
        _, index, sign = self._axis(i, axis)
        return _gathered_sum(X.to(self.device, self.dtype), index, sign)

    def blocks(self, g: int) -> Iterator[torch.Tensor]:
        for c, (group, _) in enumerate(self.cells):
            if group == g:
                yield self.state[c]

    # ------------------------------------------------------------------ the add-up check's statistics
    # The check compares the sum of the agents' sketches with the sketch of Δ.grad at the first F
    # Fourier frequencies of the sketch (F = min(CHECK_FREQUENCIES, k/2 + 1)): a sketch of the sketch,
    # the same linear map on both sides. Coefficient f of a tensor-hashed matrix's sketch is the rank-one
    # form r_fᵀ Δ c_f (r_f(i) = s_r(i) ω^{f h_r(i)}, c_f likewise, ω = e^{-2πi/k}), one pass over Δ by a
    # (cols × 2F) product instead of its whole sketch (three passes and a gather).

    def sums(self) -> tuple[np.ndarray, np.ndarray]:
        """``(‖Σ_k P x_k‖², ‖P x_k‖²)`` per group, (G,) and (G, K): ``x_k`` agent k's sketch, ``P`` its first F Fourier
        coefficients over √F (so ``E‖P x‖² = E‖x‖² = ‖g‖²``); what the add-up check compares with :meth:`norms_sq`."""
        total, diag = np.zeros(self.n_groups), np.zeros((self.n_groups, self.n_agents))
        for c, (g, _) in enumerate(self.cells):
            X = self._spectrum(self.state[c])                                          # (K, F)
            diag[g] += X.abs().square().sum(1).cpu().numpy()
            total[g] += float(X.sum(0).abs().square().sum())
        return total, diag

    def norms_sq(self, grads: Iterable[tuple[int, torch.Tensor]]) -> np.ndarray:
        """(G,) ``‖P S v‖²`` for the vector v of the ``(i, gradient of params[i])`` pairs (see :meth:`sums`)."""
        images = torch.zeros(len(self.cells), self._bins, dtype=torch.complex128, device=self.device)
        for i, grad in grads:
            images[self.cell_index[i]] += (self._matrix_spectrum(i, grad) if self.tensor[i]
                                           else self._spectrum(self._project(i, grad.reshape(1, -1), 0)[0]))
        out = np.zeros(self.n_groups)
        np.add.at(out, [g for g, _ in self.cells], images.abs().square().sum(1).cpu().numpy())
        return out

    @property
    def _bins(self) -> int:
        return min(CHECK_FREQUENCIES, self.k // 2 + 1)

    def _spectrum(self, x: torch.Tensor) -> torch.Tensor:
        """(..., F) complex128: ``P x`` of sketches x (..., k)."""
        return torch.fft.rfft(x.double(), dim=-1)[..., :self._bins] / self._bins ** 0.5

    def _matrix_spectrum(self, i: int, grad: torch.Tensor) -> torch.Tensor:
        """(F,) complex128: ``P S grad`` of tensor-hashed ``params[i]``, as ``r_fᵀ grad c_f`` per frequency."""
        if i not in self._forms:
            f = torch.arange(self._bins, dtype=torch.float64, device=self.device)
            forms = []
            for axis in (0, 1):
                signed = self._axis(i, axis)[0]
                phase = torch.polar(torch.ones(1, dtype=torch.float64, device=self.device),
                                    -2 * torch.pi / self.k * (signed % self.k)[:, None].double() * f)
                forms.append(phase * torch.where(signed >= self.k, -1.0, 1.0).double()[:, None])   # (n, F)
            r, c = forms
            self._forms[i] = (r, torch.cat([c.real, c.imag], 1).to(self.dtype))
        r, c = self._forms[i]
        Y = (grad.reshape(_matrix_shape(self.params[i])).to(self.device, self.dtype) @ c).double()  # (rows, 2F)
        return (r * torch.complex(Y[:, :self._bins], Y[:, self._bins:])).sum(0) / self._bins ** 0.5

    def _buffers(self) -> list[torch.Tensor]:
        return [self.state]


def _gathered_sum(X: torch.Tensor, index: torch.Tensor, sign: torch.Tensor) -> torch.Tensor:
    """``Σ_q sign[q] ⊙ X[:, index[q]]`` for X (n, d) and index, sign (m, k): the CountSketch of X's rows
    (n, k), d ≤ m k. A gather per q while m < :data:`LOOP_BELOW` (each reads lines of every row); else one
    gather of all m k slots, signed and summed over m (a pass each, whatever m). Measured on a CPU,
    chunks of 2¹⁶ values: m = 2, 69 against 91 µs; m = 12, 575 against 1296 µs; a scatter-add 96 and 695 µs."""
    m, k = index.shape
    if m < LOOP_BELOW:
        out = X.index_select(1, index[0]).mul_(sign[0])
        for q in range(1, m):
            out.addcmul_(X.index_select(1, index[q]), sign[q])
        return out
    return X.index_select(1, index.reshape(-1)).mul_(sign.reshape(-1)).view(-1, m, k).sum(1)


def _wrap_diagonals(Z: torch.Tensor) -> torch.Tensor:
    """(k,) sums of a (k, k) matrix's entries by (row + column) mod k: ``out[c] = Σ_b Z[b, (c - b) mod k]``,
    read as a strided view of ``[Z Z]`` (entry (b, c) at offset ``b (2k - 1) + k + c``)."""
    k = Z.shape[0]
    twice = torch.cat([Z, Z], 1)  # (k, 2k)
    return twice.as_strided((k, k), (2 * k - 1, 1), twice.storage_offset() + k).sum(0)


def _tensor_hashed(p: torch.Tensor, k: int) -> bool:
    """Whether ``p`` gets the tensor-structured hash: a matrix whose per-token products cost more than
    sketching the token's two factors by FFT, ``d_out d_in > 4 (d_out + d_in + 5 k ⌊log₂ k⌋)``, ``⌊log₂ k⌋`` at
    least 1 (full-width
    weights; not LoRA factors, whose per-agent products are cheap to form and hash)."""
    if p.dim() < 2:
        return False
    rows, cols = _matrix_shape(p)
    return rows * cols > 4 * (rows + cols + 5 * k * max(1, k.bit_length() - 1))


def _matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    """The (rows, columns) a parameter is hashed as: (shape[0], rest) for ≥ 2-D, (1, numel) otherwise."""
    rows = p.shape[0] if p.dim() >= 2 else 1
    return rows, p.numel() // max(rows, 1)
