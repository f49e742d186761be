"""Measured timing coefficients: the form a hardware profile takes when its figures come from a
benchmark on the machine itself (the `cpu` profile, benchmarks/cpu_profile.py) instead of
spec sheets.

Why not the roofline: the cost model times a decode step as max(bytes / bandwidth, FLOPs /
(MFU x peak)). A tiny model on a 2-core CPU is neither: its step is dominated by per-step
overhead (the scheduler, Python, per-layer kernel launches), which grows with the batch and the
context but not through bandwidth or FLOPs. So a measured profile carries linear fits of the
measured times instead, fitted by non-negative least squares (scipy.optimize.nnls: a time never
decreases with more work, and a negative coefficient would give negative times off the measured
range):

- decode step = a + b x batch + c x context tokens (the KV tokens of the whole batch);
- prefill of an admitted batch = a + b x prompt tokens (it includes the HTTP round trip of the
  request, which the simulated engine does not time elsewhere);
- train step = a + b x trained tokens; scoring (forward only) = a + b x tokens;
- one weight update (pause, load, version, continue) and an engine start: constants.

`MeasuredCosts.load(path)` reads the JSON the benchmark writes (its format is `to_json`'s);
timing.py and trainer.py use it in place of the cost model when the profile has one.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class LinearFit:
    """seconds = intercept + sum(coefficient x variable), fitted on measured samples."""

    intercept: float
    coefficients: dict[str, float]
    # Over the samples the fit was made on: the largest |fit - measured| / measured (how well
    # the linear form holds) and the number of samples.
    max_relative_error: float = 0.0
    num_samples: int = 0

    def __call__(self, **variables: float) -> float:
        unknown = set(variables) ^ set(self.coefficients)
        if unknown:
            raise ValueError(f"LinearFit: variables {sorted(variables)} do not match the fit's "
                             f"{sorted(self.coefficients)}")
        return self.intercept + sum(c * variables[name] for name, c in self.coefficients.items())

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "LinearFit":
        return cls(intercept=float(data["intercept"]),
                   coefficients={k: float(v) for k, v in data["coefficients"].items()},
                   max_relative_error=float(data.get("max_relative_error", 0.0)),
                   num_samples=int(data.get("num_samples", 0)))


def fit_linear(names: Sequence[str], rows: Sequence[Sequence[float]],
               seconds: Sequence[float]) -> LinearFit:
    """Fit seconds = intercept + sum(c_i x row_i) with every coefficient >= 0 (scipy's
    non-negative least squares). `rows[j]` holds sample j's variables in the order of `names`."""
    from scipy.optimize import nnls

    x = np.asarray(rows, dtype=float).reshape(len(rows), len(names))
    y = np.asarray(seconds, dtype=float)
    if len(y) != len(x):
        raise ValueError(f"fit_linear: {len(x)} rows but {len(y)} times")
    if len(y) < len(names) + 1:
        raise ValueError(f"fit_linear: {len(y)} samples cannot fit {len(names) + 1} "
                         "coefficients; measure more points")
    design = np.column_stack([np.ones(len(y)), x])
    solution, _ = nnls(design, y)
    fitted = design @ solution
    return LinearFit(intercept=float(solution[0]),
                     coefficients={n: float(c) for n, c in zip(names, solution[1:])},
                     max_relative_error=float(np.max(np.abs(fitted - y) / y)),
                     num_samples=len(y))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredCosts:
    """What benchmarks/cpu_profile.py measured, as the simulator uses it."""

    decode_step: LinearFit  # variables: batch, context_tokens
    prefill: LinearFit  # variables: tokens
    train_step: LinearFit  # variables: tokens
    score: LinearFit  # variables: tokens
    weight_update_s: float  # one in-flight weight update of an engine, pause to continue
    engine_start_s: float  # launch until the engine answers
    # Where and when: date, machine, load average, the command (for the docs and the report).
    provenance: dict = dataclasses.field(default_factory=dict)

    def decode_step_seconds(self, batch: int, context_tokens: float) -> float:
        return self.decode_step(batch=batch, context_tokens=context_tokens)

    def prefill_seconds(self, num_tokens: int) -> float:
        return self.prefill(tokens=num_tokens)

    def train_step_seconds(self, num_tokens: int) -> float:
        return self.train_step(tokens=num_tokens)

    def score_seconds(self, num_tokens: int) -> float:
        return self.score(tokens=num_tokens)

    def to_json(self) -> dict:
        return {"provenance": self.provenance,
                "engine": {"decode_step_s": self.decode_step.to_json(),
                           "prefill_s": self.prefill.to_json(),
                           "weight_update_s": self.weight_update_s,
                           "start_s": self.engine_start_s},
                "trainer": {"train_step_s": self.train_step.to_json(),
                            "score_s": self.score.to_json()}}

    @classmethod
    def from_json(cls, data: dict) -> "MeasuredCosts":
        try:
            engine, trainer = data["engine"], data["trainer"]
            return cls(decode_step=LinearFit.from_json(engine["decode_step_s"]),
                       prefill=LinearFit.from_json(engine["prefill_s"]),
                       weight_update_s=float(engine["weight_update_s"]),
                       engine_start_s=float(engine["start_s"]),
                       train_step=LinearFit.from_json(trainer["train_step_s"]),
                       score=LinearFit.from_json(trainer["score_s"]),
                       provenance=dict(data.get("provenance", {})))
        except (KeyError, TypeError) as err:
            raise ValueError(f"measured profile: missing or malformed field {err}; rewrite it "
                             "with benchmarks/cpu_profile.py") from None

    @classmethod
    def load(cls, path: str | Path) -> "MeasuredCosts":
        return cls.from_json(json.loads(Path(path).read_text()))
