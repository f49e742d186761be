"""Issue 40: the weight sync's FP8 quantiser (megatron_rl/weight_sync/fp8.py) against SGLang
0.5.23's own code on CPU. UE8M0 block quantisation bit-identical to fp8_utils
.per_block_cast_to_fp8 (DeepGEMM's); per-tensor bit-identical to fp8_utils.input_to_float8 (the
engine's own online quantisation); block dequantisation equal to fp8_utils.block_quant_dequant;
the skip rule equal to Fp8Config.from_config + quantization/utils.is_layer_skipped on the tiny
Qwen3-MoE and Llama-4 names. Not checked here: SGLang's model classes built with an FP8 config
(their constructors read the scheduler's published parallel runtime; docs/low_precision.md). A
subprocess: the CPU stand-ins SGLang's imports need must not enter the pytest process."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json
from megatron_rl.platform.sglang_cpu import apply_sglang_cpu_fixes
apply_sglang_cpu_fixes()  # CPU stand-ins for SGLang's imports
import torch
from sglang.srt.layers.quantization.fp8 import Fp8Config
from sglang.srt.layers.quantization.fp8_utils import (block_quant_dequant, input_to_float8,
                                                      per_block_cast_to_fp8)
from sglang.srt.layers.quantization.utils import is_layer_skipped
from megatron_rl.weight_sync import fp8
from models.registry import get_model_family, model_family_for_hf_config

out = {}
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
disagree = []
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
print("RESULT " + json.dumps(out))
'''


def test_quantiser_and_rule_match_sglang_on_cpu():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    assert result.pop("rule_disagreements") == []
    assert result and all(result.values()), result
