"""The RL driver, `megatron-rl train RECIPE.yaml [section.field=value ...]`: ScaleRL under the
asynchronous Pipeline-RL schedule (SCALERL.md; DESIGN.md data flow).

It reads as the algorithm: the generators keep producing scored groups under the staleness bound
(rollout manager) while the loop takes a step's groups -> drops zero-variance and unverified
groups -> advantages -> one Megatron optimizer step -> pushes the weights to the generators in
flight -> validates, logs, checkpoints. The parts live in megatron_rl/run_setup.py (what a run
starts and stops) and the packages it names.
"""
from __future__ import annotations

import signal
import sys
import time
from collections.abc import Sequence

from megatron_rl.config import ConfigError, RunConfig, load_config


def train(cfg: RunConfig) -> int:
    """The run; returns the exit status (0, or 128 + the signal after a graceful stop)."""
    from megatron_rl.run_setup import RunSetup, TrainerFailure

    with GracefulStop() as stop, RunSetup.start(cfg) as run:
        stop.install()  # again: starting Ray replaced the SIGTERM handler
        if cfg.eval.at_step_zero and run.step == 0:
            run.validate(step=0)  # R0 of the compute-scaling curve
        progress = run.progress(range(cfg.train.num_steps))
        progress.update(run.step)
        skipped_in_a_row = 0
        while run.step < cfg.train.num_steps and not stop.requested:
            try:
                metrics = one_step(run, cfg, step=run.step + 1)
                progress.update(1)
                skipped_in_a_row = skipped_in_a_row + 1 if metrics.get("train/skipped") else 0
                after_step(run, cfg, skipped_in_a_row=skipped_in_a_row)
            except TrainerFailure as failure:  # restored from the last checkpoint: redo
                run.recover_trainers(failure)
                progress.n, skipped_in_a_row = run.step, 0
                progress.refresh()
        run.commit_checkpoint(blocking=True)
        if stop.requested and run.last_checkpoint_step != run.step:
            run.save_checkpoint(run.step, wait=True)
        run.finish()
        if stop.requested:
            from megatron_rl.console import notice

            notice(f"stopped by {stop.requested.name} after step {run.step}; checkpoint "
                   f"step_{run.step:06d} written; continue with --resume")
            return 128 + stop.requested.value
    return 0


def one_step(run, cfg: RunConfig, *, step: int) -> dict[str, float]:
    """Take the step's groups -> filter -> advantages -> one optimizer step -> push the weights
    -> log. Returns the step's metrics."""
    import math

    from megatron_rl.algorithms import compute_advantages, group_keep_mask
    from megatron_rl.resilience import faults
    from megatron_rl.algorithms import length_penalties
    from megatron_rl.trainer.batch import TrainBatch

    started = time.perf_counter()
    groups = run.take_groups(cfg.prompts_per_step)  # generated while the last step ran
    run.record_ledger(step, groups)
    rewards = run.rewards_of(groups)  # [prompts, G]; NaN where the verifier failed
    if cfg.algorithm.length_penalty:  # DAPO's overlong penalty on correct answers
        rewards = rewards + length_penalties(groups, cfg.algorithm).view_as(rewards)
    keep = group_keep_mask(rewards, zero_variance_filter=cfg.algorithm.zero_variance_filter)
    metrics = run.rollout_metrics(groups, rewards, keep)
    if keep.any():
        advantages = compute_advantages(rewards, cfg.algorithm.advantage_normalization,
                                        keep=keep)
        kept = [i for i in range(len(groups)) if keep[i]]
        values = advantages[kept].tolist()
        if faults.planned("nan_loss", step):  # chaos tests: a non-finite loss, real path
            values = [[math.nan] * len(row) for row in values]
        batch = TrainBatch.from_groups([groups[i].samples for i in kept], values)
        metrics |= run.train_step(batch)
    metrics |= run.push_weights()  # in flight: generation continues on the new weights
    metrics["perf/step_seconds"] = time.perf_counter() - started
    run.log(step, metrics)
    return metrics


