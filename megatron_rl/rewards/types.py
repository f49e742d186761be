"""What every verifier returns: the reason codes, the typed reward result, the mapping from a
verdict to a reward value (SCALERL.md section 2: +1 correct, -1 or 0 incorrect; the incorrect
value is a parameter, default 0.0 so that the mean reward is the pass rate), and how the final
answer is separated from the thinking part of a completion.

A verifier failure (the sandbox, a math worker or a scorer broke: `VERIFIER_FAILURES`) is not a
verdict on the completion: its result carries no reward (None, never `incorrect_reward`), so that
an infrastructure fault can never become a negative advantage. docs/rewards.md says what happens
to such samples (re-scored once, then their group is dropped).
"""
from __future__ import annotations

import dataclasses
import enum


class Reason(str, enum.Enum):
    """Why a completion got its reward. Compares equal to its string value."""

    CORRECT = "correct"
    WRONG = "wrong"                      # an answer (or program output) that does not match
    NO_ANSWER = "no_answer"              # nothing to grade: no `</think>`, no answer, no code
    PARSE_ERROR = "parse_error"          # an answer that does not parse; code that does not compile
    TIMEOUT = "timeout"                  # grading or the program ran past its time limit
    RUNTIME_ERROR = "runtime_error"      # the program raised, crashed or exited non-zero
    MEMORY_LIMIT = "memory_limit"
    OUTPUT_LIMIT = "output_limit"
    PROCESS_LIMIT = "process_limit"
    FILE_SIZE_LIMIT = "file_size_limit"  # a file over the size limit or a full working directory
    # Verifier failures (VERIFIER_FAILURES): not the policy's fault, so no reward at all.
    SANDBOX_ERROR = "sandbox_error"      # the code sandbox failed (server unreachable, no report)
    VERIFIER_ERROR = "verifier_error"    # a grader failed: dead math worker, math-verify or a
                                         # procedural scorer raised

    def __str__(self) -> str:
        return self.value


VERIFIER_FAILURES = frozenset({Reason.SANDBOX_ERROR, Reason.VERIFIER_ERROR})


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RewardScale:
    """Reward values for the verdicts. `partial_credit` interpolates by the pass fraction (code
    tests passed, reasoning-gym partial scores) instead of all-or-nothing."""

    correct_reward: float = 1.0
    incorrect_reward: float = 0.0
    partial_credit: bool = False

    def __post_init__(self) -> None:
        if not self.correct_reward > self.incorrect_reward:
            raise ValueError("RewardScale.correct_reward must exceed incorrect_reward, got "
                             f"{self.correct_reward} <= {self.incorrect_reward}")

    def value(self, reason: Reason, pass_fraction: float) -> float | None:
        """The reward of a verdict; None for a verifier failure (there is no verdict)."""
        if reason in VERIFIER_FAILURES:
            return None
        if reason == Reason.CORRECT:
            return self.correct_reward
        if self.partial_credit:
            gap = self.correct_reward - self.incorrect_reward
            return self.incorrect_reward + gap * pass_fraction
        return self.incorrect_reward


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RewardResult:
    reward: float | None  # None exactly when the verifier failed (`verifier_failed`)
    reason: Reason
    pass_fraction: float  # in [0, 1]: tests passed / total, or 1.0 / 0.0 for a single answer
    detail: str = ""

    def __post_init__(self) -> None:
        if (self.reward is None) != self.verifier_failed:
            raise ValueError(f"RewardResult with reason {self.reason!r} needs reward "
                             f"{'None' if self.verifier_failed else 'a number'}, got "
                             f"{self.reward!r}: a verifier failure ({sorted(VERIFIER_FAILURES)}) "
                             "has no reward and every verdict has one; build results with "
                             "make_result")

    @property
    def verifier_failed(self) -> bool:
        """The verifier, not the completion, failed: no reward; re-score, else drop the group."""
        return self.reason in VERIFIER_FAILURES

    @property
    def passed(self) -> bool:
        """Counts towards the pass rate (validation mean@k)."""
        return self.reason == Reason.CORRECT


def make_result(reason: Reason, scale: RewardScale, *, pass_fraction: float | None = None,
                detail: str = "") -> RewardResult:
    if pass_fraction is None:  # 0.0 for a verifier failure too, where it means nothing
        pass_fraction = 1.0 if reason == Reason.CORRECT else 0.0
    return RewardResult(reward=scale.value(reason, pass_fraction), reason=reason,
                        pass_fraction=pass_fraction, detail=detail)


THINK_END = "</think>"


def final_answer(completion: str, *, think_end: str | None = THINK_END) -> str | None:
    """The part after the last `think_end` (None when the thinking never ended, e.g. the
    completion was truncated); the whole completion when `think_end` is None (no thinking)."""
    if think_end is None:
        return completion
    end = completion.rfind(think_end)
    return None if end < 0 else completion[end + len(think_end):]
