"""Host side of the code-execution sandbox: limits, typed requests and results, and `Sandbox`.

`Sandbox` owns one pre-forked sandbox server (sandbox_server.py, a single-threaded process started
once) and bounds how many programs run at once. Each run creates eight pipes, hands the far ends
to the server, sends the job down the control pipe and then multiplexes stdin / tests / stdout /
stderr / results / checks / status here with output caps, so a program printing gigabytes costs
the host at most `max_output_bytes` before it is killed. The server does the privileged work
(cgroup, namespaces, mounts, rlimits, seccomp, the uid change) in processes it forks, never in
this possibly multi-threaded, large process. Every concurrent run on the host gets its own
unprivileged uid (a lock file per uid, so that sandboxes in other processes never take it too):
RLIMIT_NPROC is counted per real uid, and the seccomp fallback kills leftovers by uid.

What a run reports is parsed strictly here: records the program could have written (the results
pipe) can only ever make its verdict worse, never pass a test or become `sandbox_error`; records
only the sandbox writes (status, checks) that do not parse are `sandbox_error`. Nothing a program
writes makes this module raise. Function results reach the host as plain data (JSON of built-in
types) and are compared here, by code.py; docs/rewards.md explains the limits, the isolation
modes and the threat model.
"""
from __future__ import annotations

import dataclasses
import errno
import fcntl
import functools
import json
import logging
import marshal
import os
import random
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from megatron_rl.rewards.sandbox_server import NUM_FDS, decode_value, encode_value, tests_payload

SERVER_PATH = Path(__file__).with_name("sandbox_server.py")
ISOLATIONS = ("namespaces", "auto", "seccomp")
STATUSES = ("ok", "runtime_error", "timeout", "memory_limit", "output_limit", "process_limit",
            "file_size_limit", "parse_error", "sandbox_error")
DEFAULT_ENV = (("PATH", "/usr/local/bin:/usr/bin:/bin"), ("LANG", "C.UTF-8"))
# Not used by useradd (UID_MAX 60000) nor by systemd's DynamicUser= range (61184-65519).
DEFAULT_UID_RANGE = (60100, 61100)
DEFAULT_UID_LOCK_DIR = "/run/megatron_rl/sandbox_uids"

