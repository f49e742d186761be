"""AdamW and its learning-rate schedule for the trainer, from megatron-core.

ScaleRL defaults (SCALERL.md section 8): AdamW, lr 5e-7 reached by a linear warm-up of 100 steps
and then constant, eps 1e-15, weight decay 0.01; gradient clipping at 1.0 (not stated in the
paper). Megatron's `get_megatron_optimizer` gives the distributed optimizer (optimizer state
sharded over data-parallel ranks, separately for expert parameters) and `OptimizerParamScheduler`
the warm-up-then-constant schedule.

Without Transformer Engine or apex (CPU runs), megatron-core falls back to torch.optim.AdamW built
without `foreach`/`fused`, which on CPU tensors is torch's per-parameter Python loop (~10 ops per
parameter per step). `_use_fused_cpu_adamw` switches that fallback to torch's fused AdamW kernel
(one kernel per parameter); GPU runs use TE's / apex's FusedAdam and are untouched.

Colocated runs move the optimizer's own tensors off the device around generation
(`move_optimizer_state`): the Adam moments, and the FP32 main copies where they are tensors of
their own (bf16 parameters). FP32 parameters have no separate copy: the optimizer updates the
model's parameters (FP32Optimizer) or views of them (the distributed optimizer's shards), which
stay on the device.
"""
from __future__ import annotations

import dataclasses

import torch


# Our optimizer names -> megatron-core's OptimizerConfig.optimizer ("adam" there applies weight
# decay decoupled, i.e. AdamW).
MEGATRON_OPTIMIZER = {"adamw": "adam"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSettings:
    name: str = "adamw"  # a key of MEGATRON_OPTIMIZER
    lr: float = 5e-7
    lr_warmup_steps: int = 100
    lr_schedule: str = "constant"  # after warm-up: constant (ScaleRL), linear or cosine decay
    min_lr: float = 0.0  # reached at num_steps by a decaying schedule
    num_steps: int = 1000
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-15
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        if self.name not in MEGATRON_OPTIMIZER:
            raise ValueError(f"optimizer.name {self.name!r} is not one of "
                             f"{tuple(MEGATRON_OPTIMIZER)}")
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"train.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"train.lr_schedule {self.lr_schedule!r} is not one of "
                             "('constant', 'linear', 'cosine')")
        if self.clip_grad < 0:
            raise ValueError(f"train.clip_grad must be >= 0 (0 disables), got {self.clip_grad}")


def build_optimizer(model_chunks: list, settings: OptimizerSettings, *, bf16: bool,
                    params_dtype: torch.dtype):
    """(MegatronOptimizer, OptimizerParamScheduler) for the DDP-wrapped model chunks."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    min_lr = settings.lr if settings.lr_schedule == "constant" else settings.min_lr
    config = OptimizerConfig(
        optimizer=MEGATRON_OPTIMIZER[settings.name], lr=settings.lr, min_lr=min_lr,
        weight_decay=settings.weight_decay, adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad, bf16=bf16, params_dtype=params_dtype,
        use_distributed_optimizer=settings.use_distributed_optimizer)
    optimizer = get_megatron_optimizer(config, model_chunks)
    _use_fused_cpu_adamw(optimizer)
    # Warm-up from 0 to lr, then constant or decaying to min_lr at num_steps. The scheduler's
    # step count is advanced before each optimizer step (trainer), so step k uses lr * k / warm-up.
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=settings.lr, min_lr=min_lr,
        lr_warmup_steps=settings.lr_warmup_steps,
        lr_decay_steps=max(settings.num_steps, settings.lr_warmup_steps + 1),
        lr_decay_style=settings.lr_schedule, start_wd=settings.weight_decay,
        end_wd=settings.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
    return optimizer, scheduler


@dataclasses.dataclass(slots=True)
class OffloadTargets:
    """What a colocated trainer may move off the device: the main parameters that are tensors of
    their own, and the optimizer state's tensors as (state dict, key) slots."""

    main_params: list[torch.Tensor]
    state_slots: list[tuple[dict, str]]

    @property
    def num_bytes(self) -> int:
        tensors = self.main_params + [state[key] for state, key in self.state_slots]
        return sum(t.numel() * t.element_size() for t in tensors)


def offload_targets(optimizer, model_chunks: list) -> OffloadTargets:
    """The optimizer's own tensors: every tensor of its state (Adam moments, step counts) and the
    main parameters whose storage is no model parameter's.

    megatron-core's `MegatronOptimizer.offload_to_cpu` / `restore_from_cpu` move every tensor of
    the inner optimizer's param_groups with `p.data = p.data.cpu()`. For FP32 parameters those
    are the model's parameters themselves (FP32Optimizer) or views of them (the distributed
    optimizer's shard_fp32_groups, `model_param.view(-1)[start:end]`): new data detaches a view,
    so every later update would go to a copy the model never sees, and a model parameter moved
    that way leaves the device the weight sync reads it on. Only separate tensors qualify: the
    bf16 parameters' FP32 main copies."""
    model_storages = {param.untyped_storage().data_ptr()
                      for chunk in model_chunks for param in chunk.parameters()}
    main_params, state_slots = [], []
    for inner in _torch_optimizers(optimizer):
        for group in inner.param_groups:
            main_params += [param for param in group["params"]
                            if param.untyped_storage().data_ptr() not in model_storages]
        for state in inner.state.values():
            state_slots += [(state, key) for key, value in state.items()
                            if isinstance(value, torch.Tensor)]
    return OffloadTargets(main_params=main_params, state_slots=state_slots)


def move_optimizer_state(optimizer, model_chunks: list, device: torch.device) -> int:
    """Move `offload_targets` to `device`; returns the bytes that changed device (0 when all
    were there). The optimizer keys its state by the main parameters' tensor objects, which
    `.data` assignment keeps."""
    moved = 0
    targets = offload_targets(optimizer, model_chunks)
    for param in targets.main_params:
        if param.device != device:
            moved += param.numel() * param.element_size()
            param.data = param.data.to(device)
    for state, key in targets.state_slots:
        value = state[key]
        if value.device != device:
            moved += value.numel() * value.element_size()
            state[key] = value.to(device)
    return moved


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a (chained) MegatronOptimizer; stub optimizers (a rank with
    no parameters of a kind) have none."""
    return [chained.optimizer for chained in getattr(optimizer, "chained_optimizers", [optimizer])
            if getattr(chained, "optimizer", None) is not None]


def _use_fused_cpu_adamw(optimizer) -> None:
    """Run megatron-core's torch.optim.AdamW fallback with torch's fused CPU kernel.

    The fused kernel computes the same update as the single-tensor loop (to ~1 ulp); torch reads
    the choice from each parameter group at every step, and a checkpoint saved afterwards records
    it. Only optimizers whose parameters are all on the CPU are switched: a CUDA run keeps what
    megatron-core chose (normally TE's FusedAdam, which is not a torch optimizer)."""
    for inner in _torch_optimizers(optimizer):
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or any(p.device.type != "cpu" for p in params):
            continue
        inner.defaults.update(fused=True, foreach=False)
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)
