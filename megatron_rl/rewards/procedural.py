"""Procedural-task rewards: reasoning-gym problems (task tag "rg/<dataset>") graded by the
dataset's own `score_answer`, applied to the text inside the last <answer>...</answer> after the
thinking part. reasoning-gym scores lie in [0, 1] and some give partial credit; a score of 1 is
"correct", anything lower "wrong" (its score is the pass fraction, used with partial credit).

A scorer that raises has two possible culprits. Some scorers raise on text they cannot parse
(prime_factorization's raises ValueError on "zzz"): the answer's fault. A broken scorer (or
record) is not. So the scorer is then tried on the reference answer: if that scores, the answer
gets `parse_error`; if that raises too, the scorer failed (`verifier_error`: no reward, never a
wrong answer).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from megatron_rl.data.records import PromptRecord
from megatron_rl.data.sources import PROCEDURAL_TASK_PREFIX
from megatron_rl.rewards.types import (
    THINK_END,
    Reason,
    RewardResult,
    RewardScale,
    final_answer,
    make_result,
)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ProceduralRewardConfig:
    think_end: str | None = THINK_END
    answer_tag: str = "answer"
    scale: RewardScale = dataclasses.field(default_factory=RewardScale)


@functools.lru_cache(maxsize=None)
def _score_fn(dataset: str) -> Callable[[str | None, dict[str, Any]], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(dataset)


def procedural_dataset(record: PromptRecord) -> str:
    if not record.task.startswith(PROCEDURAL_TASK_PREFIX):
        raise ValueError(f"prompt {record.prompt_id!r}: task {record.task!r} is not a "
                         f"procedural task (expected '{PROCEDURAL_TASK_PREFIX}<dataset>')")
    return record.task[len(PROCEDURAL_TASK_PREFIX):]


class ProceduralReward:
    """Reward of a completion for a reasoning-gym record (needs its answer and metadata)."""

    def __init__(self, config: ProceduralRewardConfig | None = None) -> None:
        self.config = config or ProceduralRewardConfig()

    def __call__(self, completion: str, record: PromptRecord) -> RewardResult:
        from reasoning_gym.utils import extract_answer

        scale = self.config.scale
        dataset = procedural_dataset(record)
        answer_part = final_answer(completion, think_end=self.config.think_end)
        if answer_part is None:
            return make_result(Reason.NO_ANSWER, scale, detail=f"no {self.config.think_end}")
        answer = extract_answer(answer_part, tag_name=self.config.answer_tag)
        if answer is None:
            return make_result(Reason.NO_ANSWER, scale,
                               detail=f"no <{self.config.answer_tag}> tags")
        entry = {"question": record.prompt, "answer": record.answer,
                 "metadata": dict(record.metadata)}
        score_answer = _score_fn(dataset)  # an unknown dataset is a configuration error: raise
        try:
            score = float(score_answer(answer, entry))
        except Exception as exc:  # noqa: BLE001 - whose fault it is decides the reason
            failure = f"{dataset} scorer failed: {type(exc).__name__}: {exc}"
            try:
                score_answer(record.answer, entry)
            except Exception as probe:  # noqa: BLE001
                return make_result(Reason.VERIFIER_ERROR, scale, detail=(
                    f"{failure}; on the reference answer too: {type(probe).__name__}: {probe}"))
            return make_result(Reason.PARSE_ERROR, scale, detail=failure)
        score = min(max(score, 0.0), 1.0)
        reason = Reason.CORRECT if score >= 1.0 else Reason.WRONG
        return make_result(reason, scale, pass_fraction=score, detail=f"score {score:g}")
