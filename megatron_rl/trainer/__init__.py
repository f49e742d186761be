"""The Megatron RL trainer: model build from the models registry at a TP/EP/PP/SP/DP layout,
distributed AdamW, the RL forward-backward (FP32 chunked log-prob head, global-denominator
aggregation), packed micro-batches, and resharding checkpoints. Importing this package does not
import Megatron; building an `RLTrainer` does (after the platform's CPU shims).
"""
from megatron_rl.trainer.batch import MicroBatch, TrainBatch, pack_micro_batches, \
    shard_for_data_parallel
from megatron_rl.trainer.checkpoint import CheckpointState
from megatron_rl.trainer.model import PrecisionChoice, precision_overrides
from megatron_rl.trainer.optimizer import OptimizerSettings
from megatron_rl.trainer.parallel import ParallelGroups, ParallelLayout, init_parallel
from megatron_rl.trainer.step import LossSettings
from megatron_rl.trainer.trainer import RLTrainer, StepMetrics, TrainerSettings

__all__ = [
    "CheckpointState",
    "LossSettings",
    "MicroBatch",
    "OptimizerSettings",
    "ParallelGroups",
    "ParallelLayout",
    "PrecisionChoice",
    "RLTrainer",
    "StepMetrics",
    "TrainBatch",
    "TrainerSettings",
    "init_parallel",
    "pack_micro_batches",
    "precision_overrides",
    "shard_for_data_parallel",
]
