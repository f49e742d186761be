"""One forward-backward pass of the RL loss through Megatron's pipeline schedule.

The model runs up to its final norm; GPTModel's `output_processor` hook (megatron-core 0.19.2)
then hands us the final hidden states and the (vocab-parallel) LM-head weight instead of computing
logits. We gather sequence-parallel hidden states over TP, keep only loss positions, and compute
FP32 log-probs and entropy of the generated tokens in chunks with
`megatron_rl.ops.vocab_parallel_chunked_logprobs` (never a [tokens, vocab] FP32 tensor), at the
generator's sampling temperature: pi_train is softmax(logits / T), the distribution the recorded
pi_gen log-probs are of, so rho, CISPO's truncation, the mismatch metric and the entropy metric
all refer to the sampling distribution. With fp32_lm_head=False (model.fp32_lm_head, the ablation
of SCALERL.md section 6) the head's logits GEMM runs in the model's params dtype and only the
log-softmax and entropy in FP32, as megatron-core's own output layer and cross-entropy do.

The same pass trains the supervised cold start (`LossSettings.kind="sft"`, megatron_rl/sft.py):
the token loss is then -log pi(y_t) of the reference response tokens (old log-probs and advantages
unused), aggregated like any other loss; at temperature 1 this is the plain cross-entropy.

Exact aggregation. Each token's loss is multiplied by `token_weights(...)`, built from
denominators counted over the WHOLE global batch, so a micro-batch's scalar loss is its share of
the global aggregate. Megatron is configured (model.py) with calculate_per_token_loss=True and an
unscaled finalize: the schedule neither divides by the number of micro-batches nor by a token count,
and DDP sums (not averages) gradients over data-parallel ranks. The gradient is therefore the
gradient of the sum of all shards' losses = the single-rank aggregate, under any DP / PP /
micro-batching. Under TP every rank holds the same loss and Megatron's region ops make the
gradients exact. The router's auxiliary load-balancing loss, if the model family enables one, is
NOT rescaled this way (it is summed over micro-batches and DP ranks): RL runs use coefficient 0.

Context parallelism (CP). Each CP rank holds a load-balanced slice of every sequence (batch.py)
with its targets and masks, so the head and the token losses are local; the weights still carry
the global denominators, so the CP ranks' losses sum to the CP 1 micro-batch loss. The attention
exchanges keys and values across CP ranks and its backward sends their gradients back (TE's CP
attention on GPU; the all-gather / reduce-scatter of models/sdpa_attention.py on CPU), so each
rank's parameter gradient is its share of the CP 1 gradient, and Megatron DDP, which reduces
dense gradients over data parallel WITH context parallel, sums them (with
calculate_per_token_loss it neither averages over dp x cp nor multiplies the loss by CP): no
rescaling is needed. The statistics are summed over the same dp x cp group. GSPO's sequence
ratio is the one non-local quantity: each completion's log-ratio sum is all-reduced over that
group before the loss (`_gspo_sequence_log_ratio`), so every slice uses the whole completion's
ratio.

Train / rollout mismatch (algorithms/mismatch.py, issue 40). Every step, corrections on or off,
each micro-batch adds its tokens' mismatch sums and histogram of log(pi_train / pi_gen) to the
statistics (`mismatch_sums`), reduced with them over data x context parallel and read into
`ForwardBackwardResult.mismatch` (KL estimates, ratio quantiles from the histogram, shares
masked). With corrections set (`LossSettings.mismatch`) the policy loss's token losses are
multiplied by `correction_weights` before aggregation: a dropped token contributes 0 and keeps its
place in the global denominators. The sequence mask under CP uses the whole completion's mean
log-ratio, reduced as GSPO's is.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from megatron_rl import platform
from megatron_rl.algorithms.mismatch import NUM_SUMS, MismatchCorrection, metrics_from_sums
from megatron_rl.platform import collective_device
from megatron_rl.trainer.batch import MicroBatch
from megatron_rl.trainer.parallel import ParallelGroups

# Order of the per-micro-batch sums reduced over data-parallel ranks.
_STATS = ("loss", "num_loss_tokens", "num_clipped", "ratio", "abs_logp_diff", "entropy",
          "num_tokens")
# Followed by the mismatch sums and histogram (algorithms/mismatch.mismatch_sums), reduced alike.
_STATS_SIZE = len(_STATS) + NUM_SUMS


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LossSettings:
    kind: str = "cispo"  # cispo | dapo | grpo | gspo; or "sft": token cross-entropy (cold start)
    aggregation: str = "prompt"  # prompt | sample | token
    eps_max: float = 5.0
    eps_low: float | None = None  # None: the kind's default clip range (algorithms)
    eps_high: float | None = None
    logprob_chunk_size: int = 1024
    # Train / rollout mismatch corrections (algorithm.tis_cap, mismatch_*); off by default.
    mismatch: MismatchCorrection = dataclasses.field(default_factory=MismatchCorrection)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ForwardBackwardResult:
    """Global (all data-parallel ranks) sums over the step's loss tokens; same on every rank."""

    loss: float
    num_loss_tokens: int
    num_clipped: float
    ratio_sum: float
    abs_logp_diff_sum: float
    entropy_sum: float
    num_tokens: int
    abs_logp_diff_max: float = 0.0  # largest |logp_train - logp_gen| of any loss token
    # Routing replay (trainer/routing_replay.py): (token, MoE layer) decisions counted and those
    # where the trainer's own top-k differed from the generator's; 0 / 0 without a routing table.
    num_routing_flips: int = 0
    num_routing_decisions: int = 0
    # The train / rollout mismatch over the step's loss tokens, "mismatch/kl_k1" ... (names and
    # meaning: algorithms/mismatch.metrics_from_sums); empty without loss tokens or for SFT.
    mismatch: dict[str, float] = dataclasses.field(default_factory=dict)


