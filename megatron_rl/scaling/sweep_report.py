"""The report of a sweep (`megatron-rl sweep`, sweep.py): what each variant's runs say, and which
variant is better by the paper's rules.

Per run, the sigmoid fit of its overall ("all") validation curve, and the extrapolation protocol
(fit on the first half of the run's compute, predict its final pass rate), both exactly as
`megatron-rl fit` computes them (report.py, the same fit settings, the runs' own
eval.warmup_compute_gpu_hours). Per variant, the fit of every seed's points pooled into one curve
(R0 the mean of the seeds' step-0 pass rates), and the seed spread of A: the sample standard
deviation (ddof = 1) of the per-seed fitted A values. Ranking: by pooled A, then B; two variants
are indistinguishable in A when |delta A| < max(0.02, the larger seed spread of the two), and are
then compared by B with A fixed at their mean (`compare_recipes`), tied when the B intervals
overlap. Output: console tables, `<output_dir>/sweep.json`, `curves.png` (every run's curve and
fit) and `extrapolation.png` (the pooled fits extended to a target compute).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from rich.table import Table

from megatron_rl.console import print_table, report_console
from megatron_rl.scaling.cli import fit_record, format_value, with_ci
from megatron_rl.scaling.log import OVERALL_TASK, read_scaling_log
from megatron_rl.scaling.report import (EQUAL_A_TOLERANCE, ExtrapolationReport, RecipeComparison,
                                        compare_recipes, extrapolation_report, fit_series)
from megatron_rl.scaling.series import ScalingSeries
from megatron_rl.scaling.sigmoid import SigmoidFit, SigmoidFitConfig

REPORT = "sweep.json"
FIRST_HALF = 0.5  # the paper's protocol: fit on half the compute, predict the rest
TARGET_FACTOR = 10.0  # default extrapolation target: 10x the longest run's compute
SEED_SPREAD = "sample standard deviation (ddof=1) of the per-seed fitted A"


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


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class VariantResult:
    name: str
    overrides: tuple[str, ...]
    runs: tuple[RunResult, ...]
    pooled_series: ScalingSeries | None
    pooled_r0: float | None
    pooled: SigmoidFit | None
    problem: str | None  # why there is no pooled fit

    @property
    def seed_spread(self) -> float | None:
        """SEED_SPREAD; None with fewer than two fitted seeds."""
        values = [r.fit.a for r in self.runs if r.fit is not None]
        return float(np.std(values, ddof=1)) if len(values) >= 2 else None

    @property
    def prediction_errors(self) -> list[float]:
        return [r.first_half.final_error for r in self.runs if r.first_half is not None]


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class Placement:
    """A variant's place in the ranking and how it compares with the one above it."""

    rank: int
    variant: str
    tolerance: float | None  # the |delta A| below which it ties with the one above
    comparison: RecipeComparison | None  # None for the first
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
    """Every seed's points as one curve (ordered by compute) and its R0: the mean of the seeds'
    step-0 pass rates."""
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
    base = dict(name=name, overrides=overrides, runs=tuple(runs))
    try:
        series, r0 = pooled_curve(name, runs)
    except ValueError as err:
        return VariantResult(**base, pooled_series=None, pooled_r0=None, pooled=None,
                             problem=str(err))
    try:
        pooled = fit_series(series, r0=r0, config=config)
    except ValueError as err:
        return VariantResult(**base, pooled_series=series, pooled_r0=r0, pooled=None,
                             problem=str(err))
    return VariantResult(**base, pooled_series=series, pooled_r0=r0, pooled=pooled,
                         problem=None)


def a_tolerance(spread_a: float | None, spread_b: float | None,
                floor: float = EQUAL_A_TOLERANCE) -> float:
    """|delta A| below which two variants are indistinguishable: max(floor, seed spreads)."""
    return max([floor, *(s for s in (spread_a, spread_b) if s is not None)])


def rank_variants(variants: list[VariantResult], config: SigmoidFitConfig,
                  floor: float = EQUAL_A_TOLERANCE) -> list[Placement]:
    """The fitted variants best first: by A, and where neighbours' A are indistinguishable, by B
    with A fixed at their mean; indistinguishable neighbours share a rank."""
    order = sorted((v for v in variants if v.pooled is not None),
                   key=lambda v: (v.pooled.a, v.pooled.b), reverse=True)
    compared: dict[tuple[str, str], RecipeComparison] = {}

    def compare(above: VariantResult, below: VariantResult) -> RecipeComparison:
        key = (above.name, below.name)
        if key not in compared:
            compared[key] = compare_recipes(
                above.pooled_series, below.pooled_series, r0_a=above.pooled_r0,
                r0_b=below.pooled_r0, config=config, fits=(above.pooled, below.pooled),
                tolerance=a_tolerance(above.seed_spread, below.seed_spread, floor))
        return compared[key]

    for _ in range(len(order)):  # within the A tolerance, B decides the order
        swapped = False
        for i in range(len(order) - 1):
            comparison = compare(order[i], order[i + 1])
            if comparison.a_equal and comparison.better == order[i + 1].pooled_series.label:
                order[i], order[i + 1], swapped = order[i + 1], order[i], True
        if not swapped:
            break
    placements: list[Placement] = []
    for i, variant in enumerate(order):
        if i == 0:
            placements.append(Placement(rank=1, variant=variant.name, tolerance=None,
                                        comparison=None, verdict="best"))
            continue
        above = order[i - 1]
        tolerance = a_tolerance(above.seed_spread, variant.seed_spread, floor)
        comparison = compare(above, variant)
        tied = comparison.better is None
        placements.append(Placement(
            rank=placements[-1].rank if tied else i + 1, variant=variant.name,
            tolerance=tolerance, comparison=comparison,
            verdict=_verdict(above, variant, comparison, tolerance, floor)))
    return placements


