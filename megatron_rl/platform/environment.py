"""The environment variables that trainer ranks and SGLang engines start with, in one place.

A weight-update group is one NCCL communicator over a trainer rank (the sender) and every engine
rank, and its ranks must agree on NCCL's memory and NVLink-SHARP settings. SGLang 0.5.23 sets
NCCL_CUMEM_ENABLE=0 and NCCL_NVLS_ENABLE=0 in its engines unless they are already set
(sglang/srt/entrypoints/engine.py, `_set_envs_and_config`); a trainer rank left at NCCL's defaults
(both on where the hardware has them) then forms a group that fails (slime sets the same value on
its trainer actors for this reason). So the shared values are resolved once, on the driver, from
its environment (a value set there wins; otherwise SGLang's defaults below), and reach:

- every Ray worker of the run (trainer ranks, generator actors and the SGLang servers these start)
  through the job's runtime_env (`megatron_rl.cluster.runtime`);
- each trainer rank again in its torchrun-style environment (`megatron_rl.cluster.trainers`);
- every SGLang server process before SGLang reads them (`megatron_rl.rollout.sglang_launch`; a
  server started outside Ray gets its own environment's values, else the same defaults).

Values for one kind of process (they configure the process, not a communicator):

- trainer ranks: CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's tensor / sequence-parallel layers
  launch a collective and then the GEMM it overlaps, and rely on one hardware queue to start them
  in that order: megatron/core/tensor_parallel/layers.py), and PYTORCH_CUDA_ALLOC_CONF=
  expandable_segments:True (less fragmentation as sequence lengths vary) unless the weights go to
  colocated engines through CUDA IPC: sharing expandable-segment memory needs pidfd_getfd, which
  unprivileged containers refuse (pytorch/pytorch#165685). An allocator setting already in the
  environment (PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF) is left as it is.
- engines: nothing more. SGLang sets its own CUDA_DEVICE_MAX_CONNECTIONS (8) and keeps torch's
  allocator defaults (its weight cache refuses expandable segments).

On CPU nothing reads these variables; they are set all the same (one code path).
"""
from __future__ import annotations

import os
from collections.abc import Mapping

# Must be equal on both sides of a weight-update group; SGLang's defaults.
SHARED_DEFAULTS: dict[str, str] = {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"}
TRAINER_DEFAULTS: dict[str, str] = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either
TRAINER_ALLOCATOR_CONF = "expandable_segments:True"


def shared_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables trainer ranks and engines must agree on: `environ`'s value (default
    os.environ) where it sets one, else SGLang's default."""
    environ = os.environ if environ is None else environ
    return {name: environ.get(name, default) for name, default in SHARED_DEFAULTS.items()}


def trainer_environment(environ: Mapping[str, str] | None = None, *,
                        cuda_ipc: bool) -> dict[str, str]:
    """A trainer rank's variables: the shared ones and the trainer's own. `cuda_ipc`: the weights
    reach the engines through CUDA IPC (weight_sync.transport=tensor), so no expandable segments."""
    environ = os.environ if environ is None else environ
    env = shared_environment(environ)
    env.update({name: environ.get(name, default) for name, default in TRAINER_DEFAULTS.items()})
    if not cuda_ipc and not any(name in environ for name in ALLOCATOR_VARIABLES):
        env[ALLOCATOR_VARIABLES[0]] = TRAINER_ALLOCATOR_CONF
    return env


def generator_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """An SGLang engine's variables (the shared ones; SGLang sets the rest itself)."""
    return shared_environment(environ)


def apply_generator_environment() -> dict[str, str]:
    """Set the engine's variables in this process (an SGLang server, before SGLang is imported);
    values already set stay. Returns them."""
    env = generator_environment()
    os.environ.update(env)
    return env
