"""Launching this folder's trainer-side worker scripts (_*_worker.py) from the pytest side.

Every worker takes `MODEL_DIR GENERATOR_URL OUT_JSON [ARGS...]` (and the generator's API key, if
it has one, in ENGINE_KEY_ENV: never on a command line), runs under `torchrun
--standalone` (torchrun binds its own free port: no fixed ports to collide), and its rank 0 writes
what it measured to OUT_JSON; the test asserts on that. The launch is its own process group, so a
timeout kills torchrun and every rank. Output goes to a log file, not a pipe: the colocated-tensor
transport starts torch's torch_shm_manager, which inherits a pipe and keeps it open after the
worker exits. A failed launch shows the log's tail.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LOG_TAIL_CHARS = 8000
ENGINE_KEY_ENV = "TEST_ENGINE_API_KEY"


class WorkerLaunch:
    """One torchrun launch of a worker script; `result()` waits for it."""

    def __init__(self, script: str, model_dir: str, url: str, *args: str, num_ranks: int,
                 directory: Path, api_key: str | None = None):
        self.out_path = directory / "result.json"
        self.log_path = directory / "worker.log"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(num_ranks), str(HERE / script), model_dir, url,
                   str(self.out_path), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        if api_key is not None:
            env[ENGINE_KEY_ENV] = api_key
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)

    def result(self, timeout_s: float) -> dict:
        """Rank 0's measurements; fails with the log's tail on a non-zero exit or a timeout."""
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            code = f"timeout after {timeout_s:.0f} s"
        assert code == 0, f"worker exit {code}:\n" + self.log_path.read_text()[-LOG_TAIL_CHARS:]
        return json.loads(self.out_path.read_text())

    def kill(self) -> None:
        """Kill torchrun and its ranks if they still run."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def run_worker(script: str, model_dir: str, url: str, *args: str, num_ranks: int,
               directory: Path, timeout_s: float, api_key: str | None = None) -> dict:
    """Launch `script` against the generator at `url` and return rank 0's measurements."""
    launch = WorkerLaunch(script, model_dir, url, *args, num_ranks=num_ranks,
                          directory=directory, api_key=api_key)
    try:
        return launch.result(timeout_s)
    finally:
        launch.kill()


def still_alive(processes, timeout_s: float = 60.0) -> list:
    """The psutil processes of `processes` not yet gone (exited or zombie) after waiting up to
    `timeout_s` for all of them; [] once every one has ended."""
    import time

    import psutil

    def alive(process) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout_s
    while (left := [p for p in processes if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left
