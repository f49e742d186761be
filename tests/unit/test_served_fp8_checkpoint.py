"""rollout.precision=fp8 (issue 40): the FP8 copy of model.hf_checkpoint the generators load
(megatron_rl/cluster/served_checkpoint.py) and the config-time refusal where SGLang's FP8 layers
cannot serve the model (config.fp8_serving_problem). The copy's tensors are compared with the
weight sync's own quantiser (weight_sync/fp8.py, itself checked bit for bit against SGLang's
helpers in tests/integration/test_fp8_sglang.py); the shard-size rule with SGLang's
validate_block_quant_shapes worked by hand on the tiny sizes."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.cluster.served_checkpoint import KEY_FILE, write_fp8_checkpoint
from megatron_rl.config import ConfigError, fp8_serving_problem, load_config
from megatron_rl.weight_sync import fp8

pytestmark = pytest.mark.unit

BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
         "weight_block_size": [16, 16]}
E, H, I = 2, 32, 16  # experts, hidden, expert intermediate


def _source(path, shards=1):
    """A Llama-4-shaped HF checkpoint: attention, shared expert, fused experts, router, norm,
    embeddings; `shards` safetensors files."""
    g = torch.Generator().manual_seed(0)
    r = lambda *shape: (torch.randn(*shape, generator=g) * 0.05).bfloat16()  # noqa: E731
    p = "language_model.model.layers.0."
    tensors = {f"{p}self_attn.q_proj.weight": r(32, H), f"{p}self_attn.o_proj.weight": r(H, 32),
               f"{p}feed_forward.shared_expert.gate_proj.weight": r(I, H),
               f"{p}feed_forward.experts.gate_up_proj": r(E, H, 2 * I),
               f"{p}feed_forward.experts.down_proj": r(E, I, H),
               f"{p}feed_forward.router.weight": r(E, H), f"{p}input_layernorm.weight": r(H),
               "language_model.model.embed_tokens.weight": r(64, H)}
    path.mkdir()
    names = sorted(tensors)
    for i in range(shards):
        save_file({n: tensors[n] for n in names[i::shards]},
                  str(path / f"model-{i:05d}-of-{shards:05d}.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": {"model_type": "llama4_text", "head_dim": 16, "hidden_size": H,
                        "num_attention_heads": 2}}))
    (path / "tokenizer.json").write_text('{"model": "stand-in"}')
    return tensors


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_the_copy_holds_the_quantisers_tensors_and_the_served_config(tmp_path):
    tensors = _source(tmp_path / "hf", shards=2)
    served = write_fp8_checkpoint(tmp_path / "hf", tmp_path / "served", BLOCK)
    config = json.loads((served / "config.json").read_text())
    assert config["quantization_config"] == BLOCK
    assert config["text_config"]["head_dim"] == 16  # the rest as it was
    assert (served / "tokenizer.json").read_text() == '{"model": "stand-in"}'
    written = {}
    for shard in served.glob("*.safetensors"):
        written.update(load_file(str(shard)))
    layout = fp8.Fp8Layout.from_quantization_config(BLOCK)
    expected = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            for piece, t in fp8.unfuse_llama4_experts(name, tensor).items():
                expected.update(fp8.quantize_named(piece, t, layout))
        elif name in fp8.fp8_quantized(BLOCK, [name]):
            expected.update(fp8.quantize_named(name, tensor, layout))
        else:
            expected[name] = tensor
    assert sorted(written) == sorted(expected)
    for name, tensor in expected.items():
        assert written[name].dtype == tensor.dtype and torch.equal(
            _bits(written[name]), _bits(tensor)), name
    # Projections and experts in FP8 (2 experts x gate/up/down), router / norm / embeddings not.
    assert sum(t.dtype == torch.float8_e4m3fn for t in written.values()) == 3 + 3 * E
    assert written["language_model.model.layers.0.feed_forward.router.weight"].dtype == \
        torch.bfloat16
    # Two shards: an index naming each tensor's shard, as SGLang's loader reads it.
    weight_map = json.loads((served / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(weight_map) == sorted(written)
    for shard in set(weight_map.values()):
        assert set(load_file(str(served / shard))) == {n for n, s in weight_map.items()
                                                       if s == shard}


def test_per_tensor_and_ue8m0_layouts(tmp_path):
    _source(tmp_path / "hf")
    per_tensor = {k: v for k, v in BLOCK.items() if k != "weight_block_size"}
    served = write_fp8_checkpoint(tmp_path / "hf", tmp_path / "pt", per_tensor)
    written = load_file(str(served / "model-00000-of-00001.safetensors"))
    scale = written["language_model.model.layers.0.self_attn.q_proj.weight_scale"]
    assert scale.dim() == 0 and scale.dtype == torch.float32
    ue8m0 = {**BLOCK, "scale_fmt": "ue8m0"}
    written = load_file(str(write_fp8_checkpoint(tmp_path / "hf", tmp_path / "ue", ue8m0)
                            / "model-00000-of-00001.safetensors"))
    scales = written["language_model.model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two


def test_a_finished_copy_is_reused_and_a_changed_one_rewritten(tmp_path):
    _source(tmp_path / "hf")
    served = write_fp8_checkpoint(tmp_path / "hf", tmp_path / "served", BLOCK)
    marker = served / "written-before"
    marker.write_text("")
    assert write_fp8_checkpoint(tmp_path / "hf", tmp_path / "served", BLOCK) == served
    assert marker.exists()  # same source, same layout: not written again
    write_fp8_checkpoint(tmp_path / "hf", tmp_path / "served", {**BLOCK,
                                                               "weight_block_size": [32, 32]})
    assert not marker.exists()  # another layout: a new copy
    assert json.loads((served / "config.json").read_text())["quantization_config"][
        "weight_block_size"] == [32, 32]
    marker.write_text("")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"model": "changed"}')
    write_fp8_checkpoint(tmp_path / "hf", tmp_path / "served", {**BLOCK,
                                                               "weight_block_size": [32, 32]})
    assert not marker.exists() and json.loads((served / KEY_FILE).read_text())["key"]


def test_llama4_blocks_must_hold_whole_heads(tmp_path):
    _source(tmp_path / "hf")
    with pytest.raises(ValueError, match="multiple of head_dim 16"):
        write_fp8_checkpoint(tmp_path / "hf", tmp_path / "served",
                             {**BLOCK, "weight_block_size": [8, 8]})
    assert not (tmp_path / "served").exists()


TINY_LLAMA4 = {"model_type": "llama4_text", "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "hidden_size": 64, "intermediate_size": 32,
               "intermediate_size_mlp": 96}


def test_fp8_serving_problem_names_a_block_that_fits():
    # Shards of the tiny Llama-4 (16 experts, every layer MoE: transformers' defaults): q 64,
    # k/v 32, shared expert and experts 32 -> 32 divides all and holds whole heads (head_dim
    # 16); 128 does not divide them (SGLang raises at load).
    problem = fp8_serving_problem("llama4", TINY_LLAMA4, 128, 1)
    assert problem.startswith("rollout.fp8_block_size: 128 cannot serve this llama4 model")
    assert "use rollout.fp8_block_size=32 or null" in problem
    assert fp8_serving_problem("llama4", TINY_LLAMA4, 16, 1) is None
    assert fp8_serving_problem("llama4", TINY_LLAMA4, None, 1) is None
    # 8 divides every shard but cuts heads (SGLang's q/k row permutation within a head).
    assert "whole heads" in fp8_serving_problem("llama4", TINY_LLAMA4, 8, 1)
    # TP 2 halves the shards: k/v 16 per rank, experts 16 -> only 16 fits.
    assert "rollout.fp8_block_size=16 or" in fp8_serving_problem("llama4", TINY_LLAMA4, 32, 2)
    assert "not available for model family 'mamba'" in fp8_serving_problem("mamba", {}, 128, 1)
    # The planner's rule (scaling/plan.py fp8_partition_sizes): the dense MLP's width counts
    # only where a layer is dense (every other one here: 80 rows -> 16, not 32).
    dense_80 = {**TINY_LLAMA4, "intermediate_size_mlp": 80}
    assert fp8_serving_problem("llama4", dense_80, 32, 1) is None
    assert "rollout.fp8_block_size=16 or" in fp8_serving_problem(
        "llama4", {**dense_80, "interleave_moe_layer_step": 2}, 32, 1)
    assert "not divisible by 3" in fp8_serving_problem("llama4", TINY_LLAMA4, 16, 3)
    # SGLang's Llama loader drops block scales (renames weight_scale_inv): per-tensor only.
    assert "drops block scales" in fp8_serving_problem("llama", {}, 16, 1)
    assert fp8_serving_problem("llama", {}, None, 1) is None


def test_config_refuses_fp8_where_it_cannot_serve_before_anything_starts(tmp_path):
    def checkpoint(name, **text):  # a config.json only: what the check reads
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(
            {"architectures": ["Llama4ForCausalLM"], **text}))
        return f"model.hf_checkpoint={tmp_path / name}"

    tiny = checkpoint("tiny", **TINY_LLAMA4)
    with pytest.raises(ConfigError, match="rollout.fp8_block_size: 128 cannot serve this llama4"):
        load_config(None, ["model.name=llama4", tiny, "rollout.precision=fp8"])
    with pytest.raises(ConfigError, match="rollout.fp8_scale_fmt: ue8m0"):
        load_config(None, [tiny, "rollout.precision=fp8", "rollout.fp8_block_size=null",
                           "rollout.fp8_scale_fmt=ue8m0"])
    load_config(None, ["model.name=llama4", tiny, "rollout.precision=fp8",
                       "rollout.fp8_block_size=16"])
    # SGLang's FP8 layers take bf16 / fp16 activations only (Fp8Config).
    with pytest.raises(ConfigError, match="rollout.dtype: float32 cannot serve FP8"):
        load_config(None, ["model.name=llama4", tiny, "rollout.precision=fp8",
                           "rollout.fp8_block_size=16", "rollout.dtype=float32"])
    fp32 = checkpoint("fp32", **TINY_LLAMA4, torch_dtype="float32")
    with pytest.raises(ConfigError, match="rollout.dtype: auto .the checkpoint's float32."):
        load_config(None, ["model.name=llama4", fp32, "rollout.precision=fp8",
                           "rollout.fp8_block_size=16"])
    # Scout (head_dim 128, shards multiples of 128 at TP 8): the default layout serves it.
    scout = checkpoint("scout", model_type="llama4_text", num_attention_heads=40,
                       num_key_value_heads=8, head_dim=128, hidden_size=5120,
                       intermediate_size=8192, intermediate_size_mlp=16384)
    load_config(None, ["model.name=llama4", scout, "rollout.precision=fp8", "rollout.tp_size=8"])


def test_the_engines_load_the_checkpoint_or_its_fp8_copy_by_rollout_precision(tmp_path):
    from megatron_rl.cluster.served_checkpoint import served_model_dir
    from megatron_rl.config import RolloutConfig

    _source(tmp_path / "hf")
    bf16 = RolloutConfig(precision="bf16")
    assert served_model_dir(bf16, str(tmp_path / "hf"), tmp_path / "run") == str(tmp_path / "hf")
    assert not (tmp_path / "run").exists()  # nothing written for bf16
    rollout = RolloutConfig(precision="fp8", fp8_block_size=16, fp8_scale_fmt="ue8m0")
    served = served_model_dir(rollout, str(tmp_path / "hf"), tmp_path / "run")
    assert served == str((tmp_path / "run" / "served_fp8").resolve())
    assert json.loads((tmp_path / "run" / "served_fp8" / "config.json").read_text())[
        "quantization_config"] == {**BLOCK, "scale_fmt": "ue8m0"}


def test_the_disk_sync_folder_takes_the_served_copys_config(tmp_path):
    # weight_sync.transport=disk writes each update into an HF folder with the side files of
    # hf_config_dir. Served in FP8 the update is FP8 weights and scales: the folder's config.json
    # must be the served copy's (with its quantization_config), not the bf16 checkpoint's.
    from megatron_rl.rollout.types import TensorSpec
    from megatron_rl.weight_sync import WeightSyncSettings
    from megatron_rl.weight_sync.buckets import Bucket
    from megatron_rl.weight_sync.transport import DiskTransport

    _source(tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(
        {"architectures": ["Llama4ForCausalLM"], **TINY_LLAMA4}))
    cfg = load_config(None, ["model.name=llama4", f"model.hf_checkpoint={tmp_path / 'hf'}",
                             f"output_dir={tmp_path / 'run'}", "rollout.precision=fp8",
                             "rollout.fp8_block_size=16", "weight_sync.transport=disk"])
    served = write_fp8_checkpoint(tmp_path / "hf", tmp_path / "run" / "served_fp8",
                                  fp8.served_quantization_config(cfg.rollout))
    settings = WeightSyncSettings.from_run_config(cfg, hf_config_dir=str(tmp_path / "hf"))
    assert settings.hf_config_dir == str(served)
    weight, scale = fp8.quantize_blockwise(torch.randn(32, 32), (16, 16))
    name = "language_model.model.layers.0.self_attn.o_proj.weight"
    tensors = {name: weight, name + "_scale_inv": scale}
    specs = tuple(TensorSpec(name=n, dtype=t.dtype, shape=tuple(t.shape))
                  for n, t in tensors.items())
    bucket = Bucket(specs=specs, data=torch.cat([t.reshape(-1).view(torch.uint8)
                                                 for t in tensors.values()]))

    def write(config_dir, directory):
        transport = DiskTransport([], directory=str(directory), config_dir=config_dir, stage=0,
                                  timeout_s=1.0)
        transport.send(bucket, version=1, flush_cache=False)
        transport.finish(version=1)
        return directory

    folder = write(settings.hf_config_dir, tmp_path / "sync")
    assert json.loads((folder / "config.json").read_text()) == json.loads(
        (served / "config.json").read_text())
    assert json.loads((folder / "config.json").read_text())["quantization_config"] == BLOCK
    assert _bits(load_file(folder / "model-stage000.safetensors")[name]).equal(_bits(weight))
    # The bf16 checkpoint's config.json under FP8 tensors is refused, naming the fix.
    with pytest.raises(ValueError, match="no quantization_config: pass the served FP8 copy"):
        write(str(tmp_path / "hf"), tmp_path / "sync_bf16")
