"""Rotary position embedding in one autograd node, for the CPU trainer's attention.

Without Transformer Engine megatron-core applies RoPE to the query and the key with its unfused
composite (rope_utils `_apply_rotary_pos_emb_bshd`): a slice for partial rotary, cos and sin of
the frequencies, rotate-half as chunk / neg / cat (strided slices / neg / stack for interleaved
pairs), two multiplications, an add and a cat, each its own autograd node, and a backward through
as many. At the trainer's test sizes a step is per-op overhead (docs/trainer_speed.md).
`apply_rotary` computes the forward with exactly those ops (so its output is bit-identical) and
the backward in closed form, in one node:

    y = t * cos + R(t) * sin        (on the first rot_dim channels; the rest pass through)
    dL/dt = g * cos + R^T(g * sin),   R^T = -R

R, rotate-half, is a signed permutation of the channels: [x1, x2] -> [-x2, x1] on the two halves
(rotary_interleaved False: Llama, Qwen), (x_2i, x_2i+1) -> (-x_2i+1, x_2i) on adjacent pairs
(True: Llama-4). Each is a rotation by 90 degrees in its planes, so its transpose is its inverse
and its negative. The backward does the same multiplications, negations and sum that autograd does
through the composite (tests/unit/test_rope.py compares both against megatron's function). The
frequencies get no gradient: megatron's RotaryEmbedding computes them from a buffer.
"""
from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """R(x) over the last dimension: [-x2, x1] on halves, (-x_odd, x_even) on pairs."""
    if not interleaved:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def _rotate_transposed(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """R^T(x) = -R(x): [x2, -x1] on halves, (x_odd, -x_even) on pairs."""
    if not interleaved:
        first, second = x.chunk(2, dim=-1)
        return torch.cat((second, -first), dim=-1)
    return torch.stack((x[..., 1::2], -x[..., ::2]), dim=-1).flatten(-2)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mscale: float):
        rot_dim = freqs.shape[-1]
        rotated, passed = t[..., :rot_dim], t[..., rot_dim:]
        cos, sin = torch.cos(freqs), torch.sin(freqs)
        if mscale != 1.0:  # x * 1.0 is x: the multiplication changes nothing
            cos, sin = cos * mscale, sin * mscale
        cos, sin = cos.to(t.dtype), sin.to(t.dtype)
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        out = rotated * cos + _rotate(rotated, interleaved) * sin
        return torch.cat((out, passed), dim=-1) if passed.shape[-1] else out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        cos, sin = ctx.saved_tensors
        rot_dim = cos.shape[-1]
        grad, grad_passed = grad_out[..., :rot_dim], grad_out[..., rot_dim:]
        grad_t = grad * cos + _rotate_transposed(grad * sin, ctx.interleaved)
        if grad_passed.shape[-1]:
            grad_t = torch.cat((grad_t, grad_passed), dim=-1)
        return grad_t, None, None, None


def apply_rotary(t: torch.Tensor, freqs: torch.Tensor, *, interleaved: bool,
                 mscale: float = 1.0) -> torch.Tensor:
    """RoPE of `t` [s, b, h, d] with angles `freqs` [s, 1, 1, rot_dim] (rot_dim <= d, even;
    channels past rot_dim pass through), scaled by `mscale`, as megatron-core's unfused bshd
    `_apply_rotary_pos_emb_bshd`; one autograd node (module docstring). The frequencies must not
    require grad."""
    if freqs.requires_grad:
        raise ValueError("apply_rotary: freqs requires grad, but its gradient is not computed; "
                         "use megatron-core's apply_rotary_pos_emb")
    return _Rotary.apply(t, freqs, interleaved, float(mscale))
