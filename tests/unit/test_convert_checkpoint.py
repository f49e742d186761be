"""Checkpoint conversion through files (megatron_rl/convert.py) on one process: HF -> Megatron -> HF
reproduces every tensor bit-exactly with the same key set (Llama-4 interleave 1 and 2, 4 and 8
experts, tied head; Qwen3-MoE with a dense layer; dense Llama-3), `--dtype` casts, multi-shard
output with an index, the multimodal Llama-4 text part, `--validate`, and the errors users hit:
missing and unexpected weights named, config/weights mismatch, unsupported architecture, non-empty
output, truncated safetensors files and damaged JSON (exit 2, one line naming the file, no output
left), and Scout's integer `attn_temperature_tuning`. Megatron-side parity at TP/EP/PP > 1 is in
tests/dist/test_convert_parity.py.
"""
import json
import shutil
import struct

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from megatron_rl import convert

pytestmark = pytest.mark.unit


def _tiny_hf(directory, family_name: str, size: str, seed: int = 0, **overrides):
    """A random transformers model of a registered tiny size (+ HF config overrides), saved."""
    import models
    import transformers

    family = models.get_model_family(family_name)
    config = family.hf_config(size)
    for derived in ("moe_layers", "no_rope_layers", "layer_types"):  # recomputed from overrides
        config.pop(derived, None)
    hf_config = family.converter().hf_text_config_from_dict({**config, **overrides})
    cls = getattr(transformers, family.hf_architectures[0])  # the CausalLM class
    torch.manual_seed(seed)
    cls(hf_config).save_pretrained(directory)
    (directory / "tokenizer_config.json").write_text('{"model_max_length": 256}')
    return directory


def _read_all(directory) -> dict[str, torch.Tensor]:
    index = directory / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    tensors = {}
    for file in files:
        tensors.update(load_file(directory / file))
    return tensors


