"""`megatron-rl fit RUN_DIR... | CSV...`: fit scaling curves to validation logs, print, plot.

Reads each path with `read_scaling_log` (one curve per task), fits the sigmoid of SCALERL.md
section 1 to every curve and prints one table row per run and task (R0, A, B, C_mid with bootstrap
intervals, points used). Points below the warm-up compute are excluded: `--warmup-gpu-hours`,
else the `eval.warmup_compute_gpu_hours` of the run directories' config.yaml (the recipe the run
wrote), else 0; the run prints which. Optional: the extrapolation protocol (`--fit-fraction` /
`--fit-budget`), the power law on the same points (`--power-law`), and the 0.02-rule comparison
of every curve against the first (`--compare`). Writes curves.png and efficiency.png (and
extrapolation.png) to `--out-dir`, and with `--json PATH` every fit as JSON. A fit that describes
no learning (A within one grid step of R0, B or C_mid at a bound: sigmoid.py) is printed and
written as "no learning signal" with the reason, not as parameters. Bad logs exit with status 2
and one line naming the problem.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from megatron_rl.console import print_table, report_console
from megatron_rl.scaling.log import read_scaling_log
from megatron_rl.scaling.powerlaw import PowerLawFit, fit_power_law
from megatron_rl.scaling.report import (EQUAL_A_TOLERANCE, ExtrapolationReport, RecipeComparison,
                                        compare_recipes, extrapolation_report, fit_series)
from megatron_rl.scaling.series import ScalingSeries
from megatron_rl.scaling.sigmoid import SigmoidFit, SigmoidFitConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-rl fit", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="RUN_DIR|LOG",
                        help="run directories (scaling.jsonl or TensorBoard events), .jsonl or "
                             ".csv files (columns compute_gpu_hours,pass_rate[,task][,step])")
    parser.add_argument("--r0", type=float, default=None,
                        help="pass rate at C=0 for every curve; default: the step-0 point")
    parser.add_argument("--warmup-gpu-hours", type=float, default=None,
                        help="exclude points below this compute (paper: ~1500); default: the "
                             "run directories' config.yaml eval.warmup_compute_gpu_hours, else 0")
    parser.add_argument("--a-min", type=float, default=None,
                        help="lowest A on the grid; default: just above R0")
    parser.add_argument("--a-max", type=float, default=1.0, help="highest A on the grid")
    parser.add_argument("--a-step", type=float, default=0.005, help="A grid step")
    parser.add_argument("--num-bootstrap", type=int, default=200,
                        help="bootstrap replicates for the intervals (0: none)")
    parser.add_argument("--confidence", type=float, default=0.95, help="interval level")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    window = parser.add_mutually_exclusive_group()
    window.add_argument("--fit-fraction", type=float, default=None,
                        help="extrapolation report: fit on this fraction of each run's compute "
                             "(paper: 0.5) and predict the rest")
    window.add_argument("--fit-budget", type=float, default=None,
                        help="extrapolation report: fit on points up to this many GPU-hours")
    parser.add_argument("--power-law", action="store_true",
                        help="also fit R = A - D/C^B on the same points, for comparison")
    parser.add_argument("--compare", action="store_true",
                        help=f"compare every curve with the first (A within "
                             f"{EQUAL_A_TOLERANCE}: refit with mean A, compare B)")
    parser.add_argument("--out-dir", type=Path, default=Path("scaling_fit"),
                        help="where the PNG plots are written")
    parser.add_argument("--no-plots", action="store_true", help="do not write plots")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write every fit (and extrapolation) to PATH as JSON, one "
                             "entry per curve in the order of the paths")
    parser.add_argument("--extend-to", type=float, default=None,
                        help="draw the extrapolated (dashed) curve up to this many GPU-hours "
                             "(default: twice each run's compute)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return _run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"megatron-rl fit: error: {err}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    warmup, source = _warmup_gpu_hours(args.warmup_gpu_hours, args.paths)
    config = SigmoidFitConfig(
        a_min=args.a_min, a_max=args.a_max, a_step=args.a_step,
        warmup_compute=warmup, num_bootstrap=args.num_bootstrap,
        confidence=args.confidence, seed=args.seed)
    series = [s for path in args.paths for s in read_scaling_log(path).values()]
    console = _console()
    console.print(f"warm-up: points below {format_value(warmup, 'gpu_hours')} GPU-hours "
                  f"excluded ({source})")
    start = time.perf_counter()
    fits = [fit_series(s, r0=args.r0, config=config) for s in series]
    power_laws = [fit_power_law(s.compute_gpu_hours, s.pass_rate,
                                warmup_compute=config.warmup_compute) if args.power_law else None
                  for s in series]
    print_table(console, _fit_table(series, fits, power_laws, config))
    for s, fit in zip(series, fits):
        if fit.no_learning_signal is not None:
            console.print(f"{s.label}: {NO_SIGNAL}: {fit.no_learning_signal}")
    reports: list[ExtrapolationReport] = []
    if args.fit_fraction is not None or args.fit_budget is not None:
        reports = [extrapolation_report(s, r0=args.r0, fit_budget=args.fit_budget,
                                        fit_fraction=args.fit_fraction or 0.5, config=config)
                   for s in series]
        print_table(console, _extrapolation_table(reports))
    if args.compare:
        if len(series) < 2:
            raise ValueError("--compare needs at least two curves")
        comparisons = [compare_recipes(series[0], other, r0_a=args.r0, r0_b=args.r0,
                                       config=config, fits=(fits[0], fit))
                       for other, fit in zip(series[1:], fits[1:])]
        print_table(console, _comparison_table(comparisons))
    console.print(f"fitted {len(series)} curve(s) in {time.perf_counter() - start:.2f} s")
    if args.json is not None:
        _write_json(args.json, series, fits, reports, warmup)
        console.print(f"wrote {args.json}")
    if not args.no_plots:
        for path in _write_plots(args, series, fits, power_laws, reports, config):
            console.print(f"wrote {path}")
    return 0


def _warmup_gpu_hours(flag: float | None, paths: list[str]) -> tuple[float, str]:
    """The warm-up compute to exclude and where it came from: the flag, else the
    eval.warmup_compute_gpu_hours of the run directories' config.yaml (which must agree), else
    0."""
    if flag is not None:
        return flag, "--warmup-gpu-hours"
    from megatron_rl.config import ConfigError, load_config

    found: dict[float, list[Path]] = {}
    for path in map(Path, paths):
        recipe = path / "config.yaml"
        if not recipe.is_file():
            continue
        try:
            value = load_config(recipe).eval.warmup_compute_gpu_hours
        except ConfigError as err:
            raise ValueError(f"{recipe}: {err}; pass --warmup-gpu-hours to fit without "
                             "reading it") from None
        found.setdefault(value, []).append(recipe)
    if not found:
        return 0.0, "default: no run directory with a config.yaml"
    if len(found) > 1:
        listed = ", ".join(f"{recipes[0]}: {value:g}" for value, recipes in found.items())
        raise ValueError(f"the runs' eval.warmup_compute_gpu_hours differ ({listed}); curves "
                         "are fitted with one warm-up: pass --warmup-gpu-hours")
    ((value, recipes),) = found.items()
    where = str(recipes[0]) if len(recipes) == 1 else f"{len(recipes)} runs' config.yaml"
    return value, f"eval.warmup_compute_gpu_hours of {where}"


NO_SIGNAL = "no learning signal"


def fit_record(fit: SigmoidFit) -> dict:
    """A fit as JSON: the parameters with their intervals (null without a bootstrap), the
    points used and excluded as warm-up, the RMSE; a fit with no learning signal has the reason
    in `no_learning_signal` and null parameters (they are not findings)."""
    record = {"r0": fit.r0, "a": fit.a, "a_ci": fit.a_ci, "b": fit.b, "b_ci": fit.b_ci,
              "c_mid": fit.c_mid, "c_mid_ci": fit.c_mid_ci, "num_points": fit.num_points,
              "num_warmup_excluded": fit.num_warmup_excluded, "rmse": fit.rmse,
              "no_learning_signal": fit.no_learning_signal}
    if fit.no_learning_signal is not None:
        record.update(dict.fromkeys(("a", "a_ci", "b", "b_ci", "c_mid", "c_mid_ci")))
    return record


def fit_cells(fit: SigmoidFit) -> list[str]:
    """A, B, C_mid with their intervals, or "no learning signal" and dashes (the reason is
    printed below the table)."""
    if fit.no_learning_signal is not None:
        return [NO_SIGNAL, "-", "-"]
    return [with_ci(fit.a, fit.a_ci, ".3f"), with_ci(fit.b, fit.b_ci, ".3f"),
            with_ci(fit.c_mid, fit.c_mid_ci, "gpu_hours")]


def _write_json(path: Path, series: list[ScalingSeries], fits: list[SigmoidFit],
                reports: list[ExtrapolationReport], warmup: float) -> None:
    entries = [{"run": s.run, "task": s.task, "warmup_compute_gpu_hours": warmup,
                "fit": fit_record(f)} for s, f in zip(series, fits)]
    for entry, report in zip(entries, reports):
        entry["extrapolation"] = {
            "fit_budget_gpu_hours": report.fit_budget, "fit": fit_record(report.sigmoid),
            "final_compute_gpu_hours": report.final_compute,
            "observed": report.final_observed, "predicted": report.final_predicted,
            "error": report.final_error}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entries, indent=1) + "\n")


def _console() -> Console:
    # Piped output (CI logs, tests): tables at full width, lines unwrapped (print_table).
    return report_console()


def with_ci(value: float, ci: tuple[float, float] | None, fmt: str) -> str:
    text = format_value(value, fmt)
    if ci is None:
        return text
    return f"{text} [{format_value(ci[0], fmt)}, {format_value(ci[1], fmt)}]"


def format_value(value: float, fmt: str) -> str:
    if fmt == "gpu_hours":  # 12.5, 850, 16,000: no exponent notation for compute
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"
    return format(value, fmt)


def _fit_table(series: list[ScalingSeries], fits: list[SigmoidFit],
               power_laws: list[PowerLawFit | None], config: SigmoidFitConfig) -> Table:
    level = f"{round(100 * config.confidence)}% CI" if config.num_bootstrap else "no CI"
    table = Table(title=f"Sigmoid fits, R0 fixed ({level})")
    for column in ("run", "task", "R0", "A", "B", "C_mid (GPU-h)", "points", "warm-up excl.",
                   "RMSE"):
        table.add_column(column, no_wrap=True)
    if any(power_laws):
        table.add_column("power-law A", no_wrap=True)
    for s, fit, power_law in zip(series, fits, power_laws):
        row = [s.run, s.task, f"{fit.r0:.3f}", *fit_cells(fit),
               str(fit.num_points), str(fit.num_warmup_excluded), f"{fit.rmse:.4f}"]
        if any(power_laws):
            row.append(f"{power_law.a:.3f}" if power_law else "-")
        table.add_row(*row)
    return table


def _extrapolation_table(reports: list[ExtrapolationReport]) -> Table:
    table = Table(title="Extrapolation: fit up to the budget, predict the end of the run")
    for column in ("curve", "fit budget (GPU-h)", "points fitted", "A (window)",
                   "power-law A (window)", "end (GPU-h)", "observed", "predicted",
                   "error", "power-law predicted", "held-out RMSE"):
        table.add_column(column, no_wrap=True)
    for r in reports:
        power_law_a = f"{r.power_law.a:.3f}" if r.power_law else "-"
        power_law_end = (f"{r.held_out_power_law[-1]:.3f}" if r.held_out_power_law is not None
                         else "-")
        window_a = NO_SIGNAL if r.sigmoid.no_learning_signal else f"{r.sigmoid.a:.3f}"
        table.add_row(r.label, format_value(r.fit_budget, "gpu_hours"),
                      str(r.sigmoid.num_points), window_a, power_law_a,
                      format_value(r.final_compute, "gpu_hours"),
                      f"{r.final_observed:.3f}", f"{r.final_predicted:.3f}",
                      f"{r.final_error:+.3f}", power_law_end, f"{r.held_out_rmse:.4f}")
    return table


def _comparison_table(comparisons: list[RecipeComparison]) -> Table:
    table = Table(title=f"Recipe comparison (A within {EQUAL_A_TOLERANCE} -> same A, compare B)")
    for column in ("curve a", "curve b", "A a", "A b", "A equal", "B a (A fixed)",
                   "B b (A fixed)", "better", "verdict"):
        table.add_column(column, no_wrap=column != "verdict")
    for c in comparisons:
        b_a = with_ci(c.refit_a.b, c.refit_a.b_ci, ".3f") if c.refit_a else "-"
        b_b = with_ci(c.refit_b.b, c.refit_b.b_ci, ".3f") if c.refit_b else "-"
        a_a, a_b = (NO_SIGNAL if f.no_learning_signal else f"{f.a:.3f}" for f in (c.fit_a, c.fit_b))
        table.add_row(c.label_a, c.label_b, a_a, a_b,
                      "yes" if c.a_equal else "no", b_a, b_b, c.better or "tie", c.verdict)
    return table


def _write_plots(args: argparse.Namespace, series: list[ScalingSeries], fits: list[SigmoidFit],
                 power_laws: list[PowerLawFit | None], reports: list[ExtrapolationReport],
                 config: SigmoidFitConfig) -> list[Path]:
    # Imported here: matplotlib costs ~1 s to import and --no-plots should not pay for it.
    from megatron_rl.scaling.plots import CurvePlot, plot_curves, plot_efficiency

    args.out_dir.mkdir(parents=True, exist_ok=True)
    entries = [CurvePlot(series=s, fit=f, power_law=p, warmup_compute=config.warmup_compute)
               for s, f, p in zip(series, fits, power_laws)]
    written = [args.out_dir / "curves.png", args.out_dir / "efficiency.png"]
    plot_curves(entries, written[0], extend_to=args.extend_to)
    plot_efficiency(entries, written[1])
    if reports:
        window_entries = [CurvePlot(series=s, fit=r.sigmoid, power_law=r.power_law,
                                    warmup_compute=config.warmup_compute)
                          for s, r in zip(series, reports)]
        written.append(args.out_dir / "extrapolation.png")
        plot_curves(window_entries, written[-1], extend_to=args.extend_to,
                    title="Extrapolation: fitted on the budget (solid), predicted (dashed)")
    return written
