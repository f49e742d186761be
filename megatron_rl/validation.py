"""Validation metrics per task: mean@k pass rates on the held-out set (SCALERL.md section 1: the
mean over prompts of the fraction of a prompt's k samples that are correct) and mean rewards, one
value per task plus "all" (the mean over every held-out prompt, each prompt weighing the same),
and the hand-off of those pass rates to the scaling-curve log (megatron_rl/scaling/log.py).

Pass rates count correct samples (`RewardResult.passed`), not rewards, so they stay in [0, 1]
whatever the reward scale (e.g. -1 for incorrect).

Samples whose verifier failed (after the registry's retry; reward None) are no verdict and are
excluded: a prompt's pass rate and mean reward are taken over its verified samples only (the best
estimate of its pass probability from what was measured), every prompt with at least one verified
sample still weighs the same in mean@k, and a prompt none of whose samples were verified is left
out. The metrics report how many samples and prompts were excluded.
"""
from __future__ import annotations

import dataclasses
import os
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from megatron_rl.data.records import OVERALL_TASK, PromptRecord
from megatron_rl.rewards.registry import RewardRegistry


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ScoredSample:
    prompt_id: str
    task: str
    reward: float | None  # None: the verifier failed; excluded from the metrics
    passed: bool

    def __post_init__(self) -> None:
        if self.reward is None and self.passed:
            raise ValueError(f"sample of prompt {self.prompt_id!r}: a failed verification "
                             "(reward None) cannot have passed")

    @property
    def verifier_failed(self) -> bool:
        return self.reward is None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ValidationMetrics:
    """Per-task dicts, each with OVERALL_TASK ("all"). A task none of whose prompts had a
    verified sample has no pass rate or mean reward, only its counts (0 prompts)."""

    pass_rate_by_task: dict[str, float]    # mean@k over prompts with a verified sample
    mean_reward_by_task: dict[str, float]
    num_prompts_by_task: dict[str, int]    # prompts counted in the pass rate
    num_excluded_samples_by_task: dict[str, int]  # failed verifications
    num_excluded_prompts_by_task: dict[str, int]  # prompts without a single verified sample
    samples_per_prompt: int


def score_samples(registry: RewardRegistry, records: Sequence[PromptRecord],
                  completions: Sequence[Sequence[str]], *,
                  num_threads: int = 8) -> list[ScoredSample]:
    """Grade completions[i][j] (sample j of prompt i) against records[i]; verifier failures
    are re-scored once (`RewardRegistry.score_many`) and otherwise come back with reward None."""
    if len(records) != len(completions):
        raise ValueError(f"{len(records)} records but {len(completions)} completion groups")
    flat_records = [r for r, group in zip(records, completions) for _ in group]
    flat_completions = [c for group in completions for c in group]
    results = registry.score_many(flat_completions, flat_records, num_threads=num_threads)
    return [ScoredSample(prompt_id=r.prompt_id, task=r.task, reward=res.reward, passed=res.passed)
            for r, res in zip(flat_records, results)]


