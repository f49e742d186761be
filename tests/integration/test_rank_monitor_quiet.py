"""nvidia-resiliency-ext's rank monitor starts quietly on a machine without a GPU: its GPU and NIC
health checks used to print NVML's "Shared Library Not Found" with two chained tracebacks,
"Failed to shut down NVML" and "No such file or directory: /sys/class/infiniband" at every start
of every trainer rank, which a newcomer reads as a crash (megatron_rl/resilience/rank_monitor.py).
"""
import json
import os
import select
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.integration


def test_the_monitor_starts_without_health_check_noise_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("the quiet start is for machines without a GPU")
    with tempfile.TemporaryDirectory() as socket_dir:
        timeouts = {"rank_section_timeouts": {"train_step": 600.0}, "safety_factor": 5.0}
        # Started as RankMonitor.start does; this process plays the rank it dies with.
        server = subprocess.Popen(
            [sys.executable, "-m", "megatron_rl.resilience.rank_monitor", str(os.getpid()),
             os.path.join(socket_dir, "rmon.socket"), json.dumps(timeouts)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": socket_dir, "PYTHONWARNINGS": "ignore"}, text=True)
        try:
            ready, _, _ = select.select([server.stdout], [], [], 180)
            assert ready and server.stdout.readline().strip() == "ready"
        finally:
            server.terminate()
            _, stderr = server.communicate(timeout=30)
    assert stderr == "", stderr
