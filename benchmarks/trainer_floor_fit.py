"""Fit the cost model's trainer floor (scaling/cost.py: train_min_tokens_per_device) once, to
verl's published update_actor times for Qwen2.5-Math-7B on H20 (../shared/ANCHOR_FIGURES.md
section 1: the colocated baseline on 32 / 64 / 128 GPUs, the fully-async trainer on 16 / 32 / 64),
and print each row's published against modelled time, with the old_log_prob and the 10K-response
(section 1d) rows as checks.

    PYTHONPATH=. python benchmarks/trainer_floor_fit.py

A row's modelled time is `cost.train_seconds`: 6N per trained token at the calibration's train
MFU (0.4), the step's 512 x 16 samples of the anchor cases' assumed 200 + 1200 tokens
(benchmarks/simulated_anchors.py) in verl's 16 optimizer steps (train_batch 512 / ppo_mini_batch
32), each device's share of an optimizer step counted as at least the floor. Without the floor
the model is linear in the devices; verl's update_actor is linear from 32 to 64 colocated GPUs
(270 -> 133 s) and from 16 to 32 async ones (314 -> 157 s), then stops: 114 s on 128 and 113 s
on 64. One knob, least squares on the log of the modelled / published time over the six rows.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from megatron_rl.scaling import cost
from megatron_rl.scaling.hardware import get_accelerator
from megatron_rl.simulation.anchors import SHAPES

PROMPTS, SAMPLES, OPTIMIZER_STEPS = 512, 16, 512 // 32  # train_batch / ppo_mini_batch
PROMPT_TOKENS, RESPONSE_TOKENS = 200, 1200  # the anchor cases' assumptions (unpublished)


@dataclasses.dataclass(frozen=True)
class Row:
    label: str
    devices: int
    seconds: float  # published, per step
    forward_only: bool = False  # old_log_prob: 2N a token


FIT_ROWS = (Row("colocated sync, update_actor", 32, 269.80),
            Row("colocated sync, update_actor", 64, 133.41),
            Row("colocated sync, update_actor", 128, 113.81),
            Row("fully async, update_actor", 16, 313.81),
            Row("fully async, update_actor", 32, 156.98),
            Row("fully async, update_actor", 64, 113.16))
CHECK_ROWS = (Row("colocated sync, old_log_prob", 32, 107.71, forward_only=True),
              Row("colocated sync, old_log_prob", 64, 70.26, forward_only=True),
              Row("colocated sync, old_log_prob", 128, 53.92, forward_only=True),
              Row("10K responses (1d): sync, update_actor", 16, 430.263),
              Row("10K responses (1d): async, update_actor", 8, 435.874))


def _config(floor: float) -> cost.CostConfig:
    return SHAPES["qwen2.5-math-7b"].cost_config(
        hardware="H20", num_prompts_per_step=PROMPTS, samples_per_prompt=SAMPLES,
        prompt_tokens=PROMPT_TOKENS, generated_tokens=RESPONSE_TOKENS, train_mfu=0.4,
        optimizer_steps_per_step=OPTIMIZER_STEPS, train_min_tokens_per_device=floor)


def modelled(row: Row, floor: float) -> float:
    config = _config(floor)
    per_token = 2.0 * config.num_active_params if row.forward_only else None
    return cost.train_seconds(config, get_accelerator("H20"),
                              PROMPTS * SAMPLES * (PROMPT_TOKENS + RESPONSE_TOKENS), row.devices,
                              flops_per_token=per_token)


def loss(floor: float) -> float:
    return sum(math.log(modelled(row, floor) / row.seconds) ** 2 for row in FIT_ROWS)


def fit() -> float:
    """The floor (tokens a device per optimizer step) of least loss: a log grid, refined."""
    from scipy import optimize

    grid = np.concatenate([[0.0], np.geomspace(100.0, 1e6, 2001)])
    best = float(grid[int(np.argmin([loss(f) for f in grid]))])
    if best == 0.0:
        return 0.0
    result = optimize.minimize_scalar(loss, bounds=(best / 1.01, best * 1.01), method="bounded")
    return float(result.x)


def main() -> None:
    fitted, default = fit(), cost.CostConfig().train_min_tokens_per_device
    print(f"fitted: train_min_tokens_per_device={fitted:,.0f} (loss {loss(fitted):.4f}; "
          f"linear, no floor: {loss(0.0):.4f})")
    print(f"cost.py default: train_min_tokens_per_device={default:,.0f}")
    print()
    print(f"{'row (Qwen2.5-Math-7B, H20, 512 x 16 a step)':46s} {'GPUs':>5s} {'published':>9s} "
          f"{'linear':>8s} {'+floor':>8s} {'error':>7s}")
    for label, rows in (("fitted", FIT_ROWS), ("check", CHECK_ROWS)):
        print(f"-- {label}")
        for row in rows:
            linear, floored = modelled(row, 0.0), modelled(row, default)
            print(f"{row.label:46s} {row.devices:5d} {row.seconds:9.1f} {linear:8.1f} "
                  f"{floored:8.1f} {floored / row.seconds - 1:+7.1%}")


if __name__ == "__main__":
    main()
