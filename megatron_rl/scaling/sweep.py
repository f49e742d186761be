"""`megatron-rl sweep SWEEP.yaml [--resume]`: a recipe ablation in one command (docs/scaling.md).

SWEEP.yaml names a base recipe, named variants (dotted overrides), seeds and a budget. Every
(variant, seed) is an ordinary `megatron-rl train` run in `<output_dir>/<variant>/seed<seed>/`,
started as a subprocess of its own (a crash of one run cannot take the sweep down) whose console
goes to `train.log` in its directory. This module owns the sweep file, the plan (every run's
RunConfig is built before any run starts, so a bad override stops the sweep at once with the run
config's own error) and the runs: one after another, or up to `parallel` at once (each then starts
its own local Ray cluster, or reserves its own placement group on the cluster it joins; a run
still is just a `megatron-rl train`). A run's own artefacts say where it stands: a
committed checkpoint at train.num_steps whose validation of that step is logged (or a checkpoint
past the compute budget) is finished and skipped, an earlier one is resumed with the run's own
`--resume` (which also validates a last step that a stop left unvalidated), a directory without
any starts fresh. The report (fits, seed spread, ranking) is sweep_report.py's.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import difflib
import enum
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Self

import yaml

from megatron_rl.config import ConfigError, RunConfig, load_config
from megatron_rl.resilience.checkpoint import list_checkpoints
from megatron_rl.scaling.log import LOG_NAME
from megatron_rl.train import validation_due

PROGRAM = "megatron-rl sweep"
FIELDS = ("name", "base", "output_dir", "overrides", "variants", "seeds", "budget",
          "target_compute_gpu_hours", "parallel")
BUDGETS = ("steps", "compute_gpu_hours")
TRAIN_LOG = "train.log"
ATTEMPTS = "attempts.jsonl"  # in the sweep's output_dir: one line per run started
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # variant names become directory names
POLL_S = 2.0  # how often a compute budget looks at a running run's scaling log
TICK_S = 0.1  # how often the sweep looks whether a running run has exited


class SweepError(ValueError):
    """A broken sweep file or plan; the message names the field and the fix (one line)."""


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SweepSpec:
    """SWEEP.yaml. Paths (base, output_dir) are relative to the current directory, as the
    recipe's own paths are for `megatron-rl train`."""

    name: str
    base: str
    output_dir: str
    overrides: tuple[str, ...]  # applied to every run
    variants: dict[str, tuple[str, ...]]  # in the file's order
    seeds: tuple[int, ...]
    budget_steps: int | None  # exactly one of the two budgets is set
    budget_compute_gpu_hours: float | None
    target_compute_gpu_hours: float | None  # the extrapolation plot's end; None: 10x the longest
    parallel: int  # at most this many runs at once

    def budget_text(self) -> str:
        return (f"{self.budget_steps} steps" if self.budget_steps is not None
                else f"{self.budget_compute_gpu_hours:g} GPU-hours")


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class SweepRun:
    """One (variant, seed): `megatron-rl train BASE *overrides` with the resolved `config`."""

    variant: str
    seed: int
    output_dir: Path
    overrides: tuple[str, ...]
    config: RunConfig

    @property
    def label(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    @property
    def log(self) -> Path:
        return self.output_dir / TRAIN_LOG


class RunState(enum.Enum):
    FRESH = "not started"
    RESUME = "resume from its checkpoint"
    RESTART = "started, no checkpoint: set aside, start again"
    FINISHED = "finished"


# ------------------------------------------------------------------------- the sweep file

def load_sweep(path: str | Path) -> SweepSpec:
    """The sweep file, checked field by field (SweepError naming the field)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise SweepError(f"sweep file {str(path)!r} does not exist") from None
    except yaml.YAMLError as err:
        raise SweepError(f"{path} is not valid YAML: {' '.join(str(err).split())}") from None
    where = str(path)
    _check(isinstance(raw, dict), f"{where}: expected a mapping of the fields {', '.join(FIELDS)}")
    for key in raw:
        if key not in FIELDS:
            close = difflib.get_close_matches(str(key), FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SweepError(f"{where}: unknown field {key!r}{hint} (fields: {', '.join(FIELDS)})")
    for key in ("name", "base", "variants", "seeds", "budget"):
        _check(raw.get(key) is not None, f"{where}: {key}: missing; {_HELP[key]}")
    name = _string(raw["name"], f"{where}: name")
    base = _string(raw["base"], f"{where}: base")
    _check(Path(base).is_file(), f"{where}: base: recipe {base!r} does not exist (paths are "
           "relative to the current directory, as for megatron-rl train)")
    output_dir = _string(raw.get("output_dir", f"runs/sweep_{name}"), f"{where}: output_dir")
    overrides = _overrides(raw.get("overrides"), f"{where}: overrides")
    variants = raw["variants"]
    _check(isinstance(variants, dict) and variants, f"{where}: variants: expected a mapping of "
           "variant name -> list of overrides, e.g. {cispo: [algorithm.loss=cispo]}")
    parsed = {}
    for variant, items in variants.items():
        _check(isinstance(variant, str) and _NAME.match(variant) is not None,
               f"{where}: variants: name {variant!r} must be letters, digits, '_', '-' or '.' "
               "(it names the variant's directory)")
        parsed[variant] = _overrides(items, f"{where}: variants.{variant}")
    seeds = raw["seeds"]
    _check(isinstance(seeds, list) and seeds and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds),
        f"{where}: seeds: expected a non-empty list of non-negative integers, got {seeds!r}")
    _check(len(set(seeds)) == len(seeds), f"{where}: seeds: {seeds} repeats a seed")
    steps, compute = _budget(raw["budget"], f"{where}: budget")
    target = raw.get("target_compute_gpu_hours")
    if target is not None:
        target = _positive(target, f"{where}: target_compute_gpu_hours")
    parallel = raw.get("parallel", 1)
    _check(isinstance(parallel, int) and not isinstance(parallel, bool) and parallel >= 1,
           f"{where}: parallel: expected an integer >= 1, got {parallel!r}")
    spec = SweepSpec(name=name, base=base, output_dir=output_dir, overrides=overrides,
                     variants=parsed, seeds=tuple(seeds), budget_steps=steps,
                     budget_compute_gpu_hours=compute, target_compute_gpu_hours=target,
                     parallel=parallel)
    _check_reserved(spec, where)
    return spec


_HELP = {
    "name": "give the sweep a name",
    "base": "the run recipe every run starts from, e.g. examples/configs/demo.yaml",
    "variants": "a mapping of variant name -> overrides, e.g. {cispo: [algorithm.loss=cispo]}",
    "seeds": "a list of seeds, e.g. [1, 2, 3]",
    "budget": "{steps: N} (train.num_steps of every run) or {compute_gpu_hours: X}",
}


def _check(condition: Any, message: str) -> None:
    if not condition:
        raise SweepError(message)


def _string(value: Any, where: str) -> str:
    _check(isinstance(value, str) and value.strip(), f"{where}: expected a non-empty string, "
           f"got {value!r}")
    return value


def _overrides(value: Any, where: str) -> tuple[str, ...]:
    value = [] if value is None else value
    _check(isinstance(value, list) and all(isinstance(v, str) for v in value),
           f"{where}: expected a list of section.field=value overrides, got {value!r}")
    return tuple(value)


def _positive(value: Any, where: str) -> float:
    try:  # YAML 1.1 reads 1e3 as a string
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    _check(number > 0.0 and number != float("inf"), f"{where}: expected a number > 0, got "
           f"{value!r}")
    return number


def _budget(value: Any, where: str) -> tuple[int | None, float | None]:
    _check(isinstance(value, dict) and len(value) == 1 and next(iter(value)) in BUDGETS,
           f"{where}: expected exactly one of {{steps: N}} or {{compute_gpu_hours: X}}, got "
           f"{value!r}")
    ((kind, amount),) = value.items()
    if kind == "steps":
        _check(isinstance(amount, int) and not isinstance(amount, bool) and amount >= 1,
               f"{where}.steps: expected an integer >= 1, got {amount!r}")
        return amount, None
    return None, _positive(amount, f"{where}.compute_gpu_hours")


def _key(override: str) -> str:
    return override.partition("=")[0].strip()


def _check_reserved(spec: SweepSpec, where: str) -> None:
    """Fields the sweep sets for every run may not be overridden."""
    reserved = {"seed": "seeds:", "output_dir": "output_dir: and the variant/seed layout"}
    if spec.budget_steps is not None:
        reserved["train.num_steps"] = "budget.steps"
    lists = {"overrides": spec.overrides,
             **{f"variants.{v}": items for v, items in spec.variants.items()}}
    for field, items in lists.items():
        for override in items:
            if _key(override) in reserved:
                raise SweepError(f"{where}: {field}: {override!r} sets {_key(override)}, which "
                                 f"the sweep sets for every run from {reserved[_key(override)]}; "
                                 "remove it")


# ------------------------------------------------------------------------------ the plan

def plan_runs(spec: SweepSpec) -> list[SweepRun]:
    """Every run with its resolved RunConfig, variants in the file's order, then seeds; errors
    of the run config's own validation name the list they came from."""
    _resolve(spec.base, spec.overrides, "overrides")
    runs = []
    for variant, items in spec.variants.items():
        _resolve(spec.base, (*spec.overrides, *items), f"variants.{variant}")
        for seed in spec.seeds:
            out = Path(spec.output_dir) / variant / f"seed{seed}"
            overrides = (*spec.overrides, *items, f"seed={seed}",
                         f"output_dir={json.dumps(str(out))}")  # JSON quotes are YAML quotes
            if spec.budget_steps is not None:
                overrides += (f"train.num_steps={spec.budget_steps}",)
            cfg = _resolve(spec.base, overrides, f"variants.{variant} (seed {seed})")
            runs.append(SweepRun(variant=variant, seed=seed, output_dir=out,
                                 overrides=overrides, config=cfg))
    _check_runs_apart(runs)
    return runs


def _resolve(base: str, overrides: tuple[str, ...], where: str) -> RunConfig:
    try:
        return load_config(base, overrides)
    except ConfigError as err:
        raise SweepError(f"{where}: {err}") from None


def _check_runs_apart(runs: list[SweepRun]) -> None:
    """Each run writes only into its own directory, and the curves share one warm-up."""
    for run in runs:
        cfg, where = run.config, f"variants.{run.variant}"
        for field, value in (("checkpoint.dir", cfg.checkpoint.dir),
                             ("logging.tensorboard_dir", cfg.logging.tensorboard_dir),
                             ("checkpoint.load", cfg.checkpoint.load)):
            _check(value is None, f"{where}: {field} is {value!r}, so every run of the sweep "
                   f"would share it; set {field}=null (each run uses its own output_dir)")
    warmups = {run.config.eval.warmup_compute_gpu_hours: run.variant for run in runs}
    _check(len(warmups) == 1, "variants: eval.warmup_compute_gpu_hours differs between variants "
           f"({', '.join(f'{v}: {w:g}' for w, v in warmups.items())}); the curves of a sweep "
           "are compared with one warm-up: set it in overrides")


# ----------------------------------------------------------------- where a run stands

def run_state(run: SweepRun, spec: SweepSpec) -> tuple[RunState, int | None]:
    """(state, newest committed checkpoint step) from the run's own artefacts only.

    A checkpoint at train.num_steps finishes the run only with that step's validation logged
    (when the recipe validates it): a stop during the last validation still writes the
    checkpoint, and `megatron-rl train --resume` then validates the step and exits without a
    newer checkpoint, so the point is looked for in the checkpoint's scaling log and in the
    run's own (which the resumed run restored from that checkpoint and appended to)."""
    checkpoints = list_checkpoints(run.config.checkpoint_dir)  # committed: renamed with manifest
    if not checkpoints:
        started = any((run.output_dir / name).is_file() for name in (LOG_NAME, "ledger.jsonl"))
        return (RunState.RESTART if started else RunState.FRESH), None
    newest = checkpoints[0]
    step = int(newest.name.split("_")[1])
    validated = not validation_due(run.config, step) or any(
        step in logged_steps(log) for log in (newest / LOG_NAME, run.output_dir / LOG_NAME))
    done = (step >= run.config.train.num_steps and validated) or (
        spec.budget_compute_gpu_hours is not None
        and logged_compute(newest / LOG_NAME) >= spec.budget_compute_gpu_hours)
    return (RunState.FINISHED if done else RunState.RESUME), step


def _log_records(text: str) -> list[dict]:
    """The records of a scaling log's text; a line being written is skipped."""
    records = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _max_compute(text: str) -> float:
    found = 0.0
    for record in _log_records(text):
        try:
            found = max(found, float(record["compute_gpu_hours"]))
        except (KeyError, TypeError, ValueError):
            continue
    return found


def logged_compute(path: Path) -> float:
    """The largest compute of a scaling log (0 if none); a line being written is skipped."""
    return _max_compute(path.read_text(encoding="utf-8")) if path.is_file() else 0.0


def logged_steps(path: Path) -> set[int]:
    """The steps a scaling log holds a validation of."""
    if not path.is_file():
        return set()
    return {record["step"] for record in _log_records(path.read_text(encoding="utf-8"))
            if isinstance(record.get("step"), int)}


# ------------------------------------------------------------------------------- the runs

class _Stop:
    """SIGTERM / SIGINT to the sweep, for its `with` block (the previous handlers come back
    after). The first is passed to every running run as one SIGTERM (each finishes its step,
    writes a checkpoint and exits) and no further run starts; a second one is passed on too (the
    runs then stop at once). The handler only counts: the sweep's loop passes the signals on
    (`_Running.poll`), so a run started just as a signal comes still gets it, and only once."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None  # the first one
        self.count = 0
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> Self:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame) -> None:
        self.signal = self.signal or signal.Signals(signum)
        self.count += 1
        what = "stopping the runs at once" if self.count > 1 else (
            "the runs finish their step and write a checkpoint; no further run starts")
        print(f"{PROGRAM}: {signal.Signals(signum).name}: {what}", file=sys.stderr, flush=True)


def _stop_with_the_sweep() -> None:
    """In the run's process before exec (Linux): SIGTERM it when the sweep dies, even by
    SIGKILL, so that a killed sweep leaves no run going on: the run stops with a checkpoint."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def train_command(run: SweepRun, spec: SweepSpec, *, resume: bool) -> list[str]:
    """The run's `megatron-rl train` command line."""
    return [sys.executable, "-m", "megatron_rl.cli", "train", spec.base, *run.overrides,
            *(["--resume"] if resume else [])]


class _Running:
    """One run's `megatron-rl train` subprocess, from start() until poll() returns its exit
    status. poll() passes the sweep's stop signals on and, under a compute budget, sends the run
    SIGTERM (a graceful stop with a checkpoint) once its scaling log reaches the budget; a run
    already stopping for its budget gets a stop signal's SIGTERM from the second signal on.

    A resumed run's scaling log is, until the run puts back its checkpoint's copy, the previous
    attempt's: it may hold validations past the checkpoint (a crash, a hard stop) and past the
    budget. The budget looks at the log only once it differs from what it was at the start."""

    def __init__(self, run: SweepRun, spec: SweepSpec, *, resume: bool, head: str) -> None:
        self.run, self.spec, self.resume, self.head = run, spec, resume, head
        self.proc: subprocess.Popen | None = None
        self.started = 0.0  # time.time() at start
        self.num_sigterms = 0  # sent to the run so far
        self.next_budget_check = 0.0  # time.monotonic()
        self.previous_log: bytes | None = None  # the log left by the previous attempt

    def start(self) -> None:
        self.run.output_dir.mkdir(parents=True, exist_ok=True)
        scaling = self.run.output_dir / LOG_NAME
        self.previous_log = scaling.read_bytes() if self.resume and scaling.is_file() else None
        self.started = time.time()
        with open(self.run.log, "ab") as log:
            # A session of its own: a Ctrl-C in the terminal reaches the sweep only, which passes
            # one SIGTERM on (two would stop the run without a checkpoint).
            self.proc = subprocess.Popen(
                train_command(self.run, self.spec, resume=self.resume), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=_stop_with_the_sweep if sys.platform == "linux" else None)

    def poll(self, stop: _Stop) -> int | None:
        code = self.proc.poll()
        if code is not None:
            return code
        while self.num_sigterms < stop.count:
            self._sigterm()
        budget = self.spec.budget_compute_gpu_hours
        if budget is not None and self.num_sigterms == 0 and \
                time.monotonic() >= self.next_budget_check:
            self.next_budget_check = time.monotonic() + POLL_S
            if self._logged_compute() >= budget:
                print(f"{PROGRAM}: {self.run.label} validated past the budget of {budget:g} "
                      "GPU-hours: stopping it (SIGTERM: it writes a checkpoint)", flush=True)
                self._sigterm()
        return None

    def _logged_compute(self) -> float:
        """The largest compute the run itself has logged (0 while the previous attempt's log
        is still in place)."""
        path = self.run.output_dir / LOG_NAME
        data = path.read_bytes() if path.is_file() else b""
        if self.previous_log is not None:
            if data == self.previous_log:
                return 0.0
            self.previous_log = None  # restored (and maybe appended to) by this attempt
        return _max_compute(data.decode("utf-8", errors="replace"))

    def _sigterm(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.num_sigterms += 1


def set_aside(run: SweepRun) -> Path:
    """Move a run directory that holds outputs but no checkpoint next to it (nothing is
    deleted), so that the run can start again."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run.output_dir.with_name(f"{run.output_dir.name}.abandoned-{stamp}")
    run.output_dir.rename(target)
    return target


def _record_attempt(out: Path, run: SweepRun, *, action: str, started: float,
                    exit_code: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ATTEMPTS, "a", encoding="utf-8") as f:
        f.write(json.dumps({"run": run.label, "action": action, "started_at": started,
                            "wall_seconds": round(time.time() - started, 3),
                            "exit_code": exit_code}) + "\n")


def wall_seconds(out: Path) -> dict[str, float]:
    """Run label -> wall time of all its attempts so far (from the sweep's attempts.jsonl)."""
    path = out / ATTEMPTS
    totals: dict[str, float] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                record = json.loads(line)
                totals[record["run"]] = totals.get(record["run"], 0.0) + record["wall_seconds"]
    return totals


def _tail(path: Path) -> str:
    """The log's last non-empty line, for the one-line failure message."""
    if not path.is_file():
        return ""
    lines = [line.strip() for line in path.read_text(errors="replace")[-4000:].splitlines()]
    lines = [line for line in lines if line]
    return lines[-1][:300] if lines else ""


def _start(run: SweepRun, spec: SweepSpec, *, head: str) -> _Running | None:
    """Start the run where its artefacts say it stands; None if it is finished (skipped)."""
    state, step = run_state(run, spec)
    if state is RunState.FINISHED:
        print(f"{head}: finished (checkpoint step {step}), skipped", flush=True)
        return None
    if state is RunState.RESTART:
        print(f"{head}: holds outputs but no checkpoint; moved to {set_aside(run)}", flush=True)
    resume = state is RunState.RESUME
    print(f"{head}: {'resuming from step ' + str(step) if resume else 'starting'} "
          f"(log: {run.log})", flush=True)
    started = _Running(run, spec, resume=resume, head=head)
    started.start()
    return started


def _exited(active: _Running, code: int, spec: SweepSpec, failed: dict[str, int], *,
            stopped: bool) -> None:
    """Record the attempt and print the run's line; a run that did not finish is failed unless
    the sweep is being stopped."""
    run = active.run
    _record_attempt(Path(spec.output_dir), run, action="resume" if active.resume else "start",
                    started=active.started, exit_code=code)
    state, step = run_state(run, spec)
    newest = "none" if step is None else f"step {step}"
    if state is RunState.FINISHED:
        print(f"{active.head}: finished in {time.time() - active.started:.0f} s", flush=True)
    elif stopped:
        print(f"{active.head}: stopped (exit status {code}, newest checkpoint: {newest})",
              flush=True)
    else:
        failed[run.label] = code
        print(f"{active.head}: FAILED (exit status {code}, newest checkpoint: {newest}); log: "
              f"{run.log}: {_tail(run.log)}", flush=True)


# ---------------------------------------------------------------------------- the command

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROGRAM, description="Run every (variant, seed) of SWEEP.yaml as a `megatron-rl "
        "train` run, fit each curve and rank the variants (docs/scaling.md).")
    parser.add_argument("sweep", metavar="SWEEP.yaml", help="the sweep file")
    parser.add_argument("--resume", action="store_true",
                        help="continue a sweep whose output_dir holds runs: finished runs are "
                             "skipped, the others resumed (or started)")
    parser.add_argument("--no-plots", action="store_true", help="do not write the PNG plots")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        spec = load_sweep(args.sweep)
        runs = plan_runs(spec)
    except SweepError as err:
        print(f"{PROGRAM}: error: {err}", file=sys.stderr)
        return 2
    out = Path(spec.output_dir)
    present = [run.label for run in runs if run.output_dir.exists()]
    if present and not args.resume:
        print(f"{PROGRAM}: error: output_dir {out} already holds runs of a sweep "
              f"({', '.join(present[:3])}{', ...' if len(present) > 3 else ''}); continue it "
              "with --resume, or choose another output_dir", file=sys.stderr)
        return 2
    if runs[0].config.data.split_seed is None and len(spec.seeds) > 1:
        print(f"{PROGRAM}: note: data.split_seed is null, so each seed validates on other "
              "held-out problems and the seed spread includes the split's; add "
              "data.split_seed=N to overrides to hold the problems fixed", flush=True)
    if spec.parallel > 1 and any(run.config.cluster.address is None for run in runs):
        print(f"{PROGRAM}: note: parallel: {spec.parallel}: runs without cluster.address each "
              "start a local Ray cluster on this machine and share its CPUs and GPUs; their "
              "compute axes (measured device-time) include that contention", flush=True)
    at_once = "one run after another" if spec.parallel == 1 else (
        f"up to {spec.parallel} runs at once")
    print(f"{PROGRAM}: {spec.name}: {len(spec.variants)} variant(s) x {len(spec.seeds)} "
          f"seed(s), {spec.budget_text()} each, {at_once}, in {out}", flush=True)
    failed: dict[str, int] = {}
    waiting = list(enumerate(runs, start=1))  # plan order
    running: list[_Running] = []
    with _Stop() as stop:
        while running or (waiting and stop.signal is None):
            while waiting and len(running) < spec.parallel and stop.signal is None:
                number, run = waiting.pop(0)
                started = _start(run, spec, head=f"{PROGRAM}: [{number}/{len(runs)}] {run.label}")
                if started is not None:
                    running.append(started)
            if running:
                time.sleep(TICK_S)
            for active in list(running):
                code = active.poll(stop)
                if code is not None:
                    running.remove(active)
                    _exited(active, code, spec, failed, stopped=stop.signal is not None)
    if stop.signal is not None:
        print(f"{PROGRAM}: stopped by {stop.signal.name}; continue with `megatron-rl sweep "
              f"{args.sweep} --resume`", file=sys.stderr, flush=True)
        return 128 + stop.signal.value
    from megatron_rl.scaling.sweep_report import report_sweep

    report_sweep(spec, runs, failed=failed, wall_seconds=wall_seconds(out),
                 plots=not args.no_plots)
    return 1 if failed else 0


if __name__ == "__main__":
    from megatron_rl.cli import main as cli_main

    sys.exit(cli_main(["sweep", *sys.argv[1:]]))
