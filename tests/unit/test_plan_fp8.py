"""The planner with rollout.precision=fp8 (issue 40 item 5): the FP8 engine's weights, scales and
the KV cache they free, the weight-sync sender's FP8 buckets and quantisation scratch, hand-counted
on the tiny Llama and a one-layer MoE; the refusals (hardware without an FP8 peak, block scales
SGLang's loader would refuse at the engine's TP); the cost model and the simulator read the same
setting.
"""
import sys
from pathlib import Path

import pytest

from megatron_rl import cli
from megatron_rl.config import load_config
from megatron_rl.scaling import plan
from megatron_rl.scaling.hardware import Accelerator

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples/configs/tiny_pipeline.yaml"  # the tiny Llama, float32 generators
SCOUT = ROOT / "examples/llama4_scout/gb200_1rack.yaml"

# The tiny Llama (hidden 64, 4 layers, 4 heads / 2 KV heads of 16, MLP 128, vocabulary 256), per
# layer: q_proj [64, 64], k_proj / v_proj [32, 64], o_proj [64, 64], gate_proj / up_proj
# [128, 64], down_proj [64, 128]: 36,864 elements SGLang holds in FP8; embeddings and LM head
# [256, 64] and the 9 norms of 64 stay in the generator dtype.
FP8_ELEMENTS = 4 * (4096 + 2048 + 2048 + 4096 + 3 * 8192)  # 147,456
HIGH_ELEMENTS = 2 * 256 * 64 + 9 * 64  # 33,344
# [16, 16] blocks per layer: q 4x4, k 2x4, v 2x4, o 4x4, gate / up 8x4, down 4x8 = 144 scales.
BLOCK16_SCALES = 4 * (16 + 8 + 8 + 16 + 32 + 32 + 32)


def _tiny(*overrides):
    # bf16 generators: SGLang's FP8 layers take bf16 / fp16 activations (config refuses fp32).
    return load_config(TINY, ["rollout.precision=fp8", "rollout.dtype=bfloat16", *overrides])


