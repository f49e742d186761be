"""`RLTrainer`: one trainer rank's Megatron model, optimizer and RL train step, behind a small API.

Built from `TrainerSettings` (plain fields; `TrainerSettings.from_run_config` reads the sections of
megatron_rl.config's RunConfig), it starts the process groups for the layout, builds the model from
the models registry, and exposes `train_step(TrainBatch) -> StepMetrics`,
`save_checkpoint(dir, extra_state)` and `load_checkpoint(dir)`. A non-finite loss or gradient
skips the optimizer step (weights, optimizer state and schedule untouched) and is counted.

Colocated with the generators (`offload_between_steps`), the trainer holds only its parameters
between steps: the gradient buffers are freed (megatron-core's `offload_grad_buffers`) and the
Adam state and separate FP32 main copies go to the CPU (trainer/optimizer.py
`move_optimizer_state`) at construction and at the end of every step; they come back at the start
of the next step and around checkpoint saves and loads. Weight sync and scoring read the
parameters only.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch

from megatron_rl.algorithms.mismatch import MismatchCorrection
from megatron_rl.platform import collective_device, has_cuda
from megatron_rl.platform import device as platform_device
from megatron_rl.trainer.batch import (TrainBatch, pack_micro_batches, padding_micro_batch,
                                       sequence_pad_multiple, shard_for_data_parallel,
                                       split_for_context_parallel)
from megatron_rl.trainer.checkpoint import CheckpointState, load_checkpoint, save_checkpoint
from megatron_rl.trainer.model import build_model, precision_overrides, recompute_overrides
from megatron_rl.trainer.optimizer import (OptimizerSettings, build_optimizer,
                                           move_optimizer_state)
from megatron_rl.trainer.parallel import ParallelLayout, init_parallel
from megatron_rl.trainer.step import LossSettings, run_forward_backward

_DTYPE_TO_PRECISION = {"float32": "fp32", "bfloat16": "bf16"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerSettings:
    model_name: str = "llama4"
    model_size: str = "tiny"
    layout: ParallelLayout = ParallelLayout()
    precision: str = "bf16"  # fp32 | bf16
    fp8_recipe: str | None = None  # None | "delayed" | "current" | "mxfp8" (TE, GPU)
    use_transformer_engine: bool | None = None  # None: whenever TE is available
    loss: LossSettings = LossSettings()
    # rollout.temperature: the head scores softmax(logits / T), the distribution the generator
    # sampled from and recorded its log-probs of; at any other T every ratio rho is biased.
    temperature: float = 1.0
    # model.fp32_lm_head: the head's logits GEMM in FP32 (SCALERL.md section 6); False is the
    # ablation, the GEMM in the params dtype with the log-softmax and entropy still in FP32.
    fp32_lm_head: bool = True
    # rollout.routing_replay: MoE routers replay the generator's experts of batches that carry
    # them (trainer/routing_replay.py); False: they route freely and only the flips are counted.
    routing_replay: bool = True
    # rollout.routing_replay_compare: also score each routed batch once WITHOUT replay (forward
    # only, one more forward per step) for StepMetrics.logp_mismatch_without_replay.
    routing_replay_compare: bool = False
    optimizer: OptimizerSettings = OptimizerSettings()
    micro_batch_max_tokens: int = 16384
    seed: int = 1234
    checkpoint_format: str = "torch_dist"  # Megatron dist_checkpointing save backend
    # cluster.colocated: between steps (while the generators use the devices) free the gradient
    # buffers and move the optimizer state to the CPU, keeping only the parameters.
    offload_between_steps: bool = False
    # TransformerConfig fields on top of the family's (tests: smaller models, aux-loss off, ...).
    config_overrides: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_run_config(cls, run, **config_overrides: Any) -> "TrainerSettings":
        """From a megatron_rl.config RunConfig (sections model, parallelism, algorithm, train,
        optimizer; rollout.temperature, the sampling temperature the head must score at)."""
        algorithm, train, optim = run.algorithm, run.train, run.optimizer
        gspo = algorithm.loss == "gspo"
        return cls(
            model_name=run.model.name, model_size=run.model.size,
            layout=ParallelLayout.from_config(run.parallelism),
            precision=_DTYPE_TO_PRECISION[run.model.params_dtype],
            fp8_recipe=run.model.fp8,
            use_transformer_engine=run.model.use_transformer_engine,
            temperature=run.rollout.temperature,
            fp32_lm_head=run.model.fp32_lm_head,
            routing_replay=run.rollout.routing_replay,
            routing_replay_compare=run.rollout.routing_replay_compare,
            loss=LossSettings(
                kind=algorithm.loss, aggregation=algorithm.aggregation,
                eps_max=algorithm.eps_max,
                eps_low=algorithm.gspo_eps_low if gspo else algorithm.eps_low,
                eps_high=algorithm.gspo_eps_high if gspo else algorithm.eps_high,
                mismatch=_mismatch_correction(algorithm)),
            optimizer=OptimizerSettings(
                name=optim.name, lr=train.lr, lr_warmup_steps=train.lr_warmup_steps,
                lr_schedule=train.lr_schedule, min_lr=train.min_lr, num_steps=train.num_steps,
                clip_grad=train.clip_grad, weight_decay=optim.weight_decay,
                adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2,
                adam_eps=optim.adam_eps,
                use_distributed_optimizer=optim.use_distributed_optimizer),
            micro_batch_max_tokens=train.micro_batch_max_tokens, seed=run.seed,
            checkpoint_format=run.checkpoint.format,
            offload_between_steps=run.cluster.colocated,
            config_overrides={**recompute_overrides(train.recompute_granularity),
                              **config_overrides})


def _mismatch_correction(algorithm) -> MismatchCorrection:
    """The algorithm section's train / rollout mismatch corrections (config.AlgorithmConfig has
    checked them: windows both bounds or none, TIS not with CISPO)."""
    def window(low: float | None, high: float | None) -> tuple[float, float] | None:
        return None if low is None else (low, high)

    return MismatchCorrection(
        tis_cap=algorithm.tis_cap,
        sequence_window=window(algorithm.mismatch_sequence_low, algorithm.mismatch_sequence_high),
        token_window=window(algorithm.mismatch_token_low, algorithm.mismatch_token_high))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    """One optimizer step; token means are over the global batch's loss tokens."""

    step: int  # optimizer steps taken so far (skipped steps do not count)
    loss: float  # the aggregated RL loss (global)
    grad_norm: float  # before clipping; NaN when skipped or clipping is off
    clip_fraction: float  # fraction of loss tokens whose ratio hit a clip / truncation
    mean_ratio: float  # mean pi_train / pi_gen
    logp_mismatch: float  # mean |logp_train - logp_gen|
    logp_mismatch_max: float  # max |logp_train - logp_gen| over the step's loss tokens
    entropy: float  # mean policy entropy (FP32 head)
    num_loss_tokens: int
    num_tokens: int  # all non-padding positions processed (prompt + completion)
    num_micro_batches: int  # on this rank
    learning_rate: float
    skipped: bool  # non-finite loss or gradient: no update
    num_skipped_steps: int  # cumulative
    # Routing replay (MoE, batches carrying the generator's experts; NaN otherwise): fraction of
    # (token, layer) decisions where the trainer's own router chose other experts than the
    # generator (TensorBoard train/routing_flip_fraction), and with routing_replay_compare the
    # mean |logp_train - logp_gen| the same weights give without replay.
    routing_flip_fraction: float = math.nan
    logp_mismatch_without_replay: float = math.nan
    # offload_between_steps: device bytes released at the end of the step (gradient buffers,
    # and on a GPU the optimizer state moved to the CPU); 0 otherwise.
    offloaded_bytes: int = 0
    # Train / rollout mismatch (issue 40), TensorBoard train/mismatch/*: KL estimates, ratio
    # quantiles, shares masked (algorithms/mismatch.metrics_from_sums); empty without tokens.
    mismatch: dict[str, float] = dataclasses.field(default_factory=dict)


