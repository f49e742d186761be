"""The RL driver, `megatron-rl train RECIPE.yaml [section.field=value ...]`: ScaleRL under the
asynchronous Pipeline-RL schedule (SCALERL.md; DESIGN.md data flow).

It reads as the algorithm: the generators keep producing scored groups under the staleness bound
(rollout manager) while the loop takes a step's groups -> drops zero-variance and unverified
groups -> advantages -> one Megatron optimizer step -> pushes the weights to the generators in
flight -> validates, logs, checkpoints. The parts live in megatron_rl/run_setup.py (what a run
starts and stops) and the packages it names.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Sequence

from megatron_rl.config import ConfigError, RunConfig, load_config, save_config


def train(cfg: RunConfig) -> None:
    from megatron_rl.algorithms import compute_advantages, group_keep_mask
    from megatron_rl.run_setup import RunSetup, length_penalties
    from megatron_rl.trainer.batch import TrainBatch

    with RunSetup.start(cfg) as run:
        if cfg.eval.at_step_zero and run.step == 0:
            run.validate(step=0)  # R0 of the compute-scaling curve
        for step in run.progress(range(run.step + 1, cfg.train.num_steps + 1)):
            started = time.perf_counter()
            groups = run.take_groups(cfg.prompts_per_step)  # generated while the last step ran
            rewards = run.rewards_of(groups)  # [prompts, G]; NaN where the verifier failed
            if cfg.algorithm.length_penalty:  # DAPO's overlong penalty on correct answers
                rewards = rewards + length_penalties(groups, cfg.algorithm).view_as(rewards)
            keep = group_keep_mask(rewards,
                                   zero_variance_filter=cfg.algorithm.zero_variance_filter)
            metrics = run.rollout_metrics(groups, rewards, keep)
            if keep.any():
                advantages = compute_advantages(
                    rewards, cfg.algorithm.advantage_normalization, keep=keep)
                kept = [i for i in range(len(groups)) if keep[i]]
                batch = TrainBatch.from_groups([groups[i].samples for i in kept],
                                               advantages[kept].tolist())
                metrics |= run.train_step(batch)
            metrics |= run.push_weights()  # in flight: generation continues on the new weights
            metrics["perf/step_seconds"] = time.perf_counter() - started
            run.log(step, metrics)
            if cfg.eval.interval_steps and (step % cfg.eval.interval_steps == 0
                                            or step == cfg.train.num_steps):
                run.validate(step)
            if cfg.checkpoint.interval_steps and step % cfg.checkpoint.interval_steps == 0:
                run.save_checkpoint(step)
        run.finish()


USAGE = """usage: megatron-rl train RECIPE.yaml [section.field=value ...]

Runs ScaleRL under the Pipeline-RL schedule as RECIPE.yaml (with the overrides) says; every field
is in docs/config.md, and `python -m megatron_rl.config RECIPE.yaml [overrides]` prints the
resolved recipe. Outputs go to output_dir: config.yaml, tensorboard/, scaling.jsonl (for
`megatron-rl fit`), checkpoints/, generator logs."""


def main(argv: Sequence[str]) -> int:
    """`megatron-rl train` (megatron_rl/cli.py has set up the console)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    try:
        cfg = load_config(argv[0], list(argv[1:]))
    except ConfigError as err:
        print(f"megatron-rl train: error: {err}", file=sys.stderr)
        return 2
    save_config(cfg, f"{cfg.output_dir}/config.yaml")
    try:
        train(cfg)
    except ConfigError as err:  # found once the data or the checkpoint is read
        print(f"megatron-rl train: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from megatron_rl.cli import main as cli_main

    sys.exit(cli_main(["train", *sys.argv[1:]]))
