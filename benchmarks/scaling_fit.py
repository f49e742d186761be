"""Wall time of the sigmoid fit (acceptance: 20-80 points in under 2 s) against a baseline.

Baseline, measured in the same run: the paper's procedure taken literally, a continuous
(B, C_mid) least-squares refinement at *every* grid A (step 0.005 from R0 to 1). `fit_sigmoid`
refines only along a downhill walk of the A profile from the coarse grid's best starts; the table
shows it returns the same grid A, and what the bootstrap intervals add on top.

Run: .venv/bin/python benchmarks/scaling_fit.py
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_rl.scaling.sigmoid import (SigmoidFitConfig, _coarse_starts,  # noqa: E402
                                        _refine_b_c_mid, a_grid_for, fit_sigmoid)

TRUTH = {"a": 0.61, "b": 1.5, "c_mid": 2000.0, "r0": 0.2}
NUM_REPEATS = 3


def exhaustive_grid(x: np.ndarray, y: np.ndarray, r0: float) -> float:
    """Refine (B, C_mid) at every grid A; return the best A."""
    config = SigmoidFitConfig(num_bootstrap=0)
    grid = a_grid_for(r0, config)
    starts = _coarse_starts(x, y, r0, grid, config)
    sse = [_refine_b_c_mid(x, y, r0, float(a), b0, m0)[0] for a, (_, b0, m0) in zip(grid, starts)]
    return float(grid[int(np.argmin(sse))])


def timed(fn) -> tuple[float, object]:
    times, result = [], None
    for _ in range(NUM_REPEATS):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    rng = np.random.default_rng(0)
    r0 = TRUTH["r0"]
    warm = np.linspace(100.0, 16000.0, 30)  # first calls pay for imports and caches
    fit_sigmoid(warm, r0 + 0.3 * warm / (warm + 2000.0), r0=r0)
    rows = []
    for num_points in (20, 40, 80):
        compute = np.linspace(16000.0 / num_points, 16000.0, num_points)
        rate = r0 + (TRUTH["a"] - r0) / (1 + (TRUTH["c_mid"] / compute) ** TRUTH["b"])
        rate = rate + rng.normal(0.0, 0.005, num_points)
        base_s, base_a = timed(lambda: exhaustive_grid(np.log(compute), rate, r0))
        fast_s, fast = timed(lambda: fit_sigmoid(compute, rate, r0=r0,
                                                 config=SigmoidFitConfig(num_bootstrap=0)))
        full_s, full = timed(lambda: fit_sigmoid(compute, rate, r0=r0))
        rows.append((num_points, base_s, fast_s, base_s / fast_s, base_a == fast.a, full_s,
                     full.a, full.b, full.c_mid))
    header = (f"{'points':>6} | {'baseline: every A (s)':>21} | {'fit, no CI (s)':>14} | "
              f"{'speed-up':>8} | {'same A':>6} | {'fit + 200 bootstrap (s)':>23} | "
              f"{'A':>6} {'B':>6} {'C_mid':>7}")
    print("Sigmoid fit wall time (median of 3); acceptance: fit + bootstrap < 2 s")
    print(header)
    print("-" * len(header))
    for n, base_s, fast_s, speedup, same, full_s, a, b, c_mid in rows:
        print(f"{n:>6} | {base_s:>21.3f} | {fast_s:>14.3f} | {speedup:>7.1f}x | "
              f"{str(same):>6} | {full_s:>23.3f} | {a:>6.3f} {b:>6.3f} {c_mid:>7.0f}")
    print(f"truth: A={TRUTH['a']} B={TRUTH['b']} C_mid={TRUTH['c_mid']:.0f} R0={r0}, "
          "noise sd 0.005")


if __name__ == "__main__":
    main()
