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
5. One reused receive buffer for weight-update buckets (CPU torch has no caching allocator: each
   fresh bucket cost more in page faults than its transfer). See `_reuse_receive_buffer`.
6. Llama-4 RoPE on CPU: SGLang's Llama-4 attention relies on the CUDA rotary kernel rotating q/k
   in place and drops the result; the CPU path returns new tensors, so RoPE was never applied.
   The wrapper writes the result back in place. See `_rotate_in_place`.
7. Llama-4 chunked local attention on torch_native (the CPU attention backend ignores it and
   attends to the whole prefix): chunk-block masks on RoPE layers; needs
   --disable-hybrid-swa-memory (checked). GPU engines on torch_native need it too, so it lives in
   megatron_rl/platform/sglang_chunked_attention.py (applied on GPU by the launcher).
8. Per-request sampling seeds, for servers started with MEGATRON_RL_SAMPLING_SEEDS=1
   (rollout.deterministic): SGLang uses a request's `sampling_seed` only under
   --enable-deterministic-inference, which needs a GPU attention backend (fa3 / flashinfer /
   triton); otherwise every request draws from the engine's one torch stream, so a completion
   depends on what the engine sampled before (a restarted engine samples differently). The fix
   builds the seed tensor when every request of a batch has a seed. Safe only without batching
   seeded and unseeded requests together (deterministic mode runs one request at a time).
9. Expert parallelism (ep_size > 1) on the native MoE path: the dispatcher marks experts owned by
   other EP ranks as -1 and `moe_forward_native` fails on them ("index -1 is out of bounds").
   The wrapper runs only this rank's local (token, expert) pairs; the model's all-reduce over
   the TP group (which contains the EP group) sums the ranks' partial outputs, as on CUDA. See
   `_native_moe_local_experts`.
10. Returned routed experts (rollout.routing_replay): the capturer's host buffer is allocated
   pinned through cudaHostRegister, which fails without CUDA; it is plain host memory here. See
   `_patch_routed_experts_host_cache`.
11. A KV cache bounded by --max-total-tokens starts whatever other processes do with memory:
   SGLang sizes the pool from the memory free after loading minus (1 - mem_fraction_static) of
   the memory free before, and refuses to start when that is <= 0, which happens on CPU as soon
   as another process (a second server, a trainer rank) grows by more than mem_fraction_static of
   free memory meanwhile. When max_total_tokens is set the pool is that size anyway; the wrapper
   then gives the profile the room for it instead of failing. See `_kv_budget_for_max_tokens`.
12. Start-up cost, not correctness: SGLang starts its scheduler(s) and detokenizer with
   multiprocessing's spawn, so each child imports torch, transformers and sglang again (~10 s of
   CPU each, ~2/3 of a tiny server's start on 2 cores). On CPU the children are forked from the
   server process instead, which has imported all that with these fixes applied, when it runs no
   other thread (checked: no OpenMP pool or I/O thread is copied); else
   from a forkserver that preloads it (`megatron_rl.platform.sglang_forkserver`). See
   `_start_children_forked` (MEGATRON_RL_SGLANG_CHILDREN=fork|forkserver|spawn chooses).
13. FP8 checkpoints (rollout.precision=fp8): SGLang's FP8 linear and MoE methods need AMX on CPU
   (an assertion at load, `sgl_kernel` VNNI kernels in the forward). Their loaders and
   parameters stay; the matmul dequantises the fp8 weights with their scales and runs in the
   activation dtype. See megatron_rl/platform/sglang_fp8_cpu.py.
14. No TP "memory balance" check on CPU (SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK=0): with
   tp_size > 1 SGLang compares the smallest free memory over the ranks with this rank's, read a
   moment later, and refuses to start when they differ by 10 %. On a GPU each rank reads its own
   device; on CPU every rank reads the one machine's free RAM, so the check only measures what
   other processes allocated between the two reads (CI once saw 9.21 GB against 10.28 GB while a
   neighbouring test started, and a TP2/EP2 engine exited). The warning is still logged.
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

