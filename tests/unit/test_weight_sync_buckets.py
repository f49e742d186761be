"""Bucket planning (megatron_rl.weight_sync.plan), the reusable scratch memory (gather.Arena) and
the bucket byte layout (buckets.Bucket), against hand-computed layouts."""
import pytest
import torch

from megatron_rl.weight_sync import Arena, Bucket, plan_buckets
from models.convert_common import concatenated, fused_qkv, renamed

pytestmark = pytest.mark.unit

SHAPES = {"emb": (10, 4), "qkv": (16, 4), "fc1": (12, 4), "norm": (4,), "head": (10, 4)}


def _meta(dtypes=None):
    dtypes = dtypes or {}
    return lambda name: torch.empty(SHAPES[name], dtype=dtypes.get(name, torch.float32),
                                    device="meta")


def _groups():
    return [renamed("embed", "emb"),
            fused_qkv("q", "k", "v", "qkv", num_attention_heads=2, num_query_groups=1),
            concatenated(("gate", "up"), "fc1"), renamed("norm_w", "norm"),
            renamed("lm_head", "head")]


def test_plan_packs_whole_groups_up_to_the_bucket_size():
    # HF bytes per group (fp32): embed 160, q+k+v 256 (q 8x4, k 4x4, v 4x4), gate+up 192,
    # norm 16, lm_head 160. With 300-byte buckets: [embed] (160 + 256 > 300), [qkv]
    # (256 + 192 > 300), [gate, up, norm] (192 + 16 + 160 > 300), [lm_head].
    plan = plan_buckets(_groups(), _meta(), bucket_bytes=300)
    assert [[s.name for s in b.specs] for b in plan] == [
        ["embed"], ["q", "k", "v"], ["gate", "up", "norm_w"], ["lm_head"]]
    assert [b.num_bytes for b in plan] == [160, 256, 208, 160]
    assert plan[1].offsets == (0, 128, 192) and plan[2].offsets == (0, 96, 192)
    # Renamed groups are gathered straight into the bucket; split / fused ones are converted.
    assert plan[0].in_place == {"embed": "emb"} and plan[1].in_place == {}
    assert plan[2].in_place == {"norm_w": "norm"}
    assert plan[2].megatron_names == ["fc1", "norm"]
    # A group larger than the bucket travels alone.
    tiny = plan_buckets(_groups(), _meta(), bucket_bytes=1)
    assert [len(b.groups) for b in tiny] == [1] * 5
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(_groups(), _meta(), bucket_bytes=0)


def test_mixed_dtypes_are_ordered_by_item_size_so_every_offset_is_aligned():
    # norm in bf16 (8 bytes) before fp32 tensors would misalign them: larger items go first.
    dtypes = {"norm": torch.bfloat16}
    (bucket,) = plan_buckets(_groups()[2:4], _meta(dtypes), bucket_bytes=10**6)
    assert [s.name for s in bucket.specs] == ["gate", "up", "norm_w"]
    assert [s.dtype for s in bucket.specs] == [torch.float32, torch.float32, torch.bfloat16]
    for spec, offset in zip(bucket.specs, bucket.offsets):
        assert offset % spec.dtype.itemsize == 0
    # A cast to the generators' dtype: every tensor bf16, nothing gathered in place.
    (cast,) = plan_buckets(_groups(), _meta(), bucket_bytes=10**6, dtype=torch.bfloat16)
    assert {s.dtype for s in cast.specs} == {torch.bfloat16} and cast.in_place == {}
    assert cast.num_bytes == (160 + 256 + 192 + 16 + 160) // 2
    # A tensor the gatherer cannot assemble in place (vocabulary padding) is copied instead.
    (trimmed,) = plan_buckets(_groups()[:1], _meta(), bucket_bytes=10**6,
                              can_fill=lambda name: name != "emb")
    assert trimmed.in_place == {}


