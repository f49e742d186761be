"""The trainer's parallel layout and the one object that names its process groups.

`ParallelLayout` holds the sizes (Megatron's own field names) and checks them against the world
size; `init_parallel(layout, seed)` starts torch.distributed and Megatron's parallel_state through
megatron_rl.platform and returns `ParallelGroups`, which the rest of the trainer receives instead
of reaching for parallel_state globals. Data parallelism fills what the model-parallel sizes leave.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: same as tensor_model_parallel_size
    context_parallel_size: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for field in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "expert_model_parallel_size", "context_parallel_size"):
            if getattr(self, field) < 1:
                raise ValueError(f"parallelism.{field} must be >= 1, got {getattr(self, field)}")
        if self.expert_tensor_parallel_size is not None and self.expert_tensor_parallel_size < 1:
            raise ValueError("parallelism.expert_tensor_parallel_size must be >= 1 or None")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ValueError("parallelism.sequence_parallel needs tensor_model_parallel_size > 1; "
                             "set sequence_parallel=False")

    @classmethod
    def from_config(cls, parallelism) -> "ParallelLayout":
        """From megatron_rl.config's `parallelism` section (or any object with these fields)."""
        return cls(tensor_model_parallel_size=parallelism.tensor_model_parallel_size,
                   pipeline_model_parallel_size=parallelism.pipeline_model_parallel_size,
                   expert_model_parallel_size=parallelism.expert_model_parallel_size,
                   expert_tensor_parallel_size=parallelism.expert_tensor_parallel_size,
                   context_parallel_size=parallelism.context_parallel_size,
                   sequence_parallel=parallelism.sequence_parallel)

    @property
    def model_parallel_size(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size)

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world size {world_size} is not divisible by TP x PP x CP = "
                f"{self.model_parallel_size}; change the parallel sizes or the number of ranks")
        dp = world_size // self.model_parallel_size
        expert_tp = self.expert_tensor_parallel_size or self.tensor_model_parallel_size
        expert_mp = self.expert_model_parallel_size * expert_tp * self.pipeline_model_parallel_size
        if world_size % expert_mp:
            raise ValueError(
                f"world size {world_size} is not divisible by EP x ETP x PP = {expert_mp}; "
                "change expert_model_parallel_size / expert_tensor_parallel_size")
        return dp

    def megatron_overrides(self) -> dict:
        """TransformerConfig fields for this layout."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ParallelGroups:
    """The process groups of this rank, named once (STYLE.md rule 4)."""

    tp: torch.distributed.ProcessGroup
    pp: torch.distributed.ProcessGroup
    dp: torch.distributed.ProcessGroup  # data parallel of dense parameters (CP excluded)
    expert_dp: torch.distributed.ProcessGroup  # data parallel of expert parameters
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    # Context parallelism: each sequence split over the CP ranks (load-balanced, trainer/batch.py).
    # dp_cp is the group Megatron DDP reduces dense gradients over (data parallel WITH context
    # parallel); None: no CP, the same as dp.
    dp_cp: torch.distributed.ProcessGroup | None = None
    cp_rank: int = 0
    cp_size: int = 1

    @property
    def data_group(self) -> torch.distributed.ProcessGroup:
        """The ranks whose tokens together make the global batch at one (TP, PP) coordinate:
        data parallel x context parallel. Per-token statistics are summed over it."""
        return self.dp_cp if self.dp_cp is not None else self.dp

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pipeline_last_rank(self) -> int:
        """Global rank of this pipeline's last stage (source of broadcast metrics)."""
        return torch.distributed.get_process_group_ranks(self.pp)[-1]

    @classmethod
    def from_parallel_state(cls) -> "ParallelGroups":
        from megatron.core import parallel_state as ps

        return cls(
            tp=ps.get_tensor_model_parallel_group(), pp=ps.get_pipeline_model_parallel_group(),
            dp=ps.get_data_parallel_group(), expert_dp=ps.get_expert_data_parallel_group(),
            world_size=torch.distributed.get_world_size(),
            tp_rank=ps.get_tensor_model_parallel_rank(),
            pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=ps.get_data_parallel_rank(),
            tp_size=ps.get_tensor_model_parallel_world_size(),
            pp_size=ps.get_pipeline_model_parallel_world_size(),
            dp_size=ps.get_data_parallel_world_size(),
            dp_cp=ps.get_data_parallel_group(with_context_parallel=True),
            cp_rank=ps.get_context_parallel_rank(),
            cp_size=ps.get_context_parallel_world_size(),
        )


def init_parallel(layout: ParallelLayout, *, seed: int = 1234) -> ParallelGroups:
    """Start (or re-start, at a new layout) the process groups for `layout` on this rank."""
    from megatron_rl.platform import init_distributed

    if torch.distributed.is_initialized():  # else the sizes are checked once it is
        layout.data_parallel_size(torch.distributed.get_world_size())
    init_distributed(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        seed=seed,
    )
    layout.data_parallel_size(torch.distributed.get_world_size())
    return ParallelGroups.from_parallel_state()
