"""The validation log a run writes for curve fitting, and the readers of every supported format.

A run directory holds `scaling.jsonl`, one JSON object per task per validation:
`{"step": int, "compute_gpu_hours": float, "pass_rate": float, "task": str}` ("all" is the overall
pass rate; the step-0 lines give R0). `ScalingLog` appends to it durably (flush + fsync, never
rewriting an old line, so a crash loses at most the line being written) and mirrors the values as
TensorBoard scalars `val/pass_rate/<task>` and `compute/gpu_hours` at global_step = step.
`read_scaling_log` reads a run directory (the jsonl if present, else the TensorBoard events), a
`.jsonl` file or a `.csv` file (columns compute_gpu_hours, pass_rate[, task][, step]) into one
`ScalingSeries` per task.

Restarts: a run resumed from a checkpoint re-validates steps it may already have logged; the
writer appends again and the reader keeps, for each (task, step), the line written last.
"""
from __future__ import annotations

import csv
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from megatron_rl.scaling.series import ScalingSeries

LOG_NAME = "scaling.jsonl"
OVERALL_TASK = "all"
PASS_RATE_TAG_PREFIX = "val/pass_rate/"
COMPUTE_TAG = "compute/gpu_hours"


class ScalarWriter(Protocol):
    """The part of torch.utils.tensorboard.SummaryWriter that the log uses."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any: ...

    def flush(self) -> Any: ...


class ScalingLog:
    """Append-only writer of `<run_dir>/scaling.jsonl` (+ TensorBoard scalars given a writer)."""

    def __init__(self, run_dir: str | os.PathLike, tb_writer: ScalarWriter | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOG_NAME
        self.tb_writer = tb_writer
        self._last: tuple[int, float] | None = None  # (step, compute) of this writer's last append

    def append(self, step: int, compute_gpu_hours: float,
               pass_rate_by_task: dict[str, float]) -> None:
        """Record one validation: every task's pass rate at `step`, after `compute` GPU-hours."""
        step, compute = self._check(step, compute_gpu_hours, pass_rate_by_task)
        lines = "".join(
            json.dumps({"step": step, "compute_gpu_hours": compute, "pass_rate": float(rate),
                        "task": task}) + "\n"
            for task, rate in pass_rate_by_task.items())
        self.run_dir.mkdir(parents=True, exist_ok=True)
        created = not self.path.exists()
        with open(self.path, "a+b") as f:
            # A crash mid-write can leave a torn last line; start on a fresh line so that only the
            # torn one is lost (the reader skips it with a warning).
            if f.tell() > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    lines = "\n" + lines
            f.write(lines.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        if created:
            _fsync_dir(self.run_dir)  # make the new directory entry durable too
        self._last = (step, compute)
        if self.tb_writer is not None:
            for task, rate in pass_rate_by_task.items():
                self.tb_writer.add_scalar(PASS_RATE_TAG_PREFIX + task, float(rate),
                                          global_step=step)
            self.tb_writer.add_scalar(COMPUTE_TAG, compute, global_step=step)
            self.tb_writer.flush()

    def has_step(self, step: int) -> bool:
        """Whether the log holds a validation at `step` (a resumed run checks its own: a stop
        may have come between the step's checkpoint and its validation)."""
        if not self.path.is_file():
            return False
        return any(series.step is not None and step in series.step.tolist()
                   for series in read_scaling_log(self.path).values())

    def _check(self, step: int, compute: float,
               pass_rate_by_task: dict[str, float]) -> tuple[int, float]:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative int")
        compute = float(compute)
        if not math.isfinite(compute) or compute < 0.0:
            raise ValueError(f"compute_gpu_hours={compute!r} must be a finite number >= 0")
        if not pass_rate_by_task:
            raise ValueError("pass_rate_by_task is empty; give at least the overall task "
                             f"{OVERALL_TASK!r}")
        for task, rate in pass_rate_by_task.items():
            if not isinstance(task, str) or not task:
                raise ValueError(f"task name {task!r} must be a non-empty string")
            try:
                value = float(rate)  # also accepts numpy / 0-d torch scalars
            except (TypeError, ValueError):
                value = math.nan
            if isinstance(rate, bool) or not 0.0 <= value <= 1.0:
                raise ValueError(f"pass rate {rate!r} of task {task!r} at step {step} must be a "
                                 "number in [0, 1] (the fraction of correct samples)")
        if self._last is not None:
            last_step, last_compute = self._last
            if step <= last_step or compute < last_compute:
                raise ValueError(
                    f"step {step} at {compute} GPU-hours follows step {last_step} at "
                    f"{last_compute} GPU-hours; steps must increase and compute must not decrease")
        return int(step), compute


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_scaling_log(path: str | os.PathLike) -> dict[str, ScalingSeries]:
    """One ScalingSeries per task from a run dir, a .jsonl or a .csv (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        if (path / LOG_NAME).is_file():
            return _read_jsonl(path / LOG_NAME, run=path.name)
        return _read_tensorboard(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such run directory or log file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path, run=path.stem)
    if suffix == ".csv":
        return _read_csv(path)
    raise ValueError(f"{path}: unsupported log; give a run directory (with {LOG_NAME} or "
                     "TensorBoard events), a .jsonl or a .csv file")


def _read_jsonl(path: Path, *, run: str) -> dict[str, ScalingSeries]:
    points: dict[str, dict[int, tuple[float, float]]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # Only a torn write (a crash during append) produces this; skip, but say so.
            warnings.warn(f"{path}:{number}: skipping a line that is not valid JSON "
                          "(torn write?)", stacklevel=2)
            continue
        step, compute, rate, task = _fields(record, where=f"{path}:{number}")
        points.setdefault(task, {})[step] = (compute, rate)  # a later line supersedes
    if not points:
        raise ValueError(f"{path}: the log has no validation records")
    return {task: _series(run, task, by_step) for task, by_step in points.items()}


def _fields(record: Any, *, where: str) -> tuple[int, float, float, str]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in ("step", "compute_gpu_hours", "pass_rate") if k not in record]
    if missing:
        raise ValueError(f"{where}: missing field(s) {missing}; each line needs step, "
                         "compute_gpu_hours, pass_rate and task")
    step, compute, rate = record["step"], record["compute_gpu_hours"], record["pass_rate"]
    task = record.get("task", OVERALL_TASK)
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"{where}: step {step!r} is not an integer")
    for name, value in (("compute_gpu_hours", compute), ("pass_rate", rate)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: {name} {value!r} is not a number")
    if not isinstance(task, str) or not task:
        raise ValueError(f"{where}: task {task!r} must be a non-empty string")
    return step, float(compute), float(rate), task


def _series(run: str, task: str, by_step: dict[int, tuple[float, float]]) -> ScalingSeries:
    steps = np.array(sorted(by_step), dtype=np.int64)
    values = np.array([by_step[int(s)] for s in steps], dtype=np.float64).reshape(-1, 2)
    return ScalingSeries(run=run, task=task, step=steps, compute_gpu_hours=values[:, 0],
                         pass_rate=values[:, 1])


def _read_csv(path: Path) -> dict[str, ScalingSeries]:
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        columns = [c.strip() for c in (reader.fieldnames or [])]
        missing = {"compute_gpu_hours", "pass_rate"} - set(columns)
        if missing:
            raise ValueError(f"{path}: missing column(s) {sorted(missing)}; expected "
                             "compute_gpu_hours,pass_rate[,task][,step]")
        rows = [{k.strip(): (v or "").strip() for k, v in row.items() if k} for row in reader]
    has_step = "step" in columns
    by_task: dict[str, list[tuple[int | None, float, float]]] = {}
    for number, row in enumerate(rows, start=2):
        where = f"{path}:{number}"
        try:
            compute, rate = float(row["compute_gpu_hours"]), float(row["pass_rate"])
            step = int(row["step"]) if has_step else None
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from err
        by_task.setdefault(row.get("task") or OVERALL_TASK, []).append((step, compute, rate))
    if not by_task:
        raise ValueError(f"{path}: no data rows")
    if has_step:
        return {task: _series(path.stem, task, {s: (c, r) for s, c, r in rows_})
                for task, rows_ in by_task.items()}
    # Without steps the file order is the time order; the series check rejects a compute drop.
    return {task: ScalingSeries(run=path.stem, task=task,
                                compute_gpu_hours=np.array([c for _, c, _ in rows_]),
                                pass_rate=np.array([r for _, _, r in rows_]))
            for task, rows_ in by_task.items()}


def _read_tensorboard(run_dir: Path) -> dict[str, ScalingSeries]:
    event_dirs = sorted({p.parent for p in run_dir.rglob("events.out.tfevents.*")})
    if not event_dirs:
        raise FileNotFoundError(f"{run_dir}: neither {LOG_NAME} nor TensorBoard event files "
                                "found; is this a run directory?")
    # Imported here: reading TensorBoard is the slow path, and `fit` on CSVs does not need it.
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS, EventAccumulator)

    found: dict[Path, dict[str, ScalingSeries]] = {}
    for event_dir in event_dirs:
        accumulator = EventAccumulator(str(event_dir), size_guidance={SCALARS: 0})
        accumulator.Reload()
        tags = accumulator.Tags()[SCALARS]
        task_tags = [t for t in tags if t.startswith(PASS_RATE_TAG_PREFIX)]
        if not task_tags:
            continue
        if COMPUTE_TAG not in tags:
            raise ValueError(f"{event_dir}: pass-rate scalars without {COMPUTE_TAG!r}; the "
                             "compute axis is missing")
        compute = {e.step: e.value for e in accumulator.Scalars(COMPUTE_TAG)}
        found[event_dir] = {}
        for tag in task_tags:
            task = tag[len(PASS_RATE_TAG_PREFIX):]
            by_step: dict[int, tuple[float, float]] = {}
            for event in accumulator.Scalars(tag):
                if event.step not in compute:
                    raise ValueError(f"{event_dir}: {tag} at step {event.step} has no "
                                     f"{COMPUTE_TAG} scalar at the same step")
                by_step[event.step] = (compute[event.step], event.value)
            found[event_dir][task] = _series(run_dir.name, task, by_step)
    if not found:
        raise ValueError(f"{run_dir}: TensorBoard events have no {PASS_RATE_TAG_PREFIX}<task> "
                         "scalars")
    if len(found) > 1:
        raise ValueError(f"{run_dir}: pass-rate scalars in several event directories "
                         f"({', '.join(str(d) for d in found)}); point at one of them")
    return next(iter(found.values()))
