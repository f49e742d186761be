"""Llama-4's chunked local attention on SGLang 0.5.23's torch_native attention backend, on CPU and
on GPU: the one fix of SGLang that both kinds of engine need (megatron_rl/platform/sglang_cpu.py
holds the CPU-only ones and lists this one as its fix 7).

On its RoPE layers (RadixAttention.use_irope) Llama-4 lets a token attend causally within its
`attention_chunk_size` chunk only. torch_native ignores `use_irope` and attends to the whole
prefix: without the fix the tiny test model's log-probs are off by up to ~4 nats from the first
token past the first chunk. The backend already masks by a sliding window when a layer has one:
for a chunked layer the fix hands it the chunk size as the window and, for that call, a mask
builder that draws chunk blocks instead (same keyword arguments, absolute positions, built on the
query's device: prefill, cached prefixes and decode are all covered, on CPU and CUDA alike).

SGLang also keeps the KV of Llama-4's chunked layers in a separate, smaller sliding-window pool by
default, which torch_native reads with full-pool indices: wrong rows once the two pools' slots
diverge, then "IndexError: index 820 is out of bounds for dimension 0 with size 820" (a 819-token
window pool). A chunked model on this backend must be served with --disable-hybrid-swa-memory
(SGLangServerSettings.server_args passes it); starting without it is an error rather than silent
garbage.

On GPU SGLang's model hook admits only fa3 / aiter / triton / ascend / trtllm_mha / intel_xpu for
Llama-4 (an assertion in `handle_model_specific_adjustments`), torch_native not among them,
because unpatched torch_native ignores the chunk. With the fix applied the engine honours it, so
the fix also lets torch_native through that one check (`_admit_torch_native`, through SGLang's own
resolution-hook registry); every other step of SGLang's argument resolution sees torch_native.
That is how a Blackwell (SM100, GB200) engine serves Llama-4 correctly with SGLang 0.5.23, whose
other backends there ignore the chunk (rollout/sglang_server.py `gpu_attention_backend`).

`apply_chunked_attention_fix()` runs in every SGLang server process (megatron_rl.rollout.
sglang_launch's module body, and apply_sglang_cpu_fixes on CPU) before SGLang is imported. It is
a no-op for models without chunked attention and for every other backend.
"""
from __future__ import annotations

import functools

import torch

_applied = False
_LLAMA4_ARCHITECTURES = ("Llama4ForConditionalGeneration", "Llama4ForCausalLM")
# Any backend of SGLang's Llama-4 list: only its assertion reads it (see _admit_torch_native).
_ADMITTED_STAND_IN = "triton"
_ADMISSION_SOURCE = "megatron_rl.platform.sglang_chunked_attention"


def apply_chunked_attention_fix() -> None:
    """Patch torch_native (and SGLang's Llama-4 backend check) when SGLang is imported in this
    process. Idempotent: the CPU fixes call it too."""
    global _applied
    if _applied:
        return
    from megatron_rl.platform.sglang_cpu import _patch_on_import

    _patch_on_import("sglang.srt.layers.attention.torch_native_backend",
                     patch_torch_native_chunked_attention)
    _patch_on_import("sglang.srt.arg_groups.resolution_hooks", _register_admission)
    _applied = True


def _chunked_causal_mask(*, q_len: int, kv_len: int, sliding_window_size: int,
                         device, query_offset: int = 0) -> torch.Tensor:
    """[q_len, kv_len] True = attend: key k is at or before query q and in q's chunk (chunk size
    passed as `sliding_window_size`, the name of the mask builder this stands in for)."""
    q_pos = torch.arange(query_offset, query_offset + q_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    return (k_pos <= q_pos) & (k_pos >= q_pos - q_pos % sliding_window_size)


def _with_chunked_attention(forward):
    """Wrap torch_native's forward_extend / forward_decode (see the module docstring)."""

    def wrapped(self, q, k, v, layer, forward_batch, *args, **kwargs):
        chunk = self.attention_chunk_size
        if chunk is None or not getattr(layer, "use_irope", False):
            return forward(self, q, k, v, layer, forward_batch, *args, **kwargs)
        window = layer.sliding_window_size
        layer.sliding_window_size = chunk
        self._make_sliding_window_mask = _chunked_causal_mask  # shadows the staticmethod
        try:
            return forward(self, q, k, v, layer, forward_batch, *args, **kwargs)
        finally:
            layer.sliding_window_size = window
            del self._make_sliding_window_mask

    return wrapped


def patch_torch_native_chunked_attention(module) -> None:
    """Patch sglang.srt.layers.attention.torch_native_backend's TorchNativeAttnBackend."""
    backend_class = module.TorchNativeAttnBackend
    init = backend_class.__init__

    @functools.wraps(init)
    def __init__(self, model_runner, *args, **kwargs):
        init(self, model_runner, *args, **kwargs)
        self.attention_chunk_size = getattr(model_runner, "attention_chunk_size", None)
        if self.attention_chunk_size is not None and self.use_sliding_window_kv_pool:
            raise RuntimeError(
                "torch_native attention reads a chunked-attention model's sliding-window KV pool "
                "with full-pool indices: serve this model (e.g. Llama-4) with "
                "--disable-hybrid-swa-memory (megatron_rl/platform/sglang_chunked_attention.py)")

    backend_class.__init__ = __init__
    backend_class.forward_extend = _with_chunked_attention(backend_class.forward_extend)
    backend_class.forward_decode = _with_chunked_attention(backend_class.forward_decode)


def _admit_torch_native(server_args, previous) -> None:
    """SGLang's `handle_model_specific_adjustments` step, for a chunked-attention Llama-4 on a
    GPU with torch_native: run with a declaration that shows its Llama-4 backend assertion a
    backend of its list, taken back as soon as the step returns (the step reads the backend for
    nothing else on Llama-4; later steps, e.g. the one that disables CUDA graphs for
    torch_native, see torch_native)."""
    from sglang.srt.arg_groups.model_override_base import model_config_of, resolved_view

    view = resolved_view(server_args)
    if view.attention_backend != "torch_native" or view.device == "cpu":
        return previous(server_args)
    model_config = model_config_of(server_args)
    architectures = getattr(model_config.hf_config, "architectures", None) or [None]
    if (architectures[0] not in _LLAMA4_ARCHITECTURES
            or getattr(model_config, "attention_chunk_size", None) is None):
        return previous(server_args)
    stand_in = (_ADMISSION_SOURCE, {"attention_backend": _ADMITTED_STAND_IN})
    server_args._resolved_overrides.append(stand_in)
    try:
        previous(server_args)
    finally:
        server_args._resolved_overrides[:] = [
            o for o in server_args._resolved_overrides if o is not stand_in]


def _register_admission(module) -> None:
    module.register_resolution_hook("handle_model_specific_adjustments")(_admit_torch_native)
