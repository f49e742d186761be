"""The sandbox server: a pre-forked, single-threaded process that runs untrusted programs.

`megatron_rl/rewards/sandbox.py` starts this file once per `Sandbox` as
`python -I -S -B sandbox_server.py SOCKET_FD` with a scrubbed environment, so it imports only the
standard library and never the package. For every run the host sends six pipe ends over the
socket; the server forks a *monitor* (root, host namespaces) which reads the job, creates fresh
network / mount / PID / IPC / UTS namespaces and forks the sandbox's *init* (PID 1 there). Init
mounts a read-only view of the root file system, a size-capped private tmpfs holding an empty
working directory, and a private /proc; applies resource limits; drops to an unprivileged per-run
uid; then forks the *candidate*, which runs the program in this already-initialised interpreter
(no interpreter start-up per run, which is why the sandbox is cheaper than a plain subprocess).
The monitor enforces the wall-clock limit and reports how the candidate ended; when init exits
(after the candidate) or is killed, the kernel kills everything else in its PID namespace, so
nothing a program starts can outlive it. Where namespaces are not permitted, a seccomp filter
that refuses non-Unix sockets replaces the network namespace and the monitor kills leftovers by
process group and uid (docs/rewards.md: what each mode protects against).

Wire format (all text lines, so that a hostile program cannot confuse a binary parser):
  control pipe (host -> monitor): 8-byte little-endian length + marshal-encoded job dict; then EOF
                                  (the host closing it) means "kill the candidate now".
  status pipe (monitor -> host):  "X <message>" on a setup failure, then one final
                                  "S exit_code signal killed cpu_s max_rss_kb isolation wall_s pid".
  results pipe (sandbox -> host):  "X <message>" setup failure, "P <exc>" the program did not
                                  compile, "E <pid> <exc> <errno>" uncaught exception,
                                  "T <i> <0|1> <exc>" function-test outcome, "D <pid>" the
                                  harness reached its end.
  init pipe (init -> monitor):    "W <candidate pid> <wait status>".
"""
import atexit
import builtins
import ctypes
import errno
import fcntl
import gc
import io
import marshal
import os
import resource
import select
import shutil
import signal
import socket
import struct
import sys
import time
import traceback

# --- Linux constants (include/uapi) not exposed by the Python 3.11 standard library ------------
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
SYS_MOUNT_SETATTR = 442  # same number on every architecture (unified syscall table, Linux 5.12)
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
SECCOMP_MODE_FILTER = 2

EXIT_SETUP_FAILED = 70  # init could not enter the sandbox; the program never ran
# Imported once here instead of in every run: what short test programs commonly import (and the
# codec socket addresses need). A fresh interpreter would import them from the same files.
PRELOAD = ("encodings.idna", "threading", "collections", "itertools", "functools", "heapq",
           "bisect", "math", "re", "string", "random", "typing", "dataclasses", "copy",
           "operator", "fractions", "decimal", "statistics", "json")
NAMESPACE_FLAGS = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p)
_libc.prctl.argtypes = (ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                        ctypes.c_ulong)
_libc.syscall.restype = ctypes.c_long


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)),
           f"mount {fstype or source} on {target}")


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


