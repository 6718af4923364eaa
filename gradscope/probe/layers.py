"""The layers the hooks method can attribute, and which probed parameters each holds.

Only exactly ``nn.Linear`` and plain ``nn.Embedding`` modules: a layer's gradient is then ``Σ_tokens G_tᵀ A_t``
(Linear) or ``G_t`` scattered to the token ids (Embedding), from the call's input ``A`` and output gradient ``G``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn


def supported(module: nn.Module) -> bool:
    """Layers whose parameters hooks can attribute: exactly ``nn.Linear`` or a plain ``nn.Embedding``.

    Subclasses are excluded on purpose: some (``nn.MultiheadAttention.out_proj``) are used without
    calling their ``forward``, so a hook would never see them.
    """
    if type(module) is nn.Linear:
        return True
    return type(module) is nn.Embedding and not module.scale_grad_by_freq and not module.sparse


def _unsupported(module: nn.Module) -> str:
    """Why hooks cannot attribute the parameters of ``module`` (not :func:`supported`), for messages."""
    if type(module) is nn.Embedding:
        return f"in an Embedding with {'sparse=True' if module.sparse else 'scale_grad_by_freq=True'}"
    return f"in a {type(module).__name__}"


def _is_param_wrapper(module: nn.Module) -> bool:
    """peft's LoRA on a bare parameter (``LoraConfig(target_parameters=...)``, e.g. fused MoE experts): its
    ``lora_A`` / ``lora_B`` are ``nn.Linear`` modules whose weights it reads without calling them."""
    cls = type(module)
    return cls.__name__ == "ParamWrapper" and cls.__module__.startswith("peft.")


def find_layers(model: nn.Module, params: Sequence[nn.Parameter]) -> tuple[list["Layer"], dict[int, str]]:
    """The hookable layers holding ``params``, and the parameters none covers: index → why (for messages).

    A parameter is covered when exactly one module of ``model`` holds it and that module is
    :func:`supported` (a weight tied between two modules is not) and is called to use it (not so the
    ``lora_A`` / ``lora_B`` Linears of peft's ``target_parameters`` LoRA, whose weights it reads).
    """
    index = {id(p): i for i, p in enumerate(params)}
    owners: dict[int, list[tuple[str, nn.Module, str]]] = {}
    never_called: set[int] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        if _is_param_wrapper(module):
            never_called.update(id(m) for part in (module.lora_A, module.lora_B) for m in part.values())
        for name, p in module.named_parameters(recurse=False):
            if id(p) in index:
                owners.setdefault(index[id(p)], []).append((module_name, module, name))
    layers: dict[int, Layer] = {}
    uncovered: dict[int, str] = {}
    for i in range(len(params)):
        held = {id(m): (n, m, p) for n, m, p in owners.get(i, [])}  # one module reached by two paths is one
        if len(held) != 1:
            uncovered[i] = (f"tied: held by {len(held)} modules, {', '.join(repr(n) for n, _, _ in held.values())}"
                            if held else "held by no module of the model")
            continue
        module_name, module, name = next(iter(held.values()))
        if id(module) in never_called:
            uncovered[i] = ("in a Linear that peft's target_parameters LoRA (ParamWrapper) never calls: it reads the "
                            "weight")
            continue
        if not supported(module) or name not in ("weight", "bias"):
            uncovered[i] = (_unsupported(module) if not supported(module)
                            else f"{name!r} of a {type(module).__name__}, neither weight nor bias")
            continue
        layer = layers.setdefault(id(module), Layer(module, module_name or type(module).__name__))
        setattr(layer, name, i)
    return list(layers.values()), uncovered


@dataclass(eq=False)
class Layer:
    """A hooked module, the indices of its probed parameters, and this step's ghost / embedding rows."""

    module: nn.Module
    name: str
    weight: int | None = None
    bias: int | None = None
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    n_rows: int = 0  # tokens in ``rows``
    # the batch dimension of its k-th call in a forward (k: Piece.index), verified by a passed self-check where the
    # shape left a choice: a layer called twice per forward may see two layouts of the same shape ((T, B, d), (B, S, d))
    batch_dims: dict[int, int] = field(default_factory=dict)

    @property
    def embedding(self) -> bool:
        return isinstance(self.module, nn.Embedding)
