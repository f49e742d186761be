"""The memory planner (megatron_rl/scaling/plan.py) and the production recipes it sizes: hand
values of the distributed optimizer's buffer layout, parameter counts against the models' own
formula, the recipes load and validate with the real config loader and fit their hardware, and
each recipe's generated comment block equals what `megatron-rl plan --update-recipe` writes now.
"""
import dataclasses
from pathlib import Path

import pytest

from megatron_rl import cli
from megatron_rl.config import ConfigError, load_config
from megatron_rl.scaling import plan

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(ROOT.glob("examples/llama4_scout/*.yaml")) + sorted(
    ROOT.glob("examples/qwen3_30b_a3b/*.yaml")) + sorted(ROOT.glob("examples/llama3_8b/*.yaml"))


def test_buffer_layout_by_hand():
    # Reverse order, starts aligned to 64: [0, 100) for the last param, [128, 138) for the first;
    # end padded to lcm(2, 128) = 256; shards [0, 128) and [128, 256).
    layout = plan.buffer_plan([10, 100], num_shards=2)
    assert (layout.numel_unpadded, layout.numel) == (110, 256)
    assert layout.shard_numel == (100, 10)
    assert plan.buffer_plan([5], num_shards=3).numel == 384  # lcm(3, 128)
    assert sum(plan.buffer_plan([7, 300, 64, 1], num_shards=4).shard_numel) == 372


def test_rank_parameters_split_like_megatron():
    arch = plan.Architecture(num_layers=2, hidden_size=8, num_attention_heads=4,
                             num_query_groups=2, head_dim=2, ffn_hidden_size=16, vocab_size=32,
                             num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=6,
                             shared_expert_size=6, moe_layer_pattern=(1, 1))
    full = plan.rank_parameters(arch, plan.TrainerLayout(), pp_rank=0)
    layout = plan.TrainerLayout(world_size=4, tensor_model_parallel_size=2,
                                expert_model_parallel_size=2, sequence_parallel=True)
    split = plan.rank_parameters(arch, layout, pp_rank=0)
    sizes = {p.name: p.numel for p in split}
    assert sizes["embedding.word_embeddings.weight"] == 16 * 8
    assert sizes["decoder.layers.0.mlp.router.weight"] == 4 * 8  # replicated
    assert sizes["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"] == 2 * 6 * 8
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in sizes
    assert len(full) - len(split) == 2 * 2 * 2  # 2 experts x (fc1, fc2) x 2 layers fewer
    stages = [plan.rank_parameters(arch, plan.TrainerLayout(world_size=2,
                                                            pipeline_model_parallel_size=2),
                                   pp_rank=r) for r in (0, 1)]
    assert sum(p.numel for s in stages for p in s) == sum(p.numel for p in full)
    with pytest.raises(ValueError, match="not divisible"):
        plan.rank_parameters(arch, plan.TrainerLayout(world_size=3, expert_model_parallel_size=3),
                             pp_rank=0)


@pytest.fixture(scope="module")
def scout():
    return plan.Architecture.from_family("llama4", "scout")


# One MoE layer, H 8, 4 heads of 2 (linear_proj [8, 8]), 4 experts of width 6 (fc1 [12, 8]),
# vocabulary 32 (output layer [32, 8]); TP 2 x EP 2: the sender holds experts 0 and 1 whole,
# TP shard 0 of the dense tensors.
TINY_MOE = plan.Architecture(num_layers=1, hidden_size=8, num_attention_heads=4,
                             num_query_groups=2, head_dim=2, ffn_hidden_size=16, vocab_size=32,
                             num_experts=4, moe_ffn_hidden_size=6, moe_layer_pattern=(1,))
TP2_EP2 = plan.TrainerLayout(world_size=4, tensor_model_parallel_size=2,
                             expert_model_parallel_size=2, sequence_parallel=True)


def _tiny_mapping():
    import torch

    from models.convert_common import WeightGroup, renamed

    fc1 = tuple(f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight"
                for e in range(4))
    stacked = WeightGroup(  # like Llama-4's fused experts: a new tensor, not a view
        hf_names=("experts.gate_up_proj",), megatron_names=fc1, to_megatron=None,
        to_hf=lambda mg: {"experts.gate_up_proj": torch.stack([mg[n].t() for n in fc1])})
    return [renamed("lm_head.weight", "output_layer.weight"),
            renamed("o_proj.weight", "decoder.layers.0.self_attention.linear_proj.weight"),
            stacked]


