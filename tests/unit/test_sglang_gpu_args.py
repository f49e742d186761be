"""A GPU engine's SGLang arguments for Llama-4 (issue 39.2 and 39.3), built on CPU for a CUDA
device, the GPU's compute capability given (what NVML reports on the engine's node).

2. Chunked attention: only a backend that honours Llama-4's chunk serves it (fa3, Hopper); a
   backend that ignores it is refused, and so is a Blackwell node (no such backend there in
   SGLang 0.5.23), with the fix named. The rule's premises are read from SGLang's installed source.
3. Colocated Llama-4: the weights region is backed up to host memory across a release, since the
   q/k norm's weight is neither a parameter nor a buffer. SGLang's own parser takes the arguments.
"""
import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from megatron_rl.rollout import sglang_server
from megatron_rl.rollout.sglang_server import SGLangServerSettings

pytestmark = pytest.mark.unit

SGLANG = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"
HOPPER, BLACKWELL = (9, 0), (10, 0)


def _model(tmp_path, *, chunk: int | None = 8192, qk_norm: bool = True,
           architecture: str = "Llama4ForConditionalGeneration") -> str:
    text = {"use_qk_norm": qk_norm, "hidden_size": 64}
    if chunk is not None:
        text["attention_chunk_size"] = chunk
    config = ({"architectures": [architecture], "text_config": text}
              if architecture.startswith("Llama4") else {"architectures": [architecture]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def _args(monkeypatch, model_path, capability, **fields) -> list[str]:
    monkeypatch.setattr(sglang_server, "gpu_compute_capability", lambda: capability,
                        raising=False)
    return SGLangServerSettings(model_path=model_path, device="cuda", **fields).server_args(
        port=30000)


def _backend(args: list[str]) -> str | None:
    return args[args.index("--attention-backend") + 1] if "--attention-backend" in args else None


def _parsed(args: list[str]) -> dict:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return vars(parser.parse_args(args))


def test_llama4_on_hopper_gets_fa3(tmp_path, monkeypatch):
    args = _args(monkeypatch, _model(tmp_path), HOPPER)
    assert _backend(args) == "fa3"
    assert _parsed(args)["attention_backend"] == "fa3"
    assert _backend(_args(monkeypatch, _model(tmp_path), HOPPER, attention_backend="fa3")) \
        == "fa3"


@pytest.mark.parametrize("backend", ["triton", "trtllm_mha", "flashinfer", "torch_native"])
def test_a_backend_that_ignores_the_chunk_is_refused(tmp_path, monkeypatch, backend):
    with pytest.raises(ValueError, match="ignores the model's chunked attention.*fa3"):
        _args(monkeypatch, _model(tmp_path), HOPPER, attention_backend=backend)


def test_blackwell_refuses_llama4_naming_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"compute capability 10\.0.*Hopper"):
        _args(monkeypatch, _model(tmp_path), BLACKWELL)


def test_models_without_chunked_attention_keep_sglangs_choice(tmp_path, monkeypatch):
    dense = _model(tmp_path, architecture="LlamaForCausalLM")
    assert _backend(_args(monkeypatch, dense, BLACKWELL)) is None
    assert _backend(_args(monkeypatch, dense, BLACKWELL, attention_backend="triton")) == "triton"


def test_cpu_engines_keep_the_patched_torch_native(tmp_path):
    args = SGLangServerSettings(model_path=_model(tmp_path), device="cpu").server_args(30000)
    assert _backend(args) == "torch_native" and "--disable-hybrid-swa-memory" in args


def test_the_rules_premises_in_sglangs_source():
    """What the rule relies on, in SGLang 0.5.23: only the flash-attention backend builds
    chunk-local attention; triton and trtllm_mha (its SM100 default for Llama-4) read neither the
    chunk nor use_irope; its model hook refuses fa4 (and so everything but its list) for Llama-4."""
    attention = SGLANG / "layers" / "attention"
    assert "LocalAttentionMetadataBuilder" in (attention / "flashattention_backend.py").read_text()
    for name in ("triton_backend.py", "trtllm_mha_backend.py"):
        source = (attention / name).read_text()
        assert "use_irope" not in source and "attention_chunk_size" not in source, name
    overrides = (SGLANG / "arg_groups" / "model_overrides" / "llama4.py").read_text()
    assert 'backend, platform = "trtllm_mha", "sm100"' in overrides
    hook = (SGLANG / "arg_groups" / "model_hook.py").read_text()
    llama4 = hook.split('model_arch in ("Llama4ForConditionalGeneration", "Llama4ForCausalLM")')[1]
    allowed = llama4.split("assert attention_backend in {")[1].split("}")[0]
    assert '"fa3"' in allowed and '"fa4"' not in allowed


def test_colocated_llama4_backs_its_weights_up_across_a_release(tmp_path, monkeypatch):
    args = _args(monkeypatch, _model(tmp_path), HOPPER, enable_memory_saver=True)
    parsed = _parsed(args)
    assert parsed["enable_memory_saver"] and parsed["enable_weights_cpu_backup"]
    # Not needed (host memory and copy time saved): without the memory saver, or without the
    # weightless q/k norm (Maverick), or for another model.
    assert "--enable-weights-cpu-backup" not in _args(monkeypatch, _model(tmp_path), HOPPER)
    maverick = _model(tmp_path, qk_norm=False)
    assert "--enable-weights-cpu-backup" not in _args(monkeypatch, maverick, HOPPER,
                                                       enable_memory_saver=True)
    dense = _model(tmp_path, architecture="LlamaForCausalLM")
    assert "--enable-weights-cpu-backup" not in _args(monkeypatch, dense, HOPPER,
                                                      enable_memory_saver=True)


def test_why_the_q_k_norm_weight_needs_the_backup():
    """SGLang 0.5.23: Llama-4's q/k norm has no weight parameter (a plain tensor attribute), and a
    release stashes only the model's buffers; the CPU backup keeps the whole weights region."""
    assert "has_weight=False" in (SGLANG / "models" / "llama4.py").read_text()
    norm = (SGLANG / "layers" / "layernorm.py").read_text()
    assert "self.weight = torch.ones(hidden_size, dtype=weight_dtype)" in norm
    updater = (SGLANG / "managers" / "scheduler_components" / "weight_updater.py").read_text()
    export = updater.split("def _export_static_state(model):")[1].split("\ndef ")[0]
    assert "named_buffers()" in export and "named_parameters" not in export
    loader = (SGLANG / "model_executor" / "model_runner_components" /
              "load_model_utils.py").read_text()
    assert "enable_cpu_backup=enable_cpu_backup" in loader
