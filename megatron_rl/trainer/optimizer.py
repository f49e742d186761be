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


def _use_fused_cpu_adamw(optimizer) -> None:
    """Run megatron-core's torch.optim.AdamW fallback with torch's fused CPU kernel.

    The fused kernel computes the same update as the single-tensor loop (to ~1 ulp); torch reads
    the choice from each parameter group at every step, and a checkpoint saved afterwards records
    it. Only optimizers whose parameters are all on the CPU are switched: a CUDA run keeps what
    megatron-core chose (normally TE's FusedAdam, which is not a torch optimizer)."""
    for chained in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(chained, "optimizer", None)
        if not isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            continue
        params = [p for group in inner.param_groups for p in group["params"]]
        if not params or any(p.device.type != "cpu" for p in params):
            continue
        inner.defaults.update(fused=True, foreach=False)
        for group in inner.param_groups:
            group.update(fused=True, foreach=False)
