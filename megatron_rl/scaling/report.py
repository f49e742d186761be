"""What a user asks of fitted curves: does the fit extrapolate, and which recipe is better.

`extrapolation_report` applies the paper's protocol (fit on the points up to a compute budget,
by default half the run, predict the rest, report predicted vs observed at the end), with the
power law fitted on the same window for comparison. `compare_recipes` applies the 0.02 rule: A
values closer than 0.02 are treated as equal (the paper's seed-to-seed spread is +-0.015), both
runs are refitted with their mean A fixed, and the recipes are compared by B; otherwise the higher
A wins. When the mean A is not above a run's R0 (a run that starts about where the other ends),
no curve of that run rises to it: B is not compared and the two are reported equal, saying why.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from megatron_rl.scaling.powerlaw import PowerLawFit, fit_power_law
from megatron_rl.scaling.series import ScalingSeries
from megatron_rl.scaling.sigmoid import SigmoidFit, SigmoidFitConfig, fit_sigmoid

# Paper section 1: A values within 0.02 are treated as equal.
EQUAL_A_TOLERANCE = 0.02


def resolve_r0(series: ScalingSeries, r0: float | None = None) -> float:
    """The explicit R0 if given, else the series' step-0 pass rate; error if neither exists."""
    if r0 is not None:
        return float(r0)
    if series.r0 is None:
        raise ValueError(f"{series.label}: no step-0 (compute 0) point to take R0 from; log a "
                         "validation before the first optimizer step, or pass --r0")
    return series.r0


def fit_series(series: ScalingSeries, *, r0: float | None = None,
               config: SigmoidFitConfig = SigmoidFitConfig(), max_compute: float | None = None,
               fixed_a: float | None = None) -> SigmoidFit:
    """Sigmoid fit of a series, optionally only on points with compute <= max_compute."""
    keep = np.ones(series.num_points, dtype=bool) if max_compute is None else (
        series.compute_gpu_hours <= max_compute)
    try:
        return fit_sigmoid(series.compute_gpu_hours[keep], series.pass_rate[keep],
                           r0=resolve_r0(series, r0), config=config, fixed_a=fixed_a)
    except ValueError as err:
        raise ValueError(f"{series.label}: {err}") from err


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class ExtrapolationReport:
    label: str
    fit_budget: float  # GPU-hours; points up to here were fitted, the rest held out
    sigmoid: SigmoidFit
    power_law: PowerLawFit | None
    held_out_compute: np.ndarray  # [num_held_out]
    held_out_observed: np.ndarray  # [num_held_out]
    held_out_predicted: np.ndarray  # [num_held_out] sigmoid prediction
    held_out_power_law: np.ndarray | None  # [num_held_out] power-law prediction

    @property
    def final_compute(self) -> float:
        return float(self.held_out_compute[-1])

    @property
    def final_observed(self) -> float:
        return float(self.held_out_observed[-1])

    @property
    def final_predicted(self) -> float:
        return float(self.held_out_predicted[-1])

    @property
    def final_error(self) -> float:
        """Predicted minus observed pass rate at the last point of the run."""
        return self.final_predicted - self.final_observed

    @property
    def held_out_rmse(self) -> float:
        return float(np.sqrt(np.mean((self.held_out_predicted - self.held_out_observed) ** 2)))


def extrapolation_report(series: ScalingSeries, *, r0: float | None = None,
                         fit_budget: float | None = None, fit_fraction: float = 0.5,
                         config: SigmoidFitConfig = SigmoidFitConfig(),
                         with_power_law: bool = True) -> ExtrapolationReport:
    """Fit on compute <= fit_budget (default fit_fraction x the run's compute), predict the rest."""
    if series.num_points == 0:
        raise ValueError(f"{series.label}: empty curve")
    total = float(series.compute_gpu_hours[-1])
    if fit_budget is None:
        if not 0.0 < fit_fraction < 1.0:
            raise ValueError(f"fit_fraction={fit_fraction} must be in (0, 1)")
        fit_budget = fit_fraction * total
    held_out = series.compute_gpu_hours > fit_budget
    if not held_out.any():
        raise ValueError(f"{series.label}: no points above the fit budget of {fit_budget:g} "
                         f"GPU-hours (the run ends at {total:g}); lower the budget")
    sigmoid = fit_series(series, r0=r0, config=config, max_compute=fit_budget)
    power_law = None
    if with_power_law:
        window = ~held_out
        power_law = fit_power_law(series.compute_gpu_hours[window], series.pass_rate[window],
                                  warmup_compute=config.warmup_compute)
    compute = series.compute_gpu_hours[held_out]
    return ExtrapolationReport(
        label=series.label, fit_budget=float(fit_budget), sigmoid=sigmoid, power_law=power_law,
        held_out_compute=compute, held_out_observed=series.pass_rate[held_out],
        held_out_predicted=sigmoid.predict(compute),
        held_out_power_law=power_law.predict(compute) if power_law is not None else None)


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class RecipeComparison:
    label_a: str
    label_b: str
    fit_a: SigmoidFit  # free-A fits
    fit_b: SigmoidFit
    a_equal: bool  # |A_a - A_b| < tolerance
    # with the mean A fixed (only when a_equal, and only when the mean A is above both R0)
    refit_a: SigmoidFit | None
    refit_b: SigmoidFit | None
    better: str | None  # label of the better recipe; None when B is equal too
    verdict: str

    @property
    def mean_a(self) -> float:
        return 0.5 * (self.fit_a.a + self.fit_b.a)


