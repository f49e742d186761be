"""The FP8 block quantiser of the weight sync (megatron_rl/weight_sync/fp8.py) on CPU: degenerate
blocks, edge blocks, the e4m3 round-trip bound, scale names, UE8M0 scales, shard invariance, and
the rule saying which HF tensors SGLang holds in FP8. References are hand computations here;
tests/integration/test_fp8_sglang.py compares with SGLang's own helpers and models."""
import itertools
import math

import pytest
import torch

from megatron_rl.weight_sync.fp8 import (FP8_DTYPE, Fp8Layout, check_llama4_block_rows,
                                         dequantize_blockwise, fp8_quantized, quantize_blockwise,
                                         quantize_named, quantize_per_tensor,
                                         unfuse_llama4_experts)

pytestmark = pytest.mark.unit


def _hand_dequant(quantized, scale_inv, block=(128, 128)):
    """Element by element: q[i, j] * scale_inv[i // bm, j // bn] (float64)."""
    rows, cols = quantized.shape
    out = torch.empty(rows, cols, dtype=torch.float64)
    q = quantized.to(torch.float64)
    for i in range(0, rows, block[0]):
        for j in range(0, cols, block[1]):
            out[i:i + block[0], j:j + block[1]] = (
                q[i:i + block[0], j:j + block[1]] * float(scale_inv[i // block[0], j // block[1]]))
    return out


def _bound(x, scale):
    """|dequantised - x| <= max(2^-4 |x|, 2^-10 s) per element (fp8.py's docstring: e4m3 has 3
    mantissa bits, so rounding to nearest is within half a step, 2^-4 of a normal value, and
    within 2^-10 * s below the smallest normal 2^-6 * s), plus float32 rounding of x / s."""
    return torch.maximum(x.abs().double() * 2.0 ** -4, scale * 2.0 ** -10) * (1 + 2.0 ** -20)


def _weights(rows, cols, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # Spread magnitudes over ~6 binades so that both normals and subnormals of e4m3 occur.
    magnitude = torch.exp(torch.randn(rows, cols, generator=generator) * 2.0)
    return magnitude * torch.sign(torch.randn(rows, cols, generator=generator)) * 0.01


def test_all_zero_and_all_equal_blocks_are_finite_and_exact():
    weight = torch.zeros(256, 256)
    weight[128:, :128] = 3.0  # an all-equal block
    weight[:128, 128:] = -1e-7  # below the 1e-4 amax floor
    quantized, scale_inv = quantize_blockwise(weight)
    assert quantized.dtype == FP8_DTYPE and scale_inv.dtype == torch.float32
    assert torch.isfinite(quantized.float()).all() and torch.isfinite(scale_inv).all()
    assert (scale_inv > 0).all()
    # Zero block: scale from the floor, 1e-4 / 448; values exactly 0.
    assert float(scale_inv[0, 0]) == pytest.approx(1e-4 / 448, rel=1e-6)
    assert (quantized[:128, :128].float() == 0).all()
    # All-equal block: amax / 448 maps every element to 448 exactly, and back to 3.0 exactly.
    assert float(scale_inv[1, 0]) == pytest.approx(3.0 / 448, rel=1e-7)
    assert (quantized[128:, :128].float() == 448.0).all()
    dequantized = dequantize_blockwise(quantized, scale_inv)
    assert torch.allclose(dequantized[128:, :128], torch.full((128, 128), 3.0), rtol=1e-6)
    for ue8m0 in (False, True):
        q, s = quantize_blockwise(torch.zeros(5, 3), ue8m0=ue8m0)
        assert (q.float() == 0).all() and torch.isfinite(s).all()


def test_per_tensor_zero_and_constant():
    quantized, scale = quantize_per_tensor(torch.zeros(3, 4))
    assert scale.shape == () and torch.isfinite(scale) and (quantized.float() == 0).all()
    quantized, scale = quantize_per_tensor(torch.full((3, 4), -2.0))
    assert (quantized.float() == -448.0).all()
    assert float(scale) == pytest.approx(2.0 / 448, rel=1e-7)


@pytest.mark.parametrize("shape", [(1, 1), (5, 300), (129, 127), (200, 130), (3, 257, 129)])
def test_shapes_not_multiples_of_128(shape):
    weight = _weights(math.prod(shape[:-1]), shape[-1]).view(shape)
    quantized, scale_inv = quantize_blockwise(weight)
    *batch, rows, cols = shape
    assert quantized.shape == weight.shape
    assert scale_inv.shape == (*batch, math.ceil(rows / 128), math.ceil(cols / 128))
    # Edge blocks get their own scale: the amax of exactly their own elements / 448.
    flat_w, flat_s = weight.reshape(-1, rows, cols)[-1], scale_inv.reshape(
        -1, *scale_inv.shape[-2:])[-1]
    last = flat_w[(scale_inv.shape[-2] - 1) * 128:, (scale_inv.shape[-1] - 1) * 128:]
    assert float(flat_s[-1, -1]) == pytest.approx(max(float(last.abs().max()), 1e-4) / 448,
                                                  rel=1e-6)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_round_trip_within_e4m3_bound(ue8m0):
    weight = _weights(300, 260, seed=1)
    quantized, scale_inv = quantize_blockwise(weight, ue8m0=ue8m0)
    hand = _hand_dequant(quantized, scale_inv)
    # Same products, float32 (one rounding, 2^-24 relative) against float64.
    assert torch.allclose(dequantize_blockwise(quantized, scale_inv).double(), hand,
                          rtol=2.0 ** -24, atol=0)
    scale = scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:300, :260]
    error = (hand - weight.double()).abs()
    assert (error <= _bound(weight, scale)).all()
    # The bound is tight to a factor < 2: the worst relative error of normal values is > 2^-5.
    normal = weight.double().abs() >= scale * 2.0 ** -6
    assert float((error[normal] / weight.double().abs()[normal]).max()) > 2.0 ** -5


def test_per_tensor_round_trip_within_bound():
    weight = _weights(70, 90, seed=2).to(torch.bfloat16)
    quantized, scale = quantize_per_tensor(weight)
    assert float(scale) == pytest.approx(float(weight.float().abs().max()) / 448, rel=1e-6)
    error = (quantized.double() * float(scale) - weight.double()).abs()
    assert (error <= _bound(weight, torch.tensor(float(scale), dtype=torch.float64))).all()


def test_ue8m0_scales_are_powers_of_two_of_the_formula():
    weight = _weights(384, 256, seed=3)
    weight[:128, :128] *= 400.0 / float(weight[:128, :128].abs().max())
    weight[5, 7] = -448.0  # amax / 448 == 1 exactly: a power of two stays itself
    _, scale_inv = quantize_blockwise(weight, ue8m0=True)
    for i, j in itertools.product(range(3), range(2)):
        amax = float(weight[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max())
        expected = 2.0 ** math.ceil(math.log2(amax / 448.0))
        assert float(scale_inv[i, j]) == expected
        mantissa, _ = math.frexp(float(scale_inv[i, j]))
        assert mantissa == 0.5  # an exact power of two
    assert float(scale_inv[0, 0]) == 1.0


def test_scale_names_and_layout_from_config():
    block = Fp8Layout.from_quantization_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]})
    assert block == Fp8Layout(weight_block_size=(128, 128), ue8m0=False)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    out = quantize_named(name, _weights(200, 64), block)
    assert list(out) == [name, "model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"]
    assert out[name].dtype == FP8_DTYPE and out[name].shape == (200, 64)
    assert out["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"].shape == (2, 1)
    per_tensor = Fp8Layout.from_quantization_config({"quant_method": "fp8",
                                                     "activation_scheme": "dynamic"})
    out = quantize_named("model.layers.0.self_attn.q_proj.weight", _weights(8, 8), per_tensor)
    assert out["model.layers.0.self_attn.q_proj.weight_scale"].shape == ()
    ue8m0 = Fp8Layout.from_quantization_config(
        {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"})
    assert ue8m0.ue8m0
    with pytest.raises(ValueError, match="unfuse_llama4_experts"):
        block.scale_name("model.layers.0.feed_forward.experts.gate_up_proj")
    with pytest.raises(ValueError, match="'fp8' layout only"):
        Fp8Layout.from_quantization_config({"quant_method": "mxfp8"})
    with pytest.raises(ValueError, match="activation_scheme is 'static'"):
        Fp8Layout.from_quantization_config({"quant_method": "fp8", "activation_scheme": "static"})
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize_blockwise(torch.tensor([[1.0, float("nan")]]))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_shards_gathered_in_any_order_quantise_as_the_whole(dim, ue8m0):
    """TP shards along either dim (4 ranks, 128-aligned as SGLang's block loader requires),
    arriving in every order and placed at their rank's offset, quantise bit-identically to the
    whole tensor; and each shard quantised alone gives exactly the whole tensor's blocks (SGLang
    narrows the full weight_scale_inv per rank by ceil(shard / 128) rows or columns)."""
    whole = _weights(512, 384, seed=4).to(torch.bfloat16)
    ref_q, ref_s = quantize_blockwise(whole, ue8m0=ue8m0)
    shards = list(whole.chunk(4, dim=dim) if dim == 0 else whole.split([128, 128, 64, 64], dim))
    sizes = [s.shape[dim] for s in shards]
    offsets = [sum(sizes[:r]) for r in range(len(shards))]
    for order in itertools.permutations(range(len(shards))):
        gathered = torch.empty_like(whole)
        for rank in order:
            gathered.narrow(dim, offsets[rank], sizes[rank]).copy_(shards[rank])
        q, s = quantize_blockwise(gathered, ue8m0=ue8m0)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
    if dim == 0:  # 128-row shards: per-shard scales are the whole tensor's block rows
        pieces = [quantize_blockwise(shard, ue8m0=ue8m0) for shard in shards]
        assert torch.equal(torch.cat([p[0] for p in pieces]).view(torch.uint8),
                           ref_q.view(torch.uint8))
        assert torch.equal(torch.cat([p[1] for p in pieces]), ref_s)
    else:  # 64-column shards straddle a block: their own scales differ from the whole's
        assert not torch.equal(quantize_blockwise(shards[2], ue8m0=ue8m0)[1], ref_s[:, 2:3])


def test_expert_stacks_quantise_per_expert():
    experts = torch.stack([_weights(130, 140, seed=e) * (e + 1) for e in range(3)])
    q, s = quantize_blockwise(experts)
    assert s.shape == (3, 2, 2)
    for e in range(3):
        q_e, s_e = quantize_blockwise(experts[e])
        assert torch.equal(q[e].view(torch.uint8), q_e.view(torch.uint8)) and torch.equal(s[e], s_e)


def test_llama4_fused_experts_unfuse_to_linear_orientation():
    # [E=2, H=3, 2I=4]: expert e's gate is columns 0-1 transposed, up columns 2-3 transposed.
    gate_up = torch.arange(24.0).view(2, 3, 4)
    out = unfuse_llama4_experts("model.layers.0.feed_forward.experts.gate_up_proj", gate_up)
    prefix = "model.layers.0.feed_forward.experts."
    assert list(out) == [prefix + "0.gate_proj.weight", prefix + "0.up_proj.weight",
                         prefix + "1.gate_proj.weight", prefix + "1.up_proj.weight"]
    assert out[prefix + "1.gate_proj.weight"].tolist() == [[12.0, 16.0, 20.0], [13.0, 17.0, 21.0]]
    assert out[prefix + "0.up_proj.weight"].tolist() == [[2.0, 6.0, 10.0], [3.0, 7.0, 11.0]]
    down = torch.arange(12.0).view(2, 2, 3)  # [E, I, H] -> [H, I] per expert
    out = unfuse_llama4_experts("model.layers.0.feed_forward.experts.down_proj", down)
    assert out[prefix + "1.down_proj.weight"].tolist() == [[6.0, 9.0], [7.0, 10.0], [8.0, 11.0]]
    with pytest.raises(ValueError, match="not a Llama-4 fused expert tensor"):
        unfuse_llama4_experts("model.layers.0.feed_forward.router.weight", torch.zeros(4, 3))
    # Blocks must hold whole heads (SGLang reorders q/k rows within a head after loading).
    check_llama4_block_rows(Fp8Layout(weight_block_size=(128, 128)), head_dim=128)
    check_llama4_block_rows(Fp8Layout(weight_block_size=(128, 128)), head_dim=64)
    check_llama4_block_rows(Fp8Layout(weight_block_size=None), head_dim=256)
    with pytest.raises(ValueError, match="multiple of head_dim 256"):
        check_llama4_block_rows(Fp8Layout(weight_block_size=(128, 128)), head_dim=256)


# The tiny models' HF parameter names, as the families' converters name them.
def _hf_names(family: str) -> list[str]:
    from models.registry import get_model_family, model_family_for_hf_config

    bound = model_family_for_hf_config(get_model_family(family).hf_config("tiny"))
    return [name for group in bound.weight_groups() for name in group.hf_names]


@pytest.mark.parametrize("family", ["llama4", "qwen3_moe"])
def test_rule_quantises_projections_and_keeps_the_rest(family):
    names = _hf_names(family)
    quantised = fp8_quantized({"quant_method": "fp8", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128]}, names)
    kept = set(names) - quantised
    assert quantised and all(n.endswith(("_proj.weight", "experts.gate_up_proj",
                                         "experts.down_proj")) for n in quantised)
    for name in kept:  # embeddings, LM head, routers, norms
        assert any(k in name for k in ("embed_tokens", "lm_head", "norm", "router",
                                       "mlp.gate.weight")), name
    for k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
        assert any(k in n for n in quantised)
    assert not any("embed_tokens" in n or "lm_head" in n or "norm" in n for n in quantised)
    if family == "qwen3_moe":
        assert "model.layers.0.mlp.experts.3.gate_proj.weight" in quantised
        assert "model.layers.0.mlp.gate.weight" in kept
    else:
        assert "model.layers.0.feed_forward.shared_expert.down_proj.weight" in quantised
        assert "model.layers.0.feed_forward.router.weight" in kept
        assert {"model.layers.0.feed_forward.experts.gate_up_proj",
                "model.layers.0.feed_forward.experts.down_proj"} <= quantised


def test_rule_honours_ignored_layers():
    names = _hf_names("qwen3_moe")
    config = {"quant_method": "fp8", "weight_block_size": [128, 128],
              "modules_to_not_convert": ["model.layers.1.self_attn", "layers.2.mlp.experts"]}
    quantised = fp8_quantized(config, names)
    assert not any(n.startswith("model.layers.1.self_attn.") for n in quantised)
    assert not any(n.startswith("model.layers.2.mlp.experts.") for n in quantised)
    assert "model.layers.1.mlp.experts.0.up_proj.weight" in quantised
    assert "model.layers.2.self_attn.o_proj.weight" in quantised
    # SGLang asks about a layer's FusedMoE as one module: naming one expert skips them all.
    one_expert = fp8_quantized({"quant_method": "fp8", "modules_to_not_convert": [
        "model.layers.3.mlp.experts.1.gate_proj"]}, names)
    assert not any(n.startswith("model.layers.3.mlp.experts.") for n in one_expert)
    assert "model.layers.3.self_attn.q_proj.weight" in one_expert
    # Dotted-path boundaries: "mlp.gate" must not exclude mlp.gate_proj of a dense layer.
    dense = ["model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate.weight"]
    assert fp8_quantized({"quant_method": "fp8", "ignored_layers": ["mlp.gate"]},
                         dense) == {"model.layers.0.mlp.gate_proj.weight"}
