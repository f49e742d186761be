"""Hardware profiles of the simulator: the accelerator of scaling/hardware.py (the same spec-sheet
figures `megatron-rl cost` uses) plus what only a simulation needs, the links a weight push and
a checkpoint travel over.

Link figures are per GPU and per direction, from public spec sheets:
- NVLink 4 (H100 / H200 SXM): 900 GB/s bidirectional -> 450 GB/s each way, 8 GPUs per domain.
- NVLink 5 (B200 HGX: 8 GPUs; GB200 NVL72: 72 GPUs per domain): 1.8 TB/s bidirectional ->
  900 GB/s each way.
- Scale-out: one ConnectX-7 400 Gb/s NIC per GPU (DGX H100/H200/B200, GB200 NVL72 compute trays)
  -> 50 GB/s.
- H20 (HGX H20, 8 GPUs): NVLink 4, 900 GB/s bidirectional -> 450 GB/s each way (the figure
  reported for it; scaling/hardware.py says where from); the NIC is assumed as on DGX H100.
- Host link (colocated runs move the trainer's optimizer state to the CPU and back between
  phases, cluster.py): PCIe Gen5 x16 on Hopper and HGX B200, 64 GB/s each way; NVLink-C2C on a
  GB200 superchip, 900 GB/s bidirectional -> 450 GB/s each way.
Checkpoint storage bandwidth per node is an assumption (a parallel file system at ~10 GB/s per
node), not a spec; `link_efficiency` (the achieved fraction of a link's peak) is a knob like the
cost model's MFU.

The `cpu` profile is this machine's real SGLang CPU engine and Megatron CPU trainer, measured by
benchmarks/cpu_profile.py into cpu_profile.json next to this file (`measured=True`; its timing is
measured.py's fitted coefficients, not the roofline: docs/simulation.md, "Against real runs on
this machine"). Without that file it falls back to placeholder figures (`measured=False`).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_rl.scaling.cost import CostConfig
from megatron_rl.scaling.hardware import ACCELERATORS, Accelerator
from megatron_rl.simulation.measured import MeasuredCosts


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class HardwareProfile:
    """One accelerator type and the links around it, as the simulator times them."""

    accelerator: Accelerator
    devices_per_node: int  # GPUs a node failure takes down together
    nvlink_domain: int  # GPUs that reach each other over NVLink (8, or 72 in an NVL72 rack)
    nvlink_gb_per_s: float  # per GPU, each way
    scale_out_gb_per_s: float  # per GPU, each way (InfiniBand / RoCE NIC)
    storage_gb_per_s_per_node: float  # checkpoint writes and reads
    link_efficiency: float = 0.8  # achieved fraction of a link's peak
    host_gb_per_s: float = 64.0  # per GPU, each way, to host memory (PCIe Gen5 x16)
    measured: bool = False  # True once a benchmark measured the figures (the cpu profile)
    # Measured profiles: fitted times (measured.py) that timing.py and trainer.py use in place
    # of the cost model's roofline.
    measured_costs: MeasuredCosts | None = None

    def __post_init__(self) -> None:
        if self.measured != (self.measured_costs is not None):
            raise ValueError(f"HardwareProfile {self.name}: measured={self.measured} needs "
                             "measured_costs given exactly when measured is True")
        for name in ("devices_per_node", "nvlink_domain", "nvlink_gb_per_s",
                     "scale_out_gb_per_s", "storage_gb_per_s_per_node"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HardwareProfile {self.name}: {name}={getattr(self, name)} "
                                 "must be > 0")
        if not 0.0 < self.link_efficiency <= 1.0:
            raise ValueError(f"HardwareProfile {self.name}: link_efficiency="
                             f"{self.link_efficiency} must be in (0, 1]")

    @property
    def name(self) -> str:
        return self.accelerator.name

    def link_bytes_per_s(self, *, same_nvlink_domain: bool) -> float:
        """Achieved bytes/s of one GPU's link to another: NVLink inside a domain, else the NIC."""
        peak = self.nvlink_gb_per_s if same_nvlink_domain else self.scale_out_gb_per_s
        return 1e9 * peak * self.link_efficiency

    @property
    def host_bytes_per_s(self) -> float:
        """Achieved bytes/s of one GPU's copy to or from host memory."""
        return 1e9 * self.host_gb_per_s * self.link_efficiency

    @property
    def storage_bytes_per_s_per_node(self) -> float:
        return 1e9 * self.storage_gb_per_s_per_node * self.link_efficiency

    def cost_config(self, base: CostConfig) -> CostConfig:
        """`base` (the model shape, workload and efficiency knobs) on this profile's hardware.
        The cpu profile's accelerator is not one `megatron-rl cost` offers, so `base.hardware`
        stays as it is there; the simulator always times with `self.accelerator`."""
        if self.name in ACCELERATORS:
            return dataclasses.replace(base, hardware=self.name)
        return base


def _gpu(name: str, *, nvlink_domain: int, nvlink_gb_per_s: float) -> HardwareProfile:
    return HardwareProfile(accelerator=ACCELERATORS[name], devices_per_node=8 if nvlink_domain == 8
                           else 4, nvlink_domain=nvlink_domain, nvlink_gb_per_s=nvlink_gb_per_s,
                           scale_out_gb_per_s=50.0, storage_gb_per_s_per_node=10.0)


# Placeholder figures for a 2-core CPU machine (bf16 matmuls on 2 cores, DDR bandwidth): only
# the KV capacity (when the recipe gives no max_total_tokens) and checkpoint times still use them
# once the profile is measured.
CPU_ACCELERATOR = Accelerator(name="cpu", bf16_tflops=0.1, fp8_tflops=0.1, hbm_gb_per_s=10.0,
                              memory_gb=16.0)
CPU_PROFILE_JSON = Path(__file__).with_name("cpu_profile.json")  # benchmarks/cpu_profile.py


def cpu_profile(path: Path = CPU_PROFILE_JSON) -> HardwareProfile:
    """This machine: measured when benchmarks/cpu_profile.py has written `path`, else the
    placeholder figures (measured=False)."""
    costs = MeasuredCosts.load(path) if path.is_file() else None
    return HardwareProfile(accelerator=CPU_ACCELERATOR, devices_per_node=1, nvlink_domain=1,
                           nvlink_gb_per_s=5.0, scale_out_gb_per_s=1.0,
                           storage_gb_per_s_per_node=0.5, measured=costs is not None,
                           measured_costs=costs)


PROFILES: dict[str, HardwareProfile] = {
    "H100": _gpu("H100", nvlink_domain=8, nvlink_gb_per_s=450.0),
    "H200": _gpu("H200", nvlink_domain=8, nvlink_gb_per_s=450.0),
    "B200": _gpu("B200", nvlink_domain=8, nvlink_gb_per_s=900.0),
    # A GB200 NVL72 compute tray holds 4 GPUs (2 Grace-Blackwell superchips): a node loss
    # takes 4 GPUs, while NVLink spans the 72 of the rack.
    "GB200": dataclasses.replace(_gpu("GB200", nvlink_domain=72, nvlink_gb_per_s=900.0),
                                 host_gb_per_s=450.0),
    "cpu": cpu_profile(),
    # The verl figures of ../shared/ANCHOR_FIGURES.md ran on H20 (docs/simulation.md, "Against
    # published figures").
    "H20": _gpu("H20", nvlink_domain=8, nvlink_gb_per_s=450.0),
}


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; choose one of "
                         f"{', '.join(PROFILES)}") from None
