"""The multi-turn step metrics (metrics.py trajectory_metrics) and the trajectory fields of the
rollout-samples lines (write_rollout_samples), against hand-computed values. The cost model's
prediction is checked against the multi-turn prefill formula as docs/scaling.md states it,
computed here by hand, not by calling the cost model.

The samples and groups are stand-ins carrying only what the metrics read (the trajectory stats
have the fields of rollout/multi_turn.py TrajectoryStats)."""
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch

from megatron_rl.metrics import trajectory_metrics, write_rollout_samples

pytestmark = pytest.mark.unit


@dataclasses.dataclass(frozen=True)
class Stats:  # the fields of rollout/multi_turn.py TrajectoryStats
    turns: int
    tool_calls: int
    tool_errors: int
    tool_seconds: float
    generation_seconds: float
    decode_tokens: int
    observation_tokens: int
    prefill_tokens: int
    cached_tokens: int
    requests: int
    tool_run_seconds: float = 0.0


def _sample(trajectory, *, prompt_tokens=10, completion_tokens=5, index=0):
    return SimpleNamespace(
        trajectory=trajectory, prompt_token_ids=[1] * prompt_tokens,
        token_ids=[2] * completion_tokens, num_loss_tokens=completion_tokens,
        sample_index=index, thinking_budget=100, interrupted=False, finish_reason="stop",
        sampled_versions=[0] * completion_tokens)


# Four turns (two tool calls, one failed) and one turn without a call; a single-turn sample
# (no trajectory) beside them counts in none of the trajectory metrics.
FOUR_TURNS = Stats(turns=4, tool_calls=2, tool_errors=1, tool_seconds=0.5,
                   generation_seconds=2.0, decode_tokens=30, observation_tokens=30,
                   prefill_tokens=40, cached_tokens=60, requests=4, tool_run_seconds=0.125)
ONE_TURN = Stats(turns=1, tool_calls=0, tool_errors=0, tool_seconds=0.0, generation_seconds=1.0,
                 decode_tokens=10, observation_tokens=0, prefill_tokens=10, cached_tokens=0,
                 requests=1)
SAMPLES = [_sample(FOUR_TURNS), _sample(ONE_TURN), _sample(None, prompt_tokens=99)]


def test_trajectory_metrics_by_hand():
    metrics = trajectory_metrics(SAMPLES, samples_per_prompt=2, prefix_caching=True)
    expected = {
        "rollout/turns_per_trajectory": 2.5,         # (4 + 1) / 2
        "rollout/turns_per_trajectory_max": 4.0,
        "rollout/tool_calls": 1.0,                   # (2 + 0) / 2
        "rollout/tool_calls_total": 2.0,
        "rollout/tool_errors": 0.5,                  # 1 failed of 2 calls
        "perf/tool_seconds": 0.5,
        "perf/tool_run_seconds": 0.125,
        "perf/generation_seconds": 3.0,
        "perf/tool_to_generation_ratio": 0.5 / 3.0,
        "rollout/prefill_tokens": 50.0,
        "rollout/cached_tokens": 60.0,
        "rollout/decode_tokens": 40.0,
        "rollout/observation_tokens": 30.0,
        "rollout/prefill_share": 50 / 90,
        # Mean shape: P = 10, T = 2.5 turns, g = 40 / 2 = 20 generated tokens per trajectory,
        # O = 30 observation tokens / (5 - 2) later turns = 10. Prefix caching: the prompt once
        # per group of 2, then the observations: 10 / 2 + (2.5 - 1) x 10 = 20; share 20 / 40.
        "cost/prefill_share": 20 / 40,
    }
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value), name


def test_cost_prediction_without_prefix_caching():
    # Turn k re-reads the history: T P + (g/T + O) T (T - 1) / 2
    # = 2.5 x 10 + (8 + 10) x 2.5 x 1.5 / 2 = 25 + 33.75 = 58.75; share 58.75 / (58.75 + 20).
    metrics = trajectory_metrics(SAMPLES, samples_per_prompt=2, prefix_caching=False)
    assert metrics["cost/prefill_share"] == pytest.approx(58.75 / 78.75)
    assert metrics["rollout/prefill_share"] == pytest.approx(50 / 90)  # measured: unchanged


def test_single_turn_steps_log_nothing_new_and_ratios_without_denominator_are_nan():
    assert trajectory_metrics([_sample(None), _sample(None)], samples_per_prompt=2,
                              prefix_caching=True) == {}
    no_calls = trajectory_metrics([_sample(ONE_TURN)], samples_per_prompt=2, prefix_caching=True)
    assert math.isnan(no_calls["rollout/tool_errors"])
    assert no_calls["rollout/tool_calls_total"] == 0.0
    # one turn, no observation: the prompt once per group of 2 -> 10 / 2 = 5 against 10 decoded
    assert no_calls["cost/prefill_share"] == pytest.approx(5 / 15)


def test_rollout_samples_lines_carry_the_trajectory(tmp_path):
    group = SimpleNamespace(group_id=7, prompt_index=3,
                            samples=[_sample(FOUR_TURNS, index=0), _sample(None, index=1)])
    path = tmp_path / "step_4.jsonl"
    write_rollout_samples(path, 4, [group], torch.tensor([[1.0, math.nan]]))
    multi, single = [json.loads(line) for line in path.read_text().splitlines()]
    assert (multi["turns"], multi["tool_calls"], multi["tool_errors"],
            multi["observation_tokens"]) == (4, 2, 1, 30)
    assert multi["reward"] == 1.0 and single["reward"] is None
    assert not {"turns", "tool_calls", "tool_errors", "observation_tokens"} & single.keys()
