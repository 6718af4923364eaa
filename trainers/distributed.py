"""Data parallelism under ``torchrun``: one process per device, rollouts split across them.

``torchrun --nproc_per_node=N -m gradscope.cli train ...`` sets ``RANK`` / ``WORLD_SIZE`` /
``LOCAL_RANK``; :meth:`Dist.from_env` then joins the process group (gloo on CPU, NCCL on GPU). Every
rank holds the same adapters and optimizer states (same seed, same summed gradients); each rolls out
its share of a step's tasks. Gradients are summed across ranks with the loss of every mini-batch
normalised by the *global* token count, so the summed gradient is exactly that of one process
training on the union of the ranks' mini-batch chunks — and so is the probe's Gram (the probe
all-reduces per-agent contributions itself, docs/distributed.md). (Which samples form a global
mini-batch differs from a one-process run's split of the same step.) Only rank 0 writes the run file and evaluates alert rules; a ``stop``
is broadcast so that every rank leaves the loop after the same step.
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, TypeVar

import torch
import torch.distributed as tdist

T = TypeVar("T")


def world_size_from_env() -> int:
    """The world size torchrun announced (1 when not launched by torchrun)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class Dist:
    """This process's place in the job; the single-process default makes every method a no-op."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, timeout_s: float = 300.0) -> "Dist":
        """Join torchrun's process group, if launched by torchrun with WORLD_SIZE > 1.

        ``timeout_s`` bounds every collective: a rank that stops answering (without dying; a dead
        rank is noticed at once) makes the others fail after that long instead of hanging.
        """
        world = world_size_from_env()
        if world == 1:
            return cls()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        if not tdist.is_initialized():
            tdist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return cls(rank=tdist.get_rank(), world=tdist.get_world_size(), local_rank=local_rank)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's share of a sequence every rank holds in the same order (round robin)."""
        return list(items[self.rank::self.world])

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks of a few numbers (float64)."""
        if not self.active:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self._device())
        tdist.all_reduce(t)
        return t.tolist()

    def sum_grads(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Sum ``.grad`` over ranks in one flat all-reduce (a missing grad counts as zeros and is
        created, so every rank reduces the same tensors)."""
        if not self.active:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        tdist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world
        tdist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    @contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (e.g. builds a cache), then the others."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()

    def close(self, finished: bool = True) -> None:
        """Leave the process group. After a run every rank finished (``finished``), the ranks first
        meet at a barrier, so that no rank tears gloo down while another is still in a collective or
        writing the run file; after an error they do not wait for each other."""
        if self.active and tdist.is_initialized():
            if finished:
                tdist.barrier()
            tdist.destroy_process_group()

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


class NullWriter:
    """What ranks other than 0 get instead of a ``RunWriter``: every log call does nothing."""

    def __enter__(self) -> "NullWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def flush(self) -> None:
        return None

    def __getattr__(self, name: str):
        if name.startswith("log_"):
            return lambda *args, **kw: None
        raise AttributeError(name)
