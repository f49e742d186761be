"""Compute-scaling curves (fit, extrapolate, compare, plot), their validation log, and the RLVR
cost model.

Names are re-exported lazily (PEP 562) so that `megatron-rl cost` does not import scipy and the
trainer's `ScalingLog` does not import matplotlib.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "ScalingSeries": "series",
    "ScalingLog": "log",
    "read_scaling_log": "log",
    "SigmoidFit": "sigmoid",
    "SigmoidFitConfig": "sigmoid",
    "fit_sigmoid": "sigmoid",
    "sigmoid_curve": "sigmoid",
    "PowerLawFit": "powerlaw",
    "fit_power_law": "powerlaw",
    "power_law_curve": "powerlaw",
    "ExtrapolationReport": "report",
    "RecipeComparison": "report",
    "compare_recipes": "report",
    "extrapolation_report": "report",
    "fit_series": "report",
    "CurvePlot": "plots",
    "plot_curves": "plots",
    "plot_efficiency": "plots",
    "Accelerator": "hardware",
    "ACCELERATORS": "hardware",
    "CostConfig": "cost",
    "CostReport": "cost",
    "estimate_cost": "cost",
    "PRESETS": "cost",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
