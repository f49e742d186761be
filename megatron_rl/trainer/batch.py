"""The trainer's input and how it is cut up: `TrainBatch` (one optimizer step's completions, typed),
its split across data-parallel ranks, and padded micro-batches under a token budget.

Every trainer rank receives the same global `TrainBatch`; each computes the same deterministic
partition (`shard_for_data_parallel`, balanced by token count) and keeps its share, so no rank needs
to see another's data and the aggregation denominators can be counted from the global batch.
Within a rank, completions are grouped into micro-batches of at most `max_tokens` padded tokens
(`pack_micro_batches`). Sequences are right-padded, not concatenated: causal attention makes the
real tokens' outputs independent of trailing padding, and Megatron's local (non-TE) attention has no
packed-sequence (THD) kernel; padded tokens are excluded from MoE routing through `padding_mask`.
Token t's log-prob is predicted at position t-1, so a completion of L tokens contributes L-1
positions whose targets are tokens 1..L-1 and whose loss mask is `loss_mask[1:]`.

Context parallelism (CP size c > 1): all CP ranks of a data-parallel rank pack the same
micro-batches, padded to a multiple of 2c (times TP under sequence parallelism), and each keeps
its load-balanced slice of every per-position field (`split_for_context_parallel`): the sequence
cut into 2c chunks, rank r keeping chunks r and 2c-1-r, the layout megatron-core's RoPE and
Transformer Engine's CP attention assume (megatron.core.utils.get_batch_on_this_cp_rank).
Targets, masks and old log-probs travel with their positions, so the loss head and the loss are
computed on local positions only.

FP8 (Transformer Engine, GPU) needs each rank's token count divisible by 8 / 16 (delayed and
current scaling) or 32 (MXFP8); `sequence_pad_multiple` then pads every rank's slice of a sequence
to a multiple of 128. Padding positions are marked in `padding_mask` and carry no loss, so they
count in no statistic, and a lock-step `padding_micro_batch` counts in none either.

Micro-batches are built on the host; `MicroBatch.to(device)` moves one to the model's device
(trainer/step.py does, right before its forward).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch

from megatron_rl.ops.context_parallel import load_balanced_positions

# Tokens each rank's slice of a padded sequence is a multiple of when FP8 is on. Transformer
# Engine's FP8 GEMMs need the token count (the product of all but the last input dim) divisible
# by 8 in the forward (transformer_engine.pytorch.utils.assert_dim_for_fp8_exec) and by 16 once
# tokens are the contraction dimension of the weight-gradient GEMM (megatron-core 0.19.2
# fp8_utils.get_fp8_align_size), and by 32 for MXFP8 (MXFP8Quantizer.is_quantizable: 32-element
# scaling blocks). 128 covers all of these and TE's 128-wide blockwise tiles; slime pads to
# TP x 128 likewise.
FP8_TOKEN_ALIGNMENT = 128


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainBatch:
    """One optimizer step's completions (the GLOBAL batch, identical on every trainer rank).

    Per completion i (position i in the lists):
      token_ids[i]     [L_i] int64: prompt + completion tokens.
      loss_mask[i]     [L_i] 0/1: 1 on tokens the policy sampled (they carry the loss); 0 on prompt
                       tokens and on forced-interruption tokens inserted by the generator.
      old_logprobs[i]  [L_i] float: the generator's log pi_gen(token_t | tokens_<t) per token
                       (values where loss_mask is 0 are ignored).
      advantages[i]    float: the completion's advantage (broadcast to its tokens).
      prompt_ids[i]    int: global prompt id in [0, num_prompts) (groups completions of a prompt).
      sample_ids[i]    int: global completion id; the ids are a permutation of [0, num_samples).
      routed_experts[i] [L_i - 1, layers * top_k] uint8/uint16, optional (routing replay): the
                       experts the generator routed input position t to (row t; layer-major),
                       docs/routing_replay.md. None when the batch carries no routing.
    """

    token_ids: Sequence[torch.Tensor]
    loss_mask: Sequence[torch.Tensor]
    old_logprobs: Sequence[torch.Tensor]
    advantages: torch.Tensor
    prompt_ids: torch.Tensor
    sample_ids: torch.Tensor
    routed_experts: Sequence[torch.Tensor] | None = None

    def __post_init__(self) -> None:
        num = len(self.token_ids)
        if num == 0:
            raise ValueError("TrainBatch is empty; give at least one completion")
        for name in ("loss_mask", "old_logprobs"):
            if len(getattr(self, name)) != num:
                raise ValueError(f"TrainBatch.{name} has {len(getattr(self, name))} entries but "
                                 f"token_ids has {num}; give one per completion")
        for name in ("advantages", "prompt_ids", "sample_ids"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != (num,):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value)
                raise ValueError(
                    f"TrainBatch.{name} must be a tensor of shape ({num},), got {shape}")
        if sorted(self.sample_ids.tolist()) != list(range(num)):
            raise ValueError("TrainBatch.sample_ids must be a permutation of 0..num_samples-1")
        if int(self.prompt_ids.min()) < 0:
            raise ValueError("TrainBatch.prompt_ids must be >= 0")
        per_token = zip(self.token_ids, self.loss_mask, self.old_logprobs)
        for i, (ids, mask, old) in enumerate(per_token):
            if ids.dim() != 1 or ids.numel() < 2:
                raise ValueError(f"completion {i}: token_ids must be 1-D with at least 2 tokens")
            if mask.shape != ids.shape or old.shape != ids.shape:
                raise ValueError(f"completion {i}: loss_mask {tuple(mask.shape)} and old_logprobs "
                                 f"{tuple(old.shape)} must match token_ids {tuple(ids.shape)}")
            if mask[0] != 0:
                raise ValueError(f"completion {i}: loss_mask[0] is 1, but the first token has no "
                                 "prediction; it must be a prompt token (mask 0)")
        if self.routed_experts is not None:
            if len(self.routed_experts) != num:
                raise ValueError(f"TrainBatch.routed_experts has {len(self.routed_experts)} "
                                 f"entries but token_ids has {num}; give one per completion")
            widths = {int(r.shape[-1]) for r in self.routed_experts}
            for i, (ids, routed) in enumerate(zip(self.token_ids, self.routed_experts)):
                if routed.dim() != 2 or routed.shape[0] != ids.numel() - 1 or len(widths) != 1:
                    raise ValueError(
                        f"completion {i}: routed_experts {tuple(routed.shape)} must be "
                        f"[{ids.numel() - 1}, layers * top_k] (one row per input position, the "
                        f"same width for every completion; widths seen: {sorted(widths)})")

    @classmethod
    def from_groups(cls, groups: Sequence[Sequence], advantages: Sequence[Sequence[float]]
                    ) -> "TrainBatch":
        """The batch of kept groups of rollout samples (megatron_rl.rollout.RolloutSample:
        prompt_token_ids, token_ids, loss_mask, logprobs over the completion) with their
        advantages [group][sample]: prompt tokens get mask 0 and log-prob 0, group k becomes
        prompt id k, samples are numbered in order."""
        if len(groups) != len(advantages):
            raise ValueError(f"{len(groups)} groups but {len(advantages)} advantage rows")
        token_ids, loss_mask, old_logprobs, flat_advantages, prompt_ids = [], [], [], [], []
        routed = []
        for prompt_id, (group, group_advantages) in enumerate(zip(groups, advantages)):
            if len(group) != len(group_advantages):
                raise ValueError(f"group {prompt_id}: {len(group)} samples but "
                                 f"{len(group_advantages)} advantages")
            for sample, advantage in zip(group, group_advantages):
                num_prompt = len(sample.prompt_token_ids)
                token_ids.append(torch.tensor([*sample.prompt_token_ids, *sample.token_ids],
                                              dtype=torch.long))
                loss_mask.append(torch.tensor([0] * num_prompt + list(sample.loss_mask),
                                              dtype=torch.long))
                old_logprobs.append(torch.tensor([0.0] * num_prompt + list(sample.logprobs),
                                                 dtype=torch.float32))
                flat_advantages.append(float(advantage))
                prompt_ids.append(prompt_id)
                routed.append(getattr(sample, "routed_experts", None))
        carried = [r is not None for r in routed]
        if any(carried) and not all(carried):
            raise ValueError(f"{sum(carried)} of {len(routed)} samples carry routed experts; "
                             "routing replay needs them for every sample of the batch")
        return cls(token_ids=token_ids, loss_mask=loss_mask, old_logprobs=old_logprobs,
                   advantages=torch.tensor(flat_advantages, dtype=torch.float32),
                   prompt_ids=torch.tensor(prompt_ids), sample_ids=torch.arange(len(token_ids)),
                   routed_experts=routed if all(carried) else None)

    @property
    def num_samples(self) -> int:
        return len(self.token_ids)

    def sample_num_loss_tokens(self) -> list[int]:
        """Loss tokens per completion, indexed by sample id."""
        counts = [0] * self.num_samples
        for sample_id, mask in zip(self.sample_ids.tolist(), self.loss_mask):
            counts[sample_id] = int((mask[1:] != 0).sum())
        return counts

    def prompt_of_sample(self) -> list[int]:
        """Global prompt id of each completion, indexed by sample id."""
        prompts = [0] * self.num_samples
        for sample_id, prompt_id in zip(self.sample_ids.tolist(), self.prompt_ids.tolist()):
            prompts[sample_id] = prompt_id
        return prompts


@dataclasses.dataclass(kw_only=True, slots=True)
class MicroBatch:
    """Right-padded rows [b, s] of positions (s a multiple of the sequence-parallel split)."""

    input_ids: torch.Tensor  # [b, s] int64
    position_ids: torch.Tensor  # [b, s] int64
    targets: torch.Tensor  # [b, s] int64, the next token
    loss_mask: torch.Tensor  # [b, s] bool, on targets
    old_logprobs: torch.Tensor  # [b, s] float32
    advantages: torch.Tensor  # [b, s] float32
    sample_index: torch.Tensor  # [b, s] int64, global sample id (0 on padding)
    prompt_index: torch.Tensor  # [b, s] int64, global prompt id (0 on padding)
    padding_mask: torch.Tensor  # [b, s] bool, True on padding (excluded from MoE routing)
    # [b, s, layers * top_k] uint8/uint16 generator expert ids (routing replay; 0 on padding,
    # which trainer/routing_replay.py replaces by a valid dummy); None: no routing carried.
    routed_experts: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # [num_loss_tokens] set by the forward pass (a metric)
    # A lock-step micro-batch of a rank with less data (padding_micro_batch): routed like real
    # tokens (an all-padding micro-batch would leave MoE load-balancing normalisers at 0) but
    # counted in no statistic.
    is_padding: bool = False

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) positions: the step's num_tokens statistic."""
        return 0 if self.is_padding else int((~self.padding_mask).sum())

    def to(self, device: torch.device | str) -> "MicroBatch":
        """This micro-batch with every tensor on `device` (itself when all are there already).
        Host-to-GPU copies go through pinned memory without blocking the host, so the forward's
        kernels queue behind them."""
        device = torch.device(device)
        moved = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor) and value.device != device:
                if device.type == "cuda" and value.device.type == "cpu":
                    value = value.pin_memory().to(device, non_blocking=True)
                else:
                    value = value.to(device)
                moved[field.name] = value
        return dataclasses.replace(self, **moved) if moved else self


