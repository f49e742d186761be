"""The one place a run chooses what it runs on: the real cluster (Ray, SGLang servers, Megatron
ranks: `RayBackend`, what `megatron-rl train` and the demo always use) or a simulated one
(megatron_rl.simulation.cluster.SimulatedBackend: engines that speak SGLang's HTTP API with
modelled timing and a trainer group with modelled durations, chosen only by `megatron-rl
simulate` and the scale tests). The driver (train.py, run_setup.py), the rollout manager,
resilience/ and validation receive the started cluster and never ask which it is.

A backend's `start` returns an object with the `RunClusterInterface` below; RunCluster
(launch.py) is the real one. Every query the layers above make of the cluster goes through it,
Ray's node table included (`lost_nodes`), so that every import points down: resilience/ calls
the cluster object it is handed, it does not import cluster/.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

from megatron_rl.config import RunConfig


class RunClusterInterface(Protocol):
    """What the driver and resilience/ use of a started cluster."""

    layout: object  # ClusterLayout (colocated, sizes)
    trainers: object  # the trainer group (cluster/trainers.py TrainerGroup's methods)
    generators: object  # the generator pool (cluster/generators.py GeneratorPool's methods)
    model_dir: str
    routing_replay: bool
    num_devices: int
    api_key: str | None

    def lost_nodes(self, node_ids: Iterable[str], *, within_s: float = 0.0) -> dict[str, str]:
        """{node id: address} of the nodes in `node_ids` that are gone."""

    def write_processes(self, out: Path) -> None: ...

    def restart_trainers(self, cfg: RunConfig) -> None: ...

    def stop_if_trainer_node_lost(self, cfg: RunConfig) -> None: ...

    def stop_if_node_lost(self, cfg: RunConfig, failure: BaseException) -> None: ...


class ClusterBackend(Protocol):
    def start(self, cfg: RunConfig, out: Path, stack: contextlib.ExitStack, *,
              start_checkpoint: Callable[[str], str]) -> RunClusterInterface:
        """Bring the run's cluster up, registering every teardown on `stack`."""


class RayBackend:
    """The real cluster: Ray, one placement group, SGLang engines and Megatron trainer ranks
    (cluster/launch.py)."""

    def start(self, cfg: RunConfig, out: Path, stack: contextlib.ExitStack, *,
              start_checkpoint: Callable[[str], str]) -> RunClusterInterface:
        from megatron_rl.cluster.launch import RunCluster

        return RunCluster.start(cfg, out, stack, start_checkpoint=start_checkpoint)
