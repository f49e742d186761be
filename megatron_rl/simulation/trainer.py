"""How long a simulated trainer group takes for each step of the driver's sequence: scoring
(the old policy's log-probs, a forward pass), a training step (forward + backward), a
checkpoint save, and pushing the weights to the generators.

The same formulas as `megatron-rl cost` (megatron_rl.scaling.cost.train_seconds): trained tokens x
6N (+2N for a reference model) / (train_mfu x peak x devices), 2N per scored token at the same
MFU, a device's share of an optimizer step counted as at least train_min_tokens_per_device tokens
(the trainer stops scaling with devices there); bytes
over the links of the hardware profile (profiles.py) for the weight push and the checkpoint.
A measured profile (`HardwareProfile.measured_costs`: the `cpu` profile) replaces the training
step and scoring by the benchmark's fitted times (measured.py). This module only times; the simulated trainer group that the driver calls (and that sleeps these
durations on the SimClock) is built on it in the cluster layer.
"""
from __future__ import annotations

import dataclasses
import math

from megatron_rl.scaling import cost
from megatron_rl.scaling.cost import CostConfig
from megatron_rl.simulation.profiles import HardwareProfile


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class TrainerTiming:
    """A trainer group of `num_devices` devices training `model` on `profile`."""

    model: CostConfig
    profile: HardwareProfile
    num_devices: int
    # The generators share the trainer's NVLink domain (one NVL72 rack): the push runs over
    # NVLink, else over the scale-out network.
    weights_over_nvlink: bool = False

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"TrainerTiming: num_devices={self.num_devices} must be >= 1")

    def _seconds(self, num_tokens: float, flops_per_token: float) -> float:
        return cost.train_seconds(self.model, self.profile.accelerator, num_tokens,
                                  self.num_devices, flops_per_token=flops_per_token)

    def score_seconds(self, num_tokens: int) -> float:
        """Log-probs of `num_tokens` tokens under the current policy (and the reference model,
        if any): a forward pass, 2N FLOPs per token each."""
        if self.profile.measured_costs is not None:
            return self.profile.measured_costs.score_seconds(num_tokens)
        passes = 2.0 if self.model.reference_model else 1.0
        return self._seconds(num_tokens, passes * 2.0 * self.model.num_active_params)

    def train_step_seconds(self, num_tokens: int) -> float:
        """A step over `num_tokens` trained tokens (model.optimizer_steps_per_step optimizer
        steps): 6N per token (+2N reference), the cost model's train_seconds."""
        if self.profile.measured_costs is not None:
            return self.profile.measured_costs.train_step_seconds(num_tokens)
        return self._seconds(num_tokens, cost.train_flops_per_token(self.model))

    @property
    def num_nodes(self) -> int:
        return math.ceil(self.num_devices / self.profile.devices_per_node)

    def checkpoint_seconds(self) -> float:
        """Writing (or reading) the full training state: trainer_bytes_per_param per parameter
        (weights, grads, master weights, Adam moments), every node writing its share."""
        state_bytes = self.model.total_params * self.model.trainer_bytes_per_param
        return state_bytes / (self.num_nodes * self.profile.storage_bytes_per_s_per_node)

    def weight_push_seconds(self) -> float:
        """Broadcasting one generator copy of the weights (generator precision) to the engines:
        a pipelined broadcast is bounded by one GPU link, whatever the number of receivers."""
        return cost.generator_weight_bytes(self.model) / self.profile.link_bytes_per_s(
            same_nvlink_domain=self.weights_over_nvlink)
