"""Bucket packing (megatron_rl.weight_sync.buckets) and the TP gather layout fix (gather.py),
against hand-built references."""
import pytest
import torch

from megatron_rl.weight_sync import gather
from megatron_rl.weight_sync.buckets import BucketPacker, pack_buckets

pytestmark = pytest.mark.unit


def _named():
    gen = torch.Generator().manual_seed(0)
    return [("a", torch.randn(3, 4, generator=gen)), ("b", torch.randn(5, generator=gen)),
            ("big", torch.randn(40, generator=gen)), ("c", torch.randn(2, 2, generator=gen)),
            ("half", torch.randn(3, generator=gen).to(torch.bfloat16)),
            ("d", torch.randn(6, generator=gen))]


def test_buckets_are_the_tensors_bytes_back_to_back():
    named = _named()
    buckets = list(pack_buckets(named, bucket_bytes=64))
    # 64-byte buckets, by hand: a (48 B) + b (20 B) would exceed 64 -> [a]; b + big (160 B)
    # would -> [b]; big alone fills one -> [big]; c (16 B) then half (bf16) changes dtype ->
    # [c]; half then d (fp32) changes dtype -> [half]; flush -> [d].
    assert [[s.name for s in b.specs] for b in buckets] == [
        ["a"], ["b"], ["big"], ["c"], ["half"], ["d"]]
    for bucket in buckets:
        # SGLang's flattened_bucket layout: each tensor's bytes, in order, no padding.
        expected = torch.cat([t.flatten().view(torch.uint8) for n, t in named
                              if n in {s.name for s in bucket.specs}])
        assert torch.equal(bucket.data, expected)
    unpacked = dict(kv for b in buckets for kv in b.tensors())
    for name, tensor in named:
        assert unpacked[name].dtype == tensor.dtype and torch.equal(unpacked[name], tensor)
    assert sum(b.num_bytes for b in buckets) == sum(t.numel() * t.element_size()
                                                    for _, t in named)


def test_one_dtype_per_bucket_and_flush():
    packer = BucketPacker(10**6)
    assert packer.add("x", torch.ones(4)) == []
    (closed,) = packer.add("y", torch.ones(4, dtype=torch.bfloat16))  # dtype change closes
    assert [s.name for s in closed.specs] == ["x"]
    (rest,) = packer.flush()
    assert [s.name for s in rest.specs] == ["y"] and rest.specs[0].dtype == torch.bfloat16
    assert packer.flush() == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        BucketPacker(0)


def _shard_param(tensor, partition_dim):
    param = torch.nn.Parameter(tensor)
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    return param


def test_tp_gather_rebuilds_gated_fc1_and_row_parallel(monkeypatch):
    """Megatron's TP shards of a SwiGLU fc1 are [gate_r; up_r]; the full tensor is
    [gate; up]. A row-parallel weight is split along dim 1."""
    gate, up = torch.arange(8.0).reshape(4, 2), 100 + torch.arange(8.0).reshape(4, 2)
    shards = [torch.cat([gate[2 * r:2 * r + 2], up[2 * r:2 * r + 2]]) for r in range(2)]
    monkeypatch.setattr(gather, "_size", lambda group: 2)
    monkeypatch.setattr(gather, "_all_gather", lambda tensor, group: shards)
    gatherer = gather.StageGatherer.__new__(gather.StageGatherer)
    gatherer.gated_linear_unit = True
    full = gatherer._gather_tp(shards[0], _shard_param(shards[0], 0), object(),
                               "decoder.layers.0.mlp.linear_fc1.weight")
    assert torch.equal(full, torch.cat([gate, up]))
    row = torch.arange(12.0).reshape(2, 6)
    parts = list(row.chunk(2, dim=1))
    monkeypatch.setattr(gather, "_all_gather", lambda tensor, group: parts)
    full = gatherer._gather_tp(parts[0], _shard_param(parts[0], 1), object(),
                               "decoder.layers.0.self_attention.linear_proj.weight")
    assert torch.equal(full, row)


def test_expert_names_map_between_local_and_global_numbers():
    assert gather._expert_name("decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight",
                               5) == "decoder.layers.3.mlp.experts.local_experts.5.linear_fc2.weight"
