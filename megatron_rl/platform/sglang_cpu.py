"""The CPU stand-ins and fixes that SGLang 0.5.23's CPU engine needs on a CPU-only torch, in one
place; applied only when CUDA is absent (GPU runs never call into this module's patches).

`apply_sglang_cpu_fixes()` must run in every process of an SGLang server (the HTTP process and the
scheduler / detokenizer processes it spawns) before `sglang` is imported. The server is therefore
started through megatron_rl.rollout.sglang_launch, whose module body calls it: multiprocessing's
spawn re-imports that module in each child, so the children get the same fixes. Each fix, and what
breaks without it (CPU_STACK.md, verified by switching it off):

1. `SGLANG_USE_CPU_ENGINE=1`: without it, `--device cpu` takes the vLLM import path and fails.
2. A stand-in `sgl_kernel` module providing `assign_req_to_token_pool_cpu`: the real package is a
   CUDA wheel; SGLang's allocator imports that one function on CPU (the KV slot bookkeeping).
3. A stand-in `torchvision` module: a multimodal config imported by SGLang's model registry imports
   it, and PyPI's torchvision fails beside the CPU torch build (`torchvision::nms does not exist`).
   Text models never use it.
4. The Llama-4 MoE on the native (CPU) path: SGLang raises NotImplementedError for
   `apply_router_weight_on_input`; with top-1 routing it equals scaling the expert input by the
   router weight and combining with unit weights, which is what the wrapper does.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

import torch

_applied = False


def sglang_cpu_environment() -> dict[str, str]:
    """Environment variables an SGLang server process needs on a CPU-only machine."""
    return {"SGLANG_USE_CPU_ENGINE": "1"}


def apply_sglang_cpu_fixes() -> bool:
    """Apply the CPU fixes in this process when torch has no CUDA; True when applied. Idempotent."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        os.environ.update(sglang_cpu_environment())
        _install_sgl_kernel_stand_in()
        _install_torchvision_stand_in()
        _patch_native_moe_on_import()
        _applied = True
    return True


def _install_module(name: str, **attributes) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name, f"megatron_rl CPU stand-in for {name} (see sglang_cpu.py)")
    # A spec lets importlib.util.find_spec(name) answer instead of raising on a bare module.
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    module.__path__ = []
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module


def _install_torchvision_stand_in() -> None:
    # transformers must keep seeing torchvision as absent (it caches the answer): otherwise it
    # routes image processing through torchvision.io and friends. Ask it before installing.
    from transformers.utils.import_utils import is_torchvision_available

    if is_torchvision_available():
        return  # a working torchvision is installed: nothing to stand in for
    # SGLang's multimodal configs and processors import names from these modules at module level
    # (InterpolationMode, transforms.functional, ...); text models never call them.
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
                 "torchvision.io"):
        module = _install_module(name)
        module.__getattr__ = functools.partial(_unavailable, name)
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.modules["torchvision.transforms"].functional = sys.modules[
        "torchvision.transforms.functional"]


class _Unavailable:
    """What a stand-in module's unknown name resolves to: importable, an error when used."""

    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self.name} is not provided by megatron_rl's CPU stand-ins for "
                           "SGLang (megatron_rl/platform/sglang_cpu.py); this SGLang code path "
                           "needs the real package (sgl-kernel / torchvision) or a GPU")

    def __getattr__(self, attribute: str) -> "_Unavailable":
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _Unavailable(f"{self.name}.{attribute}")


def _unavailable(module: str, attribute: str) -> _Unavailable:
    if attribute.startswith("__"):
        raise AttributeError(attribute)
    return _Unavailable(f"{module}.{attribute}")


def _install_sgl_kernel_stand_in() -> None:
    module = _install_module("sgl_kernel",
                             assign_req_to_token_pool_cpu=assign_req_to_token_pool_cpu,
                             copy_all_layer_kv_cache_cpu=copy_all_layer_kv_cache_cpu)
    # Other modules import CPU kernel names at module level on paths our text models do not
    # take (AMX, quantisation): importable, a clear error if ever called.
    module.__getattr__ = functools.partial(_unavailable, "sgl_kernel")


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """What sgl_kernel's CPU kernel does: request i's KV slots out_cache_loc[o_i : o_i + n_i]
    (o_i = sum of the earlier n_j, n_i = end_i - start_i) go to req_to_token[pool_i, start_i:end_i]."""
    del pool_len  # the row length; implied by req_to_token's shape here
    offset = 0
    for pool, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(),
                                end_offset.tolist()):
        length = end - start
        req_to_token[pool, start:end] = out_cache_loc[offset:offset + length].to(
            req_to_token.dtype)
        offset += length


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """What sgl_kernel's CPU kernel does: in every KV buffer (one address per layer and K/V, with
    its row size in bytes), copy row src_loc[i] onto row tgt_loc[i]."""
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        for target, source in zip(tgt_loc.tolist(), src_loc.tolist()):
            ctypes.memmove(address + target * row_bytes, address + source * row_bytes, row_bytes)


def _native_moe_with_input_weights(forward):
    """Wrap SGLang's native MoE forward so top-1 `apply_router_weight_on_input` works."""

    def wrapped(layer, x, topk_output, moe_runner_config):
        if not moe_runner_config.apply_router_weight_on_input:
            return forward(layer, x, topk_output, moe_runner_config)
        topk_weights = topk_output.topk_weights  # [tokens, top_k]
        if topk_weights.shape[-1] != 1:
            raise NotImplementedError(
                "apply_router_weight_on_input with top_k > 1 has no CPU implementation "
                "(Llama-4 routes top-1)")
        x = x * topk_weights.to(x.dtype)
        unit = topk_output._replace(topk_weights=torch.ones_like(topk_weights))
        config = dataclasses.replace(moe_runner_config, apply_router_weight_on_input=False)
        return forward(layer, x, unit, config)

    return wrapped


class _PatchNativeMoe(importlib.abc.MetaPathFinder):
    # SGLang imports fused_moe_native lazily (inside forward); patch it when it first loads
    # rather than importing SGLang from here.
    target = "sglang.srt.layers.moe.fused_moe_native"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            module.moe_forward_native = _native_moe_with_input_weights(module.moe_forward_native)

        spec.loader.exec_module = exec_module
        return spec


def _patch_native_moe_on_import() -> None:
    module = sys.modules.get(_PatchNativeMoe.target)
    if module is not None:
        module.moe_forward_native = _native_moe_with_input_weights(module.moe_forward_native)
    else:
        sys.meta_path.insert(0, _PatchNativeMoe())
