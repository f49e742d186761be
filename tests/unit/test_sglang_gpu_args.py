"""A GPU engine's SGLang arguments for Llama-4 (issue 39.2 and 39.3), built on CPU for a CUDA
device, the GPU's compute capability given (what NVML reports on the engine's node).

2. Chunked attention: only a backend that honours Llama-4's chunk serves it (fa3, Hopper's
   default; torch_native, patched by megatron_rl, on any GPU when asked for, with one KV pool); a
   backend that ignores it is refused, and so is a Blackwell node with no backend set (SGLang
   0.5.23 has no fast one there), with both fixes named. Every engine process applies the
   torch_native patch, GPU ones too, and the patch lets torch_native through SGLang's Llama-4
   backend check. The rule's premises are read from SGLang's installed source.
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


@pytest.mark.parametrize("backend", ["triton", "trtllm_mha", "flashinfer", "fa4"])
def test_a_backend_that_ignores_the_chunk_is_refused(tmp_path, monkeypatch, backend):
    with pytest.raises(ValueError,
                       match="ignores the model's chunked attention.*fa3.*torch_native"):
        _args(monkeypatch, _model(tmp_path), HOPPER, attention_backend=backend)


def test_blackwell_refuses_llama4_naming_both_fixes(tmp_path, monkeypatch):
    """No backend set on SM100: refused (never a silent fall-back to the slow backend), naming
    Hopper engines with fa3 and torch_native with its cost; fa3 asked for there is refused too."""
    for requested in (None, "fa3"):
        with pytest.raises(ValueError, match=r"compute capability 10\.0.*Hopper.*fa3.*"
                                             r"attention_backend: torch_native.*slower"):
            _args(monkeypatch, _model(tmp_path), BLACKWELL, attention_backend=requested)


@pytest.mark.parametrize("capability", [HOPPER, BLACKWELL], ids=["hopper", "blackwell"])
def test_torch_native_serves_llama4_on_any_gpu_with_one_kv_pool(tmp_path, monkeypatch,
                                                                capability):
    """Issue 39.2 on SM100: torch_native honours the chunk once patched, which needs one KV pool
    for all layers (it reads the sliding-window pool with full-pool indices otherwise)."""
    args = _args(monkeypatch, _model(tmp_path), capability, attention_backend="torch_native")
    parsed = _parsed(args)
    assert (parsed["attention_backend"], parsed["disable_hybrid_swa_memory"]) == (
        "torch_native", True)
    assert parsed["device"] == "cuda" and not parsed["disable_cuda_graph"]  # SGLang's own call
    # fa3 keeps the hybrid pool (it implements the chunk itself), and so does a dense model.
    assert "--disable-hybrid-swa-memory" not in _args(monkeypatch, _model(tmp_path), HOPPER)
    dense = _model(tmp_path, architecture="LlamaForCausalLM")
    assert "--disable-hybrid-swa-memory" not in _args(monkeypatch, dense, capability,
                                                      attention_backend="torch_native")


def test_every_engine_process_applies_the_torch_native_patch(monkeypatch):
    """The launcher's module body (run in each SGLang server process, GPU ones included: no CUDA
    condition around it) applies the shared patch, which hooks torch_native's backend and
    SGLang's resolution-hook registry whatever the device."""
    import ast
    import torch

    from megatron_rl.platform import sglang_chunked_attention, sglang_cpu

    # Read, not imported: its body would set this process's environment and CPU stand-ins.
    launcher = importlib.util.find_spec("megatron_rl.rollout.sglang_launch").origin
    body = ast.parse(Path(launcher).read_text()).body
    calls = [n.value.func.id for n in body if isinstance(n, ast.Expr)
             and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)]
    assert "apply_chunked_attention_fix" in calls

    hooked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sglang_chunked_attention, "_applied", False)
    monkeypatch.setattr(sglang_cpu, "_patch_on_import",
                        lambda target, patch: hooked.append((target, patch)))
    sglang_chunked_attention.apply_chunked_attention_fix()
    sglang_chunked_attention.apply_chunked_attention_fix()  # idempotent: patched once
    assert hooked == [
        ("sglang.srt.layers.attention.torch_native_backend",
         sglang_chunked_attention.patch_torch_native_chunked_attention),
        ("sglang.srt.arg_groups.resolution_hooks", sglang_chunked_attention._register_admission)]


