"""The simulated cluster behind the seam of cluster/backend.py: `SimulatedBackend.start` returns
a `SimulatedCluster` with the interface of cluster/launch.py's RunCluster, whose generator pool
serves simulated SGLang engines (engine.py, on their own event-loop thread) and whose trainer
group sleeps the durations of trainer.py's TrainerTiming on the run's SimClock. The driver, the
rollout manager, the async client, GeneratorHealth and validation run unchanged against it;
only `megatron-rl simulate` and the scale tests choose it.

- `SimulatedGeneratorPool`: GeneratorPool's methods (serving, endpoints, restart, replace,
  poll_replacements, unhealthy, check_health, shutdown; `connected`). A restart starts a fresh
  engine (version 0, a new port) without waiting; it serves after EngineTiming.start_seconds
  (launch and the weights from disk) of model time, and `poll_replacements` then reports it;
  `restarts` records each (asked, up, in model seconds). A lost node's engines are re-created
  on spare nodes, engines_per_node to a node (Ray would place them on another node with room;
  waiting for the lost node to come back is not modelled).
- `SimulatedTrainerGroup`: TrainerGroup's methods. `train_step` sleeps TrainerTiming's step time
  for the batch's tokens (x token_granularity) and returns StepMetrics' fields with plausible
  values (no model: loss 0, ratio 1, mismatch 0, entropy the engines' mean -log-prob);
  `sync_weights` pauses the connected engines (weight_sync.pause_mode), loads one bucket of the
  generator weights' bytes into each over the timed `/update_weights_from_distributed` call,
  labels the version and continues them, all over HTTP as the real WeightSync does;
  `save_checkpoint` writes a small JSON state (the run checkpoint's own files are written by the
  real code path, resilience/run_checkpoints.py) and takes TrainerTiming's checkpoint time.
  A call under way when a trainer node is lost fails with TrainerFailure (as a dead Ray actor
  does); a sync that an engine fails (refused, or no answer within weight_sync.timeout_s)
  raises WeightSyncError, as the real WeightSync does, after ending the session on the others.
- Rewards are the recipe's real verifiers on the decoded simulated token ids, which never pass:
  every reward is 0 and every group has zero variance (the zero-variance filter drops them and
  the trainer step is skipped unless `algorithm.zero_variance_filter=false`).
- `cluster.colocated`: the engines and the trainer share all devices (`colocated_timing`). The
  real driver alternates them (RunSetup.train_step: wait until no group generates, release the
  engines' memory; WeightPusher.push: resume, sync, resume the KV cache); the simulated trainer
  group checks that no engine holds a request while it trains (`ColocatedOverlap` otherwise),
  trains over all the devices, and adds the phase switches the real ranks make
  (trainer/trainer.py offload_between_steps: the optimizer state to the host and back).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.scaling.cost import CostConfig
from megatron_rl.simulation.clock import SimClock
from megatron_rl.simulation.profiles import get_profile
from megatron_rl.simulation.timing import EngineTiming
from megatron_rl.simulation.trainer import TrainerTiming


@dataclasses.dataclass(kw_only=True)
class SimulationSettings:
    """What the simulated cluster models; the recipe gives the rest (engines, trainer ranks,
    pause mode, token budgets)."""

    hardware: str = "GB200"
    time_scale: float = 100.0  # model seconds per wall second (SimClock)
    # The model's shape and efficiency knobs for the timing; None: from the recipe's model
    # family (the mapping `megatron-rl plan` uses, which imports megatron.core).
    model: CostConfig | None = None
    max_running_requests: int | None = None  # per engine; None: model.max_running_requests
    token_granularity: int = 1  # model tokens per returned token (engine.py EngineSettings)
    median_tokens: float | None = None  # completion lengths; None: half the thinking budget
    sigma: float = 1.0
    devices_per_engine: int = 0  # 0: rollout.tp_size
    engines_per_node: int = 0  # 0: the profile's GPUs per node / devices per engine (>= 1)
    seed: int = 0
    # Serve the engines from a child process (engine_process.py): the driver then holds one
    # file descriptor per request in flight instead of two, as on a real cluster (this
    # machine's hard limit of 20,000 open files allows ~9,000 requests in flight otherwise).
    engines_in_child_process: bool = False
    record_requests: bool = False  # EngineSettings.record_requests (per-token version checks)
    # Before each train step, recompute the old policy's log-probs over the batch (a forward
    # pass: TrainerTiming.score_seconds, 2N a token at train_mfu), as a baseline that does not
    # trust the rollout's log-probs runs one (verl's colocated trainer: its old_log_prob phase).
    # This project's driver uses the rollout's log-probs, so only a simulated published
    # baseline sets it (benchmarks/simulated_anchors.py).
    recompute_old_logprobs: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SimulatedLayout:
    """ClusterLayout's fields the driver reads."""

    num_trainer_ranks: int
    num_generators: int
    devices_per_generator: int
    colocated: bool = False
    device: str = "gpu"


