"""The Ray runtime of a run: start a local cluster bound to the loopback interface, or join an
existing one, reserve placement groups on it, and stop everything that was started in one
`shutdown()`.

Local start (`ClusterSettings.address` None): `ray.init(address="local")` always starts a fresh
cluster (RAY_ADDRESS and clusters already running on the machine are ignored), with a small object
store and no dashboard. Ray picks the address its components bind to when `ray` is imported: with
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 it is 127.0.0.1 for every component (GCS, raylet, workers,
agents); without it, `_node_ip_address="127.0.0.1"` alone is resolved to the machine's external
address and the GCS and raylet listen on all interfaces (both checked on Ray 2.60 with
psutil.net_connections). So the variable is set for the children, and the value Ray read at import
(`ray._private.ray_constants.ENABLE_RAY_CLUSTER`) is set to match when `ray` was imported first;
after start the node address is checked to be 127.0.0.1. Both are restored at shutdown.
Join (`address` "host:port" or "auto"): `ray.init(address=...)`; the cluster's own settings apply.
Joining a loopback address (a local cluster of another process on this machine) gets the same
treatment: otherwise Ray rewrites 127.0.0.1 to the external address and never reaches it.
Either way, the NCCL settings that trainer ranks and generator engines must share
(megatron_rl.platform.environment.shared_environment, resolved from this process's environment)
are the job's runtime_env, so every actor of the run and every process it starts gets the same
values, whatever the environment of the node it runs on.

Lost nodes: `lost_nodes` asks the GCS which of the run's nodes it no longer counts alive (the
driver's health check polls it; docs/fault_tolerance.md, "Node failures"). A call to a lost node's
actor can fail before the GCS has declared the node dead: `unreachable_nodes` finds such a node
(its raylet refuses connections), and `lost_nodes(..., within_s=node_verdict_s())` waits for the
verdict before the failure is blamed on something else.

Everything the cluster layer creates registers its stop function here (`on_shutdown`), so that
`RayCluster.shutdown()` stops trainer ranks, generators (their SGLang servers included),
placement groups and finally Ray itself, in reverse order of creation, every step attempted even
when an earlier one fails.

Ray's workers import megatron_rl and models by name: the project must be installed (`make setup`
installs it editable) or be on PYTHONPATH on every node.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable

from megatron_rl.cluster.placement import (GENERATOR_NODE_RESOURCE, TRAINER_NODE_RESOURCE,
                                           ClusterLayout, Placement, reserve_placement_group)

_LOOPBACK = "127.0.0.1"
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": every Ray component binds 127.0.0.1
# Unix sockets (raylet, plasma store) live under the temp dir; their paths must stay < 108 bytes.
_MAX_TEMP_DIR_CHARS = 48


class ClusterError(RuntimeError):
    """The Ray cluster could not be started, joined or stopped cleanly."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSettings:
    """How to get a Ray cluster. The local-only fields are refused when joining (the joined
    cluster's `ray start` decided them)."""

    address: str | None = None  # None: start a local, loopback-only cluster; else join it
    num_cpus: int | None = None  # local: CPUs offered (None: Ray counts the machine's)
    num_gpus: int | None = None  # local: GPUs offered (None: Ray counts them)
    object_store_mb: int = 256  # local: plasma store size (Ray's default is 30% of RAM)
    temp_dir: str | None = None  # local: Ray's session root (None: Ray's /tmp/ray); short path
    namespace: str | None = None  # Ray namespace of the run's actors
    log_to_driver: bool = True  # stream the actors' stdout / stderr to this process
    placement_timeout_s: float = 300.0  # longest wait for a placement group's resources

    def __post_init__(self) -> None:
        if self.address is not None:
            given = [name for name in ("num_cpus", "num_gpus", "temp_dir")
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"ClusterSettings.{', '.join(given)}: only for a local cluster (address "
                    f"None); joining {self.address!r} uses that cluster's resources and "
                    "directories: leave them None")
            if self.address == "local":
                raise ValueError("ClusterSettings.address: use None (not 'local') for a local "
                                 "loopback-only cluster")
        if self.object_store_mb < 80:
            raise ValueError(f"ClusterSettings.object_store_mb must be >= 80 (Ray's minimum is "
                             f"75 MiB), got {self.object_store_mb}")
        if self.temp_dir is not None:
            if not os.path.isabs(self.temp_dir):
                raise ValueError(f"ClusterSettings.temp_dir must be absolute, got "
                                 f"{self.temp_dir!r}")
            if len(self.temp_dir) > _MAX_TEMP_DIR_CHARS:
                raise ValueError(
                    f"ClusterSettings.temp_dir {self.temp_dir!r} is {len(self.temp_dir)} "
                    f"characters; Ray's Unix socket paths under it must stay below 108 bytes: "
                    f"use at most {_MAX_TEMP_DIR_CHARS} (e.g. under /tmp)")

    @property
    def is_local(self) -> bool:
        return self.address is None


