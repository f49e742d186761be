"""Trainer checkpoints with Megatron dist_checkpointing: model, optimizer, scheduler, RNG, step
counters and a driver-owned `extra_state` (e.g. sampler state), loadable at another parallel layout.

Tensors are saved as sharded tensors by global identity, so TP / EP / PP / DP may differ between
save and load. The distributed optimizer uses the 'fully_reshardable' sharding type: it stores the
optimizer state per parameter (not per DP-bucket), which is what allows changing TP/PP/EP and not
only DP ('dp_reshardable' does DP only; the default fails with "flattened_range is not
supported"). RNG states are restored only at the layout they were saved at (they are per rank); at
another layout the freshly seeded state is kept.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
import random
from typing import Any

import numpy as np
import torch

from megatron_rl.trainer.model import unwrap
from megatron_rl.trainer.parallel import ParallelGroups, ParallelLayout

# What the trainer passes to sharded_state_dict for the model's tensors (megatron_rl/convert.py
# writes converted checkpoints with the same); the model part of the layout does not depend on
# it, the value is kept identical for clarity.
MODEL_SHARDED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}

# chained_optim_avoid_prefix: the optimizer-state keys must not depend on how many chained
# optimizers the layout has (experts get their own optimizer only when EP/ETP differ from dense).
_SHARDED_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                     "chained_optim_avoid_prefix": True}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointState:
    """What a load gives back to the trainer besides the restored model and optimizer."""

    step: int
    num_skipped_steps: int
    saved_layout: ParallelLayout
    extra_state: dict[str, Any]
    rng_restored: bool


def async_save_unavailable() -> str | None:
    """Why Megatron's asynchronous checkpoint save cannot run in this process, or None. Its
    writer stages every tensor to host memory with `torch.cuda.synchronize()`
    (dist_checkpointing/strategies/filesystem_async.py, preload_tensors) and does not copy
    tensors already on the CPU (training would change them under the writer): CUDA only."""
    if not torch.cuda.is_available():
        return ("Megatron's asynchronous checkpoint writer stages tensors with "
                "torch.cuda.synchronize() and does not copy CPU tensors: it needs CUDA")
    return None


def save_checkpoint(directory: str, model, optimizer, scheduler, *, layout: ParallelLayout,
                    groups: ParallelGroups, step: int, num_skipped_steps: int,
                    extra_state: dict[str, Any] | None = None,
                    checkpoint_format: str = "torch_dist", async_save: bool = False):
    """Write a checkpoint of this rank's shards (collective: every trainer rank calls it).
    `step` counts optimizer updates; at step 0 only the model (and counters) are saved.
    `checkpoint_format` is Megatron's save backend (ckpt_format; torch_dist reshards on load).
    `async_save` (CUDA only, `async_save_unavailable`): return Megatron's AsyncRequest once the
    tensors are staged in host memory; the files are complete when an AsyncCallsQueue that
    scheduled it has finalized it (collective). Otherwise None, with the files complete."""
    from megatron.core import dist_checkpointing

    if async_save and (why := async_save_unavailable()):
        raise RuntimeError(f"asynchronous checkpoint save requested, but {why}; set "
                           "checkpoint.async_save to auto or never")

    if torch.distributed.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    # Before the first update the optimizer has no state (Adam initialises it lazily) and
    # Megatron cannot serialise it: such a checkpoint holds the model only.
    with_optimizer = step > 0
    state = _sharded_state(model, optimizer if with_optimizer else None, groups,
                           is_loading=False)
    state["scheduler"] = scheduler.state_dict()
    state["trainer"] = {"step": step, "num_skipped_steps": num_skipped_steps,
                        "with_optimizer": with_optimizer,
                        "layout": dataclasses.asdict(layout),
                        # Pickled so that the driver's nested state round-trips as bytes.
                        "extra_state": pickle.dumps(extra_state or {})}
    state["rng"] = _rng_object(groups, _rng_state())
    strategy = dist_checkpointing.serialization.get_default_save_sharded_strategy(
        checkpoint_format)
    if async_save:
        # "mcore": Megatron's own writer process. Its "nvrx" default needs
        # nvidia-resiliency-ext >= 0.6 (the pinned 0.4.1 predates it: megatron_rl/_nvrx_compat.py).
        return dist_checkpointing.save(state, directory, sharded_strategy=strategy,
                                       async_sharded_save=True, async_strategy="mcore")
    dist_checkpointing.save(state, directory, sharded_strategy=strategy)
    torch.distributed.barrier()
    return None


def load_checkpoint(directory: str, model, optimizer, scheduler, *, layout: ParallelLayout,
                    groups: ParallelGroups, load_optimizer: bool = True) -> CheckpointState:
    """Restore model (and optimizer, scheduler) in place; collective over all trainer ranks."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    common = dist_checkpointing.load_common_state_dict(directory)
    saved_layout = ParallelLayout(**common["trainer"]["layout"])
    load_optimizer = load_optimizer and common["trainer"]["with_optimizer"]
    same_ranks = (saved_layout.tensor_model_parallel_size == layout.tensor_model_parallel_size
                  and saved_layout.pipeline_model_parallel_size
                  == layout.pipeline_model_parallel_size)
    if load_optimizer:
        _init_empty_optimizer_state(optimizer)
    state = _sharded_state(model, optimizer if load_optimizer else None, groups, is_loading=True)
    if same_ranks:
        state["rng"] = _rng_object(groups, _rng_state())
    # A TE model resumed from a checkpoint that lacks some of its `_extra_state` (one saved by
    # a local-spec run): each such module keeps its own, as in load_model_weights.
    stored = dist_checkpointing.serialization.load_sharded_metadata(directory)
    kept = _drop_missing_extra_state(state["model"], stored, directory)
    loaded = dist_checkpointing.load(state, directory)
    unwrap(model).load_state_dict(_with_kept_extra_state(unwrap(model), loaded["model"], kept))
    if load_optimizer:
        optimizer.load_state_dict(_with_own_param_groups(optimizer, loaded["optimizer"],
                                                         adam_step=loaded["trainer"]["step"]))
        scheduler.load_state_dict(loaded["scheduler"])
    if same_ranks:
        _set_rng_state(loaded["rng"])
    trainer = loaded["trainer"]
    return CheckpointState(step=trainer["step"], num_skipped_steps=trainer["num_skipped_steps"],
                           saved_layout=saved_layout,
                           extra_state=pickle.loads(trainer["extra_state"]),
                           rng_restored=same_ranks)


