"""Train / rollout mismatch corrections (token-level TIS, sequence masking by the geometric-mean
ratio, token masking) and metrics (algorithms/mismatch.py) against hand-computed values.

One batch throughout: two completions, sample_index [0, 0, 1, 1, 1], ratios
r = pi_train / pi_gen = [1/4, 1, 4, 2, 1/2]; completion 0's geometric mean is
sqrt(1/4 * 1) = 1/2, completion 1's is (4 * 2 * 1/2)^(1/3) = 4^(1/3) ~ 1.587."""
import math

import pytest
import torch

from megatron_rl.algorithms import MismatchCorrection, correction_weights, mismatch_metrics
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
