"""The ScaleRL compute-performance curve and its fit (SCALERL.md section 1, paper A.5).

    R(C) = R0 + (A - R0) / (1 + (C_mid / C) ** B)

R0 (the step-0 pass rate) is fixed, never fitted. The fit follows the paper: a grid over A, and
for each A the (B, C_mid) pair that minimises the squared residuals, keeping the A with the lowest
sum. For each grid A the search starts from the best point of a coarse grid over (C_mid, B)
(vectorised in numpy) and is refined continuously with `scipy.optimize.least_squares`, so C_mid is
not limited to grid values and B is a least-squares estimate. Points before a warm-up compute are
excluded. Confidence intervals come from a residual bootstrap around the continuous
least-squares fit; each replicate is refitted by a continuous least-squares fit of (A, B, C_mid) (a
full grid search per replicate would cost ~30x more), and each interval is the plain percentile
interval of the replicates (`SigmoidFit.bootstrap_samples`). The grid A is not a continuous
estimate: when the interval is narrower than the A step it may lie beside the grid A, and is
reported as it is. Parameters stay inside bounds (A in the grid's range, B in [0.01, 50], C_mid
within a wide band around the data) so that a curve the model cannot explain yields a poor fit,
never an overflow. A fit whose A lies within one grid step of R0, or whose B or C_mid sits at its
bound, describes no learning (an all-zero curve fits as A = R0 + one step, B = 50): it carries
`no_learning_signal`, the reason, and its consumers print that instead of the numbers.
"""
from __future__ import annotations

import dataclasses

import numpy as np
from scipy.optimize import least_squares
from scipy.special import expit

from megatron_rl.scaling.series import check_curve

# B outside this range is not a plausible RL scaling exponent (paper: ~0.3 ... 3); the bounds keep
# the optimiser away from the flat (B -> 0) and step-function (B -> inf) limits of bad data.
LOG_B_BOUNDS = (float(np.log(1e-2)), float(np.log(50.0)))
BOUND_MARGIN = 1e-3  # a fitted (log) B or C_mid this close to a bound, as a share of its range


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SigmoidFitConfig:
    """How the sigmoid is fitted. Defaults follow the paper except where it is silent."""

    a_min: float | None = None  # lowest A on the grid; None = first multiple of a_step above R0
    a_max: float = 1.0  # highest A on the grid (paper: 0.800; any value up to 1)
    a_step: float = 0.005  # paper A.5
    num_c_mid_grid: int = 32  # coarse log-spaced C_mid starts per A, before continuous refinement
    num_b_grid: int = 24  # coarse log-spaced B starts per A
    warmup_compute: float = 0.0  # points below this many GPU-hours are excluded (paper: ~1,500)
    num_bootstrap: int = 200  # residual-bootstrap replicates for the intervals; 0 = no intervals
    confidence: float = 0.95  # two-sided level of the bootstrap percentile intervals
    seed: int = 0
    min_points: int = 5  # after warm-up exclusion; 3 parameters need some redundancy

    def __post_init__(self) -> None:
        if not 0.0 < self.a_max <= 1.0:
            raise ValueError(f"a_max={self.a_max} must be in (0, 1]")
        if self.a_min is not None and not 0.0 <= self.a_min < self.a_max:
            raise ValueError(f"a_min={self.a_min} must be in [0, a_max={self.a_max})")
        if not 0.0 < self.a_step <= 0.5:
            raise ValueError(f"a_step={self.a_step} must be in (0, 0.5]")
        if self.num_c_mid_grid < 2 or self.num_b_grid < 2:
            raise ValueError("num_c_mid_grid and num_b_grid must be >= 2")
        if self.warmup_compute < 0.0:
            raise ValueError(f"warmup_compute={self.warmup_compute} must be >= 0 GPU-hours")
        if self.num_bootstrap < 0:
            raise ValueError(f"num_bootstrap={self.num_bootstrap} must be >= 0")
        if not 0.0 < self.confidence < 1.0:
            raise ValueError(f"confidence={self.confidence} must be in (0, 1)")
        if self.min_points < 4:
            raise ValueError(f"min_points={self.min_points} must be >= 4 (3 fitted parameters)")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SigmoidFit:
    """A fitted curve, the points it was fitted on, and bootstrap intervals (None if not run)."""

    a: float
    b: float
    c_mid: float
    r0: float
    a_fixed: bool  # A was given (recipe comparison), not searched
    compute: np.ndarray  # [num_points] GPU-hours of the points used
    pass_rate: np.ndarray  # [num_points]
    residuals: np.ndarray  # [num_points] observed - fitted
    num_warmup_excluded: int
    a_ci: tuple[float, float] | None = None
    b_ci: tuple[float, float] | None = None
    c_mid_ci: tuple[float, float] | None = None
    confidence: float = 0.95
    bootstrap_samples: np.ndarray | None = None  # [num_bootstrap, (A, B, C_mid)] replicates
    # Why the parameters are not a finding (A within one grid step of R0, B or C_mid at a bound);
    # None for a curve that rises.
    no_learning_signal: str | None = None

    @property
    def num_points(self) -> int:
        return int(self.compute.size)

    @property
    def sse(self) -> float:
        return float(np.sum(self.residuals ** 2))

    @property
    def rmse(self) -> float:
        return float(np.sqrt(np.mean(self.residuals ** 2)))

    @property
    def max_compute(self) -> float:
        return float(self.compute.max())

    def predict(self, compute: np.ndarray | float) -> np.ndarray:
        return sigmoid_curve(compute, a=self.a, b=self.b, c_mid=self.c_mid, r0=self.r0)


