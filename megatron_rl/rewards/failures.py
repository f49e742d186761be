"""Accounting for verifier failures: samples whose verifier (sandbox, math worker, scorer) failed
even after the retry in `RewardRegistry.score_many` get no reward, and their whole group is
dropped from the batch like a zero-variance group (megatron_rl/algorithms/filtering.py). This
module turns results into the float rewards those filters read (NaN = failed), counts what was
dropped and why for TensorBoard, and stops the run when the verifier fails on more than
`algorithm.max_verifier_failure_fraction` of the samples scored so far in the run.

The fraction is cumulative over the run (not per batch), so one unlucky batch does not end a
week-long run while a persistent outage does. The price: late in a long run a full outage takes a
while to cross the threshold; in the meantime its batches drop every group and so train on
nothing. Keep the counter's `state_dict` in the checkpoint so that a resumed run keeps measuring
the same fraction.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from megatron_rl.rewards.types import VERIFIER_FAILURES, RewardResult

_MAX_REASONS_IN_ERROR = 3


class VerifierFailureError(RuntimeError):
    """The verifier failed on more than the allowed fraction of the run's samples."""


def reward_values(results: Sequence[RewardResult]) -> list[float]:
    """One float per result, NaN where the verifier failed: reshape to [prompts, G] for
    `verified_mask` / `group_keep_mask` (megatron_rl.algorithms)."""
    return [math.nan if r.reward is None else float(r.reward) for r in results]


class VerifierFailureCounter:
    """Counts scored and failed samples (after retries) and dropped groups; `update` raises
    `VerifierFailureError` when failures exceed `max_failure_fraction` of all samples so far."""

    def __init__(self, max_failure_fraction: float = 0.05) -> None:
        if not 0.0 <= max_failure_fraction <= 1.0:
            raise ValueError("algorithm.max_verifier_failure_fraction must be in [0, 1], got "
                             f"{max_failure_fraction!r}")
        self.max_failure_fraction = float(max_failure_fraction)
        self.num_samples = 0         # scored so far in the run
        self.num_failed = 0          # of those, verifier failures (after retries)
        self.failures_by_reason: Counter[str] = Counter()
        self.example_detail: dict[str, str] = {}  # the latest detail per reason
        self._last_batch: dict[str, float] = self._batch_metrics(0, 0, Counter())

    @classmethod
    def from_run_config(cls, run: Any) -> VerifierFailureCounter:
        """From a `megatron_rl.config.RunConfig` (reads algorithm.max_verifier_failure_fraction)."""
        return cls(run.algorithm.max_verifier_failure_fraction)

    @property
    def failure_fraction(self) -> float:
        return self.num_failed / self.num_samples if self.num_samples else 0.0

    def update(self, results: Sequence[RewardResult], group_size: int) -> None:
        """Count one batch of final results (after retries), consecutive `group_size` samples
        forming a prompt's group; then raise if the run's failure fraction is over the limit."""
        if group_size < 1 or len(results) % group_size:
            raise ValueError(f"{len(results)} results do not split into groups of {group_size}")
        failed = [r.verifier_failed for r in results]
        reasons = Counter(str(r.reason) for r in results if r.verifier_failed)
        for r in results:
            if r.verifier_failed:
                self.example_detail[str(r.reason)] = r.detail
        num_dropped_groups = sum(any(failed[i:i + group_size])
                                 for i in range(0, len(failed), group_size))
        self.num_samples += len(results)
        self.num_failed += sum(failed)
        self.failures_by_reason.update(reasons)
        self._last_batch = self._batch_metrics(sum(failed), num_dropped_groups, reasons)
        if self.failure_fraction > self.max_failure_fraction:
            raise VerifierFailureError(self._message())

    def rewards_of(self, groups: Sequence, group_size: int):
        """[prompts, G] rewards of a step's groups, NaN for samples whose verifier failed;
        the failures are counted (`update`: raises past the run's limit)."""
        import torch

        results = [r for g in groups for r in g.results]
        self.update(results, group_size)
        return torch.tensor(reward_values(results), dtype=torch.float32).view(-1, group_size)

    def metrics(self) -> dict[str, float]:
        """TensorBoard scalars: the last batch's dropped samples, dropped groups and failures per
        reason (every failure reason, 0 when absent), and the run's cumulative failure fraction
        (what the stop compares with the limit)."""
        return {**self._last_batch, "verifier/failure_fraction": self.failure_fraction}

    def state_dict(self) -> dict[str, Any]:
        return {"num_samples": self.num_samples, "num_failed": self.num_failed,
                "failures_by_reason": dict(self.failures_by_reason),
                "example_detail": dict(self.example_detail)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_samples = int(state["num_samples"])
        self.num_failed = int(state["num_failed"])
        self.failures_by_reason = Counter(state["failures_by_reason"])
        self.example_detail = dict(state["example_detail"])

    @staticmethod
    def _batch_metrics(num_failed: int, num_dropped_groups: int,
                       reasons: Counter[str]) -> dict[str, float]:
        metrics = {"verifier/dropped_samples": float(num_failed),
                   "verifier/dropped_groups": float(num_dropped_groups)}
        for reason in sorted(str(r) for r in VERIFIER_FAILURES):
            metrics[f"verifier/failures/{reason}"] = float(reasons[reason])
        return metrics

    def _message(self) -> str:
        common = ", ".join(f"{reason} x{count} (e.g. {self.example_detail.get(reason, '')!r})"
                           for reason, count in
                           self.failures_by_reason.most_common(_MAX_REASONS_IN_ERROR))
        return (f"the verifier failed on {self.failure_fraction:.1%} of the samples scored so far "
                f"({self.num_failed} of {self.num_samples}, after retries), above "
                f"algorithm.max_verifier_failure_fraction={self.max_failure_fraction:g}. Most "
                f"common: {common}. These are infrastructure failures, not wrong answers: fix the "
                "verifier (sandbox server, math-verify workers, reasoning-gym scorers; see "
                "docs/rewards.md) and resume from the last checkpoint, or raise "
                "algorithm.max_verifier_failure_fraction if such failures are expected")
