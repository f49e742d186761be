"""A training run's step metrics and where they go: the rollout metrics of a step's groups,
generator and trainer utilisation over the window since the previous log, TensorBoard (and
Weights & Biases with logging.wandb: the same scalars, the config and the scaling-curve plot;
megatron_rl/wandb_logging.py), the compute-scaling log, the progress bar (with the generator
engines in the rotation, which a lost node lowers until its engines are placed again; one plain
line per step when stderr is a log file, console.progress), and the compute axis of the scaling
curve. Multi-turn trajectories add their own (`trajectory_metrics`): turns, tool calls and errors,
tool vs generation time, and the measured prefill share of inference tokens beside the cost
model's prediction for the same shape (scaling/cost.py token_counts).

The compute axis (docs/pipeline.md) is device-hours spent on training: (trainer ranks + generator
devices) x wall time since the generators started on the training groups (on CPU, processes stand
in for devices); a validation point sits at the compute spent when it began (the policy it
validates). It counts compute spent, so it only grows: steps redone after an in-run trainer
recovery are spent compute and stay on it (`RunMetrics.compute_gpu_hours` keeps running through a
recovery); a run resumed in a new process continues from the checkpoint's value (the time between
that checkpoint and the crash left no record to count).
"""
from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from megatron_rl.config import RunConfig


def version_runs(versions: Sequence[int]) -> list[list[int]]:
    """[[version, count], ...]: the policy versions of a completion's sampled tokens in order,
    run-length encoded (a completion that spans an in-flight update has several runs)."""
    runs: list[list[int]] = []
    for version in versions:
        if runs and runs[-1][0] == version:
            runs[-1][1] += 1
        else:
            runs.append([version, 1])
    return runs


def _trajectory_fields(trajectory) -> dict:
    """A multi-turn sample's line in rollout_samples: its turns, tool calls, tool errors and
    observation tokens (nothing for a single-turn sample)."""
    if trajectory is None:
        return {}
    return {"turns": trajectory.turns, "tool_calls": trajectory.tool_calls,
            "tool_errors": trajectory.tool_errors,
            "observation_tokens": trajectory.observation_tokens}


def trajectory_metrics(samples: Sequence, *, samples_per_prompt: int,
                       prefix_caching: bool) -> dict[str, float]:
    """The step's multi-turn trajectories (samples with `trajectory` stats; {} when there are
    none, as in a single-turn run): turns per trajectory (mean, max), tool calls (per trajectory,
    total) and the share of calls that failed, tool vs generation wall time summed over the
    trajectories, their prefill (computed: input - prefix-cache hits), decode (sampled) and
    observation tokens, and `rollout/prefill_share` = prefill / (prefill + decode) beside
    `cost/prefill_share`, the cost model's prediction for trajectories of the measured mean
    shape (prompt, turns, generated and per-later-turn observation tokens) with prefix caching
    as the generators run it (SGLang's radix cache: on unless rollout.deterministic). A ratio
    without a denominator (no tool call, no generation time) is NaN, which is not logged."""
    from megatron_rl.scaling.cost import CostConfig, token_counts

    with_stats = [s for s in samples if s.trajectory is not None]
    if not with_stats:
        return {}
    stats = [s.trajectory for s in with_stats]
    count = len(stats)
    turns = sum(t.turns for t in stats)
    calls, errors = sum(t.tool_calls for t in stats), sum(t.tool_errors for t in stats)
    tool_s = sum(t.tool_seconds for t in stats)
    tool_run_s = sum(t.tool_run_seconds for t in stats)
    generation_s = sum(t.generation_seconds for t in stats)
    prefill, decode = sum(t.prefill_tokens for t in stats), sum(t.decode_tokens for t in stats)
    observation = sum(t.observation_tokens for t in stats)
    metrics = {
        "rollout/turns_per_trajectory": turns / count,
        "rollout/turns_per_trajectory_max": float(max(t.turns for t in stats)),
        "rollout/tool_calls": calls / count,
        "rollout/tool_calls_total": float(calls),
        "rollout/tool_errors": errors / calls if calls else math.nan,
        "perf/tool_seconds": tool_s,
        "perf/tool_run_seconds": tool_run_s,
        "perf/generation_seconds": generation_s,
        "perf/tool_to_generation_ratio": tool_s / generation_s if generation_s > 0 else math.nan,
        "rollout/prefill_tokens": float(prefill),
        "rollout/cached_tokens": float(sum(t.cached_tokens for t in stats)),
        "rollout/decode_tokens": float(decode),
        "rollout/observation_tokens": float(observation),
        "rollout/prefill_share": prefill / (prefill + decode) if prefill + decode else math.nan,
        "cost/prefill_share": math.nan,
    }
    if decode > 0:  # the cost model needs generated tokens
        later_turns = turns - count  # the turns an observation precedes
        predicted = token_counts(CostConfig(
            samples_per_prompt=samples_per_prompt,
            prompt_tokens=sum(len(s.prompt_token_ids) for s in with_stats) / count,
            generated_tokens=decode / count, num_turns=turns / count,
            observation_tokens=observation / later_turns if later_turns else 0.0,
            prefix_caching=prefix_caching))
        metrics["cost/prefill_share"] = predicted.prefill / (predicted.prefill + predicted.decode)
    return metrics