def shard_for_data_parallel(batch: TrainBatch, dp_rank: int, dp_size: int) -> list[int]:
    """Indices (into the batch lists) of the completions data-parallel rank `dp_rank` trains on.

    Longest-first greedy balancing of token counts; deterministic, so every rank computes the same
    partition without communication. A rank may get none when there are fewer completions than
    ranks (it then runs padding micro-batches that carry no loss).
    """
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {dp_size})")
    order = sorted(range(batch.num_samples), key=lambda i: (-batch.token_ids[i].numel(), i))
    loads = [0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        rank = min(range(dp_size), key=lambda r: (loads[r], r))
        shards[rank].append(i)
        loads[rank] += batch.token_ids[i].numel()
    return sorted(shards[dp_rank])


def pack_micro_batches(batch: TrainBatch, indices: Sequence[int], *, max_tokens: int,
                       pad_to_multiple: int = 1) -> list[MicroBatch]:
    """Group completions `indices` into micro-batches of at most `max_tokens` padded positions.

    Completions are taken longest first; a micro-batch of b rows padded to length s holds
    b * s <= max_tokens. A completion that alone exceeds the budget is an error.
    """
    if max_tokens < 1 or pad_to_multiple < 1:
        raise ValueError("max_tokens and pad_to_multiple must be >= 1")
    order = sorted(indices, key=lambda i: (-batch.token_ids[i].numel(), i))
    groups: list[list[int]] = []
    for i in order:
        length = _padded_length(batch.token_ids[i].numel() - 1, pad_to_multiple)
        if length > max_tokens:
            raise ValueError(
                f"a completion of {batch.token_ids[i].numel()} tokens needs {length} positions, "
                f"more than micro_batch_max_tokens={max_tokens}; raise micro_batch_max_tokens")
        # Longest first: the group's padded length is its first member's.
        if groups and (len(groups[-1]) + 1) * _padded_length(
                batch.token_ids[groups[-1][0]].numel() - 1, pad_to_multiple) <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [_collate(batch, group, pad_to_multiple) for group in groups]


def padding_micro_batch(pad_to_multiple: int = 1) -> MicroBatch:
    """A micro-batch with no loss tokens and no counted tokens: keeps ranks with less data in
    lock-step with the others (expert-parallel all-to-alls need every rank of the group in each
    forward)."""
    length = _padded_length(1, pad_to_multiple)
    zeros = torch.zeros(1, length, dtype=torch.int64)
    return MicroBatch(
        input_ids=zeros, position_ids=torch.arange(length).unsqueeze(0), targets=zeros.clone(),
        loss_mask=torch.zeros(1, length, dtype=torch.bool),
        old_logprobs=torch.zeros(1, length), advantages=torch.zeros(1, length),
        sample_index=zeros.clone(), prompt_index=zeros.clone(),
        padding_mask=torch.zeros(1, length, dtype=torch.bool), is_padding=True)


def sequence_pad_multiple(*, tensor_parallel_size: int = 1, context_parallel_size: int = 1,
                          fp8_recipe: str | None = None) -> int:
    """The multiple every micro-batch's padded length is rounded up to.

    `tensor_parallel_size`: the TP size when sequence parallelism splits the sequence over the TP
    ranks, else 1. Context parallelism cuts a sequence into 2 * CP load-balanced chunks (each
    rank's then split over TP). With an FP8 recipe (`fp8_recipe` not None) each rank's slice,
    length / (TP x CP), is also a multiple of FP8_TOKEN_ALIGNMENT, so every rank's token count
    suits Transformer Engine's FP8 GEMMs whatever the number of rows.
    """
    if tensor_parallel_size < 1 or context_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} and context_parallel_size "
                         f"{context_parallel_size} must be >= 1")
    split = tensor_parallel_size * context_parallel_size  # ranks one sequence is spread over
    multiple = split * (2 if context_parallel_size > 1 else 1)
    if fp8_recipe is not None:
        multiple = math.lcm(multiple, split * FP8_TOKEN_ALIGNMENT)
    return multiple