class RLTrainer:
    """One trainer rank. Every rank of the trainer world constructs it and calls its methods in
    the same order (they are collective)."""

    def __init__(self, settings: TrainerSettings, *, family=None):
        if family is None:
            from models import get_model_family

            family = get_model_family(settings.model_name)
        self.settings = settings
        self.layout = settings.layout
        self.groups = init_parallel(settings.layout, seed=settings.seed)
        precision = precision_overrides(
            settings.precision, fp8_recipe=settings.fp8_recipe,
            use_transformer_engine=settings.use_transformer_engine)
        overrides = dict(settings.config_overrides)
        if settings.routing_replay:
            overrides.setdefault("moe_enable_routing_replay", True)
        self.model, self.config = build_model(
            family, settings.model_size, settings.layout, self.groups, precision=precision,
            use_distributed_optimizer=settings.optimizer.use_distributed_optimizer,
            config_overrides=overrides)
        self.routing_replay = None
        self._async_saves = None  # Megatron's AsyncCallsQueue, from the first async save
        if self.config.num_moe_experts:
            from megatron_rl.trainer.routing_replay import RoutingReplay

            self.routing_replay = RoutingReplay(self.model, self.config,
                                                tp_rank=self.groups.tp_rank,
                                                tp_size=self.groups.tp_size)
        self.optimizer, self.scheduler = build_optimizer(
            [self.model], settings.optimizer, bf16=self.config.bf16,
            params_dtype=self.config.params_dtype)
        self.step = 0
        self.num_skipped_steps = 0
        self._offloaded = False
        if settings.offload_between_steps:
            self.offload_training_state()

    @property
    def pad_to_multiple(self) -> int:
        """The multiple micro-batch lengths are padded to (batch.sequence_pad_multiple): the
        sequence-parallel and context-parallel splits, and FP8's token alignment."""
        return sequence_pad_multiple(
            tensor_parallel_size=self.groups.tp_size if self.layout.sequence_parallel else 1,
            context_parallel_size=self.groups.cp_size, fp8_recipe=self.settings.fp8_recipe)

    def micro_batches(self, batch: TrainBatch) -> list:
        """This rank's micro-batches; every data-parallel and context-parallel rank gets the same
        number. Under CP all ranks of a CP group pack the same completions (they share the
        data-parallel rank) and each keeps its load-balanced slice of every micro-batch."""
        indices = shard_for_data_parallel(batch, self.groups.dp_rank, self.groups.dp_size)
        micro_batches = pack_micro_batches(batch, indices,
                                           max_tokens=self.settings.micro_batch_max_tokens,
                                           pad_to_multiple=self.pad_to_multiple)
        count = torch.tensor(len(micro_batches), device=collective_device())
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX,
                                     group=self.groups.data_group)
        micro_batches += [padding_micro_batch(self.pad_to_multiple)
                          for _ in range(int(count) - len(micro_batches))]
        return [split_for_context_parallel(m, self.groups.cp_rank, self.groups.cp_size)
                for m in micro_batches]

    def replay_mode(self, batch: TrainBatch, replay: bool | None = None) -> str | None:
        """How the routers treat `batch`: "replay" the generator's experts, "observe" (route
        freely, count flips), or None (no MoE or no routing carried). `replay` None: the
        settings' routing_replay."""
        from megatron_rl.trainer.routing_replay import OBSERVE, REPLAY

        if self.routing_replay is None or batch.routed_experts is None:
            return None
        return REPLAY if (self.settings.routing_replay if replay is None else replay) \
            else OBSERVE

    def score(self, batch: TrainBatch, *, replay: bool | None = None):
        """Forward only (no update): the step's log-prob statistics against the generator's
        (trainer/step.ForwardBackwardResult), with or without routing replay."""
        from megatron_rl.algorithms import AggregationDenominators

        denominators = AggregationDenominators.from_sample_token_counts(
            batch.sample_num_loss_tokens(), batch.prompt_of_sample())
        self.model.eval()
        with torch.no_grad():
            return run_forward_backward(
                self.model, self.micro_batches(batch), self.groups, denominators,
                self.settings.loss, temperature=self.settings.temperature,
                fp32_lm_head=self.settings.fp32_lm_head, forward_only=True,
                routing_replay=self.routing_replay, replay_mode=self.replay_mode(batch, replay))

    def train_step(self, batch: TrainBatch) -> StepMetrics:
        from megatron_rl.algorithms import AggregationDenominators

        without_replay = math.nan
        if self.settings.routing_replay_compare and self.replay_mode(batch) is not None:
            free = self.score(batch, replay=False)
            without_replay = free.abs_logp_diff_sum / max(free.num_loss_tokens, 1)
        denominators = AggregationDenominators.from_sample_token_counts(
            batch.sample_num_loss_tokens(), batch.prompt_of_sample())
        micro_batches = self.micro_batches(batch)
        self.reload_training_state()
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        result = run_forward_backward(self.model, micro_batches, self.groups, denominators,
                                      self.settings.loss, temperature=self.settings.temperature,
                                      fp32_lm_head=self.settings.fp32_lm_head,
                                      routing_replay=self.routing_replay,
                                      replay_mode=self.replay_mode(batch))
        finite = math.isfinite(result.loss) and self._grads_finite()
        grad_norm = math.nan
        if finite:
            # Advance the schedule first: update k (1-based) uses lr * k / warm-up steps.
            self.scheduler.step(increment=1)
            _, norm, _ = self.optimizer.step()
            grad_norm = float(norm) if norm is not None and self.settings.optimizer.clip_grad \
                else math.nan
            self.step += 1
        else:
            self.num_skipped_steps += 1
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        offloaded = self.offload_training_state() if self.settings.offload_between_steps else 0
        tokens = max(result.num_loss_tokens, 1)
        return StepMetrics(
            step=self.step, loss=result.loss, grad_norm=grad_norm,
            clip_fraction=result.num_clipped / tokens, mean_ratio=result.ratio_sum / tokens,
            logp_mismatch=result.abs_logp_diff_sum / tokens,
            logp_mismatch_max=result.abs_logp_diff_max, entropy=result.entropy_sum / tokens,
            num_loss_tokens=result.num_loss_tokens, num_tokens=result.num_tokens,
            num_micro_batches=len(micro_batches),
            learning_rate=self.optimizer.param_groups[0]["lr"], skipped=not finite,
            num_skipped_steps=self.num_skipped_steps,
            routing_flip_fraction=(result.num_routing_flips / result.num_routing_decisions
                                   if result.num_routing_decisions else math.nan),
            logp_mismatch_without_replay=without_replay, offloaded_bytes=offloaded,
            mismatch=result.mismatch)

    def offload_training_state(self) -> int:
        """Free what only a training step needs: the gradient buffers (their storage released,
        the views kept: megatron-core's `offload_grad_buffers`) and, to the CPU, the Adam state
        and the FP32 main copies that are separate tensors. Returns the device bytes released
        (on the CPU only the gradient buffers'; moving CPU tensors to the CPU is nothing).
        Parameters stay. Local to the rank; a no-op when already offloaded."""
        if self._offloaded:
            return 0
        # No main parameter's .grad may keep pointing into a freed buffer.
        self.optimizer.zero_grad()
        buffers = self.model.buffers + self.model.expert_parallel_buffers
        freed = sum(b.grad_data.untyped_storage().nbytes() for b in buffers)
        self.model.offload_grad_buffers(synchronize=has_cuda(), empty_cache=False)
        freed += move_optimizer_state(self.optimizer, [self.model], torch.device("cpu"))
        if has_cuda():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()  # the freed blocks back to the device for the engines
        self._offloaded = True
        return freed

    def reload_training_state(self) -> None:
        """Undo `offload_training_state`: the gradient buffers reallocated (zeroed) and the
        optimizer state back on the device. A no-op when nothing is offloaded."""
        if not self._offloaded:
            return
        self.model.restore_grad_buffers(synchronize=False)
        move_optimizer_state(self.optimizer, [self.model], platform_device())
        if has_cuda():
            torch.cuda.synchronize()
        self._offloaded = False

    @contextlib.contextmanager
    def _training_state(self):
        """The whole training state on the device for the body (checkpoints read and write the
        optimizer state); offloaded again after it when offloading between steps."""
        self.reload_training_state()
        try:
            yield
        finally:
            if self.settings.offload_between_steps:
                self.offload_training_state()

    def _grads_finite(self) -> bool:
        """All ranks agree whether any gradient (any bucket, any rank) is NaN or inf."""
        bad = torch.zeros(1, device=collective_device())
        for buffer in self.model.buffers + self.model.expert_parallel_buffers:
            bad = torch.maximum(bad, (~torch.isfinite(buffer.grad_data)).any().to(bad))
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
        return not bool(bad.item())

    def save_checkpoint(self, directory: str, extra_state: dict[str, Any] | None = None, *,
                        async_save: bool = False) -> bool:
        """Collective. `async_save` (CUDA only): return once the tensors are staged, the files
        being written in the background until `finalize_checkpoints` says they are complete.
        Returns whether the save is asynchronous."""
        with self._training_state():  # async: the tensors are staged before it returns
            request = save_checkpoint(
                directory, self.model, self.optimizer, self.scheduler, layout=self.layout,
                groups=self.groups, step=self.step, num_skipped_steps=self.num_skipped_steps,
                extra_state=extra_state, checkpoint_format=self.settings.checkpoint_format,
                async_save=async_save)
        if request is None:
            return False
        if self._async_saves is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._async_saves = AsyncCallsQueue()
        self._async_saves.schedule_async_request(request)
        return True

    def finalize_checkpoints(self, *, blocking: bool) -> bool:
        """Finish the asynchronous saves whose writes are done on every rank (collective; with
        `blocking`, wait for all). Returns whether none is left in flight."""
        if self._async_saves is None:
            return True
        self._async_saves.maybe_finalize_async_calls(blocking=blocking)
        return self._async_saves.get_num_unfinalized_calls() == 0

    def load_model_weights(self, directory: str) -> None:
        """Start from the weights of a converted (HF -> Megatron, megatron_rl.convert) or
        trainer-saved checkpoint, without its optimizer state (model.hf_checkpoint at step 0);
        the optimizer's main (FP32) copies are refreshed from them. Collective."""
        from megatron_rl.trainer.checkpoint import load_model_weights

        with self._training_state():
            load_model_weights(directory, self.model)
            self.optimizer.reload_model_params()

    def load_checkpoint(self, directory: str, *, load_optimizer: bool = True) -> CheckpointState:
        with self._training_state():
            state = load_checkpoint(directory, self.model, self.optimizer, self.scheduler,
                                    layout=self.layout, groups=self.groups,
                                    load_optimizer=load_optimizer)
        self.step, self.num_skipped_steps = state.step, state.num_skipped_steps
        return state
