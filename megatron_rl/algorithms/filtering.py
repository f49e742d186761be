"""Data selection on reward groups: the zero-variance filter (ScaleRL drops prompts whose G
rewards are all equal, since their group-centred advantages are all zero and carry no signal),
the verified filter (a group with a sample whose verifier failed, NaN reward, is dropped the same
way: its mean, and so every advantage in it, would be wrong), and the per-prompt pass rate that
feeds the No-Positive-Resampling sampler.
"""
from __future__ import annotations

import torch


def verified_mask(rewards: torch.Tensor) -> torch.Tensor:
    """Bool [num_prompts]: True where every reward of the group is a number, False where a
    sample's verifier failed (NaN; `megatron_rl.rewards.reward_values` writes them)."""
    _check_groups(rewards, "rewards")
    return ~torch.isnan(rewards).any(dim=1)


def zero_variance_mask(rewards: torch.Tensor) -> torch.Tensor:
    """Bool [num_prompts]: True where the group's rewards are not all equal (keep the prompt).
    A group with a failed verification (NaN) is never kept.

    Equality is exact: rewards shaped by a length penalty differ by small amounts that still
    produce a non-zero advantage, so no tolerance is applied.
    """
    _check_groups(rewards, "rewards")
    return (rewards.amax(dim=1) != rewards.amin(dim=1)) & verified_mask(rewards)


def group_keep_mask(rewards: torch.Tensor, *, zero_variance_filter: bool = True) -> torch.Tensor:
    """Bool [num_prompts]: the prompts that enter the loss and the batch std (`keep` of
    `compute_advantages`): verified groups, and with `zero_variance_filter` only those whose
    rewards differ. Groups with a failed verification are dropped whatever the filter setting."""
    if zero_variance_filter:
        return zero_variance_mask(rewards)
    return verified_mask(rewards)


def group_pass_rates(correct: torch.Tensor) -> torch.Tensor:
    """Float64 [num_prompts]: fraction of each prompt's G completions judged correct.

    ``correct`` [num_prompts, group_size] is bool (or 0/1); this is what
    ``NoPositiveResamplingSampler.update`` expects, not the (possibly shaped) reward. A failed
    verification is not a verdict: update the sampler with the verified groups only
    (``verified_mask``).
    """
    _check_groups(correct, "correct")
    if correct.dtype != torch.bool and not ((correct == 0) | (correct == 1)).all():
        raise ValueError("correct must be bool or contain only 0 and 1; pass the verifier's "
                         "correctness, not the shaped reward")
    return correct.to(torch.float64).mean(dim=1)


def _check_groups(values: torch.Tensor, name: str) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() != 2 or values.numel() == 0:
        shape = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values)
        raise ValueError(f"{name} must be a non-empty [num_prompts, group_size] tensor, "
                         f"got {shape}")