def sigmoid_curve(compute: np.ndarray | float, *, a: float, b: float, c_mid: float,
                  r0: float) -> np.ndarray:
    """R(C); written as a logistic in log C, which is exact and cannot overflow (R(0) = R0)."""
    log_c = _safe_log(compute)
    return r0 + (a - r0) * expit(b * (log_c - np.log(c_mid)))


def fit_point_mask(compute: np.ndarray, warmup_compute: float) -> np.ndarray:
    """Bool mask of the points a fit uses: C = 0 is the R0 point itself (the model passes through
    it exactly, it carries no information) and points before the warm-up compute are excluded."""
    compute = np.asarray(compute, dtype=np.float64)
    return (compute > 0.0) & (compute >= warmup_compute)


def fit_sigmoid(compute: np.ndarray, pass_rate: np.ndarray, *, r0: float,
                config: SigmoidFitConfig = SigmoidFitConfig(),
                fixed_a: float | None = None) -> SigmoidFit:
    """Fit (A, B, C_mid) to a validation curve with R0 fixed; `fixed_a` pins A (0.02 rule)."""
    compute = np.asarray(compute, dtype=np.float64)
    pass_rate = np.asarray(pass_rate, dtype=np.float64)
    check_curve(compute, pass_rate, where="fit_sigmoid")
    if not 0.0 <= r0 < 1.0:
        raise ValueError(f"r0={r0} must be in [0, 1)")
    if fixed_a is not None and not r0 < fixed_a <= 1.0:
        raise ValueError(f"fixed_a={fixed_a} must be in (r0={r0}, 1]")
    keep = fit_point_mask(compute, config.warmup_compute)
    num_warmup_excluded = int(np.sum((compute > 0.0) & ~keep))
    x, y = np.log(compute[keep]), pass_rate[keep]
    if x.size < config.min_points:
        raise ValueError(
            f"too few points to fit: {x.size} after excluding C = 0 and {num_warmup_excluded} "
            f"warm-up points below {config.warmup_compute} GPU-hours (need >= "
            f"{config.min_points}); validate more often, or lower --warmup-gpu-hours")
    if np.ptp(x) <= 0.0:
        raise ValueError("all fitted points have the same compute; the curve needs a compute range")

    a_grid = np.array([fixed_a]) if fixed_a is not None else a_grid_for(r0, config)
    a, b, log_c_mid = _search_a_grid(x, y, r0, a_grid, config)
    residuals = y - sigmoid_curve(np.exp(x), a=a, b=b, c_mid=np.exp(log_c_mid), r0=r0)
    fit = SigmoidFit(a=float(a), b=float(b), c_mid=float(np.exp(log_c_mid)), r0=r0,
                     a_fixed=fixed_a is not None, compute=np.exp(x), pass_rate=y,
                     residuals=residuals, num_warmup_excluded=num_warmup_excluded,
                     confidence=config.confidence,
                     no_learning_signal=_no_learning_signal(
                         a, b, log_c_mid, r0, x, config, a_fixed=fixed_a is not None))
    if config.num_bootstrap == 0:
        return fit
    samples = _bootstrap_samples(fit, config, a_grid)
    a_ci, b_ci, c_mid_ci = _percentile_intervals(samples, config.confidence)
    return dataclasses.replace(fit, a_ci=a_ci, b_ci=b_ci, c_mid_ci=c_mid_ci,
                               bootstrap_samples=samples)