def _verdict(above: VariantResult, variant: VariantResult, c: RecipeComparison,
             tolerance: float, floor: float) -> str:
    delta = abs(c.fit_a.a - c.fit_b.a)
    rule = f"max({floor}, seed spread) = {tolerance:.3f}"
    above_won = c.better == above.pooled_series.label  # compare_recipes names series
    if not c.a_equal and not above_won:  # not reached by rank_variants' order
        return c.verdict
    if not c.a_equal:
        return (f"below {above.name}: A {c.fit_b.a:.3f} vs {c.fit_a.a:.3f}, |dA| {delta:.3f} "
                f">= {rule}")
    b_text = f"B {c.refit_b.b:.3f} vs {c.refit_a.b:.3f} with A fixed at {c.mean_a:.3f}"
    if c.better is None:
        return (f"indistinguishable from {above.name}: |dA| {delta:.3f} < {rule}, and {b_text} "
                "within the bootstrap intervals")
    if above_won:
        return f"below {above.name}: |dA| {delta:.3f} < {rule}, {b_text}: less compute-efficient"
    # Pairwise B comparisons need not be transitive over three or more variants.
    return (f"below {above.name} by the others' order, though {b_text} favours it "
            f"(|dA| {delta:.3f} < {rule})")


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
        "a_tolerance_floor": EQUAL_A_TOLERANCE,
        "target_compute_gpu_hours": target,
        "variants": [_variant_record(v, target) for v in variants],
        "ranking": [{"rank": p.rank, "variant": p.variant, "a_tolerance": p.tolerance,
                     "verdict": p.verdict} for p in ranking],
        "not_ranked": {v.name: v.problem for v in variants if v.pooled is None},
        "failed": [{"run": r.label, "exit_code": r.exit_code, "log": str(r.log)}
                   for v in variants for r in v.runs if r.failed],
    }


def _variant_record(v: VariantResult, target: float | None) -> dict:
    errors = v.prediction_errors
    return {
        "name": v.name, "overrides": list(v.overrides),
        "pooled": fit_record(v.pooled) if v.pooled is not None else None,
        "pooled_problem": v.problem,
        "a_seed_spread": v.seed_spread,
        "first_half_error_mean": float(np.mean(errors)) if errors else None,
        "first_half_abs_error_mean": float(np.mean(np.abs(errors))) if errors else None,
        "pass_rate_at_target": (float(v.pooled.predict(target)) if v.pooled is not None
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
    return [f"{fit.r0:.3f}", with_ci(fit.a, fit.a_ci, ".3f"), with_ci(fit.b, fit.b_ci, ".3f"),
            with_ci(fit.c_mid, fit.c_mid_ci, "gpu_hours")]


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
        status = "FAILED" if r.failed else "finished"
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
    for column in ("variant", "seeds fitted", "R0", "A", "B", "C_mid (GPU-h)", "A seed spread",
                   "first-half error (mean)", at):
        table.add_column(column, no_wrap=True)
    for v in variants:
        fitted = sum(r.fit is not None for r in v.runs)
        errors = v.prediction_errors
        spread = f"{v.seed_spread:.3f}" if v.seed_spread is not None else "- (1 seed)"
        table.add_row(v.name, f"{fitted}/{len(v.runs)}", *_fit_cells(v.pooled), spread,
                      f"{np.mean(errors):+.3f}" if errors else "-",
                      f"{float(v.pooled.predict(target)):.3f}" if v.pooled is not None
                      and target is not None else (v.problem or "-"))
    return table


def _ranking_table(ranking: list[Placement], variants: list[VariantResult]) -> Table:
    table = Table(title=f"Ranking: A first, then B; indistinguishable when |dA| < "
                        f"max({EQUAL_A_TOLERANCE}, seed spread)")
    for column in ("rank", "variant", "A", "B", "verdict"):
        table.add_column(column, no_wrap=column != "verdict")
    fits = {v.name: v.pooled for v in variants}
    for p in ranking:
        fit = fits[p.variant]
        table.add_row(str(p.rank), p.variant, f"{fit.a:.3f}", f"{fit.b:.3f}", p.verdict)
    for v in variants:
        if v.pooled is None:
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
    dashed up to the target compute."""
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
              for v in variants if v.pooled is not None]
    if pooled:
        written.append(out / "extrapolation.png")
        plot_curves(pooled, written[-1], extend_to=target,
                    title="Each variant's fit pooled over seeds, extrapolated (dashed)")
    return written
