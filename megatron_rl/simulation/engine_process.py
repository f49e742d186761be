"""Simulated engines served by a child process (SimulationSettings.engines_in_child_process).

Why: the real client holds one socket per request in flight (rollout/async_client.py). With the
engines in the driver's process every request costs two file descriptors (the client's socket
and the server's accepted one), so this machine's hard RLIMIT_NOFILE of 20,000 caps a run at
about 9,000 requests in flight; with the engines in a child process the driver's side is one
descriptor per request, as on a real cluster, and the child holds the other (each process has
its own limit). It also gives the engines' HTTP side a core of its own.

`EngineHost` starts the child (multiprocessing "spawn": the driver has threads) and talks to it
over a pipe; `RemoteEngine` has the interface of engine.py's SimulatedEngine that the simulated
cluster uses (start, kill, hang, unhang, slow_down, url, alive, node, settings, stats,
num_queued, num_running), each call a message to the child. The child runs every engine on one
event loop, as EngineFleet does. The clock crosses the pipe pickled: SimClock counts from a
time.perf_counter() origin, which is CLOCK_MONOTONIC on Linux, the same in both processes.
A killed engine's statistics are kept on this side, so they outlive the child (the report and
the tests read them after the run).
"""
from __future__ import annotations

import asyncio
import multiprocessing
import threading
from typing import Any

from megatron_rl.simulation.clock import SimClock
from megatron_rl.simulation.engine import EngineSettings, EngineStats, SimulatedEngine
from megatron_rl.simulation.timing import EngineTiming

_SYNC_METHODS = frozenset({"hang", "unhang", "slow_down"})
_ASYNC_METHODS = frozenset({"start", "kill"})


def _serve(conn) -> None:
    """The child: engines on one event loop; one command from the pipe at a time, answered as
    ("ok", result) or ("error", message). The pipe is read on the loop (add_reader), so the
    engines keep serving between commands."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per request served
    engines: dict[int, SimulatedEngine] = {}
    loop = asyncio.new_event_loop()
    stopped = loop.create_future()

    async def handle(message):
        command, key, *args = message
        if command == "new":
            engines[key] = SimulatedEngine(*args[:3], name=args[3], node=args[4])
            return None
        engine = engines[key]
        if command == "stats":
            return engine.stats
        if command == "load":  # cheap: polled by tests that hold engines until they fill
            return engine.num_queued, engine.num_running
        if command in _ASYNC_METHODS:
            return await getattr(engine, command)(*args)
        if command in _SYNC_METHODS:
            return getattr(engine, command)(*args)
        raise ValueError(f"engine host: unknown command {command!r}")

    async def answer(message):
        try:
            reply = ("ok", await handle(message))
        except Exception as exc:  # noqa: BLE001 (sent back to the caller, who raises it)
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send(reply)

    def readable():
        try:
            message = conn.recv()
        except EOFError:  # the parent is gone
            message = None
        if message is None:
            loop.remove_reader(conn.fileno())
            if not stopped.done():
                stopped.set_result(None)
            return
        loop.create_task(answer(message))

    async def main():
        loop.add_reader(conn.fileno(), readable)
        await stopped
        await asyncio.gather(*(e.kill() for e in engines.values()), return_exceptions=True)

    try:
        loop.run_until_complete(main())
    finally:
        conn.close()
        os._exit(0)  # skip the interpreter's teardown of a process with thousands of sockets


class EngineHost:
    """The child process holding the engines; `call` sends one command and waits for its answer
    (thread-safe: one command at a time)."""

    def __init__(self):
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child,), name="simulated-engines",
                                       daemon=True)
        self.process.start()
        child.close()
        self._lock = threading.Lock()
        self._keys = iter(range(1 << 62))
        self.closed = False

    def call(self, *message) -> Any:
        with self._lock:
            if self.closed:
                raise RuntimeError("the simulated engines' process has been stopped")
            self._conn.send(message)
            status, result = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"simulated engines' process: {message[0]} failed: {result}")
        return result

    def new_key(self) -> int:
        return next(self._keys)

    def close(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self._conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self.process.join(timeout_s)
        if self.process.is_alive():  # stuck: it holds only simulated engines
            self.process.kill()
            self.process.join(timeout_s)
        self._conn.close()


class RemoteEngine:
    """SimulatedEngine's interface (as simulation/cluster.py uses it) for an engine served by
    an EngineHost's child process."""

    def __init__(self, host: EngineHost, settings: EngineSettings, timing: EngineTiming,
                 clock: SimClock, *, name: str = "engine", node: int = 0):
        self.host, self.settings, self.timing, self.clock = host, settings, timing, clock
        self.name, self.node = name, node
        self.key = host.new_key()
        self.url, self.alive = "", False
        self._last = EngineStats()  # the last statistics read
        host.call("new", self.key, settings, timing, clock, name, node)

    def _refresh(self) -> EngineStats:
        if not self.host.closed:
            self._last = self.host.call("stats", self.key)
        return self._last

    @property
    def stats(self) -> EngineStats:
        return self._refresh()

    def _load(self) -> tuple[int, int]:
        return (0, 0) if self.host.closed or not self.alive else self.host.call("load", self.key)

    @property
    def num_queued(self) -> int:
        return self._load()[0]

    @property
    def num_running(self) -> int:
        return self._load()[1]

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self.url = await asyncio.to_thread(self.host.call, "start", self.key, host, port)
        self.alive = True
        return self.url

    async def kill(self) -> None:
        if not self.alive or self.host.closed:
            self.alive = False
            return
        self.alive = False
        await asyncio.to_thread(self.host.call, "kill", self.key)
        await asyncio.to_thread(self._refresh)  # kept: the child may be gone when read

    close = kill

    def hang(self) -> None:
        self.host.call("hang", self.key)

    def unhang(self) -> None:
        self.host.call("unhang", self.key)

    def slow_down(self, factor: float) -> None:
        self.host.call("slow_down", self.key, factor)
