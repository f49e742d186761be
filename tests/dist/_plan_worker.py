"""Body of tests/dist/test_plan_memory.py (4 gloo ranks, one launch): builds the RL trainer for
tiny models at several layouts, takes one optimizer step so that AdamW's moments exist, and
records per rank what the trainer allocated: parameter bytes, the DDP buffers' padded sizes and
the optimizer-state bytes (FP32 main shards when the params are not FP32, exp_avg, exp_avg_sq),
with the rank's pipeline stage and data-parallel shard indices. It also records the
bytes one micro-batch's forward saves for the backward (unique storages of autograd's saved
tensors, parameters excluded). Each rank writes OUT_DIR/rank<r>.json; the pytest side compares
them with megatron_rl.scaling.plan.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_rl.trainer import (LossSettings, OptimizerSettings, ParallelLayout,  # noqa: E402
                                 RLTrainer, TrainerSettings)
from megatron_rl.scaling.plan import Architecture  # noqa: E402
from megatron_rl.trainer.model import unwrap  # noqa: E402

from _trainer_worker import make_batch  # noqa: E402

# name -> (family, layout, precision, TransformerConfig overrides)
SCENARIOS = {
    "llama4_dp4": ("llama4", ParallelLayout(), "fp32", {}),
    "llama4_tp2_sp_ep2": ("llama4", ParallelLayout(
        tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
        expert_tensor_parallel_size=1), "fp32", {}),
    "llama4_tp2_pp2_ep2": ("llama4", ParallelLayout(
        tensor_model_parallel_size=2, sequence_parallel=True, pipeline_model_parallel_size=2,
        expert_model_parallel_size=2, expert_tensor_parallel_size=1), "fp32", {}),
    "qwen3_ep4_bf16": ("qwen3_moe", ParallelLayout(expert_model_parallel_size=4), "bf16", {}),
    "llama_tp2_bf16": ("llama", ParallelLayout(tensor_model_parallel_size=2,
                                               sequence_parallel=True), "bf16", {}),
}
# Scenarios whose forward's saved tensors are measured (rank 0).
MEASURE_ACTIVATIONS = ("llama4_dp4", "llama4_tp2_sp_ep2", "qwen3_ep4_bf16", "llama_tp2_bf16")


def architecture_fields(trainer: RLTrainer, family) -> dict:
    """The planner's Architecture of the model the trainer built (its own TransformerConfig)."""
    vocab = family.model_kwargs("tiny")["vocab_size"]
    return dataclasses.asdict(Architecture.from_transformer_config(trainer.config, vocab))


def optimizer_state_bytes(trainer: RLTrainer) -> dict:
    main = moments = 0
    model_fp32 = all(p.dtype == torch.float32 for p in trainer.model.parameters())
    for chained in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
        inner = chained.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                if not model_fp32:  # an FP32 main copy of a bf16 shard
                    main += param.numel() * param.element_size()
                state = inner.state.get(param, {})
                moments += sum(state[k].numel() * state[k].element_size()
                               for k in ("exp_avg", "exp_avg_sq") if k in state)
    return {"main": main, "moments": moments}


def saved_activation_bytes(trainer: RLTrainer, batch) -> dict:
    """Unique storages autograd saves in one micro-batch's forward (parameters excluded); on
    every rank, since the forward runs collectives."""
    from megatron_rl.trainer import step

    param_storages = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    for buffer in trainer.model.buffers + trainer.model.expert_parallel_buffers:
        param_storages.add(buffer.param_data.untyped_storage().data_ptr())
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages and tensor.device.type == "cpu":
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    micro_batch = trainer.micro_batches(batch)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output, _ = step._forward_step(iter([micro_batch]), trainer.model, groups=trainer.groups,
                                       denominators=None, settings=trainer.settings.loss,
                                       temperature=1.0)
    del output
    return {"bytes": sum(saved.values()), "tokens": int(micro_batch.input_ids.numel())}


def long_batch(vocab_size: int):
    """4 prompts x 2 samples of 200-235 tokens: one sequence per micro-batch (as the planner
    assumes: the longest sequence alone in a micro-batch)."""
    from megatron_rl.trainer import TrainBatch

    gen = torch.Generator().manual_seed(0)
    ids, masks, old, advantages, prompts = [], [], [], [], []
    for p in range(4):
        for k in range(2):
            n = 200 + 10 * p + 5 * k
            ids.append(torch.randint(0, vocab_size, (n,), generator=gen))
            masks.append(torch.cat([torch.zeros(8), torch.ones(n - 8)]))
            old.append(-2.0 * torch.rand(n, generator=gen))
            advantages.append(1.0 if k == 0 else -1.0)
            prompts.append(p)
    return TrainBatch(token_ids=ids, loss_mask=masks, old_logprobs=old,
                      advantages=torch.tensor(advantages), prompt_ids=torch.tensor(prompts),
                      sample_ids=torch.arange(len(ids)))


def main() -> None:
    from megatron.core import parallel_state as ps

    from models import get_model_family

    out_dir = sys.argv[1]
    rank = int(os.environ["RANK"])
    results = {}
    for name, (family_name, layout, precision, overrides) in SCENARIOS.items():
        family = get_model_family(family_name)
        settings = TrainerSettings(
            model_name=family_name, model_size="tiny", layout=layout, precision=precision,
            loss=LossSettings(kind="cispo", aggregation="prompt", logprob_chunk_size=64),
            optimizer=OptimizerSettings(lr=1e-3, lr_warmup_steps=0),
            micro_batch_max_tokens=256, config_overrides={"num_layers": 2, **overrides})
        trainer = RLTrainer(settings, family=family)
        vocab = family.model_kwargs("tiny")["vocab_size"]
        record = {
            "architecture": architecture_fields(trainer, family),
            "layout": dataclasses.asdict(layout), "world_size": torch.distributed.get_world_size(),
            "precision": precision,
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "dense_shard": ps.get_data_parallel_rank(with_context_parallel=True),
            "expert_shard": ps.get_expert_data_parallel_rank(),
            "param_bytes": sum(p.numel() * p.element_size()
                               for p in unwrap(trainer.model).parameters()),
            "buffers": {
                "dense": [b.numel for b in trainer.model.buffers],
                "expert": [b.numel for b in trainer.model.expert_parallel_buffers],
            },
        }
        if name in MEASURE_ACTIVATIONS:  # every rank: the forward runs collectives
            record["activations"] = saved_activation_bytes(trainer, long_batch(vocab))
        trainer.train_step(make_batch(vocab_size=vocab))
        record["optimizer"] = optimizer_state_bytes(trainer)
        results[name] = record
        print(f"rank {rank}: {name} done", flush=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    from megatron_rl.platform import destroy_distributed

    destroy_distributed()


if __name__ == "__main__":
    main()
