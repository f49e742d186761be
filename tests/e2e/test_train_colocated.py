"""`megatron-rl train` with colocated placement on the real stack (Ray, one SGLang CPU engine in
the bundle of the one Megatron rank): each step releases the engine's memory through SGLang's own
endpoints before training, resumes the weights' memory, loads the new weights, resumes the rest.

The independent check is parity: with the synchronous schedule every step's samples come from
the weights the trainer held, so the train/generator log-prob mismatch stays at float noise on
every step, which it would not if the release / resume cycle or the load into resumed memory
lost or corrupted weights (or the KV cache of old weights were reused)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: add the helpers
from _checks import (processes_left, run_train, scalars as read_scalars,  # noqa: E402
                     tiny_llama_checkpoint)

pytestmark = pytest.mark.e2e


def test_megatron_rl_train_colocated_synchronous(tmp_path):
    checkpoint = tiny_llama_checkpoint(tmp_path / "tiny_llama")
    out = tmp_path / "run"
    rc, stdout, stderr, pid = run_train(
        ["examples/configs/tiny_pipeline.yaml", f"output_dir={out}",
         f"model.hf_checkpoint={checkpoint}", "logging.progress_bar=false",
         "cluster.colocated=true", "rollout.max_off_policyness=0", "train.num_steps=3",
         "eval.at_step_zero=false", "eval.interval_steps=0", "checkpoint.interval_steps=0",
         "algorithm.zero_variance_filter=false"],  # the random policy solves nothing
        timeout=1200)
    assert rc == 0, stdout[-3000:] + stderr[-6000:]
    scalars = read_scalars(out / "tensorboard")
    assert sorted(scalars["colocated/release_seconds"]) == [1, 2, 3]  # released every step
    assert set(scalars["weight_sync/version"].values()) == {1.0, 2.0, 3.0}
    assert set(scalars["train/skipped"].values()) == {0.0}
    assert max(scalars["rollout/staleness/max_lag"].values()) == 0  # synchronous
    mismatch = scalars["train/logp_mismatch_mean"]
    assert sorted(mismatch) == [1, 2, 3] and max(mismatch.values()) < 1e-4, mismatch
    log = (out / "generator-0.log").read_text()
    assert "/release_memory_occupation" in log and "/resume_memory_occupation" in log
    left = processes_left(model_dir=checkpoint, driver_pid=pid)
    assert not left, f"processes outlived the run: {left}"
