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

import torch

from megatron_rl.config import load_config, save_config

from examples.tiny_cpu.sampler import sample
from examples.tiny_cpu.toy_task import make_prompts, verify

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.yaml"
# One process: the demo's generator shares the trainer's model, so the trainer must be one rank.
DEMO_OVERRIDES = ("parallelism.world_size=1", "parallelism.expert_model_parallel_size=1",
                  "train.num_steps=40", "train.global_batch_size=32", "train.lr=5e-3",
                  "eval.interval_steps=4", "eval.num_heldout_prompts=32",
                  "eval.samples_per_prompt=4", "checkpoint.interval_steps=20",
                  "algorithm.no_positive_resampling=false")
PROMPT_LEN, COMPLETION_LEN = 8, 12


def main(argv: list[str]) -> int:
    path = argv[0] if argv and argv[0].endswith((".yaml", ".yml")) else DEFAULT_CONFIG
    overrides = argv[1:] if path != DEFAULT_CONFIG else argv
    cfg = load_config(path, [*DEMO_OVERRIDES, *overrides])
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")

    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from megatron_rl.algorithms import (NoPositiveResamplingSampler, compute_advantages,
                                        group_pass_rates, zero_variance_mask)
    from megatron_rl.scaling.log import ScalingLog
    from megatron_rl.trainer import RLTrainer, TrainBatch, TrainerSettings
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
    start = None

    def device_hours() -> float:  # CPU processes stand in for accelerators on this run
        return 0.0 if start is None else \
            (time.perf_counter() - start) / 3600 * cfg.parallelism.world_size

    def validate(step: int) -> float:
        prompts = heldout.repeat_interleave(cfg.eval.samples_per_prompt, dim=0)
        tokens, _ = sample(trainer.model, prompts, COMPLETION_LEN,
                           temperature=cfg.rollout.temperature, generator=rng)
        pass_rate = float(verify(tokens[:, PROMPT_LEN:], vocab).mean())
        curve.append(step, device_hours(), {"all": pass_rate})
        return pass_rate

    pass_rate = validate(0)  # R0, at compute 0
    start = time.perf_counter()
    progress = tqdm(range(1, cfg.train.num_steps + 1), desc="tiny RL", unit="step")
    for step in progress:
        prompt_ids = npr.sample(cfg.prompts_per_step)
        prompts = train_prompts[prompt_ids].repeat_interleave(group, dim=0)
        tokens, behaviour_logprobs = sample(trainer.model, prompts, COMPLETION_LEN,
                                            temperature=cfg.rollout.temperature, generator=rng)
        rewards = verify(tokens[:, PROMPT_LEN:], vocab).view(-1, group)  # [prompts, G]
        npr.update(prompt_ids, group_pass_rates(rewards).tolist())
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
        for tag, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                writer.add_scalar(tag, value, step)
        if step % cfg.eval.interval_steps == 0 or step == cfg.train.num_steps:
            pass_rate = validate(step)
        if step % cfg.checkpoint.interval_steps == 0:
            trainer.save_checkpoint(str(Path(cfg.checkpoint_dir) / f"step_{step:06d}"),
                                    extra_state={"npr": npr.state_dict()})
        progress.set_postfix(reward=f"{metrics['rollout/reward_mean']:.2f}",
                             val=f"{pass_rate:.2f}")
    writer.close()
    print(f"\nvalidation pass rate: step 0 -> step {cfg.train.num_steps}: "
          f"{_first_last(out)}; outputs in {out}/")
    return _fit(out)


def _train_batch(tokens, behaviour_logprobs, advantages, keep, group) -> "TrainBatch":
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


def _fit(out: Path) -> int:
    """Fit the sigmoid to the run's own curve (needs a few points above R0 to be meaningful)."""
    from megatron_rl.scaling.cli import main as fit_main

    return fit_main([str(out), "--out-dir", str(out)])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
