"""The Megatron trainer as Ray actors: `TrainerWorker` is one rank (an `RLTrainer` plus its
`WeightSync` to the generators) and `TrainerGroup` creates the ranks in a placement group's trainer
bundles and calls a method on all of them.

Start-up, torchrun's contract over Ray: every worker reports its node; rank 0 picks the rendezvous
address (its node's Ray address and a free port there); each worker gets RANK, WORLD_SIZE,
LOCAL_RANK (its index among the trainer ranks on its node, in rank order), LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in its environment before torch.distributed starts (inside
`RLTrainer`, megatron_rl.platform.init_distributed), with the NCCL and CUDA settings of a trainer
rank (megatron_rl.platform.environment: the NCCL values the generators' engines use too, resolved
once on the driver; CUDA_DEVICE_MAX_CONNECTIONS=1 for Megatron). On GPU, Ray narrows each actor's
CUDA_VISIBLE_DEVICES to its own GPU; a worker instead sees the GPUs of all trainer ranks on its
node, in local-rank order, so that device LOCAL_RANK is its own (what init_distributed selects)
and NCCL sees its node peers as torchrun would show them.

Every method of a worker is collective (all ranks call it, in the same order); `TrainerGroup`
does that and returns rank 0's result, waiting for each kind of call at most the run config's
timeout for it (`TrainerTimeouts`): no call of the driver on the trainer waits unbounded. Only
typed objects cross the actor boundary: TrainBatch, StepMetrics, SyncReport, CheckpointState,
GeneratorEndpoint, the RunConfig (and the driver-owned checkpoint `extra_state`, which RLTrainer
pickles as it is). Paths must be absolute: the actors' working directory is not the driver's.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.cluster.generators import GeneratorEndpoint
from megatron_rl.cluster.remote import actor_class, gather, kill_actors
from megatron_rl.rollout.sglang_server import listen_port


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WorkerNode:
    """Where a trainer worker runs."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]  # the GPUs Ray assigned to this actor (none on CPU)
    pid: int = 0  # the worker's process


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Rendezvous:
    """torch.distributed's rendezvous: rank 0's TCPStore."""

    master_addr: str
    master_port: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerRankEnv:
    """One rank's torchrun-style environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    visible_devices: tuple[str, ...] | None = None  # GPU: the node's trainer GPUs, in order
    # NCCL / CUDA settings (megatron_rl.platform.environment.trainer_environment), as pairs
    launch: tuple[tuple[str, str], ...] = ()

    def environment(self) -> dict[str, str]:
        env = {**dict(self.launch),
               "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
               "LOCAL_RANK": str(self.local_rank),
               "LOCAL_WORLD_SIZE": str(self.local_world_size),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        if self.visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.visible_devices)
        return env


def rank_environments(nodes: Sequence[WorkerNode], rendezvous: Rendezvous,
                      launch: Mapping[str, str] | None = None) -> list[TrainerRankEnv]:
    """The environment of each rank (`nodes[rank]` is where rank runs); `launch`: the NCCL /
    CUDA variables every rank gets (megatron_rl.platform.environment.trainer_environment)."""
    by_node: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        by_node.setdefault(node.node_id, []).append(rank)
    envs = []
    for rank, node in enumerate(nodes):
        peers = by_node[node.node_id]
        gpus = [gpu for peer in peers for gpu in nodes[peer].gpu_ids]
        if gpus and any(len(nodes[peer].gpu_ids) != 1 for peer in peers):
            raise ValueError(f"trainer rank {rank}: every trainer rank needs exactly one GPU; "
                             f"Ray gave ranks {peers} on node {node.node_ip} "
                             f"{[nodes[p].gpu_ids for p in peers]}")
        envs.append(TrainerRankEnv(
            rank=rank, world_size=len(nodes), local_rank=peers.index(rank),
            local_world_size=len(peers), master_addr=rendezvous.master_addr,
            master_port=rendezvous.master_port,
            visible_devices=tuple(gpus) if gpus else None,
            launch=tuple(sorted((launch or {}).items()))))
    return envs


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerTimeouts:
    """The driver's wait (seconds) for each kind of trainer call; past it the call raises
    TimeoutError, which the driver counts as a hung trainer (resilience/recovery.py)."""

    start: float = 900.0  # train.start_timeout_s: place the ranks, build the trainer
    step: float = 3600.0  # train.step_timeout_s
    sync: float = 1800.0  # weight_sync.sync_timeout_s: connect, sync, sync a restarted engine
    checkpoint: float = 1800.0  # checkpoint.timeout_s: save, finish an async save, load

    @classmethod
    def from_run_config(cls, run) -> "TrainerTimeouts":
        return cls(start=run.train.start_timeout_s, step=run.train.step_timeout_s,
                   sync=run.weight_sync.sync_timeout_s, checkpoint=run.checkpoint.timeout_s)

    def of(self, method: str) -> float:
        """The timeout of TrainerWorker.`method`."""
        kind = _CALL_KINDS.get(method)
        if kind is None:
            raise ValueError(f"TrainerWorker.{method}: no timeout is set for this call; add it "
                             "to megatron_rl/cluster/trainers.py _CALL_KINDS")
        return getattr(self, kind)


_CALL_KINDS = {
    "node": "start", "pick_rendezvous": "start", "setup": "start", "monitor_status": "start",
    "train_step": "step",
    "connect_generators": "sync", "sync_weights": "sync", "sync_new_generators": "sync",
    "save_checkpoint": "checkpoint", "finalize_checkpoints": "checkpoint",
    "load_checkpoint": "checkpoint", "load_model_weights": "checkpoint",
}


class TrainerWorker:
    """One Megatron trainer rank (a Ray actor, created by `TrainerGroup`)."""

    def __init__(self, rank: int):
        from megatron_rl.console import quiet_known_warnings, verbose_requested

        # A Ray worker is a program of its own: the known third-party warnings (and -v /
        # MEGATRON_RL_VERBOSE, inherited through the environment) apply to it as to the driver.
        quiet_known_warnings(verbose=verbose_requested([])[0])
        self.rank = rank
        self.trainer = None
        self.run_config = None
        self.weight_sync = None
        self._generators: list[GeneratorEndpoint] = []  # what weight_sync feeds
        self._monitor = None  # resilience/rank_monitor.RankMonitor, from setup
        self._monitor_status = "not set up"

    def __repr__(self) -> str:  # Ray shows it in errors and in `ray list actors`
        return f"TrainerWorker(rank {self.rank})"

    # ------------------------------------------------------------------ start-up

    def node(self) -> WorkerNode:
        import ray

        context = ray.get_runtime_context()
        return WorkerNode(node_id=context.get_node_id(), node_ip=ray.util.get_node_ip_address(),
                          gpu_ids=tuple(str(g) for g in
                                        context.get_accelerator_ids().get("GPU", [])),
                          pid=os.getpid())

    def pick_rendezvous(self) -> Rendezvous:
        """Rank 0: this node's Ray address and a port free on it, for the TCPStore."""
        import ray

        address = ray.util.get_node_ip_address()
        return Rendezvous(master_addr=address, master_port=listen_port(address))

    def setup(self, env: TrainerRankEnv, run_config, family=None,
              config_overrides: dict[str, Any] | None = None) -> None:
        """Set the rank's environment, then build the RLTrainer (starts torch.distributed;
        collective). `family` overrides the registry family as RLTrainer's `family=` does."""
        if env.rank != self.rank:
            raise ValueError(f"{self!r} was given the environment of rank {env.rank}")
        if self.trainer is not None:
            raise RuntimeError(f"{self!r} is already set up")
        os.environ.update(env.environment())  # before torch.distributed and CUDA start
        from megatron_rl.trainer import RLTrainer, TrainerSettings
        from megatron_rl.trainer.checkpoint import async_save_unavailable

        if run_config.checkpoint.async_save == "always" and (why := async_save_unavailable()):
            raise ValueError(f"checkpoint.async_save=always, but {why}; set it to auto (saves "
                             "asynchronously where it can) or never")
        self.run_config = run_config
        self.trainer = RLTrainer(
            TrainerSettings.from_run_config(run_config, **(config_overrides or {})),
            family=family)
        self._start_rank_monitor()

    # ------------------------------------------------------------------ training

    def _start_rank_monitor(self) -> None:
        """nvidia-resiliency-ext's rank monitor for this rank (resilience/rank_monitor.py), as
        train.rank_monitor says; `monitor_status` tells the driver what runs."""
        from megatron_rl.resilience.rank_monitor import RankMonitor

        train = self.run_config.train
        timeouts = TrainerTimeouts.from_run_config(self.run_config)
        self._monitor, why = RankMonitor.start(
            timeouts_s={"train_step": timeouts.step, "weight_sync": timeouts.sync,
                        "checkpoint": timeouts.checkpoint},
            hang_timeout_factor=train.hang_timeout_factor) \
            if train.rank_monitor else (None, "off (train.rank_monitor=false)")
        self._monitor_status = why or "on"

    def monitor_status(self) -> str:
        """"on", or why the rank monitor does not run."""
        return self._monitor_status

    def _section(self, name: str):
        return self._monitor.section(name) if self._monitor is not None \
            else contextlib.nullcontext()

    def train_step(self, batch):
        """One optimizer step on the global `TrainBatch` -> StepMetrics."""
        with self._section("train_step"):
            return self._trainer().train_step(batch)

    def save_checkpoint(self, directory: str, extra_state: dict[str, Any] | None = None,
                        async_save: str = "never") -> bool:
        """checkpoint.async_save: "auto" (asynchronous where CUDA is, trainer/checkpoint.py
        async_save_unavailable), "always" or "never". Returns whether it is asynchronous."""
        from megatron_rl.trainer.checkpoint import async_save_unavailable

        asynchronous = async_save == "always" or (async_save == "auto"
                                                   and async_save_unavailable() is None)
        with self._section("checkpoint"):
            return self._trainer().save_checkpoint(directory, extra_state,
                                                   async_save=asynchronous)

    def finalize_checkpoints(self, blocking: bool) -> bool:
        return self._trainer().finalize_checkpoints(blocking=blocking)

    def load_checkpoint(self, directory: str, load_optimizer: bool = True):
        """-> CheckpointState (step counters, the saved layout, the driver's extra_state)."""
        return self._trainer().load_checkpoint(directory, load_optimizer=load_optimizer)

    def load_model_weights(self, directory: str) -> None:
        """Start from a converted (HF -> Megatron) or trainer-saved checkpoint's weights,
        without its optimizer state (RLTrainer.load_model_weights)."""
        self._trainer().load_model_weights(directory)

    # ------------------------------------------------------------------ weights

    def connect_generators(self, generators: Sequence[GeneratorEndpoint],
                           hf_config_dir: str) -> None:
        """Build the WeightSync to these generators (collective), keeping the policy version.
        The HF <-> Megatron mapping is that of `hf_config_dir`'s config.json (the checkpoint
        the generators serve; a quantised one is refused, megatron_rl.config.
        check_served_checkpoint); the weight_sync section of the run config gives transport,
        buckets, pause mode and timeouts. Each stage's sender listens on its own node's Ray
        address."""
        if not generators:
            raise ValueError("connect_generators: no generators given")
        version = self.weight_sync.version if self.weight_sync is not None else 0
        if self.weight_sync is not None:
            self.weight_sync.close()
            self.weight_sync = None
        self.weight_sync = self._build_sync(generators, hf_config_dir)
        self.weight_sync.version = version
        self._generators = list(generators)

    def _build_sync(self, generators: Sequence[GeneratorEndpoint], hf_config_dir: str):
        import ray

        from models import model_family_for_hf_config
        from megatron_rl.config import check_served_checkpoint
        from megatron_rl.rollout import SGLangGenerator
        from megatron_rl.weight_sync import WeightSync, WeightSyncSettings

        # The checkpoint may have changed since the config was loaded, or never been in one.
        check_served_checkpoint(hf_config_dir, name="connect_generators(hf_config_dir)")
        trainer = self._trainer()
        hf_family = model_family_for_hf_config(
            json.loads((Path(hf_config_dir) / "config.json").read_text()))
        settings = WeightSyncSettings.from_run_config(
            self.run_config, hf_config_dir=hf_config_dir,
            master_address=ray.util.get_node_ip_address())
        clients = [SGLangGenerator(g.url, num_ranks=g.num_ranks, api_key=g.api_key,
                                   request_timeout_s=settings.timeout_s) for g in generators]
        return WeightSync(trainer.model, hf_family.weight_groups(), clients, settings,
                          hf_vocab_size=hf_family.hf_config.vocab_size)

    def sync_weights(self, version: int | None = None):
        """Push the current weights to the connected generators (collective) -> SyncReport;
        raises WeightSyncError (the generators keep their previous version). `version`: the
        label (default the next one; a restored run re-labels its generators)."""
        if self.weight_sync is None:
            raise RuntimeError(f"{self!r}: sync_weights() before connect_generators()")
        with self._section("weight_sync"):
            return self.weight_sync.sync(version)

    def sync_new_generators(self, generators: Sequence[GeneratorEndpoint], hf_config_dir: str,
                            version: int, connect: Sequence[GeneratorEndpoint] | None = None):
        """Bring restarted generators to the trainer's weights as `version` over a weight-update
        group of their own (collective; the generators already serving are not paused), then
        rebuild the main sync once: over `connect` (the whole new rotation, restarted ones
        included), or by default over every connected generator, the restarted ones in their
        places."""
        if self.weight_sync is None:
            raise RuntimeError(f"{self!r}: sync_new_generators() before connect_generators()")
        temporary = self._build_sync(generators, hf_config_dir)
        try:
            with self._section("weight_sync"):
                report = temporary.sync(version)
        finally:
            temporary.close()
        if connect is None:
            by_name = {g.name: g for g in generators}
            connect = [by_name.get(g.name, g) for g in self._generators]
        self.connect_generators(list(connect), hf_config_dir)
        self.weight_sync.version = version
        return report

    # ------------------------------------------------------------------ stop

    def shutdown(self) -> None:
        """Close the weight-update groups, the rank monitor and torch.distributed
        (collective)."""
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None
        if self.weight_sync is not None:
            self.weight_sync.close()
            self.weight_sync = None
        if self.trainer is not None:
            from megatron_rl.platform import destroy_distributed

            destroy_distributed()
            self.trainer = None

    def _trainer(self):
        if self.trainer is None:
            raise RuntimeError(f"{self!r} is not set up (TrainerGroup.create does it)")
        return self.trainer


