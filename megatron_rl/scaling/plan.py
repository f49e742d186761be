"""The memory planner and `megatron-rl plan RECIPE.yaml`: per-device memory of the trainer ranks
and of each generator for a recipe's layout, whether it fits, and the largest concurrency that does.

Trainer rank (Megatron, distributed optimizer, grads reduced in FP32 as the trainer builds them):
- weights and gradients: the DDP buffers that hold this rank's parameters, laid out as
  megatron-core 0.19.2 lays them out (one buffer for dense parameters and one for expert
  parameters when EP > 1 or ETP != TP; parameters in reverse order, each start aligned to 64
  elements, the end padded to a multiple of lcm(DP, 128)); weights in the params dtype, gradients
  FP32. The parameter list of a rank is derived from the architecture by formula
  (`rank_parameters`), in the order Megatron's local layer spec registers them; the Transformer
  Engine spec holds the same tensors (the input norm fused into linear_qkv).
- optimizer state: this rank's shard of each buffer (DP ranks of dense parameters include CP);
  per element FP32 Adam moments (8 bytes) and, for bf16 parameters, an FP32 main copy (4 bytes).
- activations: what one micro-batch of train.micro_batch_max_tokens tokens (the longest
  sequence, packed) saves for the backward, per layer by component, times the micro-batches a
  1F1B pipeline stage holds (PP on the first stage), with the recompute setting
  (train.recompute_granularity); plus the LM-head stage's FP32 chunked log-prob buffers and an
  FP32 copy and gradient of the head weight (megatron_rl/ops/logprobs.py). The experts'
  activations are those of the busiest expert-parallel rank: the balanced share of routed tokens
  times train.moe_routing_imbalance (no token is dropped, so skewed routing lands somewhere).
- weight sync: the plan is of each stage's sender (its lowest rank), which keeps two bucket
  buffers of the largest bucket and the scratch Arena of gathered tensors between syncs, planned
  with the weight sync's own code (`sender_sync_memory`: the family's mapping packed by
  weight_sync/plan.py); during a sync the activations are freed and to_hf allocates the fused
  experts' torch.stack, so the rank's peak is the larger of the step and the sync.
Generator (one SGLang engine of rollout.tp_size devices, experts split over ep_size): weights in
the generator dtype split over the engine's devices, the KV cache of `concurrency` sequences of
rollout.max_sequence_tokens, and the FP32 logits of a decode batch (enable_fp32_lm_head). SGLang
gives weights + KV mem_fraction_static of the device; the largest concurrency is what fits there.
The default concurrency is Pipeline-RL's bound: (k + 1) x train.global_batch_size sequences in
flight over rollout.num_generators engines (rollout/staleness.py).
FP8 generators (rollout.precision=fp8): the engine's weights from the HF tensors the sync sends,
those SGLang holds in FP8 (weight_sync/fp8.py fp8_quantized) at one byte plus their float32
scales, the rest in the generator dtype; the sender's buckets hold the fp8 bytes, and a sync
adds the quantiser's working memory. FP8 is refused where the hardware table has no FP8 peak or
SGLang's loader would refuse the block size at the engine's TP (`check_fp8_rollout`).
Colocated (cluster.colocated): trainer ranks and engines share devices. During training the
engines have released their memory; during generation the trainer has offloaded its gradients
and optimizer state (RLTrainer.offload_training_state) and keeps its weights, the weight sync's
kept buffers and the reserve, beside the engine's mem_fraction_static x device memory and its
logits: that sum must fit the device too (`ColocatedPlan`, with the largest fraction that does).
Hardware numbers come from megatron_rl/scaling/hardware.py, shared with the cost model;
`cost_config_from_run` builds the cost model's inputs from the same recipe.
The parameter and optimizer-state bytes are checked against what the trainer allocates for tiny
models at several layouts (tests/dist/test_plan_memory.py); the activation estimate against the
tensors a CPU forward saves (ratios in docs/planner.md).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.scaling.hardware import ACCELERATORS, Accelerator

GIB = 1024 ** 3
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# CUDA context, NCCL buffers, Transformer Engine workspaces, allocator fragmentation: a fixed
# reserve per trainer device (an assumption, not a measurement; a `--reserved-gib` flag).
DEFAULT_RESERVED_GIB = 6.0
# SGLang's mem_fraction_static when the recipe leaves it null (SGLang picks by GPU memory; this
# is the cost model's default too).
DEFAULT_MEM_FRACTION_STATIC = 0.85
RECOMPUTE = ("none", "selective", "full")


# --------------------------------------------------------------------------------------------
# Architecture and layout
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Architecture:
    """The shapes the planner needs, read from the family's Megatron TransformerConfig."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int  # dense-layer MLP width
    vocab_size: int
    num_experts: int = 0
    moe_router_topk: int = 1
    moe_ffn_hidden_size: int = 0
    shared_expert_size: int = 0  # 0 = no shared expert
    moe_layer_pattern: tuple[int, ...] = ()  # 1 = MoE layer; empty = dense model
    qk_norm_weights: bool = False  # q/k RMSNorm with weights (Qwen3); Llama-4's L2 norm has none
    probs_on_input: bool = False  # router score multiplied into the expert input (Llama-4)
    attention_chunk_size: int = 0  # chunked local attention (Llama-4 RoPE layers); 0 = none
    chunked_layer_pattern: tuple[int, ...] = ()  # 1 = the layer attends within its chunk

    @classmethod
    def from_transformer_config(cls, config: Any, vocab_size: int) -> "Architecture":
        num_experts = config.num_moe_experts or 0
        if num_experts:
            freq = config.moe_layer_freq
            pattern = (tuple(int(i % freq == 0) for i in range(config.num_layers))
                       if isinstance(freq, int) else tuple(int(v) for v in freq))
        else:
            pattern = ()
        return cls(num_layers=config.num_layers, hidden_size=config.hidden_size,
                   num_attention_heads=config.num_attention_heads,
                   num_query_groups=config.num_query_groups or config.num_attention_heads,
                   head_dim=config.kv_channels, ffn_hidden_size=config.ffn_hidden_size,
                   vocab_size=vocab_size, num_experts=num_experts,
                   moe_router_topk=config.moe_router_topk if num_experts else 1,
                   moe_ffn_hidden_size=(config.moe_ffn_hidden_size or 0) if num_experts else 0,
                   shared_expert_size=config.moe_shared_expert_intermediate_size or 0,
                   moe_layer_pattern=pattern, qk_norm_weights=bool(config.qk_layernorm),
                   probs_on_input=bool(getattr(config, "moe_apply_probs_on_input", False)),
                   **_chunking(config))

    @classmethod
    def from_family(cls, name: str, size: str, **overrides: Any) -> "Architecture":
        """From the models registry (imports megatron.core through the family package)."""
        from models import get_model_family

        family = get_model_family(name)
        config = family.transformer_config(size, **overrides)
        return cls.from_transformer_config(config, family.model_kwargs(size)["vocab_size"])

    def is_chunked_layer(self, index: int) -> bool:
        return bool(self.chunked_layer_pattern) and bool(self.chunked_layer_pattern[index])

    def is_moe_layer(self, index: int) -> bool:
        return bool(self.moe_layer_pattern) and bool(self.moe_layer_pattern[index])

    def parameter_counts(self) -> tuple[int, int]:
        """(total, active per token) parameters of the whole model."""
        layout = TrainerLayout()
        params = rank_parameters(self, layout, pp_rank=0)
        total = sum(p.numel for p in params)
        expert_each = 3 * self.hidden_size * self.moe_ffn_hidden_size
        num_moe = sum(self.moe_layer_pattern)
        active = total - num_moe * (self.num_experts - self.moe_router_topk) * expert_each
        return total, active


