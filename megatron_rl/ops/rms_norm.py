"""RMS normalisation in one autograd node, for the CPU trainer's norms.

On CPU, torch 2.13's `rms_norm` (torch.nn.RMSNorm, the local spec's norm through megatron's
WrappedTorchNorm) is a composite: pow, mean, add, rsqrt and two multiplications, each its own
autograd node, and a backward of about fifteen ops through six nodes. At the trainer's test sizes
a step is per-op overhead, and the nine norms of the tiny Llama-4 were ~10% of the profiled
step (docs/trainer_speed.md). `rms_norm` computes the forward with exactly those ops (so its
output is bit-identical to torch's) and the backward in closed form, eight element-wise ops in
one node:

    y = x * r * w,   r = (mean(x^2) + eps)^-1/2,   x_hat = x * r
    dL/dw = sum over tokens of g * x_hat
    dL/dx = r * (g w - x_hat * mean(g w * x_hat))

which is the composite's gradient up to fp32 rounding (tests/unit/test_rms_norm.py checks both
against torch.nn.RMSNorm, and without a weight against megatron's L2Norm, the weight-free q/k
norm of Llama-4, which the trainer keeps). Only fp32 inputs take this path; other dtypes (where
torch computes in fp32 and rounds back) use torch's own `rms_norm`.
"""
from __future__ import annotations

import torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        normed = x * rstd
        ctx.save_for_backward(normed, rstd, weight)
        return normed * weight if weight is not None else normed

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        normed, rstd, weight = ctx.saved_tensors
        grad_weight = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                grad_weight = (grad_out * normed).reshape(-1, normed.shape[-1]).sum(0)
            grad_out = grad_out * weight
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = rstd * (grad_out - normed * (grad_out * normed).mean(-1, keepdim=True))
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, last dim) + eps) * weight (weight None: no scale), as torch's
    `rms_norm` over the last dimension; one autograd node for fp32 input (module docstring)."""
    if x.dtype != torch.float32 or (weight is not None and weight.dtype != torch.float32):
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return _RMSNorm.apply(x, weight, eps)
