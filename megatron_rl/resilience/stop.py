"""The run's stop on SIGTERM / SIGINT (docs/fault_tolerance.md, "Graceful stop").

The first signal asks the run to stop (`RUN_STOP`). Every wait on the driver looks at the request
at least once a second: a wait for generation (the step's groups, validation, an idle engine) is
abandoned at once, a trainer call under way (train step, weight sync, checkpoint) gets until
train.graceful_stop_timeout_s after the signal to finish, and an abandoned wait raises
`StopRequested`. The driver then writes a checkpoint if the trainer is idle and healthy, and ends
with 128 + the signal.

The second signal stops at once, whatever the driver is blocked on: every process the driver
started (its local Ray cluster, the engines, the reward workers) is SIGKILLed, one line is
printed and the driver exits with 128 + the signal, without unwinding. Ray ends the run's actors
on other nodes when their owner, the driver, is gone; the last committed checkpoint stands.

The signals are read by a thread of this module (signal.set_wakeup_fd), not acted on in a Python
signal handler: Python runs handlers only on the main thread, and an exception a handler raises
while the main thread is inside ray.get is held by Ray until the call returns (Ray 2.60: a
SystemError once the get times out), so a handler cannot end a wait in Ray.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time

SIGNALS = (signal.SIGTERM, signal.SIGINT)
WAIT_SLICE_S = 1.0  # a wait on the driver looks at the stop request at least this often


class StopRequested(BaseException):
    """The run is stopping (first SIGTERM / SIGINT) and a wait was abandoned. A BaseException,
    like KeyboardInterrupt: no `except Exception` retry loop may swallow it. `no_checkpoint`: the
    abandoned wait was a trainer call (the ranks are still inside it) or came in the middle of
    an optimizer step (`step_under_way`), so the state is not one a checkpoint may hold."""

    def __init__(self, message: str, *, no_checkpoint: bool = False):
        super().__init__(message)
        self.no_checkpoint = no_checkpoint
        self.signal = RUN_STOP.signal or signal.SIGTERM  # the exit status is 128 + it


class RunStop:
    """This process's stop request (signals are per process, so there is one: `RUN_STOP`)."""

    def __init__(self) -> None:
        self.signal: signal.Signals | None = None
        self._deadline: float | None = None  # trainer calls under way end by then
        self.grace_s = 300.0

    def reset(self, grace_s: float = 300.0) -> None:
        self.signal, self._deadline, self.grace_s = None, None, grace_s

    def request(self, sig: signal.Signals) -> None:
        if self.signal is None:
            self._deadline = time.monotonic() + self.grace_s
            self.signal = sig

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def abandon_if_requested(self, what: str) -> None:
        """A wait for generation: raise StopRequested as soon as a stop is requested."""
        if self.signal is not None:
            raise StopRequested(f"{what}: abandoned for the {self.signal.name}")

    def abandon_if_past_grace(self, what: str) -> None:
        """A call to the run's actors under way (a trainer step, a weight sync, an engine
        start): raise StopRequested once the stop's grace period (train.
        graceful_stop_timeout_s) is over. The trainer group marks its own calls
        `no_checkpoint`."""
        if self._deadline is not None and time.monotonic() > self._deadline:
            raise StopRequested(f"{what}: abandoned, still running {self.grace_s:.0f} s after "
                                f"the {self.signal.name} (train.graceful_stop_timeout_s)")

    @contextlib.contextmanager
    def finishing(self):
        """The stop's own waits (the final checkpoint): bounded by their own timeouts, not by
        the grace period of the wait the signal interrupted."""
        deadline, self._deadline = self._deadline, None
        try:
            yield
        finally:
            self._deadline = deadline


RUN_STOP = RunStop()


@contextlib.contextmanager
def step_under_way():
    """An optimizer step between taking its groups and publishing its weights: a stop that
    abandons a wait in here leaves no checkpoint (its groups are out of the rollout manager, its
    ledger line written, maybe the trainer a step ahead of the driver)."""
    try:
        yield
    except StopRequested as stopped:
        stopped.no_checkpoint = True
        raise


class GracefulStop:
    """SIGTERM / SIGINT for the length of a run: the first sets `RUN_STOP` (module docstring),
    the second kills the run's processes and exits. Use on the main thread."""

    def __init__(self, *, grace_s: float = 300.0) -> None:
        self.grace_s = grace_s
        self._previous: dict = {}
        self._previous_fd = -1
        self._reader: socket.socket | None = None
        self._writer: socket.socket | None = None
        self._closing = False

    @property
    def requested(self) -> signal.Signals | None:
        return RUN_STOP.signal

    def __enter__(self) -> "GracefulStop":
        RUN_STOP.reset(self.grace_s)
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach the main thread only: they stay its owner's
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(),
                                                 warn_on_full_buffer=False)
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, _wake_only)
        threading.Thread(target=self._watch, name="stop-signals", daemon=True).start()
        return self

    def install(self) -> None:
        """Take the signals back (starting Ray replaces the SIGTERM handler with one that
        raises SystemExit)."""
        for sig in self._previous:  # empty off the main thread
            signal.signal(sig, _wake_only)

    def __exit__(self, *exc) -> None:
        self._closing = True
        if self._writer is not None:
            signal.set_wakeup_fd(self._previous_fd)
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._writer.close()  # ends _watch
        RUN_STOP.reset()

    def _watch(self) -> None:
        reader = self._reader
        with reader:
            while True:
                try:
                    data = reader.recv(64)
                except OSError:
                    return
                if not data or self._closing:
                    return
                for number in data:
                    if number in SIGNALS:
                        self._on_signal(signal.Signals(number))

    def _on_signal(self, sig: signal.Signals) -> None:
        from megatron_rl.console import notice

        if RUN_STOP.requested:  # kill first: writing the line may block (a full stderr pipe)
            hard_stop(128 + sig, line=f"second {sig.name}: stopping now, without a checkpoint "
                      "(every process of the run is killed; the last checkpoint stands)")
        RUN_STOP.request(sig)
        notice(f"{sig.name}: abandoning the wait for generation (a trainer step under way "
               f"gets {RUN_STOP.grace_s:.0f} s), then writing a checkpoint and stopping (send "
               "it again to stop at once)")


def _wake_only(signum, frame) -> None:
    """The Python-level handler: nothing (the stop thread reads the signal from the wakeup
    fd); it must exist so that the interpreter's C handler writes that fd."""


_WRITE_S = 1.0  # how long the hard stop lets its last line and the flushes take


def hard_stop(status: int, *, line: str | None = None) -> None:
    """SIGKILL every descendant of this process (a new one started meanwhile is caught by the
    next sweep), then exit with `status` at once, from any thread. The operator's `line` and
    the flushes come after the kill and may take _WRITE_S at most: stderr may be a pipe that is
    full and not read (or held by a thread blocked on it), and the stop must not wait on it."""
    import psutil

    me = psutil.Process()
    for _ in range(3):
        killed = []
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if child.status() != psutil.STATUS_ZOMBIE:
                    child.kill()
                    killed.append(child)
        if not killed:
            break
        psutil.wait_procs(killed, timeout=1.0)

    def write() -> None:
        if line is not None:
            from megatron_rl.console import notice

            notice(line)
        sys.stderr.flush()
        sys.stdout.flush()

    writer = threading.Thread(target=write, name="hard-stop-line", daemon=True)
    writer.start()
    writer.join(_WRITE_S)  # os._exit ends the process also while the writer is blocked
    os._exit(status)
