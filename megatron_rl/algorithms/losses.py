"""Per-token policy-gradient losses between the trainer's log-probs and the generator's recorded
(behaviour) log-probs: CISPO (ScaleRL's choice: truncated importance sampling, gradient only
through log pi), the PPO-style clipped surrogate of GRPO and DAPO, and GSPO's sequence-level
clipped ratio; plus the token cross-entropy of the supervised cold start (`megatron-rl sft`).
Every loss returns a per-token value to be minimised plus per-token metrics; how tokens become a
scalar is aggregation.py's job, so the losses never see batch structure (GSPO excepted: it needs
each token's completion id for the sequence ratio, and when a completion's tokens are spread over
several calls, as over context-parallel ranks, the caller adds up `gspo_log_ratio_sums` of the
pieces and passes each completion's mean in).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("cispo", "dapo", "grpo", "gspo")
# Not a policy loss: the supervised cold start (`megatron-rl sft`) through the same trainer.
SFT_KIND = "sft"

# Clip range per surrogate kind when compute_policy_loss gets no explicit eps_low/eps_high:
# GRPO is symmetric 0.2; DAPO's "clip-higher" 0.2/0.28; GSPO clips a sequence-level ratio, which
# stays near 1, so its range is tiny (GSPO paper: 3e-4 / 4e-4).
DEFAULT_CLIP_RANGE: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2),
    "dapo": (0.2, 0.28),
    "gspo": (3e-4, 4e-4),
}

# exp() of a larger log-ratio overflows float32, and an inf in forward turns into NaN gradients
# through the unselected branch of min(). A token this far off-policy (ratio e^20 ~ 5e8) is
# clipped or truncated by every loss here anyway; verl clamps at the same value.
MAX_LOG_RATIO = 20.0


@dataclass(slots=True)
class LossOutput:
    """Per-token loss and metrics, all [T]; the caller aggregates with its own loss mask."""

    token_loss: torch.Tensor  # to minimise (already negated); 0 where loss_mask is 0
    ratio: torch.Tensor  # pi_train / pi_gen per token, detached (1 where masked)
    clipped: torch.Tensor  # bool: the token's ratio hit a clip or truncation bound
    abs_logp_diff: torch.Tensor  # |logp_train - logp_gen|, detached (0 where masked)
    sequence_ratio: torch.Tensor | None = None  # GSPO only: s_i broadcast to its tokens


def cispo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_max: float = 5.0,
    loss_mask: torch.Tensor | None = None,
) -> LossOutput:
    """CISPO: loss = -sg(min(rho, eps_max)) * A * log pi_train, per token.

    The ratio is a constant weight (stop-gradient), so the gradient d loss / d logp is
    -min(rho, eps_max) * A and never vanishes, unlike a clipped surrogate: truncation only caps
    the weight. No lower clip (ratio >= 0 already).
    """
    _check_positive("eps_max", eps_max)
    logp, old_logp, advantages, mask = _prepare(logp, old_logp, advantages, loss_mask)
    log_ratio = _log_ratio(logp.detach(), old_logp)
    ratio = torch.exp(log_ratio)  # [T], detached
    weight = ratio.clamp(max=eps_max)
    token_loss = -(weight * advantages * logp)
    return LossOutput(
        token_loss=_masked(token_loss, mask),
        ratio=ratio,
        clipped=(ratio > eps_max) & mask,
        abs_logp_diff=_abs_logp_diff(logp, old_logp),
    )


def clipped_surrogate_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    loss_mask: torch.Tensor | None = None,
) -> LossOutput:
    """GRPO / DAPO: loss = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A), per token.

    GRPO uses eps_low = eps_high = 0.2; DAPO raises eps_high ("clip-higher"). The gradient is
    zero on clipped tokens (A > 0 with rho > 1 + eps_high, or A < 0 with rho < 1 - eps_low).
    """
    _check_clip_range(eps_low, eps_high)
    logp, old_logp, advantages, mask = _prepare(logp, old_logp, advantages, loss_mask)
    ratio = torch.exp(_log_ratio(logp, old_logp))  # [T], differentiable through logp
    token_loss, clipped = _clipped_objective(ratio, advantages, eps_low, eps_high)
    return LossOutput(
        token_loss=_masked(token_loss, mask),
        ratio=ratio.detach(),
        clipped=clipped & mask,
        abs_logp_diff=_abs_logp_diff(logp, old_logp),
    )


def gspo_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    sample_index: torch.Tensor,
    *,
    loss_mask: torch.Tensor | None = None,
    eps_low: float = DEFAULT_CLIP_RANGE["gspo"][0],
    eps_high: float = DEFAULT_CLIP_RANGE["gspo"][1],
    sequence_log_ratio: torch.Tensor | None = None,
) -> LossOutput:
    """GSPO: the clipped surrogate on the sequence ratio s_i = exp(mean_t log rho_{i,t}).

    The mean runs over completion i's unmasked tokens (``sample_index`` says which completion a
    token belongs to; any integer ids). Per-token form (GSPO-token): s_{i,t} = sg(s_i) *
    pi(y_t) / sg(pi(y_t)) has the value s_i and, since A is constant within a completion and
    every aggregation mode weights a completion's tokens equally, gives exactly the gradient of
    the sequence-level objective.

    The mean is over the tokens of this call unless ``sequence_log_ratio`` [T] gives each token
    its completion's mean log-ratio over ALL its tokens: needed when a completion is split over
    calls (context-parallel ranks each hold a slice of it), where a slice's own mean is another
    ratio. Build it from the slices' `gspo_log_ratio_sums`, summed over the slices and divided by
    the completion's number of loss tokens.
    """
    _check_clip_range(eps_low, eps_high)
    logp, old_logp, advantages, mask = _prepare(logp, old_logp, advantages, loss_mask)
    _check_index("sample_index", sample_index, logp)
    log_ratio = _log_ratio(logp.detach(), old_logp)  # [T], 0 where masked
    if sequence_log_ratio is None:
        sequence_log_ratio = _segment_mean(log_ratio, mask, sample_index)  # [T], s_i's log
    else:
        if not isinstance(sequence_log_ratio, torch.Tensor) \
                or sequence_log_ratio.shape != logp.shape:
            shape = getattr(sequence_log_ratio, "shape", type(sequence_log_ratio))
            raise ValueError(f"sequence_log_ratio has shape {tuple(shape)} but logp has shape "
                             f"{tuple(logp.shape)}; give each token its completion's mean "
                             "log-ratio [T]")
        sequence_log_ratio = sequence_log_ratio.detach().to(log_ratio.dtype)
    sequence_ratio = torch.exp(sequence_log_ratio)
    token_ratio = torch.exp(sequence_log_ratio + logp - logp.detach())  # value s_i, grad via logp
    token_loss, clipped = _clipped_objective(token_ratio, advantages, eps_low, eps_high)
    return LossOutput(
        token_loss=_masked(token_loss, mask),
        ratio=torch.exp(log_ratio),
        clipped=clipped & mask,
        abs_logp_diff=_abs_logp_diff(logp, old_logp),
        sequence_ratio=sequence_ratio,
    )


def gspo_log_ratio_sums(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    sample_index: torch.Tensor,
    num_samples: int,
    *,
    loss_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_samples] each completion's sum of log rho over this call's unmasked tokens (the
    clamped log-ratio gspo_loss averages; ``sample_index`` holds completion ids in
    [0, num_samples), the same numbering in every call). The partial sums of a completion split
    over several calls add up to its whole sum: the numerator of gspo_loss's
    ``sequence_log_ratio``. Detached."""
    logp = logp.detach()
    logp, old_logp, _, mask = _prepare(logp, old_logp, torch.zeros_like(logp), loss_mask)
    _check_index("sample_index", sample_index, logp)
    if sample_index.numel() and not 0 <= int(sample_index.min()) <= int(sample_index.max()) \
            < num_samples:
        raise ValueError(f"sample_index holds ids outside [0, num_samples={num_samples}); give "
                         "global completion ids and the batch's number of completions")
    log_ratio = _log_ratio(logp, old_logp)
    return log_ratio.new_zeros(num_samples).index_add_(0, sample_index, log_ratio * mask)


