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


# ---------------------------------------------------------------------------------------------
# An SGLang CPU server serving the tiny Llama-4 in FP8 ([16, 16] blocks, the block size the tiny
# model's shards divide with whole heads) from the run's served copy
# (cluster/served_checkpoint.py) through the CPU FP8 shim (platform/sglang_fp8_cpu.py): SGLang's
# own Fp8Config, FP8 parameters and loader, the matmul on the dequantised weights.
#
# References, transformers in FP32 on (a) the bf16 weights the trainer holds and (b) the FP8
# copy's weights dequantised (fp8 x block scale, re-fused): (b) is the exact function of what
# the engine holds, so |generator - (b)| is the engine's own computation noise (bf16
# activations; on this model ~0.01 mean, one near-tie token up to 0.09 measured), the level a
# bf16-served engine shows against its FP32 reference (0.015 max in test_sglang_llama4.py);
# |generator - (a)| is the rollout mismatch FP8 serving adds. The bound on it: (b) - (a) is
# the quantisation's whole effect on the FP32 function, so the generator may differ from (a) by
# at most |(b) - (a)| plus its own noise (NOISE_MAX); a wrong scale, a stale or misplaced
# tensor, or the scales ignored would break it (mutation: the shim without scales, below).
# Measured (2-core CPU, load ~3): mean |gen - (a)| 0.053, max 0.263; mean |gen - (b)| 0.010,
# max 0.086; max |(b) - (a)| 0.257.
NOISE_MEAN, NOISE_MAX = 0.03, 0.15
SEQUENCES = [[5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39],
             [200, 4, 4, 31, 77, 150, 9, 18], [2, 200, 45, 61, 19, 88, 101, 7, 7, 250, 13, 6]]


def _dequantised_state(served: dict, block) -> dict:
    """The FP8 copy's tensors as the engine computes with them, in the HF layout
    transformers loads (per-expert tensors fused back into gate_up_proj / down_proj)."""
    import torch

    from megatron_rl.weight_sync.fp8 import dequantize_blockwise

    state, experts = {}, {}
    for name, tensor in served.items():
        if name.endswith("_scale_inv"):
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            tensor = dequantize_blockwise(tensor, served[name + "_scale_inv"], block)
        base, found, rest = name.partition(".experts.")
        if found and rest[0].isdigit():  # base.experts.{e}.{proj}.weight
            expert, proj, _ = rest.split(".")
            experts.setdefault(base, {})[int(expert), proj] = tensor
        else:
            state[name] = tensor
    for base, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        state[base + ".experts.gate_up_proj"] = torch.stack([torch.cat(
            [parts[e, "gate_proj"].T, parts[e, "up_proj"].T], -1) for e in range(count)])
        state[base + ".experts.down_proj"] = torch.stack([parts[e, "down_proj"].T
                                                          for e in range(count)])
    return state


def _fp32_logprobs(family, state: dict) -> "torch.Tensor":
    import torch
    from transformers import Llama4ForCausalLM

    config = family.hf_config
    config._attn_implementation = "eager"
    model = Llama4ForCausalLM(config).eval()
    model.load_state_dict({n.removeprefix("language_model."): t.float()
                           for n, t in state.items()}, strict=True)
    out = []
    with torch.no_grad():
        for seq in SEQUENCES:
            logits = model(torch.tensor([seq])).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(
                -1, torch.tensor(seq[1:])[:, None])[:, 0])
    return torch.cat(out)


def test_sglang_cpu_serves_tiny_llama4_in_fp8(tmp_path):
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).parent))
    from _hf_families import family_for, save_tiny_llama4

    from megatron_rl.cluster.served_checkpoint import write_fp8_checkpoint
    from megatron_rl.rollout import (SamplingParams, SGLangGenerator, SGLangServer,
                                     SGLangServerSettings)

    block = [16, 16]
    source = save_tiny_llama4(tmp_path / "model")
    served = write_fp8_checkpoint(source, tmp_path / "served", {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": block})
    log = tmp_path / "server.log"
    server = SGLangServer.launch(SGLangServerSettings(
        model_path=str(served), dtype="bfloat16", mem_fraction_static=0.05,
        max_total_tokens=8192, startup_timeout_s=240, request_timeout_s=120, log_path=str(log)))
    try:
        generator = SGLangGenerator(server.url, request_timeout_s=120, max_retries=1)
        generated = torch.cat(generator.score(SEQUENCES))
        greedy = generator.generate([SEQUENCES[0][:5]], SamplingParams(
            max_new_tokens=8, temperature=0.0, ignore_eos=True, purpose="eval"))
    finally:
        server.shutdown()
    assert "quant=fp8, fmt=e4m3" in log.read_text()  # SGLang loaded it as an FP8 checkpoint
    assert len(greedy[0].token_ids) == 8

    family = family_for(str(source))
    bf16 = _fp32_logprobs(family, load_file(str(source / "model.safetensors")))
    dequantised = _fp32_logprobs(family, _dequantised_state(
        load_file(str(served / "model.safetensors")), tuple(block)))
    noise = (generated - dequantised).abs()
    mismatch = (generated - bf16).abs()
    quantisation = (dequantised - bf16).abs().max()
    # The engine computes with exactly the FP8 weights and scales it loaded...
    assert noise.mean() < NOISE_MEAN and noise.max() < NOISE_MAX, noise
    # ...so the mismatch against the trainer's weights is the quantisation's, clearly above the
    # engine's own noise, and bounded by what quantisation does to the FP32 function.
    assert mismatch.mean() > 3 * noise.mean(), (mismatch.mean(), noise.mean())
    assert mismatch.max() <= quantisation + NOISE_MAX, (mismatch.max(), quantisation)
