"""The generator engines as Ray actors: `GeneratorActor` launches one SGLang server with the
project's launcher (`SGLangServer`, settings passed in) on the node Ray placed it on, reports
where it listens (`GeneratorEndpoint`), checks its health and stops it; `GeneratorPool` runs one
actor per engine in a placement group's generator bundles.

The server binds the node's Ray address (127.0.0.1 on a local cluster), so that trainer ranks on
other nodes reach it. It runs in its own process group; stopping it stops the whole group, also
when the server's leader process has already died (its scheduler and detokenizer would outlive
it). Killing the actor alone would leave the server running (it is not the actor's process), so
the pool always asks the actor to stop its server first, and afterwards sweeps the process groups
of servers on this node that a dead actor could not stop. Errors name the generator: "generator
'generator-0' (http://127.0.0.1:30001 on node 127.0.0.1, server pid 1234): ...".
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from megatron_rl.cluster.processes import kill_process_group
from megatron_rl.cluster.remote import actor_class, gather, kill_actors
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
                log_path=server.log_path)
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
        stopped and the error names this generator, with the server's exit code and log tail."""
        server = self._require_server()
        try:
            server.wait_until_healthy()
        except GeneratorError as exc:
            stopped = self._stopped
            self.shutdown()
            if stopped:
                raise GeneratorError(f"{self._describe()}: shut down while starting") from None
            raise type(exc)(f"{self._describe()} did not start: {exc}") from None
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
        """Stop the server's whole process group (SIGTERM, then SIGKILL). Idempotent."""
        with self._lock:
            self._stopped = True
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


class GeneratorPool:
    """One `GeneratorActor` per generator bundle of a placement, started together."""

    def __init__(self, placement, actors: list, names: list[str]):
        self.placement = placement
        self.actors = actors
        self.names = names
        self._endpoints: list[GeneratorEndpoint | None] = [None] * len(actors)
        self._settings: list[SGLangServerSettings] = []  # per generator, for restarts
        self._stopped = False

    @classmethod
    def launch(cls, placement, settings: Sequence[SGLangServerSettings], *,
               names: Sequence[str] | None = None) -> "GeneratorPool":
        """Start one server per generator of `placement.layout` (`settings[i]` for generator
        i) and wait until all are healthy; on any failure every one is stopped and the error
        names the generator that failed."""
        pool = cls.start(placement, settings, names=names)
        pool.wait_until_healthy()
        return pool

    @classmethod
    def start(cls, placement, settings: Sequence[SGLangServerSettings], *,
              names: Sequence[str] | None = None) -> "GeneratorPool":
        """`launch` without the wait: the server processes are started and the pool returns
        while they load (build the trainer meanwhile), then `wait_until_healthy()`."""
        count = placement.layout.num_generators
        if len(settings) != count:
            raise ValueError(f"{len(settings)} server settings for {count} generators "
                             "(ClusterLayout.num_generators): give one per generator")
        names = list(names) if names is not None else [f"generator-{i}" for i in range(count)]
        if len(names) != count or len(set(names)) != count:
            raise ValueError(f"generator names {names}: give {count} distinct names")
        actor = actor_class(GeneratorActor)
        actors = [actor.options(**placement.generator_options(i), max_concurrency=2,
                                max_restarts=0).remote(names[i], settings[i])
                  for i in range(count)]
        pool = cls(placement, actors, names)
        pool._settings = list(settings)
        placement.cluster.on_shutdown("generators", pool.shutdown)
        try:
            pool._endpoints = gather([a.launch.remote() for a in actors], pool._labels(),
                                     what="launching the SGLang servers")
        except BaseException:
            pool.shutdown()
            raise
        return pool

    def wait_until_healthy(self) -> None:
        """Wait until every started server answers; on any failure every one is stopped."""
        try:
            self._endpoints = gather([a.wait_until_healthy.remote() for a in self.actors],
                                     self._labels(), what="starting the SGLang servers")
        except BaseException:
            self.shutdown()
            raise

    @property
    def endpoints(self) -> list[GeneratorEndpoint]:
        if any(e is None for e in self._endpoints):
            raise GeneratorError("the generators have not all started")
        return list(self._endpoints)

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Raise GeneratorDeadError naming every generator whose server or actor is gone (or
        GeneratorError for one that answers with an error); return when all answer."""
        problems = list(self.unhealthy(timeout_s).values())
        if len(problems) == 1:
            raise problems[0]
        if problems:
            kind = GeneratorDeadError if any(isinstance(p, GeneratorDeadError)
                                             for p in problems) else GeneratorError
            raise kind(f"{len(problems)} of {len(self.actors)} generators failed the health "
                       "check:\n" + "\n".join(str(p) for p in problems))

    def restart(self, index: int, *, timeout_s: float | None = None) -> GeneratorEndpoint:
        """Replace generator `index`'s server with a fresh one (same settings, version 0 weights
        of the served checkpoint) and wait until it answers; a dead actor is replaced by a new
        one in the same bundle. The other generators are not touched."""
        import ray

        try:
            ray.get(self.actors[index].restart.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            old = self._endpoints[index]
            if old is not None and old.node_id == ray.get_runtime_context().get_node_id():
                kill_process_group(old.pid, started_after=old.started_at)
            actor = actor_class(GeneratorActor).options(
                **self.placement.generator_options(index), max_concurrency=2,
                max_restarts=0).remote(self.names[index], self._settings[index])
            self.actors[index] = actor
            ray.get(actor.launch.remote(), timeout=timeout_s)
        self._endpoints[index] = None
        self._endpoints[index] = ray.get(self.actors[index].wait_until_healthy.remote(),
                                         timeout=timeout_s)
        return self._endpoints[index]

    def unhealthy(self, timeout_s: float = 30.0) -> dict[int, GeneratorError]:
        """{index: error naming it} of the generators whose server or actor is gone
        (GeneratorDeadError), that answer with an error, or that do not answer within
        `timeout_s` (a hung one); {} when all answer."""
        import ray

        refs = [a.check_health.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        problems: dict[int, GeneratorError] = {}
        for i, ref in enumerate(refs):
            if ref not in ready:
                problems[i] = GeneratorError(f"{self._label(i)}: no health answer within "
                                             f"{timeout_s:.0f} s")
                continue
            try:
                ray.get(ref)
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
        process group on this node that a dead actor left behind. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        import ray

        refs = [a.shutdown.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        kill_actors(self.actors)
        here = ray.get_runtime_context().get_node_id()
        unconfirmed = []
        for endpoint, ref in zip(self._endpoints, refs):
            if endpoint is None:
                continue
            if endpoint.node_id == here:  # a no-op unless the actor failed to stop its server
                kill_process_group(endpoint.pid, started_after=endpoint.started_at)
                continue
            try:
                ray.get(ref, timeout=0)  # the actor's shutdown() returned before the kill
            except Exception:  # noqa: BLE001 (reported below)
                unconfirmed.append(endpoint.describe())
        if unconfirmed:
            raise GeneratorError("could not confirm that these servers stopped (their actors "
                                 "failed on another node): " + "; ".join(unconfirmed))

    def _label(self, i: int) -> str:
        endpoint = self._endpoints[i]
        return endpoint.describe() if endpoint is not None else f"generator {self.names[i]!r}"

    def _labels(self) -> list[str]:
        return [self._label(i) for i in range(len(self.actors))]
