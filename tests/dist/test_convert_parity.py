"""HF -> Megatron conversion gives Megatron models whose logits equal transformers' own, at
(TP, EP, PP) = (1, 1, 1), (2, 2, 1) and (1, 2, 2) on 4 gloo ranks.

Tiny random models (transformers' Llama4ForCausalLM / Qwen3MoeForCausalLM from the families' HF
configs, weights randomised incl. norms, saved with save_pretrained) are converted once with
`megatron_rl.convert.convert_hf_to_megatron` (one global checkpoint each); a single torchrun
launch (_convert_worker.py) loads each checkpoint at every layout and saves the logits of fixed
input ids. Cases: Llama-4 "tiny" (every layer MoE, 4 experts, shared expert, q/k L2 norm, llama3
RoPE, chunked attention), Llama-4 "tiny_maverick" with 8 experts (dense/MoE interleave step 2),
Qwen3-MoE "tiny" (top-2 softmax router, no shared expert, q/k RMSNorm), dense Llama-3 "tiny" (GQA,
SwiGLU, llama3 RoPE scaling; EP has no experts to split there). All fp32; tolerance: max
|diff| < 1e-4 x max(1, max |logit|) (only reduction order differs from transformers). The same
launch re-saves every model at (1, 2, 2) as the trainer would; converting that back to HF must
give the original weights bit-exactly.
"""
import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.dist

WORLD_SIZE = 4
LAUNCH_TIMEOUT_S = 300
LAYOUTS = [(1, 1, 1), (2, 2, 1), (1, 2, 2)]  # (TP, EP, PP)
WORKER = Path(__file__).with_name("_convert_worker.py")
SEQ_LEN, BATCH = 20, 2  # 20 > Llama-4 tiny chunk 8: several attention chunks
TOLERANCE = 1e-4

# name -> (family, registered size, HF config overrides, the same as TransformerConfig overrides)
CASES = {
    "llama4_tiny": ("llama4", "tiny", {}, {}),
    "llama4_maverick_8e": ("llama4", "tiny_maverick", {"num_local_experts": 8},
                           {"num_moe_experts": 8}),
    "qwen3_moe_tiny": ("qwen3_moe", "tiny", {}, {}),
    "llama_tiny": ("llama", "tiny", {}, {}),
}




def _tiny_hf_model(family_name: str, size: str, overrides: dict, seed: int):
    import models
    import transformers

    family = models.get_model_family(family_name)
    config = family.hf_config(size)
    for derived in ("moe_layers", "no_rope_layers", "layer_types"):  # recomputed from overrides
        config.pop(derived, None)
    hf_config = family.converter().hf_text_config_from_dict({**config, **overrides})
    hf_config._attn_implementation = "eager"
    cls = getattr(transformers, family.hf_architectures[0])  # the CausalLM class
    torch.manual_seed(seed)
    model = cls(hf_config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial values everywhere, so a mis-laid weight shows
        for param in model.parameters():
            scale, base = (0.2, 1.0) if param.dim() == 1 else (0.2, 0.0)
            param.copy_(base + scale * torch.randn(param.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def parity(tmp_path_factory, torchrun):
    from megatron_rl.convert import convert_hf_to_megatron

    root = tmp_path_factory.mktemp("convert_parity")
    vocab_size = 256
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ_LEN),
                           generator=torch.Generator().manual_seed(7))
    expected, cases = {}, []
    for seed, (name, (family, size, hf_overrides, mg_overrides)) in enumerate(CASES.items()):
        model = _tiny_hf_model(family, size, hf_overrides, seed)
        assert model.config.vocab_size == vocab_size
        model.save_pretrained(root / name)
        with torch.no_grad():
            expected[name] = model(input_ids=tokens).logits
        convert_hf_to_megatron(root / name, root / f"{name}-megatron", progress=False)
        cases.append({"name": name, "family": family, "size": size, "overrides": mg_overrides,
                      "checkpoint": str(root / f"{name}-megatron")})
    spec = root / "cases.json"
    spec.write_text(json.dumps({"tokens": tokens.tolist(), "layouts": LAYOUTS, "cases": cases,
                                "resave_layout": list(LAYOUTS[-1])}))
    out = root / "logits"
    out.mkdir()
    torchrun(WORKER, ["--cases", str(spec), "--out", str(out)], num_ranks=WORLD_SIZE,
             timeout_s=LAUNCH_TIMEOUT_S)
    return expected, out, root


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}ep{}pp{}".format(*l))
@pytest.mark.parametrize("case", list(CASES))
def test_converted_megatron_logits_equal_transformers(parity, case, layout):
    expected, out, _ = parity
    actual = torch.load(out / "{}-tp{}ep{}pp{}.pt".format(case, *layout))
    reference = expected[case]
    assert actual.shape == reference.shape == (BATCH, SEQ_LEN, 256)
    diff = (actual - reference).abs().max().item()
    print(f"{case} (TP, EP, PP) = {layout}: max |diff| {diff:.2e}, max |logit| "
          f"{reference.abs().max().item():.2f}")
    assert diff < TOLERANCE * max(1.0, reference.abs().max().item()), f"max |diff| {diff}"


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_saved_at_ep2_pp2_converts_back_to_the_original_hf_weights(
        parity, case, tmp_path):
    from safetensors.torch import load_file

    from megatron_rl.convert import convert_megatron_to_hf

    _, out, root = parity
    # A model-parallel save has no hf/ folder: config and tokenizer come from the HF folder.
    convert_megatron_to_hf(out / f"{case}-resaved", tmp_path / "hf", hf_config_dir=root / case,
                           progress=False)
    original = load_file(root / case / "model.safetensors")
    restored = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(restored) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name