def after_step(run, cfg: RunConfig, *, skipped_in_a_row: int) -> None:
    """Validate and checkpoint as the recipe says; stop (with a checkpoint) after too many
    skipped steps in a row."""
    step = run.step
    run.commit_checkpoint(blocking=False)  # an asynchronous save's shards complete by now?
    if cfg.eval.interval_steps and (step % cfg.eval.interval_steps == 0
                                    or step == cfg.train.num_steps):
        run.validate(step)
    limit = cfg.train.max_consecutive_skipped_steps
    if limit and skipped_in_a_row >= limit:
        run.save_checkpoint(step, wait=True)
        raise RunStoppedError(
            f"{skipped_in_a_row} optimizer steps in a row were skipped for a non-finite loss or "
            f"gradient, the last at step {step} (train.max_consecutive_skipped_steps={limit}); "
            f"checkpoint step_{step:06d} was written. Look at train/grad_norm, the learning "
            "rate and the step's data in TensorBoard and the ledger, then resume with --resume "
            "(e.g. with a lower train.lr)")
    interval = cfg.checkpoint.interval_steps
    if (interval and step % interval == 0) or step == cfg.train.num_steps:
        run.save_checkpoint(step)  # and after the last step: a finished run can be extended


class RunStoppedError(RuntimeError):
    """The run stopped itself with a checkpoint; the message says why and what to do."""


class GracefulStop:
    """SIGTERM / SIGINT: the first finishes the current step, writes a checkpoint and ends the
    run normally (every engine and Ray actor stopped); a second one stops at once (the last
    checkpoint stands)."""

    def __init__(self) -> None:
        self.requested: signal.Signals | None = None
        self._previous: dict = {}

    def __enter__(self) -> "GracefulStop":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def install(self) -> None:
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        from megatron_rl.console import notice

        if self.requested is not None:
            notice(f"second {signal.Signals(signum).name}: stopping now, without a checkpoint")
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum)
        notice(f"{self.requested.name}: finishing the current step, then writing a checkpoint "
               "and stopping (send it again to stop at once)")


USAGE = """usage: megatron-rl train RECIPE.yaml [--resume] [section.field=value ...]

Runs ScaleRL under the Pipeline-RL schedule as RECIPE.yaml (with the overrides) says; every field
is in docs/config.md, and `python -m megatron_rl.config RECIPE.yaml [overrides]` prints the
resolved recipe. Outputs go to output_dir: config.yaml, tensorboard/, scaling.jsonl (for
`megatron-rl fit`), checkpoints/, ledger.jsonl (the groups each step trained on), faults.jsonl,
processes.json, generator logs.

A run resumes from the newest valid checkpoint in its output_dir by itself (checkpoint.resume:
auto); --resume requires one. SIGTERM / SIGINT finish the current step, write a checkpoint and
stop (exit status 128 + the signal); a second one stops at once. docs/fault_tolerance.md."""


def main(argv: Sequence[str]) -> int:
    """`megatron-rl train` (megatron_rl/cli.py has set up the console)."""
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    args = list(argv[1:])
    if "--resume" in args:  # = checkpoint.resume=always
        args = [a for a in args if a != "--resume"] + ["checkpoint.resume=always"]
    try:
        cfg = load_config(argv[0], args)
    except ConfigError as err:
        print(f"megatron-rl train: error: {err}", file=sys.stderr)
        return 2
    from megatron_rl.resilience.recovery import RunStopped
    from megatron_rl.rollout.manager import RolloutError

    try:
        return train(cfg)
    except ConfigError as err:  # found once the data or the checkpoint is read
        print(f"megatron-rl train: error: {err}", file=sys.stderr)
        return 2
    except (RunStopped, RunStoppedError, RolloutError) as err:
        print(f"megatron-rl train: stopped: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    from megatron_rl.cli import main as cli_main

    sys.exit(cli_main(["train", *sys.argv[1:]]))
