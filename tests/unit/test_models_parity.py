"""Megatron models built from models/ vs transformers' own implementations (the independent
reference), in fp32 on one CPU rank (gloo, world size 1, via megatron_rl.platform).

Weights are copied HF -> Megatron by the families' converters (models/<name>/convert.py) from
what save_pretrained writes. Checked: the Llama-4 attention of a RoPE/chunked layer and of a NoPE/global/
temperature-tuned layer on a sequence longer than the chunk (20 tokens, chunk 8, floor_scale 4),
whole decoder layers (MoE with shared expert and sigmoid top-1 router; dense MLP), and the whole
tiny models' logits (Llama-4 "tiny" = Scout-like, "tiny_maverick" = dense/MoE interleave without
q/k norm, Qwen3-MoE "tiny", dense Llama-3 "tiny" with llama3 RoPE scaling).
"""
import os
import tempfile

import pytest
import torch

pytestmark = pytest.mark.unit

SEQ_LEN = 20  # > chunk 8 and not a multiple of it: several chunks plus a padded one
BATCH = 2
TOLERANCE = 2e-5  # fp32, max |diff| (values are O(1))


def _load(model, weights: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    params = {name for name, _ in model.named_parameters()}
    missing = params - set(weights)
    assert not missing, f"mapping leaves Megatron parameters unset: {sorted(missing)}"
    for name, tensor in weights.items():
        assert state[name].shape == tensor.shape, (name, state[name].shape, tensor.shape)
    model.load_state_dict(weights, strict=False)


def _megatron_weights(family, hf_model, hf_config) -> dict[str, torch.Tensor]:
    """The HF weights as save_pretrained stores them (Qwen3-MoE: one tensor per expert; fused only
    in transformers' memory), mapped by the family's converter (models/<name>/convert.py)."""
    from safetensors.torch import load_file

    from models.convert_common import convert_state_dict

    with tempfile.TemporaryDirectory() as directory:
        hf_model.save_pretrained(directory)
        on_disk = load_file(os.path.join(directory, "model.safetensors"))
    return convert_state_dict(family.converter().weight_groups(hf_config), on_disk, to="megatron")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # Random non-trivial values everywhere (norm weights too), so a missed or mis-laid weight shows.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=generator))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))


def _pair(family_name: str, size: str, seed: int = 0):
    """(HF reference model, Megatron model with the same weights, HF config), both fp32 eval."""
    import models
    import transformers

    family = models.get_model_family(family_name)
    impl = family._impl()
    hf_config = impl.hf_text_config(size)
    hf_config._attn_implementation = "eager"
    hf_cls = getattr(transformers, family.hf_architectures[0])  # the CausalLM class
    torch.manual_seed(seed)
    hf_model = hf_cls(hf_config).eval()
    _randomize(hf_model, seed)
    config = family.transformer_config(size)
    model = family.build_model(config, pre_process=True, post_process=True).eval()
    _load(model, _megatron_weights(family, hf_model, hf_config))
    return hf_model, model, hf_config


def _tokens(vocab_size: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(seed))


def _llama4_reference_mask(layer_is_chunked: bool, chunk: int) -> torch.Tensor:
    # Written out by hand: causal, and on chunked layers only within the query's chunk.
    i = torch.arange(SEQ_LEN)[:, None]
    j = torch.arange(SEQ_LEN)[None, :]
    allowed = j <= i
    if layer_is_chunked:
        allowed &= (i // chunk) == (j // chunk)
    mask = torch.zeros(SEQ_LEN, SEQ_LEN).masked_fill(~allowed, float("-inf"))
    return mask.expand(BATCH, 1, SEQ_LEN, SEQ_LEN)


@pytest.fixture(scope="module")
def llama4_tiny(megatron_process_group):
    return _pair("llama4", "tiny")


@pytest.mark.parametrize("layer_index", [0, 3], ids=["rope_chunked_layer", "nope_global_layer"])
def test_llama4_attention_matches_transformers(llama4_tiny, layer_index):
    hf_model, model, hf_config = llama4_tiny
    assert hf_config.no_rope_layers[layer_index] == (1 if layer_index == 0 else 0)
    hidden = torch.randn(BATCH, SEQ_LEN, hf_config.hidden_size,
                         generator=torch.Generator().manual_seed(2))
    position_ids = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN)
    with torch.no_grad():
        freqs = hf_model.model.rotary_emb(hidden, position_ids)
        expected, _ = hf_model.model.layers[layer_index].self_attn(
            hidden, position_embeddings=freqs,
            attention_mask=_llama4_reference_mask(layer_index != 3, hf_config.attention_chunk_size))
        actual, bias = model.decoder.layers[layer_index].self_attention(
            hidden.transpose(0, 1).contiguous(), attention_mask=None,
            rotary_pos_emb=model.rotary_pos_emb(SEQ_LEN))
    assert bias is None
    diff = (actual.transpose(0, 1) - expected).abs().max().item()
    assert diff < TOLERANCE, f"max |diff| {diff}"


def test_llama4_attention_pieces_are_not_vacuous(llama4_tiny):
    # The chunk mask and temperature must change the result: full causal attention on the
    # RoPE layer, or no temperature on the NoPE layer, would differ from the reference.
    hf_model, model, hf_config = llama4_tiny
    hidden = torch.randn(BATCH, SEQ_LEN, hf_config.hidden_size,
                         generator=torch.Generator().manual_seed(2))
    position_ids = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN)
    with torch.no_grad():
        freqs = hf_model.model.rotary_emb(hidden, position_ids)
        chunked = hf_model.model.layers[0].self_attn(
            hidden, position_embeddings=freqs, attention_mask=_llama4_reference_mask(True, 8))[0]
        global_ = hf_model.model.layers[0].self_attn(
            hidden, position_embeddings=freqs, attention_mask=_llama4_reference_mask(False, 8))[0]
        core = model.decoder.layers[3].self_attention.core_attention
        tuned = model.decoder.layers[3].self_attention(hidden.transpose(0, 1).contiguous(), None)[0]
        core.llama4_temperature_tuning = False
        untuned = model.decoder.layers[3].self_attention(hidden.transpose(0, 1).contiguous(), None)[0]
        core.llama4_temperature_tuning = True
    assert (chunked - global_).abs().max() > 1e-3
    assert (tuned - untuned).abs().max() > 1e-3


