"""Run by tests/integration/test_fp8_sglang.py in its own process (argv[1]: a free port for
the one-rank gloo group SGLang's layers need): the weight sync's FP8 quantiser and rule
(megatron_rl/weight_sync/fp8.py) against SGLang 0.5.23's own code on CPU. Prints one line
"RESULT <json>"."""
import json
import sys
import tempfile

from megatron_rl.platform.sglang_cpu import apply_sglang_cpu_fixes
apply_sglang_cpu_fixes()  # CPU stand-ins for SGLang's imports
import torch  # noqa: E402
from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
from sglang.srt.layers.moe import initialize_moe_config
from sglang.srt.layers.quantization.fp8 import Fp8Config
from sglang.srt.layers.quantization.fp8_utils import (block_quant_dequant, input_to_float8,
                                                      per_block_cast_to_fp8)
from sglang.srt.layers.quantization.utils import _FALLBACK_FUSED_SHARDS, is_layer_skipped
from sglang.srt.models.llama4 import Llama4ForCausalLM
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM
from sglang.srt.runtime_context import SpawnRanks, publish
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
from megatron_rl.weight_sync import fp8
from models.registry import get_model_family, model_family_for_hf_config

# A config.json for ServerArgs' resolution (no weights are read); removed when the process ends.
model_dir_handle = tempfile.TemporaryDirectory()
model_dir = model_dir_handle.name
with open(f"{model_dir}/config.json", "w") as f:
    json.dump(get_model_family("qwen3_moe").hf_config("tiny"), f)
server_args = ServerArgs(model_path=model_dir, device="cpu")
set_global_server_args_for_scheduler(server_args)
publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                             distributed_init_method="tcp://127.0.0.1:" + sys.argv[1])
initialize_model_parallel(backend="gloo")
initialize_moe_config()
out = {}

# 0. SGLang's quantisation helpers and skip rule.
generator = torch.Generator().manual_seed(0)
weight = torch.randn(300, 260, generator=generator) * torch.exp(
    torch.randn(300, 260, generator=generator) * 2) * 0.01
weight[128:256, 128:256] = 0.0  # a zero block: both floor amax at 1e-4
def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.view(torch.uint8) if a.dtype == fp8.FP8_DTYPE else a,
        b.view(torch.uint8) if b.dtype == fp8.FP8_DTYPE else b)
for dtype in (torch.float32, torch.bfloat16):
    w = weight.to(dtype)
    ours_q, ours_s = fp8.quantize_blockwise(w, ue8m0=True)
    ref_q, ref_s = per_block_cast_to_fp8(w)
    out[f"ue8m0_{dtype}"] = same_bits(ours_q, ref_q) and same_bits(ours_s, ref_s.float())
    ours_q, ours_s = fp8.quantize_per_tensor(w)
    ref_q, ref_s = input_to_float8(w)
    out[f"per_tensor_{dtype}"] = same_bits(ours_q, ref_q) and same_bits(ours_s, ref_s)
    q, s = fp8.quantize_blockwise(w)
    out[f"dequant_{dtype}"] = torch.equal(
        fp8.dequantize_blockwise(q, s), block_quant_dequant(q, s, [128, 128], torch.float32))

configs = [{}, {"modules_to_not_convert": ["model.layers.1.self_attn", "layers.2.mlp.experts"]},
           {"ignored_layers": ["lm_head", "model.layers.3.mlp.experts.1.gate_proj",
                               "layers.0.feed_forward.experts"]},
           {"ignored_layers": ["mlp.gate", "self_attn.q_proj", "self_attn.k_proj",
                               "self_attn.v_proj"]}]
disagree = []  # the skip rule against is_layer_skipped on SGLang's own prefixes
for family in ("qwen3_moe", "llama4"):
    bound = model_family_for_hf_config(get_model_family(family).hf_config("tiny"))
    names = [n for g in bound.weight_groups() for n in g.hf_names]
    for extra in configs:
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128], **extra}
        sglang = Fp8Config.from_config(qc)
        ours = fp8.fp8_quantized(qc, names)
        for name in fp8.fp8_quantized({"quant_method": "fp8"}, names):
            module = name.rpartition(".")[0]
            skipped = is_layer_skipped(fp8._sglang_prefix(module), sglang.ignored_layers)
            if skipped == (name in ours):
                disagree.append([family, extra, name])
        out[f"layout_{family}_{len(extra)}"] = (
            fp8.Fp8Layout.from_quantization_config(qc).weight_block_size
            == tuple(sglang.weight_block_size))