def _chunking(config: Any) -> dict[str, Any]:
    """Llama-4's chunked attention: RoPE layers (no_rope_freq 0) attend within their chunk."""
    chunk = getattr(config, "attention_chunk_size", None)
    if not chunk:
        return {}
    no_rope = config.no_rope_freq or [0] * config.num_layers
    if isinstance(no_rope, int):
        no_rope = [int((i + 1) % no_rope == 0) for i in range(config.num_layers)]
    return {"attention_chunk_size": int(chunk),
            "chunked_layer_pattern": tuple(1 - int(v) for v in no_rope)}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TrainerLayout:
    """The trainer's parallel layout (Megatron's names); DP fills what the others leave."""

    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    sequence_parallel: bool = False

    @classmethod
    def from_config(cls, parallelism: Any) -> "TrainerLayout":
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{name: getattr(parallelism, name) for name in names})

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dense_shards(self) -> int:
        """Ranks sharing the dense parameters' optimizer state: DP x CP (Megatron's
        intra_dp_cp group)."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        return self.world_size // (self.ep * self.etp * self.pp)

    @property
    def separate_expert_buffer(self) -> bool:
        # megatron-core: expert parameters have allreduce=False (their own buffer and DP group)
        # when EP > 1 or ETP != TP.
        return self.ep > 1 or self.etp != self.tp


# --------------------------------------------------------------------------------------------
# Parameters and the distributed optimizer's shards
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class RankParameter:
    name: str
    shape: tuple[int, ...]  # on this rank (Megatron's [out, in] for linear weights)
    is_expert: bool
    # The dim Megatron splits over TP (ETP for experts); None: replicated (norms, router).
    partition_dim: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _split(value: int, parts: int, what: str) -> int:
    if value % parts:
        raise ValueError(f"{what} ({value}) is not divisible by {parts}")
    return value // parts


def rank_parameters(arch: Architecture, layout: TrainerLayout, *,
                    pp_rank: int) -> list[RankParameter]:
    """This pipeline stage's parameters on one rank, in Megatron's registration order (local
    spec), with local layer and expert numbers. Tensor-parallel splits are exact (Megatron
    requires divisibility). At TP1 / EP1 / PP1 these are the full tensors under the global names
    the weight sync speaks (weight_sync/gather.py)."""
    tp, etp, h = layout.tp, layout.etp, arch.hidden_size
    num_layers = _split(arch.num_layers, layout.pp, "num_layers over pipeline stages")
    params: list[RankParameter] = []

    def add(name: str, shape: tuple[int, ...], partition_dim: int | None = None,
            is_expert: bool = False) -> None:
        params.append(RankParameter(name=name, shape=shape, is_expert=is_expert,
                                    partition_dim=partition_dim))

    vocab = _split(arch.vocab_size, tp, "vocab_size over TP")
    if pp_rank == 0:
        add("embedding.word_embeddings.weight", (vocab, h), 0)
    heads = _split(arch.num_attention_heads, tp, "attention heads over TP")
    groups = _split(arch.num_query_groups, tp, "query groups over TP")
    d = arch.head_dim
    local_experts = _split(arch.num_experts, layout.ep, "experts over EP") if arch.num_experts \
        else 0
    for i in range(num_layers):
        index = pp_rank * num_layers + i
        prefix = f"decoder.layers.{i}."
        add(prefix + "input_layernorm.weight", (h,))
        add(prefix + "self_attention.linear_proj.weight", (h, heads * d), 1)
        add(prefix + "self_attention.linear_qkv.weight", ((heads + 2 * groups) * d, h), 0)
        if arch.qk_norm_weights:
            add(prefix + "self_attention.q_layernorm.weight", (d,))
            add(prefix + "self_attention.k_layernorm.weight", (d,))
        add(prefix + "pre_mlp_layernorm.weight", (h,))
        if arch.is_moe_layer(index):
            add(prefix + "mlp.router.weight", (arch.num_experts, h))
            width = _split(arch.moe_ffn_hidden_size, etp, "expert width over ETP")
            for j in range(local_experts):
                add(prefix + f"mlp.experts.local_experts.{j}.linear_fc1.weight", (2 * width, h),
                    0, True)
                add(prefix + f"mlp.experts.local_experts.{j}.linear_fc2.weight", (h, width), 1,
                    True)
            if arch.shared_expert_size:
                width = _split(arch.shared_expert_size, tp, "shared expert width over TP")
                add(prefix + "mlp.shared_experts.linear_fc1.weight", (2 * width, h), 0)
                add(prefix + "mlp.shared_experts.linear_fc2.weight", (h, width), 1)
        else:
            width = _split(arch.ffn_hidden_size, tp, "ffn_hidden_size over TP")
            add(prefix + "mlp.linear_fc1.weight", (2 * width, h), 0)
            add(prefix + "mlp.linear_fc2.weight", (h, width), 1)
    if pp_rank == layout.pp - 1:
        add("decoder.final_layernorm.weight", (h,))
        add("output_layer.weight", (vocab, h), 0)
    return params


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class BufferPlan:
    """One DDP buffer of a rank: its padded size and this rank's optimizer shard."""

    numel_unpadded: int  # parameter elements
    numel: int  # buffer elements (param and grad buffers), padding included
    num_shards: int  # DP ranks sharing the optimizer state
    shard_numel: tuple[int, ...]  # parameter elements in each shard (optimizer state)


def buffer_plan(sizes: Sequence[int], num_shards: int) -> BufferPlan:
    """megatron-core 0.19.2's DistributedOptimizer layout of one buffer with a single bucket
    (the trainer turns overlap_grad_reduce off): parameters in reverse order, each start aligned
    to 64 elements, the end padded to lcm(num_shards, 128); shard r is the r-th equal slice."""
    ranges, start = [], 0
    for numel in reversed(list(sizes)):
        start = _pad(start, 64)
        ranges.append((start, start + numel))
        start += numel
    total = _pad(start, math.lcm(num_shards, 128)) if ranges else 0
    shard = total // num_shards
    shards = tuple(sum(max(0, min(end, (r + 1) * shard) - max(begin, r * shard))
                       for begin, end in ranges) for r in range(num_shards))
    return BufferPlan(numel_unpadded=sum(sizes), numel=total, num_shards=num_shards,
                      shard_numel=shards)


def rank_buffers(arch: Architecture, layout: TrainerLayout, *, pp_rank: int,
                 distributed_optimizer: bool = True) -> dict[str, BufferPlan]:
    """'dense' and (when separate) 'expert' buffers of a rank on pipeline stage `pp_rank`."""
    params = rank_parameters(arch, layout, pp_rank=pp_rank)
    separate = layout.separate_expert_buffer
    groups = {"dense": [p.numel for p in params if not (p.is_expert and separate)]}
    if separate and any(p.is_expert for p in params):
        groups["expert"] = [p.numel for p in params if p.is_expert]
    shards = {"dense": layout.dense_shards, "expert": layout.expert_dp}
    if not distributed_optimizer:  # plain DDP: no padding, every rank holds all the state
        return {k: BufferPlan(numel_unpadded=sum(v), numel=sum(v), num_shards=1,
                              shard_numel=(sum(v),)) for k, v in groups.items()}
    return {k: buffer_plan(v, shards[k]) for k, v in groups.items()}


# --------------------------------------------------------------------------------------------
# Activations
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ActivationSettings:
    tokens: int  # packed tokens of one micro-batch (the longest sequence fits one)
    dtype_bytes: int = 2
    recompute: str = "none"  # none | selective (core attention) | full (whole layers)
    flash_attention: bool = True  # TE fused attention: no [s, s] probabilities are kept
    fused_swiglu: bool = True  # TE/fused SwiGLU keeps fc1's output only
    logprob_chunk_size: int = 1024
    fp32_lm_head: bool = True
    # Tokens the busiest expert-parallel rank's experts receive over the balanced share
    # (train.moe_routing_imbalance): nothing is dropped, so skewed routing grows that rank.
    routing_imbalance: float = 1.0