_log = logging.getLogger(__name__)
_STDERR_KEEP_BYTES = 64 << 10
_HOST_GRACE_S = 5.0     # the monitor enforces wall time; the host only backs it up
_DRAIN_AFTER_STATUS_S = 1.0
_UID_WAIT_S = 60.0      # every uid of the range busy: wait this long for one, then fail
_ERRNO_LIMITS = {errno.EFBIG: "file_size_limit", errno.ENOSPC: "file_size_limit"}
_MALFORMED = "the program wrote malformed records into the sandbox's results channel"


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot give the isolation it was configured for on this host (a
    configuration problem, not a verdict: it is raised, never turned into a reward)."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    """Per-run limits. With a cgroup (docs/rewards.md) the whole run, every process, its files
    in the working directory and its shared memory together, is limited to memory_bytes +
    tmpfs_bytes; each process is also limited to memory_bytes of address space (RLIMIT_AS)."""

    wall_time_s: float = 10.0
    cpu_time_s: float = 10.0
    memory_bytes: int = 1 << 30
    file_size_bytes: int = 16 << 20
    num_processes: int = 16
    num_open_files: int = 256
    max_output_bytes: int = 8 << 20
    tmpfs_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise ValueError(f"SandboxLimits.{field.name} must be > 0, got {value!r}")
        if self.memory_bytes < 64 << 20:
            raise ValueError("SandboxLimits.memory_bytes must be >= 64 MiB: the interpreter "
                             f"alone maps ~30 MiB; got {self.memory_bytes}")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SandboxConfig:
    limits: SandboxLimits = dataclasses.field(default_factory=SandboxLimits)
    num_workers: int = dataclasses.field(default_factory=lambda: os.cpu_count() or 1)
    # "namespaces" (training): refuse to run without them. "auto": namespaces where permitted,
    # else the weaker seccomp fallback (an explicit opt-in, logged). "seccomp": the fallback.
    isolation: str = "namespaces"
    uid_range: tuple[int, int] = DEFAULT_UID_RANGE
    uid_lock_dir: str = DEFAULT_UID_LOCK_DIR  # host-wide: shared by every sandbox on the node
    python_executable: str = sys.executable
    site_packages: bool = False  # let programs import the interpreter's installed packages
    workdir_root: str = dataclasses.field(default_factory=tempfile.gettempdir)  # seccomp mode
    env: tuple[tuple[str, str], ...] = DEFAULT_ENV  # the programs' whole environment

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATIONS:
            raise ValueError(f"SandboxConfig.isolation must be one of {ISOLATIONS}, "
                             f"got {self.isolation!r}")
        if self.num_workers < 1:
            raise ValueError(f"SandboxConfig.num_workers must be >= 1, got {self.num_workers}")
        lo, hi = self.uid_range
        if not 0 < lo < hi:
            raise ValueError(f"SandboxConfig.uid_range must be (lo, hi) with 0 < lo < hi, "
                             f"got {self.uid_range}")
        if not os.path.isabs(self.uid_lock_dir):
            raise ValueError("SandboxConfig.uid_lock_dir must be an absolute path, got "
                             f"{self.uid_lock_dir!r}")

    @classmethod
    def from_run_config(cls, run: Any, **overrides: Any) -> SandboxConfig:
        """The run's sandbox: from a `megatron_rl.config.RunConfig` (reads
        algorithm.sandbox_isolation, the opt-in to the seccomp fallback)."""
        return cls(isolation=run.algorithm.sandbox_isolation, **overrides)


def sandbox_open_files(config: SandboxConfig) -> int:
    """The most file descriptors a Sandbox of `config` holds in its caller's process: NUM_FDS
    pipes (both ends, until the far ends are handed to the server) for each of num_workers runs
    at once. A run's driver (megatron-rl train) reserves them beside its requests' sockets."""
    return config.num_workers * 2 * NUM_FDS


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FunctionCall:
    """A call of a function the program defines, with plain-data arguments (built-in types)."""

    function: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CallOutcome:
    """What a `FunctionCall` gave: a plain-data value, or why not (`error`)."""

    returned: bool
    value: Any = None
    error: str = ""  # "raised ValueError", "returned a Foo, not plain data", "no function f"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionRequest:
    """A program, its stdin, and optionally tests of its functions, both kinds run after the
    program: `calls` (the program's return values come back as plain data, compared by the
    caller) and `tests` (Python snippets, HumanEval style, each passing if it raises nothing; run
    in a separate clean interpreter in which the names the program defines are its functions,
    called across the sandbox boundary with plain data)."""

    program: str
    stdin: str = ""
    calls: tuple[FunctionCall, ...] = ()
    tests: tuple[str, ...] = ()
    limits: SandboxLimits | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionResult:
    status: str                      # one of STATUSES
    stdout: str
    stderr: str                      # first 64 KiB
    test_passed: tuple[bool, ...]    # one per request test (False when not reached)
    exit_code: int | None
    signal: int | None
    wall_time_s: float
    cpu_time_s: float
    max_rss_bytes: int
    isolation: str                   # "namespaces" or "seccomp" (what was actually used)
    uid: int | None                  # the unprivileged uid the program ran as
    detail: str = ""
    call_outcomes: tuple[CallOutcome | None, ...] = ()  # one per request call (None: not reached)
    cgroup: str = ""                 # "v2", "v1" or "none" (rlimits only)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _UidAllocator:
    """Host-wide: concurrent runs (of any Sandbox in any process on this host) never share a uid.
    A uid is taken by a POSIX lock on `<lock_dir>/<uid>`: the kernel releases it when the process
    dies, and forked children do not inherit it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}  # uid -> descriptor of its locked file
        self._rng = random.Random()
        self._dirs_made: set[str] = set()

    def _lock_dir(self, lock_dir: str) -> None:
        if lock_dir not in self._dirs_made:
            os.makedirs(lock_dir, 0o700, exist_ok=True)
            owner = os.stat(lock_dir).st_uid
            if owner != os.geteuid():
                raise RuntimeError(f"SandboxConfig.uid_lock_dir {lock_dir} belongs to uid "
                                   f"{owner}; it must be a directory only this user controls")
            self._dirs_made.add(lock_dir)

    def _try(self, uid: int, lock_dir: str) -> bool:
        fd = os.open(f"{lock_dir}/{uid}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self._held[uid] = fd
        return True

    def acquire(self, uid_range: tuple[int, int], lock_dir: str,
                timeout_s: float = _UID_WAIT_S) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._lock_dir(lock_dir)
                uids = list(range(*uid_range))
                self._rng.shuffle(uids)  # spread over the range: fewer lock attempts
                for uid in uids:
                    if uid not in self._held and self._try(uid, lock_dir):
                        return uid
            if time.monotonic() > deadline:
                raise RuntimeError(f"every uid of SandboxConfig.uid_range {uid_range} is in use "
                                   f"by sandboxes on this host (locks in {lock_dir}); widen it to "
                                   "at least the total num_workers of the host's sandboxes")
            time.sleep(0.01)

    def release(self, uid: int) -> None:
        with self._lock:
            fd = self._held.pop(uid, None)
            if fd is not None:
                os.close(fd)  # drops the lock


_UIDS = _UidAllocator()


def _stop_server(sock: socket.socket, proc: subprocess.Popen) -> None:
    sock.close()  # the server sees EOF and exits; running monitors finish their runs
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Sandbox:
    """Runs untrusted Python programs; thread-safe; at most `num_workers` at a time."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self._slots = threading.BoundedSemaphore(self.config.num_workers)
        self._server_lock = threading.Lock()
        self._server: tuple[socket.socket, subprocess.Popen] | None = None
        self._finalizer: weakref.finalize | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._privileged = os.geteuid() == 0
        self._warned: set[str] = set()

    # --- public API ---------------------------------------------------------------------------
    def run(self, program: str, *, stdin: str = "", tests: Sequence[str] = (),
            calls: Sequence[FunctionCall] = (),
            limits: SandboxLimits | None = None) -> ExecutionResult:
        return self.execute(ExecutionRequest(program=program, stdin=stdin, tests=tuple(tests),
                                             calls=tuple(calls), limits=limits))

    def execute(self, request: ExecutionRequest) -> ExecutionResult:
        """Raises only `SandboxUnavailableError` (isolation="namespaces" on a host that refuses
        namespaces); every other problem is a result."""
        limits = request.limits or self.config.limits
        with self._slots:
            try:
                uid = (_UIDS.acquire(self.config.uid_range, self.config.uid_lock_dir)
                       if self._privileged else None)
            except (OSError, RuntimeError) as exc:
                return _failure(f"no sandbox uid: {exc}", None)
            try:
                result = self._execute(request, limits, uid)
            finally:
                if uid is not None:
                    _UIDS.release(uid)
        self._warn_about(result)
        return result

    def max_open_files(self) -> int:
        """The most file descriptors this sandbox holds in its caller's process
        (`sandbox_open_files` of its config)."""
        return sandbox_open_files(self.config)

    def map(self, requests: Sequence[ExecutionRequest]) -> list[ExecutionResult]:
        """Run many requests concurrently (num_workers at a time); results in request order."""
        return list(self._workers().map(self.execute, requests))

    def submit(self, request: ExecutionRequest) -> Future[ExecutionResult]:
        """`execute(request)` on the sandbox's own num_workers threads (those of `map`): for a
        caller that must not lend a thread of its own while the program queues and runs, e.g.
        an event loop (`asyncio.wrap_future`), whose default executor has min(32, CPUs + 4)
        threads for everything it runs. Cancelling the future drops a request still queued."""
        return self._workers().submit(self.execute, request)

    def _workers(self) -> ThreadPoolExecutor:
        with self._server_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.config.num_workers,
                                                    thread_name_prefix="sandbox")
            return self._executor

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        with self._server_lock:
            if self._finalizer is not None:
                self._finalizer()
            self._server = self._finalizer = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def server_pid(self) -> int | None:
        return None if self._server is None else self._server[1].pid

    def _warn_about(self, result: ExecutionResult) -> None:
        """Once per Sandbox: each protection this host could not give."""
        for key, message in result_warnings(result):
            if key not in self._warned:
                self._warned.add(key)
                _log.warning("%s", message)

    # --- the server -----------------------------------------------------------------------------
    def _start_server(self) -> tuple[socket.socket, subprocess.Popen]:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [self.config.python_executable, "-I", "-S", "-B", str(SERVER_PATH),
                   str(child.fileno())] + (["--site"] if self.config.site_packages else [])
        proc = subprocess.Popen(command, pass_fds=[child.fileno()], env=dict(self.config.env),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, cwd="/",
                                start_new_session=True)  # no terminal signals (Ctrl-C) from us
        child.close()
        self._finalizer = weakref.finalize(self, _stop_server, parent, proc)
        return parent, proc

    def _send_to_server(self, fds: list[int]) -> None:
        for attempt in range(2):
            with self._server_lock:
                if self._server is None or self._server[1].poll() is not None:
                    if self._finalizer is not None:
                        self._finalizer()
                    self._server = self._start_server()
                sock = self._server[0]
                try:
                    socket.send_fds(sock, [b"R"], fds)
                    return
                except OSError:
                    if attempt:
                        raise
                    self._server[1].kill()  # broken: restart it on the next attempt
                    self._server[1].wait()

    # --- one run ------------------------------------------------------------------------------
    def _job(self, request: ExecutionRequest, limits: SandboxLimits, uid: int | None) -> bytes:
        calls = [[c.function, encode_value(list(c.args)), encode_value(dict(c.kwargs))]
                 for c in request.calls]
        job = {"program": request.program, "num_tests": len(request.tests), "calls": calls,
               "limits": dataclasses.asdict(limits), "uid": uid,
               "isolation": self.config.isolation, "workdir_root": self.config.workdir_root,
               "env": dict(self.config.env)}
        payload = marshal.dumps(job)
        return struct.pack("<Q", len(payload)) + payload

    def _execute(self, request: ExecutionRequest, limits: SandboxLimits,
                 uid: int | None) -> ExecutionResult:
        try:
            job = self._job(request, limits, uid)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"ExecutionRequest.calls must hold plain data (built-in types): "
                             f"{exc}") from exc
        pipes = [os.pipe() for _ in range(NUM_FDS)]
        (stdin_r, stdin_w), (stdout_r, stdout_w), (stderr_r, stderr_w), (control_r, control_w), \
            (status_r, status_w), (results_r, results_w), (checks_r, checks_w), \
            (tests_r, tests_w) = pipes
        far_ends = [stdin_r, stdout_w, stderr_w, control_r, status_w, results_w, checks_w,
                    tests_r]
        run = _RunIO(stdin_w=stdin_w, tests_w=tests_w, stdout_r=stdout_r, stderr_r=stderr_r,
                     control_w=control_w, status_r=status_r, results_r=results_r,
                     checks_r=checks_r, limits=limits)
        try:
            self._send_to_server(far_ends)
        except OSError as exc:
            run.close()
            return _failure(f"could not reach the sandbox server: {exc}", uid)
        finally:
            for fd in far_ends:
                os.close(fd)
        try:
            _write_all(control_w, job)
        except OSError as exc:
            run.close()
            return _failure(f"could not hand the job to the sandbox server: {exc}", uid)
        # The tests go straight to the checker (init), which reads them only once it has forked
        # the program's process: never through the monitor, whose memory the program inherits.
        run.pump({stdin_w: request.stdin.encode(),
                  tests_w: _tests_payload(request.tests) if request.tests else b""})
        return _classify(run, request, limits, uid)


@functools.lru_cache(maxsize=1024)
def _tests_payload(tests: tuple[str, ...]) -> bytes:
    """The checker's input, compiled once per distinct tests (a prompt's G samples share it)."""
    return tests_payload(list(tests))


def result_warnings(result: ExecutionResult) -> list[tuple[str, str]]:
    """(key, message) for each protection the run lacked because the host does not allow it."""
    found = []
    if result.isolation == "seccomp":
        found.append(("seccomp", "the code sandbox runs in the weaker seccomp fallback (no "
                                 "namespaces): programs see the host file system and other "
                                 "processes' command lines (docs/rewards.md: threat model)"))
    if result.cgroup == "none":
        found.append(("cgroup", "the code sandbox has no cgroup on this host, so memory is only "
                                "limited per process (RLIMIT_AS), not per run; delegate cgroup v2 "
                                "memory and pids to the trainer (docs/rewards.md)"))
    return found


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _failure(detail: str, uid: int | None) -> ExecutionResult:
    return ExecutionResult(status="sandbox_error", stdout="", stderr="", test_passed=(),
                           exit_code=None, signal=None, wall_time_s=0.0, cpu_time_s=0.0,
                           max_rss_bytes=0, isolation="", uid=uid, detail=detail)


class _RunIO:
    """The host's end of one run: feeds stdin, drains outputs under caps, kills on overflow."""

    def __init__(self, *, stdin_w: int, tests_w: int, stdout_r: int, stderr_r: int,
                 control_w: int, status_r: int, results_r: int, checks_r: int,
                 limits: SandboxLimits) -> None:
        self.inputs, self.control_w, self.status_r = [stdin_w, tests_w], control_w, status_r
        self.limits = limits
        self.buffers = {fd: bytearray() for fd in (stdout_r, stderr_r, status_r, results_r,
                                                   checks_r)}
        self.keep = {stdout_r: limits.max_output_bytes, stderr_r: _STDERR_KEEP_BYTES,
                     status_r: 1 << 16, results_r: limits.max_output_bytes, checks_r: 1 << 20}
        self.totals = dict.fromkeys(self.buffers, 0)
        self.stdout_r, self.stderr_r = stdout_r, stderr_r
        self.results_r, self.checks_r = results_r, checks_r
        self.overflow = ""
        self.host_gave_up = False

    def kill(self) -> None:
        if self.control_w >= 0:  # EOF on the control pipe: the monitor kills the candidate
            os.close(self.control_w)
            self.control_w = -1

    def close(self) -> None:
        """Release every descriptor when the run could not start."""
        self.kill()
        for fd in [*self.inputs, *self.buffers]:
            os.close(fd)

    def _read(self, fd: int) -> bool:
        data = os.read(fd, 1 << 16)
        if not data:
            return False
        self.totals[fd] += len(data)
        room = self.keep[fd] - len(self.buffers[fd])
        if room > 0:
            self.buffers[fd] += data[:room]
        limit = self.limits.max_output_bytes
        if not self.overflow and fd != self.status_r and self.totals[fd] > limit:
            self.overflow = {self.stdout_r: "stdout", self.stderr_r: "stderr"}.get(fd, "results")
            self.kill()
        return True

    def pump(self, inputs: dict[int, bytes]) -> None:
        """Feed the inputs (stdin, the tests) and drain every output until the run is over (or
        the host gives up)."""
        poller = select.poll()
        open_fds = set(self.buffers)
        for fd in open_fds:
            poller.register(fd, select.POLLIN)
        pending = {fd: memoryview(data) for fd, data in inputs.items() if data}
        for fd in inputs:
            if fd in pending:
                os.set_blocking(fd, False)
                poller.register(fd, select.POLLOUT)
                open_fds.add(fd)
            else:
                os.close(fd)
        deadline = time.monotonic() + self.limits.wall_time_s + _HOST_GRACE_S
        status_done = None
        while open_fds:
            now = time.monotonic()
            if now > deadline and self.control_w >= 0:
                self.host_gave_up = True  # the monitor should have killed it by now
                self.kill()
                deadline = now + _HOST_GRACE_S
            elif now > deadline or (status_done is not None
                                    and now > status_done + _DRAIN_AFTER_STATUS_S):
                break  # leftover writers (only possible without a PID namespace): stop reading
            for fd, _ in poller.poll(200):
                if fd in pending:
                    try:
                        pending[fd] = pending[fd][os.write(fd, pending[fd][:1 << 16]):]
                    except BrokenPipeError:
                        pending[fd] = pending[fd][:0]
                    done = not pending[fd]
                else:
                    done = not self._read(fd)
                    if done and fd == self.status_r:
                        status_done = time.monotonic()
                if done:
                    poller.unregister(fd)
                    open_fds.discard(fd)
                    os.close(fd)
        for fd in open_fds:
            os.close(fd)
        self.kill()

    def text(self, fd: int) -> str:
        return self.buffers[fd].decode("utf-8", "replace")


