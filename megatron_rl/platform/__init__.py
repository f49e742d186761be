"""What differs between CPU and GPU, in one place: capability queries, the CPU shims, and
process-group start-up.

Everything else in the project asks this package (`has_cuda()`, `has_transformer_engine()`) instead
of branching on `torch.cuda` itself. `activate_cpu_compat()` applies the CPU shims (a no-op when
CUDA is available) and must run before the first `import megatron.core`;
`init_distributed(...)` does that, starts torch.distributed (gloo on CPU, NCCL on GPU) and
Megatron's parallel_state, and seeds Megatron's model-parallel RNG. Tensors that enter the model
live on `device()`; tensors handed to a collective are created on `collective_device()`.
Importing this package does not import Megatron.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from megatron_rl.platform.cpu_compat import activate_cpu_compat, is_cpu_compat_active
from megatron_rl.platform.distributed import (
    collective_device,
    destroy_distributed,
    distributed_backend,
    init_distributed,
)

__all__ = [
    "activate_cpu_compat",
    "collective_device",
    "destroy_distributed",
    "device",
    "distributed_backend",
    "has_cuda",
    "has_transformer_engine",
    "init_distributed",
    "is_cpu_compat_active",
]


def has_cuda() -> bool:
    """True when torch sees a CUDA device (GPU paths: TE layers, FP8, NCCL)."""
    return torch.cuda.is_available()


@functools.cache
def has_transformer_engine() -> bool:
    """True when Transformer Engine's PyTorch bindings import (needs CUDA and cuDNN)."""
    if not has_cuda() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return False
    return True


def device() -> torch.device:
    """The device this process computes on: its CUDA device on GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if has_cuda() else torch.device("cpu")
