"""A local Ray start that times out in Ray's fixed 30 s raylet registration (a machine loaded by
other work) is tried again with the failed attempt's processes killed; any other error is not."""
from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from megatron_rl.cluster import runtime

pytestmark = pytest.mark.unit


def test_a_start_that_timed_out_is_tried_again_and_its_processes_killed(capsys):
    started, calls = [], []

    def init():
        calls.append(1)
        if len(calls) < 3:  # Ray's message; a child process like the raylet it leaves behind
            started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
            raise Exception("The current node timed out during startup. This could happen ...")
        return "context"

    assert runtime._start_local(init) == "context"
    assert len(calls) == 3
    for process in started:  # killed, not left running
        assert process.wait(timeout=10) is not None
        assert not psutil.pid_exists(process.pid) or psutil.Process(process.pid).status() == \
            psutil.STATUS_ZOMBIE
    assert "starting it again (attempt 3 of 3)" in capsys.readouterr().err


def test_other_errors_and_the_last_timeout_are_raised():
    def broken():
        raise ValueError("bad argument")

    with pytest.raises(ValueError):
        runtime._start_local(broken)

    def always_times_out():
        raise Exception("The current node timed out during startup.")

    with pytest.raises(Exception, match="timed out during startup"):
        runtime._start_local(always_times_out)
