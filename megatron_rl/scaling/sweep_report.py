"""The report of a sweep (`megatron-rl sweep`, sweep.py): what each variant's runs say, and which
variant is better by the paper's rules, with the seeds as the unit of replication.

Per run, the sigmoid fit of its overall ("all") validation curve, and the extrapolation protocol
(fit on the first half of the run's compute, predict its final pass rate), both exactly as
`megatron-rl fit` computes them (report.py, the same fit settings, the runs' own
eval.warmup_compute_gpu_hours). A run enters the ranking statistics unless it failed (its curve
is cut short where it failed), has no fit, or its fit shows no learning signal (sigmoid.py); the
report names every run it leaves out and why. Per variant, the fit of the points of every run that
did not fail, pooled into one curve (R0 the mean of their step-0 pass rates), and the seed spread
of A: the sample standard deviation (ddof = 1) of the ranked runs' fitted A. A pooled fit with no
learning signal leaves its variant unranked.

Ranking: by pooled A, then B. Two variants differ in A when |delta A| >= max(0.02, the larger
seed spread of the two) and, with two or more ranked seeds each, Welch's t-test on their per-seed
A rejects equality; otherwise they are compared by B with A fixed at the mean of their pooled A:
with two or more ranked seeds each, by Welch's t-test on the per-seed log B (each seed refitted
with that A), else by the pooled refits' bootstrap intervals (which leave seed-to-seed variation
out), and they tie (share a rank) when B does not differ. The A and the B test each run at half of
1 - confidence, so that two variants that differ only by chance are ranked apart in at most
1 - confidence of comparisons. Output: console tables, `<output_dir>/sweep.json`, `curves.png`
(every run's curve and fit) and `extrapolation.png` (the pooled fits extended to a target
compute).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from rich.table import Table
from scipy.stats import ttest_ind

from megatron_rl.console import print_table, report_console
from megatron_rl.scaling.cli import NO_SIGNAL, fit_cells, fit_record, format_value
from megatron_rl.scaling.log import OVERALL_TASK, read_scaling_log
from megatron_rl.scaling.report import (EQUAL_A_TOLERANCE, ExtrapolationReport, RecipeComparison,
                                        compare_recipes, extrapolation_report, fit_series)
from megatron_rl.scaling.series import ScalingSeries
from megatron_rl.scaling.sigmoid import SigmoidFit, SigmoidFitConfig

REPORT = "sweep.json"
FIRST_HALF = 0.5  # the paper's protocol: fit on half the compute, predict the rest
TARGET_FACTOR = 10.0  # default extrapolation target: 10x the longest run's compute
SEED_SPREAD = "sample standard deviation (ddof=1) of the ranked seeds' fitted A"
SEED_TEST = ("Welch's t-test (scipy.stats.ttest_ind, equal_var=False) on the ranked seeds' A, "
             "then on their log B with A fixed at the pair's mean pooled A, each at level "
             "(1 - confidence) / 2; fewer than 2 ranked seeds in a variant: the A tolerance "
             "alone, and B by the pooled refits' bootstrap intervals")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class RunResult:
    """One (variant, seed) run: its curve and fits, or why there are none."""

    variant: str
    seed: int
    output_dir: Path
    log: Path
    failed: bool
    exit_code: int | None  # of this sweep's last attempt; None: not run by it
    wall_seconds: float | None  # every attempt of the sweep together
    series: ScalingSeries | None = None
    fit: SigmoidFit | None = None
    first_half: ExtrapolationReport | None = None
    problem: str | None = None  # why there is no curve / fit
    first_half_problem: str | None = None

    @property
    def label(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    @property
    def excluded(self) -> str | None:
        """Why the run's fit does not enter the ranking statistics (seed spread, per-seed
        tests), or None. A failed run's points are left out of the pooled fit too."""
        if self.failed:
            return f"failed (exit status {self.exit_code}): its curve stops where it failed"
        if self.fit is None:
            return self.problem or "no fit"
        if self.fit.no_learning_signal is not None:
            return f"{NO_SIGNAL}: {self.fit.no_learning_signal}"
        return None


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class VariantResult:
    name: str
    overrides: tuple[str, ...]
    runs: tuple[RunResult, ...]
    pooled_series: ScalingSeries | None
    pooled_r0: float | None
    pooled: SigmoidFit | None
    problem: str | None  # why the variant is not ranked (no pooled fit, or no learning signal)

    @property
    def ranked_runs(self) -> tuple[RunResult, ...]:
        return tuple(r for r in self.runs if r.excluded is None)

    @property
    def seed_spread(self) -> float | None:
        """SEED_SPREAD; None with fewer than two ranked seeds."""
        values = [r.fit.a for r in self.ranked_runs]
        return float(np.std(values, ddof=1)) if len(values) >= 2 else None

    @property
    def prediction_errors(self) -> list[float]:
        return [r.first_half.final_error for r in self.runs if r.first_half is not None]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SeedTest:
    """Welch's t-test of two variants' per-seed values (`what`): they differ when p < level."""

    what: str
    above: tuple[float, ...]
    below: tuple[float, ...]
    p_value: float
    level: float

    @property
    def differ(self) -> bool:
        return self.p_value < self.level

    def record(self) -> dict:
        return {"what": self.what, "above": list(self.above), "below": list(self.below),
                "p_value": self.p_value, "level": self.level}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class VariantComparison:
    """Two neighbours of the ranking: the pooled fits (A, and B with A fixed at their mean) and
    the per-seed tests where both variants have two or more ranked seeds."""

    above: str
    below: str
    pooled: RecipeComparison  # fit_a: above's pooled fit, fit_b: below's
    tolerance: float  # max(floor, seed spreads)
    a_test: SeedTest | None
    b_test: SeedTest | None
    b_problem: str | None  # why B was not compared (the mean A is not above a seed's R0)
    a_equal: bool
    better: str | None  # the better variant's name; None: indistinguishable


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Placement:
    """A variant's place in the ranking and how it compares with the one above it."""

    rank: int
    variant: str
    tolerance: float | None  # the |delta A| below which it ties with the one above
    comparison: VariantComparison | None  # None for the first
    verdict: str


