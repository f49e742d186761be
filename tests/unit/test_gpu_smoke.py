"""tools/gpu_smoke.py's runner in-process, with stand-in stages (fail-fast, a stage's time budget,
the record shape) and its configuration checks; the `--dry-run --cpu` run itself, a subprocess
that runs the trainer, is tests/integration/test_gpu_smoke_dry_run.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_smoke  # noqa: E402  (imports neither torch's CUDA side nor Megatron)


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
        "moe_layer": lambda ctx: calls.append("moe_layer") or {},
        "fp8_serving": lambda ctx: calls.append("fp8_serving") or {}})
    output = tmp_path / "out.jsonl"
    ctx = gpu_smoke.Context(mode="dry_run", work=tmp_path)
    records = gpu_smoke.run(ctx, list(gpu_smoke.STAGES), output)
    assert calls == ["imports"]
    assert [r["status"] for r in records] == ["ok", "failed"] + ["not_run"] * 4
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


def test_the_fp8_stage_quantises_what_the_planner_counts(monkeypatch):
    """Stage 6's configuration without SGLang: the demo model's largest block the planner
    accepts (k_proj / v_proj: 2 KV heads of 32 = 64 rows, so 64, not 128), the weight sync's
    own quantiser and bucket plan over every tensor SGLang holds in FP8 (per layer q, k, v, o,
    the fused experts' two tensors and the shared expert's three: 9 x 4 layers), bytes equal to
    the planner's; a quantiser writing other scales, or other shapes than the sync planned,
    fails the check."""
    served = gpu_smoke.fp8_served_config()
    assert served["block"] == 64
    assert served["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3",
                                             "activation_scheme": "dynamic",
                                             "weight_block_size": [64, 64]}
    result = gpu_smoke.quantiser_check(served, {})
    assert result["quantised_tensors"] == 36
    assert (result["fp8_bytes"], result["scale_bytes"]) == (result["planner"]["fp8"],
                                                            result["planner"]["scales"])
    assert result["sync_bytes"] == result["planner"]
    assert result["sync_buckets"] > 1  # the stage's small buckets: the FP8 plan is split
    assert 1 / 64 < result["max_error_over_amax"] <= (1 + 1e-5) / 28
    from megatron_rl.weight_sync import fp8

    real = fp8.quantize_named

    def halved_scales(name, tensor, layout):
        return {k: v / 2 if v.dtype == fp8.torch.float32 else v
                for k, v in real(name, tensor, layout).items()}

    monkeypatch.setattr(fp8, "quantize_named", halved_scales)
    with pytest.raises(gpu_smoke.SmokeFailure, match="round trip is off"):
        gpu_smoke.quantiser_check(served, {})
    monkeypatch.setattr(fp8, "quantize_named", real)
    # The sync's plan and its quantiser disagreeing (the plan one scale row short).
    planned = fp8.SyncQuantiser.planned

    def short_scales(self, name, tensor):
        out = planned(self, name, tensor)
        return out and {k: v[:-1] if v.dtype == fp8.torch.float32 else v for k, v in out.items()}

    monkeypatch.setattr(fp8.SyncQuantiser, "planned", short_scales)
    with pytest.raises(gpu_smoke.SmokeFailure, match="other than the sync's bucket plan"):
        gpu_smoke.quantiser_check(served, {})


def test_the_fp8_stage_skips_with_one_line_without_sglang(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang" else real(name, *a))
    result = gpu_smoke.stage_fp8_serving(gpu_smoke.Context(mode="gpu", work=tmp_path))
    assert result == {"skipped": "SGLang is not importable here: no FP8 engine to serve"}
