"""The rollout manager's event loop on a thread of its own, and the driver's calls into it.

The driver is synchronous (Ray calls, the trainer step); the rollout manager and its HTTP clients
are asyncio. Every call the driver makes into the manager goes through `RolloutLoop`, so one
place says how a synchronous caller waits on the loop: never without a bound. Nothing on the loop
blocks, so a moment of the manager's state (`run`) or a short coroutine (`call`: stopping the
manager, closing a client, a round of liveness probes) is back within `MOMENT_S`, and one that is
not is cancelled and raised. A wait for generation, which may take as long as generating takes,
is not a `call`: the driver waits on `submit`'s future in slices while it checks the generators
(GeneratorHealth.wait) and a stop request (resilience/stop.py).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
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

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

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
