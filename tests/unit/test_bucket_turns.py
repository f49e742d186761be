"""BucketTurns: the pipeline stages' senders send one bucket at a time, cluster-wide, in the order
they asked (the PP2 x 2-engine deadlock it prevents: tests/integration/test_sglang_tp_ep2_moe.py).
Threads stand in for the stages' senders over one in-memory store (torch's HashStore)."""
from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from megatron_rl.weight_sync.transport import BucketTurns

pytestmark = pytest.mark.unit


def test_stages_never_send_at_once_and_every_bucket_gets_its_turn():
    store = dist.HashStore()
    inside, log, errors = [], [], []
    lock = threading.Lock()

    def stage(index: int):
        turns = BucketTurns(store, "session/", timeout_s=60)
        try:
            for bucket in range(20):
                with turns.turn():
                    with lock:
                        inside.append(index)
                        overlap = len(inside) > 1
                    log.append((index, bucket, overlap))
                    time.sleep(0.001)
                    with lock:
                        inside.remove(index)
        except Exception as exc:  # noqa: BLE001 (asserted below)
            errors.append(exc)

    threads = [threading.Thread(target=stage, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    assert len(log) == 60 and not any(overlap for _, _, overlap in log)
    for index in range(3):  # each stage's buckets in its own order
        assert [b for i, b, _ in log if i == index] == list(range(20))
    assert int(BucketTurns(store, "session/", timeout_s=1).store.add("serving", 0)) == 60
    assert int(BucketTurns(store, "other/", timeout_s=1).store.add("serving", 0)) == 0


def test_a_sender_that_never_gives_the_turn_back_times_the_others_out():
    store = dist.HashStore()
    holder = BucketTurns(store, "s/", timeout_s=60)
    taken = holder.turn()
    taken.__enter__()  # a stage stopped mid-bucket
    waiter = BucketTurns(store, "s/", timeout_s=0.2)
    with pytest.raises(TimeoutError, match="held the weight-sync turn"):
        with waiter.turn():
            pass