out["rule_disagreements"] = disagree

def sglang_module(hf_name):
    """The SGLang module an HF tensor loads into: experts -> the layer's FusedMoE; q/k/v_proj,
    gate/up_proj -> their fused module (SGLang's own shard table)."""
    module = hf_name.rpartition(".")[0]
    head, found, _ = module.partition(".experts.")
    if found or module.endswith(".experts"):
        return (head if found else module.removesuffix(".experts")) + ".experts"
    parent, _, leaf = module.rpartition(".")
    fused = next((f for f, shards in _FALLBACK_FUSED_SHARDS.items() if leaf in shards), leaf)
    return parent + "." + fused

torch.set_default_dtype(torch.bfloat16)  # the engine's parameter dtype

# 1. The rule against the FP8 parameters SGLang's models create, with and without exclusions.
exclusions = [[], ["model.layers.1.self_attn", "layers.2.mlp.experts", "layers.2.feed_forward"]]
for family, cls in (("qwen3_moe", Qwen3MoeForCausalLM), ("llama4", Llama4ForCausalLM)):
    bound = model_family_for_hf_config(get_model_family(family).hf_config("tiny"))
    names = [n for g in bound.weight_groups() for n in g.hf_names]
    for excluded in exclusions:
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": [16, 16], "modules_to_not_convert": excluded}
        model = cls(bound.hf_config, quant_config=Fp8Config.from_config(qc))
        in_fp8 = {n.rpartition(".")[0] for n, p in model.named_parameters()
                  if p.dtype == torch.float8_e4m3fn}
        expected = {n for n in names if sglang_module(n) in in_fp8}
        ours = fp8.fp8_quantized(qc, names)
        out[f"rule_{family}_{len(excluded)}"] = [sorted(expected - ours), sorted(ours - expected)]
        out[f"rule_nonempty_{family}_{len(excluded)}"] = len(ours)

# 2. SGLang's own loader takes the quantiser's output: Qwen3-MoE's FP8 parameters after
# load_weights hold exactly our fp8 bytes and scales (fused q/k/v and gate/up concatenated along
# the output dim, experts stacked), the rest the tensors sent.
bound = model_family_for_hf_config(get_model_family("qwen3_moe").hf_config("tiny"))
hf_cfg = bound.hf_config
names = [n for g in bound.weight_groups() for n in g.hf_names]
attention = {"q_proj": hf_cfg.num_attention_heads * hf_cfg.head_dim,
             "k_proj": hf_cfg.num_key_value_heads * hf_cfg.head_dim,
             "v_proj": hf_cfg.num_key_value_heads * hf_cfg.head_dim}
def hf_shape(name, params):
    module = name.rpartition(".")[0]
    leaf = module.rpartition(".")[2]
    if leaf in attention:
        return (attention[leaf], hf_cfg.hidden_size)
    if ".experts." in module:
        inter = hf_cfg.moe_intermediate_size
        return (hf_cfg.hidden_size, inter) if leaf == "down_proj" else (inter, hf_cfg.hidden_size)
    return tuple(params[name].shape)
def _rows(tensor):  # a per-tensor scale (0-dim) takes one slot of the fused parameter
    return tensor.reshape(1) if tensor.dim() == 0 else tensor