CASES = {
    "llama4_interleave1_4experts": ("llama4", "tiny", {}),
    "llama4_interleave2_8experts_tied": ("llama4", "tiny_maverick",
                                         {"num_local_experts": 8, "tie_word_embeddings": True}),
    "qwen3_moe_with_dense_layer": ("qwen3_moe", "tiny", {"mlp_only_layers": [2]}),
    "llama_dense": ("llama", "tiny", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_is_bit_exact(tmp_path, case):
    family, size, overrides = CASES[case]
    source = _tiny_hf(tmp_path / "hf", family, size, **overrides)
    to_megatron = convert.convert_hf_to_megatron(source, tmp_path / "mg", validate=True,
                                                 progress=False)
    assert (tmp_path / "mg" / "metadata.json").is_file()
    assert (tmp_path / "mg" / "hf" / "tokenizer_config.json").is_file()
    back = convert.convert_megatron_to_hf(tmp_path / "mg", tmp_path / "back", validate=True,
                                          progress=False)
    original, restored = _read_all(source), _read_all(tmp_path / "back")
    assert sorted(restored) == sorted(original)
    for name, tensor in original.items():
        assert restored[name].dtype == tensor.dtype and torch.equal(restored[name], tensor), name
    assert back.num_tensors == len(original) and to_megatron.num_bytes == back.num_bytes
    assert json.loads((tmp_path / "back" / "tokenizer_config.json").read_text()) == \
        {"model_max_length": 256}
    restored_config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert restored_config["architectures"] == json.loads(
        (source / "config.json").read_text())["architectures"]


def test_dtype_cast_and_multiple_shards(tmp_path):
    source = _tiny_hf(tmp_path / "hf", "llama4", "tiny_maverick")
    convert.convert_hf_to_megatron(source, tmp_path / "mg", dtype=torch.bfloat16, progress=False)
    convert.convert_megatron_to_hf(tmp_path / "mg", tmp_path / "back", max_shard_bytes=100_000,
                                   validate=True, progress=False)
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    original, restored = _read_all(source), _read_all(tmp_path / "back")
    assert sorted(restored) == sorted(original)
    for name, tensor in original.items():
        assert restored[name].dtype == torch.bfloat16
        assert torch.equal(restored[name], tensor.to(torch.bfloat16)), name
    assert json.loads((tmp_path / "back" / "config.json").read_text())["dtype"] == "bfloat16"


def test_multimodal_llama4_converts_its_text_model(tmp_path):
    # Llama4ForConditionalGeneration stores the text model under "language_model."; the vision
    # tower is skipped and the way back writes a text-only Llama4ForCausalLM.
    text = _tiny_hf(tmp_path / "text", "llama4", "tiny")
    text_config = json.loads((text / "config.json").read_text())
    multimodal = tmp_path / "mm"
    multimodal.mkdir()
    weights = {f"language_model.{n}": t for n, t in _read_all(text).items()}
    weights["vision_model.patch_embedding.weight"] = torch.ones(4, 3)
    save_file(weights, multimodal / "model.safetensors")
    (multimodal / "config.json").write_text(json.dumps(
        {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
         "text_config": text_config, "vision_config": {}}))
    report = convert.convert_hf_to_megatron(multimodal, tmp_path / "mg", progress=False)
    assert report.skipped_hf_tensors == ("vision_model.patch_embedding.weight",)
    convert.convert_megatron_to_hf(tmp_path / "mg", tmp_path / "back", progress=False)
    restored, original = _read_all(tmp_path / "back"), _read_all(text)
    assert sorted(restored) == sorted(original)
    assert all(torch.equal(restored[n], t) for n, t in original.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == \
        ["Llama4ForCausalLM"]


def _rewrite_weights(directory, change) -> None:
    weights = load_file(directory / "model.safetensors")
    change(weights)
    save_file(weights, directory / "model.safetensors")


def test_missing_and_unexpected_weights_are_named(tmp_path):
    source = _tiny_hf(tmp_path / "hf", "llama4", "tiny")

    def damage(weights):
        del weights["model.layers.2.feed_forward.router.weight"]
        weights["model.layers.9.extra.weight"] = torch.zeros(2)

    _rewrite_weights(source, damage)
    with pytest.raises(convert.ConversionError) as error:
        convert.convert_hf_to_megatron(source, tmp_path / "mg", progress=False)
    message = str(error.value)
    assert "missing" in message and "model.layers.2.feed_forward.router.weight" in message
    assert "unexpected" in message and "model.layers.9.extra.weight" in message
    assert not (tmp_path / "mg").exists()  # checked before anything is written


def test_config_that_does_not_match_the_weights(tmp_path):
    source = _tiny_hf(tmp_path / "hf", "llama4", "tiny")
    config = json.loads((source / "config.json").read_text())
    config["num_local_experts"] = 8  # the weights have 4 experts
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(convert.ConversionError, match="does not match the weights") as error:
        convert.convert_hf_to_megatron(source, tmp_path / "mg", progress=False)
    assert "model.layers.0.feed_forward.experts.gate_up_proj" in str(error.value)


def test_unsupported_architecture_lists_supported_ones(tmp_path):
    source = _tiny_hf(tmp_path / "hf", "qwen3_moe", "tiny")
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = ["MixtralForCausalLM"]
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(convert.ConversionError, match="MixtralForCausalLM") as error:
        convert.convert_hf_to_megatron(source, tmp_path / "mg", progress=False)
    assert all(architecture in str(error.value) for architecture in (
        "LlamaForCausalLM", "Llama4ForCausalLM", "Qwen3MoeForCausalLM"))


def test_cli_refuses_a_non_empty_output_unless_overwrite(tmp_path, capsys):
    source = _tiny_hf(tmp_path / "hf", "qwen3_moe", "tiny")
    output = tmp_path / "mg"
    output.mkdir()
    (output / "keep.txt").write_text("x")
    argv = ["hf-to-megatron", str(source), str(output), "--no-progress"]
    assert convert.main(argv) == 2
    assert "not empty" in capsys.readouterr().err and (output / "keep.txt").exists()
    assert convert.main([*argv, "--overwrite", "--validate"]) == 0
    assert not (output / "keep.txt").exists() and (output / "metadata.json").is_file()
    assert "validated" in capsys.readouterr().out
    back = tmp_path / "back"
    assert convert.main(["megatron-to-hf", str(output), str(back), "--no-progress",
                         "--dtype", "float16"]) == 0
    with safe_open(back / "model.safetensors", "pt") as handle:
        assert handle.get_tensor("model.norm.weight").dtype == torch.float16


# ----------------------------------------------------------------------------- damaged inputs


@pytest.fixture(scope="module")
def pristine_hf(tmp_path_factory):
    """A tiny Llama-3 folder twice: one model.safetensors, and shards with an index."""
    root = tmp_path_factory.mktemp("pristine")
    single = _tiny_hf(root / "single", "llama", "tiny")
    sharded = root / "sharded"
    sharded.mkdir()
    weights = _read_all(single)
    names = sorted(weights)
    files = [f"model-{i + 1:05d}-of-00003.safetensors" for i in range(3)]
    weight_map = {name: files[i * 3 // len(names)] for i, name in enumerate(names)}
    for file in files:
        save_file({n: weights[n] for n in names if weight_map[n] == file}, sharded / file,
                  metadata={"format": "pt"})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": sum(t.nbytes for t in weights.values())},
         "weight_map": weight_map}))
    for side_file in ("config.json", "tokenizer_config.json"):
        shutil.copy(single / side_file, sharded / side_file)
    return {"single": single, "sharded": sharded}


def _header_end(path) -> int:
    """Bytes before the tensor data: the 8-byte header length and the JSON header."""
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.mark.parametrize("layout, cut", [
    ("single", "in_data"), ("single", "in_header"),
    ("sharded", "in_data"), ("sharded", "in_header"),
])
def test_truncated_safetensors_is_a_one_line_error_naming_the_file(tmp_path, capsys,
                                                                   pristine_hf, layout, cut):
    # A download or copy cut short: the command says which file and what to do, exits 2 and
    # leaves no output folder (nothing is written before every header is read).
    from megatron_rl.cli import main as megatron_rl_main

    source = shutil.copytree(pristine_hf[layout], tmp_path / "hf")
    damaged = source / ("model.safetensors" if layout == "single"
                        else "model-00002-of-00003.safetensors")
    size = (damaged.stat().st_size - 100 if cut == "in_data" else _header_end(damaged) // 2)
    with open(damaged, "r+b") as handle:
        handle.truncate(size)
    output = tmp_path / "mg"
    code = megatron_rl_main(["convert", "hf-to-megatron", str(source), str(output),
                             "--no-progress"])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == "" and "Traceback" not in captured.err
    # The whole error is one line (the CLI may print its environment summary line before it).
    lines = captured.err.strip().splitlines()
    assert [line for line in lines if str(damaged) in line or "error" in line] == lines[-1:]
    assert lines[-1].startswith("megatron-rl convert: error: ")
    assert "truncated" in lines[-1] and "re-download or re-copy it" in lines[-1]
    assert not output.exists()


def test_missing_shard_and_damaged_json_are_one_line_errors(tmp_path, capsys, pristine_hf):
    source = shutil.copytree(pristine_hf["sharded"], tmp_path / "hf")
    output = tmp_path / "mg"
    argv = ["hf-to-megatron", str(source), str(output), "--no-progress"]
    (source / "model-00003-of-00003.safetensors").unlink()
    assert convert.main(argv) == 2
    assert "model-00003-of-00003.safetensors is missing" in capsys.readouterr().err
    index = source / "model.safetensors.index.json"
    index.write_text(index.read_text()[:40])
    assert convert.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{index} is not valid JSON" in err
    assert not output.exists()


def test_config_that_transformers_refuses_is_a_one_line_error(tmp_path, capsys, pristine_hf):
    source = shutil.copytree(pristine_hf["single"], tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "rms_norm_eps": "1e-5"}))
    assert convert.main(["hf-to-megatron", str(source), str(tmp_path / "mg"),
                         "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rms_norm_eps" in err
    assert f"{source / 'config.json'} is not a valid llama config" in err
    assert not (tmp_path / "mg").exists()


@pytest.mark.parametrize("multimodal", [False, True], ids=["text", "multimodal"])
def test_scout_style_integer_temperature_tuning_converts_as_the_flag(tmp_path, multimodal):
    # meta-llama's Scout config.json stores attn_temperature_tuning as 4, which transformers'
    # strict Llama4TextConfig refuses; it means True, and converts exactly as the bool config.
    import models
    from models.llama4.config import megatron_fields

    source = _tiny_hf(tmp_path / "hf", "llama4", "tiny")
    bool_config = json.loads((source / "config.json").read_text())
    assert bool_config["attn_temperature_tuning"] is True
    scout = shutil.copytree(source, tmp_path / "scout")
    text_config = {**bool_config, "attn_temperature_tuning": 4}
    if multimodal:  # Scout's own layout: the text model under "language_model."
        del text_config["architectures"]
        weights = {f"language_model.{n}": t for n, t in _read_all(source).items()}
        save_file(weights, scout / "model.safetensors", metadata={"format": "pt"})
        scout_config = {"architectures": ["Llama4ForConditionalGeneration"],
                        "model_type": "llama4", "text_config": text_config,
                        "vision_config": {}}
    else:
        scout_config = text_config
    (scout / "config.json").write_text(json.dumps(scout_config))

    converter = models.get_model_family("llama4").converter()
    from_int = converter.hf_text_config_from_dict(scout_config)
    from_bool = converter.hf_text_config_from_dict(bool_config)
    assert from_int.attn_temperature_tuning is True
    assert from_int.to_dict() == from_bool.to_dict()
    assert megatron_fields(from_int) == megatron_fields(from_bool)
    assert megatron_fields(from_int)["attn_temperature_tuning"] is True
    family = models.model_family_for_hf_config(scout_config)  # what the trainer binds
    assert family.hf_config.attn_temperature_tuning is True

    convert.convert_hf_to_megatron(scout, tmp_path / "mg", validate=True, progress=False)
    convert.convert_megatron_to_hf(tmp_path / "mg", tmp_path / "back", validate=True,
                                   progress=False)
    original, restored = _read_all(source), _read_all(tmp_path / "back")
    assert sorted(restored) == sorted(original)
    assert all(torch.equal(restored[n], t) for n, t in original.items())
    # The way back writes a config.json that transformers' strict config loads.
    written = json.loads((tmp_path / "back" / "config.json").read_text())
    assert written["attn_temperature_tuning"] is True
    transformers.AutoConfig.from_pretrained(tmp_path / "back")
