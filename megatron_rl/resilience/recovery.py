"""Recovery while a run goes on (docs/fault_tolerance.md): generators that die or hang are taken
out of the rotation, their groups re-queued, and restarted and re-synced while the others go on;
reward workers that die or hang are recorded (MathVerifier has already replaced them and graded
their samples again); a trainer rank that dies or hangs raises `TrainerFailure`, and the driver
restores the trainer group from the last checkpoint (`TrainerRestarts` bounds how often). Every
fault goes to faults.jsonl.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.console import notice
from megatron_rl.resilience import ledger

_STABLE_S = 300.0  # a generator up this long since its restart has recovered
_HEALTH_STRIKES = 2  # health checks in a row a generator must fail to count as hung


class TrainerFailure(RuntimeError):
    """A trainer rank died or hung (the run restores the trainer group from a checkpoint)."""


class RunStopped(RuntimeError):
    """The run stopped itself (a checkpoint was written); the message says why and what next."""


class NodeLost(RunStopped):
    """A node the run cannot go on without is gone (it held a trainer rank or the driver), or
    fewer than rollout.min_generators engines could be placed: the run stops, and the
    scheduler should requeue it with --resume on a healthy allocation."""

    exit_status = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, run it again


def resume_hint(cfg: RunConfig) -> str:
    """What a `--resume` of this run will load (the newest valid checkpoint)."""
    from megatron_rl.resilience.checkpoint import latest_valid

    path = latest_valid(Path(cfg.checkpoint_dir).resolve(), warn=lambda _: None)
    if path is None:
        return "there is no checkpoint yet: start the run again (without --resume)"
    return f"`megatron-rl train ... --resume` continues from {path}"


def node_lost_message(cfg: RunConfig, lost: dict[str, str], held: dict[str, list[str]]) -> str:
    """One line: which node(s) were lost ({node id: address}), what ran there, what next."""
    nodes = "; ".join(f"node {address} (Ray node id {node_id[:12]}) with "
                      f"{', '.join(held.get(node_id) or ['nothing of this run'])}"
                      for node_id, address in lost.items())
    return (f"lost {nodes}: the run cannot go on without it (exit status "
            f"{NodeLost.exit_status}: requeue it). {resume_hint(cfg)}")


def trainer_call(call: Callable):
    """Run a call on the trainer group; a rank that died (Ray actor death) or hung (no answer
    within its timeout) raises TrainerFailure."""
    import ray

    try:
        return call()
    except (ray.exceptions.RayActorError, TimeoutError) as exc:
        raise TrainerFailure(f"{type(exc).__name__}: {str(exc).splitlines()[0][:500]}") from exc


class GeneratorHealth:
    """Health of the generator engines, their nodes and the reward workers while the driver
    waits.

    `cluster` is the RunCluster (its generator pool, trainer group, placement); `clients` the
    run's list of HTTP clients (one per engine), shared with the rollout manager and the
    metrics: a restart replaces its entry. `version()` is the policy version the generators
    hold, which a restarted engine receives; `new_client(url)` makes its client;
    `on_restarted()` runs after an engine joins or leaves (processes.json)."""

    def __init__(self, cfg: RunConfig, out: Path, *, cluster, loop, manager, clients: list,
                 math_verifier, version: Callable[[], int], new_client: Callable,
                 on_restarted: Callable[[], None]):
        self.cfg, self.out = cfg, out
        self.cluster, self.loop, self.manager, self.clients = cluster, loop, manager, clients
        self.generators = cluster.generators
        self.math_verifier = math_verifier
        self._version, self._new_client, self._on_restarted = version, new_client, on_restarted
        # Restarts of a generator in a row: one that fails again within _STABLE_S of its
        # restart (a crash loop) counts on; rollout.max_generator_restarts of them: given up.
        self._restarts: dict[int, int] = {}
        self._restarted_at: dict[int, float] = {}
        self._strikes: dict[int, int] = {}  # failed timer health checks in a row
        self._given_up: set[int] = set()
        self._lost: dict[int, str] = {}  # generator -> why its node is gone (not yet handled)
        # Generators restarted in place -> the node they served on: a node Ray declares dead
        # after a request saw its engine fail (before the verdict) turns the restart into a
        # re-creation, as if the loss had been seen first.
        self._restarting_on: dict[int, str] = {}
        # Generators out of the rotation being brought back (restarting, re-created, waiting
        # out a backoff, or started) -> their fault record; all of them at once, none waited for.
        self._placing: dict[int, dict] = {}
        self._retry_at: dict[int, float] = {}  # next attempt after a failed one (monotonic s)
        self._started: dict[int, object] = {}  # started, not yet in the rotation -> endpoint
        # Started engines connected to the trainer's coming weight sync (a check before a sync,
        # when the trainer holds newer weights than version()) -> the version then: they enter
        # the rotation once the sync gave them the next one.
        self._joining: dict[int, int] = {}
        self._joining_connected: set[int] = set()  # those the trainer's sync was connected to
        self._below_min_since: float | None = None
        self._last_check = 0.0
        self._failures: list = []  # GeneratorFailure reports not yet recovered

    def wait(self, coroutine, *, put_back: Callable | None = None):
        """Run a coroutine on the rollout loop; while it runs, failed generators are restarted
        and failed reward workers recorded. A graceful stop abandons it (StopRequested, within
        WAIT_SLICE_S; resilience/stop.py); `put_back(result)` then undoes a result it had
        produced already (RolloutLoop.abandon)."""
        from megatron_rl.resilience.stop import RUN_STOP, WAIT_SLICE_S

        what = f"waiting for {coroutine.__qualname__}"
        future = self.loop.submit(coroutine, put_back=put_back)
        try:
            while True:
                # Checked at least once per wait, also by one that ends at once (the pipeline
                # runs ahead of the trainer): else a re-created engine is never taken back and
                # the timed health checks never run while the trainer is the bottleneck.
                self.check()
                try:
                    return future.result(timeout=WAIT_SLICE_S)
                except TimeoutError:
                    RUN_STOP.abandon_if_requested(what)
                    self.record_reward_faults()
        except BaseException:
            self.loop.abandon(future)  # the run is stopping: nothing waits for the result
            raise

    def record_reward_faults(self) -> None:
        """faults.jsonl records of the math workers that died or hung and were replaced; their
        samples were graded again already (MathVerifier), so nothing is redone."""
        for fault in self.math_verifier.take_faults():
            ledger.record_fault(self.out, **fault, requeued_groups=0, steps_lost=0)
            notice(f"reward worker: {fault['what']}; its samples are scored again by a fresh "
                   "worker")

    def in_rotation(self) -> int:
        """How many engines are in the rotation (serving the run's requests)."""
        return len(self.clients) - len(self.loop.run(lambda: self.manager.down))

    def metrics(self) -> dict[str, float]:
        return {"rollout/engines_in_rotation": float(self.in_rotation())}

    def check(self, *, now: bool = False, strikes: int = _HEALTH_STRIKES) -> None:
        """Health-check every generator in the rotation and the run's nodes (every
        rollout.health_check_interval_s, or `now`: before a weight sync). A lost node that held
        a trainer rank or the driver stops the run (NodeLost); one that held generators takes
        them out of the rotation, to be re-created when Ray can place them again. Generators
        failing `strikes` checks in a row, a request, or the liveness rule (no progress for
        rollout.no_progress_timeout_s, docs/pipeline.md) are taken out and restarted. With
        `now`, the trainer's weight sync is connected to the engines in the rotation. A failed
        rollout task (RolloutError) is raised here."""
        self.loop.run(self.manager.raise_if_failed)  # a rollout task's failure stops the run
        interval = self.cfg.rollout.health_check_interval_s
        if now or time.monotonic() - self._last_check >= interval:
            self._last_check = time.monotonic()
            self._check_nodes()
            up = set(range(len(self.clients))) - self.loop.run(lambda: self.manager.down)
            unhealthy = self.generators.unhealthy(
                sorted(up | set(self._joining)),
                timeout_s=self.cfg.rollout.health_check_timeout_s)
            # Failed checks in a row while serving: an engine that left starts again from none.
            self._strikes = {i: self._strikes.get(i, 0) + 1 if i in unhealthy else 0
                             for i in up}
            for index in sorted(up):
                if self._strikes[index] >= strikes:  # a busy engine may miss one
                    del self._strikes[index]
                    self.loop.run(lambda i=index, r=str(unhealthy[index]):
                                  self.manager.mark_down(i, r))
            for index in sorted(set(self._joining) & set(unhealthy)):  # started, then failed
                self._start_failed(index, unhealthy[index])
            if not now:  # `now` comes from a weight sync, whose pause makes no progress
                # Engines with requests in flight and no progress (no answer, no passed
                # /health_generate) for rollout.no_progress_timeout_s: marked down.
                self.loop.call(self.manager.check_liveness(
                    self.cfg.rollout.no_progress_timeout_s))
        self._failures += self.loop.run(self.manager.take_failures)
        down = self.loop.run(lambda: self.manager.down) - self._given_up - set(self._placing)
        for index in sorted(down):  # all started at once; none is waited for here
            self._restart(index)
        if down:
            self._on_restarted()  # processes.json once: they left the rotation
        self._take_back_placed(now=now)
        self._check_enough()
        if now:
            # Nothing to sync into (no engine in the rotation, none joining): wait (bounded).
            while not self.in_rotation() and not self._joining:
                from megatron_rl.resilience.stop import RUN_STOP, WAIT_SLICE_S

                RUN_STOP.abandon_if_requested("waiting for a generator to sync weights into")
                time.sleep(WAIT_SLICE_S)
                # A lost trainer node stops the run now, not after the engines' start bound
                # (rollout.engine_start_timeout_s) that _check_enough waits out.
                self._check_nodes()
                self._take_back_placed(now=True)
                self._check_enough()
            self._connect_rotation()

    # ------------------------------------------------------------------ nodes

    def _check_nodes(self) -> None:
        """Ray's node state: the generators of a lost node are taken out of the rotation (their
        groups re-queued), then NodeLost for a lost node of a trainer rank or the driver (the
        message names the engines it also held). The node table is the cluster's
        (`RunClusterInterface.lost_nodes`, cluster/backend.py): Ray's, or the simulated one."""
        serving = self.generators.serving()
        lost = self.cluster.lost_nodes([e.node_id for e in serving.values()]
                                       + list(self._restarting_on.values()))
        for index, node_id in list(self._restarting_on.items()):
            if index not in self._placing:  # back in the rotation, or given up
                del self._restarting_on[index]
            elif node_id in lost:
                del self._restarting_on[index]
                for pending in (self._retry_at, self._started, self._joining):
                    pending.pop(index, None)
                self._joining_connected.discard(index)
                self._place_later(index, self._placing[index],
                                  f"its node {lost[node_id]} (Ray node id {node_id[:12]}) was "
                                  "lost while it restarted")
        for index, endpoint in serving.items():
            if endpoint.node_id in lost:
                self._lost[index] = (f"its node {lost[endpoint.node_id]} (Ray node id "
                                     f"{endpoint.node_id[:12]}) was lost")
                self.loop.run(lambda i=index, why=self._lost[index]: self.manager.mark_down(
                    i, f"{endpoint.describe()}: {why}"))
        self.cluster.stop_if_trainer_node_lost(self.cfg)

    def _check_enough(self) -> None:
        """Fewer than rollout.min_generators engines in the rotation: the run goes on while
        it waits for Ray to place the missing ones, up to rollout.engine_start_timeout_s, then
        stops (NodeLost); at once when too many were given up to ever get back there."""
        need, total = self.cfg.rollout.min_engines, len(self.clients)
        up = self.in_rotation()
        if total - len(self._given_up) < need:
            raise RunStopped(
                f"{len(self._given_up)} of {total} generators failed and could not be "
                f"restarted (rollout.max_generator_restarts="
                f"{self.cfg.rollout.max_generator_restarts}); the run needs "
                f"{need} (rollout.min_generators). See the generator logs in output_dir; "
                f"{resume_hint(self.cfg)}")
        if up >= need:
            self._below_min_since = None
            return
        waited = 0.0 if self._below_min_since is None \
            else time.monotonic() - self._below_min_since
        if self._below_min_since is None:
            self._below_min_since = time.monotonic()
            notice(f"{up} of {total} generator engines in the rotation, fewer than "
                   f"rollout.min_generators={need}: waiting up to "
                   f"{self.cfg.rollout.engine_start_timeout_s:.0f} s "
                   "(rollout.engine_start_timeout_s) for Ray to place the missing ones")
        elif waited > self.cfg.rollout.engine_start_timeout_s:
            missing = ", ".join(repr(self.generators.names[i]) for i in sorted(self._placing))
            raise NodeLost(
                f"only {up} of {total} generator engines in the rotation for {waited:.0f} s, "
                f"fewer than rollout.min_generators={need}: Ray could not place "
                f"{missing or 'the missing engines'} again within "
                "rollout.engine_start_timeout_s. Give the cluster nodes with room for them; "
                f"{resume_hint(self.cfg)}")

    # ------------------------------------------------------------------ restarts

    def _restart(self, index: int) -> None:
        """Start bringing generator `index` back: restarted in place, or, when its node is gone,
        re-created when Ray can place it. Not waited for (`_take_back_placed` polls it), so any
        number of engines restart at once; bounded attempts with backoff, per engine."""
        failure = next((f for f in self._failures if f.index == index), None)
        name = self.generators.names[index]
        fault = dict(kind="generator", what=failure.reason if failure else name,
                     detected_at=failure.detected_at if failure else time.time(),
                     requeued_groups=failure.requeued_groups if failure else 0, steps_lost=0)
        self._strikes.pop(index, None)  # it left: back, it starts with none
        if time.monotonic() - self._restarted_at.get(index, -math.inf) > _STABLE_S:
            self._restarts[index] = 0  # it served a while: a new failure, not a loop
        if index in self._lost:  # the node is gone: no restart in place
            self._place_later(index, fault, self._lost.pop(index))
            return
        endpoint = self.generators.serving().get(index)
        if endpoint is not None:
            self._restarting_on[index] = endpoint.node_id
        self._placing[index] = fault
        self._attempt(index)

    def _attempt(self, index: int) -> None:
        """The next restart of generator `index` (its fault in `_placing`), or give it up once
        rollout.max_generator_restarts attempts in a row were spent."""
        fault, name = self._placing[index], self.generators.names[index]
        attempt, limit = self._restarts.get(index, 0), self.cfg.rollout.max_generator_restarts
        if attempt >= limit:
            self._give_up(index, fault, attempt)
            return
        notice(f"generator {name!r} failed ({fault['what'].splitlines()[0][:200]}); "
               f"restarting it (attempt {attempt + 1} of {limit})")
        self._restarts[index] = attempt + 1
        self.generators.restart(index)

    def _start_failed(self, index: int, error: Exception) -> None:
        """An attempt to bring generator `index` back failed (its start, a health check after
        it, or its weights): the next one after a backoff (2 s, doubling, at most 60 s), or
        given up when that was the last allowed."""
        self._started.pop(index, None)
        self._joining.pop(index, None)
        self._joining_connected.discard(index)
        self._lost.pop(index, None)  # the next restart finds out again where it can run
        attempt = self._restarts.get(index, 0)
        notice(f"generator {self.generators.names[index]!r}: restart failed: "
               f"{type(error).__name__}: {str(error).splitlines()[0][:300]}")
        if attempt >= self.cfg.rollout.max_generator_restarts:
            self._give_up(index, self._placing[index], attempt)
        else:
            self._retry_at[index] = time.monotonic() + min(60.0, 2.0 * 2 ** max(attempt - 1, 0))

    def _give_up(self, index: int, fault: dict, attempts: int) -> None:
        for pending in (self._placing, self._retry_at, self._started, self._joining):
            pending.pop(index, None)
        self._given_up.add(index)
        notice(f"generator {self.generators.names[index]!r}: given up after {attempts} "
               f"restart(s) that did not last {_STABLE_S:.0f} s; the run goes on with the "
               "others")
        self._drop_failure(index)
        ledger.record_fault(self.out, recovered=False, **fault)

    def _place_later(self, index: int, fault: dict, why: str) -> None:
        """Re-create generator `index` in its bundle once Ray can place it; the run goes on
        without it meanwhile. A lost node is not the engine failing: the placement is the first
        attempt of a fresh sequence (max_generator_restarts bounds its failed starts), so that
        neither an in-place restart the node loss defeated nor the placement itself count
        against a fault of the re-created engine within its first 5 minutes."""
        self._restarts[index] = 1
        self.generators.replace(index)
        first, name = fault["what"].splitlines()[0][:200], self.generators.names[index]
        if "was lost" not in first:  # first seen by a request or a health check
            why = why.splitlines()[0][:300]
            fault["what"] = (why if why.startswith(f"generator {name!r}")
                             else f"generator {name!r}: {why}") + f" (first seen as: {first})"
        self._placing[index] = fault
        self._on_restarted()
        notice(f"generator {self.generators.names[index]!r} left the rotation: "
               f"{why.splitlines()[0][:300]}. The run goes on with {self.in_rotation()} of "
               f"{len(self.clients)} engines; it is re-created when Ray can place it (the node "
               "back, or another with room)")

    def _take_back_placed(self, *, now: bool) -> None:
        """Poll every generator being brought back, all in one pass: the next attempt of those
        whose backoff is over starts, one that failed to start spends an attempt, and those
        that started come back into the rotation together (`_take_back`). With `now` (a check
        before a weight sync: the trainer holds newer weights than version()), the started ones
        are not given those weights under the older version: they join the coming sync (the
        trainer's sync is connected to them) and enter the rotation at the next check, holding
        the version that sync published."""
        if not self._placing:
            return
        clock = time.monotonic()
        for index in sorted(i for i, at in self._retry_at.items() if at <= clock):
            del self._retry_at[index]
            self._attempt(index)
        for index, result in sorted(self.generators.poll_replacements().items()):
            if isinstance(result, Exception):
                self._start_failed(index, result)
            else:
                self._started[index] = result
        for index in sorted(set(self._started) & set(self._lost)):  # started, then its node went
            self._start_failed(index, RuntimeError(self._lost[index]))
        version = self._version()
        if now:
            for index in self._started:
                self._joining.setdefault(index, version)
            return
        synced = {i for i, joined_at in self._joining.items()  # the sync since gave them one
                  if version > joined_at and i in self._joining_connected}
        self._joining.clear()
        self._joining_connected.clear()
        if self._started:
            self._take_back(dict(sorted(self._started.items())), version, synced=synced)

    def _take_back(self, started: dict, version: int, *, synced: set[int]) -> None:
        """Started engines ({index: endpoint}) to the trainer's weights as `version`, all over
        one weight-update group of their own (the others go on generating; `synced` ones have
        them already), then back in the rotation together; the trainer's main sync is rebuilt
        once, over the new rotation. When the sync fails, the engines that fail a health check
        spend an attempt (all of them when none does); the others are taken back next time."""
        fresh = {i: e for i, e in started.items() if i not in synced}
        target = dict(sorted({**self._rotation(), **started}.items()))
        if fresh:
            try:
                trainer_call(lambda: self.cluster.trainers.sync_new_generators(
                    list(fresh.values()), self.cluster.model_dir, version,
                    connect=list(target.values())))
            except TrainerFailure:
                raise
            except Exception as exc:  # noqa: BLE001 (an engine failed during it: which?)
                failed = self.generators.unhealthy(
                    sorted(fresh), timeout_s=self.cfg.rollout.health_check_timeout_s)
                for index in sorted(failed or fresh):
                    self._start_failed(index, failed.get(index, exc))
                return
            self.generators.connected = self._names(target)
        for index, endpoint in started.items():
            client = self._new_client(endpoint.url)
            old, self.clients[index] = self.clients[index], client
            self.loop.call(old.close())
            self.loop.run(lambda i=index, c=client: self.manager.mark_up(i, c))
            self._restarted_at[index] = time.monotonic()
            self._strikes.pop(index, None)  # back: it starts with none
            self._started.pop(index)
            self._drop_failure(index)
            ledger.record_fault(self.out, **self._placing.pop(index))
        self._on_restarted()
        self._connect_rotation()  # only when the rotation changed meanwhile
        back = [f"{e.name!r} at {e.url} (node {e.node_ip})" for e in started.values()]
        more = f" and {len(back) - 8} more (processes.json)" if len(back) > 8 else ""
        notice(f"generator(s) back with policy version {version}: {', '.join(back[:8])}{more}; "
               f"{self.in_rotation()} of {len(self.clients)} engines in the rotation")

    def _drop_failure(self, index: int) -> None:
        self._failures = [f for f in self._failures if f.index != index]

    # ------------------------------------------------------------------ the trainer's sync

    def _rotation(self) -> dict:
        """{index: endpoint} of the engines in the rotation."""
        down = self.loop.run(lambda: self.manager.down)
        return {i: e for i, e in self.generators.serving().items() if i not in down}

    @staticmethod
    def _names(endpoints: dict) -> set[str]:
        return {e.name for e in endpoints.values()}

    def _connect_rotation(self) -> None:
        """Connect the trainer's weight sync to the engines in the rotation and those joining
        it at the coming sync, when it covers others (an engine left, or came back)."""
        rotation = self._rotation() | {i: self._started[i] for i in self._joining}
        rotation = dict(sorted(rotation.items()))
        # A joining engine has a new address under its old name: names alone do not tell.
        if not rotation or (self._names(rotation) == self.generators.connected
                            and self._joining_connected == set(self._joining)):
            return
        trainer_call(lambda: self.cluster.trainers.connect_generators(
            list(rotation.values()), hf_config_dir=self.cluster.model_dir))
        self.generators.connected = self._names(rotation)
        self._joining_connected = set(self._joining)


class TrainerRestarts:
    """Counts the trainer group's restarts against train.max_trainer_restarts and records each
    recovery in faults.jsonl."""

    def __init__(self, cfg: RunConfig, out: Path):
        self.cfg, self.out = cfg, out
        self.count = 0

    def begin(self, failure: TrainerFailure, *, failed_step: int,
              stop_if_node_lost: Callable[[], None]) -> float:
        """A restart is about to happen: counted, or RunStopped past the limit. A lost node is
        no restart: `stop_if_node_lost()` (RunCluster.stop_if_trainer_node_lost, which waits
        for Ray's verdict on a node whose raylet went) raises NodeLost first. Returns the time
        the failure was detected."""
        detected = time.time()
        stop_if_node_lost()
        self.count += 1
        limit = self.cfg.train.max_trainer_restarts
        if self.count > limit:
            raise RunStopped(f"the trainer failed at step {failed_step} ({failure}) and has "
                             f"been restarted {limit} time(s) already "
                             "(train.max_trainer_restarts); resume with --resume once the "
                             "cause is fixed") from failure
        notice(f"trainer failed at step {failed_step}: {failure}; restarting the trainer ranks "
               f"(attempt {self.count} of {limit})")
        return detected

    def done(self, failure: TrainerFailure, *, detected: float, failed_step: int,
             restored_step: int, restored_from: Path | None) -> None:
        lost = failed_step - 1 - restored_step
        ledger.record_fault(self.out, kind="trainer", what=str(failure), detected_at=detected,
                            restored_step=restored_step, steps_lost=lost)
        notice(f"trainer restored to step {restored_step} "
               f"({restored_from.name if restored_from is not None else 'the start of the run'}"
               f"); {lost} step(s) are redone")
