"""The weight sync's gather, planning and bucket pipeline at every parallel layout (4 gloo ranks).

Reference: the tiny Llama-4's converter mapping applied to the plain state dict of the same
weights at (TP, EP, PP) = (1,1,1), no gather involved. At (1,1,1) DP4, TP2+SP, EP2, PP2 and
TP2 x EP2 x PP2 + SP, a sync to a recording in-process generator on each stage's sender (colocated
tensor transport, ~a dozen small buckets, a fresh buffer per bucket) must deliver every HF tensor
exactly once, bit-exact, in its HF shape; with dtype=bf16 every tensor arrives as the rounded
reference. Only senders send; the coordinator (rank 0) wraps the update in pause / begin / end /
flush / resume. And without any checkpoint, a TP2 trainer initialised from the same seed holds
exactly the TP1 weights (on CPU every TP rank once drew the same shard). With generators serving
FP8 (TP2 x EP2 x PP2 + SP), the tensors sent, quantised after the gather, are bit-identical to
the quantiser applied to the single-rank HF tensors. What each sender keeps
allocated after a sync (two bucket buffers, the scratch arena of gathered tensors) is what the
memory planner predicts (megatron_rl/scaling/plan.py `sender_sync_memory`). See
tests/dist/_weight_sync_gather_worker.py.
"""
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

WORKER = Path(__file__).parent / "_weight_sync_gather_worker.py"
FP32_LAYOUTS = ("tp1_ep1_pp1", "tp2_sp", "ep2", "pp2", "tp2_ep2_pp2_sp")


@pytest.fixture(scope="module")
def result(tmp_path_factory, torchrun_result) -> dict:
    out_dir = tmp_path_factory.mktemp("weight_sync_gather")
    return torchrun_result(WORKER, [str(out_dir)], out_dir=out_dir, num_ranks=4, timeout_s=480)


@pytest.mark.parametrize("layout", FP32_LAYOUTS + ("tp2_sp_fresh", "tp2_ep2_pp2_sp_bf16"))
def test_every_hf_tensor_arrives_once_and_exact(result, layout):
    ranks = result["layouts"][layout]["ranks"]
    senders = [r for r in ranks if r["sender"]]
    pp_size = 2 if "pp2" in layout else 1
    # One sender per pipeline stage: the stage's lowest rank.
    assert sorted(r["pp_rank"] for r in senders) == list(range(pp_size))
    received, from_state_dict = [], []
    for sender in senders:
        for got in (sender["received"], sender["hf_state_dict"]):
            assert got["max_diff"] == 0.0, (layout, sender["rank"], got["max_diff"])
            assert got["shapes_ok"]
            assert got["dtypes"] == (["torch.bfloat16"] if layout.endswith("bf16")
                                     else ["torch.float32"])
        received += sender["received"]["names"]
        from_state_dict += sender["hf_state_dict"]["names"]
        # Many buckets and every planned byte sent.
        assert sender["num_buckets"] >= 3
        assert sender["num_bytes"] == sender["planned_bytes"]
    # Every HF tensor exactly once across the stages.
    assert sorted(received) == result["reference_names"]
    assert sorted(from_state_dict) == result["reference_names"]
    itemsize = 2 if layout.endswith("bf16") else 4
    assert sum(s["num_bytes"] for s in senders) == result["reference_bytes"] * itemsize // 4
    for rank in ranks:
        assert rank["version"] == 1
        if not rank["sender"]:
            assert rank["num_bytes"] == 0
    # Rank 0 coordinates: pause, begin, its stage's buckets, end, flush, continue.
    calls = ranks[0]["calls"]
    assert calls[:3] == ["health", "pause", "begin"] and calls[-3:] == ["end", "flush", "resume"]
    assert set(calls[3:-3]) == {"tensors"}


def test_fp8_tensors_sent_equal_the_quantised_single_rank_tensors(result):
    """Issue 40: quantised on each stage's sender after the TP / EP gather and the HF
    conversion, bit for bit what quantize_named makes of the single-rank model's HF tensors
    (Llama-4's fused experts per expert, with their scales); everything else as bf16."""
    senders = [r for r in result["layouts"]["tp2_ep2_pp2_sp_fp8"]["ranks"] if r["sender"]]
    assert len(senders) == 2
    received = []
    for sender in senders:
        for got in (sender["received"], sender["hf_state_dict"]):
            assert got["mismatched"] == [], (sender["rank"], got["mismatched"][:5])
        assert sender["received"]["names"] == sender["hf_state_dict"]["names"]
        # The report counts the fp8 weights sent and the bytes (fp8 1, scales 4, bf16 2).
        assert sender["num_quantized"] == sender["received"]["num_fp8"] > 0
        assert sender["num_bytes"] == sender["planned_bytes"] == sender["received"]["num_bytes"]
        assert sender["quantize_s"] > 0
        received += sender["received"]["names"]
    assert sorted(received) == result["reference_fp8_names"]
    # 4 layers x (q, k, v, o, shared gate / up / down, 4 experts x gate / up / down) = 76.
    assert sum(s["num_quantized"] for s in senders) == 76
    assert sum(s["num_bytes"] for s in senders) == result["reference_fp8_bytes"]
    assert result["reference_fp8_bytes"] < result["reference_bytes"] // 2  # vs bf16


@pytest.mark.parametrize("layout", FP32_LAYOUTS + ("tp2_ep2_pp2_sp_bf16",))
def test_the_planner_predicts_what_each_sender_keeps(result, layout):
    """Issue 30.9: the planner's weight-sync terms against the real sync's allocations, exactly:
    bucket count, largest bucket, its two buffers and the arena's size after the sync."""
    from megatron_rl.scaling import plan

    sizes = {"tp1_ep1_pp1": {}, "tp2_sp": dict(tensor_model_parallel_size=2,
                                               expert_tensor_parallel_size=2,
                                               sequence_parallel=True),
             "ep2": dict(expert_model_parallel_size=2),
             "pp2": dict(pipeline_model_parallel_size=2)}
    sizes["tp2_ep2_pp2_sp"] = sizes["tp2_ep2_pp2_sp_bf16"] = dict(
        tensor_model_parallel_size=2, expert_model_parallel_size=2,
        pipeline_model_parallel_size=2, sequence_parallel=True)
    layout_sizes = plan.TrainerLayout(world_size=4, **sizes[layout])
    arch = plan.Architecture.from_family("llama4", "tiny")
    mapping = plan.family_mapping("llama4", "tiny")
    senders = [r for r in result["layouts"][layout]["ranks"] if r["sender"]]
    assert senders
    for sender in senders:
        predicted = plan.sender_sync_memory(
            arch, layout_sizes, mapping, pp_rank=sender["pp_rank"], bucket_bytes=96 * 1024,
            params_dtype="float32",
            generator_dtype="bfloat16" if layout.endswith("bf16") else "float32")
        kept = sender["sync_memory"]
        # Not vacuous: shards of other ranks are gathered wherever TP or EP splits tensors.
        assert (kept["gathered"] > 0) == ("tp2" in layout or "ep2" in layout), kept
        assert kept["buffers"] == 2 * kept["largest_bucket"] > 0
        assert {k: getattr(predicted, k) for k in kept} == kept, (layout, sender["pp_rank"])
