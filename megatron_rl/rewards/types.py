"""What every verifier returns: the reason codes, the typed reward result, the mapping from a
verdict to a reward value (SCALERL.md section 2: +1 correct, -1 or 0 incorrect; the incorrect
value is a parameter, default 0.0 so that the mean reward is the pass rate), and how the final
answer is separated from the thinking part of a completion.
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
    SANDBOX_ERROR = "sandbox_error"      # the verifier itself failed; not the policy's fault

    def __str__(self) -> str:
        return self.value


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

    def value(self, reason: Reason, pass_fraction: float) -> float:
        if reason == Reason.CORRECT:
            return self.correct_reward
        if self.partial_credit:
            gap = self.correct_reward - self.incorrect_reward
            return self.incorrect_reward + gap * pass_fraction
        return self.incorrect_reward


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RewardResult:
    reward: float
    reason: Reason
    pass_fraction: float  # in [0, 1]: tests passed / total, or 1.0 / 0.0 for a single answer
    detail: str = ""

    @property
    def passed(self) -> bool:
        """Counts towards the pass rate (validation mean@k)."""
        return self.reason == Reason.CORRECT


def make_result(reason: Reason, scale: RewardScale, *, pass_fraction: float | None = None,
                detail: str = "") -> RewardResult:
    if pass_fraction is None:
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
