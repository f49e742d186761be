"""Trainer ranks and SGLang engines start with the same NCCL settings (issue 30.6,
megatron_rl.platform.environment). Both launch environments are built as a run builds them,
without starting Ray, a trainer or an engine: the Ray job's runtime_env (what RayCluster.start
passes to ray.init), a trainer rank's torchrun-style environment (rank_environments, applied by
TrainerWorker.setup), and an SGLang server process's environment after the module body of
megatron_rl.rollout.sglang_launch ran (a real interpreter, stopped before SGLang starts)."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.platform.environment import (SHARED_DEFAULTS, generator_environment,
                                              shared_environment, trainer_environment)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
NAMES = sorted(SHARED_DEFAULTS)


class _Stop(Exception):
    pass


def _ray_job_env_vars(monkeypatch) -> dict[str, str]:
    """The env_vars RayCluster.start gives every worker of the job (ray.init is intercepted)."""
    import ray

    from megatron_rl.cluster import ClusterSettings, RayCluster

    seen = {}

    def init(**kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(ray, "init", init)
    with pytest.raises(_Stop):
        RayCluster.start(ClusterSettings(num_cpus=1))
    return seen["runtime_env"]["env_vars"]


def _trainer_env(job: dict[str, str], node: dict[str, str]) -> dict[str, str]:
    """A trainer rank's environment once TrainerWorker.setup applied its TrainerRankEnv."""
    from megatron_rl.cluster import Rendezvous, WorkerNode, rank_environments

    ranks = rank_environments([WorkerNode(node_id="a", node_ip="10.0.0.1", gpu_ids=("0",))],
                              Rendezvous(master_addr="10.0.0.1", master_port=29500),
                              launch=trainer_environment(cuda_ipc=False))
    return {**node, **job, **ranks[0].environment()}


def _engine_envs(start_envs: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The environment of an SGLang server process started with each of `start_envs` (only the
    shared variables matter), after the entry module's body ran (what SGLang then reads). One
    interpreter runs the module body once per case (runpy, not as __main__: no server)."""
    script = (
        "import json, os, runpy, sys\n"
        "cases, names, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), {}\n"
        "for case, start in cases.items():\n"
        "    for name in names:\n"
        "        os.environ.pop(name, None)\n"
        "    os.environ.update({n: v for n, v in start.items() if n in names})\n"
        "    runpy.run_module('megatron_rl.rollout.sglang_launch', run_name='sglang_launch')\n"
        "    out[case] = {name: os.environ.get(name) for name in names}\n"
        "print(json.dumps(out))\n")
    result = subprocess.run([sys.executable, "-c", script, json.dumps(start_envs),
                             json.dumps(NAMES)], cwd=ROOT, check=True, capture_output=True,
                            text=True, timeout=300)
    return json.loads(result.stdout.strip().splitlines()[-1])


DRIVERS = {"defaults": {}, "driver-sets-cumem": {"NCCL_CUMEM_ENABLE": "1"}}


def _expected(driver: dict[str, str]) -> dict[str, str]:
    return {name: driver.get(name, SHARED_DEFAULTS[name]) for name in NAMES}


def _node(expected: dict[str, str]) -> dict[str, str]:
    """A node whose own environment says the opposite of the driver."""
    return {name: "0" if value == "1" else "1" for name, value in expected.items()}


@pytest.fixture(scope="module")
def engines() -> dict[str, dict[str, str]]:
    # Under Ray a generator actor (and the server it starts) inherits its node's environment
    # with the job's env_vars over it; outside Ray, whatever the server is started with.
    cases = {case: {**_node(_expected(driver)), **_expected(driver)}
             for case, driver in DRIVERS.items()}
    return _engine_envs({**cases, "outside-ray": {}, "own-value": {"NCCL_NVLS_ENABLE": "1"}})


@pytest.mark.parametrize("case", DRIVERS)
def test_trainer_ranks_and_engines_agree(monkeypatch, engines, case):
    """Under Ray: the driver's values (or SGLang's defaults) reach both sides, whatever the
    nodes' own environment says."""
    driver = DRIVERS[case]
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    for name, value in driver.items():
        monkeypatch.setenv(name, value)
    expected = _expected(driver)
    job = _ray_job_env_vars(monkeypatch)
    assert job == expected  # the engines' case was started with exactly these over its node's
    trainer = _trainer_env(job, _node(expected))
    assert {name: trainer[name] for name in NAMES} == engines[case] == expected


def test_an_engine_started_outside_ray_gets_the_trainers_defaults(engines):
    trainer = trainer_environment({}, cuda_ipc=False)
    assert engines["outside-ray"] == {name: trainer[name] for name in NAMES} == SHARED_DEFAULTS
    # A value of the engine's own environment stands (SGLang keeps it, as below).
    assert engines["own-value"]["NCCL_NVLS_ENABLE"] == "1"


