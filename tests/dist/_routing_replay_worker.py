"""Body of tests/dist/test_routing_replay.py: parallel invariance of an RL step WITH routing replay.

Usage: torchrun --nproc-per-node 4 _routing_replay_worker.py OUT_DIR

The batch of tests/dist/_trainer_worker.py carries a routing table (random distinct expert ids per
position and layer, top-2 of 4 experts: mostly NOT the trainer's own choice, so replay changes
the routing of most tokens). One RL step from the same weights at (TP, EP, PP) = (1,1,1) DP4,
(2,2,1)+SP DP2 and (1,2,2) DP2 gives loss, grad norm, flip counts and the updated weights; the
same step without replay at (1,1,1) shows that the replay changed the result. Rank 0 writes the
numbers to OUT_DIR/result.json.
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _trainer_worker import build, full_params, make_batch, write_result  # noqa: E402

from megatron_rl.rollout.types import compact_expert_ids  # noqa: E402
from megatron_rl.trainer import ParallelLayout  # noqa: E402

NUM_EXPERTS, TOP_K, NUM_LAYERS = 4, 2, 2
LAYOUTS = {
    "tp1_ep1_pp1": ParallelLayout(),
    "tp2_ep2_sp": ParallelLayout(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                 expert_tensor_parallel_size=1, sequence_parallel=True),
    "ep2_pp2": ParallelLayout(expert_model_parallel_size=2, pipeline_model_parallel_size=2),
}


def routed_batch(seed: int = 5):
    batch = make_batch(vocab_size=96)
    gen = torch.Generator().manual_seed(seed)
    tables = []
    for ids in batch.token_ids:
        rows = ids.numel() - 1
        choice = torch.rand(rows, NUM_LAYERS, NUM_EXPERTS, generator=gen).argsort(dim=-1)
        tables.append(compact_expert_ids(choice[..., :TOP_K].reshape(rows, -1)))
    return dataclasses.replace(batch, routed_experts=tables)


def main() -> None:
    out_dir = sys.argv[1]
    batch = routed_batch()
    kwargs = {"moe_router_topk": TOP_K}
    out: dict = {"layouts": {}}
    trainer = build(LAYOUTS["tp1_ep1_pp1"], **kwargs)
    init_dir = os.path.join(out_dir, "ckpt", "init")
    trainer.save_checkpoint(init_dir)
    reference_params = None
    for name, layout in LAYOUTS.items():
        if name != "tp1_ep1_pp1":
            trainer = build(layout, **kwargs)
            trainer.load_checkpoint(init_dir, load_optimizer=False)
        metrics = trainer.train_step(batch)
        out["layouts"][name] = {
            "loss": metrics.loss, "grad_norm": metrics.grad_norm,
            "flip_fraction": metrics.routing_flip_fraction,
            "num_micro_batches": metrics.num_micro_batches,
            "num_loss_tokens": metrics.num_loss_tokens, "dp_size": trainer.groups.dp_size}
        save_dir = os.path.join(out_dir, "ckpt", name)
        trainer.save_checkpoint(save_dir)
        # The updated weights, read back at (1,1,1), against the reference layout's.
        trainer = build(LAYOUTS["tp1_ep1_pp1"], **kwargs)
        trainer.load_checkpoint(save_dir, load_optimizer=False)
        params = full_params(trainer)
        if reference_params is None:
            reference_params = params
        out["layouts"][name]["max_param_diff"] = max(
            float((params[k] - reference_params[k]).abs().max()) for k in params)
    # The same step without replay (own routing): a different loss, the same flip count.
    trainer = build(LAYOUTS["tp1_ep1_pp1"], **kwargs)
    trainer.load_checkpoint(init_dir, load_optimizer=False)
    free = dataclasses.replace(trainer.settings, routing_replay=False)
    trainer.settings = free
    metrics = trainer.train_step(batch)
    out["no_replay"] = {"loss": metrics.loss, "grad_norm": metrics.grad_norm,
                        "flip_fraction": metrics.routing_flip_fraction}
    write_result(out, out_dir)


if __name__ == "__main__":
    main()
