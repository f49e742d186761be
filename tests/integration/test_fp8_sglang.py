"""Issue 40: the weight sync's FP8 quantiser (megatron_rl/weight_sync/fp8.py) against SGLang
0.5.23's own code on CPU. UE8M0 block quantisation bit-identical to fp8_utils
.per_block_cast_to_fp8 (DeepGEMM's); per-tensor bit-identical to fp8_utils.input_to_float8 (the
engine's own online quantisation); block dequantisation equal to fp8_utils.block_quant_dequant;
the skip rule equal to Fp8Config.from_config + quantization/utils.is_layer_skipped; the rule equal
to the parameters SGLang's own Qwen3-MoE and Llama-4 models create in FP8 (tiny sizes, with and
without excluded modules); the sync's plan and conversion sending Qwen3-MoE through
megatron_rl's gloo transport into SGLang's own WeightUpdater (receive, load), whose FP8
parameters then hold the quantiser's bytes; SGLang's Qwen3-MoE loader (`load_weights`) taking the quantiser's
named output into exactly those bytes and scales, block and per-tensor; and SGLang's Llama-4
(multimodal class, text only) loading it, experts unfused, into parameters that dequantise to the
trainer's tensors within the e4m3 bound, which needs blocks of whole heads. The worker
(_fp8_sglang_worker.py) runs in a subprocess: the CPU stand-ins SGLang's imports need must not
enter the pytest process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.rollout.sglang_server import listen_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

WORKER = Path(__file__).with_name("_fp8_sglang_worker.py")


def test_quantiser_and_rule_match_sglang_on_cpu():
    proc = subprocess.run([sys.executable, str(WORKER), str(listen_port())], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1].removeprefix("RESULT "))
    # Bit-identical to SGLang's helpers, same layout and skip decisions.
    assert result.pop("rule_disagreements") == []
    for key in [k for k in result if k.startswith(("ue8m0_", "per_tensor_", "dequant_",
                                                   "layout_"))]:
        assert result.pop(key) is True, key
    # The rule equals the FP8 parameters of SGLang's models: nothing missing, nothing extra.
    for family, full, excluded in (("qwen3_moe", 64, 48), ("llama4", 36, 27)):
        assert result.pop(f"rule_{family}_0") == [[], []]
        assert result.pop(f"rule_{family}_3") == [[], []]
        assert result.pop(f"rule_nonempty_{family}_0") == full
        assert result.pop(f"rule_nonempty_{family}_3") == excluded
    # SGLang's loader holds exactly what was sent, in all 16 FP8 parameters (4 layers x qkv,
    # o_proj, w13, w2) and the rest.
    # Through the sync's plan and conversion, megatron_rl's gloo transport and SGLang's
    # WeightUpdater (receive + load_weights): received bit for bit as quantize_named makes it
    # of the bf16 tensors, and loaded into the FP8 parameters. 4 layers x (q, k, v, o and 4
    # experts x gate, up, down).
    assert result.pop("sync_joined") is True and result.pop("sync_loaded") is True
    assert result.pop("sync_received_mismatched") == []
    assert result.pop("sync_load_mismatched") == []
    assert result.pop("sync_num_quantized") == 4 * (4 + 4 * 3)
    assert result.pop("sync_quantize_s") is True
    for layout in ("block", "per_tensor"):
        assert result.pop(f"load_{layout}_mismatched") == []
        assert result.pop(f"load_{layout}_fp8_params") == 16
    # Llama-4 as SGLang serves it: 24 FP8 parameters (4 layers x qkv, o_proj, shared gate_up
    # and down, w13, w2) within the e4m3 bound of the trainer's tensors when blocks hold whole
    # heads; with smaller blocks SGLang's q/k row reordering breaks exactly the qkv blocks, and
    # check_llama4_block_rows refuses that layout.
    assert result.pop("llama4_16_outside_bound") == []
    assert result.pop("llama4_8_outside_bound") == ["qkv_proj"]
    assert result.pop("llama4_16_refused") is False and result.pop("llama4_8_refused") is True
    assert result.pop("llama4_16_fp8_params") == result.pop("llama4_8_fp8_params") == 24
    assert result == {}