def test_chunk_masks_with_tensor_lengths_on_the_querys_device():
    """On GPU torch_native passes lengths as 0-dim tensors (`seq_lens[i]`) and the query's device;
    the chunk mask equals a brute-force chunk-block reference for prefill and decode."""
    import torch

    from megatron_rl.platform.sglang_chunked_attention import _chunked_causal_mask

    def reference(q_len, kv_len, chunk, offset):
        return [[int(k <= q and k // chunk == q // chunk) for k in range(kv_len)]
                for q in range(offset, offset + q_len)]

    for q_len, kv_len, chunk, offset in ((7, 7, 3, 0), (1, 10, 4, 9), (1, 9, 4, 8), (3, 12, 5, 9)):
        mask = _chunked_causal_mask(q_len=torch.tensor(q_len), kv_len=torch.tensor(kv_len),
                                    sliding_window_size=chunk, device=torch.device("cpu"),
                                    query_offset=torch.tensor(offset))
        assert mask.dtype == torch.bool and mask.device.type == "cpu"
        assert mask.int().tolist() == reference(q_len, kv_len, chunk, offset)


def _llama4_config(monkeypatch, architecture="Llama4ForConditionalGeneration", chunk=8192):
    import types

    from sglang.srt.arg_groups import model_override_base

    config = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=[architecture]),
                                   attention_chunk_size=chunk)
    monkeypatch.setattr(model_override_base, "model_config_of", lambda server_args: config)


def _llama4_backend_check(server_args):
    """The Llama-4 branch of SGLang 0.5.23's handle_model_specific_adjustments (its list is
    checked against the source in test_the_rules_premises_in_sglangs_source)."""
    from sglang.srt.arg_groups.model_override_base import resolved_view

    backend = resolved_view(server_args).attention_backend
    assert backend in {"fa3", "aiter", "triton", "ascend", "trtllm_mha", "intel_xpu"}, backend
    server_args.seen = backend


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_patch_lets_torch_native_through_sglangs_llama4_check(monkeypatch, device):
    import types

    from megatron_rl.platform.sglang_chunked_attention import _admit_torch_native
    from sglang.srt.arg_groups.model_override_base import resolved_view

    _llama4_config(monkeypatch)
    earlier = ("earlier step", {"cuda_graph_max_bs": 8})
    record = types.SimpleNamespace(attention_backend="torch_native", device=device,
                                   _resolved_overrides=[earlier])
    if device == "cpu":  # SGLang runs no such check on CPU: the step is left alone
        with pytest.raises(AssertionError, match="torch_native"):
            _admit_torch_native(record, _llama4_backend_check)
        return
    with pytest.raises(AssertionError, match="torch_native"):
        _llama4_backend_check(record)  # SGLang's own check refuses it
    _admit_torch_native(record, _llama4_backend_check)
    assert record.seen == "triton"  # the check saw a listed backend ...
    assert record._resolved_overrides == [earlier]  # ... and nothing of it stays
    assert resolved_view(record).attention_backend == "torch_native"


def test_the_admission_leaves_other_models_and_backends_alone(monkeypatch):
    import types

    from megatron_rl.platform.sglang_chunked_attention import _admit_torch_native

    for architecture, chunk, backend in (("Llama4ForConditionalGeneration", None, "torch_native"),
                                         ("LlamaForCausalLM", 8192, "torch_native"),
                                         ("Llama4ForConditionalGeneration", 8192, "flashinfer")):
        _llama4_config(monkeypatch, architecture, chunk)
        record = types.SimpleNamespace(attention_backend=backend, device="cuda",
                                       _resolved_overrides=[])
        with pytest.raises(AssertionError, match=backend):
            _admit_torch_native(record, _llama4_backend_check)


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
    # The list _llama4_backend_check copies (torch_native not in it: the admission is needed), in
    # a step megatron_rl may wrap through SGLang's registry; nothing else there reads the backend
    # for Llama-4; SGLang turns CUDA graphs off for torch_native itself, in a later step.
    assert sorted(a.strip().strip('"') for a in allowed.split(",") if a.strip()) == sorted(
        ["fa3", "aiter", "triton", "ascend", "trtllm_mha", "intel_xpu"])
    branch = llama4.split("\n    elif ")[0]
    assert [line.strip()[:40] for line in branch.splitlines() if "attention_backend" in line] == [
        "attention_backend = resolved_view(server", "assert attention_backend in {",
        'f"fa3, aiter, triton, ascend, trtllm_mha']  # the read, the check, its message
    from sglang.srt.arg_groups.resolution_hooks import _OVERRIDABLE_HOOKS

    assert "handle_model_specific_adjustments" in _OVERRIDABLE_HOOKS
    compat = (SGLANG / "arg_groups" / "attention_hook.py").read_text()
    assert 'if attention_backend == "torch_native":' in compat
    assert "Cuda graph is disabled because of using torch native attention backend" in compat
    native = (attention / "torch_native_backend.py").read_text()
    assert "device=per_req_query.device" in native and "use_irope" not in native


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
