"""The `serialized_named_tensors` of SGLang's `/update_weights_from_tensor` (colocated weight
updates), built as SGLang 0.5.23's own Engine builds it (srt/entrypoints/engine.py,
`_serialize_tensors_per_rank`):

- One serialisation per engine rank (its tp_size; expert parallelism splits the same ranks), and
  each rank deserialises only its own (`TpModelWorker.deserialize_own_rank`). Serialising a CUDA
  tensor takes one reference in torch's CUDA IPC reference counting, which the receiver gives
  back when it drops the tensor: one payload read by N ranks gives it back N times, so the
  sender's memory could return to its allocator while other ranks still read it.
- CUDA tensors are reduced with SGLang's `monkey_patch_torch_reductions` (the receiving ranks
  apply it too): a tensor carries its GPU's UUID instead of its index, which the engine maps to
  its own index; trainer and engine see different CUDA_VISIBLE_DEVICES, so the index would name
  another GPU there. The patch is in force only while serialising and is undone afterwards:
  SGLang's reducer fails on CPU tensors (IndexError), which other code in the trainer's process
  pickles through torch.multiprocessing (checkpoint workers, queues).
- CPU tensors (CPU runs) travel through shared-memory files (torch's `file_system` strategy;
  CPU_STACK.md).

Nothing here keeps the tensors alive: the caller must not write their memory again until the
engine is done with it (megatron_rl.weight_sync gives every bucket fresh memory).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import torch

_REDUCTIONS_LOCK = threading.Lock()


def serialize_for_ranks(named_tensors: Sequence[tuple[str, torch.Tensor]],
                        num_ranks: int) -> list[str]:
    """One base64 payload per engine rank (JSON's `serialized_named_tensors`)."""
    from sglang.srt.utils import MultiprocessingSerializer

    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1 (the engine's tp_size), got {num_ranks}")
    named_tensors = list(named_tensors)
    on_cuda = any(tensor.is_cuda for _, tensor in named_tensors)
    if not on_cuda:
        torch.multiprocessing.set_sharing_strategy("file_system")
    with sglang_cuda_reductions() if on_cuda else contextlib.nullcontext():
        return [_serialize(MultiprocessingSerializer, named_tensors) for _ in range(num_ranks)]


# A CPU tensor's shared-memory file is registered with torch's shm manager daemon, which torch
# starts on first use; on a loaded machine its first answer can come after libshm's connection
# timeout ("Shared memory manager connection has timed out", seen in the suite at load ~50). The
# daemon is up by then: asking again succeeds. Bounded: a manager that never answers still fails.
_SHM_MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
_SHM_MANAGER_ATTEMPTS = 3


def _serialize(serializer, named_tensors: list) -> str:
    for attempt in range(1, _SHM_MANAGER_ATTEMPTS + 1):
        try:
            return serializer.serialize(named_tensors, output_str=True)
        except RuntimeError as exc:
            if _SHM_MANAGER_TIMEOUT not in str(exc) or attempt == _SHM_MANAGER_ATTEMPTS:
                raise


@contextlib.contextmanager
def sglang_cuda_reductions() -> Iterator[None]:
    """SGLang's tensor reductions in this process for the duration, then torch's again (unless
    they were SGLang's before: an engine in this process keeps them). Serialised: one thread
    at a time."""
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from torch.multiprocessing import reductions

    with _REDUCTIONS_LOCK:
        patched_before = hasattr(reductions, "_reduce_tensor_original")
        monkey_patch_torch_reductions()
        try:
            yield
        finally:
            if not patched_before:
                reductions.reduce_tensor = reductions._reduce_tensor_original
                reductions.rebuild_cuda_tensor = reductions._rebuild_cuda_tensor_original
                del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
                reductions.init_reductions()