def _no_learning_signal(a: float, b: float, log_c_mid: float, r0: float, x: np.ndarray,
                        config: SigmoidFitConfig, *, a_fixed: bool) -> str | None:
    """Why a fit describes no learning, or None. The least-squares optimum of a flat or falling
    curve is the lowest grid A with B or C_mid driven to a bound; the bootstrap then has nothing
    to resample around, so its intervals may not even contain the estimate."""
    reasons = []
    if not a_fixed and a - r0 <= config.a_step * (1.0 + 1e-6):
        reasons.append(f"A {a:.3f} within one grid step ({config.a_step:g}) of R0 {r0:.3f}")
    for name, value, (lo, hi), shown in (
            ("B", float(np.log(b)), LOG_B_BOUNDS, f"{b:.3g}"),
            ("C_mid", log_c_mid, _log_c_mid_bounds(x), f"{np.exp(log_c_mid):.3g} GPU-hours")):
        margin = BOUND_MARGIN * (hi - lo)  # the squashed parameters approach a bound, never reach
        if value <= lo + margin or value >= hi - margin:
            reasons.append(f"{name} {shown} at its {'lower' if value <= lo + margin else 'upper'}"
                           " bound")
    return "; ".join(reasons) or None


def a_grid_for(r0: float, config: SigmoidFitConfig) -> np.ndarray:
    """Grid values of A: multiples of a_step strictly above R0 (so A - R0 > 0), up to a_max."""
    step = config.a_step
    above_r0 = (np.floor(r0 / step + 1e-9) + 1) * step
    # An explicit a_min at or below R0 (e.g. the paper's 0.45 for a strong base model) falls back
    # to the first grid multiple above R0: A = R0 is the degenerate flat curve.
    lo = config.a_min if config.a_min is not None and config.a_min > r0 else above_r0
    grid = np.arange(lo, config.a_max + step / 2, step)
    grid = grid[grid <= config.a_max + 1e-12]
    if grid.size == 0:
        raise ValueError(f"the A grid [{lo:.4f}, {config.a_max}] is empty: a_max must exceed "
                         f"R0={r0:.4f}")
    return np.round(grid, 10)


def _safe_log(compute: np.ndarray | float) -> np.ndarray:
    c = np.asarray(compute, dtype=np.float64)
    with np.errstate(divide="ignore"):
        return np.log(np.maximum(c, 0.0))  # log 0 = -inf -> expit(-inf) = 0 -> R0


def _search_a_grid(x: np.ndarray, y: np.ndarray, r0: float, a_grid: np.ndarray,
                   config: SigmoidFitConfig) -> tuple[float, float, float]:
    """Grid A with the least refined SSE; returns (a, b, log_c_mid).

    Refining every grid A costs one least-squares solve each (~150 for R0 ~ 0.2); instead the
    coarse SSE profile over A (cheap, vectorised) picks starting indices and the refined profile
    is walked downhill from each of them. The refined profile is smooth in A, so this lands on the
    same grid point as refining them all, at ~10% of the cost.
    """
    coarse = _coarse_starts(x, y, r0, a_grid, config)
    coarse_sse = np.array([c[0] for c in coarse])
    refined: dict[int, tuple[float, float, float]] = {}

    def profile(i: int) -> float:
        if i not in refined:
            _, b0, m0 = coarse[i]
            refined[i] = _refine_b_c_mid(x, y, r0, float(a_grid[i]), b0, m0)
        return refined[i][0]

    for start in _lowest_local_minima(coarse_sse, num=3):
        i = start
        profile(i)
        while True:
            neighbours = [j for j in (i - 1, i + 1) if 0 <= j < a_grid.size]
            best = min(neighbours, key=profile, default=i)
            if not neighbours or profile(best) >= profile(i):
                break
            i = best
    i_best = min(refined, key=lambda i: refined[i][0])
    _, b, m = refined[i_best]
    return float(a_grid[i_best]), b, m