@pytest.mark.parametrize("bucket_bytes, expected", [
    # Buckets [output 512 B], [o_proj 128 B], [experts 768 B]: two buffers of 768 B. Gathered
    # per bucket: the output layer's TP shard 1 lands in its slot (rows: contiguous) -> 0;
    # o_proj's shard 1 (columns: strided) needs 128 / 2 = 64 B of scratch -> 256 (aligned);
    # experts 2 and 3 come whole from EP rank 1, 192 B each -> 2 x 256.
    (600, dict(num_buckets=3, largest_bucket=768, buffers=2 * 768, gathered=512,
               conversion=768, quantization=0)),
    # One bucket of all three (1408 B): one buffer; gathered 256 + 512 at once.
    (2**20, dict(num_buckets=1, largest_bucket=1408, buffers=1408, gathered=768,
                 conversion=768, quantization=0)),
])
def test_sender_sync_memory_by_hand(bucket_bytes, expected):
    memory = plan.sender_sync_memory(TINY_MOE, TP2_EP2, _tiny_mapping(), pp_rank=0,
                                     bucket_bytes=bucket_bytes, params_dtype="bfloat16",
                                     generator_dtype="bfloat16")
    assert dataclasses.asdict(memory) == expected
    assert memory.kept == expected["buffers"] + expected["gathered"]
    # FP32 generators: nothing is gathered in place (a cast), so the output layer (512 B in
    # bf16) and o_proj (128 -> 256 B, plus its 256 B of scratch) are gathered too.
    fp32 = plan.sender_sync_memory(TINY_MOE, TP2_EP2, _tiny_mapping(), pp_rank=0,
                                   bucket_bytes=2**20, params_dtype="bfloat16",
                                   generator_dtype="float32")
    assert (fp32.largest_bucket, fp32.gathered) == (2816, 512 + 512 + 512)


def test_each_stage_sends_its_own_layers():
    arch = dataclasses.replace(TINY_MOE, num_layers=2, moe_layer_pattern=(1, 1))
    layout = plan.TrainerLayout(world_size=2, pipeline_model_parallel_size=2)
    first, last = (plan.stage_parameter_names(arch, layout, r) for r in (0, 1))
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" in last
    assert {n.split(".")[2] for n in first if n.startswith("decoder.layers.")} == {"0"}
    assert {n.split(".")[2] for n in last if n.startswith("decoder.layers.")} == {"1"}
    # The o_proj of layer 0 is stage 0's: stage 1 sends the output layer only.
    mapping = [g for g in _tiny_mapping() if "experts" not in g.hf_names[0]]
    memory = plan.sender_sync_memory(arch, layout, mapping, pp_rank=1, bucket_bytes=2**20,
                                     params_dtype="bfloat16", generator_dtype="bfloat16")
    assert (memory.num_buckets, memory.largest_bucket, memory.gathered) == (1, 512, 0)


def test_scout_sender_holds_the_fused_experts_by_hand(scout):
    """Issue 30.9: Llama-4 Scout at the recipe's TP 4, PP 2, EP 8. The largest bucket is one
    layer's experts.gate_up_proj alone, [16, 5120, 2 x 8192] bf16 = 2.5 GiB; the sender keeps
    two such buffers and the 14 experts of the other expert-parallel ranks it gathers for it,
    [2 x 8192, 5120] bf16 = 160 MiB each; torch.stack allocates the 2.5 GiB tensor again."""
    layout = plan.TrainerLayout(world_size=16, tensor_model_parallel_size=4,
                                pipeline_model_parallel_size=2, expert_model_parallel_size=8,
                                sequence_parallel=True)
    mapping = plan.family_mapping("llama4", "scout")
    gate_up = 16 * 5120 * 16384 * 2
    for pp_rank in (0, 1):
        memory = plan.sender_sync_memory(scout, layout, mapping, pp_rank=pp_rank,
                                         bucket_bytes=512 * 2**20, params_dtype="bfloat16",
                                         generator_dtype="bfloat16")
        assert gate_up == 2.5 * plan.GIB
        assert (memory.largest_bucket, memory.buffers) == (gate_up, 2 * gate_up)
        assert memory.gathered == 14 * 16384 * 5120 * 2
        assert memory.conversion == gate_up


def test_routing_imbalance_scales_the_busiest_ranks_expert_activations():
    # SP over TP 2: 64 tokens -> 32 per rank; top-1, ETP 1; experts keep (2 H + 3 width) per
    # routed token (fused SwiGLU) in bf16: 32 x (16 + 18) x 2 = 2176 B balanced.
    act = plan.ActivationSettings(tokens=64)
    balanced = plan.layer_activation_bytes(TINY_MOE, TP2_EP2, act, moe=True)
    skewed = plan.layer_activation_bytes(TINY_MOE, TP2_EP2,
                                         dataclasses.replace(act, routing_imbalance=1.5),
                                         moe=True)
    assert balanced["experts"] == 2176 and skewed["experts"] == 1.5 * 2176
    assert {k: v for k, v in skewed.items() if k != "experts"} == \
        {k: v for k, v in balanced.items() if k != "experts"}


