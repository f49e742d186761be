"""The second SIGTERM's hard stop (issue 37 item 6; megatron_rl/resilience/stop.py): it kills the
run's processes first and writes its line after, without waiting on stderr, so a full stderr pipe
that nobody reads cannot keep the run alive. Each case runs the real GracefulStop._on_signal in a
child interpreter whose stderr is a pipe this test never reads."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]

_DRIVER = """
import fcntl, os, signal, subprocess, sys
child = subprocess.Popen(["sleep", "600"], stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
if sys.argv[1] == "full":  # fill the stderr pipe (nobody reads it), then block on it as usual
    flags = fcntl.fcntl(2, fcntl.F_GETFL)
    fcntl.fcntl(2, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        while True:
            os.write(2, b"x" * 65536)
    except BlockingIOError:
        pass
    fcntl.fcntl(2, fcntl.F_SETFL, flags)
from megatron_rl.resilience.stop import RUN_STOP, GracefulStop
RUN_STOP.request(signal.SIGTERM)  # the first signal came already
GracefulStop()._on_signal(signal.SIGTERM)
print("still running", flush=True)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("stderr", ["full", "read"])
def test_the_second_signal_kills_first_and_never_waits_on_stderr(stderr, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    err = subprocess.PIPE if stderr == "full" else open(tmp_path / "stderr", "w")
    driver = subprocess.Popen([sys.executable, "-c", _DRIVER, stderr], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=err, text=True)
    child = int(driver.stdout.readline())
    try:
        returncode = driver.wait(timeout=30)  # on main: blocked on the full pipe for good
        child_killed = _gone(child)
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        if stderr == "full":
            driver.stderr.close()
        else:
            err.close()
    assert returncode == 128 + signal.SIGTERM
    assert "still running" not in driver.stdout.read()
    assert child_killed  # the run's processes were killed
    if stderr == "read":  # a stderr that takes the line gets it
        assert "second SIGTERM: stopping now" in (tmp_path / "stderr").read_text()