def test_llama4_chunked_attention_with_explicit_mask(llama4_tiny):
    # A trainer may pass a [b, 1, s, s] mask (True = masked) instead of None: the chunk blocks cut
    # from it (with the padded tail) must give the same result; a padding mask must mask keys.
    _, model, hf_config = llama4_tiny
    attention = model.decoder.layers[0].self_attention
    hidden = torch.randn(SEQ_LEN, BATCH, hf_config.hidden_size,
                         generator=torch.Generator().manual_seed(5))
    rope = model.rotary_pos_emb(SEQ_LEN)
    causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).triu(1).expand(BATCH, 1, -1, -1)
    with torch.no_grad():
        implicit = attention(hidden, None, rotary_pos_emb=rope)[0]
        explicit = attention(hidden, causal, rotary_pos_emb=rope)[0]
        masked = causal.clone()
        masked[:, :, :, 17] = True  # hide key 17 (in the last, padded chunk 16..23)
        hidden_changed = hidden.clone()
        hidden_changed[17] += 1.0
        a = attention(hidden, masked, rotary_pos_emb=rope)[0]
        b = attention(hidden_changed, masked, rotary_pos_emb=rope)[0]
    assert (implicit - explicit).abs().max() < 1e-6
    # Only token 17's own output row may change (its query changed); every other row ignores it.
    rows = [i for i in range(SEQ_LEN) if i != 17]
    assert (a[rows] - b[rows]).abs().max() < 1e-6
    assert (implicit[18] - a[18]).abs().max() > 1e-4


