"""Fit the cost model's per-step decode floor (scaling/cost.py: decode_layer_overhead_us,
decode_tp_layer_overhead_us) once, to the SGLang batch-1 decode speeds of
../shared/ANCHOR_FIGURES.md section 19 (Qwen's speed benchmark: SGLang 0.4.6.post1 on H20,
QwenLM/Qwen2.5 docs/source/getting_started/speed_benchmark.md @ac727245), and print the fitted
knobs, each row's published against modelled speed, and the long-input rows as a check of the
context term.

    PYTHONPATH=. python benchmarks/decode_floor_fit.py

The published speed counts prompt + generated tokens over the whole request, so a row's decode
step is ((input + 2048) / speed - prefill) / 2048, the prefill as the cost model computes it
(2N per input token at prefill_mfu). The roofline part of a step is `cost.decode_step` with the
floor knobs at 0 (batch 1, the mean context input + 1024); the floor is num_layers x (a + b when
the engine has > 1 device). Least squares on the relative step-time error, so every row weighs
the same in tok/s. The single-knob form (b = 0) is printed beside it: its residuals are why the
TP term is there. Only the input-1 rows are fitted; the long-input rows check what is left.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from megatron_rl.scaling import cost
from megatron_rl.scaling.hardware import get_accelerator
from megatron_rl.simulation.anchors import SHAPES

GENERATED = 2048
ROOFLINE = {"decode_layer_overhead_us": 0.0, "decode_tp_layer_overhead_us": 0.0}  # no floor


@dataclasses.dataclass(frozen=True)
class Row:
    shape: str
    precision: str
    devices: int  # TP size of the one engine
    input_tokens: int
    speed: float  # published (input + generated) / seconds, batch 1


FIT_ROWS = (Row("qwen3-30b-a3b", "bf16", 1, 1, 137.18), Row("qwen3-30b-a3b", "fp8", 1, 1, 155.55),
            Row("qwen3-235b-a22b", "bf16", 8, 1, 74.50), Row("qwen3-235b-a22b", "fp8", 4, 1, 71.65))
CHECK_ROWS = (Row("qwen3-30b-a3b", "bf16", 1, 30720, 1283.94),
              Row("qwen3-30b-a3b", "bf16", 1, 63488, 1538.79),
              Row("qwen3-30b-a3b", "bf16", 1, 129042, 1385.65))


def _config(row: Row, **knobs) -> cost.CostConfig:
    return SHAPES[row.shape].cost_config(hardware="H20", generator_precision=row.precision,
                                         **knobs)


def prefill_seconds(row: Row, config: cost.CostConfig) -> float:
    return cost.compute_seconds(2.0 * config.num_active_params * row.input_tokens,
                                get_accelerator("H20"), row.precision, config.prefill_mfu,
                                row.devices)


def modelled_step(row: Row, **knobs) -> float:
    config = _config(row, **knobs)
    return cost.decode_step(config, get_accelerator("H20"), row.devices, 1,
                            row.input_tokens + GENERATED / 2)[0]


def published_step(row: Row) -> float:
    seconds = (row.input_tokens + GENERATED) / row.speed - prefill_seconds(row, _config(row))
    return seconds / GENERATED


def modelled_speed(row: Row, **knobs) -> float:
    seconds = prefill_seconds(row, _config(row, **knobs)) + GENERATED * modelled_step(row, **knobs)
    return (row.input_tokens + GENERATED) / seconds


def fit(tp_term: bool = True) -> dict[str, float]:
    """Least-squares knobs (microseconds) over FIT_ROWS, relative to each row's step."""
    columns, target = [], []
    for row in FIT_ROWS:
        layers, measured = SHAPES[row.shape].num_layers, published_step(row)
        features = [layers * 1e-6] + ([layers * 1e-6 * (row.devices > 1)] if tp_term else [])
        columns.append([f / measured for f in features])
        target.append((measured - modelled_step(row, **ROOFLINE)) / measured)
    solution = np.linalg.lstsq(np.array(columns), np.array(target), rcond=None)[0]
    return {"decode_layer_overhead_us": float(solution[0]),
            "decode_tp_layer_overhead_us": float(solution[1]) if tp_term else 0.0}


def main() -> None:
    fits = {"per layer + TP term": fit(tp_term=True), "per layer only": fit(tp_term=False)}
    defaults = cost.CostConfig()
    fits["cost.py defaults"] = {k: getattr(defaults, k) for k in
                                ("decode_layer_overhead_us", "decode_tp_layer_overhead_us")}
    for name, knobs in fits.items():
        print(f"{name}: " + ", ".join(f"{k}={v:.1f}" for k, v in knobs.items()))
    print()
    knobs, single = fits["cost.py defaults"], fits["per layer only"]
    print(f"{'row (H20, batch 1, gen 2048)':44s} {'published':>9s} {'roofline':>9s} "
          f"{'+floor':>8s} {'error':>6s} {'1 knob':>7s}")
    for label, rows in (("fitted", FIT_ROWS), ("check: context term", CHECK_ROWS)):
        print(f"-- {label}")
        for row in rows:
            name = f"{row.shape} {row.precision} TP{row.devices} input {row.input_tokens:,}"
            modelled = modelled_speed(row, **knobs)
            roofline = modelled_speed(row, **ROOFLINE)
            print(f"{name:44s} {row.speed:9.2f} {roofline:9.2f} {modelled:8.2f} "
                  f"{modelled / row.speed - 1:+6.1%} "
                  f"{modelled_speed(row, **single) / row.speed - 1:+7.1%}")


if __name__ == "__main__":
    main()
