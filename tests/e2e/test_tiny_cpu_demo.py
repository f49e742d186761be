"""`make demo` end to end: the tiny CPU run learns its toy task and leaves every output behind.

The independent reference is the task itself: a random policy passes about half of the held-out
prompts (R0 ~ 0.5), and the run must lift the validation pass rate well above that, with the
curve log, TensorBoard events, a checkpoint and the fitted-curve plots written to output_dir.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_cpu_run_learns_and_writes_outputs(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "examples.tiny_cpu.run", f"output_dir={out}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    lines = [json.loads(line) for line in (out / "scaling.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines]
    assert steps == list(range(0, 41, 4))
    assert lines[0]["compute_gpu_hours"] == 0.0
    r0, final = lines[0]["pass_rate"], lines[-1]["pass_rate"]
    assert 0.3 < r0 < 0.7, f"a random policy should pass about half, got R0={r0}"
    assert final >= r0 + 0.3, f"no learning: pass rate {r0} -> {final}"

    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoints" / "step_000020").is_dir()
    assert (out / "curves.png").stat().st_size > 0
    assert (out / "config.yaml").is_file()
    assert "Sigmoid fits" in proc.stdout
