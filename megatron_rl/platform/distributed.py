"""Process-group start-up for trainers and tests: torch.distributed plus Megatron parallel_state.

One call, `init_distributed(...)`, takes the parallel sizes (the same names as Megatron's
`initialize_model_parallel`), reads the rank and world size that torchrun exports (or runs as a
single process when they are absent), picks gloo on CPU and NCCL on GPU, builds Megatron's groups
and seeds its model-parallel RNG. `destroy_distributed()` undoes it so tests can re-initialise.

The one rule for collectives: every tensor our code hands to a torch.distributed collective over
these groups is created on `collective_device()`. NCCL serves only CUDA tensors (a CPU tensor
fails with "No backend type associated with device type cpu"), and a tensor made without a
device lands on the CPU, which CPU runs (gloo) never notice;
tests/unit/test_platform_collectives.py checks every collective call site of megatron_rl/ and
models/ against this rule. (Initialising with "cpu:gloo,cuda:nccl" instead would give each of
Megatron's groups, which megatron-core 0.19.2 creates with the default backend, a second, gloo
backend: full-mesh TCP connections per group on every rank.)
"""
from __future__ import annotations

import datetime
import os

import torch

from megatron_rl.platform.cpu_compat import activate_cpu_compat


def distributed_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def collective_device() -> torch.device:
    """Where a tensor passed to a collective over the trainer's process groups must live: this
    rank's CUDA device under NCCL (GPU), the CPU under gloo."""
    if distributed_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    seed: int = 1234,
    timeout_minutes: int = 10,
) -> None:
    """Start torch.distributed (if not already) and Megatron's model-parallel groups.

    Rank, world size and rendezvous come from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT, LOCAL_RANK); without them this process runs alone (world size 1, in-memory store).
    Data parallelism fills what the model-parallel sizes leave of the world size.
    """
    activate_cpu_compat()
    from megatron.core import parallel_state, tensor_parallel

    if not torch.distributed.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:  # launched by torchrun
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            torch.distributed.init_process_group(backend=distributed_backend(), timeout=timeout)
        else:
            # Alone: an in-memory store, not a TCP port. A port picked free and bound a moment
            # later can be taken in between by any outgoing connection (seen: EADDRINUSE in CI).
            # (RANK / WORLD_SIZE stay unset: a later re-initialisation must not mistake this
            # process for a torchrun rank.)
            os.environ.setdefault("LOCAL_RANK", "0")
            if torch.cuda.is_available():
                torch.cuda.set_device(0)
            torch.distributed.init_process_group(
                backend=distributed_backend(), store=torch.distributed.HashStore(), rank=0,
                world_size=1, timeout=timeout)
    world_size = torch.distributed.get_world_size()
    model_parallel = (tensor_model_parallel_size * pipeline_model_parallel_size
                      * context_parallel_size)
    if world_size % model_parallel:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor x pipeline x context parallel "
            f"sizes {tensor_model_parallel_size} x {pipeline_model_parallel_size} x "
            f"{context_parallel_size}; change the sizes or the number of processes")
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
    )
    # inference_rng_tracker=True: the default tracker forks CUDA RNG states, which needs CUDA.
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=not torch.cuda.is_available())
    torch.manual_seed(seed)


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
