"""How `megatron-rl train` shapes the verifier's rewards before the advantages: DAPO's overlong
penalty (algorithm.length_penalty) on correct answers, from the samples' generated-token counts
(the loop itself runs in tests/e2e)."""
import types

import pytest

from megatron_rl.config import load_config
from megatron_rl.rewards.types import Reason, RewardResult
from megatron_rl.algorithms import length_penalties

pytestmark = pytest.mark.unit


def _result(correct: bool) -> RewardResult:
    return RewardResult(reward=1.0 if correct else 0.0,
                        reason=Reason.CORRECT if correct else Reason.WRONG,
                        pass_fraction=1.0 if correct else 0.0)


def test_length_penalty_hits_long_correct_answers_only():
    algorithm = load_config(None, ["algorithm.length_penalty=true",
                                   "algorithm.length_penalty_max_length=10",
                                   "algorithm.length_penalty_cache_length=4"]).algorithm
    # Generated tokens (the forced-interruption phrase has loss mask 0 and does not count).
    lengths = [[5, 8], [9, 12]]
    correct = [[True, True], [False, True]]
    groups = [types.SimpleNamespace(
        samples=[types.SimpleNamespace(num_loss_tokens=n) for n in row],
        results=[_result(c) for c in passed]) for row, passed in zip(lengths, correct)]
    # clip((10 - |y|) / 4 - 1, -1, 0): 5 -> 0, 8 -> -0.5, 9 (wrong) -> 0, 12 -> -1 (clipped).
    assert length_penalties(groups, algorithm).tolist() == [0.0, -0.5, 0.0, -1.0]