from megatron_rl.platform import sglang_chunked_attention, sglang_fp8_cpu

_applied = False


def sglang_cpu_environment() -> dict[str, str]:
    """Environment variables an SGLang server process needs on a CPU-only machine."""
    return {"SGLANG_USE_CPU_ENGINE": "1",
            # Fix 14: the ranks share one machine's RAM; the GPU-per-rank balance check is noise.
            "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0"}


def apply_sglang_cpu_fixes() -> bool:
    """Apply the CPU fixes in this process when torch has no CUDA; True when applied. Idempotent."""
    global _applied
    if torch.cuda.is_available():
        return False
    if not _applied:
        os.environ.update(sglang_cpu_environment())
        _install_sgl_kernel_stand_in()
        _install_torchvision_stand_in()
        _patch_on_import("sglang.srt.layers.moe.fused_moe_native", _patch_native_moe)
        _patch_on_import("sglang.srt.models.llama4", _patch_llama4_rope)
        sglang_chunked_attention.apply_chunked_attention_fix()
        _patch_on_import("sglang.srt.weight_sync.tensor_bucket", _patch_tensor_bucket)
        _patch_on_import("sglang.srt.state_capturer.base", _patch_routed_experts_host_cache)
        _patch_on_import("sglang.srt.mem_cache.kv_cache_configurator", _patch_kv_budget)
        _patch_on_import("sglang.srt.layers.quantization.fp8", sglang_fp8_cpu.patch_fp8_methods)
        if child_start_method() != "spawn":
            _patch_on_import("sglang.srt.entrypoints.engine", _patch_child_start_method)
        if os.environ.get(SAMPLING_SEEDS_ENV) == "1":
            _patch_on_import("sglang.srt.sampling.sampling_batch_info", _patch_sampling_seeds)
        _applied = True
    return True


SAMPLING_SEEDS_ENV = "MEGATRON_RL_SAMPLING_SEEDS"


def _with_request_seeds(from_schedule_batch):
    @functools.wraps(from_schedule_batch)
    def wrapped(cls, batch, vocab_size: int):
        info = from_schedule_batch.__func__(cls, batch, vocab_size)
        seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
        if info.sampling_seed is None and seeds and all(s is not None for s in seeds):
            info.sampling_seed = torch.tensor(seeds, dtype=torch.int64, device=info.device)
        return info

    return classmethod(wrapped)


def _patch_sampling_seeds(module) -> None:
    cls = module.SamplingBatchInfo
    cls.from_schedule_batch = _with_request_seeds(cls.__dict__["from_schedule_batch"])
    _register_murmur_hash32_cpu()


_MASK32 = 0xFFFFFFFF


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2**32 for uint32 values held in int64, without int64 overflow."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _mul32(_rotl32(_mul32(k, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ k, 13)
    return (_mul32(h, 5) + 0xE6546B64) & _MASK32


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor,
                      col_indices: torch.Tensor) -> torch.Tensor:
    """sgl_kernel's CPU MurmurHash3 of (64-bit seed, 32-bit position, 32-bit column) per
    [row, column], as SGLang's Triton kernel (sglang/kernels/ops/sampling/murmur_hash.py) mixes
    them: the uniform noise of `multinomial_with_seed`. [n] x [n] x [m] -> [n, m] (int64 values
    in [0, 2**32))."""
    seed = seed.to(torch.int64)
    low, high = (seed & _MASK32)[:, None], ((seed >> 32) & _MASK32)[:, None]
    pos = (positions.to(torch.int64) & _MASK32)[:, None]
    col = (col_indices.to(torch.int64) & _MASK32)[None, :]
    h = torch.zeros((seed.shape[0], 1), dtype=torch.int64)
    for block in (low, high, pos):
        h = _murmur3_mix(h, block)
    h = _murmur3_mix(h.expand(-1, col.shape[1]), col.expand(h.shape[0], -1)) ^ 16
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def _register_murmur_hash32_cpu() -> None:
    if hasattr(torch.ops.sgl_kernel, "murmur_hash32_cpu"):
        return
    op = torch.library.custom_op("sgl_kernel::murmur_hash32_cpu", mutates_args=())(
        murmur_hash32_cpu)
    op.register_fake(lambda seed, positions, col_indices: seed.new_empty(
        (seed.shape[0], col_indices.shape[0]), dtype=torch.int64))


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


