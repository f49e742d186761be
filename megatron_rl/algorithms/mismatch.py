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

Where they plug in (not wired yet, docs/low_precision.md): trainer/step.py `_loss` multiplies
`out.token_loss` by `correction_weights(...)` before aggregation; under context parallelism the
sequence mask takes each completion's whole-sequence mean log-ratio as GSPO does
(`sequence_log_ratio`).
"""
from __future__ import annotations

import dataclasses

import torch

from megatron_rl.algorithms.losses import MAX_LOG_RATIO, _loss_mask, _segment_mean

# Losses whose importance ratio is against the generator's own log-probs already.
RATIO_AGAINST_GENERATOR = ("cispo",)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MismatchCorrection:
    """Which corrections apply: `tis_cap` (C of min(r, C); None = off), `sequence_window` and
    `token_window` ((low, high) bounds on the ratio kept; None = off)."""

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
        mask = _loss_mask(loss_mask, train_logp)
        log_ratio = torch.log(_ratio(train_logp, gen_logp, loss_mask))
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
    `sample_index`, the share whose sequence_kept is False). Local to this call: over data
    parallel ranks, sums and counts add up but quantiles do not."""
    mask = _loss_mask(loss_mask, train_logp)
    ratio = _ratio(train_logp, gen_logp, loss_mask)[mask].double()
    if ratio.numel() == 0:
        return {}
    log_ratio = torch.log(ratio)
    out = {f"{prefix}kl_k1": float((-log_ratio).mean()),
           f"{prefix}kl_k3": float((ratio - 1 - log_ratio).mean())}
    values = torch.quantile(ratio, torch.tensor(quantiles, dtype=torch.float64))
    out.update({f"{prefix}ratio_p{100 * q:g}": float(v) for q, v in zip(quantiles, values)})
    kept = torch.ones_like(mask)
    for flags in (token_kept, sequence_kept):
        if flags is not None:
            kept = kept & flags
    out[f"{prefix}masked_token_share"] = 1.0 - float(kept[mask].double().mean())
    if sequence_kept is not None and sample_index is not None:
        ids = sample_index[mask]
        dropped = torch.unique(ids[~sequence_kept[mask]])
        out[f"{prefix}masked_sequence_share"] = dropped.numel() / torch.unique(ids).numel()
    return out


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
