"""The power-law alternative R(C) = A - D / C**B (paper A.4), fitted only for comparison.

The power law has no R0 anchor and no saturation scale: on an early window (before the curve
bends) it explains the data as well as the sigmoid but puts its asymptote A far too high, often at
the bound of 1. `fit_power_law` exists so that reports and plots can show that overshoot next to
the sigmoid fit of the same points; the project's decisions use the sigmoid.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from scipy.optimize import least_squares

from megatron_rl.scaling.series import check_curve


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class PowerLawFit:
    a: float
    d: float
    b: float
    compute: np.ndarray  # [num_points] GPU-hours of the points used
    pass_rate: np.ndarray  # [num_points]
    residuals: np.ndarray  # [num_points] observed - fitted

    @property
    def rmse(self) -> float:
        return float(np.sqrt(np.mean(self.residuals ** 2)))

    def predict(self, compute: np.ndarray | float) -> np.ndarray:
        return power_law_curve(compute, a=self.a, d=self.d, b=self.b)


def power_law_curve(compute: np.ndarray | float, *, a: float, d: float, b: float) -> np.ndarray:
    c = np.asarray(compute, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return a - d * np.exp(-b * np.log(c))


def fit_power_law(compute: np.ndarray, pass_rate: np.ndarray, *, warmup_compute: float = 0.0,
                  a_max: float = 1.0, min_points: int = 4) -> PowerLawFit:
    """Least-squares (A, D, B) with 0 <= A <= a_max, D > 0, B > 0, over points above warm-up.

    A is bounded by a_max (a pass rate cannot exceed 1): an early-window fit that "wants" A > 1
    then sits on the bound, which is the overshoot the comparison is meant to show.
    """
    compute = np.asarray(compute, dtype=np.float64)
    pass_rate = np.asarray(pass_rate, dtype=np.float64)
    check_curve(compute, pass_rate, where="fit_power_law")
    keep = (compute > 0.0) & (compute >= warmup_compute)
    x, y = np.log(compute[keep]), pass_rate[keep]
    if x.size < min_points:
        raise ValueError(f"too few points for the power law: {x.size} above the warm-up "
                         f"(need >= {min_points})")

    def residuals(params: np.ndarray) -> np.ndarray:
        a, log_d, b = params
        return a - np.exp(log_d - b * x) - y

    def jacobian(params: np.ndarray) -> np.ndarray:
        _, log_d, b = params
        term = np.exp(log_d - b * x)
        return np.stack([np.ones_like(x), -term, term * x], axis=1)  # [num_points, 3]

    # Multi-start over B: the problem is non-convex in B, and a handful of starts is cheap.
    best = None
    for b0 in (0.1, 0.3, 1.0, 3.0):
        a0 = min(float(y.max()) + 0.05, a_max - 1e-6)
        gap = max(a0 - float(y[0]), 1e-3)
        start = np.array([a0, np.log(gap) + b0 * x[0], b0])
        result = least_squares(residuals, start, jac=jacobian, method="trf",
                               bounds=([0.0, -np.inf, 1e-4], [a_max, np.inf, 20.0]))
        if best is None or result.cost < best.cost:
            best = result
    a, log_d, b = best.x
    return PowerLawFit(a=float(a), d=float(np.exp(log_d)), b=float(b), compute=np.exp(x),
                       pass_rate=y, residuals=-residuals(best.x))