def layer_activation_bytes(arch: Architecture, layout: TrainerLayout, act: ActivationSettings,
                           *, moe: bool, chunked: bool = False) -> dict[str, float]:
    """Bytes one layer saves for the backward for one micro-batch, by component, without
    recompute. Elements per token, TP-split where Megatron splits them; tensors Megatron keeps
    sequence-sharded under SP divided by TP. The experts' tokens are the balanced share times
    act.routing_imbalance (the busiest rank)."""
    e, h, d = act.dtype_bytes, arch.hidden_size, arch.head_dim
    tp, s = layout.tp, act.tokens / layout.cp
    seq = s / tp if layout.sequence_parallel else s  # norms, linear inputs under SP
    heads, groups = arch.num_attention_heads / tp, max(arch.num_query_groups / tp, 1)
    out: dict[str, float] = {}
    # Input norm (input) and linear_qkv (its normalised input; Megatron keeps the SP shard).
    out["norms + linear inputs"] = 2 * seq * h * e
    qkv = (heads + 2 * groups) * d
    rotated = (heads + groups) * d * (2 if arch.qk_norm_weights or arch.probs_on_input else 1)
    out["q, k, v"] = s * (qkv + rotated) * e
    # Megatron's local spec (no TE) at 16-bit: its torch norms keep an FP32 copy of their input
    # and the softmax runs in FP32 (attention_softmax_in_fp32), keeping FP32 probabilities
    # next to the 16-bit ones.
    upcast = not act.flash_attention and e < 4
    if upcast:
        out["norms + linear inputs"] += 2 * seq * h * 4
        if arch.qk_norm_weights:
            out["q, k, v"] += s * (heads + groups) * d * 4
    probs = e + 4 if upcast else e
    if act.flash_attention:
        out["attention"] = s * heads * d * e + s * heads * 4  # output + FP32 log-sum-exp
    elif chunked:  # Llama-4 local spec: q, k, v folded into chunks (copies), per-chunk probs
        chunk = min(arch.attention_chunk_size, s)
        padded = -(-s // chunk) * chunk
        out["attention"] = heads * padded * chunk * probs + padded * qkv * e + s * heads * d * e
    else:
        out["attention"] = heads * s * s * probs + s * heads * d * e  # probabilities + context
    out["norms + linear inputs"] += 2 * seq * h * e  # pre-MLP norm input and output
    glu = 3 if act.fused_swiglu else 4
    if moe:
        # Tokens this rank's experts see: the balanced share, times the imbalance.
        routed = seq * arch.moe_router_topk * layout.etp * act.routing_imbalance
        width = arch.moe_ffn_hidden_size / layout.etp
        out["router"] = seq * arch.num_experts * 4 * 2  # FP32 logits and scores
        out["experts"] = routed * (2 * h + glu * width) * e
        if arch.shared_expert_size:
            out["mlp"] = s * glu * arch.shared_expert_size / tp * e
    else:
        out["mlp"] = s * glu * arch.ffn_hidden_size / tp * e
    return out


def stage_activation_bytes(arch: Architecture, layout: TrainerLayout, act: ActivationSettings,
                           *, pp_rank: int) -> dict[str, float]:
    """Activations a pipeline stage holds at its peak: the micro-batches in flight (1F1B: PP -
    pp_rank on stage pp_rank) x its layers' saved tensors, with recompute."""
    if act.recompute not in RECOMPUTE:
        raise ValueError(f"recompute {act.recompute!r}: choose one of {RECOMPUTE}")
    num_layers = arch.num_layers // layout.pp
    in_flight = layout.pp - pp_rank
    seq = act.tokens / layout.cp / (layout.tp if layout.sequence_parallel else 1)
    total: dict[str, float] = {}
    worst_layer = 0.0
    for i in range(num_layers):
        index = pp_rank * num_layers + i
        layer = layer_activation_bytes(arch, layout, act, moe=arch.is_moe_layer(index),
                                       chunked=arch.is_chunked_layer(index))
        if act.recompute == "selective" and not act.flash_attention:
            s = act.tokens / layout.cp
            width = min(arch.attention_chunk_size, s) if arch.is_chunked_layer(index) else s
            layer["attention"] -= (arch.num_attention_heads / layout.tp * s * width
                                   * act.dtype_bytes)
        worst_layer = max(worst_layer, sum(layer.values()))
        if act.recompute == "full":
            layer = {"layer inputs (full recompute)": seq * arch.hidden_size * act.dtype_bytes}
        for name, value in layer.items():
            total[name] = total.get(name, 0.0) + value * in_flight
    if act.recompute == "full":
        total["one layer recomputed"] = worst_layer
    return total


def lm_head_bytes(arch: Architecture, layout: TrainerLayout, act: ActivationSettings,
                  *, params_dtype_bytes: int) -> dict[str, float]:
    """The last stage's head: final-norm input and the gathered hidden states it keeps, and the
    chunked FP32 log-prob op's buffers (ops/logprobs.py: a [chunk, vocab/tp] FP32 scratch and
    its block of exponentials, an FP32 copy of the head weight when the params are not FP32, and
    the FP32 weight gradient accumulated over the chunks)."""
    h, s = arch.hidden_size, act.tokens / layout.cp
    vocab = arch.vocab_size / layout.tp
    seq = s / layout.tp if layout.sequence_parallel else s
    weight = vocab * h
    chunk = min(act.logprob_chunk_size, s)
    fp32_copy = weight * 4 if (act.fp32_lm_head and params_dtype_bytes != 4) else 0
    return {
        "head inputs": (seq + s) * h * act.dtype_bytes + 4 * s * 4,
        "FP32 LM-head chunks": 2 * chunk * vocab * 4 + fp32_copy + weight * 4,
    }


# --------------------------------------------------------------------------------------------
# Weight sync: what the sender of each pipeline stage holds
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SenderSyncMemory:
    """Weight-sync memory on the sender of one pipeline stage (its lowest rank), in bytes, as
    megatron_rl/weight_sync allocates it. `buffers` and `gathered` stay allocated between syncs,
    so they sit on top of a training step's peak; `conversion` exists only during a sync, when
    the step's activations are gone."""

    num_buckets: int
    largest_bucket: int  # bytes of the largest planned bucket, in the generators' dtype
    buffers: int  # WeightSync._bucket_buffers: two of the largest bucket (fill one, send one)
    gathered: int  # the Arena, grown to the largest bucket's tensors gathered outside the bucket
    conversion: int  # the largest group's tensors that to_hf allocates (torch.stack of experts)
    # FP8 generators: the most one group's quantisation allocates (Llama-4's per-expert copies,
    # the group's fp8 weights and scales, the quantiser's float32 scratch of its largest piece)
    quantization: int = 0

    @property
    def kept(self) -> int:
        return self.buffers + self.gathered


def stage_parameter_names(arch: Architecture, layout: TrainerLayout, pp_rank: int) -> set[str]:
    """The global (TP1/EP1/PP1) names of pipeline stage `pp_rank`'s parameters."""
    per_stage = _split(arch.num_layers, layout.pp, "num_layers over pipeline stages")
    first, last = pp_rank * per_stage, (pp_rank + 1) * per_stage
    names = set()
    for param in rank_parameters(arch, TrainerLayout(), pp_rank=0):
        match = re.match(r"decoder\.layers\.(\d+)\.", param.name)
        if match:
            if first <= int(match[1]) < last:
                names.add(param.name)
        elif param.name == "embedding.word_embeddings.weight":
            if pp_rank == 0:
                names.add(param.name)
        elif pp_rank == layout.pp - 1:  # final norm, output layer
            names.add(param.name)
    return names


def sender_sync_memory(arch: Architecture, layout: TrainerLayout, mapping: Sequence, *,
                       pp_rank: int, bucket_bytes: int, params_dtype: str,
                       generator_dtype: str,
                       quantization_config: Mapping | None = None) -> SenderSyncMemory:
    """The weight sync of stage `pp_rank` planned as WeightSync plans it: the family's mapping
    groups whose Megatron tensors the stage holds, packed by weight_sync.plan.plan_buckets (on
    meta tensors). Per bucket the sender gathers into the Arena every tensor it does not hold
    whole (TP / ETP shards, other expert-parallel ranks' experts) unless the tensor is gathered
    straight into its bucket slot (`in_place`), plus scratch for the shards it receives along
    dim 1 (strided places); the Arena keeps the largest bucket's need. Then each group's to_hf
    runs; what it allocates (not views: Llama-4's torch.stack of the fused experts) is copied
    into the bucket and freed. The sender holds expert-parallel rank 0's experts and TP rank 0's
    shards. FP8 generators (`quantization_config`, the served config's): the buckets are planned
    with the sync's own quantiser (weight_sync/fp8.py SyncQuantiser, built as WeightSync builds
    it), so they hold the fp8 weights and scales of the tensors SGLang holds in FP8, never
    gathered in place (the quantiser reads the gathered tensor and writes other bytes), and
    each group's quantisation allocates `quantization` during a sync."""
    import torch

    from megatron_rl.weight_sync.gather import Arena
    from megatron_rl.weight_sync.plan import plan_buckets

    full = {p.name: p for p in rank_parameters(arch, TrainerLayout(), pp_rank=0)}
    stage = stage_parameter_names(arch, layout, pp_rank)
    groups = [g for g in mapping if g.megatron_names and set(g.megatron_names) <= stage]
    dtype = getattr(torch, params_dtype)
    element = DTYPE_BYTES[params_dtype]

    def meta(name: str) -> torch.Tensor:
        return torch.empty(full[name].shape, dtype=dtype, device="meta")

    quantiser = None
    if quantization_config is not None:
        from megatron_rl.weight_sync.fp8 import SyncQuantiser

        quantiser = SyncQuantiser(quantization_config,
                                  [name for group in groups for name in group.hf_names],
                                  head_dim=arch.head_dim)
    buckets = plan_buckets(groups, meta, bucket_bytes=bucket_bytes,
                           dtype=getattr(torch, generator_dtype), quantiser=quantiser)
    if not buckets:
        return SenderSyncMemory(num_buckets=0, largest_bucket=0, buffers=0, gathered=0,
                                conversion=0)
    local_experts = arch.num_experts // layout.ep if arch.num_experts else 0

    def aligned(num_bytes: int) -> int:
        return -(-num_bytes // Arena.ALIGN) * Arena.ALIGN

    gathered = 0
    for bucket in buckets:
        in_place = set(bucket.in_place.values())
        need = 0
        for name in bucket.megatron_names:
            param = full[name]
            shards = (layout.etp if param.is_expert else layout.tp) \
                if param.partition_dim is not None else 1
            expert = re.search(r"local_experts\.(\d+)\.", name)
            held = expert is None or int(expert[1]) < local_experts
            num_bytes = param.numel * element
            if shards == 1 and held:
                continue  # the sender's own parameter, used where it is
            if name not in in_place:
                need += aligned(num_bytes)
            if shards > 1 and param.partition_dim != 0:
                need += (shards - 1 if held else shards) * aligned(num_bytes // shards)
        gathered = max(gathered, need)
    conversion = quantization = 0
    for group in groups:
        inputs = {name: meta(name) for name in group.megatron_names}
        outputs = group.to_hf(inputs)
        # New tensors only: an input returned as it is, or a view of one (_base set), is free.
        allocated = [t for t in outputs.values()
                     if t._base is None and not any(t is x for x in inputs.values())]
        conversion = max(conversion, sum(t.numel() * element for t in allocated))
        if quantiser is not None:
            quantization = max(quantization, _quantization_bytes(
                quantiser, outputs, element, DTYPE_BYTES[generator_dtype]))
    largest = max(bucket.num_bytes for bucket in buckets)
    return SenderSyncMemory(num_buckets=len(buckets), largest_bucket=largest,
                            buffers=min(2, len(buckets)) * largest, gathered=gathered,
                            conversion=conversion, quantization=quantization)


def _quantization_bytes(quantiser: Any, outputs: Mapping[str, Any], element: int,
                        generator_element: int) -> int:
    """What quantising one group's HF tensors allocates at once, at most (`quantiser`:
    weight_sync/fp8.py SyncQuantiser). The sync quantises one piece at a time and copies it into
    its bucket slot before the next is made (WeightSync._hf_tensors, SyncQuantiser.
    iter_quantized), so the peak is one tensor's: its cast to the generators' dtype (when the
    trainer's differs), plus the largest of its pieces: Llama-4's per-expert copy of a fused
    expert tensor, the quantiser's float32 scratch, and the piece's fp8 weight and scale."""
    import torch

    peak = 0
    for name, tensor in outputs.items():
        planned = quantiser.planned(name, tensor)
        if planned is None:
            continue
        cast = tensor.numel() * generator_element if generator_element != element else 0
        pieces = [(piece, planned[quantiser.layout.scale_name(piece_name)])
                  for piece_name, piece in planned.items()
                  if piece.dtype == torch.float8_e4m3fn]
        largest = max(
            (piece.numel() * generator_element if name not in planned else 0)  # unfused copy
            + QUANTISER_SCRATCH_BYTES_PER_ELEMENT * _scratch_elements(quantiser.layout, piece)
            + piece.numel() + scale.numel() * scale.element_size()
            for piece, scale in pieces)
        peak = max(peak, cast + largest)
    return peak


def _scratch_elements(layout: Any, piece: Any) -> int:
    """Elements of the quantiser's float32 working copy of `piece` (padded to whole blocks)."""
    block = layout.weight_block_size
    if block is None:
        return piece.numel()
    *batch, rows, cols = piece.shape
    return math.prod(batch) * _pad(rows, block[0]) * _pad(cols, block[1])


def family_mapping(name: str, size: str) -> list:
    """The family's HF <-> Megatron mapping for `size`: the groups the weight sync sends."""
    from models import get_model_family, model_family_for_hf_config

    return model_family_for_hf_config(get_model_family(name).hf_config(size)).weight_groups()


# --------------------------------------------------------------------------------------------
# FP8 generators (rollout.precision: fp8)
# --------------------------------------------------------------------------------------------

# The quantiser's float32 working copies of one tensor at its peak (weight_sync/fp8.py
# quantize_blockwise: the zero-padded float32 copy, the copy divided by the block scales and its
# clamp, alive together before the cast to fp8; quantize_per_tensor likewise: float copy, scaled
# copy, clamp), in bytes per element of the largest tensor quantised at once.
QUANTISER_SCRATCH_BYTES_PER_ELEMENT = 12


def hf_meta_tensors(arch: Architecture, mapping: Sequence, *,
                    params_dtype: str = "bfloat16") -> dict[str, Any]:
    """{HF name: meta tensor} of the whole model as the weight sync sends it: each mapping
    group's `to_hf` on meta tensors of the full (TP1 / EP1 / PP1) parameters."""
    import torch

    full = {p.name: p for p in rank_parameters(arch, TrainerLayout(), pp_rank=0)}
    dtype = getattr(torch, params_dtype)
    out = {}
    for group in mapping:
        if group.megatron_names:
            out.update(group.to_hf({name: torch.empty(full[name].shape, dtype=dtype,
                                                      device="meta")
                                    for name in group.megatron_names}))
    return out


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ServedWeights:
    """Bytes of one generator copy of the weights (all of the engine's devices together)."""

    fp8: int = 0  # the FP8 weights, one byte an element
    scales: int = 0  # their float32 scales
    high_precision: int  # everything else in the generator dtype

    @property
    def total(self) -> int:
        return self.fp8 + self.scales + self.high_precision


def served_weight_bytes(hf_tensors: Mapping[str, Any], *, generator_dtype: str,
                        quantization_config: Mapping | None) -> ServedWeights:
    """The engine's weights by kind: with an FP8 `quantization_config`, the quantised tensors'
    fp8 bytes and scales as the weight sync sends them (weight_sync/fp8.py SyncQuantiser
    .planned) and the rest (embeddings, LM head, routers, norms) at the generator dtype;
    without one, all of it at the generator dtype."""
    element = DTYPE_BYTES[generator_dtype]
    if quantization_config is None:
        return ServedWeights(high_precision=sum(t.numel() for t in hf_tensors.values())
                             * element)
    from megatron_rl.weight_sync.fp8 import SyncQuantiser

    quantiser = SyncQuantiser(quantization_config, hf_tensors)
    fp8 = scales = high = 0
    for name, tensor in hf_tensors.items():
        planned = quantiser.planned(name, tensor)
        if planned is None:
            high += tensor.numel() * element
            continue
        for t in planned.values():
            if t.element_size() == 1:
                fp8 += t.numel()
            else:
                scales += t.numel() * t.element_size()
    return ServedWeights(fp8=fp8, scales=scales, high_precision=high)


def fp8_partition_sizes(arch: Architecture, *, tp_size: int, ep_size: int) -> dict[str, int]:
    """The sizes SGLang 0.5.23 requires to be multiples of the block when an engine of
    `tp_size` devices (experts over `ep_size` of them) loads block-FP8 weights
    (srt/layers/quantization/fp8.py): Fp8LinearMethod.validate_block_quant_shapes: each output
    partition of a merged layer (qkv_proj's q / k / v, gate_up_proj's halves; at TP 1 too) and,
    at TP > 1, a row-parallel layer's input partition (o_proj, down_proj); Fp8MoEMethod
    .create_weights: the experts' intermediate size per MoE-TP rank (tp_size / ep_size), and
    at MoE-TP > 1 as an input too. K/V heads below one per device are replicated
    (QKVParallelLinear)."""
    tp, d = tp_size, arch.head_dim
    q = _split(arch.num_attention_heads, tp, "attention heads over rollout.tp_size") * d
    sizes = {"q_proj rows per device": q,
             "k_proj / v_proj rows per device": max(1, arch.num_query_groups // tp) * d}
    if tp > 1:
        sizes["o_proj columns per device"] = q
    widths = {}
    if not arch.moe_layer_pattern or not all(arch.moe_layer_pattern):
        widths["dense MLP"] = arch.ffn_hidden_size
    if arch.num_experts and arch.shared_expert_size:
        widths["shared expert"] = arch.shared_expert_size
    for what, width in widths.items():
        sizes[f"{what} gate / up rows per device"] = _split(width, tp, f"{what} width over TP")
        if tp > 1:
            sizes[f"{what} down_proj columns per device"] = width // tp
    if arch.num_experts:
        moe_tp = _split(tp, ep_size, "rollout.tp_size over rollout.ep_size")
        sizes["routed experts' width per MoE-TP rank"] = _split(
            arch.moe_ffn_hidden_size, moe_tp, "expert width over MoE TP")
    return sizes


def check_fp8_rollout(run: Any, *, accelerator: Accelerator, arch: Architecture,
                      hf_names: Iterable[str] | None = None,
                      tp_size: int | None = None) -> None:
    """The planner's refusals of rollout.precision=fp8: hardware without an FP8 peak in the
    cost model's table, and block scales that SGLang would refuse at the engine's TP (or, for
    Llama-4, that its q/k row reordering would break: weight_sync/fp8.py
    check_llama4_block_rows). `tp_size`: another engine size than the recipe's."""
    rollout = run.rollout
    if rollout.precision != "fp8":
        return
    if accelerator.fp8_tflops <= 0:
        raise ValueError(f"rollout.precision=fp8: {accelerator.name} has no FP8 peak in the "
                         "cost model's hardware table (megatron_rl/scaling/hardware.py); serve "
                         "rollout.precision=bf16 there or plan for a GPU with FP8 tensor cores")
    block = rollout.fp8_block_size
    if block is None:
        return
    tp = tp_size or rollout.tp_size
    sizes = fp8_partition_sizes(arch, tp_size=tp, ep_size=math.gcd(rollout.ep_size, tp))
    bad = {what: size for what, size in sizes.items() if size % block}
    divisor = math.gcd(*sizes.values())
    from megatron_rl.weight_sync.fp8 import is_llama4_fused_experts

    fused_experts = hf_names is not None and any(map(is_llama4_fused_experts, hf_names))
    if bad:
        listed = ", ".join(f"{what} {size}" for what, size in bad.items())
        hint = f"a block size dividing {divisor} (e.g. rollout.fp8_block_size={divisor})"
        if fused_experts:
            hint += f" that is a multiple of head_dim {arch.head_dim} (Llama-4)"
        hint = "" if fused_experts and divisor % arch.head_dim else hint + ", or "
        raise ValueError(f"rollout.fp8_block_size={block} does not divide what an engine of "
                         f"rollout.tp_size={tp} splits ({listed}; SGLang's fp8.py refuses it "
                         f"at load): use {hint}per-tensor scales "
                         "(rollout.fp8_block_size=null)")
    if fused_experts:
        from megatron_rl.weight_sync.fp8 import Fp8Layout, check_llama4_block_rows

        try:
            check_llama4_block_rows(Fp8Layout(weight_block_size=(block, block)), arch.head_dim)
        except ValueError as err:
            raise ValueError(f"rollout.fp8_block_size={block}: {err}") from None


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TrainerPlan:
    layout: TrainerLayout
    pp_rank: int  # the stage with the largest peak
    components: dict[str, float]  # bytes per rank (the stage's weight-sync sender)
    buffers: dict[str, BufferPlan]
    capacity: float
    sync: SenderSyncMemory | None = None

    @property
    def total(self) -> float:
        """The training step's peak (with the weight-sync memory kept between syncs)."""
        return sum(self.components.values())

    @property
    def sync_peak(self) -> float:
        """During a weight sync: the step's activations are freed, the conversion's tensors
        are allocated."""
        activations = sum(v for k, v in self.components.items() if k.startswith("act: "))
        return self.total - activations + (self.sync.conversion + self.sync.quantization
                                           if self.sync else 0)

    @property
    def peak(self) -> float:
        return max(self.total, self.sync_peak)

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class GeneratorPlan:
    devices: int  # per engine
    components: dict[str, float]  # bytes per device, at the running concurrency
    requested_concurrency: int  # sequences sent to an engine (Pipeline-RL's bound by default)
    max_concurrency: int  # the most whose KV fits mem_fraction_static
    kv_bytes_per_sequence: float  # per device
    static_budget: float  # mem_fraction_static x device memory
    capacity: float

    @property
    def concurrency(self) -> int:
        """Sequences decoding at once: SGLang queues what the KV cache cannot hold."""
        return min(self.requested_concurrency, self.max_concurrency)

    @property
    def total(self) -> float:
        return sum(self.components.values())

    @property
    def fits(self) -> bool:
        return self.max_concurrency >= 1 and self.total <= self.capacity


# What a colocated trainer rank keeps on the device while the engines generate: the components
# of TrainerPlan that RLTrainer.offload_training_state leaves (gradients, the optimizer state with
# any separate FP32 main copy, and the activations are gone).
COLOCATED_RESIDENT = ("weights", "FP8 weight copies", "weight sync: bucket buffers",
                      "weight sync: gathered tensors", "reserved (CUDA, NCCL, fragmentation)")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ColocatedPlan:
    """One shared device while the engine generates: the trainer rank's resident part (of its
    stage that keeps the most), the engine's static budget and its decode batch's logits."""

    trainer_resident: dict[str, float]  # bytes, COLOCATED_RESIDENT's components
    mem_fraction_static: float
    engine_logits: float  # outside SGLang's static budget
    capacity: float
    # The largest mem_fraction_static (in hundredths) at which the device fits and the engine
    # holds one longest sequence; 0.0: none.
    max_mem_fraction_static: float

    @property
    def static_budget(self) -> float:
        return self.mem_fraction_static * self.capacity

    @property
    def total(self) -> float:
        return sum(self.trainer_resident.values()) + self.static_budget + self.engine_logits

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


def plan_colocated(stages: Sequence[TrainerPlan], generator_at: Callable[[float], GeneratorPlan],
                   *, mem_fraction_static: float) -> ColocatedPlan:
    """The generation phase of a colocated device, for the trainer stage whose resident part
    is largest. `generator_at(fraction)` plans the engine at a mem_fraction_static (its decode
    batch, hence its logits, shrinks with the KV cache)."""
    resident = max(({k: v for k, v in stage.components.items() if k in COLOCATED_RESIDENT}
                    for stage in stages), key=lambda parts: sum(parts.values()))

    def at(fraction: float) -> ColocatedPlan:
        generator = generator_at(fraction)
        return ColocatedPlan(trainer_resident=resident, mem_fraction_static=fraction,
                             engine_logits=generator.components["logits (decode batch)"],
                             capacity=generator.capacity, max_mem_fraction_static=0.0)

    largest = next((hundredths / 100 for hundredths in range(99, 0, -1)
                    if at(hundredths / 100).fits and generator_at(hundredths / 100).fits), 0.0)
    return dataclasses.replace(at(mem_fraction_static), max_mem_fraction_static=largest)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class MemoryPlan:
    hardware: Accelerator
    architecture: Architecture
    trainer: TrainerPlan
    generator: GeneratorPlan
    notes: tuple[str, ...]
    colocated: ColocatedPlan | None = None  # cluster.colocated only

    @property
    def fits(self) -> bool:
        return self.trainer.fits and self.generator.fits and \
            (self.colocated is None or self.colocated.fits)


def plan_trainer(arch: Architecture, layout: TrainerLayout, act: ActivationSettings, *,
                 hardware: Accelerator, params_dtype_bytes: int, fp8: bool = False,
                 distributed_optimizer: bool = True,
                 reserved_gib: float = DEFAULT_RESERVED_GIB,
                 sync: Sequence[SenderSyncMemory] = ()) -> TrainerPlan:
    """Per-rank memory of the worst pipeline stage (the one with the largest peak), on the
    stage's weight-sync sender: `sync[pp_rank]` (sender_sync_memory; empty: no weight sync)."""
    return max(plan_trainer_stages(arch, layout, act, hardware=hardware,
                                   params_dtype_bytes=params_dtype_bytes, fp8=fp8,
                                   distributed_optimizer=distributed_optimizer,
                                   reserved_gib=reserved_gib, sync=sync),
               key=lambda stage: stage.peak)


def plan_trainer_stages(arch: Architecture, layout: TrainerLayout, act: ActivationSettings, *,
                        hardware: Accelerator, params_dtype_bytes: int, fp8: bool = False,
                        distributed_optimizer: bool = True,
                        reserved_gib: float = DEFAULT_RESERVED_GIB,
                        sync: Sequence[SenderSyncMemory] = ()) -> list[TrainerPlan]:
    """`plan_trainer` for every pipeline stage, in stage order."""
    stages = []
    main_copy = 0 if params_dtype_bytes == 4 else 4
    for pp_rank in range(layout.pp):
        buffers = rank_buffers(arch, layout, pp_rank=pp_rank,
                               distributed_optimizer=distributed_optimizer)
        numel = sum(b.numel for b in buffers.values())
        shard = sum(max(b.shard_numel) for b in buffers.values())
        components = {
            "weights": numel * params_dtype_bytes,
            "gradients (FP32)": numel * 4,
            "optimizer state": shard * (8 + main_copy),
        }
        if fp8:
            # Transformer Engine keeps an FP8 copy of each linear weight (and its transpose)
            # for the step: ~2 bytes per parameter, an estimate.
            components["FP8 weight copies"] = numel * 2
        for name, value in stage_activation_bytes(arch, layout, act, pp_rank=pp_rank).items():
            components[f"act: {name}"] = value
        if pp_rank == layout.pp - 1:
            for name, value in lm_head_bytes(arch, layout, act,
                                             params_dtype_bytes=params_dtype_bytes).items():
                components[f"act: {name}"] = value
        stage_sync = sync[pp_rank] if sync else None
        if stage_sync is not None:
            components["weight sync: bucket buffers"] = stage_sync.buffers
            components["weight sync: gathered tensors"] = stage_sync.gathered
        components["reserved (CUDA, NCCL, fragmentation)"] = reserved_gib * GIB
        stages.append(TrainerPlan(layout=layout, pp_rank=pp_rank, components=components,
                                  buffers=buffers, capacity=hardware.memory_bytes,
                                  sync=stage_sync))
    return stages


def plan_generator(arch: Architecture, *, hardware: Accelerator, tp_size: int, ep_size: int,
                   weight_bytes: int, kv_bytes: int, max_sequence_tokens: int, concurrency: int,
                   mem_fraction_static: float, fp32_lm_head: bool,
                   served: ServedWeights | None = None) -> GeneratorPlan:
    """Per-device memory of one SGLang engine: attention, dense and shared layers TP-split,
    experts split over EP and the rest of the engine's devices (so over all tp_size devices),
    embeddings vocab-parallel; KV heads split over TP (replicated below one head per device).
    `served`: FP8 weights (served_weight_bytes) in place of every parameter at weight_bytes."""
    total, _ = arch.parameter_counts()
    weights = (served.total if served is not None else total * weight_bytes) / tp_size
    kv_heads = max(1, arch.num_query_groups // tp_size)
    kv_per_token = 2 * arch.num_layers * kv_heads * arch.head_dim * kv_bytes
    kv_per_sequence = kv_per_token * max_sequence_tokens
    budget = mem_fraction_static * hardware.memory_bytes
    max_concurrency = max(0, int((budget - weights) // kv_per_sequence))
    running = min(concurrency, max_concurrency)
    vocab = arch.vocab_size / tp_size
    logits = running * vocab * (4 if fp32_lm_head else weight_bytes)
    if fp32_lm_head:
        logits += vocab * arch.hidden_size * 4  # the head weight cast to FP32
    components = {"weights": weights}
    if served is not None and served.fp8:
        components = {"weights: FP8 (e4m3)": served.fp8 / tp_size,
                      "weights: FP8 scales (FP32)": served.scales / tp_size,
                      "weights: high precision": served.high_precision / tp_size}
    components |= {"KV cache": running * kv_per_sequence, "logits (decode batch)": logits}
    del ep_size  # experts over EP x (TP / EP) = tp_size devices either way
    return GeneratorPlan(devices=tp_size, components=components,
                         requested_concurrency=concurrency,
                         max_concurrency=max_concurrency, kv_bytes_per_sequence=kv_per_sequence,
                         static_budget=budget, capacity=hardware.memory_bytes)


def default_concurrency(run: Any) -> int:
    """Sequences in flight per engine under Pipeline-RL's admission bound: (k + 1) x
    global_batch_size over the engines (rollout/staleness.py)."""
    rollout = run.rollout
    k = rollout.max_off_policyness if rollout.mode == "pipeline" else max(
        rollout.max_off_policyness - 1, 0)
    return math.ceil((k + 1) * run.train.global_batch_size / rollout.num_generators)


def plan_run(run: Any, *, hardware: str, concurrency: int | None = None,
             reserved_gib: float = DEFAULT_RESERVED_GIB,
             architecture: Architecture | None = None,
             mapping: Sequence | None = None) -> MemoryPlan:
    """The memory plan of a RunConfig on `hardware` (a name of the shared hardware table).
    `architecture` / `mapping` (the weight sync's groups): None reads them from the family."""
    accelerator = get_hardware(hardware)
    arch = architecture or Architecture.from_family(run.model.name, run.model.size)
    if mapping is None:
        mapping = family_mapping(run.model.name, run.model.size)
    layout = TrainerLayout.from_config(run.parallelism)
    te = run.model.use_transformer_engine
    params_bytes = DTYPE_BYTES[run.model.params_dtype]
    act = ActivationSettings(tokens=run.train.micro_batch_max_tokens, dtype_bytes=params_bytes,
                             recompute=run.train.recompute_granularity, flash_attention=te,
                             fused_swiglu=te, fp32_lm_head=run.model.fp32_lm_head,
                             routing_imbalance=run.train.moe_routing_imbalance)
    rollout = run.rollout
    gen_dtype = run.model.params_dtype if rollout.dtype == "auto" else rollout.dtype
    from megatron_rl.weight_sync.fp8 import served_quantization_config

    quantization_config = served_quantization_config(rollout)
    served = None
    if quantization_config is not None:
        hf_tensors = hf_meta_tensors(arch, mapping, params_dtype=run.model.params_dtype)
        check_fp8_rollout(run, accelerator=accelerator, arch=arch, hf_names=hf_tensors)
        served = served_weight_bytes(hf_tensors, generator_dtype=gen_dtype,
                                     quantization_config=quantization_config)
    sync = [sender_sync_memory(arch, layout, mapping, pp_rank=pp_rank,
                               bucket_bytes=run.weight_sync.bucket_mb * 2**20,
                               params_dtype=run.model.params_dtype, generator_dtype=gen_dtype,
                               quantization_config=quantization_config)
            for pp_rank in range(layout.pp)]
    stages = plan_trainer_stages(arch, layout, act, hardware=accelerator,
                                 params_dtype_bytes=params_bytes, fp8=run.model.fp8 is not None,
                                 distributed_optimizer=run.optimizer.use_distributed_optimizer,
                                 reserved_gib=reserved_gib, sync=sync)
    trainer = max(stages, key=lambda stage: stage.peak)
    mem_fraction = rollout.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC

    def generator_at(fraction: float, *, tp_size: int = rollout.tp_size,
                     weights: ServedWeights | None = served) -> GeneratorPlan:
        return plan_generator(
            arch, hardware=accelerator, tp_size=tp_size, ep_size=rollout.ep_size,
            weight_bytes=DTYPE_BYTES[gen_dtype], kv_bytes=DTYPE_BYTES[gen_dtype],
            max_sequence_tokens=rollout.max_sequence_tokens,
            concurrency=concurrency or default_concurrency(run), mem_fraction_static=fraction,
            fp32_lm_head=rollout.enable_fp32_lm_head, served=weights)

    generator = generator_at(mem_fraction)
    notes = []
    if served is not None:
        notes.append(_fp8_note(run, arch, accelerator, generator, generator_at(
            mem_fraction, weights=None), served=served, gen_dtype=gen_dtype,
            fraction=mem_fraction))
    if rollout.mem_fraction_static is None:
        notes.append(f"rollout.mem_fraction_static is null: planned with "
                     f"{DEFAULT_MEM_FRACTION_STATIC}")
    if not trainer.fits:
        notes.append("the trainer does not fit: raise train.recompute_granularity, PP or EP, or "
                     "split sequences with parallelism.context_parallel_size (TE on GPU)")
    if not generator.fits:
        notes.append("a generator cannot hold the weights and one longest sequence: raise "
                     "rollout.tp_size")
    colocated = None
    if run.cluster.colocated:
        colocated = plan_colocated(stages, generator_at, mem_fraction_static=mem_fraction)
        if not colocated.fits:
            largest = colocated.max_mem_fraction_static
            notes.append(
                f"colocated: generation needs {_gib(colocated.total)} of {_gib(colocated.capacity)}"
                f" GiB per device: set rollout.mem_fraction_static <= {largest:.2f}"
                if largest > 0 else
                f"colocated: the trainer's resident part alone "
                f"({_gib(sum(colocated.trainer_resident.values()))} GiB) leaves the engine no "
                "room: raise PP or TP, or set cluster.colocated=false")
    return MemoryPlan(hardware=accelerator, architecture=arch, trainer=trainer,
                      generator=generator, notes=tuple(notes), colocated=colocated)


def smallest_engine(run: Any, arch: Architecture, accelerator: Accelerator, *,
                    weight_bytes: float, fraction: float, fp8: bool) -> int:
    """The fewest devices (a power of two) an engine needs so that its weights take at most
    half of the static budget (the rest is KV cache; the cost model's engine-size rule, without
    its overhead factor), with the attention heads split evenly and, for FP8, the blocks
    dividing every shard."""
    size = 1
    while size < arch.num_attention_heads:
        fits = weight_bytes / size <= 0.5 * fraction * accelerator.memory_bytes
        if fits and arch.num_attention_heads % size == 0:
            if not fp8:
                return size
            try:
                check_fp8_rollout(run, accelerator=accelerator, arch=arch, tp_size=size)
                return size
            except ValueError:
                pass
        size *= 2
    return size


def _fp8_note(run: Any, arch: Architecture, accelerator: Accelerator, fp8: GeneratorPlan,
              bf16: GeneratorPlan, *, served: ServedWeights, gen_dtype: str,
              fraction: float) -> str:
    """rollout.precision=fp8 against the same engine in the generator dtype: weights, the KV
    cache that frees, and the engines the recipe's generator devices make at the smallest
    engine size."""
    total, _ = arch.parameter_counts()
    sizes = [smallest_engine(run, arch, accelerator, weight_bytes=weights, fraction=fraction,
                             fp8=fp8_weights)
             for weights, fp8_weights in ((served.total, True),
                                          (total * DTYPE_BYTES[gen_dtype], False))]
    devices = run.rollout.num_generators * run.rollout.tp_size
    weights = sum(v for k, v in fp8.components.items() if k.startswith("weights"))
    return (f"rollout.precision=fp8: weights {_gib(weights)} GiB per device instead of "
            f"{_gib(bf16.components['weights'])} in {gen_dtype}, so the KV "
            f"cache holds {fp8.max_concurrency} longest sequences instead of "
            f"{bf16.max_concurrency}; the smallest engine whose weights take at most half of "
            f"mem_fraction_static is {_gpus(sizes[0])} instead of {sizes[1]}, and the recipe's "
            f"{devices} generator GPUs make {devices // sizes[0]} such engines instead of "
            f"{devices // sizes[1]}")


def _gpus(count: int) -> str:
    return f"{count} GPU" + ("s" if count > 1 else "")


def get_hardware(name: str) -> Accelerator:
    """A hardware-table entry by name, case-insensitively (gb200 = GB200)."""
    by_lower = {key.lower(): value for key, value in ACCELERATORS.items()}
    try:
        return by_lower[name.lower()]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; choose one of "
                         f"{', '.join(k.lower() for k in ACCELERATORS)}") from None


# --------------------------------------------------------------------------------------------
# Cost model inputs from the same recipe
# --------------------------------------------------------------------------------------------

# Mean generated tokens as a fraction of the longest completion: an assumption until a run's own
# mean is known (then pass --generated-tokens to `megatron-rl cost`).
MEAN_GENERATED_FRACTION = 0.5


def cost_config_from_run(run: Any, *, hardware: str, architecture: Architecture,
                         decode_batch: int, train_mfu: float | None = None):
    """The cost model's CostConfig for a recipe: model shape, workload, precisions (the
    generators' is rollout.precision), engine size and the recipe's device count (trainer world
    + generator devices)."""
    from megatron_rl.scaling.cost import CostConfig

    total, active = architecture.parameter_counts()
    rollout = run.rollout
    if rollout.precision == "fp8":
        check_fp8_rollout(run, accelerator=get_hardware(hardware), arch=architecture)
    moe = architecture.num_experts > 0
    return CostConfig(
        total_params=float(total), active_params=float(active) if moe else 0.0,
        num_experts=architecture.num_experts if moe else 0,
        experts_per_token=architecture.moe_router_topk,
        num_layers=architecture.num_layers, num_kv_heads=architecture.num_query_groups,
        head_dim=architecture.head_dim, num_prompts_per_step=run.prompts_per_step,
        samples_per_prompt=rollout.samples_per_prompt,
        generated_tokens=int(MEAN_GENERATED_FRACTION * rollout.max_response_tokens),
        num_steps=run.train.num_steps, hardware=get_hardware(hardware).name,
        train_precision="fp8" if run.model.fp8 else "bf16",
        generator_precision=rollout.precision,
        generator_devices_per_instance=rollout.tp_size,
        max_running_requests=max(1, decode_batch),
        mem_fraction_static=rollout.mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC,
        train_mfu=train_mfu if train_mfu is not None else (0.3 if moe else 0.4),
        pipeline_rl=rollout.mode == "pipeline",
        total_devices=run.parallelism.world_size + rollout.num_generators * rollout.tp_size)


# --------------------------------------------------------------------------------------------
# Output: table, recipe comment block
# --------------------------------------------------------------------------------------------

def _gib(value: float) -> str:
    return f"{value / GIB:,.1f}"


def _size(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.1f} GiB" if num_bytes >= 0.1 * GIB else \
        f"{num_bytes / 2**20:,.0f} MiB"


def plan_rows(plan: MemoryPlan) -> list[tuple[str, str, str]]:
    """(component, GiB per device, note) rows; section headers have an empty value."""
    t, g, lay = plan.trainer, plan.generator, plan.trainer.layout
    cap = plan.hardware.memory_bytes
    rows = [(f"trainer rank (TP{lay.tp} PP{lay.pp} CP{lay.cp} EP{lay.ep} ETP{lay.etp}"
             f"{' SP' if lay.sequence_parallel else ''}, DP{lay.dp}, {lay.world_size} GPUs; "
             f"stage {t.pp_rank})", "", "")]
    for name, value in t.components.items():
        note = ""
        if name == "optimizer state":
            note = (f"sharded over DP x CP = {lay.dense_shards}"
                    + (f" (experts: {lay.expert_dp})" if "expert" in t.buffers else ""))
        rows.append((name, _gib(value), note))
    if t.sync is not None:
        rows.append(("total", _gib(t.total), f"{t.total / cap:.0%} of {_gib(cap)} GiB in a "
                     "training step"))
        quantising = (f", quantising to FP8 up to {_size(t.sync.quantization)}"
                      if t.sync.quantization else "")
        rows.append(("peak during a weight sync", _gib(t.sync_peak),
                     f"activations freed; to_hf allocates {_size(t.sync.conversion)}{quantising} "
                     f"(largest bucket {_size(t.sync.largest_bucket)}, "
                     f"{t.sync.num_buckets} buckets)"))
        rows.append(("peak", _gib(t.peak), f"{t.peak / cap:.0%} of {_gib(cap)} GiB: "
                     + ("fits" if t.fits else "DOES NOT FIT")))
    else:
        rows.append(("total", _gib(t.total), f"{t.total / cap:.0%} of {_gib(cap)} GiB: "
                     + ("fits" if t.fits else "DOES NOT FIT")))
    rows.append((f"generator device (engine of {g.devices} GPUs)", "", ""))
    for name, value in g.components.items():
        note = f"{g.concurrency} sequences" if name == "KV cache" else \
            _size(value) if name.startswith("weights: FP8 scales") and value >= 2**20 else \
            f"{value / 2**10:,.0f} KiB" if name.startswith("weights: FP8 scales") else ""
        rows.append((name, _gib(value), note))
    rows.append(("total", _gib(g.total), f"{g.total / cap:.0%} of {_gib(cap)} GiB"))
    rows.append(("largest concurrency", f"{g.max_concurrency}",
                 f"KV of {g.kv_bytes_per_sequence / GIB:.2f} GiB per longest sequence within "
                 f"mem_fraction_static ({_gib(g.static_budget)} GiB); "
                 + (f"{g.requested_concurrency} in flight per engine: all fit"
                    if g.requested_concurrency <= g.max_concurrency else
                    f"{g.requested_concurrency} in flight per engine: SGLang queues the rest")
                 + ("" if g.fits else "; DOES NOT FIT")))
    if plan.colocated is not None:
        rows += colocated_rows(plan.colocated)
    return rows


def colocated_rows(c: ColocatedPlan) -> list[tuple[str, str, str]]:
    """The generation phase of a shared device (plan_rows' format)."""
    rows = [("colocated device while generating (trainer offloaded)", "", "")]
    for name, value in c.trainer_resident.items():
        rows.append((f"trainer: {name}", _gib(value),
                     "gradients and optimizer state moved off" if name == "weights" else ""))
    rows.append(("engine: mem_fraction_static x memory", _gib(c.static_budget),
                 f"{c.mem_fraction_static:g} x {_gib(c.capacity)} GiB (weights + KV cache)"))
    rows.append(("engine: logits (decode batch)", _gib(c.engine_logits), ""))
    largest = c.max_mem_fraction_static
    fit = "fits" if c.fits else "DOES NOT FIT"
    rows.append(("total", _gib(c.total), f"{c.total / c.capacity:.0%} of {_gib(c.capacity)} "
                 f"GiB: {fit}; the largest rollout.mem_fraction_static that fits is "
                 + (f"{largest:.2f}" if largest > 0 else "none")))
    return rows


def print_plan(plan: MemoryPlan, file: typing.TextIO | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Memory plan per device ({plan.hardware.name}, "
                        f"{plan.hardware.memory_gb:g} GB)")
    table.add_column("component", no_wrap=True)
    table.add_column("GiB", justify="right", no_wrap=True)
    table.add_column("note")
    for component, value, note in plan_rows(plan):
        if not value:
            table.add_section()
            table.add_row(f"[bold]{component}[/bold]", "", "")
        else:
            table.add_row(component, value, note)
    console = Console(file=file) if file is not None else Console()
    if not console.is_terminal:
        console = Console(file=file, width=160)
    console.print(table)
    for note in plan.notes:
        console.print(f"note: {note}")


BLOCK_BEGIN = "# --- generated by `megatron-rl plan --update-recipe`: do not edit ---"
BLOCK_END = "# --- end of generated block ---"


def recipe_block(run: Any, *, hardware: str, rack_counts: Sequence[int] = (),
                 architecture: Architecture | None = None) -> str:
    """The comment block a recipe carries: the planner's table, the cost model's GPU-hours per
    step and split for the recipe's devices, and the cost model's split at other rack counts."""
    from megatron_rl.scaling.cost import best_layout, estimate_cost

    arch = architecture or Architecture.from_family(run.model.name, run.model.size)
    plan = plan_run(run, hardware=hardware, architecture=arch)
    lines = [BLOCK_BEGIN, f"# Memory per device on {plan.hardware.name} "
             f"({plan.hardware.memory_gb:g} GB), GiB:"]
    for component, value, note in plan_rows(plan):
        if not value:
            lines.append(f"#   [{component}]")
        else:
            lines.append(f"#   {component:<40} {value:>8}  {note}".rstrip())
    lines += [f"#   note: {note}" for note in plan.notes]
    # The cost model caps the decode batch by its own KV memory at the mean length.
    cost = estimate_cost(cost_config_from_run(
        run, hardware=hardware, architecture=arch,
        decode_batch=plan.generator.requested_concurrency))
    c = cost.config
    gen_devices = run.rollout.num_generators * run.rollout.tp_size
    lines += [
        f"# Cost model (megatron-rl cost; mean generated tokens = {MEAN_GENERATED_FRACTION} x "
        f"{run.rollout.max_response_tokens} = {c.generated_tokens}, train MFU {c.train_mfu}, "
        f"{c.train_precision} training"
        + (f", {c.generator_precision} generators" if c.generator_precision != "bf16" else "")
        + "):",
        f"#   GPU-hours per step (balanced): {cost.gpu_hours_per_step:.3f}; generator : trainer "
        f"device-time {cost.generator_to_trainer_ratio:.2f} : 1",
        f"#   this recipe: {gen_devices} generator + {run.parallelism.world_size} trainer GPUs; "
        f"cost model's best split of {c.total_devices}: {cost.layout.num_generator_devices} + "
        f"{cost.layout.num_trainer_devices}, step {cost.layout.step_seconds:.0f} s, "
        f"{cost.layout.gpu_hours_per_step:.3f} GPU-hours per step",
    ]
    par, engine = run.parallelism, run.rollout.tp_size
    unit = math.lcm(par.tensor_model_parallel_size * par.pipeline_model_parallel_size
                    * par.context_parallel_size,
                    par.expert_model_parallel_size * par.expert_tensor_parallel_size
                    * par.pipeline_model_parallel_size)
    for racks in rack_counts:
        devices = 72 * racks
        scaled = dataclasses.replace(cost, config=dataclasses.replace(c, total_devices=devices))
        split = best_layout(scaled)
        # This recipe's layout: trainer ranks in whole multiples of its parallel grid (more
        # data parallelism), the rest whole engines.
        world = max(unit, round(split.num_trainer_devices / unit) * unit, par.world_size)
        engines = (devices - world) // engine
        lines.append(f"#   {racks:>2} NVL72 racks ({devices} GPUs): cost model "
                     f"{split.num_generator_devices} + {split.num_trainer_devices}, step "
                     f"{split.step_seconds:.0f} s -> parallelism.world_size={world} "
                     f"rollout.num_generators={engines}")
    lines.append(BLOCK_END)
    return "\n".join(lines) + "\n"


_BLOCK_RE = re.compile(re.escape(BLOCK_BEGIN) + r".*?" + re.escape(BLOCK_END) + r"\n?", re.S)


def recipe_header(text: str) -> dict[str, Any]:
    """`# plan: hardware=gb200 racks=2,4,8,16` at the top of a recipe: how its block is made."""
    match = re.search(r"^# plan: (.*)$", text, re.M)
    settings: dict[str, Any] = {"hardware": "gb200", "racks": ()}
    if match:
        for item in match.group(1).split():
            key, _, value = item.partition("=")
            settings[key] = tuple(int(v) for v in value.split(",")) if key == "racks" else value
    return settings


def render_recipe(path: str | Path) -> str:
    """The recipe's text with its generated block replaced by a fresh one (or appended)."""
    from megatron_rl.config import load_config

    text = Path(path).read_text()
    if not re.search(r"^# plan: ", text, re.M):
        raise ValueError(f"{path}: no `# plan: hardware=NAME [racks=2,4,...]` line, so no "
                         "generated block is kept in it (add the line to opt in)")
    header = recipe_header(text)
    block = recipe_block(load_config(path), hardware=header["hardware"],
                         rack_counts=header["racks"])
    if _BLOCK_RE.search(text):
        return _BLOCK_RE.sub(lambda _: block, text, count=1)
    return text.rstrip("\n") + "\n\n" + block


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl plan",
        description="Per-device memory of a recipe's trainer ranks and generators, whether it "
                    "fits, and the largest generator concurrency that does.")
    parser.add_argument("recipe", nargs="+",
                        help="YAML recipe(s) of `megatron-rl train`, then any dotted overrides "
                             "as `megatron-rl train` takes them (rollout.precision=fp8)")
    parser.add_argument("--hardware", default=None,
                        help=f"one of {', '.join(k.lower() for k in ACCELERATORS)} (default: "
                             "the recipe's `# plan: hardware=...` line, else gb200)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="sequences in flight per generator engine (default: Pipeline-RL's "
                             "bound, (k + 1) x global batch / engines)")
    parser.add_argument("--reserved-gib", type=float, default=DEFAULT_RESERVED_GIB,
                        help="fixed reserve per trainer device (CUDA context, NCCL, "
                             "fragmentation)")
    parser.add_argument("--update-recipe", action="store_true",
                        help="rewrite each recipe's generated comment block (planner + cost "
                             "model output) in place")
    parser.add_argument("--check-recipe", action="store_true",
                        help="exit 1 if a recipe's generated block is out of date")
    return parser


def main(argv: list[str] | None = None) -> int:
    # Intermixed: overrides may follow options (`RECIPE --hardware h100 rollout.precision=fp8`).
    args = build_parser().parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    from megatron_rl.config import ConfigError, load_config

    status = 0
    overrides = [item for item in args.recipe if "=" in item]
    recipes = [item for item in args.recipe if "=" not in item]
    if overrides and (args.update_recipe or args.check_recipe):
        print("megatron-rl plan: error: a generated block is of the recipe as written; drop the "
              f"overrides ({' '.join(overrides)}) or edit the recipe", file=sys.stderr)
        return 2
    try:
        for recipe in recipes:
            if args.update_recipe or args.check_recipe:
                fresh = render_recipe(recipe)
                if args.update_recipe:
                    Path(recipe).write_text(fresh)
                    print(f"updated {recipe}")
                elif fresh != Path(recipe).read_text():
                    print(f"{recipe}: generated block is out of date; run `megatron-rl plan "
                          f"--update-recipe {recipe}`", file=sys.stderr)
                    status = 1
                continue
            hardware = args.hardware or recipe_header(Path(recipe).read_text())["hardware"]
            plan = plan_run(load_config(recipe, overrides), hardware=hardware,
                            concurrency=args.concurrency, reserved_gib=args.reserved_gib)
            print_plan(plan)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"megatron-rl plan: error: {err}", file=sys.stderr)
        return 2
    return status