def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def mismatched_params(params, sent, layout):
    """The Qwen3-MoE parameters not holding exactly the tensors `sent` (after load_weights)."""
    scale_suffix = "weight_scale_inv" if layout.weight_block_size else "weight_scale"
    mismatched = []
    for pname, param in params.items():
        module, _, pleaf = pname.rpartition(".")
        if param.dtype != torch.float8_e4m3fn and not pleaf.endswith(("scale", "scale_inv")):
            expected = sent.get(pname)
        elif module.endswith(".experts"):
            kind = pleaf.partition("_")[0]  # w13 | w2
            parts = ("gate_proj", "up_proj") if kind == "w13" else ("down_proj",)
            suffix = "weight" if pleaf.endswith("weight") else scale_suffix
            expected = torch.stack([torch.cat([_rows(sent[f"{module}.{e}.{p}.{suffix}"])
                                               for p in parts])
                                    for e in range(hf_cfg.num_experts)])
            expected = expected.reshape(param.shape)
        else:
            parent, _, fused = module.rpartition(".")
            parts = _FALLBACK_FUSED_SHARDS.get(fused, [fused])
            suffix = pleaf
            pieces = [sent[f"{parent}.{p}.{suffix}"] for p in parts]
            expected = torch.cat([_rows(p) for p in pieces]).reshape(param.shape)
        if expected is None or expected.dtype != param.dtype or not torch.equal(
                bits(param.data), bits(expected)):
            mismatched.append(pname)
    return mismatched


for label, qc in (("block", {"weight_block_size": [16, 16]}), ("per_tensor", {})):
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", **qc}
    layout = fp8.Fp8Layout.from_quantization_config(qc)
    model = Qwen3MoeForCausalLM(hf_cfg, quant_config=Fp8Config.from_config(qc))
    params = dict(model.named_parameters())
    generator = torch.Generator().manual_seed(0)
    quantised = fp8.fp8_quantized(qc, names)
    sent = {}
    for name in names:
        tensor = (torch.randn(hf_shape(name, params), generator=generator) * 0.05).bfloat16()
        sent.update(fp8.quantize_named(name, tensor, layout) if name in quantised
                    else {name: tensor})
    model.load_weights(list(sent.items()))
    out[f"load_{label}_mismatched"] = mismatched_params(params, sent, layout)
    out[f"load_{label}_fp8_params"] = sum(p.dtype == torch.float8_e4m3fn for p in params.values())

# 2b. The same model fed through the weight sync's own code and SGLang's own receiving side: the
# sync's plan and conversion (WeightSync._convert, without a trainer: the Megatron tensors are
# the HF ones converted by the family's mapping, fp32 as the CPU trainer holds them, bf16 the
# generators' dtype) fill the buckets; megatron_rl's DistributedTransport broadcasts them over
# gloo from a sender process (_fp8_bucket_sender.py) into SGLang's WeightUpdater here
# (init_weights_update_group, receive_weights_from_distributed with the flattened-bucket payload
# SGLangGenerator posts, load_weights_from_distributed), and the model's FP8 parameters then
# hold exactly what quantize_named makes of the bf16 HF tensors.
import subprocess  # noqa: E402
import os  # noqa: E402
from sglang.srt.model_executor.model_runner_components.weight_updater import \
    WeightUpdater  # noqa: E402
from megatron_rl.rollout.sglang_server import listen_port  # noqa: E402
from megatron_rl.weight_sync import WeightSync, WeightSyncSettings, plan_buckets  # noqa: E402
from megatron_rl.weight_sync.sync import _Counts  # noqa: E402
from models.convert_common import convert_state_dict  # noqa: E402

qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
      "weight_block_size": [16, 16]}
layout = fp8.Fp8Layout.from_quantization_config(qc)
model = Qwen3MoeForCausalLM(hf_cfg, quant_config=Fp8Config.from_config(qc))
params = dict(model.named_parameters())
generator = torch.Generator().manual_seed(1)
hf = {name: torch.randn(hf_shape(name, params), generator=generator, dtype=torch.float32) * 0.05
      for name in names}  # the trainer's fp32 (the default dtype is bf16 here)
groups = bound.weight_groups()
megatron = convert_state_dict(groups, hf, to="megatron")
sync = object.__new__(WeightSync)  # its conversion only: settings and quantiser
sync.settings = WeightSyncSettings(dtype=torch.bfloat16, quantization_config=qc)
sync.quantiser = fp8.SyncQuantiser(qc, names)
plan = plan_buckets(groups, lambda n: megatron[n].to("meta"), bucket_bytes=16 * 2**10,
                    dtype=torch.bfloat16, quantiser=sync.quantiser)
