"""Per-rank hang detection with nvidia-resiliency-ext's rank monitor.

Each trainer rank starts a RankMonitorServer process (nvidia_resiliency_ext.fault_tolerance) and
reports to it over a Unix socket when it enters and leaves a section of its work: "train_step",
"weight_sync", "checkpoint". A section that stays open past its timeout means the rank hung (e.g.
in a collective whose peer died, or a deadlock): the monitor sends it SIGCONT then SIGKILL. The
rank's Ray actor then dies, and the driver restores the trainer group from the last checkpoint
(RunSetup.recover_trainers) at once, without waiting for its own `train.step_timeout_s`.

Timeouts: each section has the timeout of its kind of trainer call (`train.step_timeout_s`,
`weight_sync.sync_timeout_s`, `checkpoint.timeout_s`: the driver's own waits for the same calls,
TrainerTimeouts). With `train.hang_timeout_factor` set,
the "train_step" timeout is recalibrated after `CALIBRATE_AFTER` steps to that factor times the
longest step seen (nvrx's TimeoutsCalc, synchronised over the ranks: a collective, so every rank
calls it at the same step), so that a hang is caught after a few step lengths instead of an hour.
Weight syncs and checkpoints keep the fixed timeout (rare, and their length varies).

Under `ft_launcher`, nvrx restarts ranks itself; here Ray starts them, so only the monitor and its
client are used. It runs on CPU (it needs no GPU). nvrx's NIC health check is on only where
there are GPUs and InfiniBand devices to pair, and without a GPU its GPU health check's warning
is silenced: both would only print NVML's "library not found" (`_serve`). Where
nvidia-resiliency-ext cannot be imported, `RankMonitor.start` returns None with the reason, and
a hang is caught by the driver's step timeout alone.

Files: each monitor keeps its sockets (ours and the one nvrx's server opens for a launcher, which
it puts in the temporary directory: TMPDIR points there) in a directory named after the rank's
pid, removed by `close`. A rank that is killed (the monitor dies with it) cannot remove it, so
`start` first removes the directories of ranks that no longer exist.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

SECTIONS = ("train_step", "weight_sync", "checkpoint")
CALIBRATE_AFTER = 3  # train steps seen before the train_step timeout is recalibrated
_START_TIMEOUT_S = 180.0  # importing torch and nvrx in the monitor; generous on a loaded host
_SOCKET_DIR_PREFIX = "megatron_rl_rank_monitor_"  # + the rank's pid + "_" + random
_INFINIBAND_DEVICES = "/sys/class/infiniband"  # where nvrx's NIC health check looks

_log = logging.getLogger(__name__)


class RankMonitor:
    def __init__(self, client, server, socket_dir: str, *, hang_timeout_factor: float | None):
        self._client, self._server, self._socket_dir = client, server, socket_dir
        self._factor = hang_timeout_factor
        self._steps = 0
        self.calibrated_timeout_s: float | None = None

    @classmethod
    def start(cls, *, timeouts_s: dict[str, float],
              hang_timeout_factor: float | None = None) -> tuple[RankMonitor | None, str]:
        """(the monitor, "") for this rank (after torch.distributed is up), or (None, why not).
        `timeouts_s`: section name -> its timeout, for every name in SECTIONS."""
        if sorted(timeouts_s) != sorted(SECTIONS):
            raise ValueError(f"rank monitor timeouts for {sorted(timeouts_s)}; expected one for "
                             f"each of {SECTIONS}")
        try:
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
            from nvidia_resiliency_ext.fault_tolerance.data import (
                FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR,
            )
        except Exception as exc:  # noqa: BLE001 - any import failure: not on this platform
            return None, f"nvidia-resiliency-ext does not import ({type(exc).__name__}: {exc})"
        for name in ("nvidia_resiliency_ext", "RankMonServer"):  # per-section debug chatter
            logging.getLogger(name).setLevel(logging.WARNING)
        remove_stale_socket_dirs(tempfile.gettempdir())
        socket_dir = tempfile.mkdtemp(prefix=f"{_SOCKET_DIR_PREFIX}{os.getpid()}_")
        socket_path = os.path.join(socket_dir, "rmon.socket")
        os.environ[FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR] = socket_path
        timeouts = {"rank_section_timeouts": dict(timeouts_s),
                    "safety_factor": hang_timeout_factor or 5.0}
        # A plain subprocess, not multiprocessing: spawn and forkserver re-import the caller's
        # __main__ (a Ray worker's, or a script's), and a fork would copy the rank's threads.
        server = subprocess.Popen(
            [sys.executable, "-m", "megatron_rl.resilience.rank_monitor", str(os.getpid()),
             socket_path, json.dumps(timeouts)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": socket_dir})  # nvrx's launcher socket goes there too
        ready, _, _ = select.select([server.stdout], [], [], _START_TIMEOUT_S)
        if not ready or server.stdout.readline().strip() != b"ready":
            server.kill()
            return None, (f"nvidia-resiliency-ext's rank monitor did not start within "
                          f"{_START_TIMEOUT_S:.0f} s")
        client = RankMonitorClient()
        client.init_workload_monitoring()
        return cls(client, server, socket_dir, hang_timeout_factor=hang_timeout_factor), ""

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Monitor the work inside: past its timeout this rank is killed."""
        if name not in SECTIONS:
            raise ValueError(f"unknown rank-monitor section {name!r}; one of {SECTIONS}")
        self._client.start_section(name)
        try:
            yield
        finally:
            self._client.end_section(name)
        if name == "train_step":
            self._steps += 1
            if self._factor and self._steps == CALIBRATE_AFTER:
                self._client.calculate_and_set_section_timeouts(
                    selected_sections=["train_step"], calc_out_of_section=False)
                self.calibrated_timeout_s = self._client.section_timeouts.section["train_step"]
                _log.warning("rank monitor: a train step now counts as hung after %.1f s",
                             self.calibrated_timeout_s)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.shutdown_workload_monitoring()
        self._server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._server.wait(timeout=10)
        shutil.rmtree(self._socket_dir, ignore_errors=True)


