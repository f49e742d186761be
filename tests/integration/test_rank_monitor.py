"""Trainer hang detection with nvidia-resiliency-ext's rank monitor (megatron_rl/resilience/
rank_monitor.py), with the real monitor process on CPU: a rank whose train step stays open past
the calibrated timeout (4 x the longest of its first three steps) is SIGKILLed by its monitor long
before its own 300 s hang would end, and the monitor process does not outlive it."""
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_rl.rollout.sglang_server import listen_port

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("_rank_monitor_worker.py")


def test_a_hung_train_step_is_killed_by_the_rank_monitor():
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(WORKER), str(listen_port())],
                          capture_output=True, text=True, timeout=280,
                          cwd=Path(__file__).resolve().parents[2])
    lines = proc.stdout.splitlines()
    assert proc.returncode == -9, proc.stdout + proc.stderr[-3000:]
    assert "hanging" in lines and "NOT KILLED" not in lines
    calibrated = float(next(l for l in lines if l.startswith("calibrated")).split()[1])
    assert 4 * 0.5 <= calibrated < 280, calibrated  # factor x the longest step, at least
    assert time.monotonic() - started < 280  # killed, not ended by its 300 s sleep
    # Each section runs under its own kind's timeout (step, weight sync, checkpoint).
    assert "sections checkpoint=800 train_step=600 weight_sync=700" in lines, lines
    server = int(next(l for l in lines if l.startswith("server pid")).split()[2])
    deadline = time.monotonic() + 30
    while psutil.pid_exists(server) and psutil.Process(server).status() != "zombie" and \
            time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == "zombie"