def write_rollout_samples(path: Path, step: int, groups: Sequence, rewards) -> None:
    """One JSON line per completion the step trained on (logging.rollout_samples): its group,
    prompt, lengths, drawn thinking budget, interruption and finish reason, the versions of its
    sampled tokens (version_runs) and reward; a multi-turn trajectory's also its turns, tool
    calls, tool errors and observation tokens. Written whole, then renamed."""
    from megatron_rl.resilience.ledger import write_jsonl

    write_jsonl(path, ({
        "step": step, "group_id": group.group_id, "prompt_index": group.prompt_index,
        "sample_index": sample.sample_index, "prompt_tokens": len(sample.prompt_token_ids),
        "completion_tokens": len(sample.token_ids), "loss_tokens": sample.num_loss_tokens,
        "thinking_budget": sample.thinking_budget, "interrupted": sample.interrupted,
        "finish_reason": sample.finish_reason,
        "versions": version_runs(sample.sampled_versions),
        "reward": None if math.isnan(reward) else reward} | _trajectory_fields(sample.trajectory)
        for group, row in zip(groups, rewards.tolist())
        for sample, reward in zip(group.samples, row)))


class RunMetrics:
    """`clients` is the run's list of HTTP clients, one per engine (their activity counters)."""

    def __init__(self, cfg: RunConfig, out: Path, *, clients: list, num_devices: int):
        self.cfg, self.out, self.clients, self.num_devices = cfg, out, clients, num_devices
        self.writer = self.scaling_log = None
        self._compute_start: float | None = None
        self._compute_offset = 0.0
        self._paused_busy_s = 0.0  # generator-seconds of in-flight requests held by pauses
        self._window = None
        self._progress = None
        self._wandb = None  # the W&B run (logging.wandb), opened with the first logs

    def open_logs(self, *, purge_after: int | None) -> None:
        """TensorBoard (events after `purge_after` dropped: a restored run redoes those steps),
        W&B when configured (the same W&B run across restores; a resumed run continues its
        own) and the scaling log; again after a restore."""
        from torch.utils.tensorboard import SummaryWriter

        from megatron_rl.config import config_to_dict
        from megatron_rl.scaling.log import ScalingLog
        from megatron_rl.wandb_logging import MetricWriters, WandbRun

        if self.writer is not None:
            self.writer.close()
        wandb_cfg = self.cfg.logging.wandb
        if self._wandb is None and wandb_cfg.mode != "disabled":
            self._wandb = WandbRun(wandb_cfg, config=config_to_dict(self.cfg), out=self.out,
                                   run_name=self.cfg.name, resume=purge_after is not None)
        self.writer = MetricWriters(SummaryWriter(
            self.cfg.tensorboard_dir, purge_step=None if purge_after is None
            else purge_after + 1), self._wandb)
        self.scaling_log = ScalingLog(self.out, tb_writer=self.writer)

    def close_progress(self) -> None:
        if self._progress is not None:
            self._progress.close()

    def close(self) -> None:
        self.close_progress()
        if self.writer is not None:
            self.writer.close()
        if self._wandb is not None:
            self._log_scaling_plot()
            self._wandb.finish()
            self._wandb = None

    def _log_scaling_plot(self) -> None:
        """The run's fitted compute-scaling curve (the plot `megatron-rl fit` draws) to W&B, at
        the last validated step; a run with too few validation points for a fit says so."""
        from megatron_rl.console import notice
        from megatron_rl.scaling.log import OVERALL_TASK, read_scaling_log
        from megatron_rl.scaling.plots import CurvePlot, plot_curves
        from megatron_rl.scaling.report import fit_series
        from megatron_rl.scaling.sigmoid import SigmoidFitConfig

        config = SigmoidFitConfig(warmup_compute=self.cfg.eval.warmup_compute_gpu_hours,
                                  num_bootstrap=0)
        try:
            series = read_scaling_log(self.out)[OVERALL_TASK]
            fit = fit_series(series, config=config)
        except (KeyError, OSError, ValueError) as err:
            notice(f"no scaling-curve plot for W&B: {err}")
            return
        path = self.out / "wandb_scaling_curve.png"
        plot_curves([CurvePlot(series=series, fit=fit, warmup_compute=config.warmup_compute)],
                    path, title=f"{self.cfg.name}: validation pass rate vs compute")
        self._wandb.add_image("val/scaling_curve", path,
                              0 if series.step is None else int(series.step[-1]))

    # ------------------------------------------------------------------ the compute axis

    def resume_compute(self, gpu_hours: float) -> None:
        """A run resumed from a checkpoint starts its compute axis at the checkpoint's value."""
        self._compute_offset = gpu_hours

    @property
    def compute_gpu_hours(self) -> float:
        if self._compute_start is None:
            return self._compute_offset
        return self._compute_offset + (time.perf_counter() - self._compute_start) / 3600 \
            * self.num_devices

    def start_clock(self) -> None:
        """Compute is being spent from here on: the generators start on the training groups."""
        if self._compute_start is None:
            self._compute_start = time.perf_counter()

    def progress(self, steps: Iterable[int]):
        """The progress bar over the run's steps (and the utilisation window's start): a bar in a
        terminal, one line per step with the same fields in a log (console.progress)."""
        from megatron_rl.console import progress

        self.start_clock()
        self._window = (time.perf_counter(), self._activity(), 0.0)
        self._progress = progress(steps, desc=self.cfg.name, unit="step",
                                  disable=not self.cfg.logging.progress_bar)
        return self._progress

    # ------------------------------------------------------------------ a step's metrics

    def rollout(self, groups: Sequence, rewards, keep, *, sampler, gate, verifier_failures,
                version: int, wait_s: float) -> dict[str, float]:
        """What the step's groups say: rewards, pass rate, lengths, truncation and interruption,
        the zero-variance share, staleness, the gate's and the verifiers' counters, and the
        multi-turn trajectories' own (trajectory_metrics; none in a single-turn run)."""
        from megatron_rl.rollout.staleness import staleness_histogram

        samples = [s for g in groups for s in g.samples]
        lengths = sorted(len(s.token_ids) for s in samples)
        passed = [r.passed for g in groups for r in g.results if not r.verifier_failed]
        versions = [v for s in samples for v in s.sampled_versions]
        metrics = {
            "rollout/reward_mean": float(rewards[~rewards.isnan()].mean()) if passed else math.nan,
            "rollout/pass_rate": sum(passed) / len(passed) if passed else math.nan,
            "rollout/response_length_mean": sum(lengths) / len(lengths),
            "rollout/response_length_p99": float(lengths[min(len(lengths) - 1,
                                                             int(0.99 * len(lengths)))]),
            "rollout/truncation_rate": sum(s.truncated for s in samples) / len(samples),
            "rollout/interruption_rate": sum(s.interrupted for s in samples) / len(samples),
            "rollout/zero_variance_fraction": 1.0 - float(keep.float().mean()),
            "rollout/npr_retired_prompts": float(sampler.num_retired),
            "perf/trainer_wait_seconds": wait_s,
        }
        if versions:
            metrics |= staleness_histogram(
                versions, trainer_version=version,
                max_off_policyness=self.cfg.rollout.max_off_policyness).to_scalars()
        metrics |= gate.to_scalars()
        metrics |= verifier_failures.metrics()
        metrics |= trajectory_metrics(
            samples, samples_per_prompt=self.cfg.rollout.samples_per_prompt,
            prefix_caching=not self.cfg.rollout.deterministic)  # SGLang's radix cache
        return metrics

    @staticmethod
    def train(step, seconds: float) -> dict[str, float]:
        """The optimizer step's report (trainer/step.py StepResult) as metrics."""
        return {"train/loss": step.loss, "train/grad_norm": step.grad_norm,
                "train/entropy": step.entropy, "train/is_clip_fraction": step.clip_fraction,
                "train/mean_ratio": step.mean_ratio,
                "train/logp_mismatch_mean": step.logp_mismatch,
                "train/logp_mismatch_max": step.logp_mismatch_max,
                "train/learning_rate": step.learning_rate, "train/skipped": float(step.skipped),
                "train/micro_batches": float(step.num_micro_batches),
                "train/routing_flip_fraction": step.routing_flip_fraction,
                "train/logp_mismatch_without_replay": step.logp_mismatch_without_replay,
                "perf/train_seconds": seconds,
                "perf/train_tokens_per_s": step.num_tokens / max(seconds, 1e-9)} | {
            # train/mismatch/kl_k1, kl_k3, ratio_p01 / p50 / p99, masked_*_fraction (issue 40)
            f"train/{name}": value for name, value in step.mismatch.items()} | (
            # colocated: what the trainer released for generation (trainer.py offload)
            {"colocated/trainer_offloaded_gib": step.offloaded_bytes / 2**30}
            if step.offloaded_bytes else {})

    def add_paused_busy(self, seconds: float) -> None:
        """Generator-seconds that requests in flight spent held by a weight-update pause."""
        self._paused_busy_s += seconds

    def _activity(self) -> list:
        from megatron_rl.rollout.async_client import activities

        return activities(self.clients)

    def _window_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Generator and trainer utilisation since the previous step's log."""
        from megatron_rl.rollout.async_client import activity_since

        now, activity = time.perf_counter(), self._activity()
        started, before, paused_busy = self._window
        self._window = (now, activity, self._paused_busy_s)
        wall = max(now - started, 1e-9)
        window = activity_since(activity, before)
        busy = sum(w.busy_s for w in window) - (self._paused_busy_s - paused_busy)
        out = {"perf/generator_busy_fraction": max(busy, 0.0) / (wall * len(activity)),
               "perf/generation_tokens_per_s": sum(w.tokens for w in window) / wall,
               # requests resent after a broken connection, whole run (async_client.py)
               "rollout/reconnects": float(sum(client.reconnects for client in self.clients))}
        step_s = metrics.get("perf/step_seconds")
        if step_s:
            out["perf/trainer_idle_fraction"] = metrics.get("perf/trainer_wait_seconds",
                                                            0.0) / step_s
            out["weight_sync/step_fraction"] = metrics.get("weight_sync/seconds", 0.0) / step_s
        return out

    def log(self, step: int, metrics: dict[str, float], *, version: int) -> None:
        """The step's metrics (and the window's) to TensorBoard and the progress bar."""
        metrics = metrics | self._window_metrics(metrics)
        if step % self.cfg.logging.log_interval == 0:
            for tag, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(tag, value, step)
            self.writer.flush()
        engines = metrics.get("rollout/engines_in_rotation", self.cfg.rollout.num_generators)
        self._progress.set_postfix(
            reward=f"{metrics.get('rollout/reward_mean', math.nan):.2f}",
            gen_busy=f"{metrics['perf/generator_busy_fraction']:.2f}",
            trainer_idle=f"{metrics.get('perf/trainer_idle_fraction', math.nan):.2f}",
            engines=f"{engines:.0f}/{self.cfg.rollout.num_generators}", version=version)
