"""Length control: thinking-budget draws, forced-interruption masks, DAPO length penalty
(SCALERL.md section 5)."""
import random

import pytest
import torch

from megatron_rl.algorithms import (
    INTERRUPTION_PHRASE,
    build_interrupted_completion,
    length_penalty,
    sample_thinking_budget,
)

pytestmark = pytest.mark.unit


def test_thinking_budget_is_uniform_integer_in_range():
    rng = random.Random(0)
    draws = [sample_thinking_budget(rng, 10, 12) for _ in range(600)]
    assert set(draws) == {10, 11, 12}
    # Uniform: each of the 3 values about 200 times (binomial sd ~ 11.5; bounds at ~6 sd).
    assert all(130 < draws.count(v) < 270 for v in (10, 11, 12))
    rng_again = random.Random(0)
    assert [sample_thinking_budget(rng_again, 10, 12) for _ in range(600)] == draws
    assert sample_thinking_budget(random.Random(1), 10_240, 10_240) == 10_240


def test_thinking_budget_errors():
    with pytest.raises(ValueError, match="0 < lo <= hi"):
        sample_thinking_budget(random.Random(0), 12, 10)
    with pytest.raises(ValueError, match="0 < lo <= hi"):
        sample_thinking_budget(random.Random(0), 0, 10)
    with pytest.raises(TypeError, match="random.Random"):
        sample_thinking_budget(0, 1, 2)


def test_interrupted_completion_masks_the_phrase():
    token_ids, loss_mask = build_interrupted_completion([5, 6, 7], [100, 101], [8, 9])
    assert token_ids == [5, 6, 7, 100, 101, 8, 9]
    assert loss_mask == [1, 1, 1, 0, 0, 1, 1]
    token_ids, loss_mask = build_interrupted_completion([], [100], [])
    assert (token_ids, loss_mask) == ([100], [0])
    assert INTERRUPTION_PHRASE.endswith("</think>") and INTERRUPTION_PHRASE.startswith("Okay")
    with pytest.raises(ValueError, match="phrase_ids is empty"):
        build_interrupted_completion([1], [], [2])
    with pytest.raises(ValueError, match="solution_ids must be a sequence of integer"):
        build_interrupted_completion([1], [2], [3.5])
    with pytest.raises(ValueError, match="thinking_ids holds negative"):
        build_interrupted_completion([-1], [2], [3])


def test_length_penalty_values():
    # max_length 14, cache 4: free up to 10 tokens, then -1/4 per token, -1 at 14 and beyond.
    lengths = torch.tensor([5, 10, 11, 13, 14, 20])
    correct = torch.tensor([True] * 6)
    penalty = length_penalty(lengths, correct, max_length=14, cache_length=4)
    assert penalty.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    # Wrong answers keep their reward (ScaleRL); the original DAPO penalises them too.
    wrong = torch.tensor([False] * 6)
    assert length_penalty(lengths, wrong, max_length=14, cache_length=4).tolist() == [0.0] * 6
    assert length_penalty(lengths, wrong, max_length=14, cache_length=4,
                          only_correct=False).tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    # Paper values L_max 14k, L_cache 2k: 13,000 tokens -> (1000 / 2000) - 1 = -0.5.
    assert length_penalty([13_000, 12_000], [True, True], max_length=14_000,
                          cache_length=2_000).tolist() == [-0.5, 0.0]
    assert penalty.dtype == torch.float32


def test_length_penalty_errors():
    with pytest.raises(ValueError, match="same shape"):
        length_penalty([1, 2], [True], max_length=4, cache_length=2)
    with pytest.raises(ValueError, match="0 < cache_length <= max_length"):
        length_penalty([1], [True], max_length=4, cache_length=0)
    with pytest.raises(ValueError, match="non-negative integer"):
        length_penalty([1.5], [True], max_length=4, cache_length=2)
