"""`megatron-rl train` end to end on the real stack: Ray, one SGLang CPU generator and one Megatron
trainer rank, reasoning-gym arithmetic scored by its own verifier, the tiny recipe
(examples/configs/tiny_pipeline.yaml) for a few steps.

Checked against independent references: step 1's train/generator log-prob mismatch (both start
from the same HF checkpoint, fp32) is at float noise; the staleness histogram never exceeds k and
data of older versions is trained on (the pipeline runs ahead); forced interruption fires; the
scaling log, TensorBoard and a checkpoint are written; and nothing outlives the run (no SGLang or
Ray process left in the process table).
"""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: add the helpers
from _checks import (processes_left, run_train, scalars as read_scalars,  # noqa: E402
                     tiny_llama_checkpoint)

pytestmark = pytest.mark.e2e


def test_megatron_rl_train_tiny_pipeline(tmp_path):
    checkpoint = tiny_llama_checkpoint(tmp_path / "tiny_llama")
    out = tmp_path / "run"
    rc, stdout, stderr, pid = run_train(
        ["examples/configs/tiny_pipeline.yaml", f"output_dir={out}",
         f"model.hf_checkpoint={checkpoint}", "logging.progress_bar=false",
         # The random starting policy solves no problem, so every group has zero reward
         # variance and the filter would leave no step anything to train on: keep the groups
         # (zero advantages) so that every step runs the trainer and its parity check.
         "algorithm.zero_variance_filter=false"],
        timeout=1200)
    assert rc == 0, stdout[-3000:] + stderr[-6000:]

    lines = [json.loads(line) for line in (out / "scaling.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if line["task"] == "all"] == [0, 2, 4]
    scalars = read_scalars(out / "tensorboard")
    # Same weights on both sides before the first update: float noise only (fp32).
    assert scalars["train/logp_mismatch_mean"][1] < 1e-4, scalars["train/logp_mismatch_mean"]
    assert max(scalars["rollout/staleness/max_lag"].values()) <= 2  # k = 2
    assert max(scalars["rollout/staleness/mean_lag"].values()) > 0  # older data was trained on
    assert max(scalars["rollout/interruption_rate"].values()) > 0
    assert set(scalars["weight_sync/version"].values()) == {1.0, 2.0, 3.0, 4.0}
    assert set(scalars["train/skipped"].values()) == {0.0}  # every step trained
    # Utilisation: fractions of wall time; tokens are counted when a request returns, so a step
    # whose groups were all generated before it (the pipeline runs ahead) may count none.
    for tag in ("perf/generator_busy_fraction", "perf/trainer_idle_fraction",
                "weight_sync/step_fraction"):
        assert all(0.0 <= v <= 1.0 for v in scalars[tag].values()), (tag, scalars[tag])
    assert max(scalars["perf/generator_busy_fraction"].values()) > 0
    assert sum(scalars["perf/generation_tokens_per_s"].values()) > 0
    assert all(v >= 0 for v in scalars["weight_sync/paused_s"].values())
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000004"]
    left = processes_left(model_dir=checkpoint, driver_pid=pid)
    assert not left, f"processes outlived the run: {left}"
