"""Length control: ScaleRL's forced interruption (draw a thinking budget, and when a generation
reaches it append a fixed phrase that closes the thinking section, then let the model answer)
and DAPO's overlong length penalty (kept for ablations). The interruption phrase is not sampled
by the policy, so its tokens get loss mask 0: their behaviour log-probs do not exist.
"""
from __future__ import annotations

import operator
import random
from collections.abc import Sequence

import torch

INTERRUPTION_PHRASE = ("Okay, time is up. Let me stop thinking and formulate a final answer now. "
                       "</think>")


def sample_thinking_budget(rng: random.Random, lo: int, hi: int) -> int:
    """A thinking budget drawn uniformly from the integers in [lo, hi] (ScaleRL: [10k, 12k] for
    a 12,288-token thinking budget). The caller owns ``rng`` so that budgets are reproducible."""
    if not isinstance(rng, random.Random):
        raise TypeError(f"rng must be a random.Random, got {type(rng).__name__}")
    if not (isinstance(lo, int) and isinstance(hi, int)) or not 0 < lo <= hi:
        raise ValueError(f"thinking budget range needs integers 0 < lo <= hi, got lo={lo!r}, "
                         f"hi={hi!r}")
    return rng.randint(lo, hi)


def build_interrupted_completion(thinking_ids: Sequence[int], phrase_ids: Sequence[int],
                                 solution_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """(token_ids, loss_mask) of thinking + interruption phrase + solution; the mask is 1 on
    policy-sampled tokens and 0 on the inserted phrase."""
    if len(phrase_ids) == 0:
        raise ValueError("phrase_ids is empty; tokenize INTERRUPTION_PHRASE with the policy's "
                         "tokenizer")
    thinking_ids = _token_ids("thinking_ids", thinking_ids)
    phrase_ids = _token_ids("phrase_ids", phrase_ids)
    solution_ids = _token_ids("solution_ids", solution_ids)
    token_ids = [*thinking_ids, *phrase_ids, *solution_ids]
    loss_mask = [1] * len(thinking_ids) + [0] * len(phrase_ids) + [1] * len(solution_ids)
    return token_ids, loss_mask


def _token_ids(name: str, ids: Sequence[int]) -> list[int]:
    try:
        ids = [operator.index(token) for token in ids]
    except TypeError:
        raise ValueError(f"{name} must be a sequence of integer token ids") from None
    if any(token < 0 for token in ids):
        raise ValueError(f"{name} holds negative token ids")
    return ids


def length_penalty(
    lengths: torch.Tensor | Sequence[int],
    correct: torch.Tensor | Sequence[bool],
    *,
    max_length: int,
    cache_length: int,
    only_correct: bool = True,
) -> torch.Tensor:
    """DAPO's overlong penalty, float32 [N], to add to the reward:
    clip((max_length - |y|) / cache_length - 1, -1, 0), i.e. 0 up to max_length - cache_length
    tokens, falling linearly to -1 at max_length and staying -1 beyond.

    |y| counts generated tokens (prompt and inserted phrase excluded). ScaleRL (SCALERL.md 5)
    applies it to correct answers only, so a wrong answer keeps its reward; ``only_correct=False``
    is the original DAPO, which penalises every answer.
    """
    lengths = torch.as_tensor(lengths)
    correct = torch.as_tensor(correct)
    if lengths.shape != correct.shape or lengths.dim() != 1:
        raise ValueError(f"lengths {tuple(lengths.shape)} and correct {tuple(correct.shape)} "
                         "must be 1-D tensors of the same shape (one entry per completion)")
    if lengths.is_floating_point() or (lengths.numel() and int(lengths.min()) < 0):
        raise ValueError("lengths must be non-negative integer token counts")
    if not 0 < cache_length <= max_length:
        raise ValueError(f"length penalty needs 0 < cache_length <= max_length, got "
                         f"cache_length={cache_length}, max_length={max_length}")
    penalty = ((max_length - lengths.double()) / cache_length - 1.0).clamp(-1.0, 0.0)
    if only_correct:
        penalty = torch.where(correct.bool(), penalty, torch.zeros_like(penalty))
    return penalty.float()


def length_penalties(groups: Sequence, algorithm) -> torch.Tensor:
    """DAPO's overlong penalty per sample [prompts x G, flat] of a step's groups for
    algorithm.length_penalty: generated tokens (the forced-interruption phrase excluded,
    SCALERL.md section 5) against length_penalty_max_length / _cache_length, on correct answers
    only; 0 elsewhere."""
    lengths = [sample.num_loss_tokens for group in groups for sample in group.samples]
    passed = [result.passed for group in groups for result in group.results]
    return length_penalty(lengths, passed, max_length=algorithm.length_penalty_max_length,
                          cache_length=algorithm.length_penalty_cache_length)
