"""`megatron-rl sweep` on the real stack: two variants (CISPO, DAPO) x one seed of the tiny
recipe (Ray, one SGLang CPU generator, one Megatron trainer rank, reasoning-gym arithmetic), five
steps each with a validation after every step (6 curve points: the fewest a fit takes, 5 past
C = 0), plus a variant whose prompt file does not exist. The sweep is stopped by SIGTERM in the
middle of its first run and continued with --resume: the interrupted run resumes from the
checkpoint its graceful stop wrote, the next starts fresh, the broken one fails (exit 2 from
`megatron-rl train`) and the sweep reports the other two, names it and its log, and exits 1.
Run once more without the broken variant, every run is skipped as finished and the sweep exits 0.

Checked against independent references: the runs' own artefacts (train.log messages of the
graceful stop and the resume, checkpoints, ledger steps, process table); the report's fits
against `megatron-rl fit` run separately on the same run directories (warm-up read from the runs'
config.yaml); with one seed the pooled fit is that run's fit.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).parent))  # importlib mode: add the helpers
from _checks import ROOT, processes_left, tiny_llama_checkpoint, wait_for_exit  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]  # three runs, one resumed: ~800 s in the suite

NUM_STEPS = 5
RUN = ["logging.progress_bar=false", "eval.at_step_zero=true", "eval.interval_steps=1",
       "checkpoint.interval_steps=0",  # a checkpoint at the end and at a graceful stop only
       "rollout.mem_fraction_static=0.2",
       # The random starting policy solves nothing: keep the zero-variance groups so that every
       # step runs the trainer.
       "algorithm.zero_variance_filter=false"]


def _sweep(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "sweep", *args], cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    return wait_for_exit(proc, timeout=timeout)[0]


def _validated_steps(run_dir: Path) -> list[int]:
    path = run_dir / "scaling.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["step"] for line in lines
            if line.endswith("}") and json.loads(line)["task"] == "all"]


def _trained_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "ledger.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if "step" in r]


def test_sweep_stopped_and_resumed_reports_the_fits_of_megatron_rl_fit(tmp_path):
    from megatron_rl.cli import main as megatron_rl_main

    started = time.monotonic()
    model = tiny_llama_checkpoint(tmp_path / "tiny_llama")
    out = tmp_path / "sweep"
    sweep = {"name": "e2e", "base": "examples/configs/tiny_pipeline.yaml",
             "output_dir": str(out), "overrides": [f"model.hf_checkpoint={model}", *RUN],
             "variants": {"cispo": ["algorithm.loss=cispo"], "dapo": ["algorithm.loss=dapo"],
                          "broken": [f"data.prompts={tmp_path / 'missing.jsonl'}"]},
             "seeds": [1], "budget": {"steps": NUM_STEPS}}
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump(sweep, sort_keys=False))
    first, second, broken = (out / v / "seed1" for v in ("cispo", "dapo", "broken"))

    proc = _sweep(str(sweep_file))
    deadline = time.monotonic() + 600
    while not [s for s in _validated_steps(first) if s >= 2]:
        assert proc.poll() is None, _finish(proc, 10)[-4000:]
        assert time.monotonic() < deadline, "the first run validated no step 2 in 600 s"
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)  # as a Ctrl-C would: the sweep passes it on to the run
    output = _finish(proc, 600)
    assert proc.returncode == 128 + signal.SIGTERM, output[-4000:]
    assert "stopped by SIGTERM; continue with `megatron-rl sweep" in output, output[-4000:]
    log = (first / "train.log").read_text()
    stopped = re.search(r"stopped by SIGTERM after step (\d+)", log)
    assert stopped, log[-4000:]
    stopped_at = int(stopped.group(1))
    assert 2 <= stopped_at < NUM_STEPS, "the sweep was stopped too late to resume anything"
    assert [p.name for p in (first / "checkpoints").iterdir()] == [f"step_{stopped_at:06d}"]
    assert not second.exists() and not broken.exists()  # no run starts after the stop
    driver = json.loads((first / "processes.json").read_text())["driver"]["pid"]
    grace = time.monotonic() + 60
    while (left := processes_left(model_dir=model, driver_pid=driver)) and \
            time.monotonic() < grace:
        time.sleep(1)
    assert not left, left

    proc = _sweep(str(sweep_file), "--resume")
    output = _finish(proc, 900)
    assert proc.returncode == 1, output[-6000:]  # the broken run failed; the others finished
    assert f"[1/3] cispo/seed1: resuming from step {stopped_at}" in output, output[-6000:]
    assert "[2/3] dapo/seed1: starting" in output, output[-6000:]
    assert (f"[3/3] broken/seed1: FAILED (exit status 2, newest checkpoint: none); log: "
            f"{broken / 'train.log'}: megatron-rl train: error: ") in output, output[-6000:]
    assert f"FAILED: broken/seed1 (exit status 2); log: {broken / 'train.log'}" in output
    assert "resumed from" in (first / "train.log").read_text()
    for run in (first, second):
        assert _trained_steps(run) == list(range(1, NUM_STEPS + 1))  # each step once
        assert _validated_steps(run) == list(range(NUM_STEPS + 1))
    attempts = [json.loads(line) for line in (out / "attempts.jsonl").read_text().splitlines()]
    assert [(a["run"], a["action"], a["exit_code"]) for a in attempts] == [
        ("cispo/seed1", "start", 128 + signal.SIGTERM), ("cispo/seed1", "resume", 0),
        ("dapo/seed1", "start", 0), ("broken/seed1", "start", 2)]

    report = json.loads((out / "sweep.json").read_text())
    variants = {v["name"]: v for v in report["variants"]}
    assert report["fit"]["warmup_compute_gpu_hours"] == 0.0
    for name, run in (("cispo", first), ("dapo", second)):
        (ours,) = variants[name]["runs"]
        assert ours["status"] == "finished" and ours["final_step"] == NUM_STEPS
        assert ours["wall_seconds"] > 0
        assert variants[name]["pooled"] == ours["fit"]  # one seed: pooling changes nothing
        # `megatron-rl fit` on the run directory, with the paper's first-half protocol; with six
        # points the first half of the compute may hold too few for a fit (exit status 2).
        reference_file = tmp_path / f"{name}_fit.json"
        window = ["--fit-fraction", "0.5"]
        if megatron_rl_main(["fit", str(run), "--no-plots", *window,
                             "--json", str(reference_file)]) == 2:
            window = []
            assert megatron_rl_main(["fit", str(run), "--no-plots",
                                     "--json", str(reference_file)]) == 0
        theirs = next(e for e in json.loads(reference_file.read_text()) if e["task"] == "all")
        assert theirs["warmup_compute_gpu_hours"] == 0.0  # from the run's own config.yaml
        assert ours["fit"] == theirs["fit"] and ours["fit"]["num_points"] == NUM_STEPS + 1
        if window:
            half = theirs["extrapolation"]
            assert ours["first_half"] == {
                "fit_budget_gpu_hours": half["fit_budget_gpu_hours"],
                "points_fitted": half["fit"]["num_points"], "a": half["fit"]["a"],
                "predicted": half["predicted"], "observed": half["observed"],
                "error": half["error"]}
        else:
            assert ours["first_half"] is None
            assert "too few points" in ours["first_half_problem"]
    # Five steps from a random policy may not learn: a variant is ranked, or not ranked for
    # want of a learning signal (its fit then has no parameters), never both.
    ranked = {p["variant"] for p in report["ranking"]}
    unranked = {name: why for name, why in report["not_ranked"].items() if name != "broken"}
    assert ranked | set(unranked) == {"cispo", "dapo"} and not ranked & set(unranked), report
    assert all(why.startswith("no learning signal") for why in unranked.values()), unranked
    assert all(variants[name]["pooled"]["a"] is None for name in unranked)
    assert not ranked or report["ranking"][0]["rank"] == 1
    assert report["not_ranked"]["broken"] == "no run has a validation curve"
    assert report["failed"] == [{"run": "broken/seed1", "exit_code": 2,
                                 "log": str(broken / "train.log")}]
    for name in ("curves.png", "extrapolation.png"):
        assert (out / name).read_bytes().startswith(b"\x89PNG")

    # Without the broken variant, a finished sweep runs nothing again and exits 0.
    del sweep["variants"]["broken"]
    sweep_file.write_text(yaml.safe_dump(sweep, sort_keys=False))
    logs = {run: (run / "train.log").read_text() for run in (first, second)}
    proc = _sweep(str(sweep_file), "--resume", "--no-plots")
    output = _finish(proc, 300)
    assert proc.returncode == 0, output[-4000:]
    assert f"[1/2] cispo/seed1: finished (checkpoint step {NUM_STEPS}), skipped" in output
    assert f"[2/2] dapo/seed1: finished (checkpoint step {NUM_STEPS}), skipped" in output
    assert logs == {run: (run / "train.log").read_text() for run in (first, second)}
    again = json.loads((out / "sweep.json").read_text())
    assert again["variants"] == [variants["cispo"], variants["dapo"]] and not again["failed"]
    print(f"\n[test] the sweep e2e took {time.monotonic() - started:.0f} s")