def run_result(run, config: SigmoidFitConfig, *, failed: bool, exit_code: int | None,
               wall_seconds: float | None) -> RunResult:
    """The fits of one sweep run (a sweep.SweepRun) from its scaling log, as `megatron-rl fit`
    makes them."""
    result = RunResult(variant=run.variant, seed=run.seed, output_dir=run.output_dir,
                       log=run.log, failed=failed, exit_code=exit_code,
                       wall_seconds=wall_seconds)
    try:
        series = read_scaling_log(run.output_dir)[OVERALL_TASK]
    except (ValueError, FileNotFoundError, KeyError) as err:
        problem = f"no {OVERALL_TASK!r} curve" if isinstance(err, KeyError) else str(err)
        return dataclasses.replace(result, problem=problem)
    result = dataclasses.replace(result, series=series)
    try:
        result = dataclasses.replace(result, fit=fit_series(series, config=config))
    except ValueError as err:
        return dataclasses.replace(result, problem=str(err))
    try:
        first_half = extrapolation_report(series, config=config, fit_fraction=FIRST_HALF,
                                          with_power_law=False)
    except ValueError as err:
        return dataclasses.replace(result, first_half_problem=str(err))
    return dataclasses.replace(result, first_half=first_half)


def pooled_curve(name: str, runs: list[RunResult]) -> tuple[ScalingSeries, float]:
    """Every given run's points as one curve (ordered by compute) and its R0: the mean of the
    runs' step-0 pass rates."""
    curves = [r.series for r in runs if r.series is not None]
    if not curves:
        raise ValueError("no run has a validation curve")
    starts = [s.r0 for s in curves if s.r0 is not None]
    if len(starts) != len(curves):
        raise ValueError("a seed's curve has no step-0 point to take R0 from; validate at step 0 "
                         "(eval.at_step_zero)")
    compute = np.concatenate([s.compute_gpu_hours for s in curves])
    rate = np.concatenate([s.pass_rate for s in curves])
    order = np.argsort(compute, kind="stable")
    return (ScalingSeries(run=name, task=OVERALL_TASK, compute_gpu_hours=compute[order],
                          pass_rate=rate[order]), float(np.mean(starts)))