# --- parsing what a run reported -----------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return type(value) is int


def _is_str(value: Any) -> bool:
    return type(value) is str


# Per record kind: a check of its JSON payload. Anything else on a channel is malformed.
_RESULT_RECORDS = {
    "P": _is_str,
    "E": lambda p: (type(p) is list and len(p) == 4 and _is_int(p[0]) and _is_str(p[1])
                    and _is_int(p[2]) and _is_str(p[3])),
    "R": lambda p: type(p) is list and all(type(o) is list and len(o) == 2 and _is_str(o[0])
                                           for o in p),
    "D": _is_int,
}
_CHECK_RECORDS = {
    "T": lambda p: (type(p) is list and len(p) == 3 and _is_int(p[0])
                    and type(p[1]) is bool and _is_str(p[2])),
    "D": lambda p: p is None,
    "X": _is_str,
}
_STATUS_FIELDS = {"exit_code": int, "signal": int, "killed": str, "cpu_s": (int, float),
                  "max_rss_kb": int, "isolation": str, "wall_s": (int, float), "pid": int,
                  "oom_kills": int, "memory_peak": int, "cgroup": str, "cgroup_missing": str,
                  "fallback_reason": str}
_STATUS_RECORDS = {
    "X": _is_str,
    "N": _is_str,
    "S": lambda p: (type(p) is dict and set(p) == set(_STATUS_FIELDS)
                    and all(isinstance(p[k], t) and type(p[k]) is not bool
                            for k, t in _STATUS_FIELDS.items())),
}


