"""Data selection on reward groups: the zero-variance filter (ScaleRL drops prompts whose G
rewards are all equal, since their group-centred advantages are all zero and carry no signal) and
the per-prompt pass rate that feeds the No-Positive-Resampling sampler.
"""
from __future__ import annotations

import torch


def zero_variance_mask(rewards: torch.Tensor) -> torch.Tensor:
    """Bool [num_prompts]: True where the group's rewards are not all equal (keep the prompt).

    Equality is exact: rewards shaped by a length penalty differ by small amounts that still
    produce a non-zero advantage, so no tolerance is applied.
    """
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2 or rewards.numel() == 0:
        shape = tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards)
        raise ValueError(f"rewards must be a non-empty [num_prompts, group_size] tensor, "
                         f"got {shape}")
    return rewards.amax(dim=1) != rewards.amin(dim=1)


def group_pass_rates(correct: torch.Tensor) -> torch.Tensor:
    """Float64 [num_prompts]: fraction of each prompt's G completions judged correct.

    ``correct`` [num_prompts, group_size] is bool (or 0/1); this is what
    ``NoPositiveResamplingSampler.update`` expects, not the (possibly shaped) reward.
    """
    if not isinstance(correct, torch.Tensor) or correct.dim() != 2 or correct.numel() == 0:
        shape = tuple(correct.shape) if isinstance(correct, torch.Tensor) else type(correct)
        raise ValueError(f"correct must be a non-empty [num_prompts, group_size] tensor, "
                         f"got {shape}")
    if correct.dtype != torch.bool and not ((correct == 0) | (correct == 1)).all():
        raise ValueError("correct must be bool or contain only 0 and 1; pass the verifier's "
                         "correctness, not the shaped reward")
    return correct.to(torch.float64).mean(dim=1)
