"""tools/gpu_smoke.py --dry-run on CPU: every import and configuration path of the GPU smoke test
runs without a GPU and the JSON report says what a GPU run would do. The slice's TE layer spec
has Transformer Engine modules in exactly the slots TE fills (placeholders here, TE absent), the
FP8 recipes set Megatron's fields, the chunked FP32 head beats the bf16 head's accuracy against
fp64 at a tiny size, and the SGLang server arguments and weight-sync transports follow the GPU
count (one GPU: in-memory hand-over, as NCCL refuses two ranks on one device), and SGLang's own
argument parser accepts those arguments. A subprocess: the
dry run activates the CPU shims and imports Megatron, which this test process must not inherit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_smoke_dry_run(tmp_path):
    output = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "tools/gpu_smoke.py", "--dry-run", "--output",
                           str(output)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["dry_run"] and report["within_time_limit"]
    sections = report["sections"]
    assert {name: s["status"] for name, s in sections.items()} == {
        "te_slice": "ok", "logprob_head": "ok", "sglang_sync": "ok"}

    te = sections["te_slice"]
    assert te["fp32"]["params_dtype"] == "torch.float32"
    assert te["bf16"]["params_dtype"] == "torch.bfloat16"
    assert te["bf16"]["num_layers"] == 2 and te["bf16"]["hidden_size"] == 5120  # Scout's width
    spec = te["layer_spec"]
    assert spec["self_attention"] == "Llama4SelfAttention"
    assert spec["self_attention.core_attention"] == "Llama4CoreAttention"
    assert spec["mlp"] == "MoELayer" and spec["pre_mlp_layernorm"] == "_TENormWithResidual"
    if report["environment"]["transformer-engine"] is None:  # CI: TE's slots are placeholders
        assert set(te["te_placeholders"]) == {
            "self_attention.linear_qkv", "self_attention.linear_proj",
            "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"}
    assert te["fp8_fields"] == {"delayed": {"fp8": "hybrid", "fp8_recipe": "delayed"},
                                "mxfp8": {"fp8": "e4m3", "fp8_recipe": "mxfp8"}}

    head = sections["logprob_head"]
    assert head["chunked_fp32"]["max_abs_err_vs_fp64"] < 1e-5
    assert head["bf16_head"]["max_abs_err_vs_fp64"] > 10 * head["chunked_fp32"][
        "max_abs_err_vs_fp64"]

    sync = sections["sglang_sync"]
    args = sync["server_args"]
    assert args[args.index("--device") + 1] == "cuda"
    assert args[args.index("--dtype") + 1] == "bfloat16"
    assert "--enable-fp32-lm-head" in args and "--disable-cuda-graph" not in args
    # ... and SGLang's own parser takes them.
    assert sync["sglang_parsed"] == {"device": "cuda", "dtype": "bfloat16",
                                     "mem_fraction_static": "0.3", "enable_fp32_lm_head": "True"}
    assert (sync["transport_1_gpu"], sync["baseline_1_gpu"]) == ("tensor", "device_copy")
    assert (sync["transport_2_gpus"], sync["baseline_2_gpus"]) == ("distributed",
                                                                   "nccl_broadcast")
    assert sync["family"] == "llama" and sync["num_weight_groups"] > 0


def test_gpu_smoke_refuses_a_real_run_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "tools/gpu_smoke.py", "--output",
                           str(tmp_path / "r.json"), "--sections", "logprob_head"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr, proc.stderr[-2000:]
