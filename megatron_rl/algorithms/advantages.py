"""Group-relative advantages: A_i = r_i - mean(r over the prompt's G completions), optionally
normalised by the prompt's group std (GRPO) or by the std of the whole batch (ScaleRL). Rewards
arrive as one row per prompt, so "group" is always a row; prompts dropped by the zero-variance
or verified filter (``keep`` False) get zero advantage and stay out of the batch statistics. A
dropped row may hold NaN (a failed verification): it never enters any arithmetic.
"""
from __future__ import annotations

import torch

NORMALIZATIONS = ("none", "prompt", "batch")


def compute_advantages(
    rewards: torch.Tensor,
    normalization: str,
    *,
    keep: torch.Tensor | None = None,
    eps: float = 1e-6,
    std_correction: int = 1,
) -> torch.Tensor:
    """Group-centred advantages, [num_prompts, group_size], same dtype as ``rewards``.

    ``normalization``: "none" (r - mean), "prompt" (divide by the group's std + eps) or "batch"
    (divide by the std of all kept advantages + eps). ``keep`` [num_prompts] bool marks prompts
    that stay in the loss (``group_keep_mask``); dropped prompts get advantage 0 and do not enter
    the batch std (the SCALERL.md default). Rewards of dropped prompts are ignored, so they may be
    NaN (failed verifications); a kept prompt must have finite rewards. ``std_correction`` is
    torch's Bessel correction: 1 (default) is the sample std that TRL's and verl's GRPO use; 0 is
    the population std.
    """
    _check_rewards(rewards)
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"unknown advantage normalization {normalization!r}; "
                         f"choose one of {NORMALIZATIONS}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if std_correction not in (0, 1):
        raise ValueError(f"std_correction must be 0 (population std) or 1 (sample std), "
                         f"got {std_correction}")
    num_prompts, group_size = rewards.shape
    keep = _check_keep(keep, num_prompts, rewards.device)
    _check_kept_rewards_finite(rewards, keep)
    # Dropped rows become zeros: NaN * 0 would still be NaN.
    rewards = torch.where(keep.unsqueeze(1), rewards, torch.zeros_like(rewards))

    advantages = rewards - rewards.mean(dim=1, keepdim=True)  # [num_prompts, group_size]
    if normalization == "prompt":
        if group_size <= std_correction:
            raise ValueError(f"prompt-level normalization needs group_size > {std_correction} "
                             f"for a sample std (got group_size {group_size}); use "
                             "normalization='none' or std_correction=0")
        divisor = rewards.std(dim=1, correction=std_correction, keepdim=True) + eps
        # A zero-variance group has all-zero advantages; with eps = 0 keep them 0, not 0/0.
        advantages = advantages / torch.where(divisor > 0, divisor, torch.ones_like(divisor))
    elif normalization == "batch":
        kept = advantages[keep]  # [num_kept, group_size]
        # Too few kept values for a std means every kept advantage is 0 anyway (a kept group has
        # at least two distinct rewards), so any finite divisor gives the same answer.
        if kept.numel() > std_correction:
            divisor = kept.std(correction=std_correction) + eps
            if divisor > 0:
                advantages = advantages / divisor
    return advantages


def _check_rewards(rewards: torch.Tensor) -> None:
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards)
        raise ValueError(f"rewards must be a [num_prompts, group_size] tensor, got {shape}")
    if not rewards.is_floating_point():
        raise TypeError(f"rewards must be a floating-point tensor, got {rewards.dtype}; "
                        "convert with rewards.float()")
    if rewards.numel() == 0:
        raise ValueError(f"rewards is empty (shape {tuple(rewards.shape)})")


def _check_kept_rewards_finite(rewards: torch.Tensor, keep: torch.Tensor) -> None:
    bad = keep & ~torch.isfinite(rewards).all(dim=1)
    if bad.any():
        raise ValueError(f"rewards of kept prompts {bad.nonzero().flatten().tolist()[:5]} contain "
                         "NaN or inf; NaN marks a failed verification: drop those groups with "
                         "keep=group_keep_mask(rewards) (megatron_rl.algorithms.filtering)")


def _check_keep(keep: torch.Tensor | None, num_prompts: int,
                device: torch.device) -> torch.Tensor:
    if keep is None:
        return torch.ones(num_prompts, dtype=torch.bool, device=device)
    if keep.dtype != torch.bool or tuple(keep.shape) != (num_prompts,):
        raise ValueError(f"keep must be a bool tensor of shape [num_prompts]=({num_prompts},), "
                         f"got dtype {keep.dtype} shape {tuple(keep.shape)}")
    return keep.to(device)
