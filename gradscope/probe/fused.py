"""A probed ``nn.Linear`` whose weight gradient comes from the hooks method's per-agent products.

Under the hooks method every row's ``P_b = G_bᵀ A_b`` (or, for a call of one agent, ``Gᵀ A``) is
formed to get the per-agent gradients; their sum *is* the weight gradient, which autograd would
otherwise compute again (``Gᵀ A``, the same products). While a probe is attached, the forward of each
hooked ``nn.Linear`` runs :class:`HookedLinear`: an ``F.linear`` whose backward asks the probe for
the weight (and bias) gradient and computes it itself only when the probe did not form the products
(another path, an unprobed backward, a store — then the probe reads the call after it). The gradient
still goes to the parameter through autograd (``AccumulateGrad``), so ``.grad`` accumulation, DDP's and
FSDP's gradient hooks and gradient checkpointing see an ordinary backward.

Not used under autocast (the backward would have to replay autocast's casts): there the layer runs
``F.linear`` and the probe reads its output gradient with a tensor hook, as for any call.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

class HookedLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)``; the probe attaches ``on_grad(G) -> (dW, db) | None`` (G: (..., d_out))
    to the call's backward node (``output.grad_fn.on_grad``) after the forward — or, when it forms no
    products (a store: sketch, several ranks), ``after_grad(G)``, called once autograd's own weight
    gradient is computed, while G and x are still in cache from it (hooks + TensorSketch, K = 8, against a
    tensor hook before the layer's backward: 1.38× → 1.35× and 1.42× → 1.40× plain on a 512-wide MLP,
    1.14× → 1.13× at a 0.6B model's MLP widths, side by side)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # x only for the weight gradient, as F.linear: a frozen weight's input may change in place afterwards
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight)
        ctx.has_bias, ctx.on_grad, ctx.after_grad = bias is not None, None, None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, G: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx = G @ weight if ctx.needs_input_grad[0] else None          # (..., d_out) @ (d_out, d_in)
        dW = db = None
        if ctx.on_grad is not None:
            dW, db = ctx.on_grad(G) or (None, None)
            if torch.is_grad_enabled():  # create_graph: the weight gradient must be autograd's, differentiable
                dW = db = None
        if ctx.needs_input_grad[1]:
            dW = G.reshape(-1, G.shape[-1]).T @ x.reshape(-1, x.shape[-1]) if dW is None else as_dtype(dW, weight.dtype)
        else:
            dW = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = G.reshape(-1, G.shape[-1]).sum(0) if db is None else as_dtype(db, weight.dtype)
        else:
            db = None
        if ctx.after_grad is not None:
            ctx.after_grad(G)
        return dx, dW, db


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, without the call when x has that dtype (these paths run 100s of times a step)."""
    return x if x.dtype == dtype else x.to(dtype)


def is_hooked(output: torch.Tensor) -> bool:
    """Whether ``output`` came from a :class:`HookedLinear` call."""
    return isinstance(output.grad_fn, HookedLinear._backward_cls)


class Installed:
    """``module.forward`` while hooked: :class:`HookedLinear` when gradients are recorded outside
    autocast, else ``F.linear``; then ``on_call(module, (x,), output)``, as a forward hook would be called
    (the layer needs no forward hook, so ``nn.Module.__call__`` keeps its fast path). Installed as an
    instance attribute shadowing the class's ``forward``."""

    def __init__(self, module: nn.Linear, on_call: Callable[[nn.Module, tuple, torch.Tensor], None]) -> None:
        self.module, self.on_call, self.active = module, on_call, True
        module.forward = self

    def __call__(self, input: torch.Tensor) -> torch.Tensor:  # (named as nn.Linear.forward's: lin(input=x) works)
        m = self.module
        if not self.active:
            return F.linear(input, m.weight, m.bias)
        if not torch.is_grad_enabled() or torch.is_autocast_enabled(input.device.type):
            output = F.linear(input, m.weight, m.bias)
        else:
            output = HookedLinear.apply(input, m.weight, m.bias)
        self.on_call(m, (input,), output)
        return output

    def remove(self) -> None:
        """Back to ``nn.Linear.forward``. A forward someone installed over this one (it may call this
        one, which is now ``F.linear``) is left in place."""
        self.active = False
        if self.module.__dict__.get("forward") is self:
            del self.module.forward
