"""Per-task validation metrics (mean@k, hand-computed), scoring through the registry, the
exclusion of samples whose verifier failed, and the hand-off to the scaling-curve log."""
import json

import pytest

from megatron_rl.data import PromptRecord, reasoning_gym_prompts
from megatron_rl.rewards import ProceduralReward, ProceduralRewardConfig, RewardRegistry
from megatron_rl.rewards import RewardScale, procedural
from megatron_rl.validation import (
    ScoredSample,
    log_validation,
    score_samples,
    validation_metrics,
    write_validation_samples,
)

pytestmark = pytest.mark.unit


def _samples(prompt_id: str, task: str, passed: list[bool | None], wrong: float = 0.0):
    """None: the verifier failed on that sample (no reward)."""
    return [ScoredSample(prompt_id=prompt_id, task=task,
                         reward=None if p is None else 1.0 if p else wrong, passed=bool(p))
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


def test_failed_verifications_are_excluded():
    """A prompt's rates are over its verified samples; a prompt with none is left out."""
    samples = (_samples("m1", "math", [True, False, None, None], wrong=-1.0) +  # 1/2, reward 0
               _samples("m2", "math", [None] * 4) +                             # excluded
               _samples("c1", "code", [True, True, True, False], wrong=-1.0) +  # 3/4, reward 1/2
               _samples("r1", "rg/gcd", [None] * 4))                            # excluded
    metrics = validation_metrics(samples, samples_per_prompt=4)
    assert metrics.pass_rate_by_task == {"math": 0.5, "code": 0.75, "all": 0.625}
    assert metrics.mean_reward_by_task == {"math": 0.0, "code": 0.5, "all": 0.25}
    assert metrics.num_prompts_by_task == {"math": 1, "code": 1, "rg/gcd": 0, "all": 2}
    assert metrics.num_excluded_samples_by_task == {"math": 6, "code": 0, "rg/gcd": 4, "all": 10}
    assert metrics.num_excluded_prompts_by_task == {"math": 1, "code": 0, "rg/gcd": 1, "all": 2}
    with pytest.raises(ValueError, match="verifier failed on all 8 validation samples"):
        validation_metrics(_samples("a", "math", [None] * 4) + _samples("b", "code", [None] * 4))
    with pytest.raises(ValueError, match="cannot have passed"):
        ScoredSample(prompt_id="a", task="math", reward=None, passed=True)


def test_score_samples_excludes_a_scorer_that_keeps_failing(monkeypatch):
    """A fake reasoning-gym scorer (forcing the infrastructure failure) raises on prompt 1's
    record, also for the reference answer and on the retry; prompt 0 has one wrong sample. The
    real ProceduralReward, registry and score_samples run around it."""
    records = reasoning_gym_prompts("basic_arithmetic", num_prompts=2, seed=5)
    calls = []

    def score(answer, entry):
        calls.append(entry["question"])
        if entry["question"] == records[1].prompt:
            raise OSError("scorer backend unavailable")
        return 1.0 if answer == entry["answer"] else 0.0

    monkeypatch.setattr(procedural, "_score_fn", lambda dataset: score)
    registry = RewardRegistry()
    registry.register("rg/", ProceduralReward(ProceduralRewardConfig(
        scale=RewardScale(incorrect_reward=-1.0))))
    completions = [[f"</think><answer>{records[0].answer}</answer>", "</think><answer>x</answer>"],
                   [f"</think><answer>{records[1].answer}</answer>", "</think><answer>x</answer>"]]
    samples = score_samples(registry, records, completions, num_threads=1)
    assert [(s.passed, s.reward) for s in samples] == [(True, 1.0), (False, -1.0),
                                                       (False, None), (False, None)]
    assert calls.count(records[1].prompt) == 8  # 2 samples x 2 attempts x (answer, reference)
    metrics = validation_metrics(samples, samples_per_prompt=2)
    assert metrics.pass_rate_by_task == {"rg/basic_arithmetic": 0.5, "all": 0.5}
    assert metrics.mean_reward_by_task == {"rg/basic_arithmetic": 0.0, "all": 0.0}
    assert metrics.num_excluded_samples_by_task["all"] == 2
    assert metrics.num_excluded_prompts_by_task["all"] == 1


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
    assert ("val/excluded_samples/all", 0, 100) in writer.scalars


def test_log_validation_reports_excluded_samples(tmp_path):
    metrics = validation_metrics(_samples("m", "math", [True, None]) +
                                 _samples("c", "code", [None, None]))
    writer = _Recorder()
    log_validation(tmp_path, 7, 1.0, metrics, tb_writer=writer)
    lines = [json.loads(line) for line in (tmp_path / "scaling.jsonl").read_text().splitlines()]
    assert {(d["task"], d["pass_rate"]) for d in lines} == {("math", 1.0), ("all", 1.0)}
    assert {("val/excluded_samples/all", 3, 7), ("val/excluded_samples/code", 2, 7),
            ("val/excluded_prompts/code", 1, 7)} <= set(writer.scalars)


def test_record_for_unknown_task_fails_before_scoring():
    registry = RewardRegistry()
    record = PromptRecord(prompt_id="x", task="poetry", prompt="p")
    with pytest.raises(ValueError, match="no reward function for task 'poetry'"):
        score_samples(registry, [record], [["a"]])


def test_validation_samples_file_has_one_line_per_completion_in_order(tmp_path):
    records = [PromptRecord(prompt_id="a", task="math", prompt="1 + 1 =", answer="2"),
               PromptRecord(prompt_id="b", task="math", prompt="2 + 2 =", answer="4")]
    completions = [["2", "3"], ["4", "x"]]
    scored = _samples("a", "math", [True, False]) + _samples("b", "math", [True, None])
    path = tmp_path / "validation_samples" / "step_000004.jsonl"
    write_validation_samples(path, 4, records, completions, scored)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(x["prompt_id"], x["completion"], x["reward"], x["passed"]) for x in lines] == [
        ("a", "2", 1.0, True), ("a", "3", 0.0, False), ("b", "4", 1.0, True),
        ("b", "x", None, False)]
    assert {x["step"] for x in lines} == {4} and lines[2]["prompt"] == "2 + 2 ="
    assert [p.name for p in path.parent.iterdir()] == ["step_000004.jsonl"]  # no temp left
    with pytest.raises(ValueError, match="4 completions but 3 scored"):
        write_validation_samples(path, 4, records, completions, scored[:3])
