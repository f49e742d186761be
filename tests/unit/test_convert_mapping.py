"""The families' HF <-> Megatron weight mappings (models/<name>/convert.py), without Megatron:
layouts checked against hand-written values, HF names and shapes against what transformers'
save_pretrained writes, and mapping round trips bit-exact on real saved weights.

Covered: Llama-4 with MoE interleave step 1 and 2, 2 / 4 / 8 experts, tied and untied embeddings
(always a shared expert, as in HF's Llama-4); Qwen3-MoE with dense layers (mlp_only_layers,
decoder_sparse_step) and no shared expert; dense Llama-3, tied and untied.
"""
import pytest
import torch

from models.convert_common import WeightGroup, convert_state_dict, fused_qkv

pytestmark = pytest.mark.unit


def test_fused_qkv_rows_are_grouped_q_then_k_then_v():
    # 4 query heads, 2 KV groups, head dim 1, hidden 1: rows named by value.
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    group = fused_qkv("q", "k", "v", "qkv", num_attention_heads=4, num_query_groups=2)
    qkv = group.to_megatron({"q": q, "k": k, "v": v})["qkv"]
    assert qkv.flatten().tolist() == [10, 11, 20, 30, 12, 13, 21, 31]
    back = group.to_hf({"qkv": qkv})
    assert all(torch.equal(back[n], t) for n, t in (("q", q), ("k", k), ("v", v)))


def test_fused_qkv_with_head_dim_two():
    q = torch.arange(8.0).reshape(4, 2)   # 2 heads x head dim 2, hidden 2
    k = 100 + torch.arange(4.0).reshape(2, 2)
    v = 200 + torch.arange(4.0).reshape(2, 2)
    group = fused_qkv("q", "k", "v", "qkv", num_attention_heads=2, num_query_groups=1)
    qkv = group.to_megatron({"q": q, "k": k, "v": v})["qkv"]
    assert qkv[:, 0].tolist() == [0, 2, 4, 6, 100, 102, 200, 202]


def _converter(family: str):
    # Through the registry: family packages import megatron.core, after the CPU shims.
    import models

    return models.get_model_family(family).converter()


def _llama4_config(**overrides):
    from transformers import Llama4TextConfig

    import models

    config = models.get_model_family("llama4").hf_config("tiny")
    for derived in ("moe_layers", "no_rope_layers", "layer_types"):  # recomputed from overrides
        config.pop(derived, None)
    config.pop("architectures")
    return Llama4TextConfig(**{**config, **overrides})


def _qwen3_config(**overrides):
    from transformers import Qwen3MoeConfig

    import models

    config = models.get_model_family("qwen3_moe").hf_config("tiny")
    config.pop("architectures")
    return Qwen3MoeConfig(**{**config, **overrides})