def _make_root_read_only() -> None:
    """Every existing mount becomes read-only in this mount namespace (the host is untouched)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY, 0, 0, 0)
    if _libc.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, ctypes.byref(attr),
                     ctypes.sizeof(attr)) == 0:
        return
    # Kernels before 5.12: remount each mount point read-only, one by one.
    with open("/proc/self/mountinfo") as f:
        mount_points = [line.split()[4] for line in f]
    for mount_point in mount_points:
        _libc.mount(None, mount_point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)


# --- seccomp fallback: refuse every socket family except AF_UNIX -----------------------------
# (audit arch, socket syscall number, has the x32 ABI whose numbers carry bit 30)
_SECCOMP_ARCHES = {"x86_64": (0xC000003E, 41, True), "aarch64": (0xC00000B7, 198, False)}
_IO_URING_SETUP = 425  # io_uring can open sockets without the socket syscall: refuse it too


def _socket_filter_program() -> bytes | None:
    """A classic-BPF seccomp program (struct sock_filter[]) or None on an unknown architecture."""
    arch = _SECCOMP_ARCHES.get(os.uname().machine)
    if arch is None:
        return None
    audit_arch, nr_socket, has_x32 = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, deny, kill = 0x7FFF0000, 0x00050000 | errno.EACCES, 0x80000000
    # (code, jump-if-true label, jump-if-false label, k); labels resolve to the three returns.
    program = [(ld, None, None, 4),                         # A = seccomp_data.arch
               (jeq, None, "kill", audit_arch),             # foreign ABI (e.g. int 0x80): kill
               (ld, None, None, 0)]                         # A = seccomp_data.nr
    if has_x32:
        program.append((jge, "deny", None, 0x40000000))
    program += [(jeq, None, "not_socket", nr_socket),
                (ld, None, None, 16),                       # A = low half of args[0] (family)
                (jeq, "allow", "deny", socket.AF_UNIX),
                ("not_socket", None, None, None),
                (jeq, "deny", "allow", _IO_URING_SETUP)]
    labels, code = {}, []
    for item in program:
        if isinstance(item[0], str):
            labels[item[0]] = len(code)
        else:
            code.append(item)
    labels.update(allow=len(code), deny=len(code) + 1, kill=len(code) + 2)
    code += [(ret, None, None, allow), (ret, None, None, deny), (ret, None, None, kill)]
    jump = lambda label, pc: 0 if label is None else labels[label] - pc - 1  # noqa: E731
    return b"".join(struct.pack("<HBBI", op, jump(jt, pc), jump(jf, pc), k)
                    for pc, (op, jt, jf, k) in enumerate(code))


_SOCKET_FILTER = _socket_filter_program()


def _install_socket_filter() -> None:
    if _SOCKET_FILTER is None:
        raise OSError(errno.ENOSYS, f"no seccomp socket filter for {os.uname().machine}")
    buffer = ctypes.create_string_buffer(_SOCKET_FILTER, len(_SOCKET_FILTER))
    fprog = struct.pack("<HxxxxxxQ", len(_SOCKET_FILTER) // 8, ctypes.addressof(buffer))
    fprog_buffer = ctypes.create_string_buffer(fprog, len(fprog))
    _check(_libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(fprog_buffer), 0, 0),
           "seccomp")


# --- inside the sandbox: init (PID 1) and the candidate (its only child) ----------------------
# Descriptors inside: 0 stdin, 1 stdout, 2 stderr, 3 results, 4 init -> monitor (init only).
SANDBOX_TMP, WORKDIR = "/tmp", "/tmp/work"


def _write_record(fd: int, line: str) -> None:
    data = (line.replace("\n", " ") + "\n").encode("utf-8", "backslashreplace")
    while data:
        data = data[os.write(fd, data):]


def _count_processes_of(uid: int) -> int:
    count = 0
    for name in os.listdir("/proc"):
        try:
            count += name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid
        except OSError:
            pass
    return count


def _apply_limits(job: dict) -> None:
    limits = job["limits"]
    cpu = max(1, int(limits["cpu_time_s"] + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at soft, SIGKILL at hard
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["num_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    num_processes = limits["num_processes"] + 1  # + the init process
    if job["uid"] is None:  # unprivileged host: the limit counts every process of our own uid
        num_processes += _count_processes_of(os.getuid())
    resource.setrlimit(resource.RLIMIT_NPROC, (num_processes, num_processes))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)


def _interpreter_dirs() -> list[str]:
    """Directories the program's interpreter needs: installation, environment, import path."""
    dirs = {sys.base_prefix, sys.prefix, os.path.dirname(os.path.realpath(sys.executable))}
    dirs.update(p for p in sys.path if os.path.isdir(p))
    dirs = {os.path.realpath(d) for d in dirs}
    return sorted(d for d in dirs if not any(d.startswith(o + "/") for o in dirs if o != d))


def _blocking_ancestor(path: str) -> str | None:
    """The outermost directory on `path` that other users cannot traverse (e.g. /root, 0700)."""
    current = "/"
    for part in path.strip("/").split("/"):
        current = os.path.join(current, part)
        if not os.stat(current).st_mode & 0o001:
            return current
    return None


