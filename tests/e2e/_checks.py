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


def tiny_llama4_checkpoint(directory: Path) -> Path:
    """The tiny Llama-4 MoE (models/llama4 size "tiny") of tools/make_tiny_checkpoint.py, random,
    with its tokenizer, re-saved in bf16 in the layout SGLang serves Llama-4 from
    (models/llama4/convert.py write_sglang_layout: its Llama4ForConditionalGeneration loader
    un-fuses the experts and permutes q/k) in `directory`."""
    subprocess.run([sys.executable, "tools/make_tiny_checkpoint.py", str(directory / "init"),
                    "--family", "llama4"], cwd=ROOT, check=True, capture_output=True, timeout=300)
    # megatron_rl first: it patches what megatron-core's import needs here (platform/).
    subprocess.run([sys.executable, "-c", "import sys, torch, megatron_rl.platform; from "
                    "models.llama4.convert import write_sglang_layout; write_sglang_layout("
                    "sys.argv[1], sys.argv[2], dtype=torch.bfloat16)", str(directory / "init"),
                    str(directory / "model")], cwd=ROOT, check=True, capture_output=True,
                   timeout=300)
    return directory / "model"


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


class SimulatedNodes:
    """Ray's multi-node simulation on this machine (`ray.cluster_utils.Cluster`: one raylet per
    node, all on 127.0.0.1), for node-level faults: a head node for the driver only (no CPUs),
    and nodes added and removed with a role (the custom resources of
    megatron_rl.cluster.placement). `remove` SIGKILLs every process of the node (raylet, its
    agents, its workers): a node lost, as when a machine goes away. `lose` also kills one of
    Ray's per-node agents instead (`AGENTS`): the raylet fate-shares with them and ends, and
    the node's workers with it (an operator's random fault, or an agent that crashed)."""

    # How a node can be lost: every process SIGKILLed, or one Ray agent (process title).
    AGENTS = {"dashboard agent": "ray::DashboardAgent",
              "runtime-env agent": "ray::RuntimeEnvAgent"}
    WAYS = ("all its processes", *AGENTS)

    def __init__(self, temp_dir: str):
        self._previous_env = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # every component on 127.0.0.1
        from ray._common.utils import get_default_ray_temp_dir
        from ray._private import ray_constants
        from ray.cluster_utils import Cluster

        # Cluster writes the head's address under Ray's default temp dir, whatever temp_dir is.
        os.makedirs(get_default_ray_temp_dir(), exist_ok=True)

        self._previous_flag = ray_constants.ENABLE_RAY_CLUSTER
        ray_constants.ENABLE_RAY_CLUSTER = False  # in case ray was imported before
        self._loopback = dict(node_ip_address="127.0.0.1", object_store_memory=80 * 2**20)
        self.cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=dict(
            num_cpus=0, include_dashboard=False, temp_dir=temp_dir, **self._loopback))

    @property
    def address(self) -> str:
        return self.cluster.address

    def add(self, role: str):
        """A node of 1 CPU for one trainer rank ("trainer") or one engine ("generator"), or of
        2 CPUs for one of each ("mixed")."""
        from megatron_rl.cluster.placement import GENERATOR_NODE_RESOURCE, TRAINER_NODE_RESOURCE

        resources = {"trainer": {TRAINER_NODE_RESOURCE: 1}, "generator": {
            GENERATOR_NODE_RESOURCE: 1}, "mixed": {TRAINER_NODE_RESOURCE: 1,
                                                  GENERATOR_NODE_RESOURCE: 1}}[role]
        return self.cluster.add_node(num_cpus=len(resources), resources=resources,
                                     **self._loopback)

    def node(self, node_id: str):
        return next(n for n in self.cluster.worker_nodes if n.node_id == node_id)

    def remove(self, node) -> float:
        """SIGKILL the node's processes; returns when (time.time())."""
        import time

        at = time.time()
        self.cluster.remove_node(node, allow_graceful=False)
        return at

    def lose(self, node, how: str) -> float:
        """Lose `node` one of the `WAYS`: "all its processes" SIGKILLed (`remove`), or one of
        its Ray agents SIGKILLed. Returns when (time.time())."""
        import time

        from ray._private import ray_constants

        if how not in self.AGENTS:
            return self.remove(node)
        raylet = psutil.Process(node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0]
                                .process.pid)
        agent = next(p for p in raylet.children()
                     if " ".join(p.cmdline()).startswith(self.AGENTS[how]))
        at = time.time()
        agent.kill()
        return at

    def shutdown(self) -> None:
        from ray._private import ray_constants

        try:
            self.cluster.shutdown()
        finally:
            ray_constants.ENABLE_RAY_CLUSTER = self._previous_flag
            if self._previous_env is None:
                os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
            else:
                os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = self._previous_env