def cross_entropy_loss(logp: torch.Tensor, *,
                       loss_mask: torch.Tensor | None = None) -> LossOutput:
    """Supervised fine-tuning: loss = -log pi(y_t) per token, the cross-entropy of the reference
    tokens (response tokens only: the caller's mask is 0 on the prompt). No behaviour policy:
    ratio 1, nothing clipped, no mismatch."""
    if not isinstance(logp, torch.Tensor) or logp.dim() != 1 or not logp.is_floating_point():
        raise ValueError("logp must be a 1-D floating-point per-token tensor [T], got "
                         f"{getattr(logp, 'shape', type(logp))}")
    mask = _loss_mask(loss_mask, logp)
    logp = logp.to(torch.promote_types(logp.dtype, torch.float32))
    return LossOutput(
        token_loss=_masked(-logp, mask),
        ratio=torch.ones_like(logp.detach()),
        clipped=torch.zeros_like(mask),
        abs_logp_diff=torch.zeros_like(logp.detach()),
    )


def compute_policy_loss(
    kind: str,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    sample_index: torch.Tensor | None = None,
    loss_mask: torch.Tensor | None = None,
    eps_max: float = 5.0,
    eps_low: float | None = None,
    eps_high: float | None = None,
    sequence_log_ratio: torch.Tensor | None = None,
) -> LossOutput:
    """Dispatch on ``kind`` in ("cispo", "dapo", "grpo", "gspo"); tensors are [T] per token.

    ``eps_max`` is CISPO's truncation; ``eps_low`` / ``eps_high`` the surrogate clip range,
    defaulting per kind to DEFAULT_CLIP_RANGE (dapo 0.2/0.28, grpo 0.2/0.2, gspo 3e-4/4e-4).
    "dapo" and "grpo" share one surrogate and differ only in that default; CISPO ignores
    eps_low / eps_high, the surrogates ignore eps_max. GSPO needs ``sample_index``, and takes
    ``sequence_log_ratio`` when its completions are split over calls (see gspo_loss).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown policy loss kind {kind!r}; choose one of {KINDS}")
    if sequence_log_ratio is not None and kind != "gspo":
        raise ValueError(f"sequence_log_ratio is GSPO's sequence-level ratio; policy loss "
                         f"{kind!r} has none: leave it None")
    if kind == "cispo":
        return cispo_loss(logp, old_logp, advantages, eps_max=eps_max, loss_mask=loss_mask)
    default_low, default_high = DEFAULT_CLIP_RANGE[kind]
    eps_low = default_low if eps_low is None else eps_low
    eps_high = default_high if eps_high is None else eps_high
    if kind == "gspo":
        if sample_index is None:
            raise ValueError("policy loss 'gspo' needs sample_index [T] (the completion id of "
                             "each token) to form the sequence-level ratio")
        return gspo_loss(logp, old_logp, advantages, sample_index, loss_mask=loss_mask,
                         eps_low=eps_low, eps_high=eps_high,
                         sequence_log_ratio=sequence_log_ratio)
    return clipped_surrogate_loss(logp, old_logp, advantages, eps_low=eps_low,
                                  eps_high=eps_high, loss_mask=loss_mask)


def _clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                       eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(-min(rho A, clip(rho) A), clipped flag); the flag marks tokens whose gradient is cut."""
    unclipped = ratio * advantages
    clipped_value = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    token_loss = -torch.minimum(unclipped, clipped_value)
    ratio = ratio.detach()
    clipped = (((advantages > 0) & (ratio > 1.0 + eps_high))
               | ((advantages < 0) & (ratio < 1.0 - eps_low)))
    return token_loss, clipped