def _directories_to_expose() -> dict[str, str]:
    """Interpreter directories the sandbox uid could not reach -> the directory to cover them
    with (computed once per server: ~1 ms of path walking)."""
    exposed = {}
    for path in _interpreter_dirs():
        cover = SANDBOX_TMP if path.startswith(SANDBOX_TMP + "/") else _blocking_ancestor(path)
        if cover is not None:
            exposed[path] = cover
    return exposed


_EXPOSED: dict[str, str] = {}  # set by main()


def _private_filesystem(job: dict) -> None:
    """Namespace mode: everything read-only; a fresh size-capped tmpfs on /tmp holding the empty
    working directory; a /proc showing only the sandbox. Directories the sandbox uid could not
    traverse (e.g. /root, 0700) but the interpreter lives under are covered by an empty
    read-only tmpfs into which only the interpreter's directories are bind-mounted back, at
    their own paths, so imports work and nothing else of that directory is visible."""
    # Opened before anything is covered, so each can still be reached to bind it back.
    dir_fds = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path in _EXPOSED}
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the host
    _make_root_read_only()
    _mount("sandbox", SANDBOX_TMP, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={job['limits']['tmpfs_bytes']},nr_inodes=4096,mode=0755")
    uid = job["uid"] if job["uid"] is not None else os.getuid()
    os.mkdir(WORKDIR, 0o700)
    os.chown(WORKDIR, uid, uid)
    covers = sorted(set(_EXPOSED.values()) - {SANDBOX_TMP})
    for cover in covers:
        _mount("sandbox", cover, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for path, fd in dir_fds.items():
        os.makedirs(path, 0o755, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        _mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    for cover in covers:
        _mount(None, cover, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    socket.sethostname("sandbox")


def _drop_privileges(uid: int | None) -> None:
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise OSError(errno.EPERM, f"still running as uid {os.geteuid()}, wanted {uid}")
    # No set-uid binary (su, ping, ...) can regain privileges from here on.
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def _redirect_fds(fds: list[int]) -> None:
    """The given descriptors onto 0, 1, 2, ...; every other descriptor closed."""
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in fds]
    for target, fd in enumerate(moved):
        os.dup2(fd, target)
    os.closerange(len(fds), resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def _enter_sandbox(job: dict, fds: list[int], isolation: str, workdir: str | None) -> None:
    """Apply every protection to this process (the future init and, by fork, the candidate)."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # not the server's handler
        os.setsid()  # no controlling terminal, own process group
        _redirect_fds(fds)
        if isolation == "namespaces":
            _private_filesystem(job)
        cwd = WORKDIR if isolation == "namespaces" else workdir
        os.chdir(cwd)
        _apply_limits(job)
        _drop_privileges(job["uid"])
        if isolation == "seccomp":
            _install_socket_filter()
        # Re-armed after the uid change (which clears it): dies with the monitor.
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except BaseException as exc:  # never run the program outside a complete sandbox
        try:
            _write_record(3, f"X sandbox setup failed: {type(exc).__name__}: {exc}")
        finally:
            os._exit(EXIT_SETUP_FAILED)
    os.environ.clear()
    os.environ.update(job["env"], HOME=cwd, TMPDIR=cwd, PWD=cwd)


def _run_init(candidate: int) -> None:
    """PID 1 of the sandbox: reaps orphans and reports the candidate's wait status. A program
    is never PID 1 itself, since the kernel drops default-action signals (SIGXCPU, a program's
    own kill()) sent to a namespace's init."""
    os.closerange(0, 4)  # EOF on the program's pipes must not wait for init
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == candidate:
            _write_record(4, f"W {candidate} {status}")
            os._exit(0)


def _fork_candidate() -> int:
    try:
        return os.fork()
    except OSError as exc:
        _write_record(3, f"X could not start the program: {exc}")
        os._exit(EXIT_SETUP_FAILED)


def _become_candidate() -> None:
    os.close(4)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(1, "w", closefd=False)), encoding="utf-8")
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.BufferedWriter(io.FileIO(2, "w", closefd=False)), encoding="utf-8",
        errors="backslashreplace", line_buffering=True)
    sys.argv = ["program.py"]


def _describe(exc: BaseException) -> str:
    number = exc.errno if isinstance(exc, OSError) and exc.errno is not None else 0
    return f"{type(exc).__name__} {number}"


def run_candidate(job: dict) -> int:
    """Run the program (and its function tests) as __main__; returns the exit status."""
    main_module = type(sys)("__main__")
    main_module.__builtins__ = builtins
    sys.modules["__main__"] = main_module
    try:
        code = compile(job["program"], "program.py", "exec")
    except (SyntaxError, ValueError, OverflowError) as exc:  # what compile() raises on bad source
        traceback.print_exception(exc, limit=0)
        _write_record(3, f"P {type(exc).__name__}")
        return 1
    exit_status = 0
    try:
        exec(code, main_module.__dict__)
    except SystemExit as exc:
        if job["tests"]:  # leaving before the tests run is a failure, never a pass
            _write_record(3, f"E {os.getpid()} SystemExit 0")
            return 1
        exit_status = _exit_status(exc)
    except BaseException as exc:
        _write_record(3, f"E {os.getpid()} {_describe(exc)}")  # first: printing may fail too
        _print_program_traceback(exc)
        return 1
    for index, test in enumerate(job["tests"]):
        try:
            exec(compile(test, f"test_{index}.py", "exec"), main_module.__dict__)
            _write_record(3, f"T {index} 1 -")
        except BaseException as exc:  # SystemExit inside a test is a failed test too
            _write_record(3, f"T {index} 0 {_describe(exc)}")
            _print_program_traceback(exc)
    sys.stdout.flush()
    _write_record(3, f"D {os.getpid()}")
    return exit_status


def _print_program_traceback(exc: BaseException) -> None:
    """The traceback as `python program.py` would print it: without this harness's frame."""
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


# --- the monitor -------------------------------------------------------------------------------
def _read_exactly(fd: int, size: int) -> bytes:
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            raise EOFError("control pipe closed before the whole job arrived")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _choose_isolation(job: dict) -> str:
    wanted = job["isolation"]
    if wanted in ("auto", "namespaces"):
        if _libc.unshare(NAMESPACE_FLAGS) == 0:
            return "namespaces"
        if wanted == "namespaces":
            err = ctypes.get_errno()
            raise OSError(err, f"unshare(namespaces) refused: {os.strerror(err)}; run as root "
                               "(or with CAP_SYS_ADMIN) or choose isolation='seccomp'")
    if _SOCKET_FILTER is None:
        raise OSError(errno.ENOSYS, "no network isolation possible: namespaces refused and no "
                                    f"seccomp filter for {os.uname().machine}")
    return "seccomp"


def _make_workdir(job: dict) -> str:
    path = os.path.join(job["workdir_root"], "mrl-sandbox-" + os.urandom(8).hex())
    os.mkdir(path, 0o700)
    if job["uid"] is not None:
        os.chown(path, job["uid"], job["uid"])
    return path


def _kill_leftovers(init: int, uid: int | None) -> None:
    """Seccomp mode has no PID namespace. The monitor is a child subreaper, so once init is gone
    every process the run left is (or will be) the monitor's child: kill the process group and,
    if anything is left, every process of the run's uid; then reap until none is left."""
    try:
        os.killpg(init, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return  # nothing escaped
    if uid is not None:
        helper = os.fork()
        if helper == 0:  # kill(-1) as the sandbox uid reaches exactly that uid's processes
            try:
                os.setresuid(uid, uid, uid)
                for _ in range(20):  # again, in case one was mid-fork during a sweep
                    os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                pass
            finally:
                os._exit(0)
        os.waitpid(helper, 0)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.005)
        except ChildProcessError:
            return


def _candidate_exited(child: int, pidfd: int | None, ready: list[int]) -> bool:
    if pidfd is not None:
        return pidfd in ready
    return os.waitid(os.P_PID, child, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _wait_for_candidate(child: int, control: int, wall_time_s: float) -> tuple[str, int, object]:
    """Wait for the candidate, killing it at the deadline or when the host closes `control`."""
    deadline = time.monotonic() + wall_time_s
    try:
        pidfd = os.pidfd_open(child)
    except OSError:  # Linux < 5.3: poll for the exit instead
        pidfd = None
    watched = [control] if pidfd is None else [pidfd, control]
    poll_s = None if pidfd is not None else 0.005
    killed = "-"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            killed = "timeout"
            break
        ready, _, _ = select.select(watched, [], [], min(remaining, poll_s or remaining))
        if _candidate_exited(child, pidfd, ready):
            break
        if control in ready and not os.read(control, 4096):
            killed = "host"
            break
    if killed != "-":
        os.kill(child, signal.SIGKILL)  # PID 1 of the namespace: takes every process with it
    _, status, usage = os.wait4(child, 0)
    if pidfd is not None:
        os.close(pidfd)
    return killed, status, usage


def _candidate_outcome(init_r: int, init_status: int) -> tuple[int, int, str]:
    """(exit code, signal, candidate pid) from init's report, else from init's own status."""
    os.set_blocking(init_r, False)
    try:
        words = os.read(init_r, 4096).decode().split()
    except BlockingIOError:
        words = []
    pid, status = (words[1], int(words[2])) if words[:1] == ["W"] else ("0", init_status)
    exit_code = os.waitstatus_to_exitcode(status)
    return (exit_code, 0, pid) if exit_code >= 0 else (0, -exit_code, pid)


def monitor(fds: list[int]) -> dict | None:
    """Runs in the forked monitor and never returns there; returns the job in the candidate."""
    stdin_r, stdout_w, stderr_w, control_r, status_w, results_w = fds
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        (size,) = struct.unpack("<Q", _read_exactly(control_r, 8))
        job = marshal.loads(_read_exactly(control_r, size))
        isolation = _choose_isolation(job)
        workdir = None
        if isolation == "seccomp":
            workdir = _make_workdir(job)
            _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "child subreaper")
        init_r, init_w = os.pipe()
        started = time.monotonic()
        init = os.fork()
        if init == 0:
            for fd in (control_r, status_w, init_r):
                os.close(fd)
            _enter_sandbox(job, [stdin_r, stdout_w, stderr_w, results_w, init_w], isolation,
                           workdir)
            candidate = _fork_candidate()
            if candidate == 0:
                _become_candidate()
                return job
            _run_init(candidate)
        for fd in (stdin_r, stdout_w, stderr_w, results_w, init_w):
            os.close(fd)
        killed, status, usage = _wait_for_candidate(init, control_r, job["limits"]["wall_time_s"])
        wall_s = time.monotonic() - started
        code, sig, pid = _candidate_outcome(init_r, status)
        if isolation == "seccomp":
            _kill_leftovers(init, job["uid"])
            shutil.rmtree(workdir, ignore_errors=True)
        cpu_s = usage.ru_utime + usage.ru_stime
        _write_record(status_w, f"S {code} {sig} {killed} {cpu_s:.4f} {usage.ru_maxrss} "
                                f"{isolation} {wall_s:.4f} {pid}")
    except BaseException as exc:
        try:
            _write_record(status_w, f"X {type(exc).__name__}: {exc}")
        finally:
            os._exit(1)
    os._exit(0)


def _reap_monitors(signum, frame) -> None:
    """Waiting (rather than ignoring SIGCHLD) adds each run's CPU time to this server's
    children times in /proc/<pid>/stat, which is how benchmarks/rewards.py measures it."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def serve(sock: socket.socket) -> dict | None:
    """Fork a monitor per request until the host closes the socket; returns only in candidates."""
    signal.signal(signal.SIGCHLD, _reap_monitors)
    while True:
        message, fds, _, _ = socket.recv_fds(sock, 16, 6)
        if not message:
            return None
        if len(fds) != 6:
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:
            sock.close()
            return monitor(fds)
        for fd in fds:
            os.close(fd)


def finish_candidate(exit_status: int) -> None:
    """What interpreter shutdown does that a program can observe (non-daemon threads joined,
    atexit handlers, flushed streams), then exit without tearing down the inherited server heap:
    a full finalisation would touch (and copy-on-write) every page, tripling the run's cost."""
    threading = sys.modules.get("threading")
    if threading is not None:
        threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            exit_status = exit_status or 120  # as CPython does when the final flush fails
    os._exit(exit_status)


def main() -> int:
    sock = socket.socket(fileno=int(sys.argv[1]))
    if "--site" in sys.argv[2:]:
        import site  # programs may import the interpreter's installed packages
        site.main()
    for name in PRELOAD:
        __import__(name)
    _EXPOSED.update(_directories_to_expose())
    gc.freeze()  # the server's objects stay out of the candidates' collections (copy-on-write)
    job = serve(sock)
    if job is None:
        return 0
    finish_candidate(run_candidate(job))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