def _lowest_local_minima(values: np.ndarray, num: int) -> list[int]:
    padded = np.concatenate([[np.inf], values, [np.inf]])
    is_min = (padded[1:-1] <= padded[:-2]) & (padded[1:-1] <= padded[2:])
    minima = np.flatnonzero(is_min)
    return [int(i) for i in minima[np.argsort(values[minima])][:num]]


def _coarse_starts(x: np.ndarray, y: np.ndarray, r0: float, a_grid: np.ndarray,
                   config: SigmoidFitConfig) -> list[tuple[float, float, float]]:
    """Best (sse, b, log_c_mid) of a log-spaced (C_mid, B) grid, for every grid A at once.

    With S = expit(B (log C - log C_mid)) the model is R0 + (A - R0) S, so for d = A - R0
    SSE = d^2 sum(S^2) - 2 d sum(S (y - R0)) + sum((y - R0)^2): the [C_mid, B, points] tensor is
    built once and every A costs a few multiply-adds per grid cell.
    """
    m_lo, m_hi = _log_c_mid_bounds(x)
    m_grid = np.linspace(m_lo, m_hi, config.num_c_mid_grid)
    b_grid = np.geomspace(0.1, 10.0, config.num_b_grid)
    s = expit(b_grid[None, :, None] * (x[None, None, :] - m_grid[:, None, None]))  # [m, b, points]
    gain = y - r0
    s2, sy, yy = np.sum(s * s, axis=-1), np.sum(s * gain, axis=-1), float(np.sum(gain * gain))
    d = (a_grid - r0)[:, None, None]
    sse = (d * d * s2 - 2.0 * d * sy + yy).reshape(a_grid.size, -1)  # [num_a, m * b]
    flat = np.argmin(sse, axis=1)
    i_m, i_b = np.unravel_index(flat, s2.shape)
    return [(float(sse[k, flat[k]]), float(b_grid[i_b[k]]), float(m_grid[i_m[k]]))
            for k in range(a_grid.size)]


def _refine_b_c_mid(x: np.ndarray, y: np.ndarray, r0: float, a: float, b0: float,
                    m0: float) -> tuple[float, float, float]:
    """Least-squares (B, log C_mid) for a fixed A from a coarse start; returns (sse, b, m)."""
    bounds = [LOG_B_BOUNDS, _log_c_mid_bounds(x)]
    sse, natural = _bounded_lm(x, y, r0, np.array([np.log(b0), m0]), bounds, fixed_a=a)
    return sse, float(np.exp(natural[0])), float(natural[1])


def _log_c_mid_bounds(x: np.ndarray) -> tuple[float, float]:
    # C_mid may lie beyond the data: on an early window the midpoint is often not reached yet.
    span = np.ptp(x)
    return float(x.min() - span), float(x.max() + 2.0 * span)