def lost_nodes(node_ids: Iterable[str], *, within_s: float = 0.0) -> dict[str, str]:
    """{node id: its address} of those of `node_ids` that Ray's GCS no longer counts alive.
    The GCS declares a node dead when its raylet ends (at once) or stops answering its health
    checks (RAY_health_check_period_ms x RAY_health_check_failure_threshold: 3 s x 5 by
    default), and then also fails every call to the node's actors (ActorDiedError): a lost node
    is seen in seconds, whatever the run was waiting for. With `within_s`, asked again every
    second while none is lost, for up to that long (the GCS's verdict on a node whose actor
    call just failed: `node_verdict_s()`); a stop request (SIGTERM) ends that wait early."""
    import time

    import ray

    from megatron_rl.resilience.stop import RUN_STOP, WAIT_SLICE_S

    node_ids = set(node_ids)
    deadline = time.monotonic() + within_s
    while True:
        table = {node["NodeID"]: node for node in ray.nodes()}
        lost = {}
        for node_id in node_ids:
            node = table.get(node_id)
            if node is None or not node["Alive"]:
                lost[node_id] = node["NodeManagerAddress"] if node is not None else "(unknown)"
        if lost or time.monotonic() >= deadline or RUN_STOP.requested:
            return lost
        time.sleep(WAIT_SLICE_S)


def unreachable_nodes(node_ids: Iterable[str], *, timeout_s: float = 2.0) -> set[str]:
    """Those of `node_ids` (alive to the GCS) whose raylet does not accept a connection within
    `timeout_s`: nodes on their way out that the GCS has not declared dead yet (a trainer
    rank's death reaches the driver first). A busy raylet still accepts (the kernel does)."""
    import socket

    import ray

    table = {node["NodeID"]: node for node in ray.nodes()}
    gone = set()
    for node_id in set(node_ids):
        node = table.get(node_id)
        if node is None or not node["Alive"]:
            continue  # lost_nodes says so
        try:
            socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]),
                                     timeout=timeout_s).close()
        except OSError:
            gone.add(node_id)
    return gone


def node_verdict_s() -> float:
    """The longest the GCS takes to declare a node dead that stopped answering: its health
    check period x the failures it tolerates (Ray's RAY_health_check_period_ms and
    RAY_health_check_failure_threshold, 3 s x 5 by default), plus a margin of two checks."""
    period_s = float(os.environ.get("RAY_health_check_period_ms", 3000)) / 1000
    failures = int(os.environ.get("RAY_health_check_failure_threshold", 5))
    return period_s * (failures + 2)


def _is_loopback_address(address: str) -> bool:
    """Whether a "host:port" address is on the loopback interface (a local cluster started by
    RayCluster in another process): Ray would rewrite 127.0.0.1 to the machine's external
    address, where that cluster does not listen."""
    host = address.rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


# Ray gives a new local node's raylet a fixed 30 s to register (ray/_private/node.py); on a
# machine loaded by other work it can take longer. The start is then tried again, this often.
LOCAL_START_ATTEMPTS = 3


def _start_local(init: Callable):
    """`init()` (ray.init of a new local cluster), again after Ray's "timed out during startup"
    with the processes the failed attempt started SIGKILLed (Ray leaves them running)."""
    import psutil

    me = psutil.Process()
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        before = {p.pid for p in me.children(recursive=True)}
        try:
            return init()
        except Exception as exc:  # noqa: BLE001 (Ray raises a bare Exception for this)
            if "timed out during startup" not in str(exc) or attempt == LOCAL_START_ATTEMPTS:
                raise
            started = [p for p in me.children(recursive=True) if p.pid not in before]
            for process in started:
                with contextlib.suppress(psutil.Error):
                    process.kill()
            psutil.wait_procs(started, timeout=10)
            from megatron_rl.console import notice

            notice(f"the local Ray node did not register within Ray's 30 s (a loaded machine?); "
                   f"starting it again (attempt {attempt + 1} of {LOCAL_START_ATTEMPTS})")
    raise AssertionError("unreachable")


