"""How long a simulated SGLang engine takes for what it does: a decode step of a given batch and
total context, a prefill, loading a weight bucket; and how many KV-cache tokens it holds.

Every figure comes from the cost model's own formulas (megatron_rl.scaling.cost: decode_step,
compute_seconds, kv_free_bytes, ...) on a hardware profile (profiles.py) and the model shape and
efficiency knobs of a CostConfig, so that `megatron-rl simulate` and `megatron-rl cost` agree on
every figure both compute. The cost model uses the steady-state batch and mean context; the
simulator uses the batch and context each step actually has.

A measured profile (the `cpu` profile: `HardwareProfile.measured_costs`, measured.py) replaces
the decode step, the prefill and the weight update by the benchmark's fitted times, and joining
a weight-update group costs nothing (the real run joins once, at connection).
"""
from __future__ import annotations

import dataclasses

from megatron_rl.scaling import cost
from megatron_rl.scaling.cost import CostConfig
from megatron_rl.simulation.profiles import HardwareProfile


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class EngineTiming:
    """One generator engine of `devices_per_engine` devices serving `model` on `profile`."""

    model: CostConfig
    profile: HardwareProfile
    devices_per_engine: int = 0  # 0: the cost model's choice (_auto_engine_size)
    # Weight buckets reach the engine over NVLink (trainer and engine in one NVLink domain,
    # e.g. one NVL72 rack) or over the scale-out network.
    weights_over_nvlink: bool = False
    init_group_seconds: float = 2.0  # joining a weight-update group (NCCL communicator set-up)
    # A (re)started SGLang server before it loads weights: process start, imports, NCCL and
    # CUDA-graph capture. Assumed (not measured here): about a minute on a GPU node.
    launch_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.devices_per_engine < 0:
            raise ValueError(f"devices_per_engine={self.devices_per_engine} must be >= 0 "
                             "(0 = the cost model's choice)")
        if self.profile.measured_costs is not None:
            object.__setattr__(self, "init_group_seconds", 0.0)
        if self.devices_per_engine == 0:
            object.__setattr__(self, "devices_per_engine", cost._auto_engine_size(
                self.model, self.profile.accelerator, cost.generator_weight_bytes(self.model)))
        if self.kv_capacity_tokens < 1:
            raise ValueError(f"EngineTiming: {self.devices_per_engine} {self.profile.name} "
                             f"device(s) leave no KV-cache memory after the weights "
                             f"({cost.generator_weight_bytes(self.model) / 1e9:.0f} GB); raise "
                             "devices_per_engine")

    @property
    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds (SGLang's max_total_tokens on this hardware)."""
        return int(cost.kv_free_bytes(self.model, self.profile.accelerator,
                                      self.devices_per_engine)
                   // cost.kv_bytes_per_token(self.model))

    def decode_step_seconds(self, batch: int, context_tokens: float) -> float:
        """One decode step of `batch` running sequences holding `context_tokens` KV tokens."""
        if self.profile.measured_costs is not None:
            return self.profile.measured_costs.decode_step_seconds(batch, context_tokens)
        return cost.decode_step(self.model, self.profile.accelerator, self.devices_per_engine,
                                batch, context_tokens)[0]

    def prefill_seconds(self, num_tokens: int) -> float:
        """Prefill of `num_tokens` tokens (2N FLOPs each, at prefill_mfu)."""
        if self.profile.measured_costs is not None:
            return self.profile.measured_costs.prefill_seconds(num_tokens)
        return cost.compute_seconds(2.0 * self.model.num_active_params * num_tokens,
                                    self.profile.accelerator, self.model.generator_precision,
                                    self.model.prefill_mfu, self.devices_per_engine)

    def weight_load_seconds(self, num_bytes: float) -> float:
        """Receiving one broadcast weight bucket of `num_bytes` (every rank of the engine gets
        the whole bucket, so the per-GPU link bounds it). A measured profile: the measured
        time of one whole weight update (the simulated push sends one bucket per update)."""
        if self.profile.measured_costs is not None:
            return self.profile.measured_costs.weight_update_s
        return num_bytes / self.profile.link_bytes_per_s(
            same_nvlink_domain=self.weights_over_nvlink)

    def disk_load_seconds(self) -> float:
        """Reloading every weight from a checkpoint folder (update_weights_from_disk)."""
        return cost.generator_weight_bytes(self.model) \
            / self.profile.storage_bytes_per_s_per_node

    def start_seconds(self) -> float:
        """A restarted engine until it serves: launch, then every weight from the checkpoint
        folder on the node's storage (then the run's weight sync gives it the current policy)."""
        return self.launch_seconds + self.disk_load_seconds()
