"""Helpers for probing peft LoRA models, including its pitfalls.

peft's ``set_adapter`` sets ``requires_grad=False`` on every inactive adapter. Autograd then drops
gradients for those parameters even when they were used earlier in the step, and an optimizer built
from ``requires_grad`` parameters silently loses them. Under Isolated-Policy training (one adapter
per role, one forward per role) always switch adapters with :func:`use_adapter`, and build optimizers
and probes over :func:`adapter_parameters` explicitly.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn as nn

# LoRA parameter names look like "...q_proj.lora_A.<adapter>.weight" or "...lora_embedding_A.<adapter>".
_LORA_NAME = re.compile(r"\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\.([^.]+)(?:\.|$)")


def adapter_of(param_name: str) -> str | None:
    """The LoRA adapter a parameter belongs to, from its qualified name; None for non-LoRA parameters."""
    match = _LORA_NAME.search(param_name)
    return match.group(1) if match else None


def adapter_parameters(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Every LoRA parameter of ``model`` grouped by adapter name, whatever its ``requires_grad``.

    Returns ``{adapter: [(qualified_name, parameter), ...]}`` in ``named_parameters`` order.
    """
    out: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        adapter = adapter_of(name)
        if adapter is not None:
            out.setdefault(adapter, []).append((name, param))
    return out


@contextmanager
def use_adapter(model: nn.Module, adapter: str) -> Iterator[None]:
    """Make ``adapter`` the active one for the forwards inside the block, keeping all adapters trainable.

    Restores the previously active adapter on exit. Gradients of every adapter keep flowing, so one
    step may run forwards under several adapters (one per role) and back-propagate them together.
    """
    previous = model.active_adapter
    model.set_adapter(adapter)
    _all_trainable(model)
    try:
        yield
    finally:
        model.set_adapter(previous if isinstance(previous, str) else previous[0])
        _all_trainable(model)


def _all_trainable(model: nn.Module) -> None:
    for params in adapter_parameters(model).values():
        for _, param in params:
            param.requires_grad_(True)