def test_the_trainer_peak_is_the_step_or_the_sync_whichever_is_larger():
    from megatron_rl.scaling.hardware import ACCELERATORS

    act = plan.ActivationSettings(tokens=64)
    sync = plan.SenderSyncMemory(num_buckets=3, largest_bucket=768, buffers=1536, gathered=512,
                                 conversion=768)

    def trainer(conversion: int, reserved_gib: float = 0.0):
        return plan.plan_trainer(TINY_MOE, TP2_EP2, act, hardware=ACCELERATORS["H100"],
                                 params_dtype_bytes=2, reserved_gib=reserved_gib,
                                 sync=[dataclasses.replace(sync, conversion=conversion)])

    plain = plan.plan_trainer(TINY_MOE, TP2_EP2, act, hardware=ACCELERATORS["H100"],
                              params_dtype_bytes=2, reserved_gib=0.0)
    small = trainer(768)
    assert small.components["weight sync: bucket buffers"] == 1536
    assert small.components["weight sync: gathered tensors"] == 512
    assert small.total == plain.total + 1536 + 512 == small.peak
    activations = sum(v for k, v in small.components.items() if k.startswith("act: "))
    assert small.sync_peak == small.total - activations + 768
    large = trainer(10**9)  # a conversion larger than the step's activations sets the peak
    assert large.peak == large.sync_peak == small.total - activations + 10**9
    assert not trainer(10**12).fits and small.fits


def test_scout_parameter_counts_match_the_models_formula(scout):
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()
    from models import get_model_family
    from models.common import count_parameters

    config = get_model_family("llama4").transformer_config("scout")
    expected = count_parameters(config, vocab_size=scout.vocab_size, tie_embeddings=False)
    assert scout.parameter_counts() == expected
    total, active = expected
    assert 107e9 < total < 110e9 and 16e9 < active < 18e9  # "109B total / 17B active"


def test_activations_shrink_with_recompute_sp_and_cp(scout):
    layout = plan.TrainerLayout(world_size=16, tensor_model_parallel_size=2,
                                pipeline_model_parallel_size=2, expert_model_parallel_size=8)

    def total(lay, recompute):
        act = plan.ActivationSettings(tokens=36864, recompute=recompute)
        return sum(plan.stage_activation_bytes(scout, lay, act, pp_rank=0).values())

    none, selective, full = (total(layout, r) for r in plan.RECOMPUTE)
    assert none >= selective > full
    sp = dataclasses.replace(layout, sequence_parallel=True)
    cp = dataclasses.replace(layout, world_size=32, context_parallel_size=2)
    assert total(sp, "none") < none and total(cp, "none") < none
    with pytest.raises(ValueError, match="recompute"):
        total(layout, "some")


def test_hardware_table_is_the_cost_models():
    from megatron_rl.scaling.hardware import ACCELERATORS

    assert plan.get_hardware("gb200") is ACCELERATORS["GB200"]
    assert plan.get_hardware("H100") is ACCELERATORS["H100"]
    with pytest.raises(ValueError, match="unknown hardware 'tpu'"):
        plan.get_hardware("tpu")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_loads_fits_and_its_block_is_current(recipe):
    run = load_config(recipe)  # the real loader and every validation rule
    assert run.train.global_batch_size == 768 and run.rollout.samples_per_prompt == 16
    assert run.rollout.thinking_budget == 32768 and run.rollout.forced_interruption
    assert run.rollout.max_off_policyness == 8
    assert (run.eval.interval_steps, run.eval.num_heldout_prompts) == (100, 1000)
    assert run.model.fp32_lm_head and run.rollout.enable_fp32_lm_head and run.model.fp8
    assert run.train.micro_batch_max_tokens >= run.rollout.max_sequence_tokens
    # the paper's larger batch is a valid override of the same recipe
    assert load_config(recipe, ["train.global_batch_size=2048"]).prompts_per_step == 128
    header = plan.recipe_header(recipe.read_text())
    memory = plan.plan_run(run, hardware=header["hardware"])
    assert memory.fits, plan.plan_rows(memory)
    assert plan.render_recipe(recipe) == recipe.read_text(), (
        f"the generated block of {recipe} is out of date: run `megatron-rl plan "
        f"--update-recipe {recipe.relative_to(ROOT)}`")


def test_cli_plan_prints_the_table_and_checks_recipes(capsys, tmp_path):
    recipe = ROOT / "examples/llama3_8b/gb200_1rack.yaml"
    assert cli.main(["plan", str(recipe), "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert "Memory plan per device (H100" in out and "optimizer state" in out
    assert "largest concurrency" in out
    assert cli.main(["plan", "--check-recipe", str(recipe)]) == 0
    stale = tmp_path / "stale.yaml"
    stale.write_text(recipe.read_text().replace("#   total", "#   t0tal", 1))
    assert cli.main(["plan", "--check-recipe", str(stale)]) == 1
    assert "out of date" in capsys.readouterr().err
    bare = tmp_path / "bare.yaml"
    bare.write_text("model:\n  name: llama\n  size: llama3_8b\n")
    assert cli.main(["plan", "--update-recipe", str(bare)]) == 2  # no `# plan:` line: untouched
    assert "no `# plan:" in capsys.readouterr().err


def test_context_parallel_needs_transformer_engine():
    recipe = ROOT / "examples/llama3_8b/gb200_1rack.yaml"
    overrides = ["parallelism.world_size=16", "parallelism.context_parallel_size=2"]
    assert load_config(recipe, overrides).parallelism.context_parallel_size == 2
    with pytest.raises(ConfigError, match="context_parallel_size: 2 needs Transformer Engine"):
        load_config(recipe, [*overrides, "model.use_transformer_engine=false", "model.fp8=null"])
