"""FP8 rollout end to end (issue 40, acceptance 1): `megatron-rl train
examples/configs/tiny_pipeline.yaml` (the tiny dense Llama, trainer in fp32) with
rollout.precision=fp8, Pipeline-RL with in-flight updates (max_off_policyness 2), 4 steps. The
run writes the FP8 copy of the checkpoint the engine starts from (output_dir/served_fp8), SGLang's
CPU engine serves it through its own FP8 loader and the CPU FP8 shim
(platform/sglang_fp8_cpu.py), and the weight sync quantises every update in the same layout into
the engine's FP8 parameters, in flight.

Per-tensor scales (rollout.fp8_block_size=null): SGLang 0.5.23's Llama loader drops block scales
(config.fp8_serving_problem says why; block layouts are served on the tiny Llama-4 in
tests/integration/test_fp8_sglang.py). rollout.dtype=bfloat16: SGLang's FP8 layers take bf16
activations only.

What it shows, per step, from the run's TensorBoard: the trainer's fp32 log-probs against the
generator's (train/logp_mismatch_mean / _max over the step's loss tokens). Served in fp32 that
mismatch is ~1e-6 (tests/e2e/test_long_generation.py asserts < 1e-4 mean). Measured with this
recipe (4 steps; `megatron-rl train examples/configs/tiny_pipeline.yaml rollout.dtype=bfloat16
...` as below, 2-core CPU at load 20-40): served in bf16, mean 0.00077-0.00081 / max
0.0029-0.0038 per step; served in FP8 (per-tensor), mean 0.0056-0.0070 / max 0.024-0.028. So
each step's mean must be clearly above the bf16-served level (MIN_MEAN, 2.5x it) and below
MAX_MEAN / MAX_MAX (7x / 18x the FP8 level: a wrong scale costs whole nats), and stay level
across the updates: a wrong scale, a tensor left stale or written into the wrong place by an
in-flight update would show as a jump (JUMP: no step's mean more than 3x another's).
"""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: add the helpers
from _checks import processes_left, run_train, scalars, tiny_llama_checkpoint  # noqa: E402

pytestmark = [pytest.mark.e2e]

MIN_MEAN = 2e-3
MAX_MEAN = 0.05
MAX_MAX = 0.5
JUMP = 3.0
NUM_STEPS = 4


def test_fp8_served_rollouts_with_in_flight_updates(tmp_path):
    model = tiny_llama_checkpoint(tmp_path / "tiny_llama")
    out = tmp_path / "run"
    rc, stdout, stderr, driver_pid = run_train([
        "examples/configs/tiny_pipeline.yaml", f"output_dir={out}",
        f"model.hf_checkpoint={model}", "rollout.precision=fp8", "rollout.fp8_block_size=null",
        "rollout.dtype=bfloat16",
        f"train.num_steps={NUM_STEPS}", "eval.at_step_zero=false", "eval.interval_steps=0",
        "checkpoint.interval_steps=0", "logging.progress_bar=false",
        # The random policy solves nothing: keep the zero-variance groups, so every step trains.
        "algorithm.zero_variance_filter=false"], timeout=900)
    assert rc == 0, stdout[-4000:] + stderr[-4000:]

    # The engine served the run's FP8 copy, loaded by SGLang as an FP8 checkpoint.
    served = (out / "served_fp8").resolve()
    config = json.loads((served / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    log = (out / "generator-0.log").read_text()
    assert f"'model_path': '{served}'" in log and "quant=fp8, fmt=e4m3" in log

    metrics = scalars(out / "tensorboard")
    mean, peak = metrics["train/logp_mismatch_mean"], metrics["train/logp_mismatch_max"]
    assert sorted(mean) == list(range(1, NUM_STEPS + 1)), mean
    assert metrics["weight_sync/version"][NUM_STEPS] == NUM_STEPS  # every step synced
    # Every sync quantised the 7 projections (q, k, v, o, gate, up, down) of every layer.
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    assert set(metrics["weight_sync/quantized_tensors"].values()) == {7 * layers}
    for step in mean:
        assert MIN_MEAN < mean[step] < MAX_MEAN, (step, mean)
        assert peak[step] < MAX_MAX, (step, peak)
    assert max(mean.values()) < JUMP * min(mean.values()), mean
    assert not processes_left(model_dir=served, driver_pid=driver_pid)
