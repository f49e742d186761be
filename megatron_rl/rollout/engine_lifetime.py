"""An engine's processes live no longer than the process that launched it, also when that process
is SIGKILLed (a Ray actor killed by hand, with its driver or with its node): the kernel does the
watching (PR_SET_PDEATHSIG), at every level of the server's process tree.

- The launching process starts the server (`popen`) from one thread that lives as long as the
  process: the kernel signals a child when the *thread* that forked it ends, and a thread pool or
  a Ray threaded actor may end the thread that happened to call `launch`.
- The server process, first thing (`tie_to_launcher`), asks for SIGKILL at its launcher's death,
  then checks that its parent is still the launcher (LAUNCHER_PID_ENV). A launcher that died
  before that (the server was still importing) is caught by the check, and the server exits.
  It then names itself as the launcher of its own children (the forkserver, which does the same).
- Every process forked inside the server or its forkserver (SGLang's scheduler and detokenizer) is
  tied the same way from its first instruction after the fork (`tie_forked_children`); SGLang's
  own PR_SET_PDEATHSIG in those children comes a moment later.

So SIGKILL of the launcher ends the server, whose death ends its children, whatever state they are
in (SIGKILL also ends a SIGSTOPped process). A server started without LAUNCHER_PID_ENV (by hand)
is not tied to its parent; its children are tied to it all the same.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading

LAUNCHER_PID_ENV = "MEGATRON_RL_ENGINE_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1
# Looked up once, here: a child just forked from a threaded process should not enter the dynamic
# loader (another thread may have held its lock at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None


def _ask_kill_at_parent_death() -> None:
    if _prctl is None:
        return
    if _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")


def tie_to_launcher() -> None:
    """In a process started by `popen` (or by a process that called this): SIGKILL at the
    launcher's death, and exit now if it has already died. Then this process is the launcher
    that its own spawned children (LAUNCHER_PID_ENV) tie themselves to."""
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is not None:
        _ask_kill_at_parent_death()
        if os.getppid() != int(launcher):  # re-parented: the launcher died before the prctl
            os._exit(1)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())


_forking_pid: int | None = None


def _note_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _tie_forked_child() -> None:
    _ask_kill_at_parent_death()
    if os.getppid() != _forking_pid:
        os._exit(1)


def tie_forked_children() -> None:
    """Every process os.fork()ed from this one from now on (multiprocessing's fork and
    forkserver start methods) gets SIGKILL at its parent's death from its first instruction."""
    os.register_at_fork(before=_note_forking_pid, after_in_child=_tie_forked_child)


class _LaunchThread:
    """The one thread of this process that starts engine processes (see the module docstring)."""

    def __init__(self):
        self.pid = os.getpid()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="engine-launcher", daemon=True).start()

    def _serve(self) -> None:
        while True:
            future, args, kwargs = self._requests.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(subprocess.Popen(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 (handed to the caller)
                    future.set_exception(exc)

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._requests.put((future, args, kwargs))
        return future.result()


_launch_thread: _LaunchThread | None = None
_launch_thread_lock = threading.Lock()


def popen(command: list[str], *, env: dict[str, str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen(command, env=env, **kwargs) from this process's launch thread, with
    LAUNCHER_PID_ENV set for the child's `tie_to_launcher`."""
    global _launch_thread
    with _launch_thread_lock:
        # A forked copy of this process has the object but not its thread: start its own.
        if _launch_thread is None or _launch_thread.pid != os.getpid():
            _launch_thread = _LaunchThread()
        launcher = _launch_thread
    return launcher.popen(command, env={**env, LAUNCHER_PID_ENV: str(os.getpid())}, **kwargs)
