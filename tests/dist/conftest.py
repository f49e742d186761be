"""What every multi-process test shares: launching a worker script under `torchrun --standalone`.

One launcher so that every dist test gets the same guarantees: one thread per rank (2 cores), the
repository on PYTHONPATH, torchrun binding its own free port (no port races), and on a hang the
whole process group killed and the output shown, instead of ranks left waiting on each other.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_torchrun(worker: Path, args: list[str], *, num_ranks: int, timeout_s: int) -> str:
    """Run `worker args` on `num_ranks` gloo ranks; returns the combined output, fails on error."""
    cmd = [sys.executable, "-W", "ignore", "-m", "torch.distributed.run", "--nnodes=1",
           f"--nproc-per-node={num_ranks}", "--standalone", str(worker), *args]
    python_path = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(REPO_ROOT)]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own group: a hang is killed whole
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {timeout_s}s:\n{output[-4000:]}")
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{output[-6000:]}"
    return output


def run_torchrun_for_result(worker: Path, args: list[str], *, out_dir: Path, num_ranks: int,
                            timeout_s: int) -> dict:
    """`run_torchrun`, then the JSON the worker's rank 0 wrote to out_dir/result.json
    (`_trainer_worker.write_result`): the numbers the tests assert on."""
    run_torchrun(worker, args, num_ranks=num_ranks, timeout_s=timeout_s)
    return json.loads((out_dir / "result.json").read_text())


@pytest.fixture(scope="session")
def torchrun():
    return run_torchrun


@pytest.fixture(scope="session")
def torchrun_result():
    return run_torchrun_for_result
