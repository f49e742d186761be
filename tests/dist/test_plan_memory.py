"""The memory planner against what the trainer allocates (issue 15): for tiny models at several
layouts on 4 gloo ranks, every rank's parameter bytes, DDP buffer sizes (weights and FP32
gradients, padding included) and distributed-optimizer state bytes equal the planner's
(megatron_rl/scaling/plan.py); the activation estimate is compared with the bytes a CPU forward
saves for the backward (the ratios are printed and kept in docs/planner.md; the bound here only
catches a gross error). One torchrun launch (tests/dist/_plan_worker.py).
"""
import json
from pathlib import Path

import pytest

from megatron_rl.scaling import plan

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("_plan_worker.py")
NUM_RANKS = 4


@pytest.fixture(scope="module")
def measured(torchrun, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("plan")
    torchrun(WORKER, [str(out_dir)], num_ranks=NUM_RANKS, timeout_s=600)
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(NUM_RANKS)]


def _planned(record: dict) -> tuple[plan.Architecture, plan.TrainerLayout]:
    fields = dict(record["architecture"])
    for name in ("moe_layer_pattern", "chunked_layer_pattern"):
        fields[name] = tuple(fields.get(name, ()))
    layout = record["layout"]
    etp = layout["expert_tensor_parallel_size"] or layout["tensor_model_parallel_size"]
    trainer_layout = plan.TrainerLayout(
        world_size=record["world_size"],
        tensor_model_parallel_size=layout["tensor_model_parallel_size"],
        pipeline_model_parallel_size=layout["pipeline_model_parallel_size"],
        context_parallel_size=layout["context_parallel_size"],
        expert_model_parallel_size=layout["expert_model_parallel_size"],
        expert_tensor_parallel_size=etp, sequence_parallel=layout["sequence_parallel"])
    return plan.Architecture(**fields), trainer_layout


def test_parameter_and_optimizer_bytes_equal_the_trainers(measured):
    scenarios = measured[0].keys()
    assert len(scenarios) >= 5
    for name in scenarios:
        for rank, results in enumerate(measured):
            record = results[name]
            arch, layout = _planned(record)
            element = 4 if record["precision"] == "fp32" else 2
            params = plan.rank_parameters(arch, layout, pp_rank=record["pp_rank"])
            where = f"{name}, rank {rank}"
            assert sum(p.numel for p in params) * element == record["param_bytes"], where
            buffers = plan.rank_buffers(arch, layout, pp_rank=record["pp_rank"])
            assert [b.numel for k, b in buffers.items() if k == "dense"] \
                == record["buffers"]["dense"], where
            assert [b.numel for k, b in buffers.items() if k == "expert"] \
                == record["buffers"]["expert"], where
            shard = buffers["dense"].shard_numel[record["dense_shard"]]
            if "expert" in buffers:
                shard += buffers["expert"].shard_numel[record["expert_shard"]]
            assert record["optimizer"]["moments"] == shard * 8, where
            assert record["optimizer"]["main"] == (0 if element == 4 else shard * 4), where


def test_activation_estimate_against_a_measured_forward(measured):
    ratios = {}
    for name, record in measured[0].items():
        if "activations" not in record:
            continue
        arch, layout = _planned(record)
        # Local spec on CPU: SDPACoreAttention, whose CPU kernel (torch's flash attention for
        # CPU) keeps no attention probabilities, unfused SwiGLU; no recompute (Megatron's
        # recompute saves CUDA RNG states: GPU only).
        act = plan.ActivationSettings(
            tokens=record["activations"]["tokens"],
            dtype_bytes=4 if record["precision"] == "fp32" else 2, flash_attention=True,
            fused_swiglu=False, logprob_chunk_size=64)
        estimate = sum(plan.stage_activation_bytes(arch, layout, act, pp_rank=0).values())
        estimate += plan.lm_head_bytes(arch, layout, act, params_dtype_bytes=act.dtype_bytes)[
            "head inputs"]
        ratios[name] = estimate / record["activations"]["bytes"]
    print("activation estimate / measured saved bytes:", json.dumps(ratios, indent=1))
    assert len(ratios) >= 4
    for name, ratio in ratios.items():
        assert 0.5 < ratio < 2.0, (name, ratio)
