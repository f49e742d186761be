"""`megatron-rl sweep` without training: the sweep file and its one-line errors, the plan (every
run's RunConfig up front), where a run stands from its own artefacts, the ranking rules on
hand-computed values, the report checked against `megatron-rl fit` on the same logs, the
false-winner rate of the ranking on simulated variants that differ only by chance, and the
scheduling of `parallel` runs, of a stop and of a compute budget with stand-in runs. The real
runs are in tests/e2e/test_sweep.py."""
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from megatron_rl.cli import main as megatron_rl_main
from megatron_rl.resilience import checkpoint as run_checkpoint
from megatron_rl.scaling.cli import main as fit_main
from megatron_rl.scaling.log import ScalingLog
from megatron_rl.scaling import sweep
from megatron_rl.scaling.series import ScalingSeries
from megatron_rl.scaling.sigmoid import SigmoidFitConfig, fit_sigmoid
from megatron_rl.scaling.sweep import (RunState, SweepError, load_sweep, logged_compute,
                                       plan_runs, run_state)
from megatron_rl.scaling.report import fit_series
from megatron_rl.scaling.sweep_report import (RunResult, VariantResult, a_tolerance,
                                              pooled_curve, rank_variants, report_sweep,
                                              variant_result)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
BASE = "examples/configs/tiny_pipeline.yaml"
FAST = SigmoidFitConfig(num_bootstrap=20, warmup_compute=0.0)


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # paths in a sweep file are relative to the current directory