@dataclasses.dataclass(kw_only=True, slots=True)
class SimulatedStepMetrics:
    """trainer/trainer.py StepMetrics' fields (that module imports Megatron; this one does
    not), as metrics.py reads them."""

    step: int
    loss: float
    grad_norm: float
    clip_fraction: float
    mean_ratio: float
    logp_mismatch: float
    logp_mismatch_max: float
    entropy: float
    num_loss_tokens: int
    num_tokens: int
    num_micro_batches: int
    learning_rate: float
    skipped: bool
    num_skipped_steps: int
    routing_flip_fraction: float = math.nan
    logp_mismatch_without_replay: float = math.nan
    offloaded_bytes: int = 0
    mismatch: dict[str, float] = dataclasses.field(default_factory=dict)


class SimulatedBackend:
    """cluster/backend.py's ClusterBackend for the simulated cluster. After the run,
    `cluster` is the SimulatedCluster it started (its engines' statistics, the trainer's
    modelled time). `on_start(cluster)` runs once it is up, before the driver uses it (tests
    and fault scripts: slow engines down, schedule a node loss)."""

    def __init__(self, settings: SimulationSettings = SimulationSettings(), *,
                 on_start: Callable[["SimulatedCluster"], None] | None = None):
        self.settings = settings
        self.on_start = on_start
        self.cluster: SimulatedCluster | None = None

    def start(self, cfg: RunConfig, out: Path, stack: contextlib.ExitStack, *,
              start_checkpoint: Callable[[str], str]) -> "SimulatedCluster":
        self.cluster = SimulatedCluster.start(cfg, out, stack, self.settings)
        if self.on_start is not None:
            self.on_start(self.cluster)
        return self.cluster


def model_of(cfg: RunConfig, settings: SimulationSettings) -> CostConfig:
    """The CostConfig the timing uses: settings.model on the chosen hardware, or the recipe's
    model family through `megatron-rl plan`'s mapping."""
    profile = get_profile(settings.hardware)
    if settings.model is not None:
        return profile.cost_config(settings.model)
    from megatron_rl.scaling.plan import Architecture, cost_config_from_run

    arch = Architecture.from_family(cfg.model.name, cfg.model.size)
    hardware = settings.hardware if settings.hardware != "cpu" else "H100"
    return profile.cost_config(cost_config_from_run(
        cfg, hardware=hardware, architecture=arch,
        decode_batch=settings.max_running_requests or 256))


def _node_id(node: int) -> str:
    return f"simulated-node-{node:04d}"


def _node_ip(node: int) -> str:
    return f"10.{node // 256}.{node % 256}.1"


