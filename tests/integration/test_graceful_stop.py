"""SIGTERM is always honoured (issue 31 item 4), on a real local Ray cluster: a driver stuck in
the waits a stalled run is stuck in (tests/integration/_stop_driver.py) abandons the wait for
generation at the first SIGTERM (an engine restart never blocks it: issue 37 item 5), its trainer
call once the grace period is over, and the second SIGTERM ends it at once from inside a plain
ray.get: exit 128 + 15, one line, no traceback, and no process of the run left (the local Ray
cluster's processes, the actor, a child "reward worker")."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 4.0


def _phases(out: Path) -> dict[str, dict]:
    path = out / "phases.jsonl"
    if not path.is_file():
        return {}
    return {r["phase"]: r for r in map(json.loads, path.read_text().splitlines())}


def _wait_for(out: Path, name: str, driver: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if name in (phases := _phases(out)):
            return phases[name]
        assert driver.poll() is None, f"driver exited {driver.returncode} before {name!r}:\n" \
            + (out / "driver.log").read_text()[-4000:]
        time.sleep(0.2)
    raise AssertionError(f"no {name!r} within {timeout_s} s:\n"
                         + (out / "driver.log").read_text()[-4000:])


def _alive(pid: int, create_time: float) -> bool:
    import psutil

    try:
        process = psutil.Process(pid)
        return process.create_time() == create_time and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_first_sigterm_abandons_the_waits_and_the_second_kills_the_run_at_once(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    with open(tmp_path / "driver.log", "w") as log:
        driver = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/integration/_stop_driver.py"), str(tmp_path),
             str(GRACE_S)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    try:
        _wait_for(tmp_path, "generation", driver, timeout_s=240)
        time.sleep(1.0)  # well inside the wait
        first = time.time()
        driver.send_signal(signal.SIGTERM)
        generation = _wait_for(tmp_path, "generation abandoned", driver, timeout_s=30)
        restart = _wait_for(tmp_path, "restart pending", driver, timeout_s=30)
        step = _wait_for(tmp_path, "step abandoned", driver, timeout_s=60)
        blocked = _wait_for(tmp_path, "blocked", driver, timeout_s=30)
        time.sleep(2.0)  # inside the plain ray.get
        second = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        returncode = driver.wait(timeout=60)
        exit_s = time.monotonic() - second
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
    log = (tmp_path / "driver.log").read_text()
    print(f"generation abandoned {generation['at'] - first:.1f} s after the first SIGTERM, the "
          f"trainer step {step['at'] - first:.1f} s after (grace {GRACE_S:g} s); exit "
          f"{exit_s:.1f} s after the second")
    # First SIGTERM: generation abandoned at once (the wait looks every second; the bounds are
    # ~10x for a loaded machine), the trainer call kept for the grace period, then abandoned and
    # marked: no checkpoint may be written over it.
    assert generation["signal"] == "SIGTERM" and not generation["no_checkpoint"], generation
    assert "abandoned for the SIGTERM" in generation["message"], generation
    assert generation["at"] - first < 15.0, generation["at"] - first
    # An engine restart (its actor's restart call hangs) does not hold the driver: polled.
    assert restart["polled"] == "{}", restart
    assert restart["at"] - generation["at"] < 15.0, restart["at"] - generation["at"]
    assert step["no_checkpoint"] and "TrainerWorker.train_step" in step["message"], step
    assert GRACE_S <= step["at"] - first < GRACE_S + 20.0, step["at"] - first
    # Second SIGTERM: out of a plain ray.get at once, 128 + 15, one line, no traceback.
    assert returncode == 128 + signal.SIGTERM, log[-4000:]
    assert exit_s < 30.0, exit_s
    assert "ray.get returned" not in _phases(tmp_path)
    assert log.count("second SIGTERM: stopping now") == 1, log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    # Every process of the run is gone: the Ray cluster's, the actor's, the reward worker.
    descendants = blocked["descendants"]
    assert blocked["reward_worker"] in [pid for pid, _ in descendants]
    assert len(descendants) >= 4, descendants  # gcs, raylet, a worker, the reward worker...
    deadline = time.monotonic() + 30
    while (left := [p for p in descendants if _alive(*p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, left