buckets, counts = [], _Counts()
for bucket in plan:
    data = torch.empty(bucket.num_bytes, dtype=torch.uint8)
    slots = bucket.slots(data)
    for hf_name, megatron_name in bucket.in_place.items():  # the gatherer's part
        slots[hf_name].copy_(megatron[megatron_name])
    sync._convert(bucket, {n: megatron[n] for n in bucket.megatron_names}, slots, counts)
    buckets.append((bucket.specs, data))
expected = {}
quantised = fp8.fp8_quantized(qc, names)
for name in names:
    expected.update(fp8.quantize_named(name, hf[name].bfloat16(), layout) if name in quantised
                    else {name: hf[name].bfloat16()})
path = os.path.join(model_dir, "buckets.pt")
torch.save(buckets, path)
port, group_name = listen_port(), "fp8_sync_test"
sender = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__),
                                                        "_fp8_bucket_sender.py"),
                           str(port), group_name, path], stdout=subprocess.PIPE, text=True)
updater = WeightUpdater(tp_rank=0, device="cpu", gpu_id=0, model_config=None,
                        custom_weight_loaders={}, get_model=lambda: model,
                        update_model_fields=None, recapture_cuda_graph=None,
                        get_model_runner=None)
joined = updater.init_weights_update_group("127.0.0.1", port, 1, 2, group_name, backend="gloo")
received, loaded = {}, []
for specs, _ in buckets:
    tensors = updater.receive_weights_from_distributed(
        names=[t.name for t in specs], dtypes=[t.dtype_name for t in specs],
        shapes=[list(t.shape) for t in specs], group_name=group_name,
        load_format="flattened_bucket")
    received.update((name, tensor.clone()) for name, tensor in tensors)
    loaded.append(updater.load_weights_from_distributed(tensors)[0])
updater.destroy_weights_update_group(group_name)
sender_out, _ = sender.communicate(timeout=120)
out["sync_joined"] = joined[0] and sender.returncode == 0 and "SENT" in sender_out
out["sync_loaded"] = all(loaded) and len(loaded) == len(buckets) > 1
out["sync_received_mismatched"] = sorted(
    set(expected) ^ set(received)) + [n for n in received if n in expected and not (
        received[n].dtype == expected[n].dtype and torch.equal(bits(received[n]),
                                                               bits(expected[n])))]
out["sync_num_quantized"] = sum(b.num_quantized for b in plan)
out["sync_quantize_s"] = counts.quantize_s > 0
out["sync_load_mismatched"] = mismatched_params(params, expected, layout)

# 3. Llama-4 as SGLang serves it (mllama4.Llama4ForConditionalGeneration, text only): every FP8
# parameter after load_weights dequantises to the trainer's tensor within the e4m3 bound
# (fp8.py), experts sent unfused per expert; SGLang reorders q/k rows within each head after
# loading, which block rows of whole heads survive (head_dim 16, blocks [16, 16]) and smaller
# blocks do not ([8, 8]: the q/k/v parameters fail, as check_llama4_block_rows says).
from sglang.srt.models.mllama4 import Llama4ForConditionalGeneration  # noqa: E402
from transformers import Llama4Config  # noqa: E402

bound = model_family_for_hf_config(get_model_family("llama4").hf_config("tiny"))
text_cfg = bound.hf_config
names = [n for g in bound.weight_groups() for n in g.hf_names]
H, I, E, hd = (text_cfg.hidden_size, text_cfg.intermediate_size, text_cfg.num_local_experts,
               text_cfg.head_dim)
q_rows, kv_rows = text_cfg.num_attention_heads * hd, text_cfg.num_key_value_heads * hd
def llama4_shape(name, params):
    leaf = name.rpartition(".")[0].rpartition(".")[2]
    if name.endswith("experts.gate_up_proj"):
        return (E, H, 2 * I)
    if name.endswith("experts.down_proj"):
        return (E, I, H)
    if leaf in ("q_proj", "k_proj", "v_proj"):
        return (q_rows if leaf == "q_proj" else kv_rows, H)
    if "shared_expert" in name:
        return (H, I) if leaf == "down_proj" else (I, H)
    return tuple(params["language_model." + name].shape)