def variant_result(name: str, overrides: tuple[str, ...], runs: list[RunResult],
                   config: SigmoidFitConfig) -> VariantResult:
    """The variant's pooled fit over its runs that did not fail (a failed run's curve is cut
    short, and would pull the pooled curve towards its early points)."""
    base = dict(name=name, overrides=overrides, runs=tuple(runs))
    with_curve = [r for r in runs if r.series is not None]
    pooled_runs = [r for r in with_curve if not r.failed]
    if with_curve and not pooled_runs:
        return VariantResult(**base, pooled_series=None, pooled_r0=None, pooled=None,
                             problem="every run with a curve failed (failed runs are left out "
                             f"of the ranking): {', '.join(r.label for r in with_curve)}")
    try:
        series, r0 = pooled_curve(name, pooled_runs)
    except ValueError as err:
        return VariantResult(**base, pooled_series=None, pooled_r0=None, pooled=None,
                             problem=str(err))
    try:
        pooled = fit_series(series, r0=r0, config=config)
    except ValueError as err:
        return VariantResult(**base, pooled_series=series, pooled_r0=r0, pooled=None,
                             problem=str(err))
    problem = (f"{NO_SIGNAL} in the pooled fit: {pooled.no_learning_signal}"
               if pooled.no_learning_signal is not None else None)
    return VariantResult(**base, pooled_series=series, pooled_r0=r0, pooled=pooled,
                         problem=problem)


def a_tolerance(spread_a: float | None, spread_b: float | None,
                floor: float = EQUAL_A_TOLERANCE) -> float:
    """|delta A| below which two variants are indistinguishable: max(floor, seed spreads)."""
    return max([floor, *(s for s in (spread_a, spread_b) if s is not None)])


def seed_test(what: str, above: list[float], below: list[float], level: float
              ) -> SeedTest | None:
    """Welch's t-test of two sets of per-seed values; None with fewer than two in either."""
    if len(above) < 2 or len(below) < 2:
        return None
    p_value = float(ttest_ind(above, below, equal_var=False).pvalue)
    if not math.isfinite(p_value):  # no spread on either side: equal means are no evidence
        p_value = 1.0 if np.mean(above) == np.mean(below) else 0.0
    return SeedTest(what=what, above=tuple(map(float, above)), below=tuple(map(float, below)),
                    p_value=p_value, level=level)


def compare_variants(above: VariantResult, below: VariantResult, config: SigmoidFitConfig,
                     floor: float = EQUAL_A_TOLERANCE) -> VariantComparison:
    """The ranking rule (module docstring) between two ranked variants, `above` having the
    higher (or equal) pooled A."""
    level = (1.0 - config.confidence) / 2.0  # the A and the B test share 1 - confidence
    tolerance = a_tolerance(above.seed_spread, below.seed_spread, floor)
    delta = abs(above.pooled.a - below.pooled.a)
    a_test = seed_test("A", [r.fit.a for r in above.ranked_runs],
                       [r.fit.a for r in below.ranked_runs], level)
    a_equal = delta < tolerance or (a_test is not None and not a_test.differ)
    # compare_recipes decides A by its tolerance: inf makes it refit both at the mean A.
    pooled = compare_recipes(above.pooled_series, below.pooled_series, r0_a=above.pooled_r0,
                             r0_b=below.pooled_r0, config=config, fits=(above.pooled, below.pooled),
                             tolerance=math.inf if a_equal else tolerance)
    result = dict(above=above.name, below=below.name, pooled=pooled, tolerance=tolerance,
                  a_test=a_test, a_equal=a_equal)
    if not a_equal:
        better = above.name if above.pooled.a >= below.pooled.a else below.name
        return VariantComparison(**result, b_test=None, b_problem=None, better=better)
    if pooled.refit_a is None:  # the mean A is not above a pooled R0
        flat = above if above.pooled_r0 >= pooled.mean_a else below
        b_problem = (f"the mean A {pooled.mean_a:.4f} is not above the R0 {flat.pooled_r0:.3f} "
                     f"of {flat.name}: B cannot be compared at a common A")
        return VariantComparison(**result, b_test=None, b_problem=b_problem, better=None)
    b_test, b_problem = _seed_b_test(above, below, pooled.mean_a, config, level)
    if b_problem is not None:
        better = None
    elif b_test is not None:
        higher = above.name if np.mean(b_test.above) > np.mean(b_test.below) else below.name
        better = higher if b_test.differ else None
    else:  # fewer than two ranked seeds: the pooled fits' bootstrap intervals
        better = {pooled.label_a: above.name, pooled.label_b: below.name}.get(pooled.better)
    return VariantComparison(**result, b_test=b_test, b_problem=b_problem, better=better)