def _sweep_file(tmp_path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def _good(tmp_path, **fields) -> str:
    lines = {"name": "t", "base": BASE, "output_dir": str(tmp_path / "out"),
             "overrides": "[data.split_seed=7]",
             "variants": "{cispo: [algorithm.loss=cispo], dapo: [algorithm.loss=dapo]}",
             "seeds": "[1, 2]", "budget": "{steps: 3}"}
    lines.update(fields)
    return "".join(f"{k}: {v}\n" for k, v in lines.items() if v is not None)


def test_the_demo_sweep_plans_six_ordinary_runs():
    spec = load_sweep("examples/sweeps/demo_loss.yaml")
    runs = plan_runs(spec)
    assert [r.label for r in runs] == [f"{v}/seed{s}" for v in ("cispo", "dapo")
                                       for s in (1, 2, 3)]
    for run in runs:
        cfg = run.config
        assert run.output_dir == Path("runs/sweep_demo_loss") / run.variant / f"seed{run.seed}"
        assert Path(cfg.output_dir) == run.output_dir and cfg.seed == run.seed
        assert cfg.algorithm.loss == run.variant and cfg.train.num_steps == 30
        assert cfg.data.split_seed == 1234  # the sweep's overrides reach every run
        assert cfg.checkpoint_dir == str(run.output_dir / "checkpoints")
        assert cfg.rollout.thinking_budget == 26  # and the rest is the demo recipe's
    assert spec.parallel == 1  # one run after another unless the file says otherwise
    assert runs[0].overrides == ("data.split_seed=1234", "algorithm.loss=cispo", "seed=1",
                                 'output_dir="runs/sweep_demo_loss/cispo/seed1"',
                                 "train.num_steps=30")


@pytest.mark.parametrize("fields, message", [
    ({"varients": "{a: []}"}, "unknown field 'varients'; did you mean 'variants'?"),
    ({"seeds": None}, "seeds: missing"),
    ({"base": "examples/configs/nope.yaml"}, "base: recipe 'examples/configs/nope.yaml' does "
                                             "not exist"),
    ({"variants": "{a/b: []}"}, "variants: name 'a/b' must be"),
    ({"variants": "[cispo, dapo]"}, "variants: expected a mapping"),
    ({"variants": "{a: algorithm.loss=dapo}"}, "variants.a: expected a list"),
    ({"seeds": "[1, 1]"}, "seeds: [1, 1] repeats a seed"),
    ({"seeds": "[-1]"}, "seeds: expected a non-empty list of non-negative integers"),
    ({"budget": "{steps: 3, compute_gpu_hours: 2}"}, "budget: expected exactly one of"),
    ({"budget": "{steps: 0}"}, "budget.steps: expected an integer >= 1, got 0"),
    ({"budget": "{compute_gpu_hours: lots}"}, "budget.compute_gpu_hours: expected a number > 0"),
    ({"overrides": "data.split_seed=7"}, "overrides: expected a list"),
    ({"parallel": "0"}, "parallel: expected an integer >= 1, got 0"),
    ({"parallel": '"x"'}, "parallel: expected an integer >= 1, got 'x'"),
    ({"parallel": "1.5"}, "parallel: expected an integer >= 1, got 1.5"),
    ({"variants": "{a: [seed=3]}"}, "variants.a: 'seed=3' sets seed, which the sweep sets"),
    ({"overrides": "[train.num_steps=9]"}, "overrides: 'train.num_steps=9' sets "
                                           "train.num_steps, which the sweep sets for every run "
                                           "from budget.steps"),
    # The run config's own validation, naming the list the override came from:
    ({"variants": "{a: [algorithm.loss=ppo]}"}, "variants.a: algorithm.loss: expected one of"),
    ({"variants": "{a: [algorithm.los=dapo]}"},
     "variants.a: algorithm.los: unknown field; did you mean 'algorithm.loss'?"),
    ({"overrides": "[train.global_batch_size=6]"}, "overrides: train.global_batch_size: 6 is "
                                                   "not a multiple"),
    ({"overrides": "[checkpoint.dir=/tmp/shared]"}, "checkpoint.dir is '/tmp/shared', so every "
                                                    "run of the sweep would share it"),
    ({"variants": "{a: [], b: [eval.warmup_compute_gpu_hours=5]}"},
     "eval.warmup_compute_gpu_hours differs between variants (a: 0, b: 5)"),
])
def test_a_broken_sweep_file_is_one_line_naming_the_field(tmp_path, fields, message):
    path = _sweep_file(tmp_path, _good(tmp_path, **fields))
    with pytest.raises(SweepError) as err:
        plan_runs(load_sweep(path))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_command_exits_2_with_one_line_and_refuses_an_existing_sweep_without_resume(
        tmp_path, capsys):
    broken = _sweep_file(tmp_path, _good(tmp_path, budget="{steps: -2}"))
    assert megatron_rl_main(["sweep", str(broken)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("megatron-rl sweep: error: ") and "budget.steps" in err
    assert "\n" not in err
    good = _sweep_file(tmp_path, _good(tmp_path))
    (tmp_path / "out" / "dapo" / "seed2").mkdir(parents=True)
    assert megatron_rl_main(["sweep", str(good)]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds runs of a sweep (dapo/seed2); continue it with --resume" in err
    assert "\n" not in err


def _scaling_lines(*points: tuple[int, float]) -> str:
    """scaling.jsonl text of overall-task validations at (step, compute)."""
    return "".join(json.dumps({"step": s, "compute_gpu_hours": c, "pass_rate": 0.1,
                               "task": "all"}) + "\n" for s, c in points)


def _commit(root: Path, step: int, scaling: str = "") -> None:
    """A committed run checkpoint of `step` through the run's own commit (manifest + rename)."""
    staging = run_checkpoint.partial_path(root, step)
    staging.mkdir(parents=True)
    (staging / "scaling.jsonl").write_text(scaling)
    run_checkpoint.commit(staging, run_checkpoint.checkpoint_path(root, step), step=step)


def test_where_a_run_stands_comes_from_its_own_checkpoints(tmp_path):
    spec = load_sweep(_sweep_file(tmp_path, _good(tmp_path)))
    run = plan_runs(spec)[0]  # train.num_steps = 3
    root = Path(run.config.checkpoint_dir)
    assert run_state(run, spec) == (RunState.FRESH, None)
    run.output_dir.mkdir(parents=True)
    (run.output_dir / "train.log").write_text("a run that died while reading its data\n")
    assert run_state(run, spec) == (RunState.FRESH, None)  # nothing of the run's own
    ScalingLog(run.output_dir).append(0, 0.0, {"all": 0.1})
    assert run_state(run, spec) == (RunState.RESTART, None)  # started, nothing to resume
    _commit(root, 2)
    run_checkpoint.partial_path(root, 3).mkdir()  # a save that did not finish
    assert run_state(run, spec) == (RunState.RESUME, 2)
    shutil.rmtree(run_checkpoint.partial_path(root, 3))
    _commit(root, 3, _scaling_lines((0, 0.0), (2, 0.001), (3, 0.0015)))
    assert run_state(run, spec) == (RunState.FINISHED, 3)


def test_a_run_is_finished_only_once_its_last_step_is_validated(tmp_path):
    """Issue 37 item 9. A stop during the validation of the last step still writes the
    checkpoint at train.num_steps; the run is finished only once that validation is logged,
    which its own --resume does (`megatron-rl train` validates the missing step and exits)."""
    spec = load_sweep(_sweep_file(tmp_path, _good(tmp_path)))
    run = plan_runs(spec)[0]  # train.num_steps = 3, eval.interval_steps = 2: step 3 validates
    root = Path(run.config.checkpoint_dir)
    before = _scaling_lines((0, 0.0), (2, 0.001))
    _commit(root, 3, before)  # stopped during the validation of step 3
    (run.output_dir / "scaling.jsonl").write_text(before)
    assert run_state(run, spec) == (RunState.RESUME, 3)
    # The resumed run put back the checkpoint's log and appended its validation of step 3.
    ScalingLog(run.output_dir).append(3, 0.0015, {"all": 0.2, "arithmetic": 0.2})
    assert run_state(run, spec) == (RunState.FINISHED, 3)
    # A checkpoint written after the validation holds it in its own copy of the log.
    other = plan_runs(spec)[1]
    _commit(Path(other.config.checkpoint_dir), 3, before + _scaling_lines((3, 0.0015)))
    assert run_state(other, spec) == (RunState.FINISHED, 3)
    # A recipe that does not validate its last step is finished by the checkpoint alone.
    spec = load_sweep(_sweep_file(tmp_path, _good(
        tmp_path, output_dir=str(tmp_path / "quiet"),
        overrides="[data.split_seed=7, eval.interval_steps=0, eval.at_step_zero=false]")))
    quiet = plan_runs(spec)[0]
    _commit(Path(quiet.config.checkpoint_dir), 3)
    assert run_state(quiet, spec) == (RunState.FINISHED, 3)


def test_a_compute_budget_is_reached_by_the_checkpoints_scaling_log(tmp_path):
    spec = load_sweep(_sweep_file(tmp_path, _good(tmp_path, budget="{compute_gpu_hours: 2e-3}")))
    assert spec.budget_compute_gpu_hours == 0.002 and spec.budget_steps is None
    run = plan_runs(spec)[0]
    assert run.config.train.num_steps == 4  # the recipe's, a cap
    root = Path(run.config.checkpoint_dir)
    lines = [json.dumps({"step": s, "compute_gpu_hours": c, "pass_rate": 0.0, "task": "all"})
             for s, c in ((0, 0.0), (1, 0.0011), (2, 0.0019))]
    _commit(root, 2, "\n".join(lines) + "\n")
    assert run_state(run, spec) == (RunState.RESUME, 2)
    torn = lines + [json.dumps({"step": 3, "compute_gpu_hours": 0.0024, "pass_rate": 0.0,
                                "task": "all"}), '{"step": 4, "compu']
    _commit(root, 3, "\n".join(torn))
    assert logged_compute(root / "step_000003" / "scaling.jsonl") == 0.0024
    assert run_state(run, spec) == (RunState.FINISHED, 3)


def test_the_a_tolerance_is_the_larger_of_0_02_and_the_seed_spreads():
    assert a_tolerance(None, None) == 0.02  # one seed each: nothing measured
    assert a_tolerance(0.005, None) == 0.02
    assert a_tolerance(0.01, 0.03) == 0.03
    assert a_tolerance(0.01, 0.03, floor=0.05) == 0.05


def _curve(a, b, c_mid=1.0, r0=0.2, noise_seed=0):
    compute = np.geomspace(0.05, 20.0, 30)
    rng = np.random.default_rng(noise_seed)
    rate = r0 + (a - r0) / (1.0 + (c_mid / compute) ** b) + rng.normal(0.0, 0.002, compute.size)
    return ScalingSeries(run="r", task="all", compute_gpu_hours=np.r_[0.0, compute],
                         pass_rate=np.clip(np.r_[r0, rate], 0.0, 1.0),
                         step=np.arange(compute.size + 1))


def _variant(name, curves):
    runs = [RunResult(variant=name, seed=i, output_dir=Path(name), log=Path(name) / "train.log",
                      failed=False, exit_code=None, wall_seconds=None, series=s,
                      fit=fit_sigmoid(s.compute_gpu_hours, s.pass_rate, r0=s.r0, config=FAST))
            for i, s in enumerate(curves)]
    return variant_result(name, (), runs, FAST)


def test_the_seed_spread_is_the_sample_std_of_the_per_seed_a():
    fits = [0.60, 0.62, 0.64]  # mean 0.62; sum of squares 0.0008 / (3 - 1) -> std 0.02
    variant = _variant("v", [_curve(a, 1.5, noise_seed=i) for i, a in enumerate(fits)])
    per_seed = [r.fit.a for r in variant.runs]
    assert np.allclose(per_seed, fits, atol=0.006)  # the fits find the curves' A
    mean = sum(per_seed) / 3
    assert variant.seed_spread == pytest.approx(
        (sum((a - mean) ** 2 for a in per_seed) / 2) ** 0.5, rel=1e-12)
    assert _variant("one", [_curve(0.6, 1.5)]).seed_spread is None


def test_ranking_a_first_then_b_within_the_tolerance_then_indistinguishable():
    # |dA| = 0.10 >= 0.02: the higher A ranks first, whatever B says.
    high, low = _variant("high", [_curve(0.70, 1.0)]), _variant("low", [_curve(0.60, 3.0)])
    ranking = rank_variants([low, high], FAST)
    assert [(p.rank, p.variant) for p in ranking] == [(1, "high"), (2, "low")]
    assert ranking[1].tolerance == 0.02 and "|dA| 0.100 >= max(0.02" in ranking[1].verdict
    # |dA| = 0.01 < 0.02: equal A; B (refitted with A fixed at the mean) decides: 3.0 beats 1.0,
    # so the variant with the lower A ranks first.
    slow, fast = _variant("slow", [_curve(0.61, 1.0)]), _variant("fast", [_curve(0.60, 3.0)])
    ranking = rank_variants([slow, fast], FAST)
    assert [(p.rank, p.variant) for p in ranking] == [(1, "fast"), (2, "slow")]
    assert "less compute-efficient" in ranking[1].verdict
    # |dA| = 0.025 is above 0.02 but within a seed spread of ~0.1, and B (A fixed at the mean)
    # ties within the bootstrap intervals of the noisy pooled curve: one rank.
    noisy = _variant("noisy", [_curve(0.55, 1.5, noise_seed=1), _curve(0.70, 1.5, noise_seed=2)])
    steady = _variant("steady", [_curve(0.60, 1.5, noise_seed=3)])
    assert noisy.seed_spread == pytest.approx(0.106, abs=0.01)
    assert abs(noisy.pooled.a - steady.pooled.a) == pytest.approx(0.025, abs=0.003)
    ranking = rank_variants([noisy, steady], FAST)
    assert [p.rank for p in ranking] == [1, 1]
    assert ranking[1].tolerance == pytest.approx(noisy.seed_spread)
    assert ranking[1].verdict.startswith(f"indistinguishable from {ranking[0].variant}")


def _log(run_dir: Path, a: float, b: float, seed: int) -> None:
    log = ScalingLog(run_dir)
    curve = _curve(a, b, noise_seed=seed)
    for step, compute, rate in zip(curve.step, curve.compute_gpu_hours, curve.pass_rate):
        log.append(int(step), float(compute), {"all": float(rate)})


def test_the_report_matches_megatron_rl_fit_on_the_same_logs(tmp_path, capsys):
    spec = load_sweep(_sweep_file(tmp_path, _good(tmp_path)))
    runs = plan_runs(spec)
    for run, (a, b) in zip(runs, ((0.62, 1.5), (0.66, 1.2), (0.50, 1.5), (0.52, 2.0))):
        if run.label != "dapo/seed2":  # this one failed before validating
            _log(run.output_dir, a, b, run.seed)
    returned = report_sweep(spec, runs, failed={"dapo/seed2": 1},
                            wall_seconds={"cispo/seed1": 61.0}, plots=False, config=FAST)
    printed = capsys.readouterr().out
    content = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert content == json.loads(json.dumps(returned))
    done = [r.output_dir for r in runs if r.label != "dapo/seed2"]
    out_json = tmp_path / "fit.json"
    assert fit_main([*map(str, done), "--num-bootstrap", "20", "--fit-fraction", "0.5",
                     "--no-plots", "--json", str(out_json)]) == 0
    reference = json.loads(out_json.read_text())
    swept = [r for v in content["variants"] for r in v["runs"] if r["fit"] is not None]
    assert [r["run"] for r in swept] == ["cispo/seed1", "cispo/seed2", "dapo/seed1"]
    for ours, theirs in zip(swept, reference):
        assert ours["fit"] == theirs["fit"]
        half = theirs["extrapolation"]
        assert ours["first_half"] == {
            "fit_budget_gpu_hours": half["fit_budget_gpu_hours"],
            "points_fitted": half["fit"]["num_points"], "a": half["fit"]["a"],
            "predicted": half["predicted"], "observed": half["observed"],
            "error": half["error"]}
    cispo, dapo = content["variants"]
    assert cispo["a_seed_spread"] == pytest.approx(
        np.std([r["fit"]["a"] for r in cispo["runs"]], ddof=1), rel=1e-12)
    assert cispo["first_half_error_mean"] == pytest.approx(
        np.mean([r["first_half"]["error"] for r in cispo["runs"]]), rel=1e-12)
    # One fitted dapo seed: its pooled fit is that seed's fit (R0 the same step-0 point).
    assert dapo["pooled"] == dapo["runs"][0]["fit"] and dapo["a_seed_spread"] is None
    assert cispo["pooled"]["num_points"] == 60  # both seeds' points past C = 0
    assert [p["variant"] for p in content["ranking"]] == ["cispo", "dapo"]
    assert content["failed"] == [{"run": "dapo/seed2", "exit_code": 1,
                                  "log": str(tmp_path / "out" / "dapo" / "seed2" / "train.log")}]
    dapo_2 = dapo["runs"][1]
    assert dapo_2["status"] == "failed" and "no such run directory" in dapo_2["problem"]
    assert f"FAILED: dapo/seed2 (exit status 1); log: {runs[3].log}" in printed
    assert cispo["runs"][0]["wall_seconds"] == 61.0 and "1m01s" in printed


def test_a_killed_sweep_takes_its_run_down_gracefully(tmp_path):
    """The run's process gets SIGTERM (its graceful stop) when the sweep dies, even by SIGKILL."""
    ready, stopped = tmp_path / "ready", tmp_path / "got_sigterm"
    run = (f"import signal, sys, time\n"
           f"signal.signal(signal.SIGTERM, lambda *a: (open({str(stopped)!r}, 'w').close(), "
           f"sys.exit(0)))\nopen({str(ready)!r}, 'w').close()\ntime.sleep(60)\n")
    sweep_side = ("import subprocess, sys, time\n"
                  "from megatron_rl.scaling.sweep import _stop_with_the_sweep\n"
                  f"subprocess.Popen([sys.executable, '-c', {run!r}], "
                  "preexec_fn=_stop_with_the_sweep, start_new_session=True)\ntime.sleep(60)\n")
    sweep = subprocess.Popen([sys.executable, "-c", sweep_side],
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists()
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    while not stopped.exists() and time.monotonic() < deadline + 10:
        time.sleep(0.05)
    assert stopped.exists()


# A stand-in for `megatron-rl train`, for the sweep's scheduling logic only: it notes its start
# (and each SIGTERM, and its end) in stand_in.jsonl of its run directory. "finish": it waits
# until two runs of the sweep have started (so two run at once if the sweep lets them), then
# commits a checkpoint at train.num_steps (the run is finished) and exits. "stop": it stays until
# its second SIGTERM, like a run in the middle of a step whose first SIGTERM is a graceful stop.
STAND_IN = """
import json, signal, sys, time
from pathlib import Path
from megatron_rl.resilience import checkpoint
out, root, num_steps, mode = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
def note(what):
    with open(out / "stand_in.jsonl", "a") as f:
        f.write(json.dumps({"what": what, "at": time.time()}) + "\\n")
terms = []
signal.signal(signal.SIGTERM, lambda *_: (note("sigterm"), terms.append(1)))
note("start")
deadline = time.monotonic() + 30
if mode == "finish":
    while len(list(out.parents[1].glob("*/seed*/stand_in.jsonl"))) < 2 and \\
            time.monotonic() < deadline:
        time.sleep(0.02)
    staging = checkpoint.partial_path(root, num_steps)
    staging.mkdir(parents=True)
    (staging / "scaling.jsonl").write_text(json.dumps({"step": num_steps, "compute_gpu_hours":
        0.001, "pass_rate": 0.1, "task": "all"}) + "\\n")  # its last step's validation
    checkpoint.commit(staging, checkpoint.checkpoint_path(root, num_steps), step=num_steps)
else:
    while len(terms) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
note("end")
"""


def _stand_in(mode: str):
    def command(run, spec, *, resume):
        return [sys.executable, "-c", STAND_IN, str(run.output_dir), run.config.checkpoint_dir,
                str(run.config.train.num_steps), mode]
    return command


def _notes(run) -> list[dict]:
    path = run.output_dir / "stand_in.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _wait_for(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_parallel_runs_at_most_that_many_at_once_all_of_them_in_plan_order(
        tmp_path, monkeypatch, capsys):
    """parallel: 2 and three runs: two run at once, never three, and the third starts when one
    has exited. The runs are a stand-in (STAND_IN) for the scheduling logic only."""
    path = _sweep_file(tmp_path, _good(tmp_path, variants="{cispo: [algorithm.loss=cispo]}",
                                       seeds="[1, 2, 3]", parallel="2"))
    monkeypatch.setattr(sweep, "train_command", _stand_in("finish"))
    assert sweep.main([str(path), "--no-plots"]) == 0
    runs = plan_runs(load_sweep(path))
    spans = []
    for run in runs:
        notes = _notes(run)
        assert [n["what"] for n in notes] == ["start", "end"]  # each run ran once, to its end
        spans.append((notes[0]["at"], notes[1]["at"]))
    # Each stand-in's span lies inside its process's life, so this counts exactly.
    at_once = [sum(start <= s < end for start, end in spans) for s, _ in spans]
    assert max(at_once) == 2, spans
    attempts = [json.loads(line) for line in
                (tmp_path / "out" / "attempts.jsonl").read_text().splitlines()]
    assert [a["run"] for a in sorted(attempts, key=lambda a: a["started_at"])] == [
        "cispo/seed1", "cispo/seed2", "cispo/seed3"]
    printed = capsys.readouterr().out
    assert "up to 2 runs at once" in printed and "note: parallel: 2: runs without " \
        "cluster.address each start a local Ray cluster" in printed
    for number, run in enumerate(runs, start=1):
        assert f"[{number}/3] {run.label}: starting" in printed
        assert f"[{number}/3] {run.label}: finished in" in printed


def test_a_stop_signal_reaches_every_running_run_and_starts_no_further_one(tmp_path):
    """The sweep (parallel: 2, three runs) gets SIGTERM while two runs run: each of them gets
    one SIGTERM, the third never starts, and the sweep waits for them; a second SIGTERM reaches
    both again, and the sweep exits 128 + 15. The runs are a stand-in (STAND_IN) for the
    scheduling logic only."""
    path = _sweep_file(tmp_path, _good(tmp_path, variants="{cispo: [algorithm.loss=cispo]}",
                                       seeds="[1, 2, 3]", parallel="2"))
    driver = ("import sys\nfrom megatron_rl.scaling import sweep\n"
              f"STAND_IN = {STAND_IN!r}\n"
              "sweep.train_command = lambda run, spec, *, resume: [sys.executable, '-c', "
              "STAND_IN, str(run.output_dir), run.config.checkpoint_dir, "
              "str(run.config.train.num_steps), 'stop']\n"
              f"sys.exit(sweep.main([{str(path)!r}]))\n")
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    runs = plan_runs(load_sweep(path))

    def what(run) -> list[str]:
        return [n["what"] for n in _notes(run)]

    try:
        assert _wait_for(lambda: all(what(run) == ["start"] for run in runs[:2]))
        proc.send_signal(signal.SIGTERM)
        assert _wait_for(lambda: all(what(run) == ["start", "sigterm"] for run in runs[:2]))
        time.sleep(0.5)  # a few of the sweep's polls: nothing more is passed on or started
        assert [what(run) for run in runs[:2]] == [["start", "sigterm"]] * 2
        assert proc.poll() is None  # it waits for its runs
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM.value, stderr
    assert [what(run) for run in runs[:2]] == [["start", "sigterm", "sigterm", "end"]] * 2
    assert not runs[2].output_dir.exists()
    assert "[1/3] cispo/seed1: stopped (exit status 0, newest checkpoint: none)" in stdout
    assert "[3/3]" not in stdout and "FAILED" not in stdout
    assert "stopped by SIGTERM; continue with `megatron-rl sweep" in stderr
    attempts = (tmp_path / "out" / "attempts.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["run"] for line in attempts) == ["cispo/seed1", "cispo/seed2"]


# A stand-in for a resumed `megatron-rl train` under a compute budget, for the sweep's budget
# logic only. Like the real run it takes a while to start (Ray, engines) before it puts back its
# checkpoint's scaling log, then validates a step past the budget, and on SIGTERM writes a
# checkpoint (with the log) and exits. It notes each event in stand_in.jsonl.
BUDGET_STAND_IN = """
import json, shutil, signal, sys, time
from pathlib import Path
from megatron_rl.resilience import checkpoint
out, root = Path(sys.argv[1]), sys.argv[2]
def note(what):
    with open(out / "stand_in.jsonl", "a") as f:
        f.write(json.dumps({"what": what, "at": time.time()}) + "\\n")
terms = []
signal.signal(signal.SIGTERM, lambda *_: (note("sigterm"), terms.append(1)))
note("start")
time.sleep(0.5)  # start-up: several of the sweep's budget checks
shutil.copyfile(checkpoint.list_checkpoints(root)[0] / "scaling.jsonl", out / "scaling.jsonl")
note("restored")
with open(out / "scaling.jsonl", "a") as f:
    f.write(json.dumps({"step": 3, "compute_gpu_hours": 0.0025, "pass_rate": 0.1,
                        "task": "all"}) + "\\n")
note("validated")
deadline = time.monotonic() + 30
while not terms and time.monotonic() < deadline:
    time.sleep(0.02)
staging = checkpoint.partial_path(root, 3)
staging.mkdir(parents=True)
shutil.copyfile(out / "scaling.jsonl", staging / "scaling.jsonl")
checkpoint.commit(staging, checkpoint.checkpoint_path(root, 3), step=3)
note("end")
"""


def test_a_resumed_run_is_stopped_for_its_budget_by_its_own_validations_only(
        tmp_path, monkeypatch, capsys):
    """Issue 37 item 8. The run crashed after validating step 3 past the budget, with step 2
    its newest checkpoint (below the budget): it resumes, and the budget stops it (one SIGTERM)
    only after it restored its checkpoint's log and validated past the budget itself, not on the
    previous attempt's log. The run is a stand-in (BUDGET_STAND_IN) for the budget logic only."""
    path = _sweep_file(tmp_path, _good(tmp_path, variants="{cispo: [algorithm.loss=cispo]}",
                                       seeds="[1]", budget="{compute_gpu_hours: 2e-3}"))
    (run,) = plan_runs(load_sweep(path))
    root = Path(run.config.checkpoint_dir)
    below = _scaling_lines((0, 0.0), (1, 0.0011), (2, 0.0019))
    _commit(root, 2, below)
    (run.output_dir / "scaling.jsonl").write_text(below + _scaling_lines((3, 0.0024)))
    assert run_state(run, load_sweep(path)) == (RunState.RESUME, 2)
    monkeypatch.setattr(sweep, "POLL_S", 0.0)  # look at the log on every tick
    monkeypatch.setattr(sweep, "train_command", lambda run, spec, *, resume: [
        sys.executable, "-c", BUDGET_STAND_IN, str(run.output_dir), run.config.checkpoint_dir])
    assert sweep.main([str(path), "--resume", "--no-plots"]) == 0
    assert [n["what"] for n in _notes(run)] == ["start", "restored", "validated", "sigterm", "end"]
    assert run_state(run, load_sweep(path)) == (RunState.FINISHED, 3)
    printed = capsys.readouterr().out
    assert "[1/1] cispo/seed1: resuming from step 2" in printed
    assert "cispo/seed1 validated past the budget of 0.002 GPU-hours: stopping it" in printed
    assert "[1/1] cispo/seed1: finished in" in printed


def _run(name, seed, series, *, failed=False, config=FAST):
    return RunResult(variant=name, seed=seed, output_dir=Path(name), log=Path(name) / "train.log",
                     failed=failed, exit_code=1 if failed else None, wall_seconds=None,
                     series=series, fit=fit_sigmoid(series.compute_gpu_hours, series.pass_rate,
                                                    r0=series.r0, config=config))


def test_a_failed_runs_cut_short_curve_stays_out_of_the_pooled_fit_and_the_seed_spread():
    """Issue 37 item 13. A run that failed early has a short curve whose fit is not the
    variant's; it is left out of the pooled fit and of the seed spread, and named."""
    full = [_curve(0.60, 1.5, noise_seed=1), _curve(0.62, 1.5, noise_seed=2)]
    short = _curve(0.60, 1.5, noise_seed=3)
    keep = short.compute_gpu_hours <= 0.3  # it failed before the curve bent
    short = ScalingSeries(run="r", task="all", compute_gpu_hours=short.compute_gpu_hours[keep],
                          pass_rate=short.pass_rate[keep], step=short.step[keep])
    runs = [_run("v", 1, full[0]), _run("v", 2, full[1]), _run("v", 3, short, failed=True)]
    variant = variant_result("v", (), runs, FAST)
    assert variant.seed_spread == pytest.approx(np.std([runs[0].fit.a, runs[1].fit.a], ddof=1))
    series, r0 = pooled_curve("v", runs[:2])  # the two that finished, by the reference path
    assert variant.pooled_series.num_points == series.num_points == 2 * 31
    assert variant.pooled.a == fit_series(series, r0=r0, config=FAST).a
    assert [r.label for r in variant.ranked_runs] == ["v/seed1", "v/seed2"]
    assert runs[2].excluded.startswith("failed (exit status 1)")
    # Every run with a curve failed: the variant is not ranked, and the report says why.
    alone = variant_result("w", (), [_run("w", 1, full[0], failed=True)], FAST)
    assert alone.problem.startswith("every run with a curve failed") and "w/seed1" in alone.problem
    assert rank_variants([alone, variant], FAST)[0].variant == "v"
    assert [p.variant for p in rank_variants([alone, variant], FAST)] == ["v"]


def test_a_curve_without_learning_leaves_its_variant_unranked_and_says_so(tmp_path, capsys):
    """Issue 37 item 12. All-zero curves fit as A = one grid step, B at its bound: the report
    says "no learning signal" instead of numbers and does not rank the variant."""
    spec = load_sweep(_sweep_file(tmp_path, _good(tmp_path)))
    runs = plan_runs(spec)
    for run in runs:
        log = ScalingLog(run.output_dir)
        curve = _curve(0.62, 1.5, noise_seed=run.seed)
        for step, compute, rate in zip(curve.step, curve.compute_gpu_hours, curve.pass_rate):
            log.append(int(step), float(compute),
                       {"all": float(rate) if run.variant == "cispo" else 0.0})
    content = report_sweep(spec, runs, failed={}, wall_seconds={}, plots=False, config=FAST)
    printed = capsys.readouterr().out
    cispo, dapo = content["variants"]
    assert [p["variant"] for p in content["ranking"]] == ["cispo"]
    assert content["not_ranked"]["dapo"].startswith("no learning signal in the pooled fit: A "
                                                    "0.005 within one grid step")
    for record in (dapo["pooled"], *(r["fit"] for r in dapo["runs"])):
        assert record["a"] is None and record["b"] is None and record["c_mid"] is None
        assert record["a_ci"] is None and "at its upper bound" in record["no_learning_signal"]
    assert dapo["pass_rate_at_target"] is None and dapo["seeds_ranked"] == []
    assert cispo["pooled"]["no_learning_signal"] is None and cispo["pooled"]["a"] > 0.6
    assert "left out of the ranking statistics: dapo/seed1: no learning signal: A 0.005 within " \
        "one grid step" in printed
    dapo_row = next(line for line in printed.splitlines() if line.startswith("│ dapo "))
    assert re.search(r"│ 0/2 +│ 0\.000 │ no learning signal +│ - +│ - +│", dapo_row), dapo_row
    assert "not ranked: no learning signal in the pooled fit" in printed


def test_a_mean_a_below_a_variants_r0_is_a_tie_not_a_crash(tmp_path):
    """Issue 37 item 10. A variant that starts high and barely moves (R0 0.30 -> A 0.31) next to
    one that climbs to 0.285: A is within the tolerance, and their mean A (~0.298) is below the
    first one's R0, so no curve of it rises to that A. The comparison is a tie that says why, and
    the report is written."""
    high = _variant("high", [_curve(0.31, 1.5, r0=0.30)])
    climb = _variant("climb", [_curve(0.285, 1.5, r0=0.05)])
    assert high.pooled.no_learning_signal is None and climb.pooled.no_learning_signal is None
    assert 0.5 * (high.pooled.a + climb.pooled.a) <= high.pooled_r0
    ranking = rank_variants([high, climb], FAST, floor=0.05)
    assert [p.rank for p in ranking] == [1, 1]
    assert "is not above the R0 0.300 of high: B cannot be compared" in ranking[1].verdict
    assert ranking[1].verdict.startswith("indistinguishable from high: |dA| 0.025 < max(0.05")


def _simulated_variant(name, rng, *, a=0.6, b=1.5, num_seeds=3):
    """A variant of `num_seeds` seeds as the paper describes seed-to-seed variation: per seed
    A ~ N(a, 0.015) and B = b (1 + N(0, 0.15)); 12 validations each with noise sd 0.005."""
    compute = np.geomspace(0.05, 20.0, 12)
    runs = []
    for seed in range(num_seeds):
        a_seed, b_seed = a + rng.normal(0.0, 0.015), b * (1.0 + rng.normal(0.0, 0.15))
        rate = 0.2 + (a_seed - 0.2) / (1.0 + (1.0 / compute) ** b_seed)
        rate = rate + rng.normal(0.0, 0.005, compute.size)
        series = ScalingSeries(run=name, task="all", compute_gpu_hours=np.r_[0.0, compute],
                               pass_rate=np.clip(np.r_[0.2, rate], 0.0, 1.0),
                               step=np.arange(compute.size + 1))
        runs.append(_run(name, seed, series, config=SIMULATION))
    return variant_result(name, (), runs, SIMULATION)


SIMULATION = SigmoidFitConfig(num_bootstrap=0)  # the seeds are the replicates


def test_variants_that_differ_by_chance_are_rarely_ranked_apart():
    """Issue 37 item 11. Ten variants drawn from one distribution (3 seeds each, seed spread of
    A 0.015 and of B 15%), compared pair by pair: at the 95% level at most 5% of the 45 pairs
    may be ranked apart (the pooled bootstrap intervals, which treat seeds x points as
    independent, ranked about half of them apart). Variants that do differ (B doubled, or A up
    by 0.06) are still ranked apart from every one of three plain ones, in the right order."""
    rng = np.random.default_rng(2037)
    same = [_simulated_variant(f"v{i}", rng) for i in range(10)]
    apart = [(x.name, y.name) for x, y in itertools.combinations(same, 2)
             if len({p.rank for p in rank_variants([x, y], SIMULATION)}) == 2]
    print(f"ranked apart: {len(apart)} of 45 pairs")
    assert len(apart) <= 0.05 * 45, apart
    steeper = _simulated_variant("steeper", rng, b=3.0)
    higher = _simulated_variant("higher", rng, a=0.66)
    for better in (steeper, higher):
        for plain in same[:3]:
            ranking = rank_variants([plain, better], SIMULATION)
            assert [(p.rank, p.variant) for p in ranking] == [(1, better.name), (2, plain.name)], (
                ranking[1].verdict)
