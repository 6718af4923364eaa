"""The probe under data parallelism (torch.distributed): which ranks to sum over, and the collectives.

Every rank runs the same probed steps on its share of the batch. The probe sums the ranks'
per-agent contributions (exact or sketched) and token counts, so every rank gets the Gram of the
**global** per-agent gradients ``g_k = Σ_ranks g_k^(rank)``. That is the gradient of the global loss
when the caller normalises each rank's loss by a global count (e.g. an all-reduced token count) and
sums ``.grad`` over ranks (all-reduce SUM) after the probed step; the probe never touches that.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradscope.errors import ProbeError


def resolve_group(process_group: dist.ProcessGroup | bool | None) -> dist.ProcessGroup | None:
    """The group whose ranks' gradients make up the step's gradient; None for a one-process Gram.

    None: the default group when torch.distributed is initialised with more than one rank, else
    None. False: None (each rank measures its own local gradients only). A group: that group (None
    if it has one rank).
    """
    if process_group is False:
        return None
    initialised = dist.is_available() and dist.is_initialized()
    if process_group is None:
        if not initialised:
            return None
        process_group = dist.group.WORLD
    elif not isinstance(process_group, dist.ProcessGroup) or not initialised:
        raise ProbeError(f"process_group must be None, False or a torch.distributed process group of an "
                         f"initialised torch.distributed, got {process_group!r}")
    return process_group if dist.get_world_size(process_group) > 1 else None


def world_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _comm_device(group: dist.ProcessGroup, tensor: torch.Tensor) -> torch.device:
    """NCCL reduces CUDA tensors only; other backends take the tensor where it is."""
    if tensor.device.type == "cpu" and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def all_reduce_sum_(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group``, in place; returns it."""
    device = _comm_device(group, tensor)
    if device == tensor.device:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    else:
        moved = tensor.to(device)
        dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=group)
        tensor.copy_(moved)
    return tensor


def check_same_setup(group: dist.ProcessGroup, setup: dict[str, int | str | Sequence[str]]) -> None:
    """Raise the same ProbeError on every rank unless all ranks built the probe alike.

    ``setup`` maps a description to a number or to strings (compared by checksum), e.g. the
    agents, the probed parameter names, the sketch size. One collective (the maximum of the values
    and of their negations: their maximum and minimum).
    """
    names = list(setup)
    values = [_as_int(setup[n]) for n in names]
    both = all_reduce_max(values + [-v for v in values], group)
    hi, lo = both[:len(values)], [-v for v in both[len(values):]]
    differ = [n for n, a, b in zip(names, hi, lo) if a != b]
    if differ:
        raise ProbeError(f"the ranks built their probes differently ({', '.join(differ)} differ); every rank "
                         "must probe the same agents, parameters, groups and sketch")


def all_reduce_max(values: list[int], group: dist.ProcessGroup) -> list[int]:
    """The element-wise maximum of ``values`` over the ranks of ``group`` (every rank gets it)."""
    t = torch.tensor(values, dtype=torch.int64)
    t = t.to(_comm_device(group, t))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _as_int(value: int | str | Sequence[str]) -> int:
    if isinstance(value, int):
        return value
    text = value if isinstance(value, str) else "\n".join(value)
    return zlib.crc32(text.encode())
