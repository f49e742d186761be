"""The generator engines as Ray actors: `GeneratorActor` launches one SGLang server with the
project's launcher (`SGLangServer`, settings passed in) on the node Ray placed it on, reports
where it listens (`GeneratorEndpoint`), checks its health and stops it; `GeneratorPool` runs one
actor per engine in a placement group's generator bundles. Restarting an engine never blocks the
driver: `restart` (in place; a dead, hung or failing actor is replaced by a new one in its
bundle) and `replace` (a new actor, for an engine whose node is lost: Ray re-places its bundle on
the first node with room) only start the work, and `poll_replacements` brings up, in one pass
over every engine under way, those that started. So a rack of engines restarts at once, in the
time of one start. Every stage is bounded (rollout.engine_start_timeout_s,
rollout.health_check_timeout_s).

The server binds the node's Ray address (127.0.0.1 on a local cluster), so that trainer ranks on
other nodes reach it. It runs in its own process group; stopping it stops the whole group, also
when the server's leader process has already died (its scheduler and detokenizer would outlive
it). The server and its children also die with the actor's process, whenever and however it
ends (SIGKILL included: megatron_rl.rollout.engine_lifetime), so no engine outlives its actor.
The pool still asks the actor to stop its server first (a clean stop), and afterwards sweeps the
process groups of servers on this node that a dead actor could not stop. The server runs with
the run's API key (`SGLangServerSettings.api_key`), which its endpoint hands on to the clients
(`GeneratorEndpoint.api_key`, never shown). Errors name the generator: "generator
'generator-0' (http://127.0.0.1:30001 on node 127.0.0.1, server pid 1234): ...".
"""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

from megatron_rl.cluster.processes import kill_process_group
from megatron_rl.cluster.remote import actor_class, gather, kill_actors
from megatron_rl.cluster.runtime import ClusterError, lost_nodes
from megatron_rl.rollout import GeneratorDeadError, GeneratorError, SGLangServerSettings


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GeneratorEndpoint:
    """Where one generator listens, and the process that serves it."""

    name: str
    url: str
    num_ranks: int  # SGLang tp_size: the ranks it adds to a weight-update group
    node_id: str  # Ray node id
    node_ip: str
    pid: int  # the server's leader process (its process group id)
    started_at: float  # the leader's start time (epoch s): tells its group from a reused pid
    log_path: str
    # The server's API key (SGLangServerSettings.api_key), for its clients; never shown.
    api_key: str | None = dataclasses.field(default=None, repr=False)

    def describe(self) -> str:
        return (f"generator {self.name!r} ({self.url} on node {self.node_ip}, server pid "
                f"{self.pid})")