class RayCluster:
    """This process's connection to a Ray cluster (started or joined) and what runs on it."""

    def __init__(self, settings: ClusterSettings, node_ip: str, gcs_address: str,
                 restore: Callable[[], None]):
        self.settings = settings
        self.node_ip = node_ip  # this (driver) node's address as Ray sees it
        self.gcs_address = gcs_address  # what another driver passes as ClusterSettings.address
        self._restore = restore
        self._stoppers: list[tuple[str, Callable[[], None]]] = []
        self._running = True

    # ------------------------------------------------------------------ start

    @classmethod
    def start(cls, settings: ClusterSettings = ClusterSettings()) -> "RayCluster":
        """Start a local loopback-only cluster (`settings.address` None) or join one."""
        previous_env = os.environ.get(_LOOPBACK_ENV)
        previous_sigterm = signal.getsignal(signal.SIGTERM)  # ray.init replaces the handler
        loopback = settings.is_local or _is_loopback_address(settings.address)
        if loopback:
            os.environ[_LOOPBACK_ENV] = "0"  # before `import ray` below, and for every child
        import ray
        from ray._private import ray_constants

        from megatron_rl.platform.environment import shared_environment

        runtime_env = {"env_vars": shared_environment()}
        previous_flag = ray_constants.ENABLE_RAY_CLUSTER

        def restore() -> None:
            ray_constants.ENABLE_RAY_CLUSTER = previous_flag
            if previous_env is None:
                os.environ.pop(_LOOPBACK_ENV, None)
            else:
                os.environ[_LOOPBACK_ENV] = previous_env
            if previous_sigterm is not None and threading.current_thread() is \
                    threading.main_thread():
                signal.signal(signal.SIGTERM, previous_sigterm)

        if ray.is_initialized():
            restore()
            raise ClusterError("Ray is already initialised in this process; shut that "
                               "connection down (ray.shutdown()) before starting a RayCluster")
        try:
            if loopback:
                # Ray read the variable when it was first imported (maybe before this call).
                ray_constants.ENABLE_RAY_CLUSTER = False
            if settings.is_local:
                context = _start_local(lambda: ray.init(
                    address="local", num_cpus=settings.num_cpus, num_gpus=settings.num_gpus,
                    object_store_memory=settings.object_store_mb * 2**20,
                    include_dashboard=False, namespace=settings.namespace,
                    log_to_driver=settings.log_to_driver, _node_ip_address=_LOOPBACK,
                    _temp_dir=settings.temp_dir, runtime_env=runtime_env,
                    logging_level=logging.WARNING))  # not "Started a local Ray instance."
            else:
                context = ray.init(address=settings.address, namespace=settings.namespace,
                                   log_to_driver=settings.log_to_driver,
                                   runtime_env=runtime_env, logging_level=logging.WARNING)
            node_ip = context.address_info["node_ip_address"]
            if loopback and node_ip != _LOOPBACK:
                raise ClusterError(f"the local Ray cluster came up on {node_ip}, not on "
                                   f"{_LOOPBACK}; it is not loopback-only")
        except BaseException:
            if ray.is_initialized():
                ray.shutdown()
            restore()
            raise
        return cls(settings, node_ip, context.address_info["gcs_address"], restore)

    def __enter__(self) -> "RayCluster":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ use

    def reserve(self, layout: ClusterLayout, *, name: str = "") -> Placement:
        """One placement group for the layout's trainer ranks and generators, reserved (waits
        up to `settings.placement_timeout_s`) and released at shutdown. A layout whose
        `node_roles` is None gets them when this cluster's nodes declare roles."""
        self._check_running()
        if layout.node_roles is None:
            layout = dataclasses.replace(layout, node_roles=self.has_node_roles())
        group = reserve_placement_group(layout, timeout_s=self.settings.placement_timeout_s,
                                        name=name)
        placement = Placement(layout, group, self)
        self.on_shutdown(f"placement group {name or group.id.hex()}", placement.remove)
        return placement

    def has_node_roles(self) -> bool:
        """Whether the cluster's nodes declare trainer / generator roles (custom resources,
        megatron_rl.cluster.placement). Only one of the two declared is a launch mistake: the
        other actors would have nowhere to go."""
        import ray

        offered = ray.cluster_resources()
        roles = [r for r in (TRAINER_NODE_RESOURCE, GENERATOR_NODE_RESOURCE) if offered.get(r)]
        if len(roles) == 1:
            missing = ({TRAINER_NODE_RESOURCE, GENERATOR_NODE_RESOURCE} - set(roles)).pop()
            raise ClusterError(
                f"the Ray cluster's nodes offer {roles[0]} but no node offers {missing}: start "
                f"the other nodes with `ray start --resources '{{\"{missing}\": N}}'` (see "
                "examples/launch/), or start all nodes without role resources")
        return bool(roles)

    def on_shutdown(self, what: str, stop: Callable[[], None]) -> None:
        """Register `stop` (named `what` in errors) to run at shutdown, before what was
        registered earlier."""
        self._check_running()
        self._stoppers.append((what, stop))

    def _check_running(self) -> None:
        if not self._running:
            raise ClusterError("this RayCluster has been shut down")

    # ------------------------------------------------------------------ stop

    def shutdown(self) -> None:
        """Stop everything registered (newest first), then disconnect from Ray (a local
        cluster's processes end with it). Every step runs; failures are raised together at
        the end. Safe to call twice."""
        if not self._running:
            return
        self._running = False
        import ray

        failures = []
        while self._stoppers:
            what, stop = self._stoppers.pop()
            try:
                stop()
            except Exception as exc:  # noqa: BLE001 (the remaining steps must still run)
                failures.append(f"stopping {what}: {type(exc).__name__}: {exc}")
        try:
            ray.shutdown()
        except Exception as exc:  # noqa: BLE001
            failures.append(f"ray.shutdown(): {type(exc).__name__}: {exc}")
        self._restore()
        if failures:
            raise ClusterError("shutdown finished with errors:\n  " + "\n  ".join(failures))

