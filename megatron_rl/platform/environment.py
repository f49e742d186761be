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

The shared values depend on the fabric (`host_fabric`, `FABRIC_DEFAULTS`). On a GB200 / GB300
NVL72 rack, NCCL reaches the other trays' GPUs over multi-node NVLink only with cuMem
(NCCL_CUMEM_ENABLE=1: MNNVL buffers are cuMem fabric allocations); with SGLang's 0 every
collective between trays (the trainer's EP all-to-all, PP and DP traffic, the weight-update
broadcast) would leave NVLink for InfiniBand or sockets. So an NVL72 host gets cuMem on, for
trainer ranks and engines alike (SGLang keeps a preset value, and turns cuMem on itself only for
multi-node engines). NVLink SHARP (NVLS) stays off on every fabric: MNNVL does not need it, each
NVLS communicator reserves multicast buffers on every GPU, and both sides of a weight-update group
must agree. The fabric is that of the host that resolves the values: the driver for the Ray job
(its GPU; a driver on a CPU-only head node of an NVL72 cluster must be told:
NCCL_CUMEM_ENABLE=1 in its environment), an SGLang server started outside Ray its own.

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

# Must be equal on both sides of a weight-update group, per fabric: "standard" (one NVLink or
# PCIe domain per host) is SGLang's defaults; "nvl72" (multi-node NVLink) needs cuMem.
FABRIC_DEFAULTS: dict[str, dict[str, str]] = {
    "standard": {"NCCL_CUMEM_ENABLE": "0", "NCCL_NVLS_ENABLE": "0"},
    "nvl72": {"NCCL_CUMEM_ENABLE": "1", "NCCL_NVLS_ENABLE": "0"},
}
SHARED_DEFAULTS: dict[str, str] = FABRIC_DEFAULTS["standard"]
# GPUs built into a multi-node NVLink rack (SGLang's is_mnnvl_fabric_device uses the same names).
_NVL72_GPU_NAMES = ("GB200", "GB300")
TRAINER_DEFAULTS: dict[str, str] = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # torch reads either
TRAINER_ALLOCATOR_CONF = "expandable_segments:True"


def host_fabric() -> str:
    """This host's GPU fabric: "nvl72" when its GPUs are on a multi-node NVLink fabric (a GB200 /
    GB300 superchip, or NVML reports the GPU's fabric registration complete), else "standard"
    (also without a GPU or NVML). Asks NVML, not CUDA: the SGLang launcher runs it before SGLang
    starts, and must not create a CUDA context there."""
    try:
        import pynvml
    except ImportError:
        return "standard"
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 (no driver, no GPU: not a GPU fabric)
        return "standard"
    try:
        if not pynvml.nvmlDeviceGetCount():
            return "standard"
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        name = (name.decode() if isinstance(name, bytes) else str(name)).upper()
        if any(tag in name for tag in _NVL72_GPU_NAMES):
            return "nvl72"
        fabric = getattr(pynvml, "nvmlDeviceGetGpuFabricInfo", None)
        completed = getattr(pynvml, "NVML_GPU_FABRIC_STATE_COMPLETED", None)
        if fabric is not None and completed is not None:
            try:
                if fabric(handle).state == completed:
                    return "nvl72"
            except Exception:  # noqa: BLE001 (NVML_ERROR_NOT_SUPPORTED off a fabric)
                pass
        return "standard"
    except Exception:  # noqa: BLE001 (an NVML that cannot answer: no fabric to use)
        return "standard"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def shared_environment(environ: Mapping[str, str] | None = None, *,
                       fabric: str | None = None) -> dict[str, str]:
    """The variables trainer ranks and engines must agree on: `environ`'s value (default
    os.environ) where it sets one, else the default of `fabric` (None: `host_fabric()`)."""
    environ = os.environ if environ is None else environ
    fabric = host_fabric() if fabric is None else fabric
    if fabric not in FABRIC_DEFAULTS:
        raise ValueError(f"fabric {fabric!r}: choose one of {sorted(FABRIC_DEFAULTS)}")
    return {name: environ.get(name, default)
            for name, default in FABRIC_DEFAULTS[fabric].items()}


def trainer_environment(environ: Mapping[str, str] | None = None, *,
                        cuda_ipc: bool, fabric: str | None = None) -> dict[str, str]:
    """A trainer rank's variables: the shared ones and the trainer's own. `cuda_ipc`: the weights
    reach the engines through CUDA IPC (weight_sync.transport=tensor), so no expandable segments."""
    environ = os.environ if environ is None else environ
    env = shared_environment(environ, fabric=fabric)
    env.update({name: environ.get(name, default) for name, default in TRAINER_DEFAULTS.items()})
    if not cuda_ipc and not any(name in environ for name in ALLOCATOR_VARIABLES):
        env[ALLOCATOR_VARIABLES[0]] = TRAINER_ALLOCATOR_CONF
    return env


def generator_environment(environ: Mapping[str, str] | None = None, *,
                          fabric: str | None = None) -> dict[str, str]:
    """An SGLang engine's variables (the shared ones; SGLang sets the rest itself)."""
    return shared_environment(environ, fabric=fabric)


def apply_generator_environment() -> dict[str, str]:
    """Set the engine's variables in this process (an SGLang server, before SGLang is imported);
    values already set stay. Returns them."""
    env = generator_environment()
    os.environ.update(env)
    return env