def _seed_b_test(above: VariantResult, below: VariantResult, mean_a: float,
                 config: SigmoidFitConfig, level: float) -> tuple[SeedTest | None, str | None]:
    """Welch's t-test on the ranked seeds' log B, each seed refitted with A = mean_a (no
    bootstrap: the seeds are the replicates); (None, None) with fewer than two seeds each, (None,
    why) when a seed starts at or above mean_a."""
    if len(above.ranked_runs) < 2 or len(below.ranked_runs) < 2:
        return None, None
    refit = dataclasses.replace(config, num_bootstrap=0)
    log_b: dict[str, list[float]] = {}
    for variant in (above, below):
        for run in variant.ranked_runs:
            if run.fit.r0 >= mean_a:
                return None, (f"the mean A {mean_a:.4f} is not above the R0 {run.fit.r0:.3f} of "
                              f"{run.label}: B cannot be compared at a common A")
            fit = fit_series(run.series, config=refit, fixed_a=mean_a)
            log_b.setdefault(variant.name, []).append(float(np.log(fit.b)))
    return seed_test(f"log B (A fixed at {mean_a:.4f})", log_b[above.name], log_b[below.name],
                     level), None


def rank_variants(variants: list[VariantResult], config: SigmoidFitConfig,
                  floor: float = EQUAL_A_TOLERANCE) -> list[Placement]:
    """The ranked variants (a pooled fit with a learning signal) best first: by A, and where
    neighbours' A are indistinguishable, by B with A fixed at their mean; indistinguishable
    neighbours share a rank."""
    order = sorted((v for v in variants if v.pooled is not None and v.problem is None),
                   key=lambda v: (v.pooled.a, v.pooled.b), reverse=True)
    compared: dict[tuple[str, str], VariantComparison] = {}

    def compare(above: VariantResult, below: VariantResult) -> VariantComparison:
        key = (above.name, below.name)
        if key not in compared:
            compared[key] = compare_variants(above, below, config, floor)
        return compared[key]

    for _ in range(len(order)):  # within the A tolerance, B decides the order
        swapped = False
        for i in range(len(order) - 1):
            comparison = compare(order[i], order[i + 1])
            if comparison.a_equal and comparison.better == order[i + 1].name:
                order[i], order[i + 1], swapped = order[i + 1], order[i], True
        if not swapped:
            break
    placements: list[Placement] = []
    for i, variant in enumerate(order):
        if i == 0:
            placements.append(Placement(rank=1, variant=variant.name, tolerance=None,
                                        comparison=None, verdict="best"))
            continue
        comparison = compare(order[i - 1], variant)
        tied = comparison.better is None
        placements.append(Placement(
            rank=placements[-1].rank if tied else i + 1, variant=variant.name,
            tolerance=comparison.tolerance, comparison=comparison,
            verdict=_verdict(comparison, floor)))
    return placements


def _p(test: SeedTest) -> str:
    return f"Welch p = {test.p_value:.3g}, level {test.level:g}"


