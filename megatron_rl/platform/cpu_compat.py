"""The CPU compatibility shims that let megatron-core 0.19.2 run on a CPU-only torch (gloo).

This module owns every patch the project applies to a library so that the *real* Megatron code
(GPTModel, MoE dispatchers, DDP, distributed optimizer, pipeline schedules, dist_checkpointing)
runs on development and CI machines without CUDA. `activate_cpu_compat()` applies them once,
and only when `torch.cuda.is_available()` is False: on a GPU machine it returns without touching
anything. Each shim is commented with what breaks without it. Shims 1-8 are the ones listed
(and confirmed necessary by switching each off) in /work/shared/CPU_STACK.md; shim 9 (torch AdamW
checkpoint loading) was found while building the trainer's resharding checkpoints; shim 10 (the
multi-tensor fallbacks) is a speed fix from profiling the CPU train step (docs/trainer_speed.md),
as are shim 11 (a one-rank parameter all-gather done as a copy) and shim 7's RMSNorm with a
one-node backward; shim 12 (RoPE positions under context parallelism) came with CP; shim 13
(an in-process queue for the synchronous checkpoint writer) is a start-up cost fix; shim 14 (the
attention's RoPE in one autograd node) is another speed fix of the train step; shim 15 (Megatron's
torch.compile'd fused functions run eager) is a start-up and CPU-time fix.
The nvidia-resiliency-ext version skew that breaks `import megatron.core` is not CPU-specific and
is handled in megatron_rl/_nvrx_compat.py. Call `activate_cpu_compat()` before the first
`import megatron.core` (shim 1 must be in place before that import).
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import os
import sys
import types

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE = False
_CPU = torch.device("cpu")


def activate_cpu_compat() -> bool:
    """Apply the CPU shims once; returns True if they are (now) active, False on a CUDA machine."""
    global _ACTIVE
    if torch.cuda.is_available():
        return False
    if _ACTIVE:
        return True
    _shim_eager_torch_compile()  # before anything imports megatron.core (its decorators)
    _shim_triton_stand_in()
    _shim_cuda_device_redirect()
    _shim_current_device_and_dot_cuda()
    _shim_synchronize()
    _shim_cuda_type_strings()
    _shim_streams_and_events()
    _shim_sequence_parallel_torch_norm()
    _shim_alltoall_splits_on_cpu()
    _shim_torch_adamw_reshardable_load()
    _shim_multi_tensor_fallbacks()
    _shim_single_rank_param_all_gather()
    _shim_rope_context_parallel_positions()
    _shim_checkpoint_write_results_queue()
    _shim_attention_rope_one_node()
    _ACTIVE = True
    return True


def is_cpu_compat_active() -> bool:
    return _ACTIVE


# 1. `import megatron.core` reaches megatron/core/transformer/moe/ops/paged_stash.py, which does
#    `import triton` at module level (GPU-only kernels for MoE activation paging, never used on
#    CPU). Without triton installed the whole package fails to import; register a stand-in for
#    that one module whose kernels raise if ever called.
def _shim_triton_stand_in() -> None:
    if importlib.util.find_spec("triton") is not None:
        return
    name = "megatron.core.transformer.moe.ops.paged_stash"

    def _unavailable(*_args, **_kwargs):
        raise RuntimeError("MoE paged stash needs triton and CUDA; it is not available on CPU")

    stand_in = types.ModuleType(name)
    stand_in.GLOBAL_BLOCK_SIZE = 1024
    stand_in.paged_stash_copy_kernel = _unavailable
    stand_in.paged_stash_pop_kernel = _unavailable
    stand_in.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[name] = stand_in


# 2. Megatron creates tensors with a literal `device="cuda"` (FP32Optimizer's loss scale,
#    clip_grads' overflow buffer, DDP buffers, RoPE) and moves with `.to("cuda")`; on a CPU torch
#    each raises "Torch not compiled with CUDA enabled". A global torch-function mode rewrites
#    every CUDA `device=` argument (and `.to(cuda)`) to the CPU. Costs ~20% of a CPU step.
def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is how `torch.cuda.current_device()` names a GPU.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": _CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def _shim_cuda_device_redirect() -> None:
    _CudaToCpuMode().__enter__()  # stays on the mode stack for the life of the process


# 3. `torch.cuda.current_device()` is used as a device (RoPE inv_freq, DDP buffers) and `.cuda()`
#    moves tied embeddings with PP and the distributed optimizer's shards: both raise without
#    CUDA. Make the current device the CPU and `.cuda()` the identity.
def _shim_current_device_and_dot_cuda() -> None:
    torch.cuda.current_device = lambda: _CPU
    torch.cuda.set_device = lambda *_args, **_kwargs: None
    torch.Tensor.cuda = lambda self, *_args, **_kwargs: self
    torch.nn.Module.cuda = lambda self, *_args, **_kwargs: self


# 4. dist_checkpointing calls `torch.cuda.synchronize()` around save/load: raises without CUDA.
def _shim_synchronize() -> None:
    torch.cuda.synchronize = lambda *_args, **_kwargs: None


# 5. clip_grads asserts `param.grad.type() == 'torch.cuda.FloatTensor'` and both optimizers
#    dispatch on 'torch.cuda.{Float,Half,BFloat16}Tensor' strings (TypeError for CPU tensors).
#    Report CPU tensors under the CUDA type name; a CUDA target type string maps to the CPU one.
_original_tensor_type = torch.Tensor.type


def _tensor_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None:
        name = _original_tensor_type(self)
        # The torch-function mode (shim 2) re-enters this function for the inner call: rename once.
        if self.device.type == "cpu" and not name.startswith("torch.cuda."):
            name = name.replace("torch.", "torch.cuda.", 1)
        return name
    if isinstance(dtype, str):
        dtype = dtype.replace("torch.cuda.", "torch.", 1)
    return _original_tensor_type(self, dtype, non_blocking, **kwargs)


def _shim_cuda_type_strings() -> None:
    torch.Tensor.type = _tensor_type


# 6. DDP's overlapped grad sync and the alltoall MoE dispatcher create CUDA streams and events
#    (torch.cuda.Stream(), current_stream(), stream(s), Event().record()); each raises without
#    CUDA. On CPU all work is already ordered on one stream, so no-op stand-ins are exact.
class _NullEvent:
    def __init__(self, *_args, **_kwargs):
        pass

    def record(self, *_args, **_kwargs):
        pass

    def wait(self, *_args, **_kwargs):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, _other):
        return 0.0


class _NullStream:
    def __init__(self, *_args, **_kwargs):
        pass

    def wait_stream(self, _stream):
        pass

    def wait_event(self, _event):
        pass

    def record_event(self, event=None):
        return event or _NullEvent()

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NullStream)

    def __hash__(self):
        return 0


_NULL_STREAM = _NullStream()


def _shim_streams_and_events() -> None:
    torch.cuda.Stream = _NullStream
    torch.cuda.Event = _NullEvent
    torch.cuda.current_stream = lambda *_args, **_kwargs: _NULL_STREAM
    torch.cuda.default_stream = lambda *_args, **_kwargs: _NULL_STREAM
    torch.cuda.stream = lambda *_args, **_kwargs: contextlib.nullcontext()
    torch.Tensor.record_stream = lambda self, *_args, **_kwargs: None


# 7. With the local (non-TE) layer spec, WrappedTorchNorm asserts `not config.sequence_parallel`,
#    so TP+SP (required for MoE with TP) cannot be built. A torch norm is correct under SP if its
#    weights carry `sequence_parallel=True`: finalize_model_grads then all-reduces their grads over
#    TP (each rank saw a different sequence shard). With fp32_residual_connection the input is fp32
#    while the weights may be bf16; compute in the input's dtype instead of failing.
#    RMSNorm is built as `_CPURMSNorm` at every layout: torch.nn.RMSNorm (same `weight`, same state
#    dict) whose fp32 forward and backward are one autograd node (megatron_rl/ops/rms_norm.py:
#    bit-identical forward, closed-form backward) instead of torch's six-node composite; on CPU at
#    test sizes the nine norms were ~10% of the trainer's profiled step (docs/trainer_speed.md).
class _CPURMSNorm(torch.nn.RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron_rl.ops.rms_norm import rms_norm

        weight = self.weight.to(x.dtype) if self.weight is not None else None
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return rms_norm(x, weight, eps)


class _SequenceParallelLayerNorm(torch.nn.LayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype) if self.weight is not None else None
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return torch.nn.functional.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def _shim_sequence_parallel_torch_norm() -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    original_new = WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
        # Let the original validate everything else; only the SP assertion is lifted.
        unchecked = config
        if config.sequence_parallel:
            unchecked = copy.copy(config)
            object.__setattr__(unchecked, "sequence_parallel", False)
        reference = original_new(cls, unchecked, hidden_size, eps, *args, **kwargs)
        if isinstance(reference, torch.nn.RMSNorm):
            norm = _CPURMSNorm(normalized_shape=hidden_size, eps=eps)
        elif config.sequence_parallel or config.fp32_residual_connection:
            norm = _SequenceParallelLayerNorm(normalized_shape=hidden_size, eps=eps)
        else:
            return reference
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm

    WrappedTorchNorm.__new__ = new


# 8. The alltoall dispatcher converts split sizes to numpy only for CUDA tensors
#    (moe_utils.maybe_move_tensor_to_cpu checks `tensor.is_cuda`); on CPU the splits stay tensors
#    and gloo's all_to_all_single rejects them ("split sizes must be a list of ints"). Convert CPU
#    tensors to numpy too, as the CUDA path does.
def _shim_alltoall_splits_on_cpu() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.cpu().numpy()
        return tensor

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# 9. Without TE/apex, Megatron falls back to torch.optim.AdamW, which keeps a per-parameter "step"
#    tensor; two bugs in DistributedOptimizer's load path for it (TE's FusedAdam on GPU keeps no
#    per-parameter step, so GPU runs never take this path):
#    a) a 'fully_reshardable' load looks "step" up among the per-parameter tensors, which skip it:
#       KeyError: 'step' (_set_main_param_and_optimizer_states). Let absent keys read as "not a
#       tensor", which that function already skips.
#    b) load_state_dict gives every parameter the SAME step tensor object; AdamW increments it in
#       place once per parameter, so after a resume Adam's bias correction is wrong (a resumed run
#       diverged from the uninterrupted one at its second step). Give each parameter its own copy.
class _AbsentIsNone(dict):
    def __missing__(self, _key):
        return None


def _shim_torch_adamw_reshardable_load() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        return original(self, model_param, _AbsentIsNone(tensors))

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states

    original_load = DistributedOptimizer.load_state_dict

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()

    DistributedOptimizer.load_state_dict = load_state_dict


# 10. Without TE or apex, megatron-core's gradient norm and clipping use its local multi-tensor
#     fallbacks (megatron/core/utils.py): the L2 norm builds `torch.tensor([...])` from per-tensor
#     norms, one `.item()` per parameter, and the scale is a Python loop. Not a failure but ~5% of a
#     tiny CPU train step. Same math with torch's foreach ops: the per-tensor norms are the same
#     values (stacked instead of read out one by one) and the scale is the same fp32 multiply.
def _foreach_l2_norm(_chunk_size, _noop_flag, tensor_lists, _per_tensor, *_args):
    norms = [torch.stack(torch._foreach_norm(tensors)) for tensors in tensor_lists if tensors]
    total = torch.linalg.vector_norm(torch.cat(norms)) if norms else torch.zeros(())
    return total.reshape(1).float(), None


def _foreach_scale(_chunk_size, _noop_flag, tensor_lists, scale):
    sources, destinations = tensor_lists
    if all(src is dst for src, dst in zip(sources, destinations)):
        torch._foreach_mul_(list(destinations), scale)
    else:
        torch._foreach_copy_(list(destinations), torch._foreach_mul(list(sources), scale))


def _shim_multi_tensor_fallbacks() -> None:
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm
    if clip_grads.multi_tensor_scale_impl is local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = _foreach_scale


# 11. The distributed optimizer all-gathers every parameter bucket after each step
#    (param_and_grad_buffer.start_param_sync). Over a group of one rank that gather has nothing to
#    do: the rank's shard is the whole bucket, the same memory as the output. Yet on CPU a gloo
#    all-gather of a large buffer leaves torch's multi-threaded CPU ops ~5-10x slower for a second
#    or more afterwards (measured with OMP_NUM_THREADS=2: a [1008, 1, 64] multiply 8 -> 100 us, a
#    small all-gather or an all-reduce does not do it; the cause inside gloo / OpenMP was not
#    pinned down), which made every op of the next training step slow. A synchronous all-gather
#    over a one-rank group is therefore done as what it means, a copy (none when input and output
#    are the same memory); every other call is megatron's own.
def _shim_single_rank_param_all_gather() -> None:
    from megatron.core.distributed import param_and_grad_buffer

    original = param_and_grad_buffer.dist_all_gather_func

    def all_gather(output, input, group=None, async_op=False):
        if async_op or output.numel() != input.numel() or \
                torch.distributed.get_world_size(group) != 1:
            return original(output, input, group=group, async_op=async_op)
        if output.data_ptr() != input.data_ptr():
            output.view(-1).copy_(input.view(-1))
        return None

    param_and_grad_buffer.dist_all_gather_func = all_gather


# 12. Context parallelism (CP > 1): megatron's RoPE picks each CP rank's positions
#    (`rotary_pos_embedding.get_pos_emb_on_this_cp_rank`) with a pin_memory=True index, which a
#    CPU-only torch refuses ("pin_memory=True requires a CUDA ..."). Rebound to the same
#    load-balanced selection (megatron_rl/ops/context_parallel.py `load_balanced_positions`, the layout
#    the trainer splits its micro-batches in) without pinning.
def _shim_rope_context_parallel_positions() -> None:
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    from megatron_rl.ops.context_parallel import load_balanced_positions

    def get_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        keep = load_balanced_positions(pos_emb.shape[seq_dim], cp_group.rank(), cp_group.size())
        return pos_emb.index_select(seq_dim, keep.to(pos_emb.device))

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = get_pos_emb_on_this_cp_rank


# 13. Megatron's checkpoint writer (dist_checkpointing/strategies/filesystem_async.py) passes the
#    write results through a queue that an asynchronous writer process can also reach: on the
#    first save of a process it starts a multiprocessing Manager with spawn, a server process that
#    re-imports the caller's main module (~3 s of CPU in a trainer rank, and alive as long as the
#    rank). On CPU every save is synchronous (the asynchronous writer needs CUDA:
#    megatron_rl/trainer/checkpoint.py `async_save_unavailable`, refused before a save), and the
#    results are written and read by this process: an in-process queue is the same queue.
def _shim_checkpoint_write_results_queue() -> None:
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


# 14. Without TE (whose fused RoPE needs CUDA; apply_rope_fusion is refused without it) megatron's
#    attention rotates the query and the key with rope_utils' unfused composite: ~10 autograd nodes
#    per call, per-op overhead in the profiled CPU step (docs/trainer_speed.md). The name the
#    attention module calls, `attention.apply_rotary_pos_emb`, is rebound to one that computes the
#    bshd case in one node (megatron_rl/ops/rope.py: bit-identical forward, closed-form backward):
#    [s, b, h, d] CPU tensors without cu_seqlens, fusion, MLA interleaving or mRoPE, frequencies
#    that need no gradient. Every other call is megatron's own function, and so are the other
#    modules' (MLA, inference contexts) that import it under their own names. Context parallelism
#    needs nothing here: in this layout the frequencies arrive already cut to the rank's positions
#    (RotaryEmbedding.forward, shim 12) and megatron's bshd path does not read cp_group.
def _shim_attention_rope_one_node() -> None:
    from megatron.core.transformer import attention

    from megatron_rl.ops.rope import apply_rotary

    original = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             mla_rotary_interleaved=False):
        if mla_rotary_interleaved is None:  # as megatron's function reads it
            mla_rotary_interleaved = config.multi_latent_attention
        if (cu_seqlens is not None or config.apply_rope_fusion or mla_rotary_interleaved
                or config.mrope_section is not None or freqs.requires_grad or t.dim() != 4
                or t.device.type != "cpu" or freqs.device.type != "cpu"):
            return original(t, freqs, config=config, cu_seqlens=cu_seqlens, mscale=mscale,
                            cp_group=cp_group, mla_rotary_interleaved=mla_rotary_interleaved)
        return apply_rotary(t, freqs, interleaved=config.rotary_interleaved, mscale=mscale)

    attention.apply_rotary_pos_emb = apply_rotary_pos_emb


# 15. Megatron's fused functions are torch.compile'd (megatron/core/jit.py: `jit_fuser`; the
#    bias-SwiGLU / GeLU fusions, the MoE router's helpers, L2Norm, ...). On CPU each is dynamo's
#    trace and an inductor C++ build (gcc) at its first call and again at each new shape: seconds
#    of CPU apiece, tens of seconds under load, in every trainer rank and test process, for kernels
#    no faster than eager at CPU sizes. With TORCHDYNAMO_DISABLE=1 in the environment before
#    megatron.core is imported, torch.compile returns the function itself: eager, as SGLang's CPU
#    engines run (megatron_rl/rollout/sglang_server.py). A value already set stands
#    (TORCHDYNAMO_DISABLE=0 keeps compiling); functions compiled before this call (megatron
#    imported before the shims, against the rule above) run eager too (dynamo's `disable` flag is
#    read at each call). tests/dist/test_trainer_parallel.py: 81 -> 60 CPU-seconds, warm caches.
def _shim_eager_torch_compile() -> None:
    if os.environ.setdefault("TORCHDYNAMO_DISABLE", "1") != "1":
        return
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.config.disable = True