def _segment_mean(values: torch.Tensor, mask: torch.Tensor,
                  sample_index: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over each completion's unmasked tokens, broadcast back to [T]."""
    _, segment = torch.unique(sample_index, return_inverse=True)  # [T] in 0..num_segments-1
    num_segments = int(segment.max()) + 1 if segment.numel() else 0
    sums = values.new_zeros(num_segments).index_add_(0, segment, values * mask)
    counts = values.new_zeros(num_segments).index_add_(0, segment, mask.to(values.dtype))
    # A completion with no unmasked token has no loss either; 0 keeps its ratio at 1.
    return (sums / counts.clamp(min=1.0))[segment]


def _prepare(logp, old_logp, advantages, loss_mask):
    """Validate [T] inputs; compute in at least FP32; neutralise masked tokens.

    Masked tokens (e.g. an inserted interruption phrase) may carry no behaviour log-prob at all
    (0 or NaN), so their old_logp is replaced by logp: log-ratio 0, no NaN in forward or backward.
    """
    for name, tensor in (("logp", logp), ("old_logp", old_logp), ("advantages", advantages)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() != 1:
            raise ValueError(f"{name} must be a 1-D per-token tensor [T], got shape "
                             f"{tuple(tensor.shape)}; flatten packed sequences first")
        if not tensor.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {tensor.dtype}")
        if tensor.shape != logp.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)} but logp has shape "
                             f"{tuple(logp.shape)}; all per-token inputs must match")
    dtype = torch.promote_types(logp.dtype, torch.float32)
    mask = _loss_mask(loss_mask, logp)
    logp = logp.to(dtype)
    old_logp = torch.where(mask, old_logp.detach().to(dtype), logp.detach())
    return logp, old_logp, advantages.detach().to(dtype), mask


def _loss_mask(loss_mask: torch.Tensor | None, logp: torch.Tensor) -> torch.Tensor:
    if loss_mask is None:
        return torch.ones_like(logp, dtype=torch.bool)
    if not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != logp.shape:
        shape = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask)
        raise ValueError(f"loss_mask has shape {shape} but logp has shape "
                         f"{tuple(logp.shape)}; it must be [T], 1 for trained tokens")
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def _check_index(name: str, index: torch.Tensor, logp: torch.Tensor) -> None:
    if not isinstance(index, torch.Tensor) or index.shape != logp.shape:
        shape = tuple(index.shape) if isinstance(index, torch.Tensor) else type(index)
        raise ValueError(f"{name} has shape {shape} but logp has shape {tuple(logp.shape)}")
    if index.is_floating_point() or index.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor (completion ids), got {index.dtype}")


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _abs_logp_diff(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return (logp.detach() - old_logp).abs()


def _masked(token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, token_loss, torch.zeros_like(token_loss))


def _check_positive(name: str, value: float) -> None:
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def _check_clip_range(eps_low: float, eps_high: float) -> None:
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1) so that the lower clip 1 - eps_low stays "
                         f"positive, got {eps_low}")
    if not 0.0 <= eps_high < float("inf"):
        raise ValueError(f"eps_high must be a finite number >= 0, got {eps_high}")
