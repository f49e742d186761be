"""The ScaleRL algorithm core as pure tensor functions: advantages, zero-variance and verified
(no failed verifier) group filtering, policy losses (CISPO, DAPO/GRPO, GSPO) and the SFT
cross-entropy, loss aggregation with global denominators, the No-Positive-Resampling prompt
sampler, length control and the train / rollout mismatch corrections and metrics (off by
default). No Megatron, no processes: everything here is unit-tested with
hand-computed values on CPU.
"""
from megatron_rl.algorithms.advantages import NORMALIZATIONS, compute_advantages
from megatron_rl.algorithms.aggregation import (
    MODES,
    AggregationDenominators,
    aggregate_loss,
    token_weights,
)
from megatron_rl.algorithms.filtering import (
    group_keep_mask,
    group_pass_rates,
    verified_mask,
    zero_variance_mask,
)
from megatron_rl.algorithms.length_control import (
    INTERRUPTION_PHRASE,
    build_interrupted_completion,
    length_penalties,
    length_penalty,
    sample_thinking_budget,
)
from megatron_rl.algorithms.losses import (
    DEFAULT_CLIP_RANGE,
    KINDS,
    SFT_KIND,
    LossOutput,
    cispo_loss,
    clipped_surrogate_loss,
    compute_policy_loss,
    cross_entropy_loss,
    gspo_loss,
)
from megatron_rl.algorithms.mismatch import (
    MismatchCorrection,
    correction_weights,
    metrics_from_sums,
    mismatch_metrics,
    mismatch_sums,
)
from megatron_rl.algorithms.sampler import NoPositiveResamplingSampler

__all__ = [
    "DEFAULT_CLIP_RANGE",
    "INTERRUPTION_PHRASE",
    "KINDS",
    "MODES",
    "NORMALIZATIONS",
    "AggregationDenominators",
    "LossOutput",
    "MismatchCorrection",
    "NoPositiveResamplingSampler",
    "SFT_KIND",
    "aggregate_loss",
    "build_interrupted_completion",
    "cispo_loss",
    "clipped_surrogate_loss",
    "compute_advantages",
    "compute_policy_loss",
    "correction_weights",
    "cross_entropy_loss",
    "group_keep_mask",
    "group_pass_rates",
    "gspo_loss",
    "length_penalties",
    "length_penalty",
    "metrics_from_sums",
    "mismatch_metrics",
    "mismatch_sums",
    "sample_thinking_budget",
    "token_weights",
    "verified_mask",
    "zero_variance_mask",
]
