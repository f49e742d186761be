"""The RLVR cost model and `megatron-rl cost`: FLOPs, device-time, the generator:trainer split.

Per optimizer step, with N = active parameters (MoE) and S = prompts x samples completions:
- FLOPs: 2N per generated (decode) and per prefilled token, 6N per trained token (forward +
  backward over the whole final sequence), +2N per trained token for a reference model.
  Attention FLOPs are ignored (the usual 2N / 6N approximation).
- Multi-turn prefill: without prefix caching, turn k re-reads the whole history, so a sample of
  T turns of g generated tokens each, prompt P and O observation tokens per later turn prefills
  sum_k [P + (k-1)(g+O)] = T*P + (g+O)*T(T-1)/2 tokens; the rule of thumb total ~= decode x (1 +
  T/2) is this with P = O = 0 and T(T-1)/2 rounded up to T^2/2.
- Decode is bandwidth-bound: each decode step of a generator instance reads the weights (for MoE,
  the experts touched by the batch under uniform top-k routing) plus the KV cache of every running
  sequence, at `decode_bandwidth_efficiency` of peak HBM bandwidth; the step is compute-bound
  only if 2N x batch at `decode_mfu` takes longer. On top of that roofline every decode step pays
  a fixed cost per layer (kernel launches, MoE routing, scheduling) and, when the engine spans
  several devices, a per-layer TP all-reduce cost: `decode_layer_overhead_us` and
  `decode_tp_layer_overhead_us`, fitted once to SGLang's published batch-1 decode speeds
  (benchmarks/decode_floor_fit.py; docs/simulation.md, "Calibration"). The batch is SGLang's
  max_running_requests, capped by the KV memory left after the weights. Prefill and training
  are MFU-bound.
- Training stops scaling with devices: a trainer device's share of an optimizer step is at
  least `train_min_tokens_per_device` tokens' worth of time, so a step over D devices takes
  6N x max(tokens / (optimizer steps x D), that floor) x optimizer steps at `train_mfu`; past
  tokens per optimizer step / floor devices, more trainers do not shorten it. Fitted once to
  verl's update_actor at 16-128 H20s (benchmarks/trainer_floor_fit.py; docs/simulation.md,
  "Calibration").
- Balance: Pipeline-RL keeps generators and trainers busy concurrently, so the device split that
  balances the pipeline is generator device-seconds : trainer device-seconds per step, and the
  GPU-hours per step are their sum. Synchronous RL (pipeline_rl=False) waits for the longest
  completion each step: decode time is multiplied by the long-tail factor (p99 / median length).
- Memory: the minimum devices hold the trainer's policy with its optimizer states (18 bytes/param
  for bf16 weights + fp32 grads, master weights and Adam moments), a reference model if any, and
  one generator instance, each times an overhead factor (activations, buffers, fragmentation).
Every knob is a field of `CostConfig` with a documented default and a `--flag` of the command.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import typing
from typing import Any

from megatron_rl.scaling.hardware import ACCELERATORS, PRECISIONS, Accelerator, get_accelerator

# Paper section 2 / 7: 80 GPUs = 64 generators + 16 trainers; at production scale ~6 generator
# devices per trainer device. Printed next to the model's ratio for comparison.
PAPER_LAYOUT = (64, 16)
RULE_OF_THUMB_RATIO = 6.0
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0}


def _knob(default: Any, help_: str) -> Any:
    return dataclasses.field(default=default, metadata={"help": help_})


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CostConfig:
    """Inputs of the cost model. Defaults: the paper's 8B dense setup on H100s (SCALERL.md 2, 7)."""

    # model
    total_params: float = _knob(8.03e9, "total parameters (all experts)")
    active_params: float = _knob(0.0, "parameters active per token (MoE); 0 = dense (= total)")
    num_experts: int = _knob(0, "routed experts per MoE layer; 0 = dense model")
    experts_per_token: int = _knob(1, "routed experts per token (top-k)")
    num_layers: int = _knob(32, "transformer layers (KV-cache size)")
    num_kv_heads: int = _knob(8, "key/value heads (GQA)")
    head_dim: int = _knob(128, "attention head dimension")
    # workload per optimizer step
    num_prompts_per_step: int = _knob(48, "prompts per optimizer step (paper: 48)")
    samples_per_prompt: int = _knob(16, "completions per prompt (paper: 16)")
    prompt_tokens: int = _knob(512, "mean prompt length in tokens")
    generated_tokens: int = _knob(12000, "mean generated tokens per completion, all turns")
    num_turns: int = _knob(1, "turns per completion (multi-turn / tool use)")
    observation_tokens: int = _knob(0, "tokens appended by the environment before each later turn")
    prefix_caching: bool = _knob(False, "prefill reuses cached history (else turn k re-reads it)")
    long_tail_factor: float = _knob(2.0, "p99 / median completion length")
    pipeline_rl: bool = _knob(True, "asynchronous Pipeline-RL (else synchronous: wait for the "
                                    "longest completion, decode time x long_tail_factor)")
    num_steps: int = _knob(1000, "optimizer steps in the run")
    # hardware and efficiency
    hardware: str = _knob("H100", f"accelerator: {', '.join(ACCELERATORS)}")
    generator_precision: str = _knob("bf16", f"generator weights/compute: {PRECISIONS}")
    train_precision: str = _knob("bf16", f"trainer compute: {PRECISIONS}")
    kv_cache_bytes: float = _knob(2.0, "bytes per KV-cache element (bf16 = 2, fp8 = 1)")
    generator_devices_per_instance: int = _knob(
        0, "devices per generator engine (TP/EP); 0 = smallest power of 2 where weights use "
           "<= half the memory")
    max_running_requests: int = _knob(256, "decode batch per generator engine (SGLang's "
                                           "max_running_requests), capped by KV memory")
    mem_fraction_static: float = _knob(0.85, "generator memory fraction for weights + KV "
                                             "(SGLang's mem_fraction_static)")
    decode_bandwidth_efficiency: float = _knob(0.6, "achieved fraction of peak HBM bandwidth "
                                                    "in decode")
    decode_mfu: float = _knob(0.5, "achieved fraction of peak FLOP/s if decode is compute-bound")
    # Fitted by benchmarks/decode_floor_fit.py (least squares over ANCHOR_FIGURES section 19's
    # SGLang batch-1 rows on H20); rerun it and paste its output here if the roofline changes.
    decode_layer_overhead_us: float = _knob(
        99.1, "fixed cost of one decode step per layer (kernel launches, routing, scheduling), "
             "microseconds; fitted to SGLang batch-1 decode")
    decode_tp_layer_overhead_us: float = _knob(
        21.7, "added per layer and decode step when the engine spans > 1 device (TP "
             "all-reduces), microseconds; same fit")
    prefill_mfu: float = _knob(0.5, "achieved fraction of peak FLOP/s in prefill")
    train_mfu: float = _knob(0.4, "achieved fraction of peak FLOP/s in training (MFU)")
    optimizer_steps_per_step: int = _knob(
        1, "optimizer steps one step's batch is split into (ScaleRL and this project: 1; verl: "
           "train_batch / ppo_mini_batch; NeMo-RL: samples / train_global_batch_size)")
    # Fitted by benchmarks/trainer_floor_fit.py (verl's update_actor, ANCHOR_FIGURES section 1);
    # rerun it and paste its output here if the training formula changes.
    train_min_tokens_per_device: float = _knob(
        9216.0, "fewest trained tokens a trainer device's share of an optimizer step counts "
                "as: with fewer (more devices on the same batch) a step takes as long as with "
                "this many, the trainer stops scaling; fitted to verl's update_actor at 16-128 "
                "H20s; 0 = linear in devices")
    trainer_bytes_per_param: float = _knob(
        18.0, "trainer bytes per parameter: bf16 weights 2 + fp32 grads 4 + fp32 master 4 + "
              "Adam moments 8")
    reference_model: bool = _knob(False, "a frozen reference model (KL) on the trainers "
                                         "(ScaleRL: none)")
    memory_overhead_factor: float = _knob(1.2, "multiplier on model-copy memory for "
                                               "activations, buffers, fragmentation")
    weight_sync_seconds: float = _knob(0.0, "seconds per step all devices wait for the "
                                            "weight push (layout only)")
    total_devices: int = _knob(0, "devices available; >0 prints the best generator/trainer "
                                  "split of them")

    def __post_init__(self) -> None:
        positive = ("total_params", "num_layers", "num_kv_heads", "head_dim",
                    "num_prompts_per_step", "samples_per_prompt", "generated_tokens", "num_turns",
                    "num_steps", "kv_cache_bytes", "max_running_requests",
                    "trainer_bytes_per_param")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        for name in ("active_params", "num_experts", "prompt_tokens", "observation_tokens",
                     "generator_devices_per_instance", "weight_sync_seconds", "total_devices",
                     "decode_layer_overhead_us", "decode_tp_layer_overhead_us",
                     "train_min_tokens_per_device"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("mem_fraction_static", "decode_bandwidth_efficiency", "decode_mfu",
                     "prefill_mfu", "train_mfu"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in (0, 1]")
        if self.active_params > self.total_params:
            raise ValueError(f"active_params={self.active_params:g} exceeds "
                             f"total_params={self.total_params:g}")
        if self.num_experts and not 0 < self.experts_per_token < self.num_experts:
            raise ValueError(f"experts_per_token={self.experts_per_token} must be in "
                             f"[1, num_experts={self.num_experts})")
        if self.num_experts and not self.active_params:
            raise ValueError("an MoE model (num_experts > 0) needs active_params")
        if self.long_tail_factor < 1.0:
            raise ValueError(f"long_tail_factor={self.long_tail_factor} is p99/median; >= 1")
        if self.memory_overhead_factor < 1.0:
            raise ValueError(f"memory_overhead_factor={self.memory_overhead_factor} must be >= 1")
        get_accelerator(self.hardware)
        for name in ("generator_precision", "train_precision"):
            if getattr(self, name) not in PRECISIONS:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {PRECISIONS}")

    @property
    def num_active_params(self) -> float:
        return self.active_params or self.total_params


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TokenCounts:
    """Per-completion token counts (means)."""

    decode: float  # generated tokens, all turns
    prefill: float  # tokens processed by prefill, all turns (exact sum)
    trained: float  # tokens of the final sequence the trainer runs forward + backward
    rule_of_thumb_total: float  # decode x (1 + turns / 2)
    mean_decode_context: float  # mean KV length a decode step attends to


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    """The best split of `total_devices` into generator engines and trainers."""

    num_generator_devices: int
    num_trainer_devices: int
    step_seconds: float
    gpu_hours_per_step: float  # includes idle time from imbalance and weight sync

    @property
    def ratio(self) -> float:
        return self.num_generator_devices / self.num_trainer_devices


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CostReport:
    config: CostConfig
    accelerator: Accelerator
    num_samples: int
    tokens: TokenCounts
    decode_flops: float  # per step
    prefill_flops: float
    train_flops: float
    generator_devices_per_instance: int
    decode_batch: int  # sequences decoded together per engine
    decode_batch_memory_cap: int  # what the KV memory allows
    experts_touched_fraction: float  # of the routed experts, per decode step (1 for dense)
    decode_step_seconds: float
    decode_bound: str  # "memory" or "compute"
    decode_device_seconds: float  # per optimizer step, summed over devices
    prefill_device_seconds: float
    train_device_seconds: float
    min_trainer_devices: int
    min_generator_devices: int  # one engine
    layout: Layout | None

    @property
    def generator_device_seconds(self) -> float:
        return self.decode_device_seconds + self.prefill_device_seconds

    @property
    def generator_to_trainer_ratio(self) -> float:
        return self.generator_device_seconds / self.train_device_seconds

    @property
    def gpu_hours_per_step(self) -> float:
        """Balanced pipeline: every device busy, so device-time is the cost."""
        return (self.generator_device_seconds + self.train_device_seconds) / 3600.0

    @property
    def gpu_hours_per_run(self) -> float:
        return self.gpu_hours_per_step * self.config.num_steps

    @property
    def decode_tokens_per_second_per_device(self) -> float:
        return self.decode_batch / (self.decode_step_seconds * self.generator_devices_per_instance)

    @property
    def min_devices(self) -> int:
        return self.min_trainer_devices + self.min_generator_devices

    def train_seconds(self, num_devices: int) -> float:
        """A step's training on `num_devices` trainer devices (cost.train_seconds)."""
        return train_seconds(self.config, self.accelerator, self.num_samples * self.tokens.trained,
                             num_devices)

    def split_step_seconds(self, num_generator_devices: int, num_trainer_devices: int) -> float:
        """The step on one split: the slower of generation over its devices and training over
        its own, plus the weight sync all devices wait for."""
        return max(self.generator_device_seconds / num_generator_devices,
                   self.train_seconds(num_trainer_devices)) + self.config.weight_sync_seconds

    @property
    def trainer_scaling_limit(self) -> int:
        """Trainer devices past which a step trains no faster (its floor); 0 = no floor."""
        floor = self.config.train_min_tokens_per_device
        if not floor:
            return 0
        return _ceil(self.num_samples * self.tokens.trained
                     / (self.config.optimizer_steps_per_step * floor))


def token_counts(config: CostConfig) -> TokenCounts:
    """Per-completion decode / prefill / trained tokens, with the exact multi-turn prefill sum."""
    turns, prompt, obs = config.num_turns, config.prompt_tokens, config.observation_tokens
    decode = float(config.generated_tokens)
    per_turn = decode / turns
    if config.prefix_caching:
        # The prompt is prefilled once per group, then only the new observation tokens.
        prefill = prompt / config.samples_per_prompt + (turns - 1) * obs
    else:
        prefill = turns * prompt + (per_turn + obs) * turns * (turns - 1) / 2
    # Decode at turn k starts from a context of P + (k-1)(g+O) and grows by g: mean over turns.
    mean_context = prompt + (turns - 1) * (per_turn + obs) / 2 + per_turn / 2
    return TokenCounts(decode=decode, prefill=prefill, trained=prompt + decode + (turns - 1) * obs,
                       rule_of_thumb_total=decode * (1 + turns / 2),
                       mean_decode_context=mean_context)


def estimate_cost(config: CostConfig) -> CostReport:
    accelerator = get_accelerator(config.hardware)
    tokens = token_counts(config)
    num_samples = config.num_prompts_per_step * config.samples_per_prompt
    n_active = config.num_active_params
    decode_flops = 2.0 * n_active * tokens.decode * num_samples
    prefill_flops = 2.0 * n_active * tokens.prefill * num_samples
    train_flops = train_flops_per_token(config) * tokens.trained * num_samples

    weight_bytes = generator_weight_bytes(config)
    min_generator = _ceil(weight_bytes * config.memory_overhead_factor
                          / (accelerator.memory_bytes * config.mem_fraction_static))
    engine = config.generator_devices_per_instance or _auto_engine_size(config, accelerator,
                                                                        weight_bytes)
    if engine < min_generator:
        raise ValueError(f"generator_devices_per_instance={engine} cannot hold the weights "
                         f"({weight_bytes / 1e9:.0f} GB x {config.memory_overhead_factor}); "
                         f"use >= {min_generator}")
    decode = _decode(config, accelerator, tokens, engine, weight_bytes)
    decode_device_seconds = num_samples * tokens.decode / decode["batch"] \
        * decode["step_seconds"] * engine
    if not config.pipeline_rl:
        decode_device_seconds *= config.long_tail_factor
    prefill_device_seconds = compute_seconds(prefill_flops, accelerator,
                                             config.generator_precision, config.prefill_mfu)
    train_device_seconds = compute_seconds(train_flops, accelerator, config.train_precision,
                                           config.train_mfu)
    trainer_bytes = config.total_params * (config.trainer_bytes_per_param
                                           + (2.0 if config.reference_model else 0.0))
    min_trainer = _ceil(trainer_bytes * config.memory_overhead_factor / accelerator.memory_bytes)
    report = CostReport(
        config=config, accelerator=accelerator, num_samples=num_samples, tokens=tokens,
        decode_flops=decode_flops, prefill_flops=prefill_flops, train_flops=train_flops,
        generator_devices_per_instance=engine, decode_batch=decode["batch"],
        decode_batch_memory_cap=decode["batch_cap"],
        experts_touched_fraction=decode["experts_touched"],
        decode_step_seconds=decode["step_seconds"], decode_bound=decode["bound"],
        decode_device_seconds=decode_device_seconds,
        prefill_device_seconds=prefill_device_seconds, train_device_seconds=train_device_seconds,
        min_trainer_devices=min_trainer, min_generator_devices=min_generator, layout=None)
    if config.total_devices:
        report = dataclasses.replace(report, layout=best_layout(report))
    return report


def _ceil(value: float) -> int:
    return max(1, math.ceil(value - 1e-9))


def _auto_engine_size(config: CostConfig, accelerator: Accelerator, weight_bytes: float) -> int:
    # Smallest power of two where the weights take at most half of the usable memory, leaving
    # the other half for the KV cache (decode throughput is bounded by the batch the KV fits).
    usable = accelerator.memory_bytes * config.mem_fraction_static
    size = 1
    while weight_bytes * config.memory_overhead_factor > 0.5 * size * usable:
        size *= 2
    return size


# The formulas below are shared with the simulator (megatron_rl/simulation): its engines and
# trainer take their step times from them, so `megatron-rl cost` and `megatron-rl simulate`
# cannot disagree on a figure both compute.

def compute_seconds(flops: float, accelerator: Accelerator, precision: str, mfu: float,
                    num_devices: int = 1) -> float:
    """Seconds for `flops` of MFU-bound work (prefill, training) on `num_devices` devices."""
    return flops / (num_devices * accelerator.peak_flops(precision) * mfu)


def train_seconds(config: CostConfig, accelerator: Accelerator, num_tokens: float,
                  num_devices: int, *, flops_per_token: float | None = None) -> float:
    """Seconds for `num_devices` trainer devices to run `num_tokens` tokens at
    `flops_per_token` (default: training's, train_flops_per_token) in the config's optimizer
    steps, each device's share of an optimizer step counted as at least
    train_min_tokens_per_device tokens: strong scaling stops there."""
    if flops_per_token is None:
        flops_per_token = train_flops_per_token(config)
    steps = config.optimizer_steps_per_step
    per_device = max(num_tokens / (steps * num_devices), config.train_min_tokens_per_device)
    return compute_seconds(flops_per_token * per_device * steps, accelerator,
                           config.train_precision, config.train_mfu)


def train_flops_per_token(config: CostConfig) -> float:
    """6N per trained token (forward + backward), +2N for a reference model's forward."""
    return (6.0 + (2.0 if config.reference_model else 0.0)) * config.num_active_params


def generator_weight_bytes(config: CostConfig) -> float:
    """Bytes of one generator copy of the weights (also what a weight push sends)."""
    return config.total_params * WEIGHT_BYTES[config.generator_precision]


def kv_bytes_per_token(config: CostConfig) -> float:
    """KV-cache bytes of one token: K and V, every layer."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * config.kv_cache_bytes


def kv_free_bytes(config: CostConfig, accelerator: Accelerator, engine: int) -> float:
    """KV-cache memory of one engine of `engine` devices: the static memory fraction less the
    weights (with their overhead factor)."""
    return engine * accelerator.memory_bytes * config.mem_fraction_static \
        - generator_weight_bytes(config) * config.memory_overhead_factor


def decode_overhead_seconds(config: CostConfig, engine: int) -> float:
    """The fixed cost of one decode step that the roofline lacks: num_layers x (the per-layer
    overhead + the TP all-reduce term when the engine spans more than one device). Independent
    of batch and context: the fit (benchmarks/decode_floor_fit.py) has batch-1 rows only."""
    per_layer_us = config.decode_layer_overhead_us \
        + (config.decode_tp_layer_overhead_us if engine > 1 else 0.0)
    return config.num_layers * per_layer_us * 1e-6


def decode_step(config: CostConfig, accelerator: Accelerator, engine: int, batch: int,
                context_tokens: float) -> tuple[float, str, float]:
    """(seconds, "memory" | "compute", experts touched fraction) of one decode step of an engine
    of `engine` devices running `batch` sequences whose KV caches hold `context_tokens` tokens
    in all: the weights read (for MoE, the experts the batch touches under uniform top-k
    routing) plus every sequence's KV, at decode_bandwidth_efficiency of peak HBM bandwidth;
    compute-bound only if 2N x batch at decode_mfu takes longer; plus the step's fixed cost
    (decode_overhead_seconds). The bound names the larger roofline term."""
    experts_touched = 1.0
    weights_read = generator_weight_bytes(config)
    if config.num_experts:
        # Uniform top-k routing: an expert is idle in a step only if no token of the batch picks it.
        experts_touched = 1.0 - (1.0 - config.experts_per_token / config.num_experts) ** batch
        expert_each = (config.total_params - config.active_params) \
            / (config.num_experts - config.experts_per_token)
        shared = config.total_params - config.num_experts * expert_each
        weights_read = (shared + config.num_experts * expert_each * experts_touched) \
            * WEIGHT_BYTES[config.generator_precision]
    step_bytes = weights_read + kv_bytes_per_token(config) * context_tokens
    memory_seconds = step_bytes / (engine * accelerator.hbm_bytes_per_s
                                   * config.decode_bandwidth_efficiency)
    compute_seconds_ = 2.0 * config.num_active_params * batch / (
        engine * accelerator.peak_flops(config.generator_precision) * config.decode_mfu)
    return (max(memory_seconds, compute_seconds_) + decode_overhead_seconds(config, engine),
            "memory" if memory_seconds >= compute_seconds_ else "compute", experts_touched)


def _decode(config: CostConfig, accelerator: Accelerator, tokens: TokenCounts, engine: int,
            weight_bytes: float) -> dict[str, Any]:
    """Batch, step time and bound of one generator engine in steady-state continuous batching."""
    kv_bytes_per_sequence = kv_bytes_per_token(config) * tokens.mean_decode_context
    batch_cap = int(kv_free_bytes(config, accelerator, engine) // kv_bytes_per_sequence)
    if batch_cap < 1:
        raise ValueError(f"no KV memory left for a single sequence of "
                         f"{tokens.mean_decode_context:.0f} tokens on {engine} device(s); raise "
                         "generator_devices_per_instance")
    batch = min(config.max_running_requests, batch_cap)
    step_seconds, bound, experts_touched = decode_step(
        config, accelerator, engine, batch, batch * tokens.mean_decode_context)
    return {"batch": batch, "batch_cap": batch_cap, "experts_touched": experts_touched,
            "step_seconds": step_seconds, "bound": bound}


def best_layout(report: CostReport) -> Layout:
    """Whole generator engines + trainers summing to total_devices, minimising the step time."""
    config, engine = report.config, report.generator_devices_per_instance
    best: Layout | None = None
    for num_generators in range(engine, config.total_devices, engine):
        num_trainers = config.total_devices - num_generators
        if num_trainers < report.min_trainer_devices:
            break
        step = report.split_step_seconds(num_generators, num_trainers)
        if best is None or step < best.step_seconds:
            best = Layout(num_generator_devices=num_generators, num_trainer_devices=num_trainers,
                          step_seconds=step,
                          gpu_hours_per_step=config.total_devices * step / 3600.0)
    if best is None:
        raise ValueError(f"total_devices={config.total_devices} is too few: one generator engine "
                         f"needs {engine} and the trainer >= {report.min_trainer_devices}")
    return best


# Presets named in the issue: the paper's 8B dense setup and Llama-4 Scout on GB200.
PRESETS: dict[str, CostConfig] = {
    # Llama-3.1-8B shape (32 layers, 8 KV heads x 128); 48 x 16 = 768 completions, ~12k generated
    # tokens each, H100-class GPUs, the paper's 80-GPU run.
    "paper-8b": CostConfig(total_devices=80),
    # Llama-4 Scout: 109B total / 17B active, 16 routed experts (top-1) + a shared expert,
    # 48 layers, 8 KV heads x 128; one GB200 NVL72 rack. MoE training reaches lower MFU.
    "scout-gb200": CostConfig(total_params=109e9, active_params=17e9, num_experts=16,
                              experts_per_token=1, num_layers=48, hardware="GB200",
                              train_mfu=0.3, total_devices=72),
}


def report_rows(report: CostReport) -> list[tuple[str, str, str]]:
    """(quantity, value, note) rows of the printed table; section headers have empty values."""
    c, t = report.config, report.tokens
    gen_s, train_s = report.generator_device_seconds, report.train_device_seconds
    rows = [
        ("workload", "", ""),
        ("completions per step", f"{report.num_samples}",
         f"{c.num_prompts_per_step} prompts x {c.samples_per_prompt}"),
        ("active / total params", f"{c.num_active_params / 1e9:.3g}B / {c.total_params / 1e9:.3g}B",
         "MoE" if c.num_experts else "dense"),
        ("tokens per completion: decode", f"{t.decode:,.0f}", f"{c.num_turns} turn(s)"),
        ("  prefill (exact sum)", f"{t.prefill:,.0f}",
         "prefix cache" if c.prefix_caching else "turn k re-reads the history"),
        ("  decode + prefill vs rule of thumb", f"{t.decode + t.prefill:,.0f} vs "
         f"{t.rule_of_thumb_total:,.0f}", f"decode x (1 + turns/2); ratio "
         f"{(t.decode + t.prefill) / t.rule_of_thumb_total:.3f}"),
        ("  trained", f"{t.trained:,.0f}", "final sequence, forward + backward"),
        ("FLOPs per step", "", ""),
        ("decode (2N/token)", f"{report.decode_flops:.3e}", ""),
        ("prefill (2N/token)", f"{report.prefill_flops:.3e}", ""),
        ("training (6N/token)", f"{report.train_flops:.3e}",
         "+2N reference" if c.reference_model else ""),
        (f"generation on {c.hardware}", "", ""),
        ("devices per engine", f"{report.generator_devices_per_instance}",
         f"min {report.min_generator_devices} to hold weights"),
        ("decode batch per engine", f"{report.decode_batch}",
         f"KV memory allows {report.decode_batch_memory_cap}"),
        ("decode step", f"{report.decode_step_seconds * 1e3:.2f} ms",
         f"{report.decode_bound}-bound, "
         f"{decode_overhead_seconds(c, report.generator_devices_per_instance) * 1e3:.2f} ms "
         "fixed"
         + (f"; {report.experts_touched_fraction:.1%} experts read" if c.num_experts else "")),
        ("decode tokens/s per device", f"{report.decode_tokens_per_second_per_device:,.0f}", ""),
        ("decode device-hours / step", f"{report.decode_device_seconds / 3600:.3f}",
         "" if c.pipeline_rl else f"x{c.long_tail_factor} long tail (synchronous)"),
        ("prefill device-hours / step", f"{report.prefill_device_seconds / 3600:.3f}",
         f"MFU {c.prefill_mfu}"),
        ("training", "", ""),
        ("trainer device-hours / step", f"{train_s / 3600:.3f}", f"MFU {c.train_mfu}, "
         f"{c.train_precision}"),
        ("trainer stops scaling at", f"{report.trainer_scaling_limit} devices"
         if report.trainer_scaling_limit else "never",
         f"{c.train_min_tokens_per_device:,.0f} tokens a device per optimizer step, "
         f"{c.optimizer_steps_per_step} optimizer step(s) a step"),
        ("balance", "", ""),
        ("generator : trainer devices", f"{report.generator_to_trainer_ratio:.2f} : 1",
         f"paper {PAPER_LAYOUT[0]}:{PAPER_LAYOUT[1]} = {PAPER_LAYOUT[0] / PAPER_LAYOUT[1]:.1f}; "
         f"rule of thumb ~{RULE_OF_THUMB_RATIO:.0f}"),
        ("GPU-hours per step", f"{report.gpu_hours_per_step:.3f}", "balanced pipeline"),
        ("GPU-hours per run", f"{report.gpu_hours_per_run:,.0f}", f"{c.num_steps} steps"),
        ("memory", "", ""),
        ("min trainer devices", f"{report.min_trainer_devices}",
         f"{c.trainer_bytes_per_param:g} B/param x {c.memory_overhead_factor}"
         + (" + reference" if c.reference_model else "")),
        ("min devices (trainer + 1 engine)", f"{report.min_devices}", ""),
    ]
    if report.layout is not None:
        lay = report.layout
        rows += [
            (f"layout on {c.total_devices} devices", "", ""),
            ("generators + trainers", f"{lay.num_generator_devices} + {lay.num_trainer_devices}",
             f"ratio {lay.ratio:.2f}"),
            ("step time", f"{lay.step_seconds:.1f} s",
             f"{gen_s / lay.num_generator_devices:.1f} s generate, "
             f"{report.train_seconds(lay.num_trainer_devices):.1f} s train"),
            ("GPU-hours per step / run", f"{lay.gpu_hours_per_step:.3f} / "
             f"{lay.gpu_hours_per_step * c.num_steps:,.0f}", "includes idle devices"),
        ]
    return rows


def print_report(report: CostReport, file: typing.TextIO | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"RLVR cost model ({report.config.hardware})")
    table.add_column("quantity", no_wrap=True)
    table.add_column("value", justify="right", no_wrap=True)
    table.add_column("note")
    for quantity, value, note in report_rows(report):
        if not value:
            table.add_section()
            table.add_row(f"[bold]{quantity}[/bold]", "", "")
        else:
            table.add_row(quantity, value, note)
    console = Console(file=file) if file is not None else Console()
    if not console.is_terminal:
        console = Console(file=file, width=160)
    console.print(table)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl cost",
        description="Estimate FLOPs, GPU-hours and the generator:trainer split of an RLVR run. "
                    "Start from a preset and override any field.")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="start from a named configuration (default: the CostConfig "
                             "defaults, i.e. the paper's 8B setup without a device count)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    hints = typing.get_type_hints(CostConfig)
    for field in dataclasses.fields(CostConfig):
        flag = "--" + field.name.replace("_", "-")
        help_ = f"{field.metadata['help']} (default {field.default!r})"
        kind = hints[field.name]
        if kind is bool:
            parser.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_)
        else:
            choices = {"hardware": sorted(ACCELERATORS), "generator_precision": PRECISIONS,
                       "train_precision": PRECISIONS}.get(field.name)
            parser.add_argument(flag, dest=field.name, type=kind, choices=choices,
                                default=argparse.SUPPRESS, help=help_)
    return parser


def config_from_args(argv: list[str]) -> tuple[CostConfig, bool]:
    namespace = vars(build_parser().parse_args(argv))
    preset, as_json = namespace.pop("preset"), namespace.pop("json")
    base = PRESETS[preset] if preset else CostConfig()
    return dataclasses.replace(base, **namespace), as_json


def report_to_dict(report: CostReport) -> dict[str, Any]:
    data = {f.name: getattr(report, f.name) for f in dataclasses.fields(report)}
    data = json.loads(json.dumps(data, default=lambda o: dataclasses.asdict(o)))
    for name in ("generator_device_seconds", "generator_to_trainer_ratio", "gpu_hours_per_step",
                 "gpu_hours_per_run", "decode_tokens_per_second_per_device", "min_devices"):
        data[name] = getattr(report, name)
    return data


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config, as_json = config_from_args(argv)
        report = estimate_cost(config)
    except ValueError as err:
        print(f"megatron-rl cost: error: {err}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(report_to_dict(report), indent=2))
    else:
        print_report(report)
    return 0
