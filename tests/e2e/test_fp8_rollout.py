"""FP8 rollout end to end (issue 40, acceptance 1): `megatron-rl train
examples/configs/tiny_pipeline.yaml` with rollout.precision=fp8 and [16, 16] blocks (the tiny
Llama's shards are multiples of 16), Pipeline-RL with in-flight updates (max_off_policyness 2),
4 steps. The run writes the FP8 copy of the checkpoint the engine starts from
(output_dir/served_fp8), SGLang's CPU engine serves it through its own FP8 loader and the CPU
FP8 shim (platform/sglang_fp8_cpu.py), and the weight sync quantises every update in the same
layout into the engine's FP8 parameters, in flight.

What it shows, per step, from the run's TensorBoard: the trainer's fp32 log-probs against the
generator's (train/logp_mismatch_mean / _max over the step's loss tokens). Served in fp32, that
mismatch is ~1e-6 (tests/e2e/test_long_generation.py asserts < 1e-4 mean); served in FP8 it is
the weights' quantisation error (e4m3: each weight within 2^-4 of itself relative, ~2.6 % in
Frobenius norm), so here it must be clearly above the fp32 level (MIN_MEAN = 100x it) and below
MAX_MEAN / MAX_MAX at every step, and stay level across the updates: a wrong scale, a tensor
left stale or written into the wrong place by an in-flight update would show as a jump
(JUMP: no step's mean more than 3x another's). Measured (the command and figures in
docs/low_precision.md): see MEASURED below.
"""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: add the helpers
from _checks import processes_left, run_train, scalars, tiny_llama_checkpoint  # noqa: E402

pytestmark = [pytest.mark.e2e]

MIN_MEAN = 1e-4  # 100x the fp32-served level (~1e-6)
MAX_MEAN = 0.1
MAX_MAX = 1.0
JUMP = 3.0
NUM_STEPS = 4


def test_fp8_served_rollouts_with_in_flight_updates(tmp_path):
    model = tiny_llama_checkpoint(tmp_path / "tiny_llama")
    out = tmp_path / "run"
    rc, stdout, stderr, driver_pid = run_train([
        "examples/configs/tiny_pipeline.yaml", f"output_dir={out}",
        f"model.hf_checkpoint={model}", "rollout.precision=fp8", "rollout.fp8_block_size=16",
        f"train.num_steps={NUM_STEPS}", "eval.at_step_zero=false", "eval.interval_steps=0",
        "checkpoint.interval_steps=0", "logging.progress_bar=false",
        # The random policy solves nothing: keep the zero-variance groups, so every step trains.
        "algorithm.zero_variance_filter=false"], timeout=900)
    assert rc == 0, stdout[-4000:] + stderr[-4000:]

    # The engine served the run's FP8 copy, loaded by SGLang as an FP8 checkpoint.
    served = out / "served_fp8"
    config = json.loads((served / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [16, 16]}
    log = (out / "generator-0.log").read_text()
    assert f"'model_path': '{served}'" in log and "quant=fp8, fmt=e4m3" in log

    metrics = scalars(out / "tensorboard")
    mean, peak = metrics["train/logp_mismatch_mean"], metrics["train/logp_mismatch_max"]
    assert sorted(mean) == list(range(1, NUM_STEPS + 1)), mean
    assert metrics["weight_sync/version"][NUM_STEPS] == NUM_STEPS  # every step synced
    for step in mean:
        assert MIN_MEAN < mean[step] < MAX_MEAN, (step, mean)
        assert peak[step] < MAX_MAX, (step, peak)
    assert max(mean.values()) < JUMP * min(mean.values()), mean
    assert not processes_left(model_dir=served, driver_pid=driver_pid)
