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

from megatron_rl.config import ConfigError, RunConfig, load_config
from megatron_rl.console import notice
from megatron_rl.resilience.stop import RUN_STOP, GracefulStop, StopRequested, step_under_way


def train(cfg: RunConfig, backend=None) -> int:
    """The run; returns the exit status (0, or 128 + the signal after a graceful stop).
    `backend`: what the cluster runs on (cluster/backend.py; default the real one)."""
    from megatron_rl.run_setup import RunSetup

    with GracefulStop(grace_s=cfg.train.graceful_stop_timeout_s) as stop, \
            RunSetup.start(cfg, backend) as run:
        stop.install()  # again: starting Ray replaced the SIGTERM handler
        trainer_idle = True  # false once a stop left a trainer call or a step half done
        try:
            if cfg.eval.at_step_zero and run.step == 0:
                run.validate(step=0)  # R0 of the compute-scaling curve
            elif validation_due(cfg, run.step) and not run.metrics.scaling_log.has_step(run.step):
                run.validate(run.step)  # resumed: a stop came between its checkpoint and it
            run_steps(run, cfg, stop)
        except StopRequested as abandoned:  # the first SIGTERM / SIGINT, mid-wait
            trainer_idle = not abandoned.no_checkpoint
        if trainer_idle:
            with RUN_STOP.finishing():  # the checkpoint's own timeout, not the stop's
                run.commit_checkpoint(blocking=True)
                if stop.requested and run.last_checkpoint_step != run.step:
                    run.save_checkpoint(run.step, wait=True)
        else:  # the ranks are still inside the call: an asynchronous save stays partial
            run.checkpoints.abandon_pending()
        run.finish()
        if stop.requested:
            notice(stop_message(stop.requested, run, trainer_idle, cfg))
            return 128 + stop.requested.value
    return 0


def run_steps(run, cfg: RunConfig, stop: GracefulStop) -> None:
    """The optimizer steps, until train.num_steps or a stop request; a failed trainer is
    restored from the last checkpoint and its steps redone (not while stopping)."""
    from megatron_rl.run_setup import TrainerFailure

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
            if stop.requested:  # no restore while stopping: the last checkpoint stands
                raise StopRequested(f"the trainer failed ({failure})",
                                    no_checkpoint=True) from failure
            run.recover_trainers(failure)
            progress.n, skipped_in_a_row = run.step, 0
            progress.refresh()


def stop_message(sig, run, trainer_idle: bool, cfg: RunConfig) -> str:
    """The graceful stop's last line: the checkpoint written, or the one a --resume loads."""
    last = run.last_checkpoint_step
    if trainer_idle:
        return (f"stopped by {sig.name} after step {run.step}; checkpoint step_{run.step:06d} "
                "written; continue with --resume")
    return (f"stopped by {sig.name} after step {run.step}; the trainer failed, or was still "
            f"busy {cfg.train.graceful_stop_timeout_s:.0f} s later (train."
            "graceful_stop_timeout_s), so no checkpoint was written; --resume continues from "
            + (f"step_{last:06d}" if last is not None else "the start (no checkpoint yet)"))


def one_step(run, cfg: RunConfig, *, step: int) -> dict[str, float]:
    """Take the step's groups -> filter -> advantages -> one optimizer step -> push the weights
    -> log. Returns the step's metrics."""
    import math

    from megatron_rl.algorithms import compute_advantages, group_keep_mask
    from megatron_rl.resilience import faults
    from megatron_rl.algorithms import length_penalties
    from megatron_rl.metrics import write_rollout_samples
    from megatron_rl.trainer.batch import TrainBatch

    started = time.perf_counter()
    groups = run.take_groups(cfg.prompts_per_step)  # generated while the last step ran
    with step_under_way():  # a stop abandons the take above; from here on, no checkpoint
        run.record_ledger(step, groups)
        rewards = run.rewards_of(groups)  # [prompts, G]; NaN where the verifier failed
        if cfg.algorithm.length_penalty:  # DAPO's overlong penalty on correct answers
            rewards = rewards + length_penalties(groups, cfg.algorithm).view_as(rewards)
        keep = group_keep_mask(rewards, zero_variance_filter=cfg.algorithm.zero_variance_filter)
        metrics = run.rollout_metrics(groups, rewards, keep)
        if cfg.logging.rollout_samples:
            write_rollout_samples(run.out / "rollout_samples" / f"step_{step:06d}.jsonl", step,
                                  groups, rewards)
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
    if validation_due(cfg, step):
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


def validation_due(cfg: RunConfig, step: int) -> bool:
    """Whether the recipe validates after optimizer step `step` (>= 1)."""
    return bool(step and cfg.eval.interval_steps and (step % cfg.eval.interval_steps == 0
                                                      or step == cfg.train.num_steps))


class RunStoppedError(RuntimeError):
    """The run stopped itself with a checkpoint; the message says why and what to do."""


USAGE = """usage: megatron-rl train RECIPE.yaml [--resume] [section.field=value ...]

Runs ScaleRL under the Pipeline-RL schedule as RECIPE.yaml (with the overrides) says; every field
is in docs/config.md, and `python -m megatron_rl.config RECIPE.yaml [overrides]` prints the
resolved recipe. Outputs go to output_dir: config.yaml, tensorboard/, scaling.jsonl (for
`megatron-rl fit`), checkpoints/, ledger.jsonl (the groups each step trained on), faults.jsonl,
processes.json, generator logs.

A run resumes from the newest valid checkpoint in its output_dir by itself (checkpoint.resume:
auto); --resume requires one. SIGTERM / SIGINT abandon the wait for generation (a trainer step
under way gets train.graceful_stop_timeout_s), write a checkpoint and stop (exit status 128 +
the signal); a second one kills the run's processes at once. docs/fault_tolerance.md."""


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
    from megatron_rl.cluster.runtime import ClusterError
    from megatron_rl.resilience.recovery import RunStopped
    from megatron_rl.rollout.manager import RolloutError

    try:
        return train(cfg)
    except ConfigError as err:  # found once the data or the checkpoint is read
        print(f"megatron-rl train: error: {err}", file=sys.stderr)
        return 2
    except (RunStopped, RunStoppedError, RolloutError) as err:
        print(f"megatron-rl train: stopped: {err}", file=sys.stderr)
        return getattr(err, "exit_status", 1)  # NodeLost: 75, requeue (docs/fault_tolerance.md)
    except StopRequested as stopped:  # a SIGTERM / SIGINT abandoned a start-up or teardown wait
        print(f"megatron-rl train: stopped: {stopped}", file=sys.stderr)
        return 128 + stopped.signal
    except ClusterError as err:  # Ray could not be started or joined, or its teardown failed
        print(f"megatron-rl train: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    from megatron_rl.cli import main as cli_main

    sys.exit(cli_main(["train", *sys.argv[1:]]))
