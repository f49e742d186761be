"""Megatron shards -> full tensors under TP1/EP1/PP1 names, on one sender per pipeline stage.

Every rank of a pipeline stage holds shards of that stage's parameters: dense weights split over
tensor-parallel ranks (`param.partition_dim`), experts split over expert-parallel ranks (and over
expert-tensor-parallel ranks), layers numbered locally. `StageGatherer.gather(names)` assembles the
full tensors under the names a TP1/EP1/PP1 GPTModel with the local spec would use (global layer
and expert numbers: the names models/<family>/convert.py's WeightGroups speak) on the stage's
sender, and returns {} on every other rank.

How: at construction every rank publishes which shard of which global tensor it holds (one
`all_gather_object`). For each shard the gatherer picks one source rank (the sender when it holds
it, else the lowest holder: data-parallel replicas are identical), and a gather is point-to-point:
each source sends its shards straight to the sender, in the same order on both sides. Ranks that
are the source of nothing (other data-parallel replicas, ...) take no part at all, and nobody
receives a shard it does not need (an all-gather would move every shard to every rank).

Zero-copy where the layout allows: a shard that is a contiguous block of the full tensor (split
along dim 0) is received straight into its place, and that place can be the caller's buffer
(`into`: a slot of the outgoing bucket). Other shards (split along dim 1) are received into scratch
memory and copied into place. Full tensors and scratch live in an `Arena` that is reused from
bucket to bucket and sync to sync (fresh host memory costs a page fault per 4 KiB: for a few
hundred MB that is more than the copy itself).

Layout fixes that a plain concatenation of shards gets wrong: a gated MLP's linear_fc1 holds
[gate_r; up_r] per TP rank, so the full [gate; up] is rebuilt from the halves of every shard.
Transformer Engine names (fused layer-norm weights, grouped-GEMM experts) are renamed to the
local-spec names, so the same mapping serves GPU runs. Megatron's padded vocabulary rows are
trimmed to the HF vocabulary.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
# Transformer Engine fuses the pre-attention / pre-MLP norm into the next linear.
_TE_RENAMES = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
               "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
               "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
               "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias"}
_VOCAB_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncGroups:
    """Where this rank sits, as the weight sync needs it (STYLE.md rule 4)."""

    pp_rank: int
    tp_rank: int
    tp_size: int
    etp_rank: int  # expert tensor parallel
    etp_size: int
    sender_rank: int  # global rank that sends this stage's weights (its lowest rank)
    pp_size: int = 1

    @property
    def is_sender(self) -> bool:
        return dist.get_rank() == self.sender_rank

    @classmethod
    def from_parallel_state(cls) -> "WeightSyncGroups":
        """From Megatron's parallel_state (collective: every trainer rank must call it)."""
        from megatron.core import parallel_state as ps

        pp_rank = ps.get_pipeline_model_parallel_rank()
        ranks_pp = [None] * dist.get_world_size()
        dist.all_gather_object(ranks_pp, pp_rank)
        return cls(pp_rank=pp_rank, tp_rank=ps.get_tensor_model_parallel_rank(),
                   tp_size=ps.get_tensor_model_parallel_world_size(),
                   etp_rank=ps.get_expert_tensor_parallel_rank(),
                   etp_size=ps.get_expert_tensor_parallel_world_size(),
                   sender_rank=ranks_pp.index(pp_rank),
                   pp_size=ps.get_pipeline_model_parallel_world_size())


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Shard:
    """Which piece of a global tensor a rank holds."""

    name: str  # TP1/EP1/PP1 name
    index: int  # shard number along `dim` (0 when not split)
    count: int  # shards of the full tensor
    dim: int  # partition dim
    shape: tuple[int, ...]  # the shard's shape
    dtype: torch.dtype
    gated: bool  # [gate_r; up_r] rows of a gated MLP's linear_fc1

    @property
    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.shape)
        shape[self.dim] *= self.count
        return tuple(shape)