class TrainerGroup:
    """The trainer's ranks, one `TrainerWorker` actor each, called together."""

    def __init__(self, placement, workers: list, timeouts: TrainerTimeouts = TrainerTimeouts()):
        self.placement = placement
        self.workers = workers
        self.timeouts = timeouts
        self.nodes: list = []  # WorkerNode per rank (node, GPU ids), once created
        self._stopped = False

    @classmethod
    def create(cls, placement, run_config, *, family=None,
               config_overrides: dict[str, Any] | None = None) -> "TrainerGroup":
        """Start `placement.layout.num_trainer_ranks` workers (= parallelism.world_size) and
        build the trainer on all of them, within train.start_timeout_s; on failure every
        worker is stopped. Later calls wait as `TrainerTimeouts` says."""
        import ray

        from megatron_rl.platform.environment import trainer_environment

        world_size = placement.layout.num_trainer_ranks
        if run_config.parallelism.world_size != world_size:
            raise ValueError(
                f"parallelism.world_size is {run_config.parallelism.world_size} but the "
                f"placement has {world_size} trainer ranks (ClusterLayout.num_trainer_ranks); "
                "they must match")
        actor = actor_class(TrainerWorker)
        workers = [actor.options(**placement.trainer_options(rank), max_restarts=0).remote(rank)
                   for rank in range(world_size)]
        group = cls(placement, workers, TrainerTimeouts.from_run_config(run_config))
        timeout_s = group.timeouts.start
        placement.cluster.on_shutdown("trainer ranks", group.shutdown)
        try:
            nodes = group._call_all("node")
            group.nodes = list(nodes)
            [rendezvous] = gather([workers[0].pick_rendezvous.remote()], group._labels()[:1],
                                  what="picking the rendezvous", timeout_s=timeout_s)
            envs = rank_environments(nodes, rendezvous, launch=trainer_environment(
                cuda_ipc=run_config.weight_sync.transport == "tensor"))
            config_ref = ray.put(run_config)
            gather([w.setup.remote(env, config_ref, family, config_overrides)
                    for w, env in zip(workers, envs)], group._labels(),
                   what="building the trainer", timeout_s=timeout_s)
        except BaseException:
            # Short: a rank that failed leaves the others blocked in a collective with it.
            group.shutdown(timeout_s=10.0)
            raise
        return group

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def call(self, method: str, *args: Any, timeout_s: float | None = None,
             **kwargs: Any) -> Any:
        """Call `method` on every rank (collective) and return rank 0's result; the first rank
        to fail raises (see megatron_rl.cluster.remote.gather). `timeout_s`: the call's own
        timeout (`TrainerTimeouts.of(method)`) unless given."""
        return self._call_all(method, *args, timeout_s=timeout_s, **kwargs)[0]

    def train_step(self, batch, *, timeout_s: float | None = None):
        """-> rank 0's StepMetrics (global means). The batch is serialised once for all."""
        import ray

        return self.call("train_step", ray.put(batch), timeout_s=timeout_s)

    def connect_generators(self, generators: Sequence[GeneratorEndpoint],
                           hf_config_dir: str) -> None:
        self.call("connect_generators", list(generators), hf_config_dir)

    def sync_weights(self, version: int | None = None, *, timeout_s: float | None = None):
        """-> rank 0's SyncReport (the coordinator's: version, time split, control time)."""
        return self.call("sync_weights", version, timeout_s=timeout_s)

    def sync_new_generators(self, generators: Sequence[GeneratorEndpoint], hf_config_dir: str,
                            version: int, connect: Sequence[GeneratorEndpoint] | None = None):
        """-> rank 0's SyncReport of bringing restarted `generators` to `version`; the main
        sync is then rebuilt over `connect` (TrainerWorker.sync_new_generators)."""
        return self.call("sync_new_generators", list(generators), hf_config_dir, version,
                         None if connect is None else list(connect))

    def save_checkpoint(self, directory: str, extra_state: dict[str, Any] | None = None, *,
                        async_save: str = "never") -> bool:
        """Collective over the ranks; checkpoint.async_save's value. -> whether the shards are
        still being written (complete once `finalize_checkpoints` returns True)."""
        return self.call("save_checkpoint", directory, extra_state, async_save)

    def finalize_checkpoints(self, *, blocking: bool) -> bool:
        """-> whether no asynchronous save is left in flight (waits for all with `blocking`)."""
        return self.call("finalize_checkpoints", blocking)

    def load_checkpoint(self, directory: str, *, load_optimizer: bool = True):
        """-> rank 0's CheckpointState."""
        return self.call("load_checkpoint", directory, load_optimizer)

    def load_model_weights(self, directory: str) -> None:
        self.call("load_model_weights", directory)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Close torch.distributed on every rank (waits up to `timeout_s`: a rank stuck in a
        collective is not waited for), then kill the actors. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        import ray

        from megatron_rl.resilience.stop import RUN_STOP

        if RUN_STOP.requested:  # a stopping run: ranks a stop left inside a call never answer
            timeout_s = min(timeout_s, 10.0)
        refs = [w.shutdown.remote() for w in self.workers]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        kill_actors(self.workers)

    def _call_all(self, method: str, *args: Any, timeout_s: float | None = None,
                  **kwargs: Any) -> list[Any]:
        from megatron_rl.resilience.stop import StopRequested

        if self._stopped:
            raise RuntimeError("the trainer group has been shut down")
        timeout_s = self.timeouts.of(method) if timeout_s is None else timeout_s
        refs = [getattr(w, method).remote(*args, **kwargs) for w in self.workers]
        try:
            return gather(refs, self._labels(), what=f"TrainerWorker.{method}",
                          timeout_s=timeout_s)
        except StopRequested as stop:  # the ranks are still inside the call
            stop.no_checkpoint = True
            raise

    def _labels(self) -> list[str]:
        return [f"trainer rank {rank}" for rank in range(len(self.workers))]