class GeneratorActor:
    """One SGLang server (a Ray actor, created by `GeneratorPool`; max_concurrency 2 so that
    `shutdown` can run while `wait_until_healthy` waits)."""

    def __init__(self, name: str, settings: SGLangServerSettings):
        import ray

        from megatron_rl.console import quiet_known_warnings, verbose_requested

        quiet_known_warnings(verbose=verbose_requested([])[0])  # as TrainerWorker does
        self.name = name
        self.settings = dataclasses.replace(settings, host=ray.util.get_node_ip_address())
        self._lock = threading.Lock()
        self._server = None
        self._endpoint: GeneratorEndpoint | None = None
        self._stopped = False

    def __repr__(self) -> str:  # Ray shows it in errors and in `ray list actors`
        return f"GeneratorActor({self.name})"

    def launch(self) -> GeneratorEndpoint:
        """Start the server process (returns at once; see `wait_until_healthy`)."""
        import psutil
        import ray

        from megatron_rl.rollout import SGLangServer

        with self._lock:
            if self._stopped or self._server is not None:
                raise GeneratorError(f"generator {self.name!r}: launch() after "
                                     f"{'shutdown' if self._stopped else 'launch'}()")
            server = SGLangServer.launch(self.settings, wait=False)
            self._server = server
            self._endpoint = GeneratorEndpoint(
                name=self.name, url=server.url, num_ranks=self.settings.tp_size,
                node_id=ray.get_runtime_context().get_node_id(),
                node_ip=self.settings.host, pid=server.process.pid,
                started_at=psutil.Process(server.process.pid).create_time(),
                log_path=server.log_path, api_key=self.settings.api_key)
            return self._endpoint

    def restart(self) -> GeneratorEndpoint:
        """Stop the server (whatever state it is in: exited, hung or stopped) and launch a new
        one with the same settings (on a new port); wait with `wait_until_healthy`."""
        with self._lock:
            if self._stopped:
                raise GeneratorError(f"{self._describe()}: restart() after shutdown()")
            server, endpoint = self._server, self._endpoint
            self._server = self._endpoint = None
        if server is not None:
            server.shutdown(timeout_s=5.0)
            kill_process_group(endpoint.pid, started_after=endpoint.started_at)
        return self.launch()

    def wait_until_healthy(self) -> GeneratorEndpoint:
        """Wait for the server's /health (settings.startup_timeout_s). On failure the server is
        stopped and the error names this generator, with the server's exit code and log tail.
        The actor stays usable: a failed start (a port taken meanwhile: "address already in
        use") costs one attempt, and the next `restart` launches a new server."""
        server = self._require_server()
        try:
            server.wait_until_healthy()
        except GeneratorError as exc:
            stopped, described = self._stopped, self._describe()
            self._stop_server()  # not shutdown(): that would refuse every later restart()
            if stopped:
                raise GeneratorError(f"{described}: shut down while starting") from None
            raise type(exc)(f"{described} did not start: {exc}") from None
        return self._endpoint

    def endpoint(self) -> GeneratorEndpoint:
        self._require_server()
        return self._endpoint

    def check_health(self) -> None:
        """Raise GeneratorDeadError (server process exited, or not answering) or GeneratorError,
        naming this generator; return when the server answers /server_info."""
        from megatron_rl.rollout import SGLangGenerator

        server = self._require_server()
        try:
            SGLangGenerator(server.url, server=server, max_retries=0).check_health()
        except GeneratorError as exc:
            raise type(exc)(f"{self._describe()}: {exc}") from None

    def shutdown(self) -> None:
        """Stop the server's whole process group (SIGTERM, then SIGKILL), for good: the actor
        refuses to launch again. Idempotent."""
        with self._lock:
            self._stopped = True
        self._stop_server()

    def _stop_server(self) -> None:
        with self._lock:
            server, endpoint = self._server, self._endpoint
        if server is None:
            return
        server.shutdown()
        kill_process_group(endpoint.pid, started_after=endpoint.started_at)

    def _require_server(self):
        if self._stopped:
            raise GeneratorDeadError(f"{self._describe()}: shut down")
        if self._server is None:
            raise GeneratorError(f"generator {self.name!r}: not launched")
        return self._server

    def _describe(self) -> str:
        if self._endpoint is None:
            return f"generator {self.name!r}"
        return self._endpoint.describe()


class GeneratorStartError(ClusterError, GeneratorError):
    """Generators did not start at a run's launch, each after all its starts; the message names
    every one with its server's error."""


@dataclasses.dataclass(kw_only=True, slots=True)
class _Replacement:
    """A generator being restarted, one stage at a time: its actor's `restart` in place (or,
    in a new actor, `launch`: pending until Ray places the bundle), then `wait_until_healthy`.
    `ref` is the ObjectRef of the stage under way, `since` when it began (time.monotonic())."""

    stage: str  # "restart" | "launch" | "healthy"
    ref: object
    since: float
    old: GeneratorEndpoint | None = None  # the server it replaces (for names and cleanup)


