"""tools/gpu_smoke.py on CPU. `--dry-run --cpu` writes one JSON record per stage, in the stage
order, every stage's configuration checked (stage 6: the FP8 engine's layout through SGLang's
Fp8Config, the weight sync's own quantiser and bucket plan against the planner, the run's FP8
copy of the weights holding what the sync writes): the FP8 recipes
pad every micro-batch (the padding one too) to their token alignment, SGLang's own parser takes
both servers' arguments, the in-memory sync's buckets are small enough to reuse buffers, the
trainer environment of the colocated hand-over has no expandable segments, and the Scout MoE
layer's planner figure is there; and stage 2 runs RLTrainer for real on the CPU stand-in (gloo,
local spec): fp32 log-probs equal transformers' fp32 forward of the same converted weights, bf16
ones differ by bf16 noise only, a padding micro-batch changes no statistic, and train_step runs
over it. A subprocess: the run activates the CPU shims and imports Megatron, which this test
process must not inherit.
(~15 s: out of the unit tier; the runner itself is tests/unit/test_gpu_smoke.py.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_smoke  # noqa: E402  (imports neither torch's CUDA side nor Megatron)


def test_dry_run_on_cpu_checks_every_stage_and_runs_the_trainer(tmp_path):
    output = tmp_path / "smoke.jsonl"
    proc = subprocess.run([sys.executable, "tools/gpu_smoke.py", "--dry-run", "--cpu",
                           "--output", str(output)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["stage"] for r in records] == list(gpu_smoke.STAGES)
    assert [r["index"] for r in records] == list(range(len(gpu_smoke.STAGES)))
    for record in records:
        assert set(record) == set(gpu_smoke.RECORD_FIELDS)
        assert (record["status"], record["mode"], record["error"]) == ("ok", "cpu", None)
    assert sum(r["budget_s"] for r in records) == gpu_smoke.TIME_LIMIT_S == 600
    imports, trainer, sglang, colocated, moe, fp8_serving = (r["result"] for r in records)

    assert imports["modules"]["megatron.core"]["imported"]
    env = imports["environment"]
    assert env["shared_disagree"] == {}
    assert env["trainer_ranks"]["NCCL_CUMEM_ENABLE"] == env["engines"]["NCCL_CUMEM_ENABLE"]

    chunk = trainer["attention_chunk_size"]
    assert min(trainer["sequence_lengths"]) > chunk
    assert len({n % 8 for n in trainer["sequence_lengths"]}) > 1  # uneven lengths
    for name, alignment in (("fp8_delayed_te", 16), ("fp8_mxfp8_te", 32)):
        fp8 = trainer["configuration"]["precisions"][name]
        assert fp8["pad_to_multiple"] % alignment == 0, fp8
        assert all(n % alignment == 0 for n in fp8["micro_batch_lengths"]), fp8
        assert fp8["padding_micro_batch_length"] % alignment == 0, fp8
        assert fp8["fp8_fields"]["fp8_recipe"] == name.split("_")[1]
    spec = trainer["configuration"]["precisions"]["bf16_te"]["layer_spec"]
    assert spec["self_attention.core_attention"] == "Llama4CoreAttention"
    assert spec["mlp"] == "MoELayer"
    fp32, bf16 = trainer["precisions"]["fp32_local"], trainer["precisions"]["bf16_local"]
    assert fp32["backend"] == "gloo" and fp32["parameter_device"] == "cpu"
    # Against transformers' fp32 forward of the converted weights: equal in fp32 (the reference
    # and the conversion agree), bf16 noise in bf16 (so the comparison can tell them apart).
    assert fp32["logp_vs_reference"]["mean_abs"] < 1e-5
    assert 1e-4 < bf16["logp_vs_reference"]["mean_abs"] < 1e-2
    for run in (fp32, bf16):
        assert run["logp_with_padding"] == run["logp_vs_reference"]  # the padding counts nothing
        assert run["micro_batch_lengths"][-1] == 1  # the padding micro-batch, last
        step = run["train_step"]
        assert step["num_micro_batches"] == len(run["micro_batch_lengths"]) > 2
        assert not step["skipped"] and step["num_loss_tokens"] == sum(
            c for _, c in gpu_smoke.SEQUENCE_LENGTHS)

    for name, saver in (("server_sglang", "False"), ("server_colocated", "True")):
        parsed = sglang[name]["parsed"]  # by SGLang's own argument parser
        assert (parsed["device"], parsed["dtype"], parsed["enable_memory_saver"]) == (
            "cuda", "bfloat16", saver)
        # Issue 39.2: the chunked-attention model on a backend that honours the chunk (fa3: no
        # GPU here, so the Hopper default; Blackwell's torch_native is tested below);
        # 39.3: the colocated engine keeps its q/k-norm weight across a release.
        assert parsed["attention_backend"] == "fa3"
        assert parsed["enable_weights_cpu_backup"] == saver
    syncs = sglang["syncs"]
    assert (syncs["distributed"]["transport"], syncs["distributed"]["backend"]) == (
        "distributed", "gloo")
    assert syncs["tensor"]["transport"] == "tensor"
    assert sglang["min_tensor_buckets"] >= gpu_smoke.MIN_BUCKETS
    assert sglang["family"] == "llama4" and sglang["num_weight_groups"] > 0

    assert not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(
        colocated["trainer_environment"])
    assert colocated["resume_order"][0] == ["weights"]

    assert (moe["hidden_size"], moe["num_moe_experts"], moe["moe_ffn_hidden_size"]) == (
        5120, 16, 8192)  # Scout's
    assert moe["planner_bytes"] == sum(moe["planner_parts"].values()) > 0
    assert {"attention", "experts", "router"} <= set(moe["planner_parts"])

    # Stage 6 (issue 40): SGLang's own Fp8Config reads the served layout; the weight sync's own
    # bucket plan with its quantiser, and the quantiser's bytes, are the planner's
    # (tests/unit/test_gpu_smoke.py checks the rest in-process).
    assert fp8_serving["sglang_weight_block_size"] == [64, 64]  # 2 KV heads of 32
    assert fp8_serving["fp8_bytes"] == fp8_serving["planner"]["fp8"] > 0
    assert fp8_serving["sync_bytes"] == fp8_serving["planner"]
    # The run's FP8 copy (cluster/served_checkpoint.py) of stage 2's weights holds what the sync
    # writes: FP8 per layer q, k, v, o, the shared expert's 3 and 4 experts x 3, over 4 layers.
    assert fp8_serving["served_copy"]["fp8"] == 4 * (4 + 3 + 4 * 3)