def _patch_native_moe(module) -> None:
    # SGLang imports fused_moe_native lazily (inside forward): patched when it first loads.
    # Fix 9 innermost: fix 4 hands it unit weights, and it drops the other EP ranks' experts.
    module.moe_forward_native = _native_moe_with_input_weights(
        _native_moe_local_experts(module.moe_forward_native))


# 9. Expert parallelism on the native (CPU) MoE path (ep_size > 1). SGLang's standard dispatcher
#    maps each token's top-k expert ids to this rank's local expert ids and marks the experts
#    other EP ranks own as -1 (the drop sentinel the CUDA runners skip); moe_forward_native
#    scatters every id into a count table and fails ("index -1 is out of bounds"). The wrapper
#    runs the native forward on this rank's (token, expert) pairs only, as top-1 rows, and adds
#    each pair's weighted output back to its token (in fp32): this rank's partial sum over its
#    local experts. The model's all-reduce after the MoE (over the TP group, which contains the
#    EP group) adds the ranks' partial sums, as on CUDA. A rank where no token picked a local
#    expert contributes zeros.
def _native_moe_local_experts(forward):
    """Wrap SGLang's native MoE forward so that -1 (non-local) expert ids are skipped."""

    def wrapped(layer, x, topk_output, moe_runner_config):
        topk_ids = topk_output.topk_ids  # [tokens, top_k]; -1: an expert another rank owns
        local = topk_ids >= 0
        if bool(local.all()):
            return forward(layer, x, topk_output, moe_runner_config)
        tokens, slots = local.nonzero(as_tuple=True)  # [pairs] each
        if tokens.numel() == 0:
            return x.new_zeros(x.shape)
        pairs = topk_output._replace(topk_ids=topk_ids[tokens, slots][:, None],
                                     topk_weights=topk_output.topk_weights[tokens, slots][:, None])
        partial = forward(layer, x[tokens], pairs, moe_runner_config)  # [pairs, hidden]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, tokens, partial.float()).to(x.dtype)

    return wrapped


# 5. Reuse one receive buffer for weight-update buckets. SGLang allocates every received bucket
#    afresh (`FlattenedTensorBucket.empty`). On GPU the CUDA caching allocator hands the same
#    memory back for free; CPU torch has no caching allocator, so every bucket of a sync paid a
#    page fault per 4 KiB of fresh memory (for a 64 MiB bucket that takes longer than receiving
#    it). The received tensors only live until `load_weights` has copied them into the model,
#    before the next bucket is received, so one buffer (grown to the largest bucket) serves all.
def _reuse_receive_buffer(empty):
    cache: dict[str, torch.Tensor] = {}

    @functools.wraps(empty)
    def wrapped(names, dtypes, shapes, device):
        if torch.device(device).type != "cpu":
            return empty(names, dtypes, shapes, device)
        bucket = empty(names, dtypes, shapes, "meta")  # layout and checks, no memory
        size = bucket.flattened_tensor.numel()
        buffer = cache.get("buffer")
        if buffer is None or buffer.numel() < size:
            buffer = cache["buffer"] = torch.empty(size, dtype=torch.uint8)
        bucket.flattened_tensor = buffer[:size]
        return bucket

    return wrapped


def _patch_tensor_bucket(module) -> None:
    bucket_class = module.FlattenedTensorBucket
    bucket_class.empty = staticmethod(_reuse_receive_buffer(bucket_class.empty))