def _bounded_lm(x: np.ndarray, y: np.ndarray, r0: float, start: np.ndarray,
                bounds: list[tuple[float, float]], *, fixed_a: float | None
                ) -> tuple[float, np.ndarray]:
    """Least squares over ([A,] log B, log C_mid) inside `bounds`; returns (sse, natural params).

    Each parameter is v = lo + (hi - lo) * expit(u) with u unconstrained, so MINPACK's
    Levenberg-Marquardt ("lm", compiled, several times faster here than the bounded Python "trf"
    solver) can be used and still never leaves the bounds, even on data the model cannot explain.
    """
    lo = np.array([b[0] for b in bounds])
    span = np.array([b[1] - b[0] for b in bounds])

    def natural(u: np.ndarray) -> np.ndarray:
        return lo + span * expit(u)

    def split(v: np.ndarray) -> tuple[float, float, float]:
        return (fixed_a, *v) if fixed_a is not None else tuple(v)

    def residuals(u: np.ndarray) -> np.ndarray:
        a, log_b, m = split(natural(u))
        return r0 + (a - r0) * expit(np.exp(log_b) * (x - m)) - y

    def jacobian(u: np.ndarray) -> np.ndarray:
        a, log_b, m = split(natural(u))
        b = np.exp(log_b)
        s = expit(b * (x - m))
        ds = (a - r0) * s * (1.0 - s) * b
        columns = [ds * (x - m), -ds]  # d r / d log B, d r / d log C_mid
        if fixed_a is None:
            columns.insert(0, s)  # d r / d A
        sigma = expit(u)
        return np.stack(columns, axis=1) * (span * sigma * (1.0 - sigma))  # [num_points, free]

    # Start strictly inside the bounds: at a bound the squashing has no gradient.
    share = np.clip((start - lo) / span, 1e-3, 1.0 - 1e-3)
    result = least_squares(residuals, np.log(share / (1.0 - share)), jac=jacobian, method="lm",
                           max_nfev=200 * len(bounds))
    return float(2.0 * result.cost), natural(result.x)


def _bootstrap_samples(fit: SigmoidFit, config: SigmoidFitConfig, a_grid: np.ndarray
                       ) -> np.ndarray:
    """Residual-bootstrap replicates of the estimate: [num_bootstrap, (A, B, C_mid)].

    Residual (not case) resampling keeps the compute design of the run, which is what a repeat of
    the same run would share; the paper's seed-to-seed spread (A +-0.015) is the external check.
    Each replicate is one continuous fit of (A, B, C_mid) (or (B, C_mid) with A fixed), with A
    limited to the grid's range. The replicates are drawn around the continuous least-squares
    fit, not the grid one: centred on the grid A they would ignore that the truth is not a grid
    value, and once the noise is small against the A step the intervals would miss the true A
    most of the time. Residuals are centred and scaled by sqrt(n / (n - p)) because fitted
    residuals are smaller than the noise that produced them.
    """
    x = np.log(fit.compute)
    fixed_a = fit.a if fit.a_fixed else None
    bounds = [LOG_B_BOUNDS, _log_c_mid_bounds(x)]
    estimate = [np.log(fit.b), np.log(fit.c_mid)]
    if fixed_a is None:
        bounds.insert(0, (float(a_grid.min()), float(a_grid.max())))
        estimate.insert(0, fit.a)
    # ([A,] log B, log C_mid) of the continuous fit: the bootstrap's "true" curve and the start
    # of every replicate's fit.
    _, centre = _bounded_lm(x, fit.pass_rate, fit.r0, np.array(estimate), bounds, fixed_a=fixed_a)
    fitted = sigmoid_curve(fit.compute, a=fixed_a if fixed_a is not None else centre[0],
                           b=np.exp(centre[-2]), c_mid=np.exp(centre[-1]), r0=fit.r0)
    residuals = fit.pass_rate - fitted
    residuals = (residuals - residuals.mean()) * np.sqrt(
        residuals.size / (residuals.size - len(bounds)))
    rng = np.random.default_rng(config.seed)
    samples = np.empty((config.num_bootstrap, 3))
    for i in range(config.num_bootstrap):
        y_star = fitted + rng.choice(residuals, size=residuals.size, replace=True)
        _, natural = _bounded_lm(x, y_star, fit.r0, centre, bounds, fixed_a=fixed_a)
        a = fixed_a if fixed_a is not None else natural[0]
        samples[i] = (a, np.exp(natural[-2]), np.exp(natural[-1]))
    return samples


def _percentile_intervals(samples: np.ndarray, confidence: float) -> list[tuple[float, float]]:
    """Two-sided percentile interval of each column of `samples` [replicate, parameter]."""
    tail = 100.0 * (1.0 - confidence) / 2.0
    lows, highs = np.percentile(samples, [tail, 100.0 - tail], axis=0)
    return [(float(low), float(high)) for low, high in zip(lows, highs)]
