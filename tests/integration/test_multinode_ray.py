"""A multi-node launch on one machine: Ray's multi-node simulation (`ray.cluster_utils.Cluster`, one
raylet per simulated node, all on 127.0.0.1) started the way examples/launch/ starts a real
cluster: a head node that runs only the driver, a trainer node declaring the
`megatron_rl_trainer` role resource and a generator node declaring `megatron_rl_generator`. Then
`megatron-rl train` joins it by address, as the launch scripts submit it, and runs the tiny recipe
(examples/configs/tiny_pipeline.yaml: the real SGLang CPU generator, the real Megatron trainer,
reasoning-gym arithmetic scored by its own verifier) for two steps. Before the run,
examples/launch/wait_for_nodes.py (what the launch scripts run before submitting) must see the
three nodes with their roles.

Checked: the trainer rank and the SGLang server run under the raylet of the node their role names
(found from the process tree while the run is going, not from what Ray reports), the run finishes
with both steps trained at float-noise train/generator log-prob mismatch, TensorBoard and its
final checkpoint written (validation is off: the e2e tests cover it); and after the cluster is
shut down no process of it is left. The engine's per-run API key (read from the server's start
environment, where the run hands it over): a request without it is refused while the run goes,
and it is in no command line, nor in any file the run or Ray wrote (config.yaml, processes.json,
the generator log, Ray's logs) nor in the run's output. Also here, cheap: the layout arithmetic of node roles (which
bundles ask for which resource) and the launch scripts' composition (what runs on which node).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # importlib mode: the e2e run helpers

from _checks import SimulatedNodes  # noqa: E402

NUM_STEPS = 2


def test_node_role_bundles(monkeypatch):
    """Role resources go into the bundles only when node_roles is on; colocated refuses them; a
    cluster declaring one role but not the other is refused with the fix."""
    import ray

    from megatron_rl.cluster import ClusterError, ClusterLayout, ClusterSettings, RayCluster
    from megatron_rl.cluster.placement import GENERATOR_NODE_RESOURCE, TRAINER_NODE_RESOURCE

    layout = ClusterLayout(num_trainer_ranks=2, num_generators=1, devices_per_generator=4,
                           device="gpu", node_roles=True)
    assert layout.bundles() == [{"CPU": 1.0, "GPU": 1.0, TRAINER_NODE_RESOURCE: 1.0}] * 2 + [
        {"CPU": 1.0, "GPU": 4.0, GENERATOR_NODE_RESOURCE: 4.0}]
    # Actors ask for CPUs / GPUs only: the role resource is held by the bundle.
    assert layout.trainer_resources() == {"CPU": 1.0, "GPU": 1.0}
    for roles in (None, False):
        plain = ClusterLayout(num_trainer_ranks=1, num_generators=1, node_roles=roles)
        assert plain.bundles() == [{"CPU": 1.0}, {"CPU": 1.0}]
    with pytest.raises(ValueError, match="node_roles: colocated"):
        ClusterLayout(num_trainer_ranks=1, num_generators=1, colocated=True, node_roles=True)

    cluster = RayCluster(ClusterSettings(), "127.0.0.1", "127.0.0.1:1", restore=lambda: None)
    for offered, roles in (({"CPU": 8.0}, False),
                           ({TRAINER_NODE_RESOURCE: 4.0, GENERATOR_NODE_RESOURCE: 8.0}, True)):
        monkeypatch.setattr(ray, "cluster_resources", lambda offered=offered: offered)
        assert cluster.has_node_roles() is roles
    monkeypatch.setattr(ray, "cluster_resources", lambda: {TRAINER_NODE_RESOURCE: 4.0})
    with pytest.raises(ClusterError, match="no node offers megatron_rl_generator"):
        cluster.has_node_roles()


# The launch scripts' steps with the node access and the programs stubbed: what would run where.
_LAUNCH_PLAN = r"""
on_node() { case "$2" in *hostname*) echo 10.0.0.1 ;; *) echo "[$1] $2" ;; esac; }
python() { echo "[head] python $*"; }
megatron-rl() { echo "[head] megatron-rl $*"; }
source examples/launch/common.sh
start_ray; convert_checkpoint; submit_run train.num_steps=3
"""


def test_launch_scripts_compose_the_run(tmp_path):
    """examples/launch/: the scripts parse; common.sh starts the head with the trainer role, the
    other nodes with theirs, waits for all of them, converts into the run directory's
    start_checkpoint and submits `megatron-rl train` joined to the head."""
    for script in ("common.sh", "slurm.sbatch", "ssh.sh"):
        subprocess.run(["bash", "-n", f"examples/launch/{script}"], cwd=ROOT, check=True)
    env = dict(os.environ, RECIPE="r.yaml", HF_CHECKPOINT=str(tmp_path / "hf"),
               OUTPUT_DIR=str(tmp_path / "out"), TRAINER_NODES="n1 n2", GENERATOR_NODES="n3",
               GPUS_PER_NODE="4")
    plan = subprocess.run(["bash", "-c", _LAUNCH_PLAN], cwd=ROOT, env=env, check=True,
                          capture_output=True, text=True).stdout.splitlines()
    commands = [line for line in plan if line.startswith("[")]
    commands[2:4] = sorted(commands[2:4])  # the worker nodes start concurrently
    assert [c.split()[0] for c in commands] == ["[n1]", "[head]", "[n2]", "[n3]", "[head]",
                                                "[head]", "[head]"], plan
    assert "ray start --head --port=6379" in commands[0]
    assert """--resources='{"megatron_rl_trainer": 4}'""" in commands[0]
    assert "wait_for_nodes.py --address 10.0.0.1:6379 --nodes 1 " in commands[1]
    assert "--address=10.0.0.1:6379" in commands[2] and "megatron_rl_trainer" in commands[2]
    assert "--address=10.0.0.1:6379" in commands[3] and "megatron_rl_generator" in commands[3]
    assert "wait_for_nodes.py --address 10.0.0.1:6379 --nodes 3 " in commands[4]
    assert f"convert_hf_to_megatron.py {tmp_path / 'hf'} {tmp_path / 'out'}/start_checkpoint " \
        "--validate" in commands[5]
    assert commands[6].endswith(f"megatron-rl train r.yaml cluster.address=10.0.0.1:6379 "
                                f"model.hf_checkpoint={tmp_path / 'hf'} "
                                f"output_dir={tmp_path / 'out'} train.num_steps=3")
    assert all("--block" not in c for c in commands)  # ssh: ray start returns


class _SimulatedNodes(SimulatedNodes):
    """Head (driver only, no CPUs), one trainer node and one generator node, on loopback."""

    def __init__(self, temp_dir: str):
        super().__init__(temp_dir)
        self.trainer_node = self.add("trainer")
        self.generator_node = self.add("generator")

    def raylet_pids(self) -> dict[int, str]:
        """{raylet pid: node name}."""
        nodes = {"head": self.cluster.head_node, "trainer": self.trainer_node,
                 "generator": self.generator_node}
        return {node.all_processes["raylet"][0].process.pid: name
                for name, node in nodes.items()}


def _node_of(pid: int, raylets: dict[int, str]) -> str | None:
    """The simulated node whose raylet `pid` descends from (None: no raylet above it)."""
    import psutil

    try:
        for parent in psutil.Process(pid).parents():
            if parent.pid in raylets:
                return raylets[parent.pid]
    except psutil.Error:
        return None
    return None


def _wait_for_processes_json(path: Path, proc: subprocess.Popen, timeout_s: float
                             ) -> dict | None:
    """The run's processes.json once written; None if the run ended (or timed out) first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path.is_file():
            return json.loads(path.read_text())
        time.sleep(0.2)
    return None