def remove_stale_socket_dirs(parent: str) -> list[str]:
    """Remove the socket directories under `parent` whose rank process no longer exists (it
    was killed before its `close`); returns their names. A directory whose pid is alive (or
    unreadable) is kept."""
    removed = []
    for name in os.listdir(parent):
        if not name.startswith(_SOCKET_DIR_PREFIX):
            continue
        pid = name[len(_SOCKET_DIR_PREFIX):].split("_", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except PermissionError:
            continue  # alive, another user's
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        removed.append(name)
    return removed



class _Ready:
    """The event RankMonitorServer.run sets once it listens: a line on stdout to the rank."""

    def set(self) -> None:
        print("ready", flush=True)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads the pipe after this


def _serve(rank_pid: int, socket_path: str, timeouts: dict) -> None:
    """The monitor process: RankMonitorServer.run, dying with the rank that started it (nvrx's
    server outlives a lost connection)."""
    import ctypes
    import signal

    import torch
    from nvidia_resiliency_ext.fault_tolerance import FaultToleranceConfig, RankMonitorServer

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != rank_pid:  # the rank died before the line above
        return
    has_gpus = torch.cuda.is_available()
    if not has_gpus:
        # nvrx builds its GPU health check whatever the config says, and without a GPU driver it
        # warns "GPU Health checks disabled: ... NVML Shared Library Not Found": there is no GPU
        # to check, so that is no news. Its errors still show.
        logging.getLogger("nvidia_resiliency_ext.shared_utils.health_check").setLevel(
            logging.ERROR)
    config = FaultToleranceConfig(
        initial_rank_heartbeat_timeout=None, rank_heartbeat_timeout=None,
        rank_out_of_section_timeout=None,  # waiting for data between steps is not a hang
        log_level=logging.WARNING,  # its INFO lines narrate start-up; a detected hang is a warning
        # The NIC health check pairs each GPU (found through NVML) with its InfiniBand NIC (under
        # /sys/class/infiniband). Without both it watches nothing, after printing NVML's "Shared
        # Library Not Found" with two chained tracebacks and "No such file or directory:
        # /sys/class/infiniband" at every start, which on a CPU machine reads like a crash.
        enable_nic_monitor=has_gpus and os.path.isdir(_INFINIBAND_DEVICES), **timeouts)
    RankMonitorServer.run(cfg=config, ipc_socket_path=socket_path,
                          rank_monitor_ready_event=_Ready(), is_restarter_logger=False)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]))
