"""Train / rollout mismatch corrections (token-level TIS, sequence masking by the geometric-mean
ratio, token masking) and metrics (algorithms/mismatch.py) against hand-computed values.

One batch throughout: two completions, sample_index [0, 0, 1, 1, 1], ratios
r = pi_train / pi_gen = [1/4, 1, 4, 2, 1/2]; completion 0's geometric mean is
sqrt(1/4 * 1) = 1/2, completion 1's is (4 * 2 * 1/2)^(1/3) = 4^(1/3) ~ 1.587."""
import math

import pytest
import torch

from megatron_rl.algorithms import (MismatchCorrection, correction_weights, metrics_from_sums,
                                    mismatch_metrics, mismatch_sums)
from megatron_rl.algorithms.mismatch import sequence_keep, token_keep, truncated_is_weight

pytestmark = pytest.mark.unit

F64 = torch.float64
RATIOS = [0.25, 1.0, 4.0, 2.0, 0.5]
GEN = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5], dtype=F64)
TRAIN = GEN + torch.log(torch.tensor(RATIOS, dtype=F64))
SAMPLES = torch.tensor([0, 0, 1, 1, 1])


def _eq(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), rtol=1e-12,
                               atol=1e-12)


def test_truncated_is_weight_caps_the_ratio():
    _eq(truncated_is_weight(TRAIN, GEN, cap=2.0), [0.25, 1.0, 2.0, 2.0, 0.5])
    # A masked token (no generator log-prob: NaN) weighs 1 and stays finite.
    gen = GEN.clone()
    gen[2] = float("nan")
    mask = torch.tensor([1, 1, 0, 1, 1])
    _eq(truncated_is_weight(TRAIN, gen, cap=2.0, loss_mask=mask), [0.25, 1.0, 1.0, 2.0, 0.5])
    # Far off-policy: the log-ratio is clamped at 20 as in the losses, no inf.
    _eq(truncated_is_weight(torch.tensor([30.0], dtype=F64), torch.tensor([0.0], dtype=F64),
                            cap=1e12), [math.exp(20.0)])


def test_token_window_keeps_ratios_inside_the_bounds():
    assert token_keep(TRAIN, GEN, window=(0.4, 2.5)).tolist() == [False, True, False, True, True]
    assert token_keep(TRAIN, GEN, window=(0.2, 5.0)).all()


def test_sequence_window_on_the_geometric_mean():
    # 0.6 <= 1/2? no: completion 0 dropped; 4^(1/3) = 1.587 <= 1.6: completion 1 kept.
    assert sequence_keep(TRAIN, GEN, SAMPLES, window=(0.6, 1.6)).tolist() == \
        [False, False, True, True, True]
    # 1.5 < 1.587: completion 1 dropped; 0.45 <= 1/2 keeps completion 0.
    assert sequence_keep(TRAIN, GEN, SAMPLES, window=(0.45, 1.5)).tolist() == \
        [True, True, False, False, False]
    # Masking token 2 (r = 4) leaves completion 1 with sqrt(2 * 1/2) = 1: kept.
    mask = torch.tensor([1, 1, 0, 1, 1])
    assert sequence_keep(TRAIN, GEN, SAMPLES, window=(0.6, 1.5),
                         loss_mask=mask).tolist() == [False, False, True, True, True]
    # A completion split over calls: its whole-sequence mean log-ratio is given.
    whole = torch.tensor([0.0, 0.0, math.log(3.0), math.log(3.0), math.log(3.0)], dtype=F64)
    assert sequence_keep(TRAIN, GEN, SAMPLES, window=(0.5, 2.0),
                         sequence_log_ratio=whole).tolist() == [True, True, False, False, False]


def test_correction_weights_combine_tis_and_both_masks():
    correction = MismatchCorrection(tis_cap=2.0, token_window=(0.4, 2.5),
                                    sequence_window=(0.6, 1.6))
    train = TRAIN.clone().requires_grad_(True)
    weight, tokens, sequences = correction_weights("dapo", correction, train_logp=train,
                                                   gen_logp=GEN, sample_index=SAMPLES)
    # min(r, 2) = [1/4, 1, 2, 2, 1/2]; tokens in [0.4, 2.5]: [F, T, F, T, T];
    # sequences [F, F, T, T, T].
    _eq(weight, [0.0, 0.0, 0.0, 2.0, 0.5])
    assert not weight.requires_grad
    assert tokens.tolist() == [False, True, False, True, True]
    assert sequences.tolist() == [False, False, True, True, True]
    # The weight multiplies a loss: masked tokens contribute 0, the rest scale by min(r, C).
    token_loss = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=F64)
    assert float((token_loss * weight).sum()) == pytest.approx(4 * 2.0 + 5 * 0.5)


