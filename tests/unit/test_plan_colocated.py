"""The planner's colocated figures (megatron_rl/scaling/plan.py `ColocatedPlan`): while the engine
generates, a shared device holds the trainer's resident part (what RLTrainer's offload leaves:
weights, the weight sync's kept buffers, the reserve) beside the engine's mem_fraction_static x
device memory and its logits. Hand values on a tiny MoE and a toy device of 10,000 bytes, and a
production recipe switched to colocated placement."""
import dataclasses
from pathlib import Path

import pytest

from megatron_rl.config import load_config
from megatron_rl.scaling import plan
from megatron_rl.scaling.hardware import Accelerator

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

# One MoE layer, H 8, 4 heads of 2, 2 KV groups, 4 experts of width 6, vocabulary 32.
TINY_MOE = plan.Architecture(num_layers=1, hidden_size=8, num_attention_heads=4,
                             num_query_groups=2, head_dim=2, ffn_hidden_size=16, vocab_size=32,
                             num_experts=4, moe_ffn_hidden_size=6, moe_layer_pattern=(1,))
TP2_EP2 = plan.TrainerLayout(world_size=4, tensor_model_parallel_size=2,
                             expert_model_parallel_size=2, sequence_parallel=True)
SYNC = plan.SenderSyncMemory(num_buckets=3, largest_bucket=768, buffers=1536, gathered=512,
                             conversion=768)


def _toy(memory_bytes: float) -> Accelerator:
    return Accelerator(name="toy", bf16_tflops=1.0, fp8_tflops=1.0, hbm_gb_per_s=1.0,
                       memory_gb=memory_bytes / 1e9)


def _colocated(memory_bytes: float, fraction: float) -> plan.ColocatedPlan:
    device = _toy(memory_bytes)
    stages = plan.plan_trainer_stages(TINY_MOE, TP2_EP2, plan.ActivationSettings(tokens=64),
                                      hardware=device, params_dtype_bytes=2, reserved_gib=0.0,
                                      sync=[SYNC])

    def generator_at(f):
        return plan.plan_generator(TINY_MOE, hardware=device, tp_size=1, ep_size=1,
                                   weight_bytes=2, kv_bytes=2, max_sequence_tokens=10,
                                   concurrency=4, mem_fraction_static=f, fp32_lm_head=False)

    return plan.plan_colocated(stages, generator_at, mem_fraction_static=fraction)


def test_generation_phase_by_hand():
    colocated = _colocated(10_000, 0.5)
    # Trainer rank at TP2 x EP2 (DP2), bf16. Dense buffer: output layer 128 at [0, 128), final
    # norm 8 at 128, router 32 at 192, pre-MLP norm 8 at 256, qkv 64 at 320, proj 32 at 384,
    # input norm 8 at 448, embedding 128 at [512, 640): 640 elements (a multiple of 128).
    # Expert buffer (2 local experts: fc2 48, fc1 96 each) at 0, 64, 192, 256 -> 352, padded to
    # 384. Weights: (640 + 384) x 2 bytes. Gradients, Adam state and activations are offloaded
    # or freed; the sync's two bucket buffers and its arena stay.
    assert colocated.trainer_resident == {
        "weights": 2048, "weight sync: bucket buffers": 1536,
        "weight sync: gathered tensors": 512, "reserved (CUDA, NCCL, fragmentation)": 0}
    # Engine: 1,336 parameters in bf16 = 2,672 bytes; KV per sequence 2 x 1 layer x 2 heads x
    # head_dim 2 x 2 bytes x 10 tokens = 160; at 0.5 of 10,000 bytes (14 fit) the 4 requested
    # decode at once: logits 4 x 32 x 2 bytes.
    assert colocated.static_budget == 5000 and colocated.engine_logits == 256
    assert colocated.total == 4096 + 5000 + 256 and colocated.fits
    # 4,096 + f x 10,000 + 256 <= 10,000: f <= 0.5648 -> 0.56 (0.57 gives 10,052).
    assert colocated.max_mem_fraction_static == 0.56
    assert _colocated(10_000, 0.56).fits and not _colocated(10_000, 0.57).fits
    assert _colocated(10_000, 0.57).total == 4096 + 5700 + 256


def test_no_fraction_fits_when_the_trainer_leaves_the_engine_too_little():
    # 6,000 bytes: one sequence needs f >= (2,672 + 160) / 6,000 = 0.472, the device allows
    # f <= (6,000 - 4,096 - 256) / 6,000 = 0.275.
    colocated = _colocated(6_000, 0.2)
    assert colocated.fits  # the sum fits at 0.2, but the engine cannot hold a sequence there
    assert colocated.max_mem_fraction_static == 0.0
    rows = plan.colocated_rows(colocated)
    assert rows[-1][2].endswith("the largest rollout.mem_fraction_static that fits is none")


@pytest.fixture(scope="module")
def llama3_8b():
    """The family's architecture and weight-sync mapping, read once (plan_run reads them on
    every call otherwise)."""
    return {"architecture": plan.Architecture.from_family("llama", "llama3_8b"),
            "mapping": plan.family_mapping("llama", "llama3_8b")}


def test_a_colocated_recipe_reports_the_generation_phase_and_the_fraction_that_fits(llama3_8b):
    recipe = ROOT / "examples/llama3_8b/h100_80gpus.yaml"
    base = load_config(recipe)
    assert (base.model.name, base.model.size) == ("llama", "llama3_8b")
    assert plan.plan_run(base, hardware="h100", **llama3_8b).colocated is None  # disaggregated
    colocated_overrides = ["cluster.colocated=true", "rollout.max_off_policyness=0",
                           f"rollout.num_generators="
                           f"{base.parallelism.world_size // base.rollout.tp_size}"]
    run = load_config(recipe, colocated_overrides)
    memory = plan.plan_run(run, hardware="h100", **llama3_8b)
    c = memory.colocated
    trainer = memory.trainer.components
    assert c.trainer_resident == {k: trainer[k] for k in plan.COLOCATED_RESIDENT if k in trainer}
    assert "gradients (FP32)" not in c.trainer_resident and c.mem_fraction_static == 0.85
    assert c.total == pytest.approx(sum(c.trainer_resident.values()) + 0.85 * 80e9
                                    + memory.generator.components["logits (decode batch)"])
    assert not c.fits and not memory.fits and memory.trainer.fits and memory.generator.fits
    largest = c.max_mem_fraction_static
    assert 0 < largest < 0.85
    assert f"set rollout.mem_fraction_static <= {largest:.2f}" in " ".join(memory.notes)
    rows = plan.plan_rows(memory)
    assert ("colocated device while generating (trainer offloaded)", "", "") in rows
    assert "DOES NOT FIT" in rows[-1][2]
    # The fraction it names fits; the next hundredth does not.
    for fraction, fits in ((largest, True), (round(largest + 0.01, 2), False)):
        replanned = plan.plan_run(load_config(recipe, [
            *colocated_overrides, f"rollout.mem_fraction_static={fraction}"]), hardware="h100",
            **llama3_8b)
        assert replanned.colocated.fits is fits and replanned.fits is fits, fraction
