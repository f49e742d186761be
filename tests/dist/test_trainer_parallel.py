"""The Megatron RL trainer across parallel layouts on 4 (and 2) CPU ranks with gloo.

Each launch runs tests/dist/_trainer_worker.py under `torchrun --standalone` (the `torchrun`
fixture of tests/dist/conftest.py: own free port, timeout); the worker batches many checks per
launch and rank 0 reports numbers as JSON, which the tests below assert on:
- parallel invariance: one RL step of the same batch from the same weights at (TP, EP, PP) =
  (1,1,1) DP4, (2,1,1)+SP DP2, (1,2,1) DP4, (1,1,2) DP2, (2,2,2)+SP DP1 gives the same loss,
  gradient norm, train / rollout mismatch metrics and updated parameters (grad norm catches gradient-scale errors that Adam's
  scale-free first update would hide);
- aggregation exactness: the prompt-level CISPO loss and gradient norm equal an independent
  single-rank reference (plain autograd on the unwrapped GPTModel, full-vocabulary log_softmax in
  float64, the loss and prompt averaging written out by hand), with uneven completion lengths spread
  over DP ranks and 1-3 micro-batches;
- checkpoint resharding: saved at (1,1,1) after one step, resumed at (2,2,2)+SP, steps 2 and 3
  match the uninterrupted run (step 3 depends on the restored Adam state);
- the Llama-4 tiny family from models/ at (1,1,1) and (2,2,2)+SP;
- learning signal (the GRPO loss falls on a fixed batch) and skipping of a non-finite step;
- offloading between steps (colocated runs): gradient buffers freed after construction, every
  step, a checkpoint save and a load, with losses, weights, Adam state and the checkpoint
  bit-identical to a trainer that keeps everything; only separate FP32 main copies may leave.
"""
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "_trainer_worker.py"
# Float32 end to end; different layouts sum partial results in different orders.
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def invariance(tmp_path_factory, torchrun_result) -> dict:
    out_dir = tmp_path_factory.mktemp("invariance")
    return torchrun_result(WORKER, ["invariance", str(out_dir)], out_dir=out_dir, num_ranks=4,
                           timeout_s=480)


@pytest.fixture(scope="module")
def training(tmp_path_factory, torchrun_result) -> dict:
    out_dir = tmp_path_factory.mktemp("training")
    return torchrun_result(WORKER, ["training", str(out_dir)], out_dir=out_dir, num_ranks=2,
                           timeout_s=240)


def _close(a: float, b: float, rel: float = REL_TOL) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


def test_same_loss_and_grad_norm_at_every_layout(invariance):
    layouts = invariance["layouts"]
    reference = layouts["tp1_ep1_pp1"]
    assert set(layouts) == {"tp1_ep1_pp1", "tp2_sp", "ep2", "pp2", "tp2_ep2_pp2_sp"}
    for name, got in layouts.items():
        assert _close(got["loss"], reference["loss"]), (name, got, reference)
        assert _close(got["grad_norm"], reference["grad_norm"]), (name, got, reference)
        assert got["num_loss_tokens"] == reference["num_loss_tokens"] == 27
        # The train / rollout mismatch metrics: sums and histograms reduced over DP, taken from
        # the last pipeline stage, not summed over TP.
        mismatch, expected = got["mismatch"], reference["mismatch"]
        assert set(mismatch) == set(expected) and "mismatch/ratio_p50" in expected, name
        assert all(_close(mismatch[k], expected[k]) for k in expected), (name, mismatch, expected)
    # The layouts really differ in data parallelism and micro-batching.
    assert [layouts[n]["dp_size"] for n in ("tp1_ep1_pp1", "tp2_sp", "pp2", "tp2_ep2_pp2_sp")] \
        == [4, 2, 2, 1]
    assert layouts["tp2_ep2_pp2_sp"]["num_micro_batches"] >= 3


def test_same_parameter_update_at_every_layout(invariance):
    for name, diff in invariance["param_diffs"].items():
        # The update itself is ~lr = 1e-3 per weight; layouts agree to float32 rounding.
        assert diff["max_abs_update"] > 5e-4, (name, diff)
        assert diff["max_abs_diff_vs_reference"] < 1e-7, (name, diff)


