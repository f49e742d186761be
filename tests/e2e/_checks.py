"""What the e2e runs of `megatron-rl train` read back: TensorBoard scalars and the process table."""
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil


def scalars(event_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar in a TensorBoard directory."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    accumulator = EventAccumulator(str(event_dir), size_guidance={SCALARS: 0})
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)}
            for tag in accumulator.Tags()[SCALARS]}


def processes_left(*, model_dir: Path, driver_pid: int) -> list[str]:
    """This run's SGLang servers (their --model-path is `model_dir`) and Ray cluster processes
    (the session Ray names after the driver's pid) still running. Other runs on the machine,
    such as a concurrent test session, are not counted."""
    session = re.compile(rf"session_[0-9_-]+_{driver_pid}\b")
    left = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(process.info["cmdline"] or [])
        ours = ("sglang" in cmdline and str(model_dir) in cmdline) or (
            ("raylet" in cmdline or "gcs_server" in cmdline) and session.search(cmdline))
        if ours:
            left.append(f"{process.pid}: {cmdline[:120]}")
    return left


ROOT = Path(__file__).resolve().parents[2]

# What a run must not print on a CPU machine: a traceback, a Python warning (warnings.warn's
# "file:line: SomeWarning: ..."), and the GPU / NIC health-check noise nvidia-resiliency-ext's
# rank monitor used to print where there is no GPU (NVML, InfiniBand, its timestamped log lines).
_NOISE = re.compile(r"Traceback \(most recent call last\)|\b[A-Z]\w*Warning: |\bNVML\b|"
                    r"/sys/class/infiniband|^\[\d{4}-\d\d-\d\d [\d:,]+\] \[[A-Z]+\] \[RankMon",
                    re.M)


def console_noise(text: str) -> list[str]:
    """The lines of a run's console output that are tracebacks or third-party noise."""
    return [line for line in text.splitlines() if _NOISE.search(line)]


def tiny_llama_checkpoint(directory: Path) -> Path:
    """tools/make_tiny_checkpoint.py's random tiny Llama (and tokenizer) in `directory`."""
    subprocess.run([sys.executable, "tools/make_tiny_checkpoint.py", str(directory)], cwd=ROOT,
                   check=True, capture_output=True, timeout=300)
    return directory


def run_train(args: list[str], *, timeout: float) -> tuple[int, str, str, int]:
    """`python -m megatron_rl.cli train ARGS` in the repository -> (return code, stdout, stderr,
    driver pid)."""
    proc = subprocess.Popen([sys.executable, "-m", "megatron_rl.cli", "train", *args], cwd=ROOT,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = wait_for_exit(proc, timeout=timeout)
    return proc.returncode, stdout, stderr, proc.pid


def wait_for_exit(proc: subprocess.Popen, *, timeout: float) -> tuple[str, str]:
    """(stdout, stderr) of `proc` once it exits; killed after `timeout` s, which stderr (or
    stdout, when stderr goes to it) then says."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        note = f"\n[test] megatron-rl train timed out after {timeout:.0f} s"
        if stderr is None:
            stdout += note
        else:
            stderr += note
    return stdout, stderr or ""
