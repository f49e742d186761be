"""A training run's cluster brought up in order: Ray, one placement group, the trainer ranks and
the SGLang engines (the engines load while the ranks build, except colocated on GPU where they
need the ranks' GPU ids), the start checkpoint into the ranks, the engines healthy, the weight
sync connected. `RunCluster.start` registers every teardown on the caller's ExitStack, so no
engine or Ray worker outlives the run, also after an error.

The run needs every node it placed something on until it is up: a start that fails because a
node was lost (an actor call on it fails, its bundle loses its node) stops with NodeLost, one
line naming the node and what it held (exit status 75: requeue), not with the actor error.
After that a lost node of a trainer rank or of the driver stops the run
(`stop_if_trainer_node_lost`); one of generators only shrinks the rotation
(resilience/recovery.py).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path

from megatron_rl.config import ConfigError, RunConfig
from megatron_rl.console import notice


class _Phases:
    """Wall time of named start-up phases, for the operator's line (`with phases("Ray"): ...`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = time.monotonic() - start

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def __str__(self) -> str:
        return ", ".join(f"{name} {s:.1f} s" for name, s in self.seconds.items())



def write_processes(out: Path, driver_node_id: str, endpoints, trainer_nodes,
                    **extra) -> None:
    """output_dir/processes.json, written whole (temp file, then rename): the driver, the
    generators serving now and the trainer ranks, for operators and chaos tests; `extra` adds
    top-level fields (the simulated cluster marks itself)."""
    info = {"driver": {"pid": os.getpid(), "node_id": driver_node_id}, **extra,
            "generators": [{"name": e.name, "url": e.url, "pid": e.pid, "node": e.node_ip,
                            "node_id": e.node_id} for e in endpoints],
            "trainer_ranks": [{"rank": r, "pid": n.pid, "node": n.node_ip, "node_id": n.node_id}
                              for r, n in enumerate(trainer_nodes)]}
    tmp = out / "processes.json.tmp"
    tmp.write_text(json.dumps(info, indent=1))
    tmp.replace(out / "processes.json")


