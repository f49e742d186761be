"""Per-task validation metrics (mean@k, hand-computed), scoring through the registry, and the
hand-off to the scaling-curve log."""
import json

import pytest

from megatron_rl.data import PromptRecord, reasoning_gym_prompts
from megatron_rl.rewards import ProceduralReward, ProceduralRewardConfig, RewardRegistry
from megatron_rl.rewards import RewardScale
from megatron_rl.validation import (
    ScoredSample,
    log_validation,
    score_samples,
    validation_metrics,
)

pytestmark = pytest.mark.unit


def _samples(prompt_id: str, task: str, passed: list[bool], wrong: float = 0.0):
    return [ScoredSample(prompt_id=prompt_id, task=task, reward=1.0 if p else wrong, passed=p)
            for p in passed]


def test_mean_at_k_per_task_and_overall():
    samples = (_samples("m1", "math", [True, True, False, False]) +     # 0.5
               _samples("m2", "math", [True, True, True, True]) +       # 1.0
               _samples("c1", "code", [False, False, False, True]) +    # 0.25
               _samples("r1", "rg/gcd", [False] * 4))                   # 0.0
    metrics = validation_metrics(samples, samples_per_prompt=4)
    assert metrics.pass_rate_by_task == pytest.approx(
        {"math": 0.75, "code": 0.25, "rg/gcd": 0.0, "all": (0.5 + 1.0 + 0.25 + 0.0) / 4})
    assert metrics.num_prompts_by_task == {"math": 2, "code": 1, "rg/gcd": 1, "all": 4}
    assert metrics.samples_per_prompt == 4


def test_pass_rates_stay_in_unit_interval_with_signed_rewards():
    samples = _samples("a", "math", [True, False], wrong=-1.0)
    metrics = validation_metrics(samples)
    assert metrics.pass_rate_by_task["math"] == 0.5
    assert metrics.mean_reward_by_task["math"] == 0.0  # (1 - 1) / 2


def test_uneven_samples_are_refused():
    samples = _samples("a", "math", [True, False]) + _samples("b", "math", [True])
    with pytest.raises(ValueError, match="exactly 2 samples.*'b': 1"):
        validation_metrics(samples)
    with pytest.raises(ValueError, match="exactly 3"):
        validation_metrics(_samples("a", "math", [True, False]), samples_per_prompt=3)
    with pytest.raises(ValueError, match="no scored samples"):
        validation_metrics([])


def test_score_samples_through_the_registry():
    registry = RewardRegistry()
    registry.register("rg/", ProceduralReward(ProceduralRewardConfig(
        scale=RewardScale(incorrect_reward=-1.0))))
    records = reasoning_gym_prompts("basic_arithmetic", num_prompts=2, seed=5)
    completions = [[f"</think><answer>{records[0].answer}</answer>", "</think><answer>x</answer>"],
                   ["</think>no tags", f"</think><answer>{records[1].answer}</answer>"]]
    samples = score_samples(registry, records, completions, num_threads=2)
    assert [(s.prompt_id, s.passed, s.reward) for s in samples] == [
        (records[0].prompt_id, True, 1.0), (records[0].prompt_id, False, -1.0),
        (records[1].prompt_id, False, -1.0), (records[1].prompt_id, True, 1.0)]
    metrics = validation_metrics(samples, samples_per_prompt=2)
    assert metrics.pass_rate_by_task == {"rg/basic_arithmetic": 0.5, "all": 0.5}


class _Recorder:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, global_step):
        self.scalars.append((tag, value, global_step))

    def flush(self):
        pass


def test_log_validation_writes_one_curve_per_task(tmp_path):
    metrics = validation_metrics(_samples("m", "math", [True, False]) +
                                 _samples("c", "code", [True, True]))
    writer = _Recorder()
    log_validation(tmp_path, 100, 12.5, metrics, tb_writer=writer)
    lines = [json.loads(line) for line in (tmp_path / "scaling.jsonl").read_text().splitlines()]
    assert {(d["task"], d["pass_rate"], d["step"], d["compute_gpu_hours"]) for d in lines} == {
        ("math", 0.5, 100, 12.5), ("code", 1.0, 100, 12.5), ("all", 0.75, 100, 12.5)}
    assert ("val/mean_reward/all", 0.75, 100) in writer.scalars
    assert ("val/pass_rate/code", 1.0, 100) in writer.scalars


def test_record_for_unknown_task_fails_before_scoring():
    registry = RewardRegistry()
    record = PromptRecord(prompt_id="x", task="poetry", prompt="p")
    with pytest.raises(ValueError, match="no reward function for task 'poetry'"):
        score_samples(registry, [record], [["a"]])