class SimulatedCluster:
    """RunCluster's interface (cluster/backend.py RunClusterInterface) over simulated engines
    and a simulated trainer group, all in this process."""

    def __init__(self, cfg: RunConfig, settings: SimulationSettings, loop, clock: SimClock,
                 model: CostConfig, api_key: str):
        from megatron_rl.simulation.engine import CompletionLengths, EngineSettings

        self.cfg, self.settings, self.loop, self.clock = cfg, settings, loop, clock
        self.profile = get_profile(settings.hardware)
        rollout = cfg.rollout
        devices = settings.devices_per_engine or rollout.tp_size
        self.layout = SimulatedLayout(num_trainer_ranks=cfg.parallelism.world_size,
                                      num_generators=rollout.num_generators,
                                      devices_per_generator=devices)
        total = self.layout.num_trainer_ranks + self.layout.num_generators * devices
        over_nvlink = total <= self.profile.nvlink_domain  # one NVLink domain (NVL72 rack)
        engine_model = model
        if cfg.cluster.colocated:
            self.layout = dataclasses.replace(self.layout, colocated=True)
            total, over_nvlink, engine_model = colocated_timing(
                model, self.profile, devices, self.layout.num_trainer_ranks)
        self.engine_timing = EngineTiming(model=engine_model, profile=self.profile,
                                          devices_per_engine=devices,
                                          weights_over_nvlink=over_nvlink)
        self.trainer_timing = TrainerTiming(model=model, profile=self.profile,
                                            num_devices=self.layout.num_trainer_ranks,
                                            weights_over_nvlink=over_nvlink)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
        g = settings.token_granularity
        median = settings.median_tokens or max(1.0, 0.5 * (rollout.thinking_budget
                                                           or rollout.max_response_tokens))
        self.engine_settings = EngineSettings(
            max_running_requests=settings.max_running_requests or model.max_running_requests,
            max_total_tokens=rollout.max_total_tokens,
            enable_priority_scheduling=rollout.continuations_first, tp_size=devices,
            api_key=api_key, random_seed=cfg.seed + settings.seed,
            vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
            lengths=CompletionLengths(median_tokens=median, sigma=settings.sigma),
            token_granularity=g, record_requests=settings.record_requests)
        self.engine_host = None  # engine_process.EngineHost with engines_in_child_process
        self.engines_per_node = settings.engines_per_node or max(
            1, self.profile.devices_per_node // devices)
        self.model_dir = str(Path(cfg.model.hf_checkpoint).resolve())
        self.routing_replay = False  # simulated engines return no routed experts
        self.num_devices = total
        self.api_key = api_key
        self._lost: dict[str, str] = {}  # node id -> address, of the nodes lost
        self._lost_lock = threading.Lock()  # the fault thread writes _lost, the driver reads it
        self.generators: SimulatedGeneratorPool | None = None
        self.trainers: SimulatedTrainerGroup | None = None

    @classmethod
    def start(cls, cfg: RunConfig, out: Path, stack: contextlib.ExitStack,
              settings: SimulationSettings) -> "SimulatedCluster":
        import secrets

        from megatron_rl.console import notice
        from megatron_rl.rollout.event_loop import RolloutLoop

        model = model_of(cfg, settings)
        loop = RolloutLoop(name="simulated-engines")
        stack.callback(loop.stop)
        cluster = cls(cfg, settings, loop, SimClock(settings.time_scale), model,
                      secrets.token_urlsafe(16))
        if settings.engines_in_child_process:
            from megatron_rl.simulation.engine_process import EngineHost

            cluster.engine_host = EngineHost()
            stack.callback(cluster.engine_host.close)  # after the pool's shutdown below
        cluster.generators = SimulatedGeneratorPool(cluster)
        stack.callback(cluster.generators.shutdown)
        cluster.generators.start()
        cluster.trainers = SimulatedTrainerGroup(cluster)
        cluster.trainers.connect_generators(cluster.generators.endpoints,
                                            hf_config_dir=cluster.model_dir)
        cluster.generators.connected = {e.name for e in cluster.generators.endpoints}
        cluster.write_processes(out)
        e = cluster.engine_settings
        notice(f"simulated cluster: {cfg.rollout.num_generators} engines of "
               f"{cluster.layout.devices_per_generator} {cluster.profile.name} "
               f"(max_running_requests {e.max_running_requests}, KV "
               f"{cluster.engine_timing.kv_capacity_tokens} tokens, token granularity "
               f"{e.token_granularity}), {cluster.layout.num_trainer_ranks} trainer devices, "
               f"time scale {settings.time_scale:g}")
        return cluster

    # ------------------------------------------------------------------ RunCluster's interface

    def lost_nodes(self, node_ids: Iterable[str], *, within_s: float = 0.0) -> dict[str, str]:
        with self._lost_lock:
            return {n: self._lost[n] for n in node_ids if n in self._lost}

    def write_processes(self, out: Path) -> None:
        from megatron_rl.cluster.launch import write_processes

        write_processes(out, "simulated-driver", self.generators.endpoints, self.trainers.nodes,
                        simulated=True)

    def restart_trainers(self, cfg: RunConfig) -> None:
        self.trainers.shutdown()
        self.stop_if_trainer_node_lost(cfg)
        self.trainers = SimulatedTrainerGroup(self)
        self.trainers.connect_generators(self.generators.endpoints,
                                         hf_config_dir=self.model_dir)
        self.generators.connected = {e.name for e in self.generators.endpoints}

    def stop_if_trainer_node_lost(self, cfg: RunConfig) -> None:
        from megatron_rl.resilience.recovery import NodeLost, node_lost_message

        lost = self.lost_nodes(n.node_id for n in self.trainers.nodes)
        if lost:
            held = {node: [f"trainer rank {r}" for r, n in enumerate(self.trainers.nodes)
                           if n.node_id == node] for node in lost}
            raise NodeLost(node_lost_message(cfg, lost, held))

    def stop_if_node_lost(self, cfg: RunConfig, failure: BaseException) -> None:
        self.stop_if_trainer_node_lost(cfg)

    # ------------------------------------------------------------------ faults

    def lose_node(self, node_id: str) -> None:
        """A node of the run is gone: its engines die together; the cluster's node table says
        so; a trainer call under way on it fails (SimulatedTrainerGroup._sleep)."""
        address = next((n.node_ip for n in self.trainers.nodes if n.node_id == node_id), None) \
            or next((_node_ip(e.node) for e in self.generators.engines
                     if _node_id(e.node) == node_id), "simulated")
        with self._lost_lock:
            self._lost[node_id] = address  # the message names it (node_lost_message)
        dying = [e for e in self.generators.engines if _node_id(e.node) == node_id]

        async def kill_all():
            await asyncio.gather(*(engine.kill() for engine in dying))

        if dying:
            self.loop.call(kill_all())

    def generator_nodes(self) -> dict[int, list[int]]:
        """{node: generator indices} of the engines serving now (for fault plans)."""
        nodes: dict[int, list[int]] = {}
        for index, engine in enumerate(self.generators.engines):
            nodes.setdefault(engine.node, []).append(index)
        return nodes

    def engine_stats(self) -> dict[str, float]:
        from megatron_rl.simulation.engine import sum_stats

        return sum_stats(self.generators.engines + self.generators.retired)


class SimulatedGeneratorPool:
    """GeneratorPool's interface over simulated engines on the cluster's engine loop."""

    def __init__(self, cluster: SimulatedCluster):
        self.cluster, self.loop = cluster, cluster.loop
        count = cluster.layout.num_generators
        self.names = [f"generator-{i}" for i in range(count)]
        self.engines = [self._new_engine(i, i // cluster.engines_per_node)
                        for i in range(count)]
        self.retired: list = []  # engines replaced by a restart (their statistics count)
        self._endpoints: list = [None] * count
        self._replacing: dict[int, object] = {}  # index -> concurrent Future of its restart
        self._spare_node = (count - 1) // cluster.engines_per_node + 1
        self._spare_used = 0  # engines placed on the spare node so far
        # One record per restart: index, name, node, asked_model_s, up_model_s (None until the
        # engine serves, or "failed"); model seconds on the cluster's clock.
        self.restarts: list[dict] = []
        self.connected: set[str] = set()
        self.call_timeout_s = cluster.cfg.rollout.health_check_timeout_s
        self._stopped = False

    def _new_engine(self, index: int, node: int):
        from megatron_rl.simulation.engine import SimulatedEngine

        settings = dataclasses.replace(self.cluster.engine_settings,
                                       random_seed=self.cluster.engine_settings.random_seed
                                       + 1000 * index + len(getattr(self, "retired", ())))
        if self.cluster.engine_host is not None:
            from megatron_rl.simulation.engine_process import RemoteEngine

            return RemoteEngine(self.cluster.engine_host, settings, self.cluster.engine_timing,
                                self.cluster.clock, name=self.names[index], node=node)
        return SimulatedEngine(settings, self.cluster.engine_timing, self.cluster.clock,
                               name=self.names[index], node=node)

    def _endpoint(self, index: int):
        from megatron_rl.cluster.generators import GeneratorEndpoint

        engine = self.engines[index]
        return GeneratorEndpoint(name=self.names[index], url=engine.url,
                                 num_ranks=engine.settings.tp_size, node_id=_node_id(engine.node),
                                 node_ip=_node_ip(engine.node), pid=os.getpid(),
                                 started_at=time.time(), log_path="",
                                 api_key=self.cluster.api_key)

    def start(self) -> None:
        async def start_all():
            await asyncio.gather(*(engine.start() for engine in self.engines))

        self.loop.call(start_all())
        self._endpoints = [self._endpoint(i) for i in range(len(self.engines))]

    def wait_until_healthy(self) -> None:
        self.check_health()

    def serving(self) -> dict:
        return {i: e for i, e in enumerate(self._endpoints) if e is not None}

    @property
    def endpoints(self) -> list:
        return list(self.serving().values())

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    @property
    def placing(self) -> frozenset[int]:
        return frozenset()

    def restart(self, index: int) -> None:
        """A fresh engine for generator `index` (version 0, a new port), not waited for. On a
        lost node it starts on a spare node (as Ray re-places a bundle on a node with room)."""
        node = self.engines[index].node
        if self.cluster.lost_nodes([_node_id(node)]):
            if self._spare_used == self.cluster.engines_per_node:
                self._spare_node, self._spare_used = self._spare_node + 1, 0
            node, self._spare_used = self._spare_node, self._spare_used + 1
        old, self._endpoints[index] = self.engines[index], None
        new = self._new_engine(index, node)
        self.retired.append(old)
        self.engines[index] = new
        clock = self.cluster.clock
        record = {"index": index, "name": self.names[index], "node": node,
                  "asked_model_s": clock.now(), "up_model_s": None}
        self.restarts.append(record)

        async def replace():
            await old.kill()
            # A real restart is not instant: the server launches and loads the checkpoint.
            await clock.sleep(self.cluster.engine_timing.start_seconds())
            try:
                if self.cluster.lost_nodes([_node_id(node)]):  # the node went while it started
                    raise RuntimeError(f"its node {_node_id(node)} was lost while it started")
                await new.start()
            except BaseException:
                record["up_model_s"] = "failed"
                raise
            record["up_model_s"] = clock.now()

        self._replacing[index] = self.loop.submit(replace())

    replace = restart

    def poll_replacements(self) -> dict:
        from megatron_rl.rollout import GeneratorError

        done = {}
        for index, future in list(self._replacing.items()):
            if not future.done():
                continue
            del self._replacing[index]
            try:
                future.result(timeout=0)
            except Exception as exc:  # noqa: BLE001 (reported as the start's failure)
                done[index] = GeneratorError(f"generator {self.names[index]!r}: restarting it "
                                             f"failed: {type(exc).__name__}: {exc}")
                continue
            self._endpoints[index] = done[index] = self._endpoint(index)
        return done

    def unhealthy(self, indices: Sequence[int] | None = None, *,
                  timeout_s: float | None = None) -> dict:
        """{index: error} of the engines that do not answer /health within `timeout_s`
        (GeneratorError: hung) or refuse the connection (GeneratorDeadError), over HTTP."""
        import aiohttp

        from megatron_rl.rollout import GeneratorDeadError, GeneratorError

        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        indices = list(range(len(self.engines)) if indices is None else indices)
        urls = {i: self.engines[i].url for i in indices}

        async def check(session, index, url):
            try:
                async with session.get(f"{url}/health",
                                       timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                    if r.status != 200:
                        return GeneratorError(f"generator {self.names[index]!r} ({url}): "
                                              f"health answered {r.status}")
            except asyncio.TimeoutError:
                return GeneratorError(f"generator {self.names[index]!r} ({url}): no health "
                                      f"answer within {timeout_s:.0f} s")
            except aiohttp.ClientError as exc:
                return GeneratorDeadError(f"generator {self.names[index]!r} ({url}): "
                                          f"{type(exc).__name__}: {exc}")
            return None

        async def check_all():
            async with aiohttp.ClientSession() as session:
                results = await asyncio.gather(*(check(session, i, u) for i, u in urls.items()))
            return {i: r for i, r in zip(urls, results) if r is not None}

        return self.loop.call(check_all(), timeout=timeout_s + 60.0) if urls else {}

    def check_health(self, timeout_s: float | None = None) -> None:
        problems = list(self.unhealthy(timeout_s=timeout_s).values())
        if problems:
            raise problems[0] if len(problems) == 1 else type(problems[0])(
                "\n".join(str(p) for p in problems))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        if self._stopped:
            return
        self._stopped = True

        async def kill_all():
            await asyncio.gather(*(e.kill() for e in self.engines if e.alive))

        self.loop.call(kill_all(), timeout=timeout_s)


class SimulatedTrainerGroup:
    """TrainerGroup's interface with modelled durations (TrainerTiming) slept on the clock."""

    def __init__(self, cluster: SimulatedCluster):
        from megatron_rl.cluster.trainers import WorkerNode

        self.cluster = cluster
        self.timing = cluster.trainer_timing
        per_node = cluster.profile.devices_per_node
        self.nodes = [WorkerNode(node_id=f"simulated-trainer-node-{r // per_node:04d}",
                                 node_ip=f"10.255.{r // per_node}.1", gpu_ids=(), pid=os.getpid())
                      for r in range(cluster.layout.num_trainer_ranks)]
        self.version = 0
        self.steps = self.skipped = 0
        self._generators: list = []
        self._stopped = False
        self.modelled_s = {"train": 0.0, "weight_push": 0.0, "checkpoint": 0.0}
        if cluster.layout.colocated:
            self.modelled_s["offload"] = 0.0  # the optimizer state to the host and back
        # Colocated: the train steps' spans on the clock (model s), for the report and tests.
        self.train_spans: list[tuple[float, float]] = []
        self.pushed: dict[str, int] = {}  # engine URL -> the last version it confirmed

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    def _sleep(self, what: str, model_seconds: float) -> None:
        """Sleep `model_seconds` of model time; a lost trainer node ends it (TrainerFailure, as
        a Ray actor's death does to the real group's call)."""
        self.modelled_s[what] = self.modelled_s.get(what, 0.0) + model_seconds  # +old_logprob
        end = time.monotonic() + self.cluster.clock.wall_delay(model_seconds)
        while True:
            self._raise_if_node_lost(what)
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(left, 0.05))

    def _raise_if_node_lost(self, what: str) -> None:
        from megatron_rl.resilience.recovery import TrainerFailure

        lost = self.cluster.lost_nodes({n.node_id for n in self.nodes})
        if lost:
            raise TrainerFailure(f"simulated trainer rank(s) on lost node(s) {sorted(lost)} "
                                 f"died during {what}")

    def call(self, method: str, *args, timeout_s: float | None = None, **kwargs):
        if self._stopped:
            raise RuntimeError("the trainer group has been shut down")
        return getattr(self, method)(*args, **kwargs)

    def monitor_status(self) -> str:
        return "simulated"

    def load_model_weights(self, directory: str) -> None:
        self.version = 0

    def train_step(self, batch, *, timeout_s: float | None = None) -> SimulatedStepMetrics:
        """One optimizer step over the batch's tokens (each standing for token_granularity
        model tokens), slept for TrainerTiming's step time."""
        g = self.cluster.engine_settings.token_granularity
        num_tokens = sum(int(t.numel()) for t in batch.token_ids)
        loss_tokens = sum(int(m.sum()) for m in batch.loss_mask)
        colocated = self.cluster.layout.colocated
        if colocated:
            self._check_engines_idle("begins")
            began, busy = self.cluster.clock.now(), self._engines_busy_s()
            self._sleep("offload", offload_seconds(self.timing))  # optimizer state back
        if self.cluster.settings.recompute_old_logprobs:
            self._sleep("old_logprob", self.timing.score_seconds(num_tokens * g))
        self._sleep("train", self.timing.train_step_seconds(num_tokens * g))
        if colocated:
            self._sleep("offload", offload_seconds(self.timing))  # and to the host again
            self._check_engines_idle("ends")
            if self._engines_busy_s() > busy:  # a request came and went meanwhile
                raise ColocatedOverlap(
                    f"cluster.colocated: the engines decoded {self._engines_busy_s() - busy:.3g} "
                    "model s during a train step; generation and training share the devices "
                    "and must alternate")
            self.train_spans.append((began, self.cluster.clock.now()))
        self.steps += 1
        cfg = self.cluster.cfg
        micro = max(1, math.ceil(num_tokens / max(1, cfg.train.micro_batch_max_tokens)))
        return SimulatedStepMetrics(
            step=self.steps, loss=0.0, grad_norm=1.0, clip_fraction=0.0, mean_ratio=1.0,
            logp_mismatch=0.0, logp_mismatch_max=0.0,
            entropy=self.cluster.engine_settings.mean_neg_logprob, num_loss_tokens=loss_tokens,
            num_tokens=num_tokens, num_micro_batches=micro, learning_rate=cfg.train.lr,
            skipped=False, num_skipped_steps=0)

    def _engines_busy_s(self) -> float:
        return sum(e.stats.busy_model_s for e in self.cluster.generators.engines)

    def _check_engines_idle(self, moment: str) -> None:
        """Colocated: the devices are the trainer's now; an engine holding a request would be
        generating on them (the driver releases the engines only once nothing generates)."""
        busy = {e.name: e.num_running + e.num_queued for e in self.cluster.generators.engines
                if e.alive and e.num_running + e.num_queued}
        if busy:
            raise ColocatedOverlap(f"cluster.colocated: engines {busy} (requests held) while a "
                                   f"train step {moment}; generation and training share the "
                                   "devices and must alternate (RunSetup.train_step releases "
                                   "the engines once no group generates)")

    def save_checkpoint(self, directory: str, extra_state: dict | None = None, *,
                        async_save: str = "never") -> bool:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        (path / "simulated_trainer.json").write_text(json.dumps(
            {"version": self.version, "steps": self.steps, "extra_state": extra_state}))
        self._sleep("checkpoint", self.timing.checkpoint_seconds())
        return False  # written synchronously

    def finalize_checkpoints(self, *, blocking: bool) -> bool:
        return True

    def load_checkpoint(self, directory: str, *, load_optimizer: bool = True) -> dict:
        state = json.loads((Path(directory) / "simulated_trainer.json").read_text())
        self.version, self.steps = state["version"], state["steps"]
        self._sleep("checkpoint", self.timing.checkpoint_seconds())
        return state

    def connect_generators(self, generators: Sequence, hf_config_dir: str) -> None:
        if not generators:
            raise ValueError("connect_generators: no generators given")
        self._generators = list(generators)

    def sync_weights(self, version: int | None = None, *, timeout_s: float | None = None):
        version = self.version + 1 if version is None else version
        report = self._push(self._generators, version,
                            pause_mode=self.cluster.cfg.weight_sync.pause_mode)
        self.version = version
        return report

    def sync_new_generators(self, generators: Sequence, hf_config_dir: str, version: int,
                            connect: Sequence | None = None):
        report = self._push(list(generators), version, pause_mode="none")
        if connect is None:
            by_name = {g.name: g for g in generators}
            connect = [by_name.get(g.name, g) for g in self._generators]
        self.connect_generators(list(connect), hf_config_dir)
        return report

    def _push(self, generators: Sequence, version: int, *, pause_mode: str):
        """The engines' side of a weight update over their HTTP API: pause, begin, one bucket
        of the generator weights (each engine times it by its link), the version, end,
        continue. -> weight_sync's SyncReport."""
        import aiohttp

        from megatron_rl.rollout import GeneratorError
        from megatron_rl.scaling.cost import generator_weight_bytes
        from megatron_rl.weight_sync.sync import SyncReport, WeightSyncError

        if self._stopped:
            raise RuntimeError("the trainer group has been shut down")
        self._raise_if_node_lost("a weight sync")
        num_bytes = int(generator_weight_bytes(self.timing.model))
        if self.cluster.layout.colocated:  # each device loads its engine's shard (below)
            num_bytes //= self.cluster.layout.devices_per_generator
        headers = {"Authorization": f"Bearer {self.cluster.api_key}"}
        group = f"simulated-sync-{version}"
        urls = [g.url for g in generators]
        timeout = aiohttp.ClientTimeout(total=self.cluster.cfg.weight_sync.timeout_s)

        async def post(session, url, path, body):
            async with session.post(f"{url}{path}", json=body) as response:
                answer = await response.json(content_type=None)
                if response.status != 200 or (isinstance(answer, dict)
                                               and answer.get("success") is False):
                    raise GeneratorError(f"{url}{path}: {response.status} {answer}")

        async def everywhere(session, path, body):
            # Every engine answers or fails (refused, or no answer within weight_sync.
            # timeout_s: hung) before the sync gives up, as the real WeightSync's wait does.
            results = await asyncio.gather(*(post(session, url, path, body) for url in urls),
                                           return_exceptions=True)
            failed = {url: r for url, r in zip(urls, results) if isinstance(r, BaseException)}
            if failed:
                await end_session(session, [u for u in urls if u not in failed])
                first = next(iter(failed.items()))
                raise WeightSyncError(
                    f"weight sync to version {version}: {len(failed)} of {len(urls)} engine(s) "
                    f"failed at {path}, e.g. {first[0]}: {type(first[1]).__name__}: "
                    f"{str(first[1])[:200] or 'no answer'}")

        async def end_session(session, healthy):
            """The engines that answered leave the failed sync (its session ended, generation
            continued), so that the driver's retry can begin a new one."""
            await asyncio.gather(*(post(session, url, path, {}) for url in healthy
                                   for path in ("/end_weight_update", "/continue_generation")),
                                 return_exceptions=True)

        async def push():
            started = time.perf_counter()
            async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
                if pause_mode != "none":
                    await everywhere(session, "/pause_generation", {"mode": pause_mode})
                paused = time.perf_counter()
                await everywhere(session, "/begin_weight_update", {})
                await everywhere(session, "/init_weights_update_group",
                                 {"group_name": group})
                loading = time.perf_counter()
                await everywhere(session, "/update_weights_from_distributed", {
                    "group_name": group, "names": ["all"], "dtypes": ["uint8"],
                    "shapes": [[num_bytes]], "weight_version": str(version)})
                loaded = time.perf_counter()
                await everywhere(session, "/destroy_weights_update_group",
                                 {"group_name": group})
                await everywhere(session, "/update_weight_version",
                                 {"new_version": str(version), "abort_all_requests": False})
                await everywhere(session, "/end_weight_update", {})
                if pause_mode != "none":
                    await everywhere(session, "/continue_generation", {})
            done = time.perf_counter()
            return started, paused, loading, loaded, done

        # Each of the 8 phases may wait weight_sync.timeout_s for a hung engine: the loop call's
        # own default (a minute) would turn that wait into a TimeoutError, i.e. a trainer failure.
        started, paused, loading, loaded, done = self.cluster.loop.call(
            push(), timeout=9 * self.cluster.cfg.weight_sync.timeout_s + 60.0)
        self.pushed.update({url: version for url in urls})  # every call above succeeded
        self.modelled_s["weight_push"] += (done - started) * self.cluster.clock.time_scale
        return SyncReport(version=version, num_bytes=num_bytes, num_tensors=1, num_buckets=1,
                          seconds=done - started, gather_s=0.0, convert_s=0.0,
                          transfer_s=loaded - loading, load_s=0.0,
                          control_s=(done - started) - (loaded - loading),
                          paused_s=(done - started) if pause_mode != "none" else 0.0)

    def shutdown(self, timeout_s: float = 60.0) -> None:
        self._stopped = True


class ColocatedOverlap(RuntimeError):
    """cluster.colocated: an engine held requests while the trainer trained on its devices."""


def colocated_timing(model: CostConfig, profile, devices_per_engine: int,
                     num_devices: int) -> tuple[int, bool, CostConfig]:
    """cluster.colocated: (devices, weights over NVLink, the engines' CostConfig). Every device
    holds a trainer rank and a share of an engine. The trainer keeps its bf16 parameters there
    while the engines generate (the rest of its state is on the host), so the engines' static
    memory fraction is what is left of `model.mem_fraction_static` after that share. The weight
    hand-over (SGLang's update_weights_from_tensor on the real cluster) is modelled as each
    device receiving its engine's shard of the weights over NVLink from the trainer ranks that
    hold them (the resharding), the engine inside one NVLink domain."""
    params_share = 2.0 * model.total_params / num_devices
    fraction = model.mem_fraction_static - params_share / profile.accelerator.memory_bytes
    if fraction <= 0:
        raise ValueError(f"cluster.colocated: the trainer's parameters ({params_share / 1e9:.1f} "
                         f"GB a device) leave the engines no memory on {profile.name}; use more "
                         "devices")
    return (num_devices, devices_per_engine <= profile.nvlink_domain,
            dataclasses.replace(model, mem_fraction_static=fraction))


def offload_seconds(timing: TrainerTiming) -> float:
    """cluster.colocated, one direction: the trainer's optimizer state (fp32 master weights and
    Adam's two moments, 12 bytes a parameter, sharded over the devices by the distributed
    optimizer) over each device's host link. The gradient buffers are freed, not moved."""
    state = 12.0 * timing.model.total_params / timing.num_devices
    return state / timing.profile.host_bytes_per_s
