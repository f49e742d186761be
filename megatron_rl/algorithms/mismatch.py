"""Corrections for the train / rollout mismatch (a generator that samples from a slightly
different distribution than the trainer computes: FP8 serving, other kernels), and its metrics.
Pure per-token tensor functions like losses.py; none is on by default (ScaleRL unchanged).

Notation: gen_logp is the generator's recorded log-prob of each sampled token; train_logp the
trainer's log-prob of the same token under the weights the generator ran (recomputed "old"
log-probs), or its current one where nothing is recomputed. r = exp(train_logp - gen_logp).

- Token-level truncated importance sampling (TIS; verl, Yao et al. 2025): multiply each token's
  loss by sg(min(r, cap)). For the losses whose ratio is taken against recomputed old log-probs
  (DAPO / GRPO / GSPO with a recomputation step), which then no longer see the generator at all.
  CISPO takes its ratio against gen_logp already and truncates it at eps_max: a TIS factor on
  top would weigh the mismatch twice, so it is refused.
- Sequence masking (MIS, "seq-mask"): drop a whole completion whose geometric-mean ratio
  exp(mean_t log r) lies outside [low, high].
- Token masking (IcePop-style): drop tokens whose r lies outside [low, high].
A masked token keeps its place in the aggregation's denominators (the global token counts are
fixed before the loss, aggregation.py): it contributes a zero loss, as a clipped token does.

Where they plug in: trainer/step.py `_loss` multiplies the policy loss's `token_loss` by
`correction_weights(...)` before aggregation (with `tis_cap` set, the loss's own ratio is then
taken against the trainer's old log-probs, see `MismatchCorrection`); under context parallelism
the sequence mask takes each completion's whole-sequence mean log-ratio as GSPO does
(`sequence_log_ratio`). The metrics are computed every step, corrections on or off, as a fixed
vector of sums and a histogram (`mismatch_sums`) that data / context parallel ranks add with one
all-reduce, read by `metrics_from_sums`.
"""
from __future__ import annotations

import bisect
import dataclasses
import itertools
import math

import torch

from megatron_rl.algorithms.losses import MAX_LOG_RATIO, _loss_mask, _segment_mean

# Losses whose importance ratio is against the generator's own log-probs already.
RATIO_AGAINST_GENERATOR = ("cispo",)

# Quantiles of r come from a fixed histogram of log r that ranks add up (a gather would move
# every token's ratio of the step): bins 1/100 of a decade wide in |log r| from 1e-7 to 100
# (> MAX_LOG_RATIO, so no token falls outside) on either side of one bin [-1e-7, 1e-7] around 0.
# A quantile read from it is within 2.3 % of its log-ratio (1e-7 absolute near 0).
_MAGNITUDE_EDGES = torch.logspace(-7, 2, 901, dtype=torch.float64)  # of |log r|
LOG_RATIO_EDGES = torch.cat([-_MAGNITUDE_EDGES.flip(0), _MAGNITUDE_EDGES])  # [1802]
# mismatch_sums' layout: these named sums, then the histogram's counts.
SUM_NAMES = ("tokens", "kl_k1", "kl_k3", "masked_tokens", "sequences", "masked_sequences")
NUM_SUMS = len(SUM_NAMES) + len(LOG_RATIO_EDGES) - 1
QUANTILES = (0.01, 0.5, 0.99)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MismatchCorrection:
    """Which corrections apply: `tis_cap` (C of min(r, C); None = off), `sequence_window` and
    `token_window` ((low, high) bounds on the ratio kept; None = off).

    TIS here: this project never stores a separate "old" policy (one optimizer step per batch;
    old log-probs are the generator's), so with `tis_cap` the trainer's own log-probs of this
    step's forward, under the weights before the update, are the recomputed old ones (a free
    recomputation): the policy loss takes its ratio against them and the generator enters only
    through sg(min(pi_train_old / pi_gen, C)) (verl's decoupled form). With one step per batch
    that ratio is 1 and its clip never binds: DAPO / GRPO + TIS train with CISPO's gradient at
    eps_max = C, GSPO + TIS with a sequence ratio of 1 and the TIS weight per token."""

    tis_cap: float | None = None
    sequence_window: tuple[float, float] | None = None
    token_window: tuple[float, float] | None = None

    def __post_init__(self) -> None:
        if self.tis_cap is not None and not 0 < self.tis_cap < float("inf"):
            raise ValueError(f"tis_cap must be a finite number > 0 (e.g. 2), got "
                             f"{self.tis_cap}; or None for no truncated importance sampling")
        for name in ("sequence_window", "token_window"):
            window = getattr(self, name)
            if window is not None and not (len(window) == 2 and 0 <= window[0] < 1 < window[1]):
                raise ValueError(f"{name} must be (low, high) with 0 <= low < 1 < high (the "
                                 f"ratios kept, e.g. (0.5, 2.0)), got {window}; or None")

    @property
    def enabled(self) -> bool:
        return (self.tis_cap, self.sequence_window, self.token_window) != (None, None, None)


