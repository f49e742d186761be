"""tools/gpu_smoke.py on CPU. `--dry-run --cpu` writes one JSON record per stage, in the stage
order, every stage's configuration checked: the FP8 recipes pad every micro-batch (the padding one
too) to their token alignment, SGLang's own parser takes both servers' arguments, the in-memory
sync's buckets are small enough to reuse buffers, the trainer environment of the colocated
hand-over has no expandable segments, and the Scout MoE layer's planner figure is there; and stage
2 runs RLTrainer for real on the CPU stand-in (gloo, local spec): fp32 log-probs equal
transformers' fp32 forward of the same converted weights, bf16 ones differ by bf16 noise only, a
padding micro-batch changes no statistic, and train_step runs over it. A subprocess: the run
activates the CPU shims and imports Megatron, which this test process must not inherit.

The runner itself (fail-fast, a stage's time budget, the record shape) is checked in-process with
stand-in stages.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

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
    imports, trainer, sglang, colocated, moe = (r["result"] for r in records)

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


def test_a_real_run_refuses_without_a_gpu(tmp_path):
    proc = subprocess.run([sys.executable, "tools/gpu_smoke.py", "--output",
                           str(tmp_path / "r.jsonl"), "--stages", "imports"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "tools/gpu_smoke.py", "--cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "pass --dry-run --cpu" in proc.stderr, proc.stderr[-2000:]


def _stand_ins(monkeypatch, stages: dict) -> None:
    monkeypatch.setitem(gpu_smoke.RUNNERS, "dry_run", stages)


def test_the_first_failure_stops_the_run_and_every_stage_gets_a_record(tmp_path, monkeypatch):
    def failing(ctx):
        gpu_smoke.expect(False, "log-probs differ", {"mean_abs": 0.3})

    calls = []
    _stand_ins(monkeypatch, {
        "imports": lambda ctx: calls.append("imports") or {"torch": "x"},
        "trainer": failing,
        "sglang": lambda ctx: calls.append("sglang") or {},
        "colocated": lambda ctx: calls.append("colocated") or {},
        "moe_layer": lambda ctx: calls.append("moe_layer") or {}})
    output = tmp_path / "out.jsonl"
    ctx = gpu_smoke.Context(mode="dry_run", work=tmp_path)
    records = gpu_smoke.run(ctx, list(gpu_smoke.STAGES), output)
    assert calls == ["imports"]
    assert [r["status"] for r in records] == ["ok", "failed", "not_run", "not_run", "not_run"]
    failed = records[1]
    assert failed["error"] == "SmokeFailure: log-probs differ"
    assert failed["result"] == {"mean_abs": 0.3} and "Traceback" in failed["traceback"]
    assert records[2]["error"] == "stage trainer failed first"
    assert [json.loads(line) for line in output.read_text().splitlines()] == records


def test_a_stage_over_its_budget_fails(tmp_path, monkeypatch):
    _stand_ins(monkeypatch, {"imports": lambda ctx: time.sleep(5) or {}})
    monkeypatch.setitem(gpu_smoke.STAGE_BUDGET_S, "imports", 0.3)
    started = time.monotonic()
    (record,) = gpu_smoke.run(gpu_smoke.Context(mode="dry_run", work=tmp_path), ["imports"],
                              tmp_path / "out.jsonl")
    assert time.monotonic() - started < 4
    assert record["status"] == "failed" and record["error"].startswith("StageTimeout")


def test_the_per_position_check_tells_a_chunk_ignoring_engine(tmp_path):
    """Issue 39.2's GPU check: log-probs that agree within the chunk and not past it (an engine
    attending to the whole prefix) fail past the chunk only."""
    import torch

    reference = [torch.zeros(9), torch.zeros(5)]
    ignoring = [torch.cat([torch.zeros(3), torch.ones(6)]), torch.cat([torch.zeros(3),
                                                                      torch.ones(2)])]
    split = gpu_smoke.by_position(ignoring, reference, chunk=4)  # positions 1-3 in the chunk
    assert split["within_chunk"] == {"mean_abs": 0.0, "max_abs": 0.0, "num_tokens": 6}
    assert split["past_chunk"] == {"mean_abs": 1.0, "max_abs": 1.0, "num_tokens": 8}



@pytest.mark.parametrize("capability, backend", [((9, 0), "fa3"), ((10, 0), "torch_native"),
                                                 (None, "fa3")],
                         ids=["hopper", "blackwell", "unknown"])
def test_the_sglang_stages_serve_the_chunk_on_hopper_and_blackwell(tmp_path, monkeypatch,
                                                                   capability, backend):
    """Issue 39.2: the per-position check past the chunk runs on Blackwell too, on torch_native
    (patched to honour the chunk, one KV pool); Hopper keeps megatron_rl's default, fa3. Both
    engines' arguments through SGLang's own parser; nothing is refused."""
    import types

    from megatron_rl.rollout import sglang_server

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Llama4ForConditionalGeneration"],
        "text_config": {"attention_chunk_size": 48, "use_qk_norm": True}}))
    monkeypatch.setattr(sglang_server, "gpu_compute_capability", lambda: capability)
    ctx = types.SimpleNamespace(model=types.SimpleNamespace(served_dir=tmp_path), work=tmp_path)
    assert gpu_smoke.chunked_attention_refusal(ctx) is None
    for saver in (False, True):
        args = gpu_smoke.server_settings(ctx, memory_saver=saver, name="probe").server_args(30000)
        parsed = gpu_smoke.parse_with_sglang(args)
        assert (parsed["device"], parsed["attention_backend"]) == ("cuda", backend)
        assert parsed["disable_hybrid_swa_memory"] is (backend == "torch_native")
        assert parsed["enable_weights_cpu_backup"] is saver