def _descendants() -> set[tuple[int, float]]:
    import psutil

    found = set()
    for process in psutil.Process().children(recursive=True):
        try:
            found.add((process.pid, process.create_time()))
        except psutil.Error:
            continue
    return found


def _alive(processes: set[tuple[int, float]]) -> list[str]:
    import psutil

    alive = []
    for pid, started in processes:
        try:
            process = psutil.Process(pid)
            if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(process.cmdline())[:120]}")
        except psutil.Error:
            continue
    return alive


def _engine_key(generator: dict) -> str:
    """The run's engine API key, from the SGLang server's start environment (readable by its
    user only); checks meanwhile that the server refuses a request without it and that no
    command line shows it."""
    import psutil
    import requests

    from megatron_rl.rollout.sglang_server import API_KEY_ENV

    environ = Path(f"/proc/{generator['pid']}/environ").read_bytes().split(b"\0")
    (key,) = [e.split(b"=", 1)[1].decode() for e in environ
              if e.startswith(API_KEY_ENV.encode() + b"=")]
    assert len(key) >= 32
    answer = requests.post(f"{generator['url']}/generate", timeout=60,
                           json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}})
    assert answer.status_code == 401, answer.text
    for process in psutil.process_iter(["cmdline"]):
        assert key not in " ".join(process.info["cmdline"] or []), process
    return key


