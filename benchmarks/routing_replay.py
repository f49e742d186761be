"""Routing replay: what it buys (train / generator log-prob agreement, routing flips) and what it
costs (bytes per token, step time), bf16 SGLang generator vs FP32 Megatron trainer.

A tiny random MoE (Qwen3-MoE: 4 experts top-2, or Llama-4: 4 experts top-1 + shared expert; the
tests' models) is served by SGLang's CPU engine in bf16 with --enable-return-routed-experts; an
FP32 trainer in this process holds the very same weights (made bf16-representable, then synced
losslessly). The generator samples completions with their routed experts, and the trainer scores
the batch:
- |logp_train - logp_gen| mean and max over the completion tokens, and the routing-flip fraction
  (the (token, layer) decisions where the trainer's own top-k differs from the generator's,
  counted in the same forward), without and with replay;
- bytes per token: stored (uint8/uint16 ids, layers x top-k per position) and on the wire
  (SGLang sends int32 ids, base64-encoded);
- time of the trainer's forward + backward over the batch with replay vs without routing data,
  alternating (--repeats, >= 3), median and min-max; the optimizer update, identical either way,
  is not included. Also the generation time with and without `return_routed_experts` in the
  request (the server records routing either way; the request adds the read-back and encoding).

    .venv/bin/python benchmarks/routing_replay.py [--family qwen3_moe|llama4] [--repeats 5]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # the tests' tiny HF models

PROMPTS = [[5, 17, 42, 99], [200, 4, 31], [2, 30, 45, 61, 19], [7, 7, 250, 13, 6, 90],
           [11, 12, 13], [100, 101, 9, 8]]


def build(family_name: str, directory: Path):
    from _hf_families import family_for, save_tiny_llama4, save_tiny_qwen3_moe

    from megatron_rl.rollout import SGLangServer, SGLangServerSettings
    from megatron_rl.trainer import (LossSettings, OptimizerSettings, ParallelLayout,
                                     RLTrainer, TrainerSettings)
    from megatron_rl.trainer.model import unwrap

    save = {"qwen3_moe": save_tiny_qwen3_moe, "llama4": save_tiny_llama4}[family_name]
    model_dir = save(directory / "model")
    server = SGLangServer.launch(SGLangServerSettings(
        model_path=str(model_dir), dtype="bfloat16", mem_fraction_static=0.2,
        max_total_tokens=8192, enable_return_routed_experts=True, startup_timeout_s=300,
        log_path=str(directory / "server.log")), wait=False)
    family = family_for(str(model_dir))
    trainer = RLTrainer(TrainerSettings(
        model_name="bench", model_size="tiny", layout=ParallelLayout(), precision="fp32",
        loss=LossSettings(kind="cispo", aggregation="prompt", logprob_chunk_size=256),
        optimizer=OptimizerSettings(lr=1e-3, lr_warmup_steps=0, clip_grad=0.0),
        micro_batch_max_tokens=4096, seed=7), family=family)
    with torch.no_grad():  # bf16-representable: the generator holds the very same weights
        for param in unwrap(trainer.model).parameters():
            param.copy_(param.bfloat16().float())
    trainer.optimizer.reload_model_params()
    server.wait_until_healthy()
    return server, trainer, family


def sync_and_sample(server, trainer, family, *, max_new_tokens: int, num_samples: int):
    from megatron_rl.rollout import SamplingParams, SGLangGenerator
    from megatron_rl.rollout.samples import Segment, assemble_sample
    from megatron_rl.trainer import TrainBatch
    from megatron_rl.weight_sync import WeightSync, WeightSyncSettings

    generator = SGLangGenerator(server.url, return_routed_experts=True)
    WeightSync(trainer.model, family.weight_groups(), [generator],
               WeightSyncSettings(dtype=torch.bfloat16, bucket_bytes=2**20, timeout_s=120),
               hf_vocab_size=family.hf_config.vocab_size).sync()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0,
                            num_samples=num_samples, seed=11)
    results = generator.generate(PROMPTS, params)
    groups = [[] for _ in PROMPTS]
    for r in results:
        groups[r.prompt_index].append(assemble_sample(
            group_id=r.prompt_index, sample_index=r.sample_index,
            prompt_token_ids=r.prompt_token_ids, segments=[Segment.from_generation(r)],
            finish_reason=r.finish_reason))
    advantages = [[1.0 if k % 2 == 0 else -1.0 for k in range(len(g))] for g in groups]
    return generator, params, results, TrainBatch.from_groups(groups, advantages)


def forward_backward_seconds(trainer, batch) -> float:
    from megatron_rl.algorithms import AggregationDenominators
    from megatron_rl.trainer.step import run_forward_backward

    denominators = AggregationDenominators.from_sample_token_counts(
        batch.sample_num_loss_tokens(), batch.prompt_of_sample())
    trainer.model.train()
    trainer.model.zero_grad_buffer()
    started = time.perf_counter()
    run_forward_backward(trainer.model, trainer.micro_batches(batch), trainer.groups,
                         denominators, trainer.settings.loss, temperature=1.0,
                         routing_replay=trainer.routing_replay,
                         replay_mode=trainer.replay_mode(batch))
    return time.perf_counter() - started


def alternate(run_a, run_b, repeats: int) -> tuple[list[float], list[float]]:
    run_a(), run_b()  # warm-up
    a, b = [], []
    for _ in range(repeats):
        a.append(run_a())
        b.append(run_b())
    return a, b


def spread(values: list[float], scale: float = 1e3) -> str:
    return (f"{statistics.median(values) * scale:8.1f} "
            f"({min(values) * scale:.1f}-{max(values) * scale:.1f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=("qwen3_moe", "llama4"), default="qwen3_moe")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--num-samples", type=int, default=4)
    args = parser.parse_args()
    if args.repeats < 3:
        parser.error("--repeats must be >= 3")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        server, trainer, family = build(args.family, Path(tmp))
        try:
            generator, params, results, batch = sync_and_sample(
                server, trainer, family, max_new_tokens=args.max_new_tokens,
                num_samples=args.num_samples)
            free, replayed = trainer.score(batch, replay=False), trainer.score(batch, replay=True)
            table = batch.routed_experts[0]
            stored = table.element_size() * table.shape[1]
            wire = 4 * table.shape[1] * 4 / 3  # int32 ids, base64
            plain = dataclasses.replace(batch, routed_experts=None)
            with_replay, without = alternate(lambda: forward_backward_seconds(trainer, batch),
                                             lambda: forward_backward_seconds(trainer, plain),
                                             args.repeats)
            from megatron_rl.rollout import SGLangGenerator

            no_routing = SGLangGenerator(server.url)  # same server, routing not requested

            def timed(client):
                def run():
                    client.flush_cache()
                    started = time.perf_counter()
                    client.generate(PROMPTS, params)
                    return time.perf_counter() - started
                return run

            gen_with, gen_without = alternate(timed(generator), timed(no_routing), args.repeats)
        finally:
            server.shutdown()

    def row(name, result):
        tokens = max(result.num_loss_tokens, 1)
        flips = result.num_routing_flips / max(result.num_routing_decisions, 1)
        print(f"{name:<16} {result.abs_logp_diff_sum / tokens:12.5f} "
              f"{result.abs_logp_diff_max:12.5f} {flips:10.4f} "
              f"({result.num_routing_flips}/{result.num_routing_decisions})")

    config = trainer.config
    print(f"\n{args.family}: {config.num_layers} layers, {config.num_moe_experts} experts, "
          f"top-{config.moe_router_topk}; bf16 SGLang generator vs FP32 trainer, identical "
          f"weights; {len(results)} completions, {free.num_loss_tokens} completion tokens")
    print(f"{'':<16} {'|dlogp| mean':>12} {'|dlogp| max':>12} {'flip frac':>10}")
    row("without replay", free)
    row("with replay", replayed)
    print(f"\nbytes per token: {stored} stored ({table.dtype}, {config.num_layers} layers x "
          f"top-{config.moe_router_topk}), {wire:.1f} on the wire (int32, base64)")
    ratio = statistics.median(with_replay) / statistics.median(without)
    print(f"\ntrainer forward+backward, median (min-max) ms over {args.repeats} alternating runs:")
    print(f"  with replay    {spread(with_replay)}")
    print(f"  no routing     {spread(without)}")
    print(f"  ratio {ratio:.3f}")
    gen_ratio = statistics.median(gen_with) / statistics.median(gen_without)
    print(f"generation of {len(results)} completions, median (min-max) ms:")
    print(f"  routed experts requested {spread(gen_with)}")
    print(f"  not requested            {spread(gen_without)}")
    print(f"  ratio {gen_ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