# 6. Llama-4 RoPE on the CPU path. SGLang's Llama4Attention calls `self.rotary_emb(positions, q,
#    k)` on views of its fused qkv output and discards the result, relying on the CUDA kernel
#    rotating in place. The CPU path (`forward_cpu` -> `forward_native`) returns new tensors and
#    leaves its inputs alone, so without this fix no Llama-4 layer applies RoPE on CPU (log-probs
#    off by up to ~3 nats from the third token on, tiny model). The wrapper copies the rotated
#    values back into the views it was given, which is what the CUDA kernel does.
def _rotate_in_place(forward):
    """Wrap a rotary embedding's forward so that it also writes its result into query / key."""

    def wrapped(positions, query, key, *args, **kwargs):
        rotated_query, rotated_key = forward(positions, query, key, *args, **kwargs)
        if rotated_query is not query:
            query.copy_(rotated_query.reshape(query.shape))
        if rotated_key is not key:
            key.copy_(rotated_key.reshape(key.shape))
        return query, key

    return wrapped


def _patch_llama4_rope(module) -> None:
    attention_class = module.Llama4Attention
    init = attention_class.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.rotary_emb is not None:  # NoPE layers have none
            # An instance attribute: nn.Module.__call__ looks `forward` up on the instance.
            self.rotary_emb.forward = _rotate_in_place(self.rotary_emb.forward)

    attention_class.__init__ = __init__


# 7. Llama-4 chunked local attention on torch_native: shared with GPU engines that serve a
#    chunked-attention model on torch_native (Blackwell), so it lives in
#    megatron_rl/platform/sglang_chunked_attention.py; these names stay for the CPU tests.
_chunked_causal_mask = sglang_chunked_attention._chunked_causal_mask
_with_chunked_attention = sglang_chunked_attention._with_chunked_attention
_patch_torch_native_chunked_attention = (
    sglang_chunked_attention.patch_torch_native_chunked_attention)


# 10. Routed experts (--enable-return-routed-experts, rollout.routing_replay) on CPU. The capturer
#     keeps every token's expert ids in a host buffer that SGLang allocates pinned and registers
#     with cudaHostRegister (`alloc_with_host_register`); without CUDA the server dies at start-up
#     ("Torch not compiled with CUDA enabled"). On a CPU-only machine the "device" buffer already
#     is host memory: the fix allocates the capturer's host buffer as plain (unpinned) memory.
#     The native MoE path captures through the same `select_experts` hook as GPU, so nothing else
#     is needed (tests/integration/test_routing_replay.py checks the returned ids).
def _unpinned_host_alloc(dims, dtype, device, pin_memory, allocator, **_unused):
    del device, pin_memory
    return allocator.allocate(dims, dtype=dtype, device="cpu")