def _verdict(c: VariantComparison, floor: float) -> str:
    fit_above, fit_below = c.pooled.fit_a, c.pooled.fit_b
    delta = abs(fit_above.a - fit_below.a)
    rule = f"max({floor}, seed spread) = {c.tolerance:.3f}"
    a_text = f"|dA| {delta:.3f} {'<' if delta < c.tolerance else '>='} {rule}"
    if c.a_test is not None:
        a_text += (f", per-seed A {'differ' if c.a_test.differ else 'do not differ'} "
                   f"({_p(c.a_test)})")
    if not c.a_equal:
        return f"below {c.above}: A {fit_below.a:.3f} vs {fit_above.a:.3f}, {a_text}"
    if c.b_test is not None:
        b_text = (f"per-seed B with A fixed at {c.pooled.mean_a:.3f}: geometric mean "
                  f"{np.exp(np.mean(c.b_test.below)):.3f} vs {np.exp(np.mean(c.b_test.above)):.3f}"
                  f" ({_p(c.b_test)})")
    elif c.b_problem is not None:
        b_text = c.b_problem
    else:
        b_text = (f"B {c.pooled.refit_b.b:.3f} vs {c.pooled.refit_a.b:.3f} with A fixed at "
                  f"{c.pooled.mean_a:.3f} (pooled fits' bootstrap intervals: fewer than 2 ranked "
                  "seeds, so seed-to-seed variation is left out)")
    if c.better is None:
        return f"indistinguishable from {c.above}: {a_text}; {b_text}"
    if c.better == c.above:
        return f"below {c.above}: {a_text}; {b_text}: less compute-efficient"
    # Pairwise B comparisons need not be transitive over three or more variants.
    return f"below {c.above} by the others' order, though {b_text} favours it ({a_text})"


# ----------------------------------------------------------------------------- the report

