"""Trainer -> generator weight transfer: Megatron shards (any TP / EP / PP) gathered per pipeline
stage, converted to HF names and layouts by the family's converter mapping, packed into buckets
and sent over a torch.distributed group that includes the generator ranks (NCCL on GPU, gloo on
CPU), with in-memory tensors (colocated) and disk as fallbacks. Importing this package does not
import Megatron or SGLang."""
from megatron_rl.weight_sync.buckets import Bucket, BucketPacker, pack_buckets
from megatron_rl.weight_sync.gather import StageGatherer, WeightSyncGroups, global_parameter_names
from megatron_rl.weight_sync.sync import SyncReport, WeightSync, WeightSyncError, \
    WeightSyncSettings
from megatron_rl.weight_sync.transport import (DiskTransport, DistributedTransport,
                                               TensorTransport, init_sender_group)

__all__ = [
    "Bucket",
    "BucketPacker",
    "DiskTransport",
    "DistributedTransport",
    "StageGatherer",
    "SyncReport",
    "TensorTransport",
    "WeightSync",
    "WeightSyncError",
    "WeightSyncGroups",
    "WeightSyncSettings",
    "global_parameter_names",
    "init_sender_group",
    "pack_buckets",
]