def test_llama4_fused_experts_are_transposed_per_expert():
    weight_groups = _converter("llama4").weight_groups
    hf = _llama4_config(num_hidden_layers=1, num_local_experts=2)
    group = next(g for g in weight_groups(hf) if g.hf_names == (
        "model.layers.0.feed_forward.experts.gate_up_proj",))
    gate_up = torch.arange(2 * 64 * 64, dtype=torch.float32).reshape(2, 64, 64)  # [E, H, 2I]
    mg = group.to_megatron({group.hf_names[0]: gate_up})
    fc1 = mg["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]  # [2I, H]
    assert fc1.shape == (64, 64)
    # nn.Linear row r (output feature r: gate for r < I, up after) = HF column r.
    assert fc1[3, 5].item() == gate_up[1, 5, 3].item()
    assert fc1[40, 7].item() == gate_up[1, 7, 40].item()


def _save_and_read(model, directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    model.save_pretrained(directory)
    return load_file(directory / "model.safetensors")


LLAMA4_VARIANTS = {
    "interleave1_4experts": {},
    "interleave2_8experts": {"interleave_moe_layer_step": 2, "num_local_experts": 8},
    "interleave2_2experts_tied": {"interleave_moe_layer_step": 2, "num_local_experts": 2,
                                  "tie_word_embeddings": True},
}


@pytest.mark.parametrize("variant", list(LLAMA4_VARIANTS))
def test_llama4_mapping_covers_saved_weights_and_round_trips(tmp_path, variant):
    from transformers import Llama4ForCausalLM

    weight_groups = _converter("llama4").weight_groups
    hf = _llama4_config(**LLAMA4_VARIANTS[variant])
    torch.manual_seed(0)
    saved = _save_and_read(Llama4ForCausalLM(hf), tmp_path)
    groups = weight_groups(hf)
    assert sorted(n for g in groups for n in g.hf_names) == sorted(saved)
    megatron = convert_state_dict(groups, saved, to="megatron")
    num_moe = len(hf.moe_layers)
    assert sum("local_experts" in n for n in megatron) == 2 * num_moe * hf.num_local_experts
    assert sum("shared_experts" in n for n in megatron) == 2 * num_moe
    assert ("output_layer.weight" in megatron) != hf.tie_word_embeddings
    back = convert_state_dict(groups, megatron, to="hf")
    assert sorted(back) == sorted(saved)
    for name, tensor in saved.items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("overrides,dense_layers", [
    ({}, []), ({"mlp_only_layers": [1]}, [1]), ({"decoder_sparse_step": 2}, [0, 2])])
def test_qwen3_moe_mapping_covers_saved_weights_and_round_trips(tmp_path, overrides,
                                                                dense_layers):
    from transformers import Qwen3MoeForCausalLM

    converter = _converter("qwen3_moe")
    weight_groups, is_moe_layer = converter.weight_groups, converter.is_moe_layer
    hf = _qwen3_config(**overrides)
    torch.manual_seed(0)
    saved = _save_and_read(Qwen3MoeForCausalLM(hf), tmp_path)
    groups = weight_groups(hf)
    assert sorted(n for g in groups for n in g.hf_names) == sorted(saved)
    megatron = convert_state_dict(groups, saved, to="megatron")
    dense = [i for i in range(hf.num_hidden_layers) if not is_moe_layer(hf, i)]
    assert dense == dense_layers
    assert sum(n.endswith("mlp.linear_fc1.weight") for n in megatron) == len(dense_layers)
    fc1 = megatron["decoder.layers.3.mlp.experts.local_experts.2.linear_fc1.weight"]
    gate = saved["model.layers.3.mlp.experts.2.gate_proj.weight"]
    assert torch.equal(fc1[:gate.shape[0]], gate)  # GLU rows: gate first, then up
    back = convert_state_dict(groups, megatron, to="hf")
    assert sorted(back) == sorted(saved)
    assert all(torch.equal(back[n], t) for n, t in saved.items())


def _llama_config(**overrides):
    import models

    family = models.get_model_family("llama")
    return family.converter().hf_text_config_from_dict({**family.hf_config("tiny"), **overrides})


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_mapping_covers_saved_weights_and_round_trips(tmp_path, tied):
    from transformers import LlamaForCausalLM

    hf = _llama_config(tie_word_embeddings=tied)
    torch.manual_seed(0)
    saved = _save_and_read(LlamaForCausalLM(hf), tmp_path)
    groups = _converter("llama").weight_groups(hf)
    assert sorted(n for g in groups for n in g.hf_names) == sorted(saved)
    megatron = convert_state_dict(groups, saved, to="megatron")
    assert ("output_layer.weight" in megatron) != tied
    fc1 = megatron["decoder.layers.2.mlp.linear_fc1.weight"]
    gate = saved["model.layers.2.mlp.gate_proj.weight"]
    up = saved["model.layers.2.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))  # GLU rows: gate first, then up
    qkv = megatron["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((hf.num_attention_heads + 2 * hf.num_key_value_heads) * hf.head_dim,
                         hf.hidden_size)
    back = convert_state_dict(groups, megatron, to="hf")
    assert sorted(back) == sorted(saved)
    assert all(torch.equal(back[n], t) for n, t in saved.items())


def test_weight_groups_name_each_tensor_once():
    llama4_groups = _converter("llama4").weight_groups
    qwen3_groups = _converter("qwen3_moe").weight_groups
    llama_groups = _converter("llama").weight_groups
    for groups in (llama4_groups(_llama4_config(interleave_moe_layer_step=2)),
                   qwen3_groups(_qwen3_config()), llama_groups(_llama_config())):
        assert all(isinstance(g, WeightGroup) for g in groups)
        hf_names = [n for g in groups for n in g.hf_names]
        mg_names = [n for g in groups for n in g.megatron_names]
        assert len(hf_names) == len(set(hf_names)) and len(mg_names) == len(set(mg_names))
