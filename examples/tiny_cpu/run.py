"""The tiny CPU run (`make demo`): the ScaleRL recipe end to end on one CPU process.

generate -> verify -> zero-variance filter -> advantages -> CISPO train step (Megatron, FP32 head,
prompt-level aggregation) -> validation (mean@k) -> scaling log -> checkpoint, then a sigmoid fit of
the validation curve. Generation is the in-process stand-in of examples/tiny_cpu/sampler.py until
the SGLang generators and the Pipeline-RL loop drive this run; the trainer, algorithms, sampler,
scaling log and fit are the library's own. Usage:

    python -m examples.tiny_cpu.run [CONFIG.yaml] [section.field=value ...]

Outputs under output_dir: tensorboard/, scaling.jsonl, checkpoints/, config.yaml, curve PNGs.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from megatron_rl.config import ConfigError, load_config, save_config
from megatron_rl.console import environment_summary, quiet_known_warnings, verbose_requested

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
# One process: the demo's generator shares the trainer's model, so the trainer must be one rank.
DEMO_OVERRIDES = ("parallelism.world_size=1", "parallelism.expert_model_parallel_size=1",
                  "train.num_steps=40", "train.global_batch_size=32", "train.lr=5e-3",
                  "eval.interval_steps=4", "eval.num_heldout_prompts=32",
                  "eval.samples_per_prompt=4", "checkpoint.interval_steps=20",
                  "algorithm.no_positive_resampling=false")
PROMPT_LEN, COMPLETION_LEN = 8, 12
# This in-process run has no SGLang generators, weight sync or Pipeline-RL schedule: fields that
# configure those (and fields of generation it does not do: budgets, interruption, the HF start
# checkpoint) would be silently ignored, so overriding them here is an error. The recipe file's
# values are for the loop that will drive this run (megatron-rl train, issue 12).
NOT_HONOURED = ("model.hf_checkpoint", "rollout.", "weight_sync.")
HONOURED_ROLLOUT = ("rollout.temperature", "rollout.top_p", "rollout.samples_per_prompt")


def main(argv: list[str]) -> int:
    verbose, argv = verbose_requested(argv)  # -v / MEGATRON_RL_VERBOSE=1: every warning
    quiet_known_warnings(verbose=verbose)  # before torch is imported: it warns at import
    print(environment_summary(), file=sys.stderr)
    path = argv[0] if argv and argv[0].endswith((".yaml", ".yml")) else DEFAULT_CONFIG
    overrides = argv[1:] if path != DEFAULT_CONFIG else argv
    try:
        _refuse_unhonoured(overrides)
        cfg = load_config(path, [*DEMO_OVERRIDES, *overrides])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")

    import torch
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from examples.tiny_cpu.sampler import sample
    from examples.tiny_cpu.toy_task import make_prompts, verify

    from megatron_rl.algorithms import (NoPositiveResamplingSampler, compute_advantages,
                                        group_pass_rates, zero_variance_mask)
    from megatron_rl.scaling.log import ScalingLog
    from megatron_rl.trainer import (RLTrainer, TrainerSettings, checkpoint_name,
                                     prune_checkpoints)
    from models import get_model_family

    vocab = get_model_family(cfg.model.name).model_kwargs(cfg.model.size)["vocab_size"]
    trainer = RLTrainer(TrainerSettings.from_run_config(cfg))
    group = cfg.rollout.samples_per_prompt
    train_prompts = make_prompts(256, PROMPT_LEN, vocab, seed=cfg.seed)
    heldout = make_prompts(cfg.eval.num_heldout_prompts, PROMPT_LEN, vocab, seed=cfg.seed + 1)
    npr = NoPositiveResamplingSampler(len(train_prompts), threshold=cfg.algorithm.npr_threshold,
                                      seed=cfg.seed,
                                      enabled=cfg.algorithm.no_positive_resampling)
    rng = torch.Generator().manual_seed(cfg.seed)
    writer = SummaryWriter(cfg.tensorboard_dir)
    curve = ScalingLog(out, tb_writer=writer)
    first_step, compute_offset = 1, 0.0
    if cfg.checkpoint.load is not None:  # continue a run: weights, optimizer, NPR, sampler RNG
        run_state = trainer.load_checkpoint(cfg.checkpoint.load).extra_state
        npr.load_state_dict(run_state["npr"])
        rng.set_state(run_state["sampler_rng"])
        first_step, compute_offset = run_state["step"] + 1, run_state["compute_gpu_hours"]
    start = None

    def device_hours() -> float:  # CPU processes stand in for accelerators on this run
        return compute_offset if start is None else compute_offset + \
            (time.perf_counter() - start) / 3600 * cfg.parallelism.world_size

    def validate(step: int) -> float:
        prompts = heldout.repeat_interleave(cfg.eval.samples_per_prompt, dim=0)
        tokens, _ = sample(trainer.model, prompts, COMPLETION_LEN,
                           temperature=cfg.rollout.temperature, generator=rng)
        pass_rate = float(verify(tokens[:, PROMPT_LEN:], vocab).mean())
        curve.append(step, device_hours(), {"all": pass_rate})
        return pass_rate

    # R0 at compute 0 (a resumed run measured it before).
    pass_rate = validate(0) if cfg.eval.at_step_zero and first_step == 1 else math.nan
    start = time.perf_counter()
    progress = tqdm(range(first_step, cfg.train.num_steps + 1), desc=cfg.name, unit="step",
                    disable=not cfg.logging.progress_bar)
    for step in progress:
        prompt_ids = npr.sample(cfg.prompts_per_step)
        prompts = train_prompts[prompt_ids].repeat_interleave(group, dim=0)
        tokens, behaviour_logprobs = sample(trainer.model, prompts, COMPLETION_LEN,
                                            temperature=cfg.rollout.temperature, generator=rng)
        correct = verify(tokens[:, PROMPT_LEN:], vocab)  # [prompts * G]
        npr.update(prompt_ids, group_pass_rates(correct.view(-1, group)).tolist())
        rewards = _shaped_rewards(correct, cfg.algorithm).view(-1, group)  # [prompts, G]
        keep = zero_variance_mask(rewards) if cfg.algorithm.zero_variance_filter \
            else torch.ones(len(prompt_ids), dtype=torch.bool)
        metrics = {"rollout/reward_mean": float(rewards.mean()),
                   "rollout/kept_prompts": int(keep.sum())}
        if keep.any():
            advantages = compute_advantages(rewards, cfg.algorithm.advantage_normalization,
                                            keep=keep)
            batch = _train_batch(tokens, behaviour_logprobs, advantages, keep, group)
            step_metrics = trainer.train_step(batch)
            metrics.update({f"train/{k}": v for k, v in vars_of(step_metrics).items()})
        if step % cfg.logging.log_interval == 0:
            for tag, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    writer.add_scalar(tag, value, step)
        if step % cfg.eval.interval_steps == 0 or step == cfg.train.num_steps:
            pass_rate = validate(step)
        if step % cfg.checkpoint.interval_steps == 0:
            trainer.save_checkpoint(
                str(Path(cfg.checkpoint_dir) / checkpoint_name(step)),
                extra_state={"npr": npr.state_dict(), "sampler_rng": rng.get_state(),
                             "step": step, "compute_gpu_hours": device_hours()})
            prune_checkpoints(cfg.checkpoint_dir, cfg.checkpoint.keep_last)
        progress.set_postfix(reward=f"{metrics['rollout/reward_mean']:.2f}",
                             val=f"{pass_rate:.2f}")
    writer.close()
    print(f"\nvalidation pass rate: step 0 -> step {cfg.train.num_steps}: "
          f"{_first_last(out)}; outputs in {out}/")
    return _fit(out, cfg.eval.warmup_compute_gpu_hours)


def _refuse_unhonoured(overrides: list[str]) -> None:
    for text in overrides:
        key = text.partition("=")[0].strip()
        if key.startswith(NOT_HONOURED) and key not in HONOURED_ROLLOUT:
            raise ConfigError(
                f"{key}: this in-process demo has no SGLang generators, weight sync or Pipeline-RL "
                "schedule, so the field would be ignored; it takes effect once the Pipeline-RL "
                "loop drives this run (megatron-rl train). Remove the override.")


def _shaped_rewards(correct: "torch.Tensor", algorithm) -> "torch.Tensor":
    """Verifier rewards, plus the DAPO overlong penalty on correct answers when configured."""
    if not algorithm.length_penalty:
        return correct
    import torch

    from megatron_rl.algorithms import length_penalty

    lengths = torch.full(correct.shape, COMPLETION_LEN)
    return correct + length_penalty(lengths, correct > 0,
                                    max_length=algorithm.length_penalty_max_length,
                                    cache_length=algorithm.length_penalty_cache_length)


def _train_batch(tokens, behaviour_logprobs, advantages, keep, group) -> "TrainBatch":
    import torch

    from megatron_rl.trainer import TrainBatch

    rows = [i for i in range(tokens.shape[0]) if keep[i // group]]
    loss_mask = torch.zeros(tokens.shape[1], dtype=torch.long)
    loss_mask[PROMPT_LEN:] = 1  # only the sampled tokens carry the loss
    kept_prompts = {p: n for n, p in enumerate(sorted({i // group for i in rows}))}
    return TrainBatch(
        token_ids=[tokens[i] for i in rows], loss_mask=[loss_mask] * len(rows),
        old_logprobs=[behaviour_logprobs[i] for i in rows],
        advantages=torch.stack([advantages.flatten()[i] for i in rows]).float(),
        prompt_ids=torch.tensor([kept_prompts[i // group] for i in rows]),
        sample_ids=torch.arange(len(rows)))


def vars_of(metrics) -> dict:
    return {name: getattr(metrics, name) for name in metrics.__dataclass_fields__}


def _first_last(out: Path) -> str:
    from megatron_rl.scaling.log import read_scaling_log

    series = read_scaling_log(out)["all"]
    return f"{series.pass_rate[0]:.3f} -> {series.pass_rate[-1]:.3f}"


def _fit(out: Path, warmup_gpu_hours: float) -> int:
    """Fit the sigmoid to the run's own curve; a run too short for a fit says so and still
    succeeds (its outputs are whole)."""
    from megatron_rl.scaling.cli import main as fit_main
    from megatron_rl.scaling.log import read_scaling_log
    from megatron_rl.scaling.sigmoid import SigmoidFitConfig, fit_point_mask

    series = read_scaling_log(out)["all"]
    usable = int(fit_point_mask(series.compute_gpu_hours, warmup_gpu_hours).sum())
    needed = SigmoidFitConfig().min_points
    if usable < needed:
        print(f"no curve fit: {usable} validation point(s) past compute 0 and the warm-up "
              f"({warmup_gpu_hours} GPU-hours), a fit needs {needed}; run more steps or "
              "validate more often (eval.interval_steps)")
        return 0
    return fit_main([str(out), "--out-dir", str(out), "--warmup-gpu-hours",
                     repr(warmup_gpu_hours)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
