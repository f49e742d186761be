"""Megatron shards -> full tensors under TP1/EP1/PP1 names, one pipeline stage at a time.

Every rank of a pipeline stage holds a shard of that stage's parameters: dense weights split over
tensor-parallel ranks (`param.partition_dim`), experts split over expert-parallel ranks (and over
expert-tensor-parallel ranks), layers numbered locally. `StageGatherer.get(global_name)` returns
the full tensor under the name a TP1/EP1/PP1 GPTModel with the local spec would use (global layer
and expert numbers: the names models/<family>/convert.py's WeightGroups speak), gathering it with
collectives over the TP / EP / ETP groups. Every rank of the stage must request the same names in
the same order (the requests are collective); the one sender of the stage uses the tensors, the
others drop them. Transformer Engine names (fused layer-norm weights, grouped-GEMM experts) are
renamed to the local-spec names, so the same mapping serves GPU runs.

Layout fixes that a plain concatenation of shards gets wrong: a gated MLP's linear_fc1 holds
[gate_r; up_r] per TP rank, so the full [gate; up] is rebuilt from the halves of every shard.
"""
from __future__ import annotations

import dataclasses
import re

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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightSyncGroups:
    """The process groups the weight sync needs on one trainer rank (STYLE.md rule 4)."""

    tp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None
    etp: dist.ProcessGroup | None  # expert tensor parallel
    stage: dist.ProcessGroup  # every rank of this pipeline stage (all DP/TP/EP ranks)
    pp_rank: int
    pp_size: int
    sender_rank: int  # global rank that sends this stage's weights (its lowest rank)

    @property
    def is_sender(self) -> bool:
        return dist.get_rank() == self.sender_rank

    @classmethod
    def from_parallel_state(cls) -> "WeightSyncGroups":
        """From Megatron's parallel_state (collective: every trainer rank must call it)."""
        from megatron.core import parallel_state as ps

        pp_rank = ps.get_pipeline_model_parallel_rank()
        pp_size = ps.get_pipeline_model_parallel_world_size()
        ranks_pp = [None] * dist.get_world_size()
        dist.all_gather_object(ranks_pp, pp_rank)
        stage_group = None
        for stage in range(pp_size):  # new_group is collective over the whole world
            members = [r for r, p in enumerate(ranks_pp) if p == stage]
            group = dist.new_group(members)
            if stage == pp_rank:
                stage_group, sender = group, members[0]
        return cls(tp=ps.get_tensor_model_parallel_group(),
                   ep=ps.get_expert_model_parallel_group(),
                   etp=ps.get_expert_tensor_parallel_group(), stage=stage_group,
                   pp_rank=pp_rank, pp_size=pp_size, sender_rank=sender)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    if _size(group) == 1:
        return [tensor]
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def global_parameter_names(gpt_model) -> dict[str, tuple[str, torch.nn.Parameter, int | None]]:
    """{TP1/EP1/PP1 name: (local name, parameter, local expert index or None)} of this rank's
    pipeline stage; for an expert the key is its name on EP rank 0 (the gatherer maps it)."""
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
    """Full tensors of one pipeline stage, gathered on request (see the module docstring)."""

    def __init__(self, gpt_model, groups: WeightSyncGroups, *, gated_linear_unit: bool,
                 vocab_size: int | None = None):
        self.groups = groups
        self.gated_linear_unit = gated_linear_unit
        self.vocab_size = vocab_size  # trim Megatron's padded vocabulary rows to this
        self.params = global_parameter_names(gpt_model)
        self._ready: dict[str, torch.Tensor] = {}
        self._experts_by_layer: dict[int, list[int]] = {}
        for layer in getattr(gpt_model.decoder, "layers", []):
            indices = getattr(getattr(layer, "mlp", None), "local_expert_indices", None)
            if indices is not None:
                self._experts_by_layer[layer.layer_number - 1] = list(indices)
        self._num_local_experts = {k: len(v) for k, v in self._experts_by_layer.items()}

    def names(self) -> set[str]:
        """Every TP1/EP1/PP1 parameter name this stage holds (all experts of its layers)."""
        names = set()
        for name, (_, _, expert) in self.params.items():
            if expert is None:
                names.add(name)
                continue
            local = self._num_local_experts[int(_LAYER.match(name)[1])]
            names.update(_expert_name(name, expert + rank * local)
                         for rank in range(_size(self.groups.ep)))
        return names

    def get(self, name: str) -> torch.Tensor:
        """The full tensor `name` (collective over this stage's TP / EP / ETP groups)."""
        if name in self._ready:
            return self._ready.pop(name)
        owner = self._owner(name)
        local_name, param, expert = self.params[owner]
        tensor = param.detach()
        if expert is None:
            full = self._gather_tp(tensor, param, self.groups.tp, local_name)
            return self._trim_vocab(name, full)
        full = self._gather_tp(tensor, param, self.groups.etp, local_name)
        layer = int(_LAYER.match(owner)[1])
        local = self._num_local_experts[layer]
        for rank, part in enumerate(_all_gather(full, self.groups.ep)):
            self._ready[_expert_name(owner, expert + rank * local)] = part
        return self._ready.pop(name)

    def _owner(self, name: str) -> str:
        """The key in self.params whose gather produces `name`."""
        if name in self.params and self.params[name][2] is None:
            return name
        match = _LAYER.match(name)
        expert = _LOCAL_EXPERT.match(match[2]) if match else None
        if expert is None:
            raise KeyError(f"{name} is not a parameter of pipeline stage {self.groups.pp_rank}")
        layer, global_expert = int(match[1]), int(expert[1])
        local = self._num_local_experts[layer]
        base = self._experts_by_layer[layer][0]
        owner = _expert_name(name, base + global_expert % local)
        if owner not in self.params:
            raise KeyError(f"{name} is not a parameter of pipeline stage {self.groups.pp_rank}")
        return owner

    def _gather_tp(self, tensor: torch.Tensor, param, group, local_name: str) -> torch.Tensor:
        if not getattr(param, "tensor_model_parallel", False) or _size(group) == 1:
            return tensor
        dim = param.partition_dim
        parts = _all_gather(tensor, group)
        if self.gated_linear_unit and local_name.endswith(("linear_fc1.weight", "linear_fc1.bias")):
            # Each shard is [gate_r; up_r]: the full tensor is [gate_0..gate_n; up_0..up_n].
            halves = [part.chunk(2, dim=dim) for part in parts]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=dim)
        return torch.cat(parts, dim=dim)

    def _trim_vocab(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if (self.vocab_size is not None and tensor.shape[0] > self.vocab_size
                and name in ("embedding.word_embeddings.weight", "output_layer.weight")):
            return tensor[:self.vocab_size]
        return tensor


def _expert_name(name: str, global_expert: int) -> str:
    return re.sub(r"local_experts\.\d+\.", f"local_experts.{global_expert}.", name, count=1)