def test_sglang_keeps_values_that_are_set_and_defaults_to_ours():
    """SGLang 0.5.23's _set_envs_and_config sets each shared variable only where it is unset
    (or where a feature this project does not turn on needs it), to 0: the values above."""
    import importlib.util

    engine = Path(importlib.util.find_spec("sglang").submodule_search_locations[0],
                  "srt", "entrypoints", "engine.py").read_text()
    body = engine.split("def _set_envs_and_config(")[1].split("\ndef ")[0]
    for name in NAMES:
        assert re.search(rf'"{name}" not in os\.environ', body), name
        # The value written is int(<feature flags>): "0" with the features off.
        assert re.search(rf'os\.environ\["{name}"\] = str\(\s*int\(', body), name
    assert set(SHARED_DEFAULTS.values()) == {"0"}


def test_trainer_only_settings():
    trainer = trainer_environment({}, cuda_ipc=False)
    assert trainer["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # Megatron's TP / SP overlap
    assert trainer["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    # CUDA IPC of expandable-segment memory needs pidfd_getfd: not with the tensor transport.
    assert "PYTORCH_CUDA_ALLOC_CONF" not in trainer_environment({}, cuda_ipc=True)
    # An allocator setting of the user's stays as it is (torch reads either name).
    assert "PYTORCH_CUDA_ALLOC_CONF" not in trainer_environment(
        {"PYTORCH_ALLOC_CONF": "garbage_collection_threshold:0.8"}, cuda_ipc=False)
    assert trainer_environment({"CUDA_DEVICE_MAX_CONNECTIONS": "8"},
                               cuda_ipc=False)["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    # Engines get the shared variables only: SGLang sets its own CUDA_DEVICE_MAX_CONNECTIONS.
    assert generator_environment({}) == shared_environment({}) == SHARED_DEFAULTS


# A stand-in for NVML (the nvidia-ml-py module SGLang's image carries) reporting one GPU of the
# name and fabric state in its environment: what host_fabric reads on a GB200 tray or an H100 host.
_FAKE_NVML = '''
import os
NVML_GPU_FABRIC_STATE_COMPLETED = 3
class _Info:
    @property
    def state(self):
        return int(os.environ["FAKE_NVML_FABRIC_STATE"])
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(index): return index
def nvmlDeviceGetName(handle): return os.environ["FAKE_NVML_GPU"]
def nvmlDeviceGetGpuFabricInfo(handle): return _Info()
'''

FABRICS = {  # (GPU name, NVML fabric state, NCCL_CUMEM_ENABLE everywhere)
    "gb200-tray": ("NVIDIA GB200", "0", "1"),
    "fabric-registered": ("NVIDIA Graphics Device", "3", "1"),
    "h100-host": ("NVIDIA H100 80GB HBM3", "0", "0"),
}


@pytest.fixture(scope="module")
def fake_nvml(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("fake_nvml")
    (folder / "pynvml.py").write_text(_FAKE_NVML)
    return folder


@pytest.fixture(scope="module")
def fabric_engines(fake_nvml) -> dict[str, dict[str, str]]:
    """Each host's SGLang server environment, one interpreter for all (as _engine_envs)."""
    script = (
        "import json, os, runpy, sys\n"
        "cases, names, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), {}\n"
        "for case, (gpu, state, _) in cases.items():\n"
        "    for name in names:\n"
        "        os.environ.pop(name, None)\n"
        "    os.environ.update(FAKE_NVML_GPU=gpu, FAKE_NVML_FABRIC_STATE=state)\n"
        "    runpy.run_module('megatron_rl.rollout.sglang_launch', run_name='sglang_launch')\n"
        "    out[case] = {name: os.environ.get(name) for name in names}\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    env["PYTHONPATH"] = os.pathsep.join([str(fake_nvml), *filter(None, [env.get("PYTHONPATH")])])
    result = subprocess.run([sys.executable, "-c", script, json.dumps(FABRICS),
                             json.dumps(NAMES)], cwd=ROOT, check=True, capture_output=True,
                            text=True, timeout=300, env=env)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("host", FABRICS)
def test_nccl_cumem_follows_the_fabric_on_every_side(monkeypatch, fake_nvml, fabric_engines,
                                                     host):
    """Issue 39.4: on an NVL72 host cuMem is on (multi-node NVLink needs it) for the Ray job's
    workers, a trainer rank and an SGLang server started on the host alike; NVLS stays off."""
    gpu, state, cumem = FABRICS[host]
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FAKE_NVML_GPU", gpu)
    monkeypatch.setenv("FAKE_NVML_FABRIC_STATE", state)
    monkeypatch.syspath_prepend(str(fake_nvml))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    expected = {"NCCL_CUMEM_ENABLE": cumem, "NCCL_NVLS_ENABLE": "0"}
    job = _ray_job_env_vars(monkeypatch)
    assert job == expected
    trainer = _trainer_env(job, {})
    assert {name: trainer[name] for name in NAMES} == expected
    assert {name: trainer_environment(cuda_ipc=False)[name] for name in NAMES} == expected
    # A server started outside Ray resolves its own host's fabric.
    assert fabric_engines[host] == expected
    # A value the environment sets still wins.
    assert shared_environment({"NCCL_CUMEM_ENABLE": "0"})["NCCL_CUMEM_ENABLE"] == "0"