class Arena:
    """Reusable scratch memory: `take` hands out aligned views of one buffer, `reset` frees them
    all. When a round needs more than the buffer holds, extra chunks are allocated and the next
    round gets one buffer of the combined size, so steady state allocates nothing."""

    ALIGN = 256

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self._chunks: list[torch.Tensor] = []
        self._offset = 0
        self._needed = 0

    def take(self, shape: Iterable[int], dtype: torch.dtype) -> torch.Tensor:
        shape = tuple(shape)
        num_bytes = math.prod(shape) * dtype.itemsize
        size = -(-num_bytes // self.ALIGN) * self.ALIGN
        self._needed += size
        if not self._chunks or self._offset + size > self._chunks[-1].numel():
            self._chunks.append(torch.empty(max(size, self._needed), dtype=torch.uint8,
                                            device=self.device))
            self._offset = 0
        view = self._chunks[-1][self._offset:self._offset + num_bytes]
        self._offset += size
        return view.view(dtype).view(shape)

    def reset(self) -> None:
        if len(self._chunks) > 1:  # grow to one buffer that fits the largest round
            self._chunks = [torch.empty(self._needed, dtype=torch.uint8, device=self.device)]
        self._offset = self._needed = 0

    @property
    def capacity(self) -> int:
        return sum(chunk.numel() for chunk in self._chunks)


def global_parameter_names(gpt_model) -> dict[str, tuple[str, torch.nn.Parameter, int | None]]:
    """{TP1/EP1/PP1 name: (local name, parameter, local expert index or None)} of this rank's
    pipeline stage; experts carry their global numbers."""
    names = {}
    for local_name, param in gpt_model.named_parameters():
        name, expert = local_name, None
        match = _LAYER.match(local_name)
        if match:
            layer = gpt_model.decoder.layers[int(match[1])]
            rest = _TE_RENAMES.get(match[2], match[2])
            grouped = _GROUPED_EXPERT.match(rest)
            if grouped:
                rest = f"mlp.experts.local_experts.{grouped[3]}.{grouped[1]}.{grouped[2]}"
            local_expert = _LOCAL_EXPERT.match(rest)
            if local_expert:
                expert = int(local_expert[1])
                rest = (f"mlp.experts.local_experts."
                        f"{layer.mlp.local_expert_indices[expert]}.{local_expert[2]}")
            name = f"decoder.layers.{layer.layer_number - 1}.{rest}"
        names[name] = (local_name, param, expert)
    return names


class StageGatherer:
    """Full tensors of one pipeline stage on its sender (see the module docstring). Building it
    is collective over the whole trainer world."""

    def __init__(self, gpt_model, groups: WeightSyncGroups, *, gated_linear_unit: bool,
                 vocab_size: int | None = None):
        self.groups = groups
        self.vocab_size = vocab_size  # trim Megatron's padded vocabulary rows to this
        self.rank = dist.get_rank()
        self.local: dict[str, tuple[torch.Tensor, Shard]] = {}
        for name, (_, param, expert) in global_parameter_names(gpt_model).items():
            split = bool(getattr(param, "tensor_model_parallel", False))
            index, count = ((groups.etp_rank, groups.etp_size) if expert is not None
                            else (groups.tp_rank, groups.tp_size))
            if not split or count == 1:
                index, count = 0, 1
            dim = int(getattr(param, "partition_dim", 0)) if count > 1 else 0
            gated = gated_linear_unit and name.endswith(("linear_fc1.weight", "linear_fc1.bias"))
            if gated and count > 1 and dim != 0:
                raise ValueError(f"{name}: a gated linear_fc1 split along dim {dim} (expected 0)")
            self.local[name] = (param.detach(), Shard(
                name=name, index=index, count=count, dim=dim, shape=tuple(param.shape),
                dtype=param.dtype, gated=gated and count > 1))
        self.device = next(iter(self.local.values()))[0].device if self.local else "cpu"
        published = [None] * dist.get_world_size()
        dist.all_gather_object(published, (groups.pp_rank, [s for _, s in self.local.values()]))
        self.shards: dict[str, list[Shard]] = {}  # this stage's tensors: every shard
        self.sources: dict[str, list[int]] = {}  # rank that sends shard i of name
        self.stage_names: dict[int, set[str]] = {}  # every stage's TP1/EP1/PP1 names
        for rank, (pp_rank, shards) in enumerate(published):
            self.stage_names.setdefault(pp_rank, set()).update(s.name for s in shards)
            if pp_rank != groups.pp_rank:
                continue
            for shard in shards:
                by_index = self.shards.setdefault(shard.name, [None] * shard.count)
                sources = self.sources.setdefault(shard.name, [None] * shard.count)
                if by_index[shard.index] is None:
                    by_index[shard.index] = shard
                if sources[shard.index] is None or rank == groups.sender_rank:
                    sources[shard.index] = rank  # the lowest holder, or the sender itself
        for name, by_index in self.shards.items():
            if any(s is None for s in by_index):
                raise ValueError(f"{name}: no rank of pipeline stage {groups.pp_rank} holds "
                                 f"shards {[i for i, s in enumerate(by_index) if s is None]}")

    def _trimmed(self, name: str) -> bool:
        shard = self.shards[name][0]
        return (self.vocab_size is not None and name in _VOCAB_NAMES
                and shard.full_shape[0] > self.vocab_size)

    def meta(self, name: str) -> torch.Tensor:
        """A meta tensor with the full tensor's HF-side shape and dtype (no communication)."""
        shard = self.shards[name][0]
        shape = list(shard.full_shape)
        if self._trimmed(name):
            shape[0] = self.vocab_size
        return torch.empty(shape, dtype=shard.dtype, device="meta")

    def can_fill(self, name: str) -> bool:
        """Whether `gather(into={name: ...})` can assemble `name` straight in the caller's buffer
        (no vocabulary padding to drop)."""
        return not self._trimmed(name)

    def participates(self, names: Iterable[str]) -> bool:
        """Whether this rank sends or receives anything when gathering `names`."""
        if self.groups.is_sender:
            return True
        return any(self.rank in self.sources[name] for name in names)

    def gather(self, names: Iterable[str], *, into: Mapping[str, torch.Tensor] | None = None,
               arena: Arena | None = None) -> dict[str, torch.Tensor]:
        """{name: full tensor} on the sender ({} elsewhere); collective among the ranks that hold
        the chosen shards, in the order of `names` (the same on every rank). `into[name]` (sender
        only, full HF-side shape) receives the tensor in place; the other results are views of
        this rank's parameters or of `arena` (valid until its next reset)."""
        names = list(names)
        into = into or {}
        arena = arena or Arena(self.device)
        if not self.groups.is_sender:
            works = [dist.isend(tensor.contiguous(), dst=self.groups.sender_rank)
                     for name in names for tensor in self._pieces_from_me(name)]
            for work in works:
                work.wait()
            return {}
        works, copies, out = [], [], {}
        for name in names:
            shards, sources = self.shards[name], self.sources[name]
            local, _ = self.local.get(name, (None, None))
            if len(shards) == 1 and sources[0] == self.rank:
                full = local  # the sender's own parameter: no copy
                if name in into:
                    into[name].copy_(local)
                    full = into[name]
                out[name] = full
                continue
            full = into.get(name)
            if full is None:
                full = arena.take(shards[0].full_shape, shards[0].dtype)
                out[name] = full[:self.vocab_size] if self._trimmed(name) else full
            else:
                out[name] = full
            for shard, source in zip(shards, sources):
                for target, piece in self._places(full, shard, local, source):
                    if source == self.rank:
                        copies.append((target, piece))
                    elif target.is_contiguous():
                        works.append(dist.irecv(target, src=source))
                    else:  # a strided place: receive into scratch, copy when it arrives
                        scratch = arena.take(target.shape, target.dtype)
                        works.append(dist.irecv(scratch, src=source))
                        copies.append((target, scratch))
        for work in works:
            work.wait()
        for target, piece in copies:
            target.copy_(piece)
        return out

    def _pieces_from_me(self, name: str) -> list[torch.Tensor]:
        """What this (non-sender) rank sends for `name`, in the order the sender receives."""
        if self.rank not in self.sources[name]:
            return []
        tensor, shard = self.local[name]
        if self.sources[name][shard.index] != self.rank:
            return []
        return list(tensor.chunk(2, dim=0)) if shard.gated else [tensor]

    def _places(self, full: torch.Tensor, shard: Shard, local: torch.Tensor | None,
                source: int):
        """[(place in `full`, the sender's own piece or None)] for one shard, in send order."""
        mine = source == self.rank
        if shard.gated:  # [gate_r; up_r] -> rows r of the gate half and of the up half
            rows = shard.shape[0] // 2
            halves = local.chunk(2, dim=0) if mine else (None, None)
            return [(full.narrow(0, part * rows * shard.count + shard.index * rows, rows), half)
                    for part, half in enumerate(halves)]
        size = shard.shape[shard.dim]
        return [(full.narrow(shard.dim, shard.index * size, size), local if mine else None)]
