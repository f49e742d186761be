"""Multi-rank SGLang CPU engines without SGLang: the thread binding and per-rank memory bound that
SGLangServerSettings sets for tp_size > 1 on CPU, and CPU fix 9 (expert parallelism on the native
MoE path: two EP ranks' partial outputs add up to the single-rank output)."""
import collections

import pytest
import torch

from megatron_rl.platform import sglang_cpu
from megatron_rl.rollout import SGLangServerSettings
from megatron_rl.rollout.sglang_server import cpu_threads_bind_for

pytestmark = pytest.mark.unit


def _flags(settings) -> dict:
    args = settings.server_args(port=1)
    return dict(zip(args, args[1:]))


def test_multi_rank_cpu_engine_gets_thread_binding_and_memory_bound(tmp_path):
    tp2 = SGLangServerSettings(model_path=str(tmp_path), tp_size=2, ep_size=2, device="cpu")
    env = tp2.cpu_environment()
    assert len(env["SGLANG_CPU_OMP_THREADS_BIND"].split("|")) == 2
    assert int(env["OMP_NUM_THREADS"]) >= 1
    assert _flags(tp2)["--max-total-tokens"] == str(tp2.cpu_rank_max_total_tokens)
    # Overridable: an explicit binding (its core count sets the threads), an explicit bound.
    bound = SGLangServerSettings(model_path=str(tmp_path), tp_size=2, device="cpu",
                                 cpu_threads_bind="0-3|4-7", max_total_tokens=512)
    assert bound.cpu_environment() == {"SGLANG_CPU_OMP_THREADS_BIND": "0-3|4-7",
                                       "OMP_NUM_THREADS": "4"}
    assert _flags(bound)["--max-total-tokens"] == "512"
    with pytest.raises(ValueError, match="one '\\|'-separated core list per rank"):
        SGLangServerSettings(model_path=str(tmp_path), tp_size=2, cpu_threads_bind="0-3")
    fraction = SGLangServerSettings(model_path=str(tmp_path), tp_size=2, device="cpu",
                                    mem_fraction_static=0.05)
    assert "--max-total-tokens" not in _flags(fraction)
    # One rank, or a GPU: nothing added.
    for settings in (SGLangServerSettings(model_path=str(tmp_path), device="cpu"),
                     SGLangServerSettings(model_path=str(tmp_path), tp_size=2, device="cuda")):
        assert settings.cpu_environment() == {}
        assert "--max-total-tokens" not in _flags(settings)


def test_cpu_threads_bind_splits_cores_evenly():
    assert cpu_threads_bind_for(2, cpus=[0, 1]) == "0|1"
    assert cpu_threads_bind_for(2, cpus=range(8)) == "0,1,2,3|4,5,6,7"
    assert cpu_threads_bind_for(2, cpus=[0, 1, 2]) == "0|1"  # equal shares
    assert cpu_threads_bind_for(4, cpus=[0, 1]) == "0|1|0|1"  # fewer cores than ranks


TopK = collections.namedtuple("TopK", "topk_weights topk_ids router_logits")


def _native_moe(layer, x, topk, config):
    """What SGLang's moe_forward_native computes (sum over slots of weight x expert(x)), and
    like it, refusing ids outside this rank's experts."""
    ids, weights = topk.topk_ids, topk.topk_weights
    assert bool((ids >= 0).all()) and bool((ids < layer["w1"].shape[0]).all()), ids
    hidden = torch.einsum("th,tkih->tki", x, layer["w1"][ids]).relu()
    out = torch.einsum("tki,tkhi->tkh", hidden, layer["w2"][ids])
    return (out * weights[..., None]).sum(1).to(x.dtype)


def test_fix9_expert_parallel_partial_sums_add_up_to_the_whole():
    torch.manual_seed(0)
    num_experts, tokens = 4, 6
    layer = {"w1": torch.randn(num_experts, 8, 5), "w2": torch.randn(num_experts, 5, 8)}
    x = torch.randn(tokens, 5)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 1], [2, 3]])
    weights = torch.rand(tokens, 2)
    whole = _native_moe(layer, x, TopK(weights, ids, None), None)
    wrapped = sglang_cpu._native_moe_local_experts(_native_moe)
    partial_sums = []
    for rank in range(2):  # EP2: rank r owns experts 2r, 2r + 1; others are -1 (SGLang's map)
        local = {name: w[2 * rank:2 * rank + 2] for name, w in layer.items()}
        local_ids = torch.where(ids // 2 == rank, ids % 2, -1)
        partial_sums.append(wrapped(local, x, TopK(weights, local_ids, None), None))
    # Tokens 0 and 4 (rank 0 only) and 1 and 5 (rank 1 only): the other rank adds exact zeros.
    assert torch.equal(partial_sums[1][[0, 4]], torch.zeros(2, 5))
    torch.testing.assert_close(partial_sums[0] + partial_sums[1], whole, atol=1e-6, rtol=1e-6)
    # All ids local (EP1): the forward is called as it is.
    assert torch.equal(wrapped(layer, x, TopK(weights, ids, None), None), whole)
    # No local expert at all: zeros.
    none = wrapped(layer, x, TopK(weights, torch.full_like(ids, -1), None), None)
    assert torch.equal(none, torch.zeros_like(x))


def test_fix14_cpu_ranks_share_one_ram_so_the_tp_memory_balance_check_is_off(monkeypatch):
    """CI once lost a TP2/EP2 engine at start: rank 0 read 9.21 GB free, rank 1 read 10.28 GB a
    moment later (a neighbouring test's memory moved), and SGLang's GPU-per-rank balance check
    raised. The check is gated by an SGLang variable that the CPU environment turns off."""
    import importlib.util
    from pathlib import Path

    from sglang.srt.environ import envs

    srt = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"
    check = (srt / "distributed" / "bootstrap.py").read_text()
    check = check[check.index("def _check_tp_memory_balance"):]
    assert "envs.SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK.get()" in check.split("\ndef ")[0]
    monkeypatch.delenv("SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", raising=False)
    assert envs.SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK.get() is True  # SGLang's default
    for name, value in sglang_cpu.sglang_cpu_environment().items():
        monkeypatch.setenv(name, value)
    assert envs.SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK.get() is False