def validation_metrics(samples: Sequence[ScoredSample], *,
                       samples_per_prompt: int | None = None) -> ValidationMetrics:
    """Per-task mean@k. Every prompt must have the same number of samples k (checked against
    `samples_per_prompt` when given): mean@k with uneven k would weigh prompts unequally. Failed
    verifications count towards k but not towards the rates (module docstring)."""
    if not samples:
        raise ValueError("no scored samples: validation needs at least one prompt")
    if all(s.verifier_failed for s in samples):
        raise ValueError(f"the verifier failed on all {len(samples)} validation samples: nothing "
                         "to measure; check the sandbox / math-verify workers / scorers")
    by_prompt: dict[str, list[ScoredSample]] = defaultdict(list)
    for sample in samples:
        by_prompt[sample.prompt_id].append(sample)
    counts = {len(group) for group in by_prompt.values()}
    k = samples_per_prompt if samples_per_prompt is not None else max(counts)
    if counts != {k}:
        uneven = {pid: len(g) for pid, g in by_prompt.items() if len(g) != k}
        raise ValueError(f"every prompt needs exactly {k} samples for mean@{k}; these differ: "
                         f"{dict(list(uneven.items())[:5])}")
    pass_rates: dict[str, list[float]] = defaultdict(list)
    rewards: dict[str, list[float]] = defaultdict(list)
    excluded_samples: dict[str, int] = defaultdict(int)
    excluded_prompts: dict[str, int] = defaultdict(int)
    for prompt_id, group in by_prompt.items():
        tasks = {s.task for s in group}
        if len(tasks) != 1:
            raise ValueError(f"prompt {prompt_id!r} has samples of several tasks {tasks}")
        verified = [s for s in group if not s.verifier_failed]
        for task in (tasks.pop(), OVERALL_TASK):
            excluded_samples[task] += k - len(verified)
            excluded_prompts[task] += not verified
            if verified:
                pass_rates[task].append(sum(s.passed for s in verified) / len(verified))
                rewards[task].append(sum(s.reward for s in verified) / len(verified))
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    return ValidationMetrics(
        pass_rate_by_task={task: mean(v) for task, v in pass_rates.items()},
        mean_reward_by_task={task: mean(v) for task, v in rewards.items()},
        num_prompts_by_task={task: len(pass_rates.get(task, ())) for task in excluded_samples},
        num_excluded_samples_by_task=dict(excluded_samples),
        num_excluded_prompts_by_task=dict(excluded_prompts),
        samples_per_prompt=k)


def log_validation(scaling_log: Any, step: int, compute_gpu_hours: float,
                   metrics: ValidationMetrics, tb_writer: Any = None) -> None:
    """Append the per-task pass rates to the scaling-curve log (one curve per task plus "all");
    mean rewards and the excluded (failed-verification) counts go to TensorBoard only
    (`val/mean_reward/<task>`, `val/excluded_samples/<task>`, `val/excluded_prompts/<task>`).
    `scaling_log` is a `megatron_rl.scaling.log.ScalingLog` (keep one per run: it checks that
    steps increase) or a run directory to open one in."""
    if isinstance(scaling_log, (str, os.PathLike)):
        from megatron_rl.scaling.log import ScalingLog  # lazily: owned by the scaling package

        scaling_log = ScalingLog(scaling_log, tb_writer)
    scaling_log.append(step, compute_gpu_hours, metrics.pass_rate_by_task)
    if tb_writer is not None:
        for task, value in metrics.mean_reward_by_task.items():
            tb_writer.add_scalar(f"val/mean_reward/{task}", value, global_step=step)
        for task, count in metrics.num_excluded_samples_by_task.items():
            tb_writer.add_scalar(f"val/excluded_samples/{task}", count, global_step=step)
        for task, count in metrics.num_excluded_prompts_by_task.items():
            tb_writer.add_scalar(f"val/excluded_prompts/{task}", count, global_step=step)
        tb_writer.flush()


def write_validation_samples(path: str | os.PathLike, step: int,
                             records: Sequence[PromptRecord],
                             completions: Sequence[Sequence[str]],
                             scored: Sequence[ScoredSample]) -> None:
    """One JSON line per held-out sample (step, prompt id, task, prompt, completion text,
    reward, passed) into `path` (written whole to a temporary file, then renamed), so that a
    run's completions can be read at every validation (`megatron-rl train` writes
    output_dir/validation_samples/step_<N>.jsonl)."""
    from pathlib import Path

    from megatron_rl.resilience.ledger import write_jsonl

    flat = [(r, c) for r, group in zip(records, completions) for c in group]
    if len(flat) != len(scored):
        raise ValueError(f"{len(flat)} completions but {len(scored)} scored samples")
    write_jsonl(Path(path), ({"step": step, "prompt_id": record.prompt_id, "task": record.task,
                              "prompt": record.prompt, "completion": completion,
                              "reward": sample.reward, "passed": sample.passed}
                             for (record, completion), sample in zip(flat, scored)))