def compare_recipes(series_a: ScalingSeries, series_b: ScalingSeries, *,
                    r0_a: float | None = None, r0_b: float | None = None,
                    config: SigmoidFitConfig = SigmoidFitConfig(),
                    tolerance: float = EQUAL_A_TOLERANCE,
                    fits: tuple[SigmoidFit, SigmoidFit] | None = None) -> RecipeComparison:
    """The paper's comparison rule between two runs (see the module docstring).

    `fits`: the free-A fits of both series with this config, if already computed.
    """
    fit_a, fit_b = fits if fits is not None else (fit_series(series_a, r0=r0_a, config=config),
                                                  fit_series(series_b, r0=r0_b, config=config))
    label_a, label_b = series_a.label, series_b.label
    if abs(fit_a.a - fit_b.a) >= tolerance:
        better = label_a if fit_a.a > fit_b.a else label_b
        verdict = (f"A differs by {abs(fit_a.a - fit_b.a):.3f} >= {tolerance}: {better} has the "
                   f"higher asymptote ({fit_a.a:.3f} vs {fit_b.a:.3f})")
        return RecipeComparison(label_a=label_a, label_b=label_b, fit_a=fit_a, fit_b=fit_b,
                                a_equal=False, refit_a=None, refit_b=None, better=better,
                                verdict=verdict)
    mean_a = 0.5 * (fit_a.a + fit_b.a)
    flat = [(label, fit.r0) for label, fit in ((label_a, fit_a), (label_b, fit_b))
            if fit.r0 >= mean_a]
    if flat:  # a refit with A at or below R0 is not a curve (fit_sigmoid refuses it)
        label, r0 = flat[0]
        verdict = (f"A within {tolerance} ({fit_a.a:.3f} vs {fit_b.a:.3f}), but the mean A "
                   f"{mean_a:.4f} is not above the R0 {r0:.3f} of {label}: B cannot be compared "
                   "at a common A; equal")
        return RecipeComparison(label_a=label_a, label_b=label_b, fit_a=fit_a, fit_b=fit_b,
                                a_equal=True, refit_a=None, refit_b=None, better=None,
                                verdict=verdict)
    refit_a = fit_series(series_a, r0=r0_a, config=config, fixed_a=mean_a)
    refit_b = fit_series(series_b, r0=r0_b, config=config, fixed_a=mean_a)
    better = _higher_b(refit_a, refit_b, label_a, label_b)
    prefix = (f"A within {tolerance} ({fit_a.a:.3f} vs {fit_b.a:.3f}); refit with A = "
              f"{mean_a:.4f}: B {refit_a.b:.3f} vs {refit_b.b:.3f}")
    verdict = (f"{prefix}: {better} is more compute-efficient" if better else
               f"{prefix}: equal within the bootstrap intervals")
    return RecipeComparison(label_a=label_a, label_b=label_b, fit_a=fit_a, fit_b=fit_b,
                            a_equal=True, refit_a=refit_a, refit_b=refit_b, better=better,
                            verdict=verdict)


def _higher_b(fit_a: SigmoidFit, fit_b: SigmoidFit, label_a: str, label_b: str) -> str | None:
    """Higher B wins, unless both bootstrap intervals exist and overlap."""
    if fit_a.b_ci is not None and fit_b.b_ci is not None:
        overlap = fit_a.b_ci[0] <= fit_b.b_ci[1] and fit_b.b_ci[0] <= fit_a.b_ci[1]
        if overlap:
            return None
    if fit_a.b == fit_b.b:
        return None
    return label_a if fit_a.b > fit_b.b else label_b