def test_tiny_run_across_simulated_nodes(tmp_path):
    from _checks import scalars as read_scalars
    from _checks import wait_for_exit

    started = time.perf_counter()
    checkpoint = tmp_path / "tiny_llama"
    # tools/make_tiny_checkpoint.py (as the e2e tests' helper runs it) while the nodes start.
    making = subprocess.Popen([sys.executable, "tools/make_tiny_checkpoint.py", str(checkpoint)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    temp_dir = tempfile.mkdtemp(prefix="mrl_mn_", dir="/tmp")  # short: Unix socket paths
    nodes = _SimulatedNodes(temp_dir)
    out = tmp_path / "run"
    try:
        # The launch scripts' wait for the nodes sees all three and their roles.
        waited = subprocess.run([sys.executable, "examples/launch/wait_for_nodes.py",
                                 "--address", nodes.address, "--nodes", "3", "--timeout", "60"],
                                cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert waited.returncode == 0, waited.stdout + waited.stderr[-3000:]
        roles = sorted(line.split()[2] for line in waited.stdout.splitlines()
                       if line.startswith("node "))
        assert roles == ["any", "generator", "trainer"], waited.stdout
        made, _ = wait_for_exit(making, timeout=300)
        assert making.returncode == 0, made[-3000:]
        laps = [("checkpoint + 3 nodes up", time.perf_counter() - started)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_rl.cli", "train",
             "examples/configs/tiny_pipeline.yaml", f"cluster.address={nodes.address}", f"output_dir={out}",
             f"model.hf_checkpoint={checkpoint}", "logging.progress_bar=false",
             f"train.num_steps={NUM_STEPS}", "eval.at_step_zero=false", "eval.interval_steps=0",
             f"checkpoint.interval_steps={NUM_STEPS}",
             # A random policy solves nothing: keep the zero-variance groups so both steps train.
             "algorithm.zero_variance_filter=false"],
            cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True)
        try:
            where = _wait_for_processes_json(out / "processes.json", proc, timeout_s=600)
            raylets = nodes.raylet_pids()
            placed = {} if where is None else {
                f"trainer rank {r['rank']}": _node_of(r["pid"], raylets)
                for r in where["trainer_ranks"]} | {
                f"generator {g['name']}": _node_of(g["pid"], raylets)
                for g in where["generators"]}
            running = _descendants()  # the clusters' processes and the run's, for the end check
            engine_key = None if where is None else _engine_key(where["generators"][0])
            laps.append(("run started", time.perf_counter() - started - sum(s for _, s in laps)))
        finally:
            stdout, _ = wait_for_exit(proc, timeout=600)
        laps.append(("run finished", time.perf_counter() - started - sum(s for _, s in laps)))
    finally:
        nodes.shutdown()
        if making.poll() is None:
            making.kill()
    assert proc.returncode == 0, stdout[-6000:]
    assert placed == {"trainer rank 0": "trainer", "generator generator-0": "generator"}, placed

    scalars = read_scalars(out / "tensorboard")
    assert set(scalars["train/skipped"].values()) == {0.0}  # both steps trained
    # The generator (other node) and the trainer start from the same checkpoint: float noise.
    assert scalars["train/logp_mismatch_mean"][1] < 1e-4, scalars["train/logp_mismatch_mean"]
    assert set(scalars["weight_sync/version"].values()) == set(
        float(v) for v in range(1, NUM_STEPS + 1))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{NUM_STEPS:06d}"]
    assert (out / "config.yaml").is_file() and (out / "generator-0.log").is_file()
    holders = [str(path) for root in (out, Path(temp_dir)) for path in root.rglob("*")
               if path.is_file() and engine_key.encode() in path.read_bytes()]
    assert not holders and engine_key not in stdout, f"the engines' API key is in {holders}"

    deadline = time.monotonic() + 30
    while (left := _alive(running)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, "processes left after the cluster shut down:\n" + "\n".join(left)
    shutil.rmtree(temp_dir, ignore_errors=True)
    print("\nmulti-node run: " + ", ".join(f"{name} {s:.1f} s" for name, s in laps))
