"""Trainer side of tests/integration/test_routing_replay.py: one torchrun launch (1 rank).

Usage: torchrun --nproc-per-node 1 _routing_replay_worker.py MODEL_DIR GENERATOR_URL OUT_JSON

An FP32 Megatron trainer of MODEL_DIR's family (tiny Qwen3-MoE or Llama-4) gets weights that are
exactly representable in bf16, syncs them into the bf16 SGLang generator (lossless: identical
weights on both sides), and the generator samples completions with their routed experts. Through
the rollout path (Segment -> assemble_sample -> TrainBatch.from_groups) the trainer then scores
the same batch without replay (its own routing; flips counted in the same forward) and with
replay, checks per micro-batch that its routers used exactly the generator's experts, and takes
one replayed RL step (the routers' weights must move: the gating weights are the trainer's own).
Rank 0 writes the measurements to OUT_JSON.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _hf_families import family_for  # noqa: E402
from _weight_sync_worker import make_trainer  # noqa: E402

from megatron_rl.rollout import SamplingParams, SGLangGenerator, wait_for_health  # noqa: E402
from megatron_rl.rollout.samples import Segment, assemble_sample  # noqa: E402
from megatron_rl.trainer import RLTrainer, TrainBatch, pack_micro_batches  # noqa: E402

PROMPTS = [[5, 17, 42, 99], [200, 4, 31], [2, 30, 45, 61, 19], [7, 7, 250, 13, 6, 90]]  # < vocab
MAX_NEW_TOKENS = 24
NUM_SAMPLES = 4


def round_to_bf16(trainer: RLTrainer) -> None:
    """Make the FP32 trainer's weights bf16-representable, so that the bf16 generator holds the
    very same weights after a sync; only the compute precision differs."""
    from megatron_rl.trainer.model import unwrap

    with torch.no_grad():
        for param in unwrap(trainer.model).parameters():
            param.copy_(param.bfloat16().float())
    trainer.optimizer.reload_model_params()


def routed_batch(results) -> TrainBatch:
    groups = [[] for _ in PROMPTS]
    for r in results:  # the rollout path: one sampled segment per request
        groups[r.prompt_index].append(assemble_sample(
            group_id=r.prompt_index, sample_index=r.sample_index,
            prompt_token_ids=r.prompt_token_ids, segments=[Segment.from_generation(r)],
            finish_reason=r.finish_reason))
    advantages = [[1.0 if k % 2 == 0 else -1.0 for k in range(len(g))] for g in groups]
    return TrainBatch.from_groups(groups, advantages)


def experts_used_check(trainer: RLTrainer, batch: TrainBatch) -> dict:
    """One completion per micro-batch: after a replayed forward, the indices each router used
    equal the generator's table at every real position (as sets of experts)."""
    import functools

    from megatron_rl.trainer.routing_replay import REPLAY
    from megatron_rl.trainer.step import _fp32_logprob_head

    replay = trainer.routing_replay
    head = functools.partial(_fp32_logprob_head, groups=trainer.groups,
                             settings=trainer.settings.loss)
    checked = mismatched = 0
    trainer.model.eval()
    with torch.no_grad():
        for i in range(batch.num_samples):
            (mb,) = pack_micro_batches(batch, [i], max_tokens=10**6)
            replay.install(mb, REPLAY)
            trainer.model(mb.input_ids, mb.position_ids, None, padding_mask=mb.padding_mask,
                          output_processor=head, output_processor_context=mb)
            table = mb.routed_experts[0].long().reshape(mb.input_ids.shape[1],
                                                        replay.num_layers, replay.top_k)
            for layer, used in replay.used_indices().items():
                want = table[:, layer].sort(dim=1).values
                got = used.reshape(-1, replay.top_k).sort(dim=1).values
                checked += want.numel()
                mismatched += int((want != got).sum())
            replay.clear()
    return {"checked": checked, "mismatched": mismatched}


def summary(result) -> dict:
    return {"mean": result.abs_logp_diff_sum / result.num_loss_tokens,
            "max": result.abs_logp_diff_max, "num_loss_tokens": result.num_loss_tokens,
            "flip_fraction": result.num_routing_flips / max(result.num_routing_decisions, 1),
            "num_flips": result.num_routing_flips,
            "num_decisions": result.num_routing_decisions}


def main() -> None:
    from megatron_rl.trainer.model import unwrap
    from megatron_rl.weight_sync import WeightSync, WeightSyncSettings

    model_dir, url, out_path = sys.argv[1:4]
    family = family_for(model_dir)
    trainer = make_trainer(family, lr=1e-2, routing_replay_compare=True)
    round_to_bf16(trainer)
    wait_for_health(url, timeout_s=240)
    generator = SGLangGenerator(url, request_timeout_s=120, max_retries=2,
                                return_routed_experts=True)
    WeightSync(trainer.model, family.weight_groups(), [generator],
               WeightSyncSettings(dtype=torch.bfloat16, bucket_bytes=2**20, timeout_s=120),
               hf_vocab_size=family.hf_config.vocab_size).sync()

    started = time.perf_counter()
    results = generator.generate(PROMPTS, SamplingParams(
        max_new_tokens=MAX_NEW_TOKENS, temperature=1.0, num_samples=NUM_SAMPLES, seed=11))
    out: dict = {"generate_s": time.perf_counter() - started}
    table = results[0].routed_experts
    out["table"] = {"dtype": str(table.dtype), "shape": list(table.shape),
                    "rows_expected": len(results[0].prompt_token_ids)
                    + len(results[0].token_ids) - 1,
                    "num_layers": trainer.config.num_layers,
                    "top_k": trainer.config.moe_router_topk,
                    "num_experts": trainer.config.num_moe_experts,
                    "max_id": max(int(r.routed_experts.max()) for r in results),
                    "bytes_per_token": table.element_size() * table.shape[1]}
    batch = routed_batch(results)
    out["without_replay"] = summary(trainer.score(batch, replay=False))
    out["with_replay"] = summary(trainer.score(batch, replay=True))
    out["experts_used"] = experts_used_check(trainer, batch)

    routers = trainer.routing_replay.routers
    before = [r.weight.detach().clone() for r in routers]
    metrics = trainer.train_step(batch)
    out["step"] = {"flip_fraction": metrics.routing_flip_fraction,
                   "logp_mismatch": metrics.logp_mismatch, "skipped": metrics.skipped,
                   "logp_mismatch_without_replay": metrics.logp_mismatch_without_replay,
                   "router_update": max(float((r.weight - b).abs().max())
                                        for r, b in zip(routers, before))}
    del unwrap
    with open(out_path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
