"""Advantages and the zero-variance filter against hand-computed values (SCALERL.md section 4)."""
import math

import pytest
import torch

from megatron_rl.algorithms import compute_advantages, group_pass_rates, zero_variance_mask

pytestmark = pytest.mark.unit

# 3 prompts x 3 completions: prompt 0 has one correct of three (0/1 rewards), prompt 1 one of three
# (+1/-1 rewards), prompt 2 all correct (zero variance).
REWARDS = torch.tensor([[1.0, 0.0, 0.0],
                        [1.0, -1.0, -1.0],
                        [1.0, 1.0, 1.0]], dtype=torch.float64)
# Group means 1/3, -1/3, 1 -> centred advantages:
CENTRED = [[2 / 3, -1 / 3, -1 / 3],
           [4 / 3, -2 / 3, -2 / 3],
           [0.0, 0.0, 0.0]]


def _close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype),
                               rtol=0, atol=tol)


def test_no_normalization_is_group_centred():
    _close(compute_advantages(REWARDS, "none"), CENTRED)


def test_prompt_normalization_divides_by_group_sample_std():
    # Prompt 0: sample variance ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3 -> std 1/sqrt(3).
    # Prompt 1: ((4/3)^2 + 2 (2/3)^2) / 2 = 4/3 -> std 2/sqrt(3). Prompt 2: std 0, advantage 0.
    s3 = math.sqrt(3.0)
    expected = [[2 / 3 * s3, -1 / 3 * s3, -1 / 3 * s3],
                [4 / 3 * s3 / 2, -2 / 3 * s3 / 2, -2 / 3 * s3 / 2],
                [0.0, 0.0, 0.0]]
    _close(compute_advantages(REWARDS, "prompt", eps=0.0), expected)
    # The default eps only perturbs by ~1e-6 relative.
    _close(compute_advantages(REWARDS, "prompt"), expected, tol=1e-5)


def test_prompt_normalization_population_std():
    # Population variance of prompt 0: (4/9 + 1/9 + 1/9) / 3 = 2/9 -> std sqrt(2)/3.
    out = compute_advantages(REWARDS[:1], "prompt", eps=0.0, std_correction=0)
    std = math.sqrt(2.0) / 3
    _close(out, [[2 / 3 / std, -1 / 3 / std, -1 / 3 / std]])


def test_batch_normalization_excludes_dropped_prompts_from_std():
    keep = torch.tensor([True, True, False])
    # Kept advantages: 2/3, -1/3, -1/3, 4/3, -2/3, -2/3; mean 0, sum of squares 30/9 = 10/3,
    # sample variance (10/3) / 5 = 2/3.
    std = math.sqrt(2 / 3)
    expected = [[a / std for a in CENTRED[0]], [a / std for a in CENTRED[1]], [0.0, 0.0, 0.0]]
    _close(compute_advantages(REWARDS, "batch", keep=keep, eps=0.0), expected)
    # Without `keep` the three zeros of prompt 2 enter the std: variance (10/3) / 8 = 5/12.
    std_all = math.sqrt(5 / 12)
    expected_all = [[a / std_all for a in row] for row in CENTRED]
    _close(compute_advantages(REWARDS, "batch", eps=0.0), expected_all)


def test_dropped_prompt_with_signal_gets_zero_advantage():
    keep = torch.tensor([False, True, True])
    out = compute_advantages(REWARDS, "none", keep=keep)
    _close(out, [[0.0, 0.0, 0.0], CENTRED[1], CENTRED[2]])
    # Batch std over prompt 1 (and prompt 2's zeros): sum of squares 24/9, 5 dof -> 8/15.
    std = math.sqrt(8 / 15)
    _close(compute_advantages(REWARDS, "batch", keep=keep, eps=0.0),
           [[0.0, 0.0, 0.0], [a / std for a in CENTRED[1]], [0.0, 0.0, 0.0]])


def test_all_prompts_dropped_gives_zeros_not_nan():
    keep = torch.tensor([False, False, False])
    for normalization in ("none", "prompt", "batch"):
        out = compute_advantages(REWARDS, normalization, keep=keep)
        assert torch.equal(out, torch.zeros_like(REWARDS))


def test_float32_rewards_keep_their_dtype():
    out = compute_advantages(REWARDS.float(), "batch", keep=zero_variance_mask(REWARDS))
    assert out.dtype == torch.float32
    _close(out, [[a / math.sqrt(2 / 3) for a in CENTRED[0]],
                 [a / math.sqrt(2 / 3) for a in CENTRED[1]], [0.0, 0.0, 0.0]], tol=1e-5)


def test_advantage_input_errors():
    with pytest.raises(ValueError, match=r"'zscore'.*\('none', 'prompt', 'batch'\)"):
        compute_advantages(REWARDS, "zscore")
    with pytest.raises(ValueError, match=r"\[num_prompts, group_size\].*\(9,\)"):
        compute_advantages(REWARDS.reshape(-1), "none")
    with pytest.raises(TypeError, match="floating-point"):
        compute_advantages(torch.ones(2, 3, dtype=torch.int64), "none")
    with pytest.raises(ValueError, match=r"keep must be a bool tensor.*\(3,\).*\(2,\)"):
        compute_advantages(REWARDS, "none", keep=torch.tensor([True, False]))
    with pytest.raises(ValueError, match="group_size > 1"):
        compute_advantages(torch.ones(4, 1), "prompt")
    with pytest.raises(ValueError, match="NaN or inf"):
        compute_advantages(torch.tensor([[1.0, float("nan")]]), "none")
    with pytest.raises(ValueError, match="eps must be >= 0"):
        compute_advantages(REWARDS, "none", eps=-1.0)


def test_zero_variance_mask():
    rewards = torch.tensor([[1.0, 0.0, 0.0],
                            [1.0, 1.0, 1.0],
                            [0.0, 0.0, 0.0],
                            [-1.0, -1.0, 1.0],
                            [0.5, 0.5, 0.5 - 1e-9]],  # a length penalty makes tiny differences
                           dtype=torch.float64)
    assert zero_variance_mask(rewards).tolist() == [True, False, False, True, True]
    with pytest.raises(ValueError, match=r"\[num_prompts, group_size\]"):
        zero_variance_mask(torch.ones(3))


def test_group_pass_rates():
    correct = torch.tensor([[True, False, False], [True, True, True], [False, False, False]])
    assert group_pass_rates(correct).tolist() == [1 / 3, 1.0, 0.0]
    assert group_pass_rates(correct.int()).tolist() == [1 / 3, 1.0, 0.0]
    with pytest.raises(ValueError, match="only 0 and 1"):
        group_pass_rates(torch.tensor([[1.0, -1.0]]))
