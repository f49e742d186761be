"""A quantised checkpoint as model.hf_checkpoint is refused (issue 30.10, 40): the trainer
starts from its weights and needs them unquantised; serving FP8 is rollout.precision=fp8 (the run
writes the generators' FP8 copy itself). Refused at config load (model.hf_checkpoint) and again
when the trainer connects to the generators, in one error naming the checkpoint, what marks it
quantised and the fix; SGLang 0.5.23 finds quantisation in config.json's quantization_config /
compression_config and in hf_quant_config.json."""
import json

import pytest

from megatron_rl.config import ConfigError, ModelConfig, load_config

pytestmark = pytest.mark.unit

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
       "weight_block_size": [128, 128]}


def _checkpoint(path, **config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         **config}))
    return path


def test_an_fp8_checkpoint_is_refused_at_config_load(tmp_path):
    served = _checkpoint(tmp_path / "fp8", quantization_config=FP8)
    with pytest.raises(ConfigError) as raised:
        load_config(None, ["model.name=llama", "model.size=tiny",
                           f"model.hf_checkpoint={served}"])
    message = str(raised.value)
    assert message.startswith(f"model.hf_checkpoint: {served} is a quantised checkpoint")
    assert "quantization_config (quant_method 'fp8')" in message
    assert "bf16 release" in message and "rollout.precision=fp8" in message


@pytest.mark.parametrize("marker", ["text_config", "compression_config", "hf_quant_config"])
def test_every_quantisation_marker_sglang_reads_is_refused(tmp_path, marker):
    if marker == "text_config":  # Llama-4's layout: the language model's config is nested
        served = _checkpoint(tmp_path / marker, text_config={"quantization_config": FP8})
        found = "config.json text_config.quantization_config"
    elif marker == "compression_config":  # compressed-tensors
        served = _checkpoint(tmp_path / marker,
                             compression_config={"quant_method": "compressed-tensors"})
        found = "config.json compression_config"
    else:  # NVIDIA ModelOpt: a file beside config.json
        served = _checkpoint(tmp_path / marker)
        (served / "hf_quant_config.json").write_text(json.dumps(
            {"quantization": {"quant_algo": "FP8"}}))
        found = "hf_quant_config.json"
    with pytest.raises(ConfigError, match=f"model.hf_checkpoint: .*{found}"):
        ModelConfig(name="llama", size="tiny", hf_checkpoint=str(served))


def test_unquantised_or_absent_checkpoints_pass(tmp_path):
    plain = _checkpoint(tmp_path / "bf16", torch_dtype="bfloat16", quantization_config=None)
    assert ModelConfig(name="llama", size="tiny", hf_checkpoint=str(plain)).hf_checkpoint
    # No config.json (yet): left to the converter and the engine to report.
    ModelConfig(name="llama", size="tiny", hf_checkpoint=str(tmp_path / "missing"))


def test_the_weight_sync_connection_refuses_it_too(tmp_path):
    """A checkpoint quantised after the config was loaded (or never named in one)."""
    from megatron_rl.cluster import GeneratorEndpoint, TrainerWorker

    served = _checkpoint(tmp_path / "fp8", quantization_config=FP8)
    endpoint = GeneratorEndpoint(name="g0", url="http://127.0.0.1:1", num_ranks=1, node_id="n",
                                 node_ip="127.0.0.1", pid=1, started_at=0.0, log_path="")
    with pytest.raises(ConfigError, match=r"connect_generators\(hf_config_dir\): .* is a "
                                          "quantised checkpoint"):
        TrainerWorker(0).connect_generators([endpoint], str(served))
