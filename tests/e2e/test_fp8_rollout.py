"""FP8 rollout end to end (issue 40, acceptance 1): `megatron-rl train
examples/configs/tiny_pipeline.yaml` on the tiny Llama-4 MoE (models/llama4 size "tiny": 4 layers,
4 top-1 experts and a shared expert each; trainer in fp32) with rollout.precision=fp8 and [16, 16]
block scales (rollout.fp8_block_size=16: divides every shard and holds whole heads, head_dim 16),
Pipeline-RL with in-flight updates (max_off_policyness 2), 4 steps. The run writes the FP8 copy of
the checkpoint the engine starts from (output_dir/served_fp8), SGLang's CPU engine serves it
through its own FP8 loader (Llama4ForConditionalGeneration: experts un-fused, q/k rows permuted)
and the CPU FP8 shim (platform/sglang_fp8_cpu.py), and every in-flight update is quantised by the
weight sync in the same layout (fused experts un-fused per expert, block scales) into the
engine's FP8 parameters. rollout.dtype=bfloat16: SGLang's FP8 layers take bf16 activations only
(and its Llama-4 path hard-codes bf16 q/k norm).

What it shows, per step, from the run's TensorBoard: the trainer's fp32 log-probs against the
generator's (train/logp_mismatch_mean / _max over the step's loss tokens). Measured with this
recipe (4 steps; the command below without rollout.precision / fp8_block_size for bf16, 2-core
CPU at load 6-14, both runs at once): served in bf16, mean 0.00075-0.00081 / max 0.0035-0.0043
per step; served in FP8 ([16, 16] blocks), mean 0.0059-0.0065 / max 0.023-0.031. So each step's
mean must be clearly above the bf16-served level (MIN_MEAN, 2.5x it) and below MAX_MEAN /
MAX_MAX (8x / 16x the FP8 level: a wrong scale costs whole nats), and stay level across the
updates: a wrong scale, an expert left stale, q/k rows written unpermuted or a block scale applied
to the wrong block by an in-flight update would show as a jump (JUMP: no step's mean more than 3x
another's).

The dense Llama is not run here: SGLang 0.5.23's Llama loader drops block scales, so it serves
per-tensor only (config.fp8_serving_problem); that layout is loaded by a real server in
tests/integration/test_fp8_sglang.py.
"""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: add the helpers
from _checks import processes_left, run_train, scalars, tiny_llama4_checkpoint  # noqa: E402

pytestmark = [pytest.mark.e2e]

MIN_MEAN = 2e-3
MAX_MEAN = 0.05
MAX_MAX = 0.5
JUMP = 3.0
NUM_STEPS = 4
# The correction diagnostics (algorithms/mismatch.py), logged every step.
MISMATCH_TAGS = ("kl_k1", "kl_k3", "ratio_p01", "ratio_p50", "ratio_p99",
                 "masked_token_fraction", "masked_sequence_fraction")


def test_fp8_served_llama4_rollouts_with_in_flight_updates(tmp_path):
    model = tiny_llama4_checkpoint(tmp_path / "tiny_llama4")
    out = tmp_path / "run"
    rc, stdout, stderr, driver_pid = run_train([
        "examples/configs/tiny_pipeline.yaml", f"output_dir={out}", "model.name=llama4",
        f"model.hf_checkpoint={model}", "rollout.precision=fp8", "rollout.fp8_block_size=16",
        "rollout.dtype=bfloat16",
        f"train.num_steps={NUM_STEPS}", "eval.at_step_zero=false", "eval.interval_steps=0",
        "checkpoint.interval_steps=0", "logging.progress_bar=false",
        # The random policy solves nothing: keep the zero-variance groups, so every step trains.
        "algorithm.zero_variance_filter=false"], timeout=900)
    assert rc == 0, stdout[-4000:] + stderr[-4000:]

    # The engine served the run's FP8 copy, loaded by SGLang as a block-scaled FP8 checkpoint.
    served = (out / "served_fp8").resolve()
    config = json.loads((served / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [16, 16]}
    log = (out / "generator-0.log").read_text()
    assert f"'model_path': '{served}'" in log and "quant=fp8, fmt=e4m3" in log

    metrics = scalars(out / "tensorboard")
    mean, peak = metrics["train/logp_mismatch_mean"], metrics["train/logp_mismatch_max"]
    assert sorted(mean) == list(range(1, NUM_STEPS + 1)), mean
    for tag in MISMATCH_TAGS:
        assert sorted(metrics[f"train/mismatch/{tag}"]) == sorted(mean), tag
    assert metrics["weight_sync/version"][NUM_STEPS] == NUM_STEPS  # every step synced
    # Every sync quantised, per layer, q, k, v, o, the shared expert's gate, up and down, and
    # each of the 4 experts' gate, up and down (un-fused): 4 layers x 19 (router, norms,
    # embeddings and lm_head stay bf16).
    text = json.loads((model / "config.json").read_text())["text_config"]
    per_layer = 4 + 3 + 3 * text["num_local_experts"]
    assert set(metrics["weight_sync/quantized_tensors"].values()) == {
        per_layer * text["num_hidden_layers"]} == {76}
    for step in mean:
        assert MIN_MEAN < mean[step] < MAX_MEAN, (step, mean)
        assert peak[step] < MAX_MAX, (step, peak)
    assert max(mean.values()) < JUMP * min(mean.values()), mean
    assert not processes_left(model_dir=served, driver_pid=driver_pid)
