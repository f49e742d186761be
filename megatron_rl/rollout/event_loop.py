"""The rollout manager's event loop on a thread of its own, and the driver's calls into it.

The driver is synchronous (Ray calls, the trainer step); the rollout manager and its HTTP clients
are asyncio. Every call the driver makes into the manager goes through `RolloutLoop`, so one
place says how a synchronous caller waits on the loop: never without a bound. Nothing on the loop
blocks, so a moment of the manager's state (`run`) or a short coroutine (`call`: stopping the
manager, closing a client, a round of liveness probes) is back within `MOMENT_S`, and one that is
not is cancelled and raised. A wait for generation, which may take as long as generating takes,
is not a `call`: the driver waits on `submit`'s future in slices while it checks the generators
(GeneratorHealth.wait) and a stop request (resilience/stop.py).

A wait the driver gives up (a stop, an error) ends with `abandon`, never a bare `future.cancel()`:
a cancel from the driver's thread only reaches the loop later, and a coroutine that completed in
between (a `take` that removed its groups from the buffer, the sampler and the gate updated)
would put its result into a cancelled future, lost. `abandon` cancels it on the loop and hands
a result that nobody will read to the `put_back` given to `submit`.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Longest wait for a call on the loop: the longest thing run as one is a round of liveness probes
# (rollout/manager.py PROBE_TIMEOUT_S, run concurrently), or closing a client's connections.
MOMENT_S = 60.0


class RolloutLoop:
    """An asyncio loop running forever on a daemon thread until `stop`."""

    def __init__(self, name: str = "rollouts"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T], *,
               put_back: Callable[[T], None] | None = None) -> "Submitted":
        """Start `coroutine` on the loop; the future gives its result to this thread. Cancelling
        the future cancels the coroutine on the loop. `put_back(result)`, run on the loop, undoes
        a result that the coroutine produced but that its caller gave up on (`abandon`), such as
        the groups of a `RolloutManager.take`."""
        future = Submitted(put_back)
        self.loop.call_soon_threadsafe(self._start, coroutine, future)
        return future

    def _start(self, coroutine: Coroutine, future: "Submitted") -> None:
        if future.cancelled():  # given up before it started
            coroutine.close()
            future.ended.set()
            return
        task = self.loop.create_task(coroutine)
        task.add_done_callback(functools.partial(_hand_over, future))

        def cancel_on_loop(done: Submitted) -> None:  # a cancel from the caller's thread
            if done.cancelled():
                self.loop.call_soon_threadsafe(task.cancel)  # a no-op once the task is done

        future.add_done_callback(cancel_on_loop)

    def abandon(self, future: "Submitted", timeout: float = MOMENT_S) -> None:
        """Give up on a `submit` whose result was not read (call it once, instead of
        `future.cancel()`): the coroutine is cancelled on the loop, and a result it had produced
        already goes to its `put_back`. Returns once the coroutine has ended, so that what the
        caller does next (a checkpoint on a stop) sees its state whole; a loop blocked past
        `timeout` is left to the next call to report."""
        if not future.cancel() and future.put_back is not None \
                and future.exception(timeout=0) is None:
            # Handed over before the cancel: the result is in the future, and nobody reads it.
            self.run(lambda: future.put_back(future.result(timeout=0)), timeout)
        future.ended.wait(timeout)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = MOMENT_S) -> T:
        """Run a coroutine on the loop and wait for its result, at most `timeout` seconds (then
        it is cancelled and TimeoutError raised)."""
        name = getattr(coroutine, "__qualname__", repr(coroutine))
        future = self.submit(coroutine)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done():  # the coroutine's own TimeoutError
                raise
            future.cancel()
            raise TimeoutError(f"the rollout event loop did not finish {name} within "
                               f"{timeout:.0f} s (a blocked loop thread or a call that should "
                               "have been a sliced wait)") from None
        except BaseException:
            future.cancel()  # a stop: nothing waits for the result any more
            raise

    def run(self, fn: Callable[[], T], timeout: float = MOMENT_S) -> T:
        """Run a plain function on the loop's thread (one moment of the manager's state)."""
        async def on_loop():
            return fn()

        on_loop.__qualname__ = getattr(fn, "__qualname__", repr(fn))
        return self.call(on_loop(), timeout)

    def stop(self, *, closing=(), join_timeout_s: float = 30.0) -> None:
        """Close the `closing` clients on the loop (their sessions belong to it), then stop."""
        for client in closing:
            self.call(client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=join_timeout_s)


class Submitted(concurrent.futures.Future):
    """`RolloutLoop.submit`'s future. `put_back` undoes a result nobody will read (or None);
    `ended` is set once the coroutine has ended on the loop and its result was handed over, or
    put back."""

    def __init__(self, put_back: Callable[[Any], None] | None):
        super().__init__()
        self.put_back = put_back
        self.ended = threading.Event()


def _hand_over(future: Submitted, task: asyncio.Task) -> None:
    """The task's outcome into the caller's future, on the loop. A caller that cancelled the
    future while the task completed gets nothing: its result goes to `put_back`."""
    try:
        if task.cancelled():
            future.cancel()
        elif task.exception() is not None:
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # given up meanwhile
                future.set_exception(task.exception())
        else:
            result = task.result()
            try:
                future.set_result(result)
            except concurrent.futures.InvalidStateError:  # cancelled as the task completed
                if future.put_back is not None:
                    future.put_back(result)
    finally:
        future.ended.set()