class HeldoutValidation:
    """A run's validation: mean@k per task on the held-out prompts with the current weights ->
    the scaling log, TensorBoard and output_dir/validation_samples/step_<N>.jsonl.

    The requests go through the rollout manager (`manager.run_anywhere`: a sample whose
    generator fails midway is generated again, the same, on another); `wait(coroutine)` runs
    them on the rollout loop while the generators are health-checked. Records whose environment
    is multi-turn (`multi_turn`, rollout/multi_turn.py) run their trajectories in the same
    environments as training, which score them (no re-scoring); their samples file holds the
    whole decoded trajectory, observations included."""

    def __init__(self, cfg, out, *, tokenizer, registry: RewardRegistry,
                 records: Sequence[PromptRecord], prompt_ids: Sequence[Sequence[int]],
                 manager, interruption, wait, multi_turn=None):
        self.cfg, self.out, self.tokenizer, self.registry = cfg, out, tokenizer, registry
        self.records, self.prompt_ids = records, prompt_ids
        self.manager, self.interruption, self._wait = manager, interruption, wait
        self.multi_turn = multi_turn  # rollout.multi_turn.MultiTurnRollout, or None

    def __call__(self, step: int, *, version: int, metrics) -> None:
        """Validate the weights of policy `version` after `step`; `metrics` is the run's
        RunMetrics (scaling log, TensorBoard writer, compute axis)."""
        import time

        started = time.perf_counter()
        k = self.cfg.eval.samples_per_prompt
        compute_gpu_hours = metrics.compute_gpu_hours  # spent on the policy validated here
        completions = self._wait(self._generate(k, version))
        texts = [[self.tokenizer.decode(s.token_ids) for s, _ in group] for group in completions]
        scored = self._score(texts, completions)
        write_validation_samples(self.out / "validation_samples" / f"step_{step:06d}.jsonl",
                                 step, self.records, texts, scored)
        log_validation(metrics.scaling_log, step, compute_gpu_hours,
                       validation_metrics(scored, samples_per_prompt=k), tb_writer=metrics.writer)
        if metrics.writer is not None:  # the pass's cost: generation, scoring, the samples file
            metrics.writer.add_scalar("perf/validation_seconds", time.perf_counter() - started,
                                      step)
            metrics.writer.flush()

    def _score(self, texts: list[list[str]], completions: list) -> list[ScoredSample]:
        """Single-turn groups scored by the registry (in one batch); multi-turn ones carry their
        environment's results. In the records' order."""
        single = [i for i, group in enumerate(completions) if group[0][1] is None]
        by_verifier = iter(score_samples(self.registry, [self.records[i] for i in single],
                                         [texts[i] for i in single]) if single else ())
        scored = []
        for record, group in zip(self.records, completions):
            for _, result in group:
                if result is None:
                    scored.append(next(by_verifier))
                else:
                    scored.append(ScoredSample(prompt_id=record.prompt_id, task=record.task,
                                               reward=result.reward, passed=result.passed))
        return scored

    async def _generate(self, k: int, version: int) -> list:
        """[prompt][sample] -> (RolloutSample, its environment's RewardResult for a multi-turn
        record, None for a single-turn one)."""
        import asyncio
        import random

        from megatron_rl.rollout import SamplingParams
        from megatron_rl.rollout.interruption import bind_generate
        from megatron_rl.rollout.multi_turn import generate_sample

        params = SamplingParams(max_new_tokens=1, temperature=self.cfg.rollout.temperature,
                                seed=self.cfg.seed, purpose="eval")

        def one(index: int, prompt: Sequence[int], sample: int):
            # Each sample its own seed (SamplingParams.seed), the same at every validation: the
            # curve's points differ by the policy, not by the sampling noise. So a sample whose
            # generator fails midway is generated again, the same, on another.
            def request(client):
                generate_one = bind_generate(
                    client, params.for_sample("eval", index, sample),
                    extra_key=self.manager.prefix_cache_key(version),
                    continuation_priority=self.interruption.continuation_priority)
                return generate_sample(
                    generate_one, prompt, self.records[index], multi_turn=self.multi_turn,
                    interruption=self.interruption, rng=random.Random(f"eval/{index}/{sample}"),
                    group_id=index, sample_index=sample)

            return self.manager.run_anywhere(index, request)

        groups = [[one(i, prompt, j) for j in range(k)] for i, prompt in enumerate(self.prompt_ids)]
        flat = await asyncio.gather(*(c for group in groups for c in group))
        return [flat[i * k:(i + 1) * k] for i in range(len(groups))]