def parse_records(text: str, kinds: dict) -> tuple[list[tuple[str, Any]], int]:
    """(kind, payload) of every well-formed "KIND JSON" line, and how many lines were not."""
    records, malformed = [], 0
    for line in text.splitlines():
        kind, _, payload = line.partition(" ")
        check = kinds.get(kind)
        try:
            value = json.loads(payload) if check is not None else None
            valid = check is not None and bool(check(value))
        except (ValueError, RecursionError):
            valid = False
        if valid:
            records.append((kind, value))
        else:
            malformed += 1
    return records, malformed


def _call_outcomes(raw: list, num_calls: int) -> tuple[CallOutcome | None, ...] | None:
    """The candidate's "R" record as outcomes; None when it does not fit the request."""
    if len(raw) != num_calls:
        return None
    outcomes = []
    for kind, value in raw:
        if kind == "ok":
            try:
                outcomes.append(CallOutcome(returned=True, value=decode_value(value)))
            except (ValueError, TypeError, RecursionError, MemoryError):
                outcomes.append(CallOutcome(returned=False, error="returned malformed data"))
        elif kind == "raise":
            outcomes.append(CallOutcome(returned=False, error=f"raised {str(value)[:80]}"))
        elif kind == "unserialisable":
            outcomes.append(CallOutcome(returned=False,
                                        error=f"returned {str(value)[:80]}: not plain data"))
        else:
            outcomes.append(CallOutcome(returned=False, error=f"no function {str(value)[:80]}"))
    return tuple(outcomes)