def run_forward_backward(model, micro_batches: Sequence[MicroBatch], groups: ParallelGroups,
                         denominators, settings: LossSettings, *, temperature: float,
                         fp32_lm_head: bool = True, forward_only: bool = False,
                         routing_replay=None, replay_mode: str | None = None
                         ) -> ForwardBackwardResult:
    """Forward (and backward) all micro-batches of this rank through Megatron's schedule.
    `temperature`: the one the rollouts were sampled at (rollout.temperature); required, since
    scoring at any other one silently biases every importance ratio. `fp32_lm_head`: the head's
    logits GEMM in FP32 (False: in the params dtype, log-softmax still FP32). `routing_replay`
    (trainer/routing_replay.RoutingReplay) with `replay_mode` "replay" or "observe" installs each
    micro-batch's generator experts right before its forward; None: the routers route freely."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    replay = routing_replay if replay_mode is not None else None
    forward_step = functools.partial(_forward_step, groups=groups, denominators=denominators,
                                     settings=settings, temperature=temperature,
                                     fp32_lm_head=fp32_lm_head, routing_replay=replay,
                                     replay_mode=replay_mode)
    first = micro_batches[0]
    try:
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=model,
            # Megatron's seq_length is the full sequence (it divides by CP for P2P shapes).
            num_microbatches=len(micro_batches),
            seq_length=first.input_ids.shape[1] * groups.cp_size,
            micro_batch_size=first.input_ids.shape[0], forward_only=forward_only)
    finally:
        if replay is not None:
            replay.clear()
    # Reduced tensors live on the collective device (NCCL refuses CPU tensors).
    flips = torch.zeros(2, dtype=torch.float64, device=collective_device())
    if replay is not None:
        count = replay.take_flip_count()
        flips += torch.tensor([count.num_flips, count.num_decisions], dtype=torch.float64,
                              device=collective_device())
        # Every (token, layer) decision lives on one rank: TP ranks hold different sequence
        # slices, pipeline stages different layers, data-parallel ranks different tokens.
        torch.distributed.all_reduce(flips)
    stats = torch.zeros(_STATS_SIZE, dtype=torch.float64, device=collective_device())
    largest = torch.zeros(1, dtype=torch.float64, device=collective_device())
    for out in outputs:  # only the last pipeline stage has outputs
        stats += out["stats"]
        largest = torch.maximum(largest, out["abs_logp_diff_max"])
    # Data x context parallel: each CP rank's sums cover its own slice of the sequences.
    torch.distributed.all_reduce(stats, group=groups.data_group)
    torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX,
                                 group=groups.data_group)
    if groups.pp_size > 1:
        torch.distributed.broadcast(stats, src=groups.pipeline_last_rank, group=groups.pp)
        torch.distributed.broadcast(largest, src=groups.pipeline_last_rank, group=groups.pp)
    values = dict(zip(_STATS, stats.tolist()))
    return ForwardBackwardResult(
        loss=values["loss"], num_loss_tokens=int(values["num_loss_tokens"]),
        num_clipped=values["num_clipped"], ratio_sum=values["ratio"],
        abs_logp_diff_sum=values["abs_logp_diff"], entropy_sum=values["entropy"],
        num_tokens=int(values["num_tokens"]), abs_logp_diff_max=float(largest),
        num_routing_flips=int(flips[0]), num_routing_decisions=int(flips[1]),
        mismatch=metrics_from_sums(stats[len(_STATS):]))


def _forward_step(data_iterator, model, *, groups, denominators, settings, temperature,
                  fp32_lm_head=True, routing_replay=None, replay_mode=None):
    # The one place micro-batches (built on the host) move to the model's device.
    micro_batch: MicroBatch = next(data_iterator).to(platform.device())
    if routing_replay is not None:
        routing_replay.install(micro_batch, replay_mode)
    head = functools.partial(_fp32_logprob_head, groups=groups, settings=settings,
                             temperature=temperature, fp32_lm_head=fp32_lm_head)
    output = model(micro_batch.input_ids, micro_batch.position_ids, None,
                   padding_mask=micro_batch.padding_mask, output_processor=head,
                   output_processor_context=micro_batch)
    return output, functools.partial(_loss, micro_batch, denominators=denominators,
                                     settings=settings, groups=groups)


def _fp32_logprob_head(*, hidden_states, output_layer, output_weight, context: MicroBatch,
                       groups: ParallelGroups, settings: LossSettings, temperature: float = 1.0,
                       fp32_lm_head: bool = True, **_unused):
    """GPTModel output_processor: FP32 log pi(target) [num_loss_tokens] at the loss positions,
    pi = softmax(logits / temperature); the entropy left in `context` is of the same pi. The
    logits GEMM is FP32, or with fp32_lm_head=False in the hidden states' and weight's dtype."""
    from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                               gather_from_sequence_parallel_region)

    from megatron_rl.ops import vocab_parallel_chunked_logprobs

    # hidden_states: [s/tp, b, h] under sequence parallelism, else [s, b, h]. The region ops'
    # backward sums the TP ranks' partial hidden-state gradients (each rank holds a vocab shard).
    if output_layer.sequence_parallel:
        hidden = gather_from_sequence_parallel_region(
            hidden_states, tensor_parallel_output_grad=True, group=groups.tp)
    else:
        hidden = copy_to_tensor_model_parallel_region(hidden_states, group=groups.tp)
    hidden = hidden.transpose(0, 1)  # [b, s, h]
    mask = context.loss_mask
    if not bool(mask.any()):
        # A padding micro-batch: one position keeps the graph connected; its loss weight is 0.
        mask = torch.zeros_like(mask)
        mask[0, 0] = True
    weight = output_weight if output_weight is not None else output_layer.weight  # [V/tp, h]
    logp, entropy = vocab_parallel_chunked_logprobs(
        hidden[mask], weight, context.targets[mask],
        vocab_start_index=groups.tp_rank * weight.shape[0],
        group=groups.tp if groups.tp_size > 1 else None,
        chunk_size=settings.logprob_chunk_size, compute_entropy=True, temperature=temperature,
        fp32_head=fp32_lm_head)
    context.entropy = entropy
    return logp  # [num_loss_tokens] fp32


def _loss(micro_batch: MicroBatch, logp: torch.Tensor, *, denominators, settings: LossSettings,
          groups: ParallelGroups | None = None):
    """(loss, token count, reduced stats) in Megatron's calculate_per_token_loss convention."""
    from megatron_rl.algorithms import (SFT_KIND, compute_policy_loss, correction_weights,
                                        cross_entropy_loss, mismatch_sums, token_weights)
    from megatron_rl.algorithms.losses import MAX_LOG_RATIO

    mask = micro_batch.loss_mask
    num_loss_tokens = int(mask.sum())
    stats = torch.zeros(_STATS_SIZE, dtype=torch.float64, device=logp.device)
    stats[_STATS.index("num_tokens")] = micro_batch.num_tokens
    correction = settings.mismatch
    # TIS: the policy loss's ratio against the trainer's own old log-probs (this forward's,
    # before the update), the generator only in the TIS weight (MismatchCorrection).
    tis = correction.tis_cap is not None and settings.kind != SFT_KIND
    sequence_log_ratio = None  # each token's whole-completion mean log(pi_train / pi_gen)
    if groups is not None and groups.cp_size > 1 and settings.kind != SFT_KIND and (
            settings.kind == "gspo" or correction.sequence_window is not None):
        # Collective: before the early return, every rank of the group takes part.
        sequence_log_ratio = _gspo_sequence_log_ratio(micro_batch, logp, denominators, groups)
    if num_loss_tokens == 0:
        loss = logp.sum() * 0.0  # keeps every rank's backward identical in structure
        return loss, torch.tensor(0, dtype=torch.int, device=logp.device), {
            "stats": stats,
            "abs_logp_diff_max": torch.zeros(1, dtype=torch.float64, device=logp.device)}
    sample_index = micro_batch.sample_index[mask]
    prompt_index = micro_batch.prompt_index[mask]
    ones = torch.ones_like(sample_index, dtype=torch.bool)
    if settings.kind == SFT_KIND:
        out = cross_entropy_loss(logp, loss_mask=ones)
        token_loss, ratio, clipped, abs_logp_diff = (out.token_loss, out.ratio, out.clipped,
                                                     out.abs_logp_diff)
    else:
        gen_logp = micro_batch.old_logprobs[mask]
        out = compute_policy_loss(
            settings.kind, logp, logp.detach() if tis else gen_logp,
            micro_batch.advantages[mask], sample_index=sample_index, loss_mask=ones,
            eps_max=settings.eps_max, eps_low=settings.eps_low, eps_high=settings.eps_high,
            sequence_log_ratio=None if tis else sequence_log_ratio)
        weight, token_kept, sequence_kept = correction_weights(
            settings.kind, correction, train_logp=logp, gen_logp=gen_logp,
            sample_index=sample_index, sequence_log_ratio=sequence_log_ratio)
        token_loss = out.token_loss * weight if correction.enabled else out.token_loss
        ratio, clipped, abs_logp_diff = out.ratio, out.clipped, out.abs_logp_diff
        if tis:  # the step's metrics stay against the generator; clipped: hit the TIS cap
            log_ratio = (logp.detach() - gen_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
            ratio, abs_logp_diff = torch.exp(log_ratio), (logp.detach() - gen_logp).abs()
            clipped = clipped | (ratio > correction.tis_cap)
        completion_num_tokens = None if denominators is None else \
            denominators.sample_num_tokens.to(logp.device)[sample_index]
        stats[len(_STATS):] = mismatch_sums(
            logp, gen_logp, sample_index, completion_num_tokens=completion_num_tokens,
            token_kept=token_kept, sequence_kept=sequence_kept)
    weights = token_weights(settings.aggregation, ones, sample_index, prompt_index, denominators)
    loss = (token_loss * weights).sum()
    stats[_STATS.index("loss")] = loss.detach().double()
    stats[_STATS.index("num_loss_tokens")] = num_loss_tokens
    stats[_STATS.index("num_clipped")] = clipped.sum().double()
    stats[_STATS.index("ratio")] = ratio.detach().double().sum()
    stats[_STATS.index("abs_logp_diff")] = abs_logp_diff.detach().double().sum()
    if micro_batch.entropy is not None:
        stats[_STATS.index("entropy")] = micro_batch.entropy.detach().double().sum()
    largest = abs_logp_diff.detach().double().max().reshape(1)
    return loss, torch.tensor(num_loss_tokens, dtype=torch.int, device=logp.device), {
        "stats": stats, "abs_logp_diff_max": largest}


def _gspo_sequence_log_ratio(micro_batch: MicroBatch, logp: torch.Tensor, denominators,
                             groups: ParallelGroups) -> torch.Tensor:
    """[num_loss_tokens] each loss token's completion mean log-ratio over the WHOLE completion
    (against the generator's log-probs: GSPO's sequence ratio, the mismatch sequence mask),
    whose positions are spread over the context-parallel ranks (a slice's own mean is another
    ratio). The per-completion sums, indexed by global sample id, are all-reduced over data x
    context parallel: the data-parallel ranks hold other completions, so they only add zeros,
    and that group runs the same number of micro-batches in the same order (trainer.py), so
    every rank makes this call once per micro-batch, loss tokens or not. The divisor is the
    completion's loss-token count from the global denominators."""
    from megatron_rl.algorithms.losses import gspo_log_ratio_sums

    mask = micro_batch.loss_mask
    sample_index = micro_batch.sample_index[mask]
    counts = denominators.sample_num_tokens  # [num_samples_global]
    if bool(mask.any()):
        sums = gspo_log_ratio_sums(logp.detach(), micro_batch.old_logprobs[mask], sample_index,
                                   counts.numel())
    else:  # no loss token in this rank's slice (logp is the head's one placeholder)
        sums = logp.new_zeros(counts.numel(), dtype=torch.float32)
    torch.distributed.all_reduce(sums, group=groups.data_group)
    return (sums / counts.to(sums.device).clamp(min=1))[sample_index]
