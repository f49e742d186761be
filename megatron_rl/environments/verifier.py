"""Single-turn verifiers as environments: `VerifierEnvironment` gives every task a reward registry
grades the uniform environment view (one turn, then the verifier's verdict). The rollout keeps
scoring single-turn groups in batches with `RewardRegistry.score_many` (nothing changes for those
recipes); this class is what validation, users and the docs see, and it scores a turn exactly as
that batch path does (same confinement of failures, same re-scoring of a failed verifier).

`confined_grade` is the failure rule every grading environment shares: an exception out of a
grader is that trajectory's verifier failure (`Reason.VERIFIER_ERROR`, no reward), as
`RewardRegistry._score_one` does for a batch; a sandbox that cannot isolate programs on this
host (`SandboxUnavailableError`) is a configuration error and still raises.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

from megatron_rl.data.records import PromptRecord
from megatron_rl.environments.base import Environment, EnvironmentSession, StepResult
from megatron_rl.rewards.registry import RewardRegistry, confined_score
from megatron_rl.rewards.types import RewardResult

Grader = Callable[[str, PromptRecord], RewardResult]


def confined_grade(grade: Grader, text: str, record: PromptRecord) -> RewardResult:
    """`grade(text, record)`, with an exception confined to this trajectory (verifier_error):
    the reward registry's own rule (`confined_score`)."""
    return confined_score(grade, text, record)


class VerifierEnvironment(Environment):
    """One turn scored by `reward_registry` (the task's registered verifier)."""

    multi_turn = False

    def __init__(self, reward_registry: RewardRegistry) -> None:
        self.reward_registry = reward_registry

    async def start(self, record: PromptRecord) -> EnvironmentSession:
        return _VerifierSession(self.reward_registry, record)


class _VerifierSession(EnvironmentSession):
    def __init__(self, reward_registry: RewardRegistry, record: PromptRecord) -> None:
        self._rewards, self._record = reward_registry, record

    async def step(self, turn: str, *, final: bool = False) -> StepResult:
        # score_many, not score: the batch path's confinement and re-scoring, for one sample.
        # Verifiers block (worker processes, the sandbox): off the event loop.
        (result,) = await asyncio.to_thread(self._rewards.score_many, [turn], [self._record],
                                            num_threads=1)
        return StepResult(done=True, reward=result)