@pytest.mark.parametrize("layer_index", [0, 3])
def test_llama4_decoder_layer_matches_transformers(llama4_tiny, layer_index):
    # Both tiny layers are MoE (sigmoid top-1 router on the expert input + shared expert).
    hf_model, model, hf_config = llama4_tiny
    hidden = torch.randn(BATCH, SEQ_LEN, hf_config.hidden_size,
                         generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN)
    with torch.no_grad():
        freqs = hf_model.model.rotary_emb(hidden, position_ids)
        expected = hf_model.model.layers[layer_index](
            hidden, position_embeddings=freqs,
            attention_mask=_llama4_reference_mask(layer_index != 3, hf_config.attention_chunk_size))
        actual, _ = model.decoder.layers[layer_index](
            hidden.transpose(0, 1).contiguous(), attention_mask=None,
            rotary_pos_emb=model.rotary_pos_emb(SEQ_LEN))
    diff = (actual.transpose(0, 1) - expected).abs().max().item()
    assert diff < TOLERANCE, f"max |diff| {diff}"


@pytest.mark.parametrize("family_name,size", [("llama4", "tiny"), ("llama4", "tiny_maverick"),
                                              ("qwen3_moe", "tiny"), ("llama", "tiny")])
def test_whole_model_logits_match_transformers(megatron_process_group, family_name, size):
    hf_model, model, hf_config = _pair(family_name, size, seed=4)
    tokens = _tokens(hf_config.vocab_size)
    position_ids = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN)
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits
        actual = model(tokens, position_ids, None)
    assert actual.shape == expected.shape == (BATCH, SEQ_LEN, hf_config.vocab_size)
    diff = (actual - expected).abs().max().item()
    assert diff < 5e-5 * max(1.0, expected.abs().max().item()), f"max |diff| {diff}"


def test_llama4_tiny_maverick_layers_are_dense_and_moe_interleaved(megatron_process_group):
    import models
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer

    family = models.get_model_family("llama4")
    model = family.build_model(family.transformer_config("tiny_maverick"),
                               pre_process=True, post_process=True)
    kinds = [type(layer.mlp) for layer in model.decoder.layers]
    assert kinds == [MLP, MoELayer, MLP, MoELayer]
    # No q/k norm anywhere on Maverick; on Scout-like tiny only on the RoPE layers 0-2.
    assert all(layer.self_attention.q_layernorm is None for layer in model.decoder.layers)
    scout_like = family.build_model(family.transformer_config("tiny"),
                                    pre_process=True, post_process=True)
    has_norm = [layer.self_attention.q_layernorm is not None for layer in scout_like.decoder.layers]
    assert has_norm == [True, True, True, False]


def test_llama_llama3_rope_scaling_changes_the_logits(megatron_process_group):
    # The dense Llama "tiny" parity above is a check of Megatron's llama3 RoPE scaling: the same
    # weights with unscaled RoPE differ from transformers well beyond the tolerance at 20 tokens.
    import models
    from models.common import build_gpt_model

    hf_model, model, hf_config = _pair("llama", "tiny", seed=4)
    family = models.get_model_family("llama")
    config = family.transformer_config("tiny")
    unscaled = build_gpt_model(config, family.layer_spec(config, use_transformer_engine=False),
                               dict(family.model_kwargs("tiny"), rope_scaling=False),
                               pre_process=True, post_process=True, vp_stage=None).eval()
    unscaled.load_state_dict(model.state_dict())
    tokens = _tokens(hf_config.vocab_size)
    position_ids = torch.arange(SEQ_LEN).expand(BATCH, SEQ_LEN)
    with torch.no_grad():
        expected = hf_model(input_ids=tokens).logits
        assert (model(tokens, position_ids, None) - expected).abs().max() < 5e-5
        assert (unscaled(tokens, position_ids, None) - expected).abs().max() > 1e-2