def split_for_context_parallel(micro_batch: MicroBatch, cp_rank: int,
                               cp_size: int) -> MicroBatch:
    """Context-parallel rank `cp_rank`'s slice of `micro_batch` (padded to a multiple of
    2 * cp_size): every per-position field [b, s, ...] -> [b, s / cp_size, ...] at the global
    positions `load_balanced_positions` names (chunks r and 2c-1-r).
    position_ids keep their global values. cp_size 1 returns the micro-batch unchanged."""
    if cp_size == 1:
        return micro_batch
    if micro_batch.entropy is not None:
        raise ValueError("split_for_context_parallel: the micro-batch was already run (entropy "
                         "set); split it before the forward pass")
    keep = load_balanced_positions(micro_batch.input_ids.shape[1], cp_rank, cp_size)
    fields = {f.name: getattr(micro_batch, f.name) for f in dataclasses.fields(MicroBatch)}
    return MicroBatch(**{name: value.index_select(1, keep)
                         if isinstance(value, torch.Tensor) else value
                         for name, value in fields.items()})


def _padded_length(num_positions: int, multiple: int) -> int:
    return -(-num_positions // multiple) * multiple


def _collate(batch: TrainBatch, group: list[int], pad_to_multiple: int) -> MicroBatch:
    # Each field is one concatenation of the group's completions and one gather into [b, s], ~50
    # ops whatever the number of completions: per-completion slices and pads were ~190 small ops
    # per step at test sizes (docs/trainer_speed.md). Position p of row r reads token p of its
    # completion (input ids) or token p + 1 (targets, loss mask, old log-probs); padding reads
    # a real token and is zeroed.
    num_tokens = [batch.token_ids[i].numel() for i in group]  # L_i
    starts = [0, *itertools.accumulate(num_tokens)][:-1]  # in the concatenation
    length = _padded_length(max(num_tokens) - 1, pad_to_multiple)
    positions = torch.arange(length)  # [s]
    valid = positions < torch.tensor(num_tokens).unsqueeze(1) - 1  # [b, s]
    source = torch.where(valid, torch.tensor(starts).unsqueeze(1) + positions, 0)  # [b, s]
    next_source = source + 1  # [b, s]
    rows = torch.tensor(group)  # [b]

    def concatenated(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if len({t.dtype for t in tensors}) > 1:  # each converted as it is, before cat promotes
            tensors = [t.to(dtype) for t in tensors]
        return torch.cat(tensors).to(dtype)

    def per_row(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        values = torch.as_tensor(values).index_select(0, rows).to(dtype).unsqueeze(1)  # [b, 1]
        return torch.where(valid, values, 0)

    token_ids = concatenated([batch.token_ids[i] for i in group], torch.int64)
    loss_mask = torch.cat([batch.loss_mask[i] for i in group])
    old_logprobs = concatenated([batch.old_logprobs[i] for i in group], torch.float32)
    return MicroBatch(
        input_ids=torch.where(valid, token_ids[source], 0),
        position_ids=positions.repeat(len(group), 1),
        targets=torch.where(valid, token_ids[next_source], 0),
        loss_mask=torch.where(valid, loss_mask[next_source] != 0, False),
        old_logprobs=torch.where(valid, old_logprobs[next_source], 0.0),
        advantages=per_row(batch.advantages, torch.float32),
        sample_index=per_row(batch.sample_ids, torch.int64),
        prompt_index=per_row(batch.prompt_ids, torch.int64),
        padding_mask=~valid,
        routed_experts=None if batch.routed_experts is None else _routed_rows(
            [batch.routed_experts[i] for i in group], source, valid),
    )


def _routed_rows(tables: list[torch.Tensor], source: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
    """Routing tables [L_i - 1, w] (one row per input position) gathered to [b, s, w], dtype
    kept, zeros on padding. `source` indexes the concatenated tokens, where completion r starts
    r entries later than its table does in the concatenated tables (one row fewer each)."""
    shift = torch.arange(len(tables)).unsqueeze(1)  # [b, 1]
    gathered = torch.cat(tables)[torch.where(valid, source - shift, 0)]  # [b, s, w]
    return torch.where(valid.unsqueeze(-1), gathered, 0)
