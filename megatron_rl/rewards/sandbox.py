"""Host side of the code-execution sandbox: limits, typed requests and results, and `Sandbox`.

`Sandbox` owns one pre-forked sandbox server (sandbox_server.py, a single-threaded process started
once) and bounds how many programs run at once. Each run creates six pipes, hands the far ends to
the server, sends the job down the control pipe and then multiplexes stdin / stdout / stderr /
results / status here with output caps, so a program printing gigabytes costs the host at most
`max_output_bytes` before it is killed. The server does the privileged work (namespaces, mounts,
rlimits, the uid change) in processes it forks, never in this possibly multi-threaded, large
process. Every concurrent run gets its own unprivileged uid so that RLIMIT_NPROC (counted per real
uid, not enforced for root) bounds each run separately. docs/rewards.md explains the limits and
the isolation modes.
"""
from __future__ import annotations

import dataclasses
import errno
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SERVER_PATH = Path(__file__).with_name("sandbox_server.py")
ISOLATIONS = ("auto", "namespaces", "seccomp")
STATUSES = ("ok", "runtime_error", "timeout", "memory_limit", "output_limit", "process_limit",
            "file_size_limit", "parse_error", "sandbox_error")
DEFAULT_ENV = (("PATH", "/usr/local/bin:/usr/bin:/bin"), ("LANG", "C.UTF-8"))
# Not used by useradd (UID_MAX 60000) nor by systemd's DynamicUser= range (61184-65519).
DEFAULT_UID_RANGE = (60100, 61100)

