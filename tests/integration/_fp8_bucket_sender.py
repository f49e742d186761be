"""Run by tests/integration/_fp8_sglang_worker.py (argv: port, group name, buckets file): the
trainer's side of one weight-update group. megatron_rl's DistributedTransport joins the group as
its rank 0 and broadcasts the buckets the worker saved (the sync's FP8 bucket bytes) over gloo,
as a stage's sender does; SGLang's receiving side runs in the worker. The generator stand-in
makes no calls: the worker calls SGLang's WeightUpdater itself, as the engine would on the
HTTP requests."""
import sys

import torch

from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.transport import DistributedTransport


class InProcessEngine:
    """The engine's HTTP calls, made by the worker instead."""

    num_ranks = 1

    def init_weight_update_group(self, group) -> None:
        pass

    def update_weights_from_distributed(self, *args, **kwargs) -> None:
        pass

    def destroy_weight_update_group(self, group_name: str) -> None:
        pass


port, group_name, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
buckets = torch.load(path, weights_only=False)  # [(specs, uint8 data)]
transport = DistributedTransport([InProcessEngine()], master_address="127.0.0.1",
                                 master_port=port, group_name=group_name, backend="gloo",
                                 timeout_s=120)
transport.connect()
for specs, data in buckets:
    transport.send(Bucket(specs=specs, data=data), version=None, flush_cache=False)
transport.close()
print("SENT", len(buckets))