def truncated_is_weight(train_logp: torch.Tensor, gen_logp: torch.Tensor, *, cap: float,
                        loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[T] sg(min(exp(train_logp - gen_logp), cap)); 1 on masked tokens."""
    ratio = _ratio(train_logp, gen_logp, loss_mask)
    return ratio.clamp(max=cap)


def token_keep(train_logp: torch.Tensor, gen_logp: torch.Tensor, *,
               window: tuple[float, float],
               loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[T] bool: the token's ratio r lies in [low, high] (masked tokens: True)."""
    ratio = _ratio(train_logp, gen_logp, loss_mask)
    return (ratio >= window[0]) & (ratio <= window[1])


def sequence_keep(train_logp: torch.Tensor, gen_logp: torch.Tensor, sample_index: torch.Tensor,
                  *, window: tuple[float, float], loss_mask: torch.Tensor | None = None,
                  sequence_log_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """[T] bool: the token's completion has its geometric-mean ratio exp(mean_t log r) (over its
    unmasked tokens, or `sequence_log_ratio` [T] when a completion is split over calls) in
    [low, high]."""
    if sequence_log_ratio is None:
        # The clamped log-ratio gspo_log_ratio_sums adds up where a completion is split.
        _ratio(train_logp, gen_logp, loss_mask)  # checks the shapes
        mask = _loss_mask(loss_mask, train_logp)
        log_ratio = (train_logp.detach() - gen_logp.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
        sequence_log_ratio = _segment_mean(log_ratio, mask, sample_index)
    ratio = torch.exp(sequence_log_ratio.detach())
    return (ratio >= window[0]) & (ratio <= window[1])


def correction_weights(kind: str, correction: MismatchCorrection, *, train_logp: torch.Tensor,
                       gen_logp: torch.Tensor, sample_index: torch.Tensor,
                       loss_mask: torch.Tensor | None = None,
                       sequence_log_ratio: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight [T] to multiply the policy loss's token_loss by, token_kept [T] bool,
    sequence_kept [T] bool) for policy loss `kind`; weights are detached."""
    if correction.tis_cap is not None and kind in RATIO_AGAINST_GENERATOR:
        raise ValueError(f"truncated importance sampling against the generator's log-probs is "
                         f"already what {kind!r} does (its ratio is pi_train / pi_gen, truncated "
                         "at eps_max); set tis_cap only with dapo / grpo / gspo")
    ones = torch.ones_like(train_logp, dtype=torch.bool)
    weight = torch.ones_like(train_logp, dtype=torch.promote_types(train_logp.dtype,
                                                                    torch.float32))
    if correction.tis_cap is not None:
        weight = truncated_is_weight(train_logp, gen_logp, cap=correction.tis_cap,
                                     loss_mask=loss_mask)
    tokens = ones if correction.token_window is None else token_keep(
        train_logp, gen_logp, window=correction.token_window, loss_mask=loss_mask)
    sequences = ones if correction.sequence_window is None else sequence_keep(
        train_logp, gen_logp, sample_index, window=correction.sequence_window,
        loss_mask=loss_mask, sequence_log_ratio=sequence_log_ratio)
    return weight * (tokens & sequences), tokens, sequences


def mismatch_metrics(train_logp: torch.Tensor, gen_logp: torch.Tensor, *,
                     loss_mask: torch.Tensor | None = None,
                     sample_index: torch.Tensor | None = None,
                     token_kept: torch.Tensor | None = None,
                     sequence_kept: torch.Tensor | None = None,
                     quantiles: tuple[float, ...] = (0.01, 0.5, 0.99),
                     prefix: str = "mismatch/") -> dict[str, float]:
    """Over the unmasked tokens: the mismatch's KL(pi_gen || pi_train) estimated from tokens
    sampled by the generator, k1 = mean(-log r) and k3 = mean(r - 1 - log r) (Schulman's
    non-negative unbiased estimator); quantiles of r (linear interpolation); and the shares
    masked: tokens (1 - mean token_kept & sequence_kept) and completions (of those in
    `sample_index`, the share whose sequence_kept is False). Local to this call, quantiles exact;
    the trainer reports the same metrics from `mismatch_sums` added over ranks."""
    _ratio(train_logp, gen_logp, loss_mask)  # checks the shapes
    mask = _loss_mask(loss_mask, train_logp)
    log_ratio = (train_logp.detach().double() - gen_logp.detach().double())[mask].clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO)  # float64, as mismatch_sums
    if log_ratio.numel() == 0:
        return {}
    ratio = torch.exp(log_ratio)
    out = {f"{prefix}kl_k1": float((-log_ratio).mean()),
           f"{prefix}kl_k3": float((torch.expm1(log_ratio) - log_ratio).mean())}
    values = torch.quantile(ratio, torch.tensor(quantiles, dtype=torch.float64))
    out.update({f"{prefix}{_quantile_name(q)}": float(v) for q, v in zip(quantiles, values)})
    kept = torch.ones_like(mask)
    for flags in (token_kept, sequence_kept):
        if flags is not None:
            kept = kept & flags
    out[f"{prefix}masked_token_fraction"] = 1.0 - float(kept[mask].double().mean())
    if sequence_kept is not None and sample_index is not None:
        ids = sample_index[mask]
        dropped = torch.unique(ids[~sequence_kept[mask]])
        out[f"{prefix}masked_sequence_fraction"] = dropped.numel() / torch.unique(ids).numel()
    return out


def mismatch_sums(train_logp: torch.Tensor, gen_logp: torch.Tensor, sample_index: torch.Tensor,
                  *, loss_mask: torch.Tensor | None = None,
                  completion_num_tokens: torch.Tensor | None = None,
                  token_kept: torch.Tensor | None = None,
                  sequence_kept: torch.Tensor | None = None) -> torch.Tensor:
    """[NUM_SUMS] float64 sums over the unmasked tokens, in SUM_NAMES' order then the histogram
    of log r over LOG_RATIO_EDGES' bins: the sums of several calls (micro-batches, data or
    context parallel ranks) add up to the sums of their tokens together, which
    `metrics_from_sums` reads. Completions are counted by 1 / n per token, n being the
    completion's whole loss-token count (`completion_num_tokens` [T], given where a completion is
    split over calls; else counted here), so a split completion adds up to 1."""
    _ratio(train_logp, gen_logp, loss_mask)  # checks the shapes
    mask = _loss_mask(loss_mask, train_logp)
    # In float64 from the log-probs: exp then log in float32 would lose a 1e-6 mismatch.
    log_ratio = (train_logp.detach().double() - gen_logp.detach().double())[mask].clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO)
    if completion_num_tokens is None:
        _, segment, counts = torch.unique(sample_index[mask], return_inverse=True,
                                          return_counts=True)
        completion_num_tokens = counts[segment]
    else:
        completion_num_tokens = completion_num_tokens[mask]
    per_completion = 1.0 / completion_num_tokens.double().clamp(min=1)
    kept = torch.ones_like(mask)
    for flags in (token_kept, sequence_kept):
        if flags is not None:
            kept = kept & flags
    sequence_dropped = (torch.zeros_like(mask) if sequence_kept is None
                        else ~sequence_kept)[mask]
    edges = LOG_RATIO_EDGES.to(log_ratio.device)
    # A NaN log-prob (a non-finite step, which the trainer skips and counts) has no bin: it makes
    # the k1 / k3 sums NaN and stays out of the histogram (bucketize would put it past the end).
    binned = log_ratio[~torch.isnan(log_ratio)]
    bins = torch.bucketize(binned, edges) - 1  # edges[b] < log r <= edges[b + 1]
    histogram = torch.zeros(len(edges) - 1, dtype=torch.float64, device=log_ratio.device)
    histogram.index_add_(0, bins, torch.ones_like(binned))
    named = torch.stack([
        torch.tensor(float(log_ratio.numel()), dtype=torch.float64, device=log_ratio.device),
        (-log_ratio).sum(),
        (torch.expm1(log_ratio) - log_ratio).sum(),  # r - 1 - log r, exact for r near 1
        (~kept[mask]).double().sum(),
        per_completion.sum(),
        (per_completion * sequence_dropped).sum()])
    return torch.cat([named, histogram])


def metrics_from_sums(sums: torch.Tensor, *, quantiles: tuple[float, ...] = QUANTILES,
                      prefix: str = "mismatch/") -> dict[str, float]:
    """`mismatch_sums` (added up over calls and ranks) as metrics: k1 and k3 (as in
    `mismatch_metrics`), quantiles of r from the histogram (linear within a bin, in log r: within
    a bin's width of the exact quantile), and the fractions of tokens and completions masked.
    Empty when no token was counted."""
    values = sums.detach().double().tolist()  # host floats, off any device
    named = dict(zip(SUM_NAMES, values[:len(SUM_NAMES)]))
    histogram = values[len(SUM_NAMES):]
    num_tokens = named["tokens"]
    if num_tokens <= 0:
        return {}
    out = {f"{prefix}kl_k1": named["kl_k1"] / num_tokens,
           f"{prefix}kl_k3": named["kl_k3"] / num_tokens}
    cumulative = list(itertools.accumulate(histogram))
    edges = LOG_RATIO_EDGES.tolist()
    for q in quantiles:
        # torch.quantile's position q (n - 1) among the sorted values; a bin's c values are
        # spread evenly over its width, the i-th at (i + 1/2) / c of it.
        position = q * (num_tokens - 1)
        b = min(bisect.bisect_left(cumulative, position + 0.5), len(histogram) - 1)
        share = (position - (cumulative[b] - histogram[b]) + 0.5) / max(histogram[b], 1.0)
        log_ratio = edges[b] + min(max(share, 0.0), 1.0) * (edges[b + 1] - edges[b])
        out[f"{prefix}{_quantile_name(q)}"] = math.exp(log_ratio)
    out[f"{prefix}masked_token_fraction"] = named["masked_tokens"] / num_tokens
    out[f"{prefix}masked_sequence_fraction"] = (named["masked_sequences"] / named["sequences"]
                                                if named["sequences"] > 0 else 0.0)
    return out


def _quantile_name(q: float) -> str:
    """ratio_p01, ratio_p50, ratio_p99 (ratio_p99.9 for 0.999)."""
    return f"ratio_p{100 * q:02g}"


def _ratio(train_logp: torch.Tensor, gen_logp: torch.Tensor,
           loss_mask: torch.Tensor | None) -> torch.Tensor:
    """[T] r = exp(train_logp - gen_logp), detached, the log clamped as the losses clamp it; 1 on
    masked tokens (their gen_logp may be missing: 0 or NaN)."""
    if train_logp.shape != gen_logp.shape or train_logp.dim() != 1:
        raise ValueError(f"train_logp {tuple(train_logp.shape)} and gen_logp "
                         f"{tuple(gen_logp.shape)} must be the same [T] per-token shape")
    mask = _loss_mask(loss_mask, train_logp)
    dtype = torch.promote_types(train_logp.dtype, torch.float32)
    log_ratio = (train_logp.detach().to(dtype) - gen_logp.detach().to(dtype)).clamp(
        -MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.where(mask, torch.exp(log_ratio), torch.ones_like(log_ratio))
