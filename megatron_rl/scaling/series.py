"""The validation curve of one run and one task: compute spent so far vs held-out pass rate.

`ScalingSeries` is the typed record that the log reader produces and the fitters, reports, plots
and CLI consume. It owns the checks every consumer relies on (equal lengths, finite values, pass
rates in [0, 1], compute that never decreases), so that bad logs fail once, at read time, with an
error naming the run, the offending point and the fix.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ScalingSeries:
    """One curve: `pass_rate[i]` measured after `compute_gpu_hours[i]` GPU-hours (at `step[i]`).

    `step` is None when the source had no step column (a CSV of compute and pass rate only); the
    points are then in file order. R0 is the pass rate of the step-0 point (or, without steps, of
    the point at zero compute); `r0` is None when the curve has no such point.
    """

    run: str
    task: str
    compute_gpu_hours: np.ndarray  # [num_points] float64, non-decreasing
    pass_rate: np.ndarray  # [num_points] float64 in [0, 1]
    step: np.ndarray | None = None  # [num_points] int64, strictly increasing

    def __post_init__(self) -> None:
        compute = np.asarray(self.compute_gpu_hours, dtype=np.float64)
        rate = np.asarray(self.pass_rate, dtype=np.float64)
        object.__setattr__(self, "compute_gpu_hours", compute)
        object.__setattr__(self, "pass_rate", rate)
        if self.step is not None:
            object.__setattr__(self, "step", np.asarray(self.step, dtype=np.int64))
        check_curve(compute, rate, where=self.label, step=self.step)

    @property
    def label(self) -> str:
        return f"{self.run}:{self.task}"

    @property
    def num_points(self) -> int:
        return int(self.compute_gpu_hours.size)

    @property
    def r0(self) -> float | None:
        if self.num_points == 0:
            return None
        first_is_start = (self.step[0] == 0) if self.step is not None else (
            self.compute_gpu_hours[0] == 0.0)
        return float(self.pass_rate[0]) if first_is_start else None


def check_curve(compute: np.ndarray, pass_rate: np.ndarray, *, where: str,
                step: np.ndarray | None = None) -> None:
    """Raise ValueError naming `where` and the bad point if the curve is not a valid log."""
    if compute.ndim != 1 or pass_rate.shape != compute.shape:
        raise ValueError(f"{where}: compute ({compute.shape}) and pass rate ({pass_rate.shape}) "
                         "must be 1-D arrays of the same length")
    if step is not None and step.shape != compute.shape:
        raise ValueError(f"{where}: {step.size} steps for {compute.size} points")
    if not (np.all(np.isfinite(compute)) and np.all(np.isfinite(pass_rate))):
        raise ValueError(f"{where}: compute and pass rate must be finite numbers (found NaN/inf)")
    bad = np.flatnonzero((pass_rate < 0.0) | (pass_rate > 1.0))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: pass rate {float(pass_rate[i])!r} at {_point(i, step)} is "
                         "outside [0, 1]; log the fraction of correct samples, not a percentage "
                         "or a +-1 reward")
    if compute.size and compute.min() < 0.0:
        i = int(np.argmin(compute))
        raise ValueError(f"{where}: negative compute {float(compute[i])!r} GPU-hours at "
                         f"{_point(i, step)}")
    if step is not None and np.any(np.diff(step) <= 0):
        i = int(np.flatnonzero(np.diff(step) <= 0)[0]) + 1
        raise ValueError(f"{where}: steps must be strictly increasing; {_point(i, step)} follows "
                         f"step {int(step[i - 1])}")
    drops = np.flatnonzero(np.diff(compute) < 0.0)
    if drops.size:
        i = int(drops[0]) + 1
        raise ValueError(f"{where}: compute is not monotone: {float(compute[i])!r} GPU-hours at "
                         f"{_point(i, step)} is below {float(compute[i - 1])!r} at the previous "
                         "point; compute must be the cumulative GPU-hours of the run (sort the "
                         "points by step, and carry the total over restarts)")


def _point(index: int, step: np.ndarray | None) -> str:
    return f"step {int(step[index])}" if step is not None else f"point {index}"
