"""torchrun worker for test_convert_parity.py: loads converted checkpoints into Megatron models at
several (TP, EP, PP) layouts and saves the logits of fixed input ids.

For each layout in the cases file, every rank re-initialises Megatron's parallel state, builds its
stage of each case's model (the family's registered size with the case's TransformerConfig
overrides), loads the converted checkpoint with `megatron_rl.convert.load_model_weights`, and runs
a forward-only pass through Megatron's pipeline schedule. The one rank that is on the last stage
with tensor-parallel and data-parallel rank 0 gathers the vocab-parallel logits and saves them.
At the cases file's `resave_layout` every model is also saved again with dist_checkpointing, as
the trainer does, so the test can convert a checkpoint written at TP/EP/PP > 1 back to HF.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def _logits(model, tokens: torch.Tensor):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    batch, seq_len = tokens.shape
    position_ids = torch.arange(seq_len).expand(batch, seq_len)

    def forward_step(data_iterator, model_chunk):
        del data_iterator
        output = model_chunk(tokens, position_ids, None)  # last stage: [b, s, vocab/tp]
        return output, lambda out, non_loss_data=False: out

    with torch.no_grad():
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
            num_microbatches=1, seq_length=seq_len, micro_batch_size=batch,
            forward_only=True, collect_non_loss_data=True)
    if not parallel_state.is_pipeline_last_stage():
        return None
    return gather_from_tensor_model_parallel_region(outputs[0])  # [b, s, vocab]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    spec = json.loads(Path(args.cases).read_text())

    from megatron_rl.platform import destroy_distributed, init_distributed

    init_distributed()
    import models
    from megatron.core import parallel_state

    from megatron.core import dist_checkpointing

    from megatron_rl.convert import MODEL_SHARDED_METADATA, load_model_weights

    tokens = torch.tensor(spec["tokens"])
    for tp, ep, pp in spec["layouts"]:
        # Experts are not tensor-split (ETP 1): with ETP = TP 2 the alltoall dispatcher's uneven
        # all_gather is not supported by gloo. Dense, attention and shared-expert weights are.
        init_distributed(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                         pipeline_model_parallel_size=pp, expert_tensor_parallel_size=1)
        saver = (parallel_state.is_pipeline_last_stage()
                 and parallel_state.get_tensor_model_parallel_rank() == 0
                 and parallel_state.get_data_parallel_rank() == 0)
        for case in spec["cases"]:
            family = models.get_model_family(case["family"])
            layout = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                          sequence_parallel=tp > 1)
            if family.transformer_config(case["size"], **case["overrides"]).num_moe_experts:
                # Megatron refuses expert parallelism without experts: a dense model's EP ranks
                # are data-parallel replicas.
                layout.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
            config = family.transformer_config(case["size"], **layout, **case["overrides"])
            model = family.build_model(
                config, pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage()).eval()
            load_model_weights(case["checkpoint"], model)
            logits = _logits(model, tokens)
            if saver:
                torch.save(logits, Path(args.out) / f"{case['name']}-tp{tp}ep{ep}pp{pp}.pt")
            if [tp, ep, pp] == spec["resave_layout"]:
                # As the trainer saves its model part: the way back must read any layout.
                resaved = Path(args.out) / f"{case['name']}-resaved"
                resaved.mkdir(exist_ok=True)
                torch.distributed.barrier()
                sharded = model.sharded_state_dict(metadata=dict(MODEL_SHARDED_METADATA))
                dist_checkpointing.save({"model": sharded}, str(resaved))
            torch.distributed.barrier()
    destroy_distributed()


if __name__ == "__main__":
    main()
