"""The mismatch corrections and metrics in the trainer's loss (trainer/step.py `_loss`) on a
hand-computed micro-batch: one prompt, completions of 3 and 2 loss tokens with advantages -0.5
and 1, ratios r = pi_train / pi_gen = [4, 2, 1/2, 1/4, 1] (as tests/unit/test_alg_mismatch.py),
prompt aggregation (one prompt: each token weighs 1/5). Loss and d loss / d logp against the hand
values; the statistics the step reduces, read as the metrics."""
import math

import pytest
import torch

from megatron_rl.algorithms import (AggregationDenominators, MismatchCorrection,
                                    metrics_from_sums)
from megatron_rl.trainer import LossSettings, TrainBatch, pack_micro_batches
from megatron_rl.trainer.step import _STATS, _loss

pytestmark = pytest.mark.unit

RATIOS = [4.0, 2.0, 0.5, 0.25, 1.0]
ADVANTAGES = [-0.5, -0.5, -0.5, 1.0, 1.0]  # per loss token
GEN = [-0.5, -3.0, -1.5, -1.0, -2.0]


def _step(settings: LossSettings):
    """(loss, d loss / d logp [5], statistics by name, mismatch metrics)."""
    batch = TrainBatch(
        token_ids=[torch.tensor([7, 10, 11, 12]), torch.tensor([7, 8, 9])],
        loss_mask=[torch.tensor([0, 1, 1, 1]), torch.tensor([0, 1, 1])],
        old_logprobs=[torch.tensor([0.0, -0.5, -3.0, -1.5]), torch.tensor([0.0, -1.0, -2.0])],
        advantages=torch.tensor([-0.5, 1.0]), prompt_ids=torch.tensor([0, 0]),
        sample_ids=torch.tensor([0, 1]))
    (micro_batch,) = pack_micro_batches(batch, [0, 1], max_tokens=100)
    mask = micro_batch.loss_mask
    assert micro_batch.sample_index[mask].tolist() == [0, 0, 0, 1, 1]
    gen = micro_batch.old_logprobs[mask]
    assert gen.tolist() == GEN
    logp = (gen + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    denominators = AggregationDenominators.from_sample_token_counts(
        batch.sample_num_loss_tokens(), batch.prompt_of_sample())
    loss, _, reduced = _loss(micro_batch, logp, denominators=denominators, settings=settings)
    loss.backward()
    stats = dict(zip(_STATS, reduced["stats"][:len(_STATS)].tolist()))
    return float(loss), logp.grad.tolist(), stats, metrics_from_sums(
        reduced["stats"][len(_STATS):])


def _close(actual, expected):
    assert actual == pytest.approx(expected, abs=1e-6), (actual, expected)


def test_token_and_sequence_masks_drop_tokens_from_cispo():
    """Tokens kept: r in [0.4, 2.5] -> [F, T, T, F, T]; completions kept: geometric mean
    (4^(1/3) and 1/2) in [0.6, 1.6] -> completion 0 only. Kept: tokens 1 and 2 (r = 2, 1/2),
    CISPO's -min(r, 5) A logp / 5 each; the dropped ones give 0 and the divisor stays 5."""
    correction = MismatchCorrection(token_window=(0.4, 2.5), sequence_window=(0.6, 1.6))
    loss, grad, stats, metrics = _step(LossSettings(kind="cispo", aggregation="prompt",
                                                    mismatch=correction))
    logp = [g + math.log(r) for g, r in zip(GEN, RATIOS)]
    _close(loss, (-2.0 * -0.5 * logp[1] - 0.5 * -0.5 * logp[2]) / 5)
    _close(grad, [0.0, 2.0 * 0.5 / 5, 0.5 * 0.5 / 5, 0.0, 0.0])
    assert stats["num_loss_tokens"] == 5
    _close(metrics["mismatch/masked_token_fraction"], 3 / 5)
    _close(metrics["mismatch/masked_sequence_fraction"], 1 / 2)
    _close(metrics["mismatch/kl_k1"], 0.0)  # log r sums to 0
    _close(metrics["mismatch/kl_k3"], 0.55)  # mean(r - 1 - log r) = (7.75 - 5) / 5


def test_corrections_off_leave_cispo_unchanged_and_still_measure():
    loss, grad, stats, metrics = _step(LossSettings(kind="cispo", aggregation="prompt"))
    _close(grad, [-min(r, 5.0) * a / 5 for r, a in zip(RATIOS, ADVANTAGES)])
    _close(stats["ratio"], sum(RATIOS))
    assert metrics["mismatch/masked_token_fraction"] == 0.0
    _close(metrics["mismatch/kl_k3"], 0.55)


@pytest.mark.parametrize("kind", ["dapo", "grpo"])
def test_tis_weighs_the_surrogate_taken_against_the_trainers_old_logprobs(kind):
    """With tis_cap = 2 the surrogate's ratio is against this forward's own log-probs (value 1,
    no clip binds) and each token is weighed by min(r, 2) = [2, 2, 1/2, 1/4, 1]: loss
    sum(-A min(r, 2)) / 5 = 0.2 and gradient -A min(r, 2) / 5, which is CISPO's at eps_max = 2.
    The step's ratio statistics stay against the generator; 'clipped' counts r > 2."""
    loss, grad, stats, _ = _step(LossSettings(kind=kind, aggregation="prompt",
                                              mismatch=MismatchCorrection(tis_cap=2.0)))
    weights = [min(r, 2.0) for r in RATIOS]
    _close(loss, sum(-a * w for a, w in zip(ADVANTAGES, weights)) / 5)
    _close(grad, [-a * w / 5 for a, w in zip(ADVANTAGES, weights)])
    _, cispo_grad, _, _ = _step(LossSettings(kind="cispo", aggregation="prompt", eps_max=2.0))
    _close(grad, cispo_grad)
    _close(stats["ratio"], sum(RATIOS))
    _close(stats["abs_logp_diff"], sum(abs(math.log(r)) for r in RATIOS))
    assert stats["num_clipped"] == 1  # r = 4


def test_tis_on_gspo_keeps_the_sequence_ratio_at_one():
    """GSPO + TIS: sequence ratio against the trainer's own log-probs = 1 (inside the clip), so
    the token gradient is -A min(r, 2) / 5 as for DAPO."""
    loss, grad, _, _ = _step(LossSettings(kind="gspo", aggregation="prompt",
                                          mismatch=MismatchCorrection(tis_cap=2.0)))
    _close(grad, [-a * min(r, 2.0) / 5 for r, a in zip(RATIOS, ADVANTAGES)])


def test_step_metrics_reach_the_train_scalars():
    """The step's mismatch metrics become TensorBoard train/mismatch/* scalars (metrics.py), from
    the trainer's StepMetrics and from the simulated cluster's mirror of it alike."""
    import dataclasses

    from megatron_rl.metrics import RunMetrics
    from megatron_rl.simulation.cluster import SimulatedStepMetrics
    from megatron_rl.trainer import StepMetrics

    assert {f.name for f in dataclasses.fields(SimulatedStepMetrics)} == {
        f.name for f in dataclasses.fields(StepMetrics)}
    _, _, _, metrics = _step(LossSettings(kind="cispo", aggregation="prompt"))
    step = SimulatedStepMetrics(
        step=1, loss=0.0, grad_norm=0.0, clip_fraction=0.0, mean_ratio=1.0, logp_mismatch=0.0,
        logp_mismatch_max=0.0, entropy=0.0, num_loss_tokens=5, num_tokens=7,
        num_micro_batches=1, learning_rate=1e-6, skipped=False, num_skipped_steps=0,
        mismatch=metrics)
    scalars = RunMetrics.train(step, 1.0)
    assert {name for name in scalars if name.startswith("train/mismatch/")} == {
        "train/mismatch/kl_k1", "train/mismatch/kl_k3", "train/mismatch/ratio_p01",
        "train/mismatch/ratio_p50", "train/mismatch/ratio_p99",
        "train/mismatch/masked_token_fraction", "train/mismatch/masked_sequence_fraction"}
    _close(scalars["train/mismatch/kl_k3"], 0.55)
