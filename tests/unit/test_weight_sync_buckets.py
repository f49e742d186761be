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
                        control_s=0.0625, cache_flushed=False, num_quantized=7,
                        quantize_s=0.125)
    metrics = report.metrics()
    assert metrics["weight_sync/bytes"] == 3 * 2**30
    assert metrics["weight_sync/quantized_tensors"] == 7.0
    assert metrics["weight_sync/quantize_s"] == 0.125
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


# Issue 40: FP8-serving generators. HF names, so that fp8.fp8_quantized (SGLang's rule) picks
# the projections; [16, 16] blocks.
L0 = "model.layers.0."
FP8_SHAPES = {"emb": (40, 32), "qkv": (64, 32), "fc2": (40, 48), "norm": (32,),
              "experts_fc1": (2, 32, 64)}
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}


def _fp8_groups():
    return [renamed("model.embed_tokens.weight", "emb"),
            fused_qkv(L0 + "self_attn.q_proj.weight", L0 + "self_attn.k_proj.weight",
                      L0 + "self_attn.v_proj.weight", "qkv", num_attention_heads=2,
                      num_query_groups=1),
            renamed(L0 + "mlp.down_proj.weight", "fc2"),
            renamed(L0 + "input_layernorm.weight", "norm")]


def _fp8_meta(name):
    return torch.empty(FP8_SHAPES[name], dtype=torch.float32, device="meta")


def _quantiser(groups, config=FP8_CONFIG, **kwargs):
    from megatron_rl.weight_sync.fp8 import SyncQuantiser

    return SyncQuantiser(config, [n for g in groups for n in g.hf_names], **kwargs)


def test_fp8_plan_has_weights_and_scales_in_bytes_and_nothing_quantised_in_place():
    groups = _fp8_groups()
    quantiser = _quantiser(groups)
    (bucket,) = plan_buckets(groups, _fp8_meta, bucket_bytes=10**6, quantiser=quantiser)
    attn = L0 + "self_attn."
    # Item size 4 first (fp32 tensors sent as they are, float32 scales), in mapping order, then
    # the fp8 weights (1 byte). q_proj [32, 32] (heads of 16), k / v [16, 32], down [40, 48]
    # (a partial row of blocks: 3 x 3 scales).
    names = ["model.embed_tokens.weight", attn + "q_proj.weight_scale_inv",
             attn + "k_proj.weight_scale_inv", attn + "v_proj.weight_scale_inv",
             L0 + "mlp.down_proj.weight_scale_inv", L0 + "input_layernorm.weight",
             attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight",
             L0 + "mlp.down_proj.weight"]
    assert [s.name for s in bucket.specs] == names
    assert [s.shape for s in bucket.specs] == [(40, 32), (2, 2), (1, 2), (1, 2), (3, 3), (32,),
                                               (32, 32), (16, 32), (16, 32), (40, 48)]
    assert [s.dtype for s in bucket.specs] == [torch.float32] * 6 + [torch.float8_e4m3fn] * 4
    # Bytes: 5120 + 4 * (4 + 2 + 2 + 9) + 128, then 1024 + 512 + 512 + 1920.
    assert bucket.offsets == (0, 5120, 5136, 5144, 5152, 5188, 5316, 6340, 6852, 7364)
    assert bucket.num_bytes == 9284 and bucket.num_quantized == 4
    # The renamed down_proj is quantised, so not gathered straight into its slot.
    assert bucket.in_place == {"model.embed_tokens.weight": "emb",
                               L0 + "input_layernorm.weight": "norm"}
    # Buckets fill by bytes: the q/k/v group is 2048 fp8 + 32 scale bytes (8192 in fp32), and
    # down_proj's 1920 + 36 bytes leave no room for the norm's 128.
    split = plan_buckets(groups, _fp8_meta, bucket_bytes=2080, quantiser=quantiser)
    assert [b.num_bytes for b in split] == [5120, 2080, 1956, 128]
    # Per-tensor scales: 0-dim float32 `weight_scale`.
    per_tensor = _quantiser(groups, {"quant_method": "fp8"})
    (bucket,) = plan_buckets(groups[1:2], _fp8_meta, bucket_bytes=10**6, quantiser=per_tensor)
    assert [(s.name.rpartition(".")[2], s.shape) for s in bucket.specs] == [
        ("weight_scale", ())] * 3 + [("weight", (32, 32)), ("weight", (16, 32)),
                                     ("weight", (16, 32))]
    assert bucket.num_bytes == 12 + 2048


def test_fp8_plan_matches_what_the_quantiser_sends():
    """The plan's names, dtypes and shapes are those of quantize_named's output (the sync checks
    every tensor against its slot), Llama-4's fused experts unfused per expert."""
    from megatron_rl.weight_sync.fp8 import quantize_named

    experts = renamed(L0 + "feed_forward.experts.gate_up_proj", "experts_fc1")
    groups = _fp8_groups() + [experts]
    for config in (FP8_CONFIG, {"quant_method": "fp8"}):
        quantiser = _quantiser(groups, config, head_dim=16)
        plan = plan_buckets(groups, _fp8_meta, bucket_bytes=10**6, quantiser=quantiser)
        planned = {s.name: (s.dtype, s.shape) for b in plan for s in b.specs}
        sent = {}
        for group in groups:
            full = {n: torch.randn(FP8_SHAPES[n]) for n in group.megatron_names}
            for name, tensor in group.to_hf(full).items():
                sent.update(quantiser.quantize(name, tensor) or {name: tensor})
        assert planned == {n: (t.dtype, tuple(t.shape)) for n, t in sent.items()}
        gate = L0 + "feed_forward.experts.1.gate_proj.weight"
        assert planned[gate] == (torch.float8_e4m3fn, (32, 32))
        expected = quantize_named(gate, full["experts_fc1"][1][:, :32].T.contiguous(),
                                  quantiser.layout)
        assert torch.equal(sent[gate].view(torch.uint8), expected[gate].view(torch.uint8))
        assert sum(b.num_quantized for b in plan) == 4 + 2 * 2
    # Llama-4's q/k rows move within a head after loading: blocks must hold whole heads.
    with pytest.raises(ValueError, match="head_dim 32"):
        _quantiser(groups, head_dim=32)
    _quantiser(_fp8_groups(), head_dim=32)  # no Llama-4 tensor: no such constraint


def test_served_quantization_config_from_the_run_config():
    from megatron_rl.config import load_config
    from megatron_rl.weight_sync import WeightSyncSettings
    from megatron_rl.weight_sync.fp8 import Fp8Layout, served_quantization_config

    def served(*overrides):
        return served_quantization_config(load_config(None, list(overrides)).rollout)

    assert served() is None and WeightSyncSettings.from_run_config(
        load_config(None, [])).quantization_config is None
    assert served("rollout.precision=fp8") == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [128, 128]}
    settings = WeightSyncSettings.from_run_config(load_config(None, [
        "rollout.precision=fp8", "rollout.fp8_block_size=16", "rollout.fp8_scale_fmt=ue8m0"]))
    assert settings.quantization_config == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [16, 16], "scale_fmt": "ue8m0"}
    assert Fp8Layout.from_quantization_config(settings.quantization_config) == Fp8Layout(
        weight_block_size=(16, 16), ue8m0=True)
    assert served("rollout.precision=fp8", "rollout.fp8_block_size=null") == {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    with pytest.raises(ValueError, match="rollout.fp8_block_size"):
        served("rollout.precision=fp8", "rollout.fp8_block_size=null",
               "rollout.fp8_scale_fmt=ue8m0")