def _limit_from_exception(name: str, number: int, hint: str) -> str | None:
    if hint in STATUSES:
        return hint
    if name == "MemoryError":
        return "memory_limit"
    if name == "BlockingIOError" and number == errno.EAGAIN:  # fork() over RLIMIT_NPROC
        return "process_limit"
    return _ERRNO_LIMITS.get(number)


def _classify(run: _RunIO, request: ExecutionRequest, limits: SandboxLimits,
              uid: int | None) -> ExecutionResult:
    stdout, stderr = run.text(run.stdout_r), run.text(run.stderr_r)
    status_records, status_malformed = parse_records(run.text(run.status_r), _STATUS_RECORDS)
    check_records, checks_malformed = parse_records(run.text(run.checks_r), _CHECK_RECORDS)
    results, results_malformed = parse_records(run.text(run.results_r), _RESULT_RECORDS)

    refused = [p for k, p in status_records if k == "N"]
    if refused:
        raise SandboxUnavailableError(
            f"{refused[0]}. The code sandbox needs namespaces (root, or CAP_SYS_ADMIN) to isolate "
            "programs properly; to accept the weaker seccomp fallback on this host set "
            "algorithm.sandbox_isolation=auto in the run config (SandboxConfig(isolation='auto'))"
            " (docs/rewards.md: threat model)")
    ours = [p for k, p in status_records + check_records if k == "X"]
    finals = [p for k, p in status_records if k == "S"]
    if status_malformed and not ours:
        ours = ["malformed record from the sandbox monitor"]
    if checks_malformed and not ours and not run.overflow:
        ours = ["malformed record from the sandbox's checker"]
    if ours or not finals:
        result = _failure(ours[0] if ours else "the sandbox monitor did not report", uid)
        return dataclasses.replace(result, stdout=stdout, stderr=stderr)
    final = finals[-1]
    exit_code, term_signal, cpu_s = final["exit_code"], final["signal"], float(final["cpu_s"])
    # The hard RLIMIT_CPU (soft + 1 s) ends a program that handles SIGXCPU with SIGKILL.
    cpu_exhausted = term_signal == signal.SIGXCPU or (
        term_signal == signal.SIGKILL and cpu_s >= limits.cpu_time_s)
    main_pid = final["pid"]

    test_passed = [False] * len(request.tests)
    tests_done = False
    for kind, payload in check_records:
        if kind == "T" and 0 <= payload[0] < len(test_passed):
            test_passed[payload[0]] = payload[1]
        tests_done = tests_done or kind == "D"
    call_records = [p for k, p in results if k == "R"]
    call_outcomes = None
    if len(call_records) == 1:
        call_outcomes = _call_outcomes(call_records[0], len(request.calls))
    malformed = results_malformed or len(call_records) > 1 or (
        call_records and call_outcomes is None)
    errors = [p for k, p in results if k == "E"]
    main_errors = [e for e in errors if e[0] == main_pid] or errors
    finished = any(k == "D" and p == main_pid for k, p in results)
    if request.calls and call_outcomes is None:
        call_outcomes = (None,) * len(request.calls)
    needs_harness = bool(request.tests or request.calls)

    status, detail = "ok", ""
    if run.overflow:
        status, detail = "output_limit", f"{run.overflow} exceeded {limits.max_output_bytes} bytes"
    elif final["killed"] == "timeout" or cpu_exhausted or run.host_gave_up:
        status, detail = "timeout", "cpu time" if cpu_exhausted else "wall time"
    elif final["oom_kills"] > 0:
        status, detail = "memory_limit", (f"the run's cgroup ({final['cgroup']}) ran out of "
                                          f"memory ({final['oom_kills']} processes killed)")
    elif malformed:
        status, detail = "runtime_error", _MALFORMED
    elif any(k == "P" for k, _ in results):
        status, detail = "parse_error", next(p for k, p in results if k == "P")
    elif main_errors and (exit_code != 0 or term_signal):
        _, name, number, hint = main_errors[0]
        status = _limit_from_exception(name, number, hint) or "runtime_error"
        detail = name
    elif term_signal:
        memory = "MemoryError" in stderr or "Cannot allocate memory" in stderr
        status = ("file_size_limit" if term_signal == signal.SIGXFSZ
                  else "memory_limit" if memory else "runtime_error")
        detail = f"killed by {_signal_name(term_signal)}"
    elif exit_code != 0:
        status, detail = "runtime_error", f"exit code {exit_code}"
    elif needs_harness and not finished:
        status, detail = "runtime_error", "the program ended before its tests finished"
    elif request.tests and not tests_done:
        status, detail = "runtime_error", "the tests did not finish (the checker was stopped)"
    return ExecutionResult(
        status=status, stdout=stdout, stderr=stderr, test_passed=tuple(test_passed),
        exit_code=exit_code if not term_signal else None, signal=term_signal or None,
        wall_time_s=float(final["wall_s"]), cpu_time_s=cpu_s,
        max_rss_bytes=final["max_rss_kb"] * 1024, isolation=final["isolation"], uid=uid,
        detail=detail,
        call_outcomes=tuple(call_outcomes or ()), cgroup=final["cgroup"])


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
