"""Accelerator spec-sheet numbers used by the cost model (per GPU, dense tensor-core throughput).

NVIDIA quotes tensor-core FLOP/s "with sparsity" (2:4 structured sparsity, which RL training and
decoding do not use); the dense figures below are half of those. Sources (public spec sheets):
- H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 / FP8 3,958 TFLOPS with sparsity,
  80 GB HBM3, 3.35 TB/s.
- H200 SXM: NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 / FP8 3,958 TFLOPS with sparsity,
  141 GB HBM3e, 4.8 TB/s.
- B200: NVIDIA HGX B200 / DGX B200 datasheet (8 GPUs): FP16/BF16 36 PFLOPS and FP8 72 PFLOPS with
  sparsity, 1,440 GB HBM3e, 64 TB/s -> per GPU 2,250 / 4,500 TFLOPS dense, 180 GB, 8 TB/s.
- GB200 (one Blackwell GPU of a GB200 NVL72): NVIDIA GB200 NVL72 spec (72 GPUs): FP16/BF16
  360 PFLOPS and FP8 720 PFLOPS with sparsity, 13.4 TB HBM3e, 576 TB/s -> per GPU 2,500 / 5,000
  TFLOPS dense, ~186 GB, 8 TB/s.
- H20 (HGX H20, the export-compliant Hopper the verl figures of ../shared/ANCHOR_FIGURES.md ran
  on): NVIDIA publishes no public datasheet; the figures reported for it (e.g.
  willitrunai.com/gpus/h20-96gb, and the Geekbench-era press reports of Nov 2023) are FP16/BF16
  148 TFLOPS and FP8 296 TFLOPS dense, 96 GB HBM3, 4.0 TB/s, NVLink 4 (900 GB/s
  bidirectional), 400 W. (A later 141 GB variant exists; the 96 GB one is the one modelled.)
Achieved fractions of these peaks (MFU, bandwidth efficiency) are cost-model knobs, not specs.
"""
from __future__ import annotations

import dataclasses

PRECISIONS = ("bf16", "fp8")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Accelerator:
    name: str
    bf16_tflops: float  # dense peak
    fp8_tflops: float  # dense peak
    hbm_gb_per_s: float  # peak HBM bandwidth
    memory_gb: float  # HBM capacity

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOP/s for 'bf16' or 'fp8'."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: choose one of {PRECISIONS}")
        return 1e12 * (self.bf16_tflops if precision == "bf16" else self.fp8_tflops)

    @property
    def hbm_bytes_per_s(self) -> float:
        return 1e9 * self.hbm_gb_per_s

    @property
    def memory_bytes(self) -> float:
        return 1e9 * self.memory_gb


ACCELERATORS: dict[str, Accelerator] = {
    a.name: a for a in (
        Accelerator(name="H100", bf16_tflops=989.5, fp8_tflops=1979.0, hbm_gb_per_s=3350.0,
                    memory_gb=80.0),
        Accelerator(name="H200", bf16_tflops=989.5, fp8_tflops=1979.0, hbm_gb_per_s=4800.0,
                    memory_gb=141.0),
        Accelerator(name="B200", bf16_tflops=2250.0, fp8_tflops=4500.0, hbm_gb_per_s=8000.0,
                    memory_gb=180.0),
        Accelerator(name="GB200", bf16_tflops=2500.0, fp8_tflops=5000.0, hbm_gb_per_s=8000.0,
                    memory_gb=186.0),
        Accelerator(name="H20", bf16_tflops=148.0, fp8_tflops=296.0, hbm_gb_per_s=4000.0,
                    memory_gb=96.0),
    )
}


def get_accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; choose one of "
                         f"{', '.join(ACCELERATORS)}") from None
