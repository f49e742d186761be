"""FP32 log-probabilities and entropies of target tokens at the LM head, chunked over tokens.

This module owns the trainer's LM-head numerics (SCALERL.md section 6): the policy's logits are
computed in FP32 from the final hidden states and the output-layer weight, but a full
[tokens, vocab] FP32 tensor is never materialised (32k tokens x 202k vocab x 4 bytes is 26 GB).
Tokens are processed `chunk_size` at a time; the forward keeps per-token statistics (the
log-sum-exp) and the backward recomputes the chunks' logits from them (all but the last chunk,
whose softmax the forward leaves in the one [chunk, vocab] buffer that the backward reuses).
The vocab-parallel variant follows megatron/core/tensor_parallel/cross_entropy.py: each rank
holds a contiguous vocab shard, the row max is all-reduced with MAX and the sum of exponentials,
the target logit and the entropy term with SUM over the group that is passed in (no parallel_state
globals); the backward needs no communication. As in Megatron, the gradient w.r.t. `hidden`
returned on each rank is only its shard's contribution: the caller sums it over the group,
normally by feeding the op `megatron.core.tensor_parallel.copy_to_tensor_model_parallel_region(
hidden, group=tp_group)`, whose backward is that all-reduce (as ColumnParallelLinear does for the
output layer). Hand-written rather than Megatron's VocabParallelCrossEntropy helpers because those
work on whole [tokens, vocab/tp] logits and have no entropy term.

Sampling temperature: SGLang records log softmax(z / T) of the distribution it sampled from
(sglang/srt/layers/sampler.py divides the FP32 logits by T before the softmax), so the ratio
pi_train / pi_gen is only unbiased when the trainer scores the same z / T. `temperature` divides
each chunk's FP32 logits in place (no extra [tokens, vocab] tensor); the backward recomputes
them the same way and carries the 1/T of d(z / T)/dz on the per-token factor. The entropy is
that of the same tempered distribution, the one the generator sampled from.

`fp32_head=False` is the ablation of the FP32 head (model.fp32_lm_head=false): each chunk's logits
are the GEMM in the inputs' dtype (bf16 for a bf16 model), cast to FP32 before the temperature and
the softmax, as megatron-core's own path computes them (output layer in the params dtype, FP32
cross-entropy). The backward is the gradient of that computation: the FP32 logit gradient is
rounded to the GEMM dtype, the hidden gradient is a GEMM in that dtype, and the weight gradient
an FP32 GEMM of the rounded operands (bf16 x bf16 products are exact in FP32, so this is the
low-precision GEMM's own FP32 accumulation) summed over the chunks in FP32 and rounded once. At
FP32 inputs the two settings are the same computation.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["chunked_logprobs", "vocab_parallel_chunked_logprobs"]

# The forward writes exp(z - m) into a scratch block of 1/_NUM_ROW_BLOCKS of a chunk's rows, beside
# the chunk's shifted logits z - m that the entropy term also reads: a quarter of a second
# [chunk, vocab/tp] buffer, for few enough extra kernels that CPU threads and GPU launches do not
# notice (smaller cache-sized blocks measured no faster on CPU, and slower on a busy machine).
_NUM_ROW_BLOCKS = 4

# Rows of the per-chunk statistics that are summed over the vocab shards in one all-reduce.
_SUM_EXP, _TARGET_LOGIT, _EXP_TIMES_LOGIT, _NUM_OWNERS = range(4)


def chunked_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    chunk_size: int = 1024,
    compute_entropy: bool = True,
    temperature: float = 1.0,
    fp32_head: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """FP32 log pi(target) and entropy per token from hidden states and the whole LM-head weight.

    hidden: [tokens, hidden] of any float dtype; weight: [vocab, hidden]; targets: [tokens] long.
    Returns (logprobs [tokens] FP32, differentiable w.r.t. hidden and weight; entropy [tokens]
    FP32, detached, or None when compute_entropy is False). Gradients come back in the dtypes of
    hidden and weight. pi is softmax(hidden @ weight^T / temperature): pass the generator's
    sampling temperature so that both sides score the distribution the tokens were sampled from;
    the entropy is that tempered distribution's too. fp32_head=False: the logits GEMM runs in
    the inputs' dtype (promoted if hidden and weight differ) and is cast to FP32 only afterwards,
    the ablation of the FP32 head (module docstring); identical to True at FP32 inputs.

    Memory beyond inputs and outputs: 1.25 x chunk_size x vocab FP32 in the forward, of which
    chunk_size x vocab is kept for the backward (when one can follow) and reused there; for a
    non-FP32 weight also an FP32 weight-grad accumulator and, with fp32_head, an FP32 copy of the
    weight, without it a chunk_size x vocab buffer of the GEMM dtype (forward and backward). The
    backward runs once per forward: a second one through a retained graph raises autograd's
    in-place error.
    """
    return vocab_parallel_chunked_logprobs(
        hidden,
        weight,
        targets,
        vocab_start_index=0,
        group=None,
        chunk_size=chunk_size,
        compute_entropy=compute_entropy,
        temperature=temperature,
        fp32_head=fp32_head,
    )


def vocab_parallel_chunked_logprobs(
    hidden: Tensor,
    weight_shard: Tensor,
    targets: Tensor,
    *,
    vocab_start_index: int,
    group: dist.ProcessGroup | None,
    chunk_size: int = 1024,
    compute_entropy: bool = True,
    temperature: float = 1.0,
    fp32_head: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """chunked_logprobs with the vocabulary sharded over `group` (None: a single shard).

    weight_shard: [vocab/tp, hidden], the rows of global token ids vocab_start_index onwards.
    Every rank of the group must pass the same hidden, targets and chunk_size (two collectives
    per chunk), and the shards must tile the vocabulary: a target owned by no shard or by two
    raises ValueError on every rank at the end of the forward. Log-probs and entropies are the
    global ones, identical on all ranks. The weight_shard gradient is exact for the shard; the
    hidden gradient is this shard's contribution only, to be summed over the group by the caller
    (Megatron's convention; see the module docstring). Logits are divided by `temperature`
    (every rank must pass the same one), as in chunked_logprobs, and fp32_head=False computes
    each shard's logits GEMM in the inputs' dtype as there.
    """
    _check_inputs(hidden, weight_shard, targets, vocab_start_index, chunk_size, temperature)
    # Function.forward runs with grad mode off, so whether a backward can follow is decided here.
    will_backward = torch.is_grad_enabled() and (hidden.requires_grad or weight_shard.requires_grad)
    gemm_dtype = (
        torch.float32 if fp32_head else torch.promote_types(hidden.dtype, weight_shard.dtype)
    )
    logprobs, entropy = _ChunkedLogprobs.apply(
        hidden, weight_shard, targets, vocab_start_index, group, chunk_size, compute_entropy,
        float(temperature), gemm_dtype, will_backward,
    )
    return logprobs, (entropy if compute_entropy else None)


def _check_inputs(
    hidden: Tensor, weight: Tensor, targets: Tensor, vocab_start_index: int, chunk_size: int,
    temperature: float,
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be [tokens, hidden] and weight [vocab, hidden]; got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)} (flatten batch and sequence "
            "dims into one token dim first)"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden has {hidden.shape[1]} features but weight rows have "
            f"{weight.shape[1]}; pass the output-layer weight as [vocab, hidden]"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight has no vocab rows; each rank's shard must hold at least one")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise TypeError(
            f"hidden and weight must be float tensors, got {hidden.dtype} and {weight.dtype}"
        )
    if targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"targets must be [tokens] = {tuple(hidden.shape[:1])}, got {tuple(targets.shape)}"
        )
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids (torch.long), got {targets.dtype}")
    if not hidden.device == weight.device == targets.device:
        raise ValueError(
            f"hidden, weight and targets must be on one device, got {hidden.device}, "
            f"{weight.device}, {targets.device}"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if (
        isinstance(vocab_start_index, bool)
        or not isinstance(vocab_start_index, int)
        or vocab_start_index < 0
    ):
        raise ValueError(f"vocab_start_index must be a non-negative int, got {vocab_start_index!r}")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(
            "temperature must be a finite number > 0 (the generator's sampling temperature; "
            f"greedy decoding has no sampling distribution to score), got {temperature!r}"
        )


def _local_targets(
    targets: Tensor, vocab_start_index: int, num_local_vocab: int
) -> tuple[Tensor, Tensor]:
    """Shard-local target ids (0 where another shard owns the target) and the ownership mask, as
    in Megatron's calculate_predicted_logits."""
    local = targets.long() - vocab_start_index
    owned = (local >= 0) & (local < num_local_vocab)  # [c] bool
    return torch.where(owned, local, 0), owned


def _all_reduce(tensor: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def _chunk_bounds(num_tokens: int, chunk_size: int) -> list[tuple[int, int]]:
    starts = range(0, num_tokens, chunk_size)
    return [(start, min(start + chunk_size, num_tokens)) for start in starts]


def _rows_per_block(num_rows: int) -> int:
    return max(1, -(-num_rows // _NUM_ROW_BLOCKS))


def _shard_softmax_stats(
    logits: Tensor, exps_scratch: Tensor, compute_entropy: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per row of this shard's logits z: the max m, sum_v exp(z_v - m) and, with compute_entropy,
    sum_v exp(z_v - m)(z_v - m). Leaves z - m in `logits`; `exps_scratch` holds one row block."""
    row_max = logits.amax(dim=-1)  # [c]
    logits.sub_(row_max.unsqueeze(-1))  # in place: no shifted copy
    sum_exp = logits.new_empty(logits.shape[0])
    exp_times_logit = logits.new_empty(logits.shape[0]) if compute_entropy else None
    rows_per_block = exps_scratch.shape[0]
    for start in range(0, logits.shape[0], rows_per_block):
        rows = slice(start, start + rows_per_block)
        block = logits[rows]  # [r, vocab/tp]
        exps = torch.exp(block, out=exps_scratch[: block.shape[0]])
        sum_exp[rows] = exps.sum(dim=-1)
        if compute_entropy:
            # In place (exps is spent) and reduced by torch's sum: a BLAS dot (bmm) over the
            # 200k-long rows measured 10x the entropy error of the naive log_softmax reference.
            exp_times_logit[rows] = exps.mul_(block).sum(dim=-1)
    return row_max, sum_exp, exp_times_logit


def _tempered_logits(
    hidden_chunk: Tensor, weight: Tensor, temperature: float, out: Tensor,
    gemm_out: Tensor | None = None,
) -> Tensor:
    """z = hidden @ weight^T / T into `out` [c, vocab/tp] FP32: the same division of the FP32
    logits that SGLang's sampler applies before its softmax (skipped at T = 1: no extra pass).
    The GEMM runs in weight's dtype; when that is not FP32 (fp32_head=False) its logits land in
    `gemm_out` [c, vocab/tp] of that dtype and are cast to FP32 into `out`."""
    hidden_chunk = hidden_chunk.to(weight.dtype)
    if weight.dtype == out.dtype:
        torch.mm(hidden_chunk, weight.t(), out=out)
    else:
        out.copy_(torch.mm(hidden_chunk, weight.t(), out=gemm_out))
    if temperature != 1.0:
        out.div_(temperature)
    return out


def _forward_chunk(
    hidden_chunk: Tensor,
    weight: Tensor,
    targets_chunk: Tensor,
    vocab_start_index: int,
    group: dist.ProcessGroup | None,
    logits: Tensor,
    exps_scratch: Tensor,
    compute_entropy: bool,
    temperature: float,
    gemm_out: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk's statistics summed over the shards, as [4, c] rows: sum_v exp(z_v - M), the
    target's z - M, sum_v exp(z_v - M)(z_v - M) and the number of shards owning the target; also
    the global row max M and this shard's row max m [c]. z are the tempered logits (the GEMM in
    weight's dtype); `logits` [c, vocab/tp] is left holding z - m."""
    _tempered_logits(hidden_chunk, weight, temperature, out=logits, gemm_out=gemm_out)
    local_targets, owned = _local_targets(targets_chunk, vocab_start_index, logits.shape[1])
    target_logit = logits.gather(1, local_targets.unsqueeze(-1)).squeeze(-1)
    # Against the shard's own max first, so no collective sits between the max and the
    # exponentials; then rescaled to the global max as in online softmax: exp(m - M) <= 1.
    shard_max, shard_sum_exp, shard_exp_times_logit = _shard_softmax_stats(
        logits, exps_scratch, compute_entropy
    )
    global_max = shard_max.clone()
    _all_reduce(global_max, dist.ReduceOp.MAX, group)
    max_shift = shard_max - global_max  # [c], <= 0
    scale = max_shift.exp()
    stats = logits.new_empty(4, logits.shape[0])  # [4, c]
    stats[_SUM_EXP] = scale * shard_sum_exp
    stats[_TARGET_LOGIT] = torch.where(owned, target_logit - global_max, 0.0)
    stats[_NUM_OWNERS] = owned
    if shard_exp_times_logit is None:
        stats[_EXP_TIMES_LOGIT] = 0.0
    else:
        # sum_v e^(z_v - M)(z_v - M)
        #   = exp(m - M) * (sum_v e^(z_v - m)(z_v - m) + (m - M) * sum_v e^(z_v - m))
        stats[_EXP_TIMES_LOGIT] = scale * (shard_exp_times_logit + max_shift * shard_sum_exp)
    _all_reduce(stats, dist.ReduceOp.SUM, group)
    return stats, global_max, shard_max


def _to_probs_minus_onehot(
    shifted_logits: Tensor, logsumexp_minus_shift: Tensor, targets_chunk: Tensor,
    vocab_start_index: int,
) -> Tensor:
    """In place, logits minus a per-row shift s [c, vocab/tp] -> softmax - onehot(target) on this
    shard's columns, given log-sum-exp - s per row. The log-sum-exp is the global one saved by
    the forward, so the backward needs no collective."""
    shifted_logits.sub_(logsumexp_minus_shift.unsqueeze(-1)).exp_()
    local_targets, owned = _local_targets(targets_chunk, vocab_start_index, shifted_logits.shape[1])
    # As in Megatron: one element per row; 0 is subtracted where another shard owns the target.
    rows = torch.arange(shifted_logits.shape[0], device=shifted_logits.device)
    shifted_logits[rows, local_targets] -= owned.float()
    return shifted_logits


class _ChunkedLogprobs(torch.autograd.Function):
    """log pi(target) with a backward that recomputes the chunks' logits; entropy is a metric.

    When the forward ends, its scratch buffer still holds the last chunk's logits; if a backward
    can follow, they are turned into that chunk's softmax - onehot and kept: the backward needs a
    buffer of that size anyway, and starts with the last chunk without recomputing it.
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, vocab_start_index, group, chunk_size, compute_entropy,
        temperature, gemm_dtype, will_backward,
    ):
        num_tokens, num_local_vocab = hidden.shape[0], weight.shape[0]
        weight_gemm = weight.to(gemm_dtype)  # [vocab/tp, hidden]; no copy when already that dtype
        logprobs = hidden.new_empty(num_tokens, dtype=torch.float32)
        entropy = hidden.new_empty(num_tokens if compute_entropy else 0, dtype=torch.float32)
        logsumexp = hidden.new_empty(num_tokens, dtype=torch.float32)  # saved for backward
        num_owners = hidden.new_empty(num_tokens, dtype=torch.float32)
        # Scratch reused by every chunk: no allocator churn, no fresh pages per chunk.
        num_rows = min(chunk_size, num_tokens)
        scratch = hidden.new_empty((num_rows, num_local_vocab), dtype=torch.float32)
        exps_scratch = hidden.new_empty(
            (_rows_per_block(num_rows), num_local_vocab), dtype=torch.float32
        )
        gemm_scratch = _gemm_scratch(scratch, gemm_dtype)
        shard_max = None
        for start, stop in _chunk_bounds(num_tokens, chunk_size):
            stats, global_max, shard_max = _forward_chunk(
                hidden[start:stop], weight_gemm, targets[start:stop], vocab_start_index, group,
                scratch[: stop - start], exps_scratch, compute_entropy, temperature,
                None if gemm_scratch is None else gemm_scratch[: stop - start],
            )
            log_sum_exp = stats[_SUM_EXP].log()  # of z - M
            logprobs[start:stop] = stats[_TARGET_LOGIT] - log_sum_exp
            logsumexp[start:stop] = global_max + log_sum_exp
            num_owners[start:stop] = stats[_NUM_OWNERS]
            if compute_entropy:
                # H = log S - sum_v p_v (z_v - M), with S = sum_v exp(z_v - M).
                entropy[start:stop] = log_sum_exp - stats[_EXP_TIMES_LOGIT] / stats[_SUM_EXP]
        del exps_scratch, weight_gemm, gemm_scratch
        _raise_unless_one_owner(num_owners, targets)
        if will_backward and num_tokens:
            last_start = _chunk_bounds(num_tokens, chunk_size)[-1][0]
            _to_probs_minus_onehot(
                scratch[: num_tokens - last_start], logsumexp[last_start:] - shard_max,
                targets[last_start:], vocab_start_index,
            )
            ctx.save_for_backward(hidden, weight, targets, logsumexp, scratch)
        else:
            ctx.save_for_backward(hidden, weight, targets, logsumexp, None)
        ctx.vocab_start_index, ctx.chunk_size = vocab_start_index, chunk_size
        ctx.temperature, ctx.gemm_dtype = temperature, gemm_dtype
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs, _grad_entropy):
        # d logp_t / d z_tv = (onehot_tv - p_tv) / T for the raw logits z (p at z / T), times the
        # upstream g_t: applied per chunk by _fp32_head_grads or _low_precision_head_grads.
        hidden, weight, targets, logsumexp, scratch = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        weight_gemm = weight.to(ctx.gemm_dtype)  # [vocab/tp, hidden]
        gemm_scratch = None if scratch is None else _gemm_scratch(scratch, ctx.gemm_dtype)
        grad_hidden = hidden.new_empty(hidden.shape) if need_hidden else None
        grad_weight = None  # FP32 [vocab/tp, hidden]: written by the first chunk, then summed into
        # Last chunk first: the forward left its softmax - onehot in `scratch`.
        chunks = _chunk_bounds(hidden.shape[0], ctx.chunk_size)[::-1]
        for index, (start, stop) in enumerate(chunks):
            hidden_chunk = hidden[start:stop].to(ctx.gemm_dtype)  # [c, hidden]
            probs_minus_onehot = scratch[: stop - start]  # [c, vocab/tp]
            gemm_out = None if gemm_scratch is None else gemm_scratch[: stop - start]
            if index > 0:
                _tempered_logits(  # recompute
                    hidden_chunk, weight_gemm, ctx.temperature, out=probs_minus_onehot,
                    gemm_out=gemm_out,
                )
                _to_probs_minus_onehot(
                    probs_minus_onehot, logsumexp[start:stop], targets[start:stop],
                    ctx.vocab_start_index,
                )
            neg_grad = grad_logprobs[start:stop].float().neg().unsqueeze(-1)  # [c, 1]
            if ctx.temperature != 1.0:
                neg_grad = neg_grad / ctx.temperature
            if gemm_out is None:
                chunk_grad_hidden, chunk_grad_weight = _fp32_head_grads(
                    probs_minus_onehot, neg_grad, hidden_chunk, weight_gemm, need_hidden,
                    need_weight,
                )
            else:
                chunk_grad_hidden, chunk_grad_weight = _low_precision_head_grads(
                    probs_minus_onehot, neg_grad, hidden_chunk, weight_gemm, gemm_out,
                    need_hidden, need_weight,
                )
            if need_hidden:
                grad_hidden[start:stop] = chunk_grad_hidden
            if need_weight:
                lhs, rhs = chunk_grad_weight  # [vocab/tp, c] FP32, [c, hidden] FP32
                if grad_weight is None:
                    grad_weight = lhs @ rhs
                else:
                    grad_weight.addmm_(lhs, rhs)
        if need_weight:
            if grad_weight is None:  # no tokens
                grad_weight = torch.zeros_like(weight)
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, None


def _gemm_scratch(scratch: Tensor, gemm_dtype: torch.dtype) -> Tensor | None:
    """A buffer like `scratch` [c, vocab/tp] in the GEMM dtype, or None for the FP32 head."""
    if gemm_dtype == scratch.dtype:
        return None
    return scratch.new_empty(scratch.shape, dtype=gemm_dtype)


def _fp32_head_grads(
    probs_minus_onehot: Tensor, neg_grad: Tensor, hidden_chunk: Tensor, weight: Tensor,
    need_hidden: bool, need_weight: bool,
) -> tuple[Tensor | None, tuple[Tensor, Tensor] | None]:
    """One chunk's hidden gradient [c, hidden] and weight-gradient GEMM operands for the FP32
    head. The per-token factor -g_t / T scales the [c, hidden] operands, not the [c, vocab/tp]
    buffer, which so sees no extra pass."""
    grad_hidden = (probs_minus_onehot @ weight).mul_(neg_grad) if need_hidden else None
    grad_weight = (probs_minus_onehot.t(), hidden_chunk * neg_grad) if need_weight else None
    return grad_hidden, grad_weight


def _low_precision_head_grads(
    probs_minus_onehot: Tensor, neg_grad: Tensor, hidden_chunk: Tensor, weight: Tensor,
    gemm_out: Tensor, need_hidden: bool, need_weight: bool,
) -> tuple[Tensor | None, tuple[Tensor, Tensor] | None]:
    """As _fp32_head_grads for logits computed as a GEMM in weight's dtype and then cast to FP32:
    autograd of that cast rounds the FP32 logit gradient to the GEMM dtype (so the per-token
    factor is applied first, to the [c, vocab/tp] buffer), and the hidden gradient is a GEMM in
    that dtype. The weight-gradient operands are the rounded logit gradient and the hidden chunk
    in FP32: their products are exact in FP32, so the FP32 GEMM is the low-precision GEMM's own
    FP32 accumulation, and the caller sums the chunks in FP32 and rounds once."""
    grad_logits = gemm_out.copy_(probs_minus_onehot.mul_(neg_grad))  # [c, vocab/tp], rounded
    grad_hidden = grad_logits @ weight if need_hidden else None
    grad_weight = None
    if need_weight:
        grad_weight = (probs_minus_onehot.copy_(grad_logits).t(), hidden_chunk.float())
    return grad_hidden, grad_weight


def _raise_unless_one_owner(num_owners: Tensor, targets: Tensor) -> None:
    """One check (one device sync) per call; every rank sees the same reduced counts, so all raise
    together and none is left waiting in a collective."""
    if num_owners.numel() == 0 or bool((num_owners == 1).all()):
        return
    bad = int((num_owners != 1).nonzero()[0, 0])
    raise ValueError(
        f"target id {int(targets[bad])} (token {bad}) is owned by {int(num_owners[bad])} vocab "
        "shards, expected exactly 1: targets must lie in [0, vocab) and the shards' "
        "vocab_start_index / weight rows must tile the vocabulary without gaps or overlap"
    )