class GeneratorPool:
    """One `GeneratorActor` per generator bundle of a placement, started together. A failed
    engine is restarted (`restart`) and one whose node is lost re-created in the same bundle
    when Ray can place it again (`replace`), neither waited for: `poll_replacements` reports
    them; until then they are not serving (`serving()`). Every stage is bounded: starts by
    `start_timeout_s` (rollout.engine_start_timeout_s), other actor calls by `call_timeout_s`
    (rollout.health_check_timeout_s)."""

    def __init__(self, placement, actors: list, names: list[str], *,
                 start_timeout_s: float = 900.0, call_timeout_s: float = 30.0):
        self.placement = placement
        self.actors = actors
        self.names = names
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self._endpoints: list[GeneratorEndpoint | None] = [None] * len(actors)
        self._settings: list[SGLangServerSettings] = []  # per generator, for restarts
        self._replacing: dict[int, _Replacement] = {}
        # Names of the engines the trainer's weight sync is connected to (set by its caller).
        self.connected: set[str] = set()
        self._stopped = False

    @classmethod
    def launch(cls, placement, settings: Sequence[SGLangServerSettings], *,
               names: Sequence[str] | None = None, start_timeout_s: float = 900.0,
               call_timeout_s: float = 30.0) -> "GeneratorPool":
        """Start one server per generator of `placement.layout` (`settings[i]` for generator
        i) and wait until all are healthy; on any failure every one is stopped and the error
        names the generator that failed."""
        pool = cls.start(placement, settings, names=names, start_timeout_s=start_timeout_s,
                         call_timeout_s=call_timeout_s)
        pool.wait_until_healthy()
        return pool

    @classmethod
    def start(cls, placement, settings: Sequence[SGLangServerSettings], *,
              names: Sequence[str] | None = None, start_timeout_s: float = 900.0,
              call_timeout_s: float = 30.0) -> "GeneratorPool":
        """`launch` without the wait: the server processes are started and the pool returns
        while they load (build the trainer meanwhile), then `wait_until_healthy()`."""
        count = placement.layout.num_generators
        if len(settings) != count:
            raise ValueError(f"{len(settings)} server settings for {count} generators "
                             "(ClusterLayout.num_generators): give one per generator")
        names = list(names) if names is not None else [f"generator-{i}" for i in range(count)]
        if len(names) != count or len(set(names)) != count:
            raise ValueError(f"generator names {names}: give {count} distinct names")
        pool = cls(placement, [], names, start_timeout_s=start_timeout_s,
                   call_timeout_s=call_timeout_s)
        pool._settings = list(settings)
        pool.actors = [pool._new_actor(i) for i in range(count)]
        pool._endpoints = [None] * count
        placement.cluster.on_shutdown("generators", pool.shutdown)
        try:
            pool._endpoints = gather([a.launch.remote() for a in pool.actors], pool._labels(),
                                     what="launching the SGLang servers",
                                     timeout_s=start_timeout_s)
        except BaseException:
            pool.shutdown()
            raise
        return pool

    def wait_until_healthy(self, *, attempts: int = 1) -> None:
        """Wait until every started server answers. A server that does not start (its process
        exited, or no /health within start_timeout_s) is started again in its actor, all such
        at once, until it has had `attempts` starts: at a run's launch one engine of 256 whose
        port was taken or whose node was slow does not end the launch. Once one has spent them,
        or on any other failure (an actor died), every server is stopped and the error names
        each generator that did not start (GeneratorStartError, with the servers' own errors)."""
        try:
            self._endpoints = self._start_all(attempts)
        except BaseException:
            self.shutdown()
            raise

    def _start_all(self, attempts: int) -> list[GeneratorEndpoint]:
        """`wait_until_healthy`'s loop: one `ray.wait` over every engine's current stage (its
        health wait, or the restart of one that did not start), in slices of WAIT_SLICE_S so
        that a graceful stop abandons it (resilience/stop.py)."""
        import ray

        from megatron_rl.console import notice
        from megatron_rl.resilience.stop import RUN_STOP, WAIT_SLICE_S

        what, bound = "starting the SGLang servers", self.start_timeout_s + self.call_timeout_s
        now = time.monotonic()
        pending = {i: _Replacement(stage="healthy", ref=a.wait_until_healthy.remote(), since=now)
                   for i, a in enumerate(self.actors)}
        starts = dict.fromkeys(pending, 1)
        endpoints: list[GeneratorEndpoint | None] = [None] * len(self.actors)
        failed: dict[int, str] = {}
        while pending:
            RUN_STOP.abandon_if_past_grace(what)
            late = [i for i, p in pending.items() if time.monotonic() - p.since > (
                bound if p.stage == "healthy" else self.call_timeout_s)]
            if late:
                raise TimeoutError(f"{what}: no answer from "
                                   f"{', '.join(self._label(i) for i in late)} within "
                                   f"{bound:.0f} s (rollout.engine_start_timeout_s)")
            ready = set(ray.wait([p.ref for p in pending.values()], num_returns=1,
                                 timeout=WAIT_SLICE_S)[0])
            for i, p in [(i, p) for i, p in pending.items() if p.ref in ready]:
                try:
                    result = ray.get(p.ref, timeout=WAIT_SLICE_S)
                except ray.exceptions.RayTaskError as exc:
                    cause = exc.cause
                    if not isinstance(cause, GeneratorError) or p.stage != "healthy":
                        exc.add_note(f"({what} on {self._label(i)})")
                        raise
                    if starts[i] >= attempts:
                        failed[i] = str(cause)
                        del pending[i]
                        continue
                    starts[i] += 1
                    notice(f"{str(cause).splitlines()[0][:300]}; starting it again (start "
                           f"{starts[i]} of {attempts})")
                    pending[i] = _Replacement(stage="restart", since=time.monotonic(),
                                              ref=self.actors[i].restart.remote())
                    continue
                except ray.exceptions.RayError as exc:
                    exc.add_note(f"({what} on {self._label(i)})")
                    raise
                if p.stage == "restart":  # the new server launched: wait for its health
                    pending[i] = _Replacement(stage="healthy", since=time.monotonic(),
                                              ref=self.actors[i].wait_until_healthy.remote())
                else:
                    endpoints[i] = result
                    del pending[i]
        if failed:
            raise GeneratorStartError(
                f"{len(failed)} of {len(self.actors)} generators did not start in {attempts} "
                f"start(s) each (rollout.max_generator_restarts + 1):\n"
                + "\n".join(failed[i] for i in sorted(failed))
                + "\nEach server's log is output_dir/generator-<i>.log; the usual causes are a GPU "
                "still held by an earlier run and a model the served settings cannot load")
        return endpoints

    def serving(self) -> dict[int, GeneratorEndpoint]:
        """{index: endpoint} of the generators whose server is started (not restarting, not
        waiting to be placed again)."""
        return {i: e for i, e in enumerate(self._endpoints) if e is not None}

    @property
    def endpoints(self) -> list[GeneratorEndpoint]:
        """The serving generators' endpoints, in index order."""
        return list(self.serving().values())

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    @property
    def placing(self) -> frozenset[int]:
        """Generators being re-created (`replace`) whose actor Ray has not placed yet."""
        import ray

        return frozenset(i for i, r in self._replacing.items()
                         if r.stage == "launch" and not ray.wait([r.ref], timeout=0)[0])

    def check_health(self, timeout_s: float | None = None) -> None:
        """Raise GeneratorDeadError naming every generator whose server or actor is gone (or
        GeneratorError for one that answers with an error); return when all answer."""
        problems = list(self.unhealthy(timeout_s=timeout_s).values())
        if len(problems) == 1:
            raise problems[0]
        if problems:
            kind = GeneratorDeadError if any(isinstance(p, GeneratorDeadError)
                                             for p in problems) else GeneratorError
            raise kind(f"{len(problems)} of {len(self.actors)} generators failed the health "
                       "check:\n" + "\n".join(str(p) for p in problems))

    def restart(self, index: int) -> None:
        """Start replacing generator `index`'s server with a fresh one (same settings, version 0
        weights of the served checkpoint), without waiting: `poll_replacements` brings it up.
        The actor stops the old server and launches the new one; an actor that cannot (dead,
        hung past call_timeout_s, or its restart failed) is killed and a new one is created in
        the same bundle, which Ray places when the bundle has a node. The other generators are
        not touched."""
        old, self._endpoints[index] = self._endpoints[index], None
        self._replacing[index] = _Replacement(stage="restart", old=old, since=time.monotonic(),
                                              ref=self.actors[index].restart.remote())

    def replace(self, index: int) -> None:
        """Start re-creating generator `index` in its bundle without waiting: Ray places the new
        actor once the bundle has a node again (the lost node back, or another with room);
        `poll_replacements` brings it up. The old actor is killed."""
        old, self._endpoints[index] = self._endpoints[index], None
        self._recreate(index, _Replacement(stage="launch", ref=None, since=0.0, old=old))

    def poll_replacements(self) -> dict[int, GeneratorEndpoint | GeneratorError]:
        """Without waiting: {index: endpoint} of the restarted or re-created generators now
        serving, and {index: error} of those whose start failed or took too long (an actor that
        died or did not answer is killed, and the next `restart` creates a new one); the others
        are left pending. One `ray.wait` covers every generator under way, however many."""
        import ray

        if not self._replacing:
            return {}
        refs = [r.ref for r in self._replacing.values()]
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        done: dict[int, GeneratorEndpoint | GeneratorError] = {}
        for index, pending in list(self._replacing.items()):
            try:
                result = self._advance(index, pending, pending.ref in ready)
            except (ray.exceptions.RayError, GeneratorError) as exc:
                cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
                result = cause if isinstance(cause, GeneratorError) else GeneratorError(
                    f"{self._label(index)}: restarting it failed: {type(exc).__name__}: "
                    f"{str(exc).splitlines()[0][:300]}")
                if cause is exc:  # dead, hung or late: else its server did not start, and the
                    self._drop_actor(index, None)  # actor, which stopped it, restarts again
            if result is not None:
                done[index] = result
                del self._replacing[index]
        return done

    def _advance(self, index: int, pending: _Replacement,
                 ready: bool) -> GeneratorEndpoint | None:
        """Move one restart on by the stages that finished; its endpoint once it serves."""
        import ray

        now = time.monotonic()
        if pending.stage == "restart":
            failure = None
            if ready:
                try:
                    ray.get(pending.ref, timeout=self.call_timeout_s)
                except ray.exceptions.RayError as exc:  # dead, or its restart raised
                    failure = exc
            elif now - pending.since > self.call_timeout_s:
                failure = "hung"
            else:
                return None
            if failure is None:
                pending.stage, pending.since = "healthy", now
                pending.ref = self.actors[index].wait_until_healthy.remote()
            else:
                self._recreate(index, pending)
            return None
        if pending.stage == "launch":
            if not ready:
                return None  # not placed yet: Ray places it when the bundle has a node
            ray.get(pending.ref, timeout=self.call_timeout_s)
            pending.stage, pending.since = "healthy", now
            pending.ref = self.actors[index].wait_until_healthy.remote()
            return None
        if ready:
            self._endpoints[index] = ray.get(pending.ref, timeout=self.call_timeout_s)
            return self._endpoints[index]
        if now - pending.since > self.start_timeout_s + self.call_timeout_s:
            raise GeneratorError(f"{self._label(index, pending.old)}: restarted, but not "
                                 f"healthy within {self.start_timeout_s:.0f} s "
                                 "(rollout.engine_start_timeout_s)")
        return None

    def _recreate(self, index: int, pending: _Replacement) -> None:
        """A new actor for generator `index` in its bundle (the old one killed), launching."""
        self._drop_actor(index, pending.old)
        self.actors[index] = self._new_actor(index)
        pending.stage, pending.since = "launch", time.monotonic()
        pending.ref = self.actors[index].launch.remote()
        self._replacing[index] = pending

    def unhealthy(self, indices: Sequence[int] | None = None, *,
                  timeout_s: float | None = None) -> dict[int, GeneratorError]:
        """{index: error naming it} of the generators (`indices`, default all) whose server or
        actor is gone (GeneratorDeadError), that answer with an error, or that do not answer
        within `timeout_s` (default call_timeout_s: a hung one); {} when all answer."""
        import ray

        timeout_s = self.call_timeout_s if timeout_s is None else timeout_s
        indices = range(len(self.actors)) if indices is None else indices
        refs = {i: self.actors[i].check_health.remote() for i in indices}
        if not refs:
            return {}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        problems: dict[int, GeneratorError] = {}
        for i, ref in refs.items():
            if ref not in ready:
                problems[i] = GeneratorError(f"{self._label(i)}: no health answer within "
                                             f"{timeout_s:.0f} s")
                continue
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause  # raised by the actor: its message names the generator
                problems[i] = cause if isinstance(cause, GeneratorError) \
                    else GeneratorError(f"{self._label(i)}: {cause!r}")
            except ray.exceptions.RayActorError as exc:
                problems[i] = GeneratorDeadError(
                    f"{self._label(i)}: its Ray actor died ({type(exc).__name__}: "
                    f"{str(exc).splitlines()[0]})")
        return problems

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Stop every server (through its actor), kill the actors, then stop any server
        process group on this node that a dead actor left behind. Idempotent. Actors that
        Ray has not placed yet are only killed (they started nothing)."""
        if self._stopped:
            return
        self._stopped = True
        import ray

        unplaced = self.placing
        refs = {i: a.shutdown.remote() for i, a in enumerate(self.actors) if i not in unplaced}
        if refs:
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        kill_actors(self.actors)
        here = ray.get_runtime_context().get_node_id()
        unconfirmed = []
        for i, ref in refs.items():
            endpoint = self._endpoints[i]
            if endpoint is None:
                continue
            if endpoint.node_id == here:  # a no-op unless the actor failed to stop its server
                kill_process_group(endpoint.pid, started_after=endpoint.started_at)
                continue
            try:
                ray.get(ref, timeout=0)  # the actor's shutdown() returned before the kill
            except Exception:  # noqa: BLE001 (reported below)
                unconfirmed.append((endpoint.node_id, endpoint.describe()))
        if unconfirmed:
            # A server on a node Ray declares dead went with it: its processes die with their
            # raylet and launcher (PDEATHSIG), or the host is gone. Only the others are a doubt.
            lost = lost_nodes({node for node, _ in unconfirmed})
            unconfirmed = [server for node, server in unconfirmed if node not in lost]
        if unconfirmed:
            raise GeneratorError("could not confirm that these servers stopped (their actors "
                                 "failed on another node): " + "; ".join(unconfirmed))

    def _new_actor(self, index: int):
        return actor_class(GeneratorActor).options(
            **self.placement.generator_options(index), max_concurrency=2,
            max_restarts=0).remote(self.names[index], self._settings[index])

    def _drop_actor(self, index: int, endpoint: GeneratorEndpoint | None) -> None:
        """Kill generator `index`'s actor without waiting, and its old server's process group
        when it ran on this node (elsewhere the server stops with its actor's process)."""
        import ray

        kill_actors([self.actors[index]])
        if endpoint is not None and endpoint.node_id == ray.get_runtime_context().get_node_id():
            kill_process_group(endpoint.pid, started_after=endpoint.started_at)

    def _label(self, i: int, endpoint: GeneratorEndpoint | None = None) -> str:
        endpoint = endpoint or self._endpoints[i]
        return endpoint.describe() if endpoint is not None else f"generator {self.names[i]!r}"

    def _labels(self) -> list[str]:
        return [self._label(i) for i in range(len(self.actors))]
