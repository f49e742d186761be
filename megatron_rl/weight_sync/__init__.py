"""Trainer -> generator weight transfer: Megatron shards (any TP / EP / PP) gathered per pipeline
stage onto one sender, converted to HF names and layouts by the family's converter mapping
straight into planned buckets, and sent over a torch.distributed group that includes the generator
ranks (NCCL on GPU, gloo on CPU) while the next bucket is prepared, with in-memory tensors
(colocated) and disk as fallbacks. Importing this package does not import Megatron or SGLang."""
from megatron_rl.weight_sync.buckets import Bucket
from megatron_rl.weight_sync.gather import (Arena, StageGatherer, WeightSyncGroups,
                                            global_parameter_names)
from megatron_rl.weight_sync.plan import PlannedBucket, plan_buckets
from megatron_rl.weight_sync.sync import SyncReport, WeightSync, WeightSyncError, \
    WeightSyncSettings
from megatron_rl.weight_sync.transport import (DiskTransport, DistributedTransport,
                                               TensorTransport, init_sender_group)

__all__ = [
    "Arena",
    "Bucket",
    "DiskTransport",
    "DistributedTransport",
    "PlannedBucket",
    "StageGatherer",
    "SyncReport",
    "TensorTransport",
    "WeightSync",
    "WeightSyncError",
    "WeightSyncGroups",
    "WeightSyncSettings",
    "global_parameter_names",
    "init_sender_group",
    "plan_buckets",
]
