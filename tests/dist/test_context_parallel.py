"""Context parallelism (CP) through the trainer on 4 CPU ranks with gloo, one torchrun launch of
tests/dist/_context_parallel_worker.py (see its docstring):
- SDPACoreAttention's all-gather CP path (local queries, all-gathered keys/values, causal mask in
  global positions; also Llama-4's chunked mask) equals full attention, outputs and gradients;
- the trainer's load-balanced split of packed micro-batches equals megatron-core's own
  get_batch_on_this_cp_rank on every rank;
- one RL step at CP 2 (DP 2) gives CP 1's (DP 4) loss, gradient norm and updated parameters for
  the llama, qwen3_moe and llama4 tiny families, with uneven completion lengths; and at
  TP 2 + SP with CP 2 (DP 1) the same loss and gradient norm; llama4's checkpoint saved at
  TP 2 + SP + CP 2 and loaded at CP 1 holds CP 1's updated parameters;
- the same CP 2 = CP 1 step with the GSPO loss (llama), whose sequence ratio is reduced over the
  CP ranks' slices of each completion;
- the train / rollout mismatch metrics equal at CP 1, CP 2 and TP 2 + SP + CP 2, and the same
  CP 2 = CP 1 step with DAPO and all three mismatch corrections (llama), whose sequence mask
  takes each completion's whole ratio.
"""
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "_context_parallel_worker.py"
# Float32 end to end; the layouts sum partial results in different orders.
REL_TOL = 1e-5
FAMILIES = ("llama", "qwen3_moe", "llama4")


@pytest.fixture(scope="module")
def result(tmp_path_factory, torchrun_result) -> dict:
    out_dir = tmp_path_factory.mktemp("context_parallel")
    return torchrun_result(WORKER, [str(out_dir)], out_dir=out_dir, num_ranks=4, timeout_s=360)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("mask", ["causal", "chunked"])
def test_all_gather_attention_equals_full_attention(result, mask):
    got = result["attention"][mask]
    assert got["local_shape"] == [12, 3, 128]  # half of the 24 positions on each CP rank
    assert got["out_max_abs_diff"] < 1e-5, got
    assert max(got["grad_max_abs_diff"]) < 1e-5, got  # q, k, v
    assert result["attention"]["chunk_mask_effect"] > 1e-2  # the chunk mask is not vacuous


def test_split_matches_megatron_core(result):
    split = result["split"]
    assert split["mismatched_fields"] == []
    # Packed lengths (padded to 2 * CP = 4) halve; the padding micro-batch too.
    assert all(local[1] * 2 == full[1] and local[0] == full[0]
               for full, local in split["shapes"]), split["shapes"]


@pytest.mark.parametrize("family", FAMILIES)
def test_cp2_step_equals_cp1_step(result, family):
    got = result["rl_step"][family]
    cp1, cp2 = got["cp1"], got["cp2"]
    assert (cp1["cp_size"], cp1["dp_size"], cp2["cp_size"], cp2["dp_size"]) == (1, 4, 2, 2)
    assert got["start_max_abs_diff"] == 0.0  # the same initial weights
    assert _close(cp2["loss"], cp1["loss"]), got
    assert _close(cp2["grad_norm"], cp1["grad_norm"]), got
    assert cp2["num_loss_tokens"] == cp1["num_loss_tokens"] == 27
    assert cp2["num_tokens"] == got["true_num_tokens"] == 49  # no position counted twice
    # Each CP rank holds half of its padded micro-batches (padded to 2 * CP).
    assert all(n % 2 == 0 for n in cp2["local_seq_lens"]), cp2
    # The update is ~lr = 1e-3 per weight; the layouts agree to float32 rounding.
    assert cp2["max_abs_update"] > 5e-4
    assert got["param_max_abs_diff"] < 1e-7, got
    _same_mismatch(cp2["mismatch"], cp1["mismatch"])


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_sp_cp2_step_equals_cp1_step(result, family):
    got = result["rl_step"][family]
    cp1, tp_cp = got["cp1"], got["tp2_sp_cp2"]
    assert (tp_cp["tp_size"], tp_cp["cp_size"], tp_cp["dp_size"]) == (2, 2, 1)
    assert _close(tp_cp["loss"], cp1["loss"]), got
    assert _close(tp_cp["grad_norm"], cp1["grad_norm"]), got
    assert tp_cp["num_tokens"] == got["true_num_tokens"]
    # Padded to 2 * CP * TP = 8: local lengths are multiples of 4, split again over TP by SP.
    assert all(n % 4 == 0 for n in tp_cp["local_seq_lens"]), tp_cp
    _same_mismatch(tp_cp["mismatch"], cp1["mismatch"])


def test_gspo_cp2_step_equals_cp1_step(result):
    """Issue 29.5: with each CP rank's own slice as the completion, CP 2's loss, gradient and
    update were those of other sequence ratios."""
    got = result["gspo_step"]["llama"]
    cp1, cp2 = got["cp1"], got["cp2"]
    assert (cp1["cp_size"], cp2["cp_size"]) == (1, 2)
    assert got["start_max_abs_diff"] == 0.0
    assert _close(cp2["loss"], cp1["loss"]), got
    assert _close(cp2["grad_norm"], cp1["grad_norm"]), got
    assert cp2["num_loss_tokens"] == cp1["num_loss_tokens"] == 27
    assert cp2["max_abs_update"] > 5e-4  # the A > 0 completions' ratios are not clipped
    assert got["param_max_abs_diff"] < 1e-7, got


def _same_mismatch(got: dict, expected: dict) -> None:
    """The step's mismatch metrics (KL estimates, histogram quantiles, shares masked) agree."""
    assert set(got) == set(expected) and "mismatch/kl_k3" in got, (got, expected)
    assert all(_close(got[name], expected[name]) for name in got), (got, expected)


def test_mismatch_corrected_cp2_step_equals_cp1_step(result):
    """DAPO with TIS, the sequence mask and the token mask (issue 40): with each CP rank's own
    slice as the completion, the sequence mask would drop other completions."""
    got = result["mismatch_step"]["llama"]
    cp1, cp2 = got["cp1"], got["cp2"]
    assert (cp1["cp_size"], cp2["cp_size"]) == (1, 2)
    assert got["start_max_abs_diff"] == 0.0
    metrics = cp1["mismatch"]
    # Not vacuous: the windows drop some tokens and completions, not all.
    assert 0 < metrics["mismatch/masked_token_fraction"] < 1, metrics
    assert 0 < metrics["mismatch/masked_sequence_fraction"] < 1, metrics
    _same_mismatch(cp2["mismatch"], metrics)
    assert _close(cp2["loss"], cp1["loss"]), got
    assert _close(cp2["grad_norm"], cp1["grad_norm"]), got
    assert cp2["num_loss_tokens"] == cp1["num_loss_tokens"] == 27
    assert cp2["max_abs_update"] > 5e-4
    assert got["param_max_abs_diff"] < 1e-7, got


def test_checkpoint_saved_at_cp2_loads_at_cp1_with_the_same_update(result):
    got = result["rl_step"]["llama4"]["tp2_sp_cp2"]
    assert got["checkpoint_max_abs_update"] > 5e-4  # the step's update is in the checkpoint
    assert got["checkpoint_param_max_abs_diff"] < 1e-7, got