def test_prompt_level_loss_matches_single_rank_reference(invariance):
    naive = invariance["naive_reference"]
    for name, got in invariance["layouts"].items():
        assert _close(got["loss"], naive["loss"]), (name, got, naive)
        assert _close(got["grad_norm"], naive["grad_norm"]), (name, got, naive)


def test_checkpoint_resumes_at_another_layout(invariance):
    uninterrupted = invariance["layouts"]["tp1_ep1_pp1"]["continued"]
    resumed = invariance["resumed"]
    assert resumed["step"] == 1
    assert resumed["rng_restored"] is False  # per-rank RNG only restores at the same layout
    assert resumed["extra_state"] == {"sampler": {"epoch": 3, "retired": [1, 5]}}
    assert all(_close(a, b) for a, b in zip(resumed["losses"], uninterrupted)), \
        (resumed["losses"], uninterrupted)


def test_llama4_tiny_runs_at_tp2_ep2_pp2(invariance):
    llama = invariance["llama4"]
    assert _close(llama["tp2_ep2_pp2_sp"]["loss"], llama["tp1_ep1_pp1"]["loss"]), llama
    assert _close(llama["tp2_ep2_pp2_sp"]["grad_norm"], llama["tp1_ep1_pp1"]["grad_norm"]), llama


def test_rl_loss_falls_on_a_fixed_batch(training):
    losses = training["losses"]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses


def test_non_finite_step_is_skipped_and_counted(training):
    skip = training["skip"]
    assert skip["skipped"] is True and skip["loss_is_finite"] is False
    assert skip["num_skipped_steps"] == 1
    assert skip["step"] == len(training["losses"])  # the skipped step is not an update
    assert skip["max_param_change"] == 0.0
    # Training continues from the unchanged weights.
    assert training["after_skip_loss"] < training["losses"][-1]


def test_offloading_frees_the_gradient_buffers_between_steps(training):
    offload = training["offload"]
    assert offload["initial_param_diff"] == 0.0  # the same seed: the same initial weights
    # The plain trainer's buffer: 21,920 parameters of this TP rank, padded; all freed.
    assert offload["plain_grad_bytes"] >= 4 * 21920
    assert offload["grad_bytes_after_init"] == 0
    for step in offload["steps"]:
        assert step["grad_bytes_after"] == 0
        # On CPU the released bytes are the gradient buffers' (optimizer state stays put).
        assert step["offloaded_bytes"] == [0, offload["plain_grad_bytes"]]
    assert offload["grad_bytes_after_save"] == offload["grad_bytes_after_load"] == 0


def test_offloading_changes_no_bit_of_training_or_checkpoints(training):
    offload = training["offload"]
    for step in offload["steps"]:
        assert step["loss"][0] == step["loss"][1] and step["grad_norm"][0] == step["grad_norm"][1]
    assert offload["param_diff"] == 0.0
    assert offload["adam_tensors"] == 3 * 33 and offload["adam_diff"] == 0.0  # moments, step
    checkpoint = offload["checkpoint"]  # saved while offloaded vs saved by the plain trainer
    assert checkpoint["same_keys"] and checkpoint["other_leaves_equal"]
    assert checkpoint["optimizer_tensors"] > 0 and checkpoint["max_abs_diff"] == 0.0
    # Loaded while offloaded, the next step matches the plain trainer's third.
    assert offload["step3_loss"][0] == offload["step3_loss"][1] == training["losses"][2]
    assert offload["step3_param_diff"] == 0.0


def test_only_separate_main_copies_leave_with_the_optimizer_state(training):
    targets = training["offload"]["targets"]
    # FP32: the distributed optimizer's main params are views of the model's, FP32Optimizer's
    # are the model's own: moving either would detach the optimizer from the model.
    assert targets["fp32_distributed"]["num_main_params"] == 0
    assert targets["fp32_ddp"]["num_main_params"] == 0
    # After steps: exp_avg and exp_avg_sq (FP32) per element and a 4-byte step per tensor.
    fp32 = targets["fp32_distributed"]
    assert fp32["state_bytes"] == 8 * fp32["param_numel"] + 4 * fp32["num_params"]
    # bf16: every parameter has a separate FP32 copy (DP1: the shard is the whole rank).
    bf16 = targets["bf16_distributed"]
    assert bf16["num_main_params"] == bf16["num_params"] == 33
    assert bf16["main_param_numel"] == bf16["param_numel"]
    assert bf16["main_dtypes"] == ["torch.float32"]