def _sharded_state(model, optimizer, groups: ParallelGroups, *, is_loading: bool) -> dict:
    # The GPTModel's own keys (no DDP / Float16Module prefixes): fp32 and bf16 runs share them.
    # A fresh metadata dict per call: Megatron caches process groups in it (dp_cp_group), which
    # would be stale after the layout changes.
    model_state = unwrap(model).sharded_state_dict(metadata=dict(_SHARDED_METADATA))
    state = {"model": model_state}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=dict(_SHARDED_METADATA))
    return state


def _with_own_param_groups(optimizer, loaded: dict, *, adam_step: int):
    """The loaded optimizer state with this optimizer's own param groups (and the saved step).

    The per-parameter state (fp32 params, exp_avg, exp_avg_sq) is sharded by parameter and
    reshards freely; the param groups are saved per chained optimizer, and the number of chained
    optimizers depends on the layout (expert parameters get their own optimizer only when EP > 1 or
    ETP != TP). Hyper-parameters come from the scheduler anyway, so the groups are rebuilt from
    this optimizer and only Adam's step count (for bias correction) is taken from the checkpoint.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", [optimizer])
    if not all(isinstance(opt, DistributedOptimizer) for opt in chained):
        return loaded  # the plain optimizers' state only loads at the layout it was saved at
    parts = [loaded[i] for i in range(len(chained))] if len(chained) > 1 else [loaded]
    for opt, part in zip(chained, parts):
        own = opt.state_dict()["optimizer"]
        for group in own["param_groups"]:
            group["step"] = adam_step
        part["optimizer"] = own
        part["param_state_sharding_type"] = _SHARDED_METADATA["distrib_optim_sharding_type"]
    return {i: part for i, part in enumerate(parts)} if len(chained) > 1 else parts[0]


def _init_empty_optimizer_state(optimizer) -> None:
    """Give a never-stepped optimizer the state tensors a checkpoint load copies into.

    Megatron builds the load targets from the optimizer's current state, which Adam creates
    lazily; Megatron's `init_state_fn` adds exp_avg / exp_avg_sq but not torch AdamW's per-parameter
    "step" (TE's FusedAdam keeps none), which the distributed optimizer's state_dict requires.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if any(len(inner.state[p]) for group in inner.param_groups for p in group["params"]):
            continue
        opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for param in group["params"]:
                if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
                    inner.state[param].setdefault("step", torch.tensor(0.0))


def _rng_object(groups: ParallelGroups, rng: dict):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    # One object per (pp, tp) coordinate; data- and context-parallel replicas hold the same seed
    # stream (one replica id each over dp x cp: two CP ranks with one id are duplicate keys).
    return ShardedObject("rng_state", rng, (groups.pp_size, groups.tp_size),
                         (groups.pp_rank, groups.tp_rank),
                         replica_id=groups.dp_rank * groups.cp_size + groups.cp_rank)


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    return {"random": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}


def _set_rng_state(rng: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(rng["random"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if rng["tracker"]:
        tensor_parallel.get_cuda_rng_tracker().set_states(rng["tracker"])


class CheckpointMismatchError(ValueError):
    """A checkpoint's model tensors do not fit the model (missing, or other shapes)."""


def load_model_weights(directory: str | os.PathLike, model) -> None:
    """Load a converted (megatron_rl/convert.py) or trainer-saved checkpoint's model weights
    into `model` in place: this rank's chunk at its TP/EP/PP layout, possibly wrapped (DDP,
    Float16Module); no optimizer state. Collective over the model-parallel ranks, like the
    trainer's load."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    directory = str(directory)
    if not os.path.isfile(os.path.join(directory, "metadata.json")):
        raise CheckpointMismatchError(f"{directory} is not a Megatron dist_checkpointing folder")
    module = unwrap(model)
    sharded = module.sharded_state_dict(metadata=dict(MODEL_SHARDED_METADATA))
    # Tensors and objects (load_tensors_metadata has the tensors only).
    stored = dist_checkpointing.serialization.load_sharded_metadata(directory)
    wanted = {entry.key: entry for entry in sharded.values()
              if isinstance(entry, (ShardedTensor, ShardedTensorFactory))}
    missing = sorted(set(wanted) - set(stored))
    if missing:
        raise CheckpointMismatchError(f"{directory} lacks model tensors: {', '.join(missing)} "
                                      "(was it converted from another model or size?)")
    mismatched = [f"{key}: checkpoint {tuple(stored[key].global_shape)} vs model "
                  f"{tuple(entry.global_shape)}" for key, entry in wanted.items()
                  if isinstance(entry, ShardedTensor)
                  and tuple(stored[key].global_shape) != tuple(entry.global_shape)]
    if mismatched:
        raise CheckpointMismatchError("checkpoint and model shapes differ: "
                                      + "; ".join(mismatched))
    kept = _drop_missing_extra_state(sharded, stored, directory)
    loaded = dist_checkpointing.load({"model": sharded}, directory)
    module.load_state_dict(_with_kept_extra_state(module, loaded["model"], kept))


# The suffix megatron-core gives the modules' `get_extra_state()` (transformer/utils.py
# make_sharded_tensors_for_checkpoint: saved as ShardedObjects).
_EXTRA_STATE = "_extra_state"


def _drop_missing_extra_state(sharded: dict, stored: dict, directory: str) -> list[str]:
    """Take out of `sharded` (a model's sharded state dict, changed in place) the `_extra_state`
    objects the checkpoint lacks, and return their state-dict keys; any other object it lacks is
    a CheckpointMismatchError. `stored`: the checkpoint's `load_sharded_metadata`.

    A model with Transformer Engine layers has objects that a checkpoint written from the local
    spec (megatron_rl/convert.py) cannot hold: TE's RMSNorm (pre_mlp_layernorm,
    final_layernorm), its linear layers and its attention (core_attention, and the backend
    module inside it) keep FP8 metadata as `_extra_state`, and Megatron's load planner refuses
    a state dict with keys the checkpoint lacks ("Missing key in checkpoint state_dict"). That
    state is what a module computes for itself (FP8 scaling history; TE starts it afresh), so a
    missing one keeps the module's own; a weight or any other object never does."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    missing = {key: entry for key, entry in sharded.items()
               if isinstance(entry, ShardedObject) and entry.unique_key not in stored}
    other = sorted(entry.key for key, entry in missing.items()
                   if not key.endswith(_EXTRA_STATE))
    if other:
        raise CheckpointMismatchError(f"{directory} lacks model objects: {', '.join(other)} "
                                      "(was it written from another model?)")
    for key in missing:
        del sharded[key]
    return sorted(missing)


def _with_kept_extra_state(module, state: dict, kept: list[str]) -> dict:
    """`state` with the module's own value for each `_extra_state` key the checkpoint lacked,
    so that the strict load still checks every other key."""
    if kept:
        own = module.state_dict()
        state.update({key: own[key] for key in kept})
    return state
