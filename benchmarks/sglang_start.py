"""Cost of starting an SGLang CPU server: SGLang's own spawned children against children started
from a preloaded forkserver and children forked from the server process (the default;
megatron_rl/platform/sglang_cpu.py, fix 12), measured in the same run.

Each round launches the tiny Llama-3-style test model's server (fp32, the integration tests'
settings, OMP_NUM_THREADS=1) once per variant, alternating, and waits until it scores one sequence. Measured per
launch: the wall time until it answers, and the CPU time of every process of the server (user +
system, read from /proc just before shutdown: the server process, SGLang's scheduler and
detokenizer, the forkserver and multiprocessing's resource tracker). On a loaded machine (the test
suite runs three streams on 2 cores) the CPU time is what a start costs the others; the wall time
means little there. Prints the median and spread (min-max) over rounds and the ratio of medians.

    .venv/bin/python benchmarks/sglang_start.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # _hf_families: the tiny test model

VARIANTS = (("spawn", "SGLang's spawn"),
            ("forkserver", "from a preloaded forkserver"),
            ("fork", "forked from the server process (default on CPU)"))


def _tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its descendants (the live ones, and the children
    they have already reaped)."""
    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


def _launch_once(model_dir: Path, variant: str, log_path: str) -> tuple[float, float]:
    from megatron_rl.platform.sglang_cpu import CHILD_START_ENV
    from megatron_rl.rollout import SGLangGenerator, SGLangServer, SGLangServerSettings

    previous = os.environ.get(CHILD_START_ENV)
    os.environ[CHILD_START_ENV] = variant
    try:
        start = time.monotonic()
        server = SGLangServer.launch(SGLangServerSettings(
            model_path=str(model_dir), dtype="float32", mem_fraction_static=0.001,
            max_total_tokens=8192, startup_timeout_s=600, log_path=log_path))
    finally:
        os.environ.pop(CHILD_START_ENV, None)
        if previous is not None:
            os.environ[CHILD_START_ENV] = previous
    try:
        SGLangGenerator(server.url, server=server).score([[5, 17, 42, 99, 7, 250, 3]])
        wall = time.monotonic() - start
        cpu = _tree_cpu_seconds(server.process.pid)
        children = psutil.Process(server.process.pid).children(recursive=True)
        forkserver = any("multiprocessing.forkserver" in " ".join(p.cmdline()) for p in children)
        if forkserver != (variant == "forkserver"):  # fork fell back: the figures would lie
            raise RuntimeError(f"variant {variant}: forkserver running is {forkserver}; see "
                               f"{log_path}")
    finally:
        server.shutdown()
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # One thread per server process, as the tests and the CPU runs (Ray actors) have: with more,
    # numpy's OpenBLAS pool runs in the server process and fix 12 takes the forkserver instead.
    os.environ["OMP_NUM_THREADS"] = "1"
    from _hf_families import save_tiny_llama

    with tempfile.TemporaryDirectory(prefix="sglang_start_") as directory:
        model_dir = Path(directory) / "model"
        save_tiny_llama(model_dir)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in VARIANTS}
        for round_index in range(args.rounds):
            for name, _ in VARIANTS:
                wall, cpu = _launch_once(model_dir, name, str(Path(directory) / f"{name}.log"))
                results[name].append((wall, cpu))
                print(f"round {round_index + 1}/{args.rounds} {name}: wall {wall:.1f} s, "
                      f"cpu {cpu:.1f} s", flush=True)
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (2-core machine: above ~2 the "
          "wall times are disturbed)")
    print(f"\n| variant | wall s, median (min-max) | CPU s, median (min-max) |\n|---|---|---|")
    medians = {}
    for name, label in VARIANTS:
        walls, cpus = zip(*results[name])
        medians[name] = (statistics.median(walls), statistics.median(cpus))
        print(f"| {label} | {medians[name][0]:.1f} ({min(walls):.1f}-{max(walls):.1f}) | "
              f"{medians[name][1]:.1f} ({min(cpus):.1f}-{max(cpus):.1f}) |")
    for name in ("forkserver", "fork"):
        print(f"{name} / spawn: wall {medians[name][0] / medians['spawn'][0]:.2f}x, "
              f"CPU {medians[name][1] / medians['spawn'][1]:.2f}x")


if __name__ == "__main__":
    main()