def test_slots_are_views_of_the_buffer_and_bucket_tensors_read_them_back():
    (bucket,) = plan_buckets(_groups()[2:4], _meta({"norm": torch.bfloat16}),
                             bucket_bytes=10**6)
    data = torch.zeros(bucket.num_bytes + 64, dtype=torch.uint8)  # a larger reused buffer
    slots = bucket.slots(data)
    values = {name: torch.randn(slot.shape).to(slot.dtype) for name, slot in slots.items()}
    for name, slot in slots.items():
        slot.copy_(values[name])
    # SGLang's flattened-bucket layout: each tensor's bytes back to back, in specs order.
    expected = torch.cat([values[s.name].flatten().view(torch.uint8) for s in bucket.specs])
    assert torch.equal(data[:bucket.num_bytes], expected)
    sent = Bucket(specs=bucket.specs, data=data[:bucket.num_bytes])
    assert sent.num_bytes == bucket.num_bytes
    for name, tensor in sent.tensors():
        assert torch.equal(tensor, values[name]) and tensor.dtype == values[name].dtype


def test_arena_reuses_one_buffer_once_it_has_grown():
    arena = Arena()
    # Sizes round up to 256-byte slots: 60 B -> 256, 14 B -> 256, 4000 B -> 4096.
    a = arena.take((3, 5), torch.float32)
    b = arena.take((7,), torch.bfloat16)
    c = arena.take((1000,), torch.float32)
    assert a.shape == (3, 5) and b.dtype == torch.bfloat16 and c.numel() == 1000
    a.fill_(1.0)
    b.fill_(2.0)
    c.fill_(3.0)
    assert torch.all(a == 1.0) and torch.all(b == 2.0)  # no overlap
    assert len(arena._chunks) == 3  # the first round grew chunk by chunk
    arena.reset()  # one buffer for everything the last round took
    assert len(arena._chunks) == 1 and arena.capacity == 256 + 256 + 4096
    a2 = arena.take((3, 5), torch.float32)
    b2 = arena.take((7,), torch.bfloat16)
    c2 = arena.take((1000,), torch.float32)
    assert len(arena._chunks) == 1  # steady state: no new memory
    assert (b2.data_ptr() - a2.data_ptr(), c2.data_ptr() - a2.data_ptr()) == (256, 512)
    arena.reset()
    assert arena.take((3, 5), torch.float32).data_ptr() == a2.data_ptr()


def test_sync_report_metrics_for_tensorboard():
    from megatron_rl.weight_sync import SyncReport

    report = SyncReport(version=3, num_bytes=3 * 2**30, num_tensors=10, num_buckets=6,
                        seconds=2.0, gather_s=0.5, convert_s=0.25, transfer_s=1.0, load_s=0.125,
                        control_s=0.0625, cache_flushed=False)
    metrics = report.metrics()
    assert metrics["weight_sync/gib_per_s"] == 1.5 and metrics["weight_sync/gib"] == 3.0
    assert metrics["weight_sync/version"] == 3.0 and metrics["weight_sync/buckets"] == 6.0
    assert metrics["weight_sync/control_s"] == 0.0625
    assert metrics["weight_sync/cache_flushed"] == 0.0
    assert set(report.metrics(prefix="sync.")) == {k.replace("weight_sync/", "sync.")
                                                    for k in metrics}


def test_settings_from_the_run_config():
    from megatron_rl.config import load_config
    from megatron_rl.weight_sync import WeightSyncSettings

    run = load_config(None, ["rollout.dtype=bfloat16", "weight_sync.bucket_mb=64",
                             "weight_sync.pause_mode=none", "output_dir=/tmp/run"])
    settings = WeightSyncSettings.from_run_config(run)
    assert settings.bucket_bytes == 64 * 2**20 and settings.dtype == torch.bfloat16
    assert settings.pause_mode is None and settings.transport == "distributed"
    assert settings.disk_dir is None
    default = WeightSyncSettings.from_run_config(load_config(None, []))
    assert default.dtype is None and default.pause_mode == "in_place"
    assert default.bucket_bytes == 512 * 2**20
    disk = WeightSyncSettings.from_run_config(
        load_config(None, ["weight_sync.transport=disk", "output_dir=/tmp/run"]),
        hf_config_dir="/ckpt/hf")
    assert disk.disk_dir == "/tmp/run/weight_sync" and disk.hf_config_dir == "/ckpt/hf"
    with pytest.raises(ValueError, match="hf_config_dir"):
        WeightSyncSettings.from_run_config(load_config(None, ["weight_sync.transport=disk"]))