def test_defaults_change_nothing_and_cispo_refuses_tis():
    assert not MismatchCorrection().enabled
    weight, tokens, sequences = correction_weights("cispo", MismatchCorrection(),
                                                   train_logp=TRAIN, gen_logp=GEN,
                                                   sample_index=SAMPLES)
    _eq(weight, [1.0] * 5)
    assert tokens.all() and sequences.all()
    # Masks apply to CISPO too; TIS does not (its ratio is against pi_gen already).
    weight, _, _ = correction_weights("cispo", MismatchCorrection(token_window=(0.4, 2.5)),
                                      train_logp=TRAIN, gen_logp=GEN, sample_index=SAMPLES)
    _eq(weight, [0.0, 1.0, 0.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="already what 'cispo' does"):
        correction_weights("cispo", MismatchCorrection(tis_cap=2.0), train_logp=TRAIN,
                           gen_logp=GEN, sample_index=SAMPLES)


@pytest.mark.parametrize("kwargs, match", [
    ({"tis_cap": 0.0}, "tis_cap must be a finite number > 0"),
    ({"tis_cap": float("inf")}, "tis_cap must be a finite number > 0"),
    ({"token_window": (1.2, 2.0)}, "0 <= low < 1 < high"),
    ({"sequence_window": (0.5, 0.9)}, "0 <= low < 1 < high"),
])
def test_settings_refuse_windows_that_exclude_ratio_one(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MismatchCorrection(**kwargs)


def test_metrics_hand_computed():
    tokens = torch.tensor([False, True, False, True, True])
    sequences = torch.tensor([False, False, True, True, True])
    out = mismatch_metrics(TRAIN, GEN, sample_index=SAMPLES, token_kept=tokens,
                           sequence_kept=sequences, quantiles=(0.1, 0.5, 0.75))
    # log r = [-ln 4, 0, ln 4, ln 2, -ln 2] sums to 0: k1 = 0. k3 = mean(r - 1) - mean(log r)
    # = (7.75 - 5) / 5 = 0.55.
    assert out["mismatch/kl_k1"] == pytest.approx(0.0, abs=1e-12)
    assert out["mismatch/kl_k3"] == pytest.approx(0.55, abs=1e-12)
    # Sorted r = [1/4, 1/2, 1, 2, 4]: p10 at position 0.4 -> 1/4 + 0.4 * 1/4 = 0.35; p50 = 1;
    # p75 at position 3 -> 2.
    assert out["mismatch/ratio_p10"] == pytest.approx(0.35, abs=1e-12)
    assert out["mismatch/ratio_p50"] == pytest.approx(1.0, abs=1e-12)
    assert out["mismatch/ratio_p75"] == pytest.approx(2.0, abs=1e-12)
    # Kept by both: tokens 3 and 4 of 5; completion 0 of 2 dropped.
    assert out["mismatch/masked_token_fraction"] == pytest.approx(0.6)
    assert out["mismatch/masked_sequence_fraction"] == pytest.approx(0.5)


def test_metrics_skip_masked_tokens():
    gen = GEN.clone()
    gen[2] = float("nan")  # a masked token without a generator log-prob
    out = mismatch_metrics(TRAIN, gen, loss_mask=torch.tensor([1, 1, 0, 1, 1]))
    # r = [1/4, 1, 2, 1/2]: k1 = -mean(log r) = ln 4 / 4; k3 = ((3.75 - 4) + ln 4) / 4.
    assert out["mismatch/kl_k1"] == pytest.approx(math.log(4) / 4, abs=1e-12)
    assert out["mismatch/kl_k3"] == pytest.approx((-0.25 + math.log(4)) / 4, abs=1e-12)
    assert out["mismatch/masked_token_fraction"] == 0.0
    assert "mismatch/masked_sequence_fraction" not in out
    assert mismatch_metrics(TRAIN, GEN, loss_mask=torch.zeros(5)) == {}


def test_sums_add_up_over_calls_and_read_as_the_metrics():
    """The trainer's path: per-call sums (here completion 1 split over two calls, as over
    context-parallel ranks, counted by its whole token count) added up, then read."""
    from megatron_rl.algorithms.mismatch import NUM_SUMS

    tokens = torch.tensor([False, True, False, True, True])
    sequences = torch.tensor([False, False, True, True, True])
    whole_counts = torch.tensor([2, 2, 3, 3, 3])
    parts = [slice(0, 3), slice(3, 5)]
    sums = sum(mismatch_sums(TRAIN[p], GEN[p], SAMPLES[p], completion_num_tokens=whole_counts[p],
                             token_kept=tokens[p], sequence_kept=sequences[p]) for p in parts)
    assert sums.shape == (NUM_SUMS,) and float(sums[6:].sum()) == 5  # every token in one bin
    out = metrics_from_sums(sums, quantiles=(0.0, 0.5, 0.75, 1.0))
    # As test_metrics_hand_computed: k1 = 0, k3 = 0.55; masked tokens 3 of 5, completions 1 of 2.
    assert out["mismatch/kl_k1"] == pytest.approx(0.0, abs=1e-12)
    assert out["mismatch/kl_k3"] == pytest.approx(0.55, abs=1e-12)
    assert out["mismatch/masked_token_fraction"] == pytest.approx(0.6, abs=1e-12)
    assert out["mismatch/masked_sequence_fraction"] == pytest.approx(0.5, abs=1e-12)
    # Sorted r = [1/4, 1/2, 1, 2, 4]; at whole positions the histogram gives the value within
    # its bin (1 % of a decade of |log r|: 2.3 %), and r = 1 sits in the bin around log r = 0.
    for name, r in (("p00", 0.25), ("p75", 2.0), ("p100", 4.0)):
        log_r = math.log(out[f"mismatch/ratio_{name}"])
        assert log_r == pytest.approx(math.log(r), rel=0.024), name
    assert out["mismatch/ratio_p50"] == pytest.approx(1.0, abs=1e-6)
    assert metrics_from_sums(torch.zeros(NUM_SUMS)) == {}


def test_histogram_quantiles_follow_torch_quantile():
    """Many tokens with FP8-like mismatches (log r ~ N(0, 0.02), a few far off): the histogram's
    p01 / p50 / p99 within a bin of torch.quantile's; the default names."""
    gen = torch.Generator().manual_seed(0)
    log_r = torch.randn(20000, generator=gen, dtype=F64) * 0.02
    log_r[:20] = torch.linspace(-6.0, 3.0, 20, dtype=F64)
    gen_logp = -torch.rand(20000, generator=gen, dtype=F64) * 5
    sums = mismatch_sums(gen_logp + log_r, gen_logp, torch.arange(20000) // 100)
    out = metrics_from_sums(sums)
    exact = torch.quantile(log_r, torch.tensor([0.01, 0.5, 0.99], dtype=F64)).tolist()
    for name, expected in zip(("ratio_p01", "ratio_p50", "ratio_p99"), exact):
        got = math.log(out[f"mismatch/{name}"])
        assert abs(got - expected) <= 0.024 * abs(expected) + 1e-6, (name, got, expected)
    assert out["mismatch/kl_k1"] == pytest.approx(float(-log_r.mean()), rel=1e-9)
    assert out["mismatch/kl_k3"] == pytest.approx(float((log_r.exp() - 1 - log_r).mean()),
                                                  rel=1e-9)
    assert out["mismatch/masked_token_fraction"] == 0.0
    assert out["mismatch/masked_sequence_fraction"] == 0.0


def test_sums_keep_a_bf16_sized_mismatch_of_float32_logprobs():
    """A 1e-6 mismatch (BF16 serving against the trainer) between float32 log-probs: k1 and k3
    from the float64 differences (exp then log in float32 would round r to 1.2e-7 steps)."""
    gen = torch.Generator().manual_seed(1)
    gen_logp = -5 * torch.rand(4000, generator=gen)
    train_logp = gen_logp + 1e-6 * torch.randn(4000, generator=gen)
    log_r = train_logp.double() - gen_logp.double()
    out = metrics_from_sums(mismatch_sums(train_logp, gen_logp, torch.zeros(4000, dtype=int)))
    assert out["mismatch/kl_k1"] == pytest.approx(float(-log_r.mean()), rel=1e-9, abs=0)
    assert out["mismatch/kl_k3"] == pytest.approx(float((log_r ** 2 / 2).mean()), rel=1e-4)


def test_sums_of_a_non_finite_step_are_nan_not_an_error():
    """A step whose log-probs are NaN (the trainer skips it and counts it: nan_loss chaos, the
    dist non-finite test) gives NaN KL sums and leaves the NaN token out of the histogram;
    bucketize would put it one bin past the end and the histogram's index_add raise."""
    from megatron_rl.algorithms.mismatch import NUM_SUMS

    train = torch.tensor([-1.0, float("nan"), -2.0])
    gen = torch.tensor([-1.0, -1.0, -2.0])
    sums = mismatch_sums(train, gen, torch.tensor([0, 0, 1]))
    assert sums.shape == (NUM_SUMS,) and float(sums[0]) == 3  # every loss token counted
    assert math.isnan(float(sums[1])) and math.isnan(float(sums[2]))
    assert float(sums[6:].sum()) == 2  # the two finite tokens, in the bin around log r = 0
