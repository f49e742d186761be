"""Groups with a failed verification (NaN reward) are dropped like zero-variance groups: out of
the loss and out of the batch std, leaving every other advantage exactly as if the group had never
been sampled (hand-computed values)."""
import math

import pytest
import torch

import megatron_rl.algorithms as alg

pytestmark = pytest.mark.unit

NAN = math.nan
# 4 prompts x 4 completions: prompt 1's second sample failed verification; prompt 2 has zero
# variance.
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0],
                        [1.0, NAN, 0.0, 0.0],
                        [0.0, 0.0, 0.0, 0.0],
                        [1.0, 0.0, 1.0, 1.0]], dtype=torch.float64)


def _close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype),
                               rtol=0, atol=tol)


def test_failed_group_is_dropped_like_a_zero_variance_group():
    assert alg.verified_mask(REWARDS).tolist() == [True, False, True, True]
    assert alg.zero_variance_mask(REWARDS).tolist() == [True, False, False, True]
    assert alg.group_keep_mask(REWARDS).tolist() == [True, False, False, True]
    assert alg.group_keep_mask(REWARDS, zero_variance_filter=False).tolist() == [
        True, False, True, True]  # the failed group is dropped whatever the filter setting
    with pytest.raises(ValueError, match=r"\[num_prompts, group_size\]"):
        alg.verified_mask(torch.ones(3))


def test_advantages_unaffected_by_the_dropped_group():
    keep = alg.group_keep_mask(REWARDS)
    # Prompt 0: mean 1/2 -> [1/2, -1/2, -1/2, 1/2]; prompt 3: mean 3/4 -> [1/4, -3/4, 1/4, 1/4].
    # Batch std (sample, n - 1 = 7) of those 8 values: sqrt((4/4 + 3/16 + 9/16) / 7) = 1/2.
    batch = alg.compute_advantages(REWARDS, "batch", keep=keep, eps=0.0)
    _close(batch, [[1.0, -1.0, -1.0, 1.0], [0.0] * 4, [0.0] * 4, [0.5, -1.5, 0.5, 0.5]])
    # Prompt std: prompt 0 sqrt(1/3) -> +-sqrt(3)/2; prompt 3 sqrt((3/16 + 9/16) / 3) = 1/2.
    prompt = alg.compute_advantages(REWARDS, "prompt", keep=keep, eps=0.0)
    s = math.sqrt(3) / 2
    _close(prompt, [[s, -s, -s, s], [0.0] * 4, [0.0] * 4, [0.5, -1.5, 0.5, 0.5]])
    # The same as a batch in which the failed prompt was never sampled.
    without = alg.compute_advantages(REWARDS[[0, 2, 3]], "batch",
                                     keep=alg.zero_variance_mask(REWARDS[[0, 2, 3]]), eps=0.0)
    _close(batch[[0, 2, 3]], without.tolist())


def test_without_the_zero_variance_filter_only_the_failed_group_leaves_the_batch_std():
    keep = alg.group_keep_mask(REWARDS, zero_variance_filter=False)
    # 12 kept values (prompt 2's four zeros join): sqrt(7/4 / 11) = sqrt(7/44).
    out = alg.compute_advantages(REWARDS, "batch", keep=keep, eps=0.0)
    d = math.sqrt(7 / 44)
    _close(out, [[0.5 / d, -0.5 / d, -0.5 / d, 0.5 / d], [0.0] * 4, [0.0] * 4,
                 [0.25 / d, -0.75 / d, 0.25 / d, 0.25 / d]])
    assert torch.isfinite(alg.compute_advantages(REWARDS, "none", keep=keep)).all()


def test_a_kept_group_with_a_failed_sample_is_refused():
    with pytest.raises(ValueError, match=r"kept prompts \[1\].*group_keep_mask"):
        alg.compute_advantages(REWARDS, "batch")
    with pytest.raises(ValueError, match=r"kept prompts \[1\]"):
        alg.compute_advantages(REWARDS, "none", keep=torch.tensor([True, True, False, True]))