def report_sweep(spec, runs, *, failed: dict[str, int], wall_seconds: dict[str, float],
                 plots: bool = True, config: SigmoidFitConfig | None = None) -> dict:
    """Fit, rank, print the tables, write sweep.json (and the plots); returns sweep.json's
    content. `spec` and `runs` are sweep.py's SweepSpec and SweepRuns."""
    warmup = runs[0].config.eval.warmup_compute_gpu_hours  # one for all (checked by the plan)
    config = config or SigmoidFitConfig(warmup_compute=warmup)
    results = [run_result(run, config, failed=run.label in failed,
                          exit_code=failed.get(run.label), wall_seconds=wall_seconds.get(
                              run.label)) for run in runs]
    variants = [variant_result(name, overrides, [r for r in results if r.variant == name],
                               config) for name, overrides in spec.variants.items()]
    ranking = rank_variants(variants, config)
    ends = [float(r.series.compute_gpu_hours[-1]) for r in results if r.series is not None]
    target = spec.target_compute_gpu_hours or (TARGET_FACTOR * max(ends) if ends else None)
    out = Path(spec.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    content = sweep_record(spec, variants, ranking, config, target)
    (out / REPORT).write_text(json.dumps(content, indent=1) + "\n")
    console = report_console()
    console.print(f"warm-up: points below {format_value(warmup, 'gpu_hours')} GPU-hours excluded "
                  f"(eval.warmup_compute_gpu_hours of the runs)")
    for table in (_run_table(results, config), _variant_table(variants, target, config),
                  _ranking_table(ranking, variants)):
        print_table(console, table)
    for r in results:
        if r.failed:
            console.print(f"FAILED: {r.label} (exit status {r.exit_code}); log: {r.log}")
    for r in results:
        if r.excluded is not None:
            console.print(f"left out of the ranking statistics: {r.label}: {r.excluded}")
    for v in variants:
        if v.problem is not None:
            console.print(f"not ranked: {v.name}: {v.problem}")
    console.print(f"wrote {out / REPORT}")
    if plots:
        for path in write_plots(out, results, variants, config, target):
            console.print(f"wrote {path}")
    return content


def sweep_record(spec, variants: list[VariantResult], ranking: list[Placement],
                 config: SigmoidFitConfig, target: float | None) -> dict:
    """sweep.json: everything the tables show, with full precision."""
    return {
        "name": spec.name, "base": spec.base, "output_dir": spec.output_dir,
        "overrides": list(spec.overrides), "seeds": list(spec.seeds),
        "budget": ({"steps": spec.budget_steps} if spec.budget_steps is not None
                   else {"compute_gpu_hours": spec.budget_compute_gpu_hours}),
        "task": OVERALL_TASK,
        "fit": {"warmup_compute_gpu_hours": config.warmup_compute,
                "num_bootstrap": config.num_bootstrap, "confidence": config.confidence,
                "bootstrap_seed": config.seed, "a_step": config.a_step,
                "first_half_fraction": FIRST_HALF},
        "seed_spread": SEED_SPREAD,
        "seed_test": SEED_TEST,
        "a_tolerance_floor": EQUAL_A_TOLERANCE,
        "target_compute_gpu_hours": target,
        "variants": [_variant_record(v, target) for v in variants],
        "ranking": [_placement_record(p) for p in ranking],
        "not_ranked": {v.name: v.problem for v in variants if v.problem is not None},
        "failed": [{"run": r.label, "exit_code": r.exit_code, "log": str(r.log)}
                   for v in variants for r in v.runs if r.failed],
    }


def _placement_record(p: Placement) -> dict:
    c = p.comparison
    return {"rank": p.rank, "variant": p.variant, "a_tolerance": p.tolerance,
            "a_equal": None if c is None else c.a_equal,
            "a_seed_test": None if c is None or c.a_test is None else c.a_test.record(),
            "b_seed_test": None if c is None or c.b_test is None else c.b_test.record(),
            "verdict": p.verdict}


def _variant_record(v: VariantResult, target: float | None) -> dict:
    errors = v.prediction_errors
    return {
        "name": v.name, "overrides": list(v.overrides),
        "pooled": fit_record(v.pooled) if v.pooled is not None else None,
        "pooled_problem": v.problem,
        "seeds_ranked": [r.label for r in v.ranked_runs],
        "excluded_from_ranking": {r.label: r.excluded for r in v.runs if r.excluded is not None},
        "a_seed_spread": v.seed_spread,
        "first_half_error_mean": float(np.mean(errors)) if errors else None,
        "first_half_abs_error_mean": float(np.mean(np.abs(errors))) if errors else None,
        "pass_rate_at_target": (float(v.pooled.predict(target)) if v.problem is None
                                and target is not None else None),
        "runs": [_run_record(r) for r in v.runs],
    }


def _run_record(r: RunResult) -> dict:
    half = r.first_half
    return {
        "run": r.label, "seed": r.seed, "output_dir": str(r.output_dir), "log": str(r.log),
        "status": "failed" if r.failed else "finished", "exit_code": r.exit_code,
        "wall_seconds": r.wall_seconds,
        "final_step": int(r.series.step[-1]) if r.series is not None else None,
        "final_compute_gpu_hours": (float(r.series.compute_gpu_hours[-1])
                                    if r.series is not None else None),
        "final_pass_rate": float(r.series.pass_rate[-1]) if r.series is not None else None,
        "fit": fit_record(r.fit) if r.fit is not None else None,
        "problem": r.problem,
        "excluded_from_ranking": r.excluded,
        "first_half": None if half is None else {
            "fit_budget_gpu_hours": half.fit_budget, "points_fitted": half.sigmoid.num_points,
            "a": half.sigmoid.a, "predicted": half.final_predicted,
            "observed": half.final_observed, "error": half.final_error},
        "first_half_problem": r.first_half_problem,
    }


def _level(config: SigmoidFitConfig) -> str:
    return f"{round(100 * config.confidence)}% CI" if config.num_bootstrap else "no CI"


def _fit_cells(fit: SigmoidFit | None) -> list[str]:
    if fit is None:
        return ["-"] * 4
    return [f"{fit.r0:.3f}", *fit_cells(fit)]


def _run_table(results: list[RunResult], config: SigmoidFitConfig) -> Table:
    table = Table(title=f"Runs: sigmoid fit of each seed ({_level(config)}) and the final pass "
                        "rate predicted from the first half of its compute")
    for column in ("run", "R0", "A", "B", "C_mid (GPU-h)", "points", "final", "predicted",
                   "error", "wall time", "status"):
        table.add_column(column, no_wrap=True)
    for r in results:
        half = r.first_half
        final = f"{r.series.pass_rate[-1]:.3f}" if r.series is not None else "-"
        predicted = (f"{half.final_predicted:.3f}", f"{half.final_error:+.3f}") if half else (
            "-", "-")
        status = "FAILED; not in the ranking" if r.failed else "finished"
        note = r.problem or r.first_half_problem
        table.add_row(r.label, *_fit_cells(r.fit), str(r.fit.num_points) if r.fit else "-",
                      final, *predicted, _duration(r.wall_seconds),
                      f"{status}; {note}" if note else status)
    return table


def _variant_table(variants: list[VariantResult], target: float | None,
                   config: SigmoidFitConfig) -> Table:
    table = Table(title=f"Variants: fit pooled over seeds ({_level(config)}); seed spread = "
                        f"{SEED_SPREAD}")
    at = f"at {format_value(target, 'gpu_hours')} GPU-h" if target is not None else "at target"
    for column in ("variant", "seeds ranked", "R0", "A", "B", "C_mid (GPU-h)", "A seed spread",
                   "first-half error (mean)", at):
        table.add_column(column, no_wrap=True)
    for v in variants:
        errors = v.prediction_errors
        num_ranked = len(v.ranked_runs)
        spread = (f"{v.seed_spread:.3f}" if v.seed_spread is not None
                  else f"- ({num_ranked} seed{'' if num_ranked == 1 else 's'})")
        table.add_row(v.name, f"{len(v.ranked_runs)}/{len(v.runs)}", *_fit_cells(v.pooled),
                      spread, f"{np.mean(errors):+.3f}" if errors else "-",
                      f"{float(v.pooled.predict(target)):.3f}" if v.problem is None
                      and target is not None else (v.problem or "-"))
    return table


def _ranking_table(ranking: list[Placement], variants: list[VariantResult]) -> Table:
    table = Table(title=f"Ranking: A first, then B; A indistinguishable when |dA| < "
                        f"max({EQUAL_A_TOLERANCE}, seed spread) or the per-seed A do not differ "
                        "(Welch); B by the per-seed B (Welch)")
    for column in ("rank", "variant", "A", "B", "verdict"):
        table.add_column(column, no_wrap=column != "verdict")
    fits = {v.name: v.pooled for v in variants}
    for p in ranking:
        fit = fits[p.variant]
        table.add_row(str(p.rank), p.variant, f"{fit.a:.3f}", f"{fit.b:.3f}", p.verdict)
    for v in variants:
        if v.problem is not None:
            table.add_row("-", v.name, "-", "-", f"not ranked: {v.problem}")
    return table


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def write_plots(out: Path, results: list[RunResult], variants: list[VariantResult],
                config: SigmoidFitConfig, target: float | None) -> list[Path]:
    """curves.png: every run's points and fit; extrapolation.png: each variant's pooled fit,
    dashed up to the target compute. A fit without a learning signal shows its points only."""
    # Imported here: matplotlib costs ~1 s to import.
    from megatron_rl.scaling.plots import CurvePlot, plot_curves

    written = []
    runs = [CurvePlot(series=dataclasses.replace(r.series, run=r.label.replace("/", " ")),
                      fit=r.fit, warmup_compute=config.warmup_compute)
            for r in results if r.fit is not None]
    if runs:
        written.append(out / "curves.png")
        plot_curves(runs, written[-1], extend_to=target,
                    title="Every run of the sweep: points and sigmoid fit")
    pooled = [CurvePlot(series=v.pooled_series, fit=v.pooled, warmup_compute=config.warmup_compute)
              for v in variants if v.pooled is not None and v.pooled_series is not None]
    if pooled:
        written.append(out / "extrapolation.png")
        plot_curves(pooled, written[-1], extend_to=target,
                    title="Each variant's fit pooled over seeds, extrapolated (dashed)")
    return written