def permute(w, num_heads):  # mllama4.py permute_qk_weight_for_rotary
    return w.view(num_heads, hd // 2, 2, -1).transpose(1, 2).reshape(num_heads * hd, -1)
text = {k: v for k, v in get_model_family("llama4").hf_config("tiny").items()
        if k != "architectures"}
for block in (16, 8):
    config = Llama4Config(text_config=text, vision_config={"model_type": "llama4_vision_model"})
    # SGLang's CPU model config records the head counts before its CPU TP padding; set them as
    # it does for TP 1.
    config.text_config.original_num_attention_heads = config.text_config.num_attention_heads
    config.text_config.original_total_num_kv_heads = config.text_config.num_key_value_heads
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic",
          "weight_block_size": [block, block]}
    layout = fp8.Fp8Layout.from_quantization_config(qc)
    try:
        fp8.check_llama4_block_rows(layout, hd)
        out[f"llama4_{block}_refused"] = False
    except ValueError:
        out[f"llama4_{block}_refused"] = True
    model = Llama4ForConditionalGeneration(config, quant_config=Fp8Config.from_config(qc))
    params = dict(model.named_parameters())
    quantised = fp8.fp8_quantized(qc, names)
    generator = torch.Generator().manual_seed(0)
    original, sent = {}, {}
    for name in names:
        tensor = (torch.randn(llama4_shape(name, params), generator=generator) * 0.05).bfloat16()
        pieces = (fp8.unfuse_llama4_experts(name, tensor) if "experts." in name
                  and not name.endswith(".weight") else {name: tensor})
        for piece_name, piece in pieces.items():
            original[piece_name] = piece
            sent.update(fp8.quantize_named(piece_name, piece, layout) if name in quantised
                        else {piece_name: piece})
    model.load_weights(list(sent.items()))
    outside = []
    for pname, param in params.items():
        if param.dtype != torch.float8_e4m3fn:
            continue
        module = pname.removeprefix("language_model.").rsplit(".", 1)[0]
        if module.endswith("qkv_proj"):
            p = module.removesuffix("qkv_proj")
            ref = torch.cat([permute(original[p + "q_proj.weight"], text_cfg.num_attention_heads),
                             permute(original[p + "k_proj.weight"], text_cfg.num_key_value_heads),
                             original[p + "v_proj.weight"]])
        elif module.endswith("gate_up_proj"):
            p = module.removesuffix("gate_up_proj")
            ref = torch.cat([original[p + "gate_proj.weight"], original[p + "up_proj.weight"]])
        elif pname.endswith("w13_weight"):
            ref = torch.stack([torch.cat([original[f"{module}.{e}.gate_proj.weight"],
                                          original[f"{module}.{e}.up_proj.weight"]])
                               for e in range(E)])
        elif pname.endswith("w2_weight"):
            ref = torch.stack([original[f"{module}.{e}.down_proj.weight"] for e in range(E)])
        else:
            ref = original[module + ".weight"]
        scale = params[pname + "_scale_inv"].float()
        dequantised = block_quant_dequant(param.data, scale, [block, block], torch.float32)
        per_element = scale.repeat_interleave(block, -2).repeat_interleave(block, -1)[
            ..., :ref.shape[-2], :ref.shape[-1]]
        bound_ = torch.maximum(ref.float().abs() * 2.0 ** -4, per_element * 2.0 ** -10)
        if not bool(((dequantised - ref.float()).abs() <= bound_ * (1 + 2.0 ** -20)).all()):
            outside.append(pname.rsplit(".", 2)[-2])
    out[f"llama4_{block}_outside_bound"] = sorted(set(outside))
    out[f"llama4_{block}_fp8_params"] = sum(p.dtype == torch.float8_e4m3fn
                                            for p in params.values())
print("RESULT " + json.dumps(out))