def _patch_routed_experts_host_cache(module) -> None:
    import collections

    funcs = collections.defaultdict(lambda: _unpinned_host_alloc)
    module.ALLOC_MEMORY_FUNCS = funcs  # this module's name only; other host pools unchanged


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs `patch(module)` right after `target` is first imported (SGLang is never imported
    from here)."""

    def __init__(self, target: str, patch):
        self.target = target
        self.patch = patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.target:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        original_exec = spec.loader.exec_module

        def exec_module(module):
            original_exec(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


def _patch_on_import(target: str, patch) -> None:
    module = sys.modules.get(target)
    if module is not None:
        patch(module)
    else:
        sys.meta_path.insert(0, _PatchOnImport(target, patch))


# 11. The KV budget of a server with --max-total-tokens, whatever the memory profile says.
def _kv_budget_for_max_tokens(profile, get_schedule):
    """Wrap KVCacheConfigurator._profile_available_bytes (see fix 11): with max_total_tokens
    set, a profile that leaves no room is raised to 1 GiB instead of failing."""
    @functools.wraps(profile)
    def wrapper(self, pre_model_load_memory):
        cap = get_schedule().max_total_tokens
        try:
            available = profile(self, pre_model_load_memory)
        except ValueError:
            if not cap:
                raise
            available = 0
        # At least 1 GiB: the pool (capped at max_total_tokens) is then as on a quiet machine
        # for the CPU-sized models served here.
        return max(available, 1 << 30) if cap else available

    return wrapper


def _patch_kv_budget(module) -> None:
    configurator = module.KVCacheConfigurator
    configurator._profile_available_bytes = _kv_budget_for_max_tokens(
        configurator._profile_available_bytes, module.get_schedule)


# 12. SGLang's children forked instead of spawned (start-up cost). SGLang sets the start method to
#     spawn in `_set_envs_and_config`, just before it starts the scheduler(s) and the
#     detokenizer; the wrapper switches it right after, to
#     - fork, when the server process runs no thread but the main one (checked in /proc, so
#       that no native thread, e.g. an OpenMP pool, a ZMQ or gRPC I/O thread, goes unseen):
#       nothing can hold a lock across the fork, and the children start with sglang and these
#       fixes already imported. They die with the server process (PR_SET_PDEATHSIG, set by the
#       launcher's at-fork hook, megatron_rl.rollout.engine_lifetime, and again by SGLang) and
#       report a crash with SIGQUIT to it, as with spawn;
#     - otherwise, forkserver: one process per server, spawned on the first child's start, that
#       preloads `megatron_rl.platform.sglang_forkserver` (these fixes, the scheduler and
#       detokenizer modules, its life and its children's tied to the server process, and a
#       SIGQUIT relay to it)
#       before any thread exists. It imports sglang once more (~10 s of CPU), where spawn
#       imports it once per child.
#     The server's child environment tweaks done per child start (NUMA binding, GPU memory
#     saver) are GPU features; this fix is CPU-only like the others.
#     MEGATRON_RL_SGLANG_CHILDREN=fork|forkserver|spawn in the server's environment chooses
#     (default fork, which falls back to forkserver as above; spawn is SGLang's own).
#     benchmarks/sglang_start.py measures the three.
FORKSERVER_PRELOAD = ("megatron_rl.platform.sglang_forkserver",)
CHILD_START_ENV = "MEGATRON_RL_SGLANG_CHILDREN"
CHILD_START_METHODS = ("fork", "forkserver", "spawn")


def child_start_method() -> str:
    """How SGLang's children start in this server process (CHILD_START_ENV; default fork)."""
    method = os.environ.get(CHILD_START_ENV, "fork")
    if method not in CHILD_START_METHODS:
        raise ValueError(f"{CHILD_START_ENV}={method!r}: use one of {CHILD_START_METHODS}")
    return method


def threads_unsafe_to_fork() -> list[str]:
    """The threads of this process other than the main one: a fork would copy them mid-work
    (native threads show as their /proc comm names)."""
    import threading

    python = {t.native_id: t.name for t in threading.enumerate()}
    main = threading.main_thread().native_id
    unsafe = []
    for tid in sorted(int(t) for t in os.listdir("/proc/self/task")):
        if tid == main:
            continue
        if tid in python:
            unsafe.append(python[tid])
        else:
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    unsafe.append(f"native thread {f.read().strip()!r}")
            except OSError:  # it ended meanwhile
                continue
    return unsafe


def _start_children_forked(set_envs_and_config):
    @functools.wraps(set_envs_and_config)
    def wrapper(*args, **kwargs):
        import logging
        import multiprocessing

        result = set_envs_and_config(*args, **kwargs)
        method = child_start_method()
        if method == "fork":
            unsafe = threads_unsafe_to_fork()
            if not unsafe:
                multiprocessing.set_start_method("fork", force=True)
                return result
            logging.getLogger(__name__).info(
                "SGLang's children start from a forkserver, not forked: threads running in the "
                "server process (%s; e.g. numpy's OpenBLAS pool when OMP_NUM_THREADS or "
                "OPENBLAS_NUM_THREADS > 1)", ", ".join(unsafe))
            method = "forkserver"
        if method == "forkserver":
            multiprocessing.set_start_method("forkserver", force=True)
            multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        return result

    return wrapper


def _patch_child_start_method(module) -> None:
    module._set_envs_and_config = _start_children_forked(module._set_envs_and_config)