def test_tiny_llama_engine_weights_and_freed_kv_by_hand():
    # Both in bf16 generators (FP8 needs bf16 activations; the recipe's own are float32).
    bf16 = plan.plan_run(load_config(TINY, ["rollout.dtype=bfloat16"]), hardware="h100")
    fp8 = plan.plan_run(_tiny("rollout.fp8_block_size=16"), hardware="h100")
    assert FP8_ELEMENTS + HIGH_ELEMENTS == 180800  # every parameter, once
    assert bf16.generator.components["weights"] == 180800 * 2
    weights = {k: v for k, v in fp8.generator.components.items() if k.startswith("weights")}
    assert weights == {"weights: FP8 (e4m3)": FP8_ELEMENTS,
                       "weights: FP8 scales (FP32)": BLOCK16_SCALES * 4,
                       "weights: high precision": HIGH_ELEMENTS * 2}
    # The KV cache (K and V, 4 layers, 2 heads of 16, bf16) gets what the weights free.
    run = load_config(TINY)
    kv_per_sequence = 2 * 4 * 2 * 16 * 2 * run.rollout.max_sequence_tokens
    budget = 0.05 * 80e9  # mem_fraction_static x H100
    assert fp8.generator.kv_bytes_per_sequence == kv_per_sequence
    assert bf16.generator.max_concurrency == int((budget - 180800 * 2) // kv_per_sequence)
    assert fp8.generator.max_concurrency == int(
        (budget - FP8_ELEMENTS - BLOCK16_SCALES * 4 - HIGH_ELEMENTS * 2) // kv_per_sequence)
    assert fp8.generator.max_concurrency > bf16.generator.max_concurrency
    assert any(note.startswith("rollout.precision=fp8: weights") for note in fp8.notes)
    # Per-tensor scales: one float32 per quantised tensor (7 per layer).
    tensor = plan.plan_run(_tiny("rollout.fp8_block_size=null"), hardware="h100")
    assert tensor.generator.components["weights: FP8 scales (FP32)"] == 4 * 7 * 4
    # bf16 plans are unchanged by the setting's existence: one "weights" row.
    assert "weights: FP8 (e4m3)" not in bf16.generator.components


def _moe_mapping():
    """TINY_MOE's tensors under HF names SGLang quantises: Llama-4's fused experts
    (a torch.stack, [E, H, 2I] = [4, 8, 12]) and an o_proj [8, 8]; the LM head stays bf16."""
    import torch

    from models.convert_common import WeightGroup, renamed

    fc1 = tuple(f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"
                for e in range(4))
    name = "model.layers.0.feed_forward.experts.gate_up_proj"
    stacked = WeightGroup(hf_names=(name,), megatron_names=fc1, to_megatron=None,
                          to_hf=lambda mg: {name: torch.stack([mg[n].t() for n in fc1])})
    return [renamed("lm_head.weight", "output_layer.weight"),
            renamed("model.layers.0.self_attn.o_proj.weight",
                    "decoder.layers.0.self_attention.linear_proj.weight"), stacked]


# test_plan.py's one-layer MoE: H 8, 4 heads of 2, 4 experts of width 6, vocabulary 32; TP 2 x
# EP 2 (the sender holds experts 0 and 1 whole, TP shard 0 of the dense tensors).
sys.path.insert(0, str(Path(__file__).parent))
from test_plan import TINY_MOE, TP2_EP2  # noqa: E402


def test_sender_buckets_and_quantisation_scratch_by_hand():
    memory = plan.sender_sync_memory(
        TINY_MOE, TP2_EP2, _moe_mapping(), pp_rank=0, bucket_bytes=2**20,
        params_dtype="bfloat16", generator_dtype="bfloat16",
        quantization_config={"quant_method": "fp8"})  # per-tensor scales
    # One bucket: LM head 512 B (bf16); o_proj 64 fp8 + a 4 B scale; the experts unfused into
    # 8 pieces [6, 8] (gate, up per expert): 384 fp8 + 8 x 4 B scales.
    assert (memory.num_buckets, memory.largest_bucket) == (1, 512 + 68 + 416)
    assert memory.buffers == 996
    # The quantiser reads the gathered o_proj, so it is no longer gathered in place: its 128 B
    # (aligned 256) join its 256 B of column scratch and the 2 x 256 B of EP rank 1's experts.
    assert memory.gathered == 256 + 256 + 512
    assert memory.conversion == 768  # the stack, as in bf16
    # One piece at a time (the sync copies each into its slot before the next is made): the
    # largest is o_proj whole, 64 elements: 12 B of float32 scratch each, its 64 B of fp8 and a
    # 4 B scale; an expert piece is less (48 elements copied in bf16, 12 x 48 B of scratch, 48 B
    # of fp8, a 4 B scale: 724 B). No cast: the trainer's dtype is the generators'.
    assert memory.quantization == 12 * 64 + 64 + 4
    fp32 = plan.sender_sync_memory(
        TINY_MOE, TP2_EP2, _moe_mapping(), pp_rank=0, bucket_bytes=2**20,
        params_dtype="float32", generator_dtype="bfloat16",
        quantization_config={"quant_method": "fp8"})
    # An fp32 trainer's stack of 4 experts x 2 x 48 is cast to bf16 first (384 elements, 768 B)
    # and then unfused one piece at a time (724 B).
    assert fp32.quantization == 768 + 724
    bf16 = plan.sender_sync_memory(TINY_MOE, TP2_EP2, _moe_mapping(), pp_rank=0,
                                   bucket_bytes=2**20, params_dtype="bfloat16",
                                   generator_dtype="bfloat16")
    assert (bf16.largest_bucket, bf16.quantization) == (512 + 128 + 768, 0)


def test_scout_fp8_blocks_fit_at_tp_2_and_the_tiny_models_need_smaller_ones():
    scout = load_config(SCOUT, ["rollout.precision=fp8", "rollout.tp_size=2",
                                "rollout.ep_size=2"])
    arch = plan.Architecture.from_family("llama4", "scout")
    # 40 heads / 8 KV heads of 128, shared expert and experts 8192 wide: at TP 2 every shard is
    # a multiple of 128.
    assert plan.fp8_partition_sizes(arch, tp_size=2, ep_size=2) == {
        "q_proj rows per device": 2560, "k_proj / v_proj rows per device": 512,
        "o_proj columns per device": 2560, "shared expert gate / up rows per device": 4096,
        "shared expert down_proj columns per device": 4096,
        "routed experts' width per MoE-TP rank": 8192}
    gb200 = plan.get_hardware("gb200")
    plan.check_fp8_rollout(scout, accelerator=gb200, arch=arch)
    tiny = plan.Architecture.from_family("llama", "tiny")
    with pytest.raises(ValueError, match=r"rollout.fp8_block_size=128 does not divide .*"
                                         r"k_proj / v_proj rows per device 32.*"
                                         r"rollout.fp8_block_size=32\).*fp8_block_size=null"):
        plan.check_fp8_rollout(_tiny(), accelerator=gb200, arch=tiny)
    plan.check_fp8_rollout(_tiny("rollout.fp8_block_size=32"), accelerator=gb200, arch=tiny)
    # Llama-4: blocks of 8 divide every shard of the tiny model, but cut its heads of 16.
    llama4 = plan.Architecture.from_family("llama4", "tiny")
    names = ["model.layers.0.feed_forward.experts.gate_up_proj"]
    with pytest.raises(ValueError, match="fp8_block_size=8: .*multiple of head_dim 16"):
        plan.check_fp8_rollout(_tiny("rollout.fp8_block_size=8"), accelerator=gb200,
                               arch=llama4, hf_names=names)
    no_fp8 = Accelerator(name="A100", bf16_tflops=312.0, fp8_tflops=0.0, hbm_gb_per_s=2039.0,
                         memory_gb=80.0)
    with pytest.raises(ValueError, match="A100 has no FP8 peak.*rollout.precision=bf16"):
        plan.check_fp8_rollout(scout, accelerator=no_fp8, arch=arch)


def test_cost_and_simulation_read_rollout_precision():
    from megatron_rl.scaling.cost import estimate_cost
    from megatron_rl.simulation.cluster import SimulationSettings, model_of

    arch = plan.Architecture.from_family("llama4", "scout")
    costs = {}
    for precision in ("bf16", "fp8"):
        run = load_config(SCOUT, [f"rollout.precision={precision}"])
        config = plan.cost_config_from_run(run, hardware="gb200", architecture=arch,
                                           decode_batch=256)
        assert config.generator_precision == precision
        assert model_of(run, SimulationSettings(hardware="GB200")).generator_precision \
            == precision
        costs[precision] = estimate_cost(config)
    assert costs["fp8"].decode_device_seconds < costs["bf16"].decode_device_seconds


def test_cli_plan_takes_overrides(capsys):
    assert cli.main(["plan", str(TINY), "--hardware", "h100", "rollout.precision=fp8",
                     "rollout.fp8_block_size=16", "rollout.dtype=bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "weights: FP8 (e4m3)" in out and "quantising to FP8" in out
    # Scout's FP8 weights (~102 GiB with scales and high-precision tensors) fit half of 0.85 x
    # 173 GiB on 2 GPUs; bf16's 201 GiB need 4.
    (note,) = [n for n in plan.plan_run(load_config(SCOUT, ["rollout.precision=fp8"]),
                                        hardware="gb200").notes if "fp8" in n]
    assert "is 2 GPUs instead of 4" in note and "make 28 such engines instead of 14" in note
    assert cli.main(["plan", "--check-recipe", str(SCOUT), "rollout.precision=fp8"]) == 2
    assert "drop the overrides" in capsys.readouterr().err
