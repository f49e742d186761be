"""CPU shim 13 (megatron_rl/platform/cpu_compat.py): Megatron's synchronous checkpoint save on CPU
passes its write results through an in-process queue, not a spawned multiprocessing Manager.
Checked with a real dist_checkpointing save and load of sharded tensors on one gloo rank: the
save starts no process, and what is loaded equals what was saved."""
import queue

import psutil
import pytest
import torch

pytestmark = pytest.mark.unit


def test_a_synchronous_save_starts_no_process_and_round_trips(tmp_path, megatron_process_group):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert isinstance(filesystem_async._results_queue, queue.Queue)
    torch.manual_seed(0)
    saved = {"a": torch.randn(4, 3), "b": torch.arange(10, dtype=torch.float32)}

    def sharded(tensors):
        return {k: ShardedTensor.from_rank_offsets(k, v) for k, v in tensors.items()}

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    dist_checkpointing.save(sharded(saved), str(tmp_path))
    started = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not started, [psutil.Process(p).cmdline() for p in started if psutil.pid_exists(p)]
    loaded = dist_checkpointing.load(sharded({k: torch.zeros_like(v) for k, v in saved.items()}),
                                     str(tmp_path))
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