_STDERR_KEEP_BYTES = 64 << 10
_HOST_GRACE_S = 5.0     # the monitor enforces wall time; the host only backs it up
_DRAIN_AFTER_STATUS_S = 1.0
_EXIT_SETUP_FAILED = 70
_ERRNO_LIMITS = {errno.EFBIG: "file_size_limit", errno.ENOSPC: "file_size_limit"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SandboxLimits:
    """Per-run limits. Memory is address space per process (RLIMIT_AS): a run can use at most
    num_processes * memory_bytes, plus tmpfs_bytes for files in its working directory."""

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
    # "auto": namespaces where permitted, else the seccomp socket filter.
    isolation: str = "auto"
    uid_range: tuple[int, int] = DEFAULT_UID_RANGE
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


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ExecutionRequest:
    """A program, its stdin, and optionally function tests (Python snippets run after the program
    in its namespace, HumanEval style: each passes if it raises nothing)."""

    program: str
    stdin: str = ""
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

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class _UidAllocator:
    """Process-wide: concurrent runs (of any Sandbox in this process) never share a uid."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_use: set[int] = set()
        self._rng = random.Random()

    def acquire(self, uid_range: tuple[int, int]) -> int:
        with self._lock:
            lo, hi = uid_range
            for _ in range(64):  # random, so that other processes' sandboxes rarely collide
                uid = self._rng.randrange(lo, hi)
                if uid not in self._in_use:
                    self._in_use.add(uid)
                    return uid
            free = sorted(set(range(lo, hi)) - self._in_use)
            if not free:
                raise RuntimeError(f"all uids of SandboxConfig.uid_range {uid_range} are in use; "
                                   "widen it to at least num_workers uids")
            self._in_use.add(free[0])
            return free[0]

    def release(self, uid: int) -> None:
        with self._lock:
            self._in_use.discard(uid)


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

    # --- public API ---------------------------------------------------------------------------
    def run(self, program: str, *, stdin: str = "", tests: Sequence[str] = (),
            limits: SandboxLimits | None = None) -> ExecutionResult:
        return self.execute(ExecutionRequest(program=program, stdin=stdin, tests=tuple(tests),
                                             limits=limits))

    def execute(self, request: ExecutionRequest) -> ExecutionResult:
        limits = request.limits or self.config.limits
        with self._slots:
            uid = _UIDS.acquire(self.config.uid_range) if self._privileged else None
            try:
                return self._execute(request, limits, uid)
            finally:
                if uid is not None:
                    _UIDS.release(uid)

    def map(self, requests: Sequence[ExecutionRequest]) -> list[ExecutionResult]:
        """Run many requests concurrently (num_workers at a time); results in request order."""
        with self._server_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.config.num_workers,
                                                    thread_name_prefix="sandbox")
            executor = self._executor
        return list(executor.map(self.execute, requests))

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
        job = {"program": request.program, "tests": list(request.tests),
               "limits": dataclasses.asdict(limits), "uid": uid,
               "isolation": self.config.isolation, "workdir_root": self.config.workdir_root,
               "env": dict(self.config.env)}
        payload = marshal.dumps(job)
        return struct.pack("<Q", len(payload)) + payload

    def _execute(self, request: ExecutionRequest, limits: SandboxLimits,
                 uid: int | None) -> ExecutionResult:
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        stderr_r, stderr_w = os.pipe()
        control_r, control_w = os.pipe()
        status_r, status_w = os.pipe()
        results_r, results_w = os.pipe()
        far_ends = [stdin_r, stdout_w, stderr_w, control_r, status_w, results_w]
        run = _RunIO(stdin_w=stdin_w, stdout_r=stdout_r, stderr_r=stderr_r, control_w=control_w,
                     status_r=status_r, results_r=results_r, limits=limits)
        try:
            self._send_to_server(far_ends)
        except OSError as exc:
            run.close()
            return _failure(f"could not reach the sandbox server: {exc}", uid)
        finally:
            for fd in far_ends:
                os.close(fd)
        try:
            _write_all(control_w, self._job(request, limits, uid))
        except OSError as exc:
            run.close()
            return _failure(f"could not hand the job to the sandbox server: {exc}", uid)
        run.pump(request.stdin.encode())
        return _classify(run, request, limits, uid)


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

    def __init__(self, *, stdin_w: int, stdout_r: int, stderr_r: int, control_w: int,
                 status_r: int, results_r: int, limits: SandboxLimits) -> None:
        self.stdin_w, self.control_w, self.status_r = stdin_w, control_w, status_r
        self.limits = limits
        self.buffers = {stdout_r: bytearray(), stderr_r: bytearray(), status_r: bytearray(),
                        results_r: bytearray()}
        self.keep = {stdout_r: limits.max_output_bytes, stderr_r: _STDERR_KEEP_BYTES,
                     status_r: 1 << 16, results_r: 1 << 20}
        self.totals = dict.fromkeys(self.buffers, 0)
        self.stdout_r, self.stderr_r, self.results_r = stdout_r, stderr_r, results_r
        self.overflow = ""
        self.host_gave_up = False

    def kill(self) -> None:
        if self.control_w >= 0:  # EOF on the control pipe: the monitor kills the candidate
            os.close(self.control_w)
            self.control_w = -1

    def close(self) -> None:
        """Release every descriptor when the run could not start."""
        self.kill()
        for fd in [self.stdin_w, *self.buffers]:
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

    def pump(self, stdin: bytes) -> None:
        """Feed stdin and drain every output until the run is over (or the host gives up)."""
        poller = select.poll()
        open_fds = set(self.buffers)
        for fd in open_fds:
            poller.register(fd, select.POLLIN)
        pending = memoryview(stdin)
        if pending:
            os.set_blocking(self.stdin_w, False)
            poller.register(self.stdin_w, select.POLLOUT)
            open_fds.add(self.stdin_w)
        else:
            os.close(self.stdin_w)
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
                if fd == self.stdin_w:
                    try:
                        pending = pending[os.write(fd, pending[:1 << 16]):]
                    except BrokenPipeError:
                        pending = pending[:0]
                    done = not pending
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


def _parse_records(text: str) -> list[list[str]]:
    return [line.split(" ") for line in text.splitlines() if line]


def _limit_from_exception(name: str, number: int) -> str | None:
    if name == "MemoryError":
        return "memory_limit"
    if name == "BlockingIOError" and number == errno.EAGAIN:  # fork() over RLIMIT_NPROC
        return "process_limit"
    return _ERRNO_LIMITS.get(number)


def _classify(run: _RunIO, request: ExecutionRequest, limits: SandboxLimits,
              uid: int | None) -> ExecutionResult:
    status_records = _parse_records(run.text(run.status_r))
    results = _parse_records(run.text(run.results_r))
    stdout, stderr = run.text(run.stdout_r), run.text(run.stderr_r)
    setup_errors = [" ".join(r[1:]) for r in status_records + results if r[0] == "X"]
    finals = [r for r in status_records if r[0] == "S" and len(r) == 9]
    if setup_errors or not finals:
        detail = setup_errors[0] if setup_errors else "the sandbox monitor did not report"
        result = _failure(detail, uid)
        return dataclasses.replace(result, stdout=stdout, stderr=stderr)
    code, sig, killed, cpu_s, rss_kb, isolation, wall_s, main_pid = finals[-1][1:]
    exit_code, term_signal, cpu_s = int(code), int(sig), float(cpu_s)
    # The hard RLIMIT_CPU (soft + 1 s) ends a program that handles SIGXCPU with SIGKILL.
    cpu_exhausted = term_signal == signal.SIGXCPU or (
        term_signal == signal.SIGKILL and cpu_s >= limits.cpu_time_s)

    test_passed = [False] * len(request.tests)
    seen = set()
    for record in results:
        if record[0] == "T" and len(record) >= 3 and record[1].isdigit():
            index = int(record[1])
            if index < len(test_passed) and index not in seen:  # first report wins
                seen.add(index)
                test_passed[index] = record[2] == "1"
    errors = [r for r in results if r[0] == "E" and len(r) >= 4]
    main_errors = [r for r in errors if r[1] == main_pid] or errors
    finished = any(r[0] == "D" and r[1:2] == [main_pid] for r in results)

    status, detail = "ok", ""
    if run.overflow:
        status, detail = "output_limit", f"{run.overflow} exceeded {limits.max_output_bytes} bytes"
    elif killed == "timeout" or cpu_exhausted or run.host_gave_up:
        status, detail = "timeout", "cpu time" if cpu_exhausted else "wall time"
    elif any(r[0] == "P" for r in results):
        status, detail = "parse_error", next(r[1] for r in results if r[0] == "P")
    elif main_errors and (exit_code != 0 or term_signal):
        name, number = main_errors[0][2], int(main_errors[0][3])
        status = _limit_from_exception(name, number) or "runtime_error"
        detail = name
    elif term_signal:
        memory = "MemoryError" in stderr or "Cannot allocate memory" in stderr
        status = ("file_size_limit" if term_signal == signal.SIGXFSZ
                  else "memory_limit" if memory else "runtime_error")
        detail = f"killed by {signal.Signals(term_signal).name}"
    elif exit_code != 0:
        status, detail = "runtime_error", f"exit code {exit_code}"
    elif request.tests and not finished:
        status, detail = "runtime_error", "the program ended before its tests finished"
    return ExecutionResult(
        status=status, stdout=stdout, stderr=stderr, test_passed=tuple(test_passed),
        exit_code=exit_code if not term_signal else None, signal=term_signal or None,
        wall_time_s=float(wall_s), cpu_time_s=cpu_s, max_rss_bytes=int(rss_kb) * 1024,
        isolation=isolation, uid=uid, detail=detail)