@dataclasses.dataclass(kw_only=True)
class RunCluster:
    """What `start` brought up. `trainers` is replaced when the trainer group recovers."""

    ray: object
    layout: object  # ClusterLayout
    placement: object
    trainers: object  # TrainerGroup
    generators: object  # GeneratorPool
    model_dir: str  # model.hf_checkpoint, absolute
    routing_replay: bool  # MoE routing replay (docs/routing_replay.md) is on
    num_devices: int  # devices the compute axis counts (processes on CPU)
    # The engines' API key, made for this run alone (SGLangServerSettings.api_key): kept out of
    # config.yaml, processes.json, logs and command lines.
    api_key: str | None = dataclasses.field(default=None, repr=False)
    # {bundle index: Ray node id} as reserved at the start: what each node held, once it is gone.
    placed: dict[int, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def start(cls, cfg: RunConfig, out: Path, stack: contextlib.ExitStack, *,
              start_checkpoint: Callable[[str], str]) -> "RunCluster":
        """`start_checkpoint(model_dir)` returns the trainer's start checkpoint (converted from
        model.hf_checkpoint)."""
        from megatron_rl.cluster import ClusterLayout, ClusterSettings, RayCluster

        phases = _Phases()
        with phases("Ray"):
            ray = RayCluster.start(ClusterSettings(
                address=cfg.cluster.address, num_cpus=cfg.cluster.num_cpus,
                placement_timeout_s=cfg.cluster.placement_timeout_s))
        stack.callback(ray.shutdown)
        layout = ClusterLayout.from_run_config(cfg, colocated=cfg.cluster.colocated)
        gpu_colocated = layout.colocated and layout.device == "gpu"
        if gpu_colocated and cfg.weight_sync.transport == "distributed":
            raise ConfigError("weight_sync.transport: colocated generators share the trainer "
                              "ranks' GPUs, and NCCL cannot hold two ranks of one group on one "
                              "GPU; set weight_sync.transport=tensor (in-memory hand-over)")
        placement = ray.reserve(layout, name=cfg.name)
        placed = placement.bundle_nodes()
        try:
            return cls._start_on(cfg, out, ray, layout, placement, placed, phases,
                                 start_checkpoint=start_checkpoint)
        except Exception as failure:
            stop_if_node_lost_at_start(cfg, layout, placed, failure)
            raise

    @classmethod
    def _start_on(cls, cfg: RunConfig, out: Path, ray, layout, placement, placed: dict,
                  phases: _Phases, *, start_checkpoint: Callable[[str], str]) -> "RunCluster":
        """The trainer ranks, the engines and the weight sync in the reserved placement."""
        from megatron_rl.cluster import GeneratorPool, TrainerGroup
        from megatron_rl.cluster.served_checkpoint import served_model_dir
        from megatron_rl.rollout.sglang_server import is_moe_model

        gpu_colocated = layout.colocated and layout.device == "gpu"
        model_dir = str(Path(cfg.model.hf_checkpoint).resolve())
        # What the engines load: model_dir, or its FP8 copy in the run directory
        # (rollout.precision fp8); the trainer starts from model_dir either way.
        served_dir = served_model_dir(cfg.rollout, model_dir, out)
        waits = dict(start_timeout_s=cfg.rollout.engine_start_timeout_s,
                     call_timeout_s=cfg.rollout.health_check_timeout_s)
        api_key = secrets.token_urlsafe(32)
        with phases("trainer ranks"):
            if gpu_colocated:  # the servers need the ranks' GPU ids
                trainers = TrainerGroup.create(placement, cfg)
                generators = GeneratorPool.start(
                    placement, server_settings(cfg, layout, out, served_dir, trainers, api_key),
                    **waits)
            else:  # the servers load while the trainer ranks build
                generators = GeneratorPool.start(
                    placement, server_settings(cfg, layout, out, served_dir, None, api_key),
                    **waits)
                trainers = TrainerGroup.create(placement, cfg)
        with phases("start checkpoint"):
            trainers.call("load_model_weights", start_checkpoint(model_dir))
        monitor = trainers.call("monitor_status")
        notice("trainer hang detection: " + (
            "nvidia-resiliency-ext rank monitor on every rank, and train.step_timeout_s"
            if monitor == "on" else f"train.step_timeout_s only (no rank monitor: {monitor})"))
        with phases("generators ready"):
            # An engine that does not start is started again (not the whole launch ended).
            generators.wait_until_healthy(attempts=cfg.rollout.max_generator_restarts + 1)
        with phases("weight-sync connection"):
            trainers.connect_generators(generators.endpoints, hf_config_dir=model_dir)
            generators.connected = {e.name for e in generators.endpoints}
        num_devices = layout.num_trainer_ranks if layout.colocated else \
            layout.num_trainer_ranks + layout.num_generators * layout.devices_per_generator
        cluster = cls(ray=ray, layout=layout, placement=placement, trainers=trainers,
                      generators=generators, model_dir=model_dir, num_devices=num_devices,
                      routing_replay=cfg.rollout.routing_replay and is_moe_model(model_dir),
                      api_key=api_key, placed=placed)
        cluster.write_processes(out)
        notice(f"cluster up in {phases.total:.1f} s ({phases}; the generators start while the "
               "trainer ranks build)")
        return cluster

    def lost_nodes(self, node_ids, *, within_s: float = 0.0) -> dict[str, str]:
        """{node id: address} of the nodes in `node_ids` Ray declares dead (resilience/ asks
        the cluster it holds, not Ray: cluster/backend.py)."""
        from megatron_rl.cluster import runtime

        return runtime.lost_nodes(node_ids, within_s=within_s)

    def write_processes(self, out: Path) -> None:
        """output_dir/processes.json: which process is which (for operators and chaos tests);
        the generators serving now (not those waiting to be placed again)."""
        import ray

        write_processes(out, ray.get_runtime_context().get_node_id(), self.generators.endpoints,
                        self.trainers.nodes)

    def restart_trainers(self, cfg: RunConfig) -> None:
        """A new trainer group in the same placement, connected to the serving engines (the old
        one is shut down first; its ranks died or hung). NodeLost, without waiting for a new
        group, when a rank's node is gone (docs/fault_tolerance.md: the run stops)."""
        from megatron_rl.cluster import TrainerGroup

        self.trainers.shutdown(timeout_s=10.0)
        self.stop_if_trainer_node_lost(cfg)
        try:
            self.trainers = TrainerGroup.create(self.placement, cfg)
        except Exception:
            # A rank's connection broke before Ray declared its node dead (ActorUnavailable):
            # the new group's actor in that bundle fails once it does. Say so, if so.
            self.stop_if_trainer_node_lost(cfg)
            raise
        self.trainers.connect_generators(self.generators.endpoints, hf_config_dir=self.model_dir)
        self.generators.connected = {e.name for e in self.generators.endpoints}

    def stop_if_trainer_node_lost(self, cfg: RunConfig) -> None:
        """Raise NodeLost when a node of the trainer ranks or of the driver is gone: Ray
        declared it dead, or a trainer rank's placement-group bundle lost its node. The
        message also names the engines that served there. A node whose raylet no longer
        accepts connections is on its way out: Ray's verdict is awaited (a rank's death
        reaches the driver first, and must not be taken for a trainer failure)."""
        import ray

        from megatron_rl.cluster.runtime import lost_nodes, node_verdict_s, unreachable_nodes
        from megatron_rl.resilience.recovery import NodeLost, node_lost_message

        ranks = {r: n.node_id for r, n in enumerate(self.trainers.nodes)}
        driver = ray.get_runtime_context().get_node_id()
        nodes = [*ranks.values(), driver]
        lost = lost_nodes(nodes, within_s=node_verdict_s() if unreachable_nodes(nodes) else 0.0)
        bundles = self.placement.bundle_nodes()
        for rank, node in ranks.items():
            if not bundles.get(self.layout.trainer_bundle_index(rank), node):
                lost.setdefault(node, next((n.node_ip for n in self.trainers.nodes
                                            if n.node_id == node), "(unknown)"))
        held = {node: [f"trainer rank {r}" for r, n in ranks.items() if n == node]
                + (["the driver"] if node == driver else []) for node in lost}
        if any(held.values()):
            for endpoint in self.generators.endpoints:
                if endpoint.node_id in held:
                    held[endpoint.node_id].append(endpoint.name)
            raise NodeLost(node_lost_message(cfg, lost, held))

    def stop_if_node_lost(self, cfg: RunConfig, failure: BaseException) -> None:
        """While the run starts (after the cluster is up: the restore of a resume, the
        rollout manager's start), every node it placed something on is needed: NodeLost
        (from `failure`) when one is gone."""
        stop_if_node_lost_at_start(cfg, self.layout, self.placed, failure)


def stop_if_node_lost_at_start(cfg: RunConfig, layout, placed: dict[int, str],
                               failure: BaseException) -> None:
    """Raise NodeLost from `failure`, a start-up step that failed, when a node of the run is
    gone: the driver's, or one that a placement-group bundle was reserved on (`placed`,
    {bundle index: node id}). The message names what each lost node held. A call to a lost
    node's actor can fail before Ray declares the node dead, so a node whose raylet no longer
    accepts connections gets Ray's verdict awaited (runtime.node_verdict_s). When the GCS
    cannot answer either, `failure` stands."""
    import ray

    from megatron_rl.cluster.runtime import lost_nodes, node_verdict_s, unreachable_nodes
    from megatron_rl.resilience.recovery import NodeLost, node_lost_message

    held: dict[str, list[str]] = {}
    for rank in range(layout.num_trainer_ranks):
        node = placed.get(layout.trainer_bundle_index(rank))
        if node:
            held.setdefault(node, []).append(f"trainer rank {rank}")
    for index in range(layout.num_generators):
        node = placed.get(layout.generator_bundle_index(index))
        if node:
            held.setdefault(node, []).append(f"generator-{index}")
    try:
        held.setdefault(ray.get_runtime_context().get_node_id(), []).append("the driver")
        lost = lost_nodes(held, within_s=node_verdict_s() if unreachable_nodes(held) else 0.0)
    except Exception:  # noqa: BLE001 (the GCS is gone too: the failure says what happened)
        return
    if lost:
        raise NodeLost(node_lost_message(cfg, lost, held)) from failure


def server_settings(cfg: RunConfig, layout, out: Path, model_dir: str, trainers,
                    api_key: str | None = None) -> list:
    """One SGLang server's settings per generator, all with the run's `api_key`; colocated ones
    (GPU) get their trainer ranks' GPUs and SGLang's memory saver."""
    from megatron_rl.rollout import SGLangServerSettings

    settings = []
    for i in range(layout.num_generators):
        fields = {}
        if layout.colocated and layout.device == "gpu":
            nodes = [trainers.nodes[r] for r in layout.generator_trainer_ranks(i)]
            if len({n.node_id for n in nodes}) != 1:
                raise ConfigError(
                    f"cluster.colocated: generator {i} would share the GPUs of trainer "
                    f"ranks on {len({n.node_id for n in nodes})} nodes; an SGLang engine "
                    "runs on one node: lower rollout.tp_size to the GPUs per node")
            fields = dict(enable_memory_saver=True,
                          visible_devices=tuple(g for n in nodes for g in n.gpu_ids))
        settings.append(SGLangServerSettings.from_rollout_config(
            cfg.rollout, model_dir, random_seed=cfg.seed + i, api_key=api_key,
            startup_timeout_s=cfg.rollout.engine_start_timeout_s,
            log_path=str((out / f"generator-{i}.log").resolve()), **fields))
    return settings
