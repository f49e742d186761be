"""The weight sync's gather, planning and bucket pipeline at every parallel layout (4 gloo ranks).

Reference: the tiny Llama-4's converter mapping applied to the plain state dict of the same
weights at (TP, EP, PP) = (1,1,1), no gather involved. At (1,1,1) DP4, TP2+SP, EP2, PP2 and
TP2 x EP2 x PP2 + SP, a sync to a recording in-process generator on each stage's sender (colocated
tensor transport, ~a dozen small buckets, two reused bucket buffers) must deliver every HF tensor
exactly once, bit-exact, in its HF shape; with dtype=bf16 every tensor arrives as the rounded
reference. Only senders send; the coordinator (rank 0) wraps the update in pause / begin / end /
flush / resume. And without any checkpoint, a TP2 trainer initialised from the same seed holds
exactly the TP1 weights (on CPU every TP rank once drew the same shard). See
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
        # Many buckets (the two buffers are reused) and every planned byte sent.
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
