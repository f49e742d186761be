"""The rollout manager's event loop on a thread of its own, and the driver's calls into it.

The driver is synchronous (Ray calls, the trainer step); the rollout manager and its HTTP clients
are asyncio. Every call the driver makes into the manager goes through `RolloutLoop`, so one
place says how a synchronous caller waits on the loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class RolloutLoop:
    """An asyncio loop running forever on a daemon thread until `stop`."""

    def __init__(self, name: str = "rollouts"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run a coroutine on the loop and wait for its result."""
        return self.submit(coroutine).result(timeout)

    def run(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run a plain function on the loop's thread (one moment of the manager's state)."""
        async def on_loop():
            return fn()

        return self.call(on_loop(), timeout)

    def stop(self, *, closing=(), join_timeout_s: float = 30.0) -> None:
        """Close the `closing` clients on the loop (their sessions belong to it), then stop."""
        for client in closing:
            self.call(client.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=join_timeout_s)
