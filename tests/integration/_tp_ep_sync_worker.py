"""Trainer side of the tensor- / expert-parallel engine tests (test_sglang_tp_ep*.py): one
torchrun launch (2 ranks) syncing a Megatron trainer into a multi-rank SGLang engine, or into
several engines at once (GENERATOR_URLS comma-separated: all of them serve MODEL_DIR's model).

Usage: torchrun --nproc-per-node 2 _tp_ep_sync_worker.py MODEL_DIR GENERATOR_URLS OUT_JSON LAYOUT
LAYOUT (the trainer's, on 2 ranks): "tp2" (TP2 + SP, EP1), "ep2" (TP1, EP2 x ETP1), "pp2" (PP2).

The engine's rank count comes from the server (`SGLangGenerator(num_ranks=None)`): the
weight-update group is the trainer's sender plus every engine rank, each of which receives the full
HF tensors and loads its own shard. The trainer-vs-engine comparison runs through the trainer's
own loss path (forward only, every layout incl. PP): the generator's log-probs go in as the
behaviour log-probs and the step reports the largest |trainer FP32 log-prob - generator log-prob|
over all tokens and ranks. Rank 0 writes the measurements to OUT_JSON; the pytest side asserts.
Steps: stale (before any sync) -> sync 1 -> a train step on generator samples -> before sync 2
(the trainer moved) -> sync 2 (the generator follows).
"""
from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _hf_families import family_for  # noqa: E402
from _weight_sync_worker import (SEQUENCES, finish, make_trainer,  # noqa: E402
                                 train_on_generator_samples)

from megatron_rl.rollout import SGLangGenerator  # noqa: E402
from megatron_rl.trainer import ParallelLayout, RLTrainer, TrainBatch  # noqa: E402

LAYOUTS = {
    "tp2": ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True),
    "ep2": ParallelLayout(expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    "pp2": ParallelLayout(pipeline_model_parallel_size=2),
}
PROMPTS = [[5, 17, 42, 99], [200, 4, 31], [2, 300, 45, 61, 19]]


def max_logprob_diff(trainer: RLTrainer, sequences, generator_logprobs) -> float:
    """max |trainer log pi(seq[t] | seq[:t]) - generator's| over t >= 1 of all sequences,
    computed by the trainer's FP32 loss head (forward only; max-reduced over all ranks)."""
    from megatron_rl.algorithms import AggregationDenominators
    from megatron_rl.trainer.step import run_forward_backward

    n = len(sequences)
    batch = TrainBatch(
        token_ids=[torch.tensor(s) for s in sequences],
        loss_mask=[torch.tensor([0.0] + [1.0] * (len(s) - 1)) for s in sequences],
        old_logprobs=[torch.cat([torch.zeros(1), lp.float()]) for lp in generator_logprobs],
        advantages=torch.zeros(n), prompt_ids=torch.arange(n), sample_ids=torch.arange(n))
    denominators = AggregationDenominators.from_sample_token_counts(
        batch.sample_num_loss_tokens(), batch.prompt_of_sample())
    step = run_forward_backward(trainer.model, trainer.micro_batches(batch), trainer.groups,
                                denominators, trainer.settings.loss, temperature=1.0,
                                forward_only=True)
    return step.abs_logp_diff_max


def scored(generator, rank: int) -> list[torch.Tensor]:
    """The generator's log-probs of SEQUENCES, scored on rank 0 and shared with every rank."""
    shared = [generator.score(SEQUENCES) if rank == 0 else None]
    torch.distributed.broadcast_object_list(shared, src=0)
    return shared[0]


def train_on_samples(trainer: RLTrainer, generator, rank: int) -> dict:
    return train_on_generator_samples(trainer, generator, rank, PROMPTS)


def main() -> None:
    from megatron_rl.weight_sync import WeightSync, WeightSyncSettings

    model_dir, urls, out_path, layout = sys.argv[1:5]
    family = family_for(model_dir)
    trainer = make_trainer(family, LAYOUTS[layout],
                           config_overrides={"use_cpu_initialization": True})
    rank = torch.distributed.get_rank()
    generators = [SGLangGenerator(url, num_ranks=None, request_timeout_s=120, max_retries=2)
                  for url in urls.split(",")]
    generator = generators[0]  # samples the train step's batch
    result: dict = {"layout": layout, "engine_ranks": [g.num_ranks for g in generators]}

    def max_diff() -> float:  # over every engine
        return max(max_logprob_diff(trainer, SEQUENCES, scored(g, rank)) for g in generators)

    result["stale_max_diff"] = max_diff()
    # Small buckets (16 KiB): a sync takes many buckets, including tensors larger than one.
    sync = WeightSync(trainer.model, family.weight_groups(), generators,
                      WeightSyncSettings(bucket_bytes=16 * 2**10, timeout_s=120),
                      hf_vocab_size=family.hf_config.vocab_size)
    syncs = []
    for version in (1, 2):
        if version == 2:
            result.update(train_on_samples(trainer, generator, rank))
            result["before_sync2_max_diff"] = max_diff()
        start = time.perf_counter()
        report = sync.sync()
        seconds = time.perf_counter() - start
        syncs.append({"version": report.version, "num_buckets": report.num_buckets,
                      "num_bytes": report.num_bytes, "seconds": seconds,
                      "transfer_s": report.transfer_s, "load_s": report.load_s,
                      "max_diff": max_diff(),
                      "generator_version": sorted({g.weight_version for g in generators}),
                      "server_version": sorted({g.server_weight_version() for g in generators})
                      if rank == 0 else None})
    # Every stage's sender's bytes and buckets (PP: each stage sends its own).
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, [(s["num_bytes"], s["num_buckets"])
                                                   for s in syncs])
    for i, s in enumerate(syncs):
        s["total_bytes"] = sum(g[i][0] for g in gathered)
        s["total_buckets"] = sum(g[i][1] for g in gathered)
    result["syncs"] = syncs
    finish(rank, result, out_path, sync)


if __name__ == "__main__":
    main()
