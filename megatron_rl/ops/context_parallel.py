"""Which positions of a sequence a context-parallel rank holds: Megatron's load-balanced layout.
The trainer's batch split (trainer/batch.py), the attention of the model families (models/) and
the CPU RoPE shim (platform/cpu_compat.py) all follow it, so it lives below all three.
"""
from __future__ import annotations

import torch


def load_balanced_positions(seq_len: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Global positions [seq_len / cp_size] (int64) that context-parallel rank `cp_rank` holds of
    a sequence of `seq_len` positions, in its local order: Megatron's load-balanced layout (the
    sequence cut into 2 * cp_size equal chunks, rank r keeps chunk r then chunk 2 * cp_size - 1 - r,
    so every rank gets the same share of causal-attention work). `seq_len` must be a multiple of
    2 * cp_size."""
    if cp_size == 1:
        return torch.arange(seq_len)
    if seq_len % (2 * cp_size):
        raise ValueError(f"context parallelism over {cp_size} ranks needs sequences padded to a "
                         f"multiple of 2 * {cp_size}; got length {seq_len}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    chunk = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk),
                      torch.arange((2 * cp_size - 1 - cp_rank) * chunk,
                                   (2 * cp_size - cp_rank) * chunk)])
