"""PNG figures of fitted curves: the compute-performance plot and the efficiency plot (Fig. 7).

Figures are built with matplotlib's object API on an Agg canvas (no pyplot, no global backend
switch), so plotting works headless and never disturbs a caller's own matplotlib state.
Curve plot: fitted points filled, warm-up points grey, held-out points hollow; the fitted curve is
solid over the fitted compute range and dashed where it extrapolates. Efficiency plot: log F vs
log C with F = C_mid**B / ((A - R0) / (R - R0) - 1), which the model makes exactly C**B: the
observed points should lie on a line of slope B.
"""
from __future__ import annotations

import dataclasses
import os

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from megatron_rl.scaling.powerlaw import PowerLawFit
from megatron_rl.scaling.series import ScalingSeries
from megatron_rl.scaling.sigmoid import SigmoidFit


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CurvePlot:
    """One series with its fit; points above the fit's compute range count as held out."""

    series: ScalingSeries
    fit: SigmoidFit
    power_law: PowerLawFit | None = None
    warmup_compute: float = 0.0


def plot_curves(entries: list[CurvePlot], path: str | os.PathLike, *,
                extend_to: float | None = None, title: str = "Compute-performance curves") -> None:
    """Observed points and fitted curves of every entry on one log-compute axis.

    `extend_to` (GPU-hours) is where the dashed extrapolation stops; default: twice the run.
    """
    fig = Figure(figsize=(11, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = _colors(len(entries))
    for entry, color in zip(entries, colors):
        compute, rate = entry.series.compute_gpu_hours, entry.series.pass_rate
        positive = compute > 0.0
        if entry.fit.no_learning_signal is not None:  # its points, and no curve to believe
            ax.scatter(compute[positive], rate[positive], color=color, s=18, marker="x",
                       label=f"{entry.series.label} (no learning signal)")
            continue
        fit_max = entry.fit.max_compute
        warmup = positive & (compute < entry.warmup_compute)
        fitted = positive & ~warmup & (compute <= fit_max)
        held_out = compute > fit_max
        ax.scatter(compute[fitted], rate[fitted], color=color, s=18, label=entry.series.label)
        ax.scatter(compute[warmup], rate[warmup], color="0.6", s=12)
        ax.scatter(compute[held_out], rate[held_out], facecolors="none", edgecolors=color, s=30,
                   label=f"{entry.series.label} held out" if held_out.any() else None)
        lo = float(compute[positive].min())
        # Dashed beyond the fitted range: to extend_to, or by default to twice the run's compute.
        hi = max(float(compute.max()), extend_to if extend_to is not None else 2 * compute.max())
        inside = np.geomspace(lo, fit_max, 200)
        ax.plot(inside, entry.fit.predict(inside), color=color, lw=1.8,
                label=f"sigmoid A={entry.fit.a:.3f} B={entry.fit.b:.2f} "
                      f"C_mid={entry.fit.c_mid:,.4g}")
        if hi > fit_max:
            beyond = np.geomspace(fit_max, hi, 100)
            ax.plot(beyond, entry.fit.predict(beyond), color=color, lw=1.8, ls="--")
        if entry.power_law is not None:
            grid = np.geomspace(lo, hi, 200)
            ax.plot(grid, entry.power_law.predict(grid), color=color, lw=1.0, ls=":",
                    label=f"power law A={entry.power_law.a:.3f}")
        ax.axhline(entry.fit.a, color=color, lw=0.6, alpha=0.4)
    ax.set_xscale("log")
    ax.set_xlabel("compute (GPU-hours)")
    ax.set_ylabel("validation pass rate")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: never hides data
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")


def efficiency_points(series: ScalingSeries, fit: SigmoidFit) -> tuple[np.ndarray, np.ndarray]:
    """(C, F) of the observed points where F is defined (R0 < R < A, C > 0)."""
    compute, rate = series.compute_gpu_hours, series.pass_rate
    valid = (compute > 0.0) & (rate > fit.r0) & (rate < fit.a)
    c, r = compute[valid], rate[valid]
    f = fit.c_mid ** fit.b / ((fit.a - fit.r0) / (r - fit.r0) - 1.0)
    return c, f


def plot_efficiency(entries: list[CurvePlot], path: str | os.PathLike, *,
                    title: str = "Efficiency: log F vs log C (slope B)") -> None:
    fig = Figure(figsize=(7, 5), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for entry, color in zip(entries, _colors(len(entries))):
        if entry.fit.no_learning_signal is not None:  # no slope to show
            continue
        c, f = efficiency_points(entry.series, entry.fit)
        if c.size == 0:
            continue
        ax.scatter(c, f, color=color, s=16, label=entry.series.label)
        grid = np.geomspace(float(c.min()), float(c.max()), 50)
        ax.plot(grid, grid ** entry.fit.b, color=color, lw=1.5, label=f"slope B={entry.fit.b:.2f}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compute C (GPU-hours)")
    ax.set_ylabel("F = C_mid^B / ((A - R0)/(R - R0) - 1)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png")


def _colors(num: int) -> list[str]:
    cycle = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
             "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]
    return [cycle[i % len(cycle)] for i in range(num)]
