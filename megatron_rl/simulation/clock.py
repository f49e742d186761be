"""The simulated clock: model time runs `time_scale` times faster than wall time, so that a
32k-token generation of several model minutes takes a fraction of a wall second while the real
control plane, which waits on wall time (time.monotonic, asyncio timeouts), runs unchanged.

Every simulated engine and trainer of one run shares one clock. Their work is timed in model
seconds by the timing models (timing.py, trainer.py) and slept as model_seconds / time_scale;
under CPU overload an engine falls behind the clock and catches up without sleeping (its model
time stays exact; its answers arrive late in wall time).
"""
from __future__ import annotations

import asyncio
import time


class SimClock:
    def __init__(self, time_scale: float = 1000.0):
        if time_scale <= 0:
            raise ValueError(f"time_scale={time_scale} must be > 0 (model seconds per wall "
                             "second; 1000 runs a 10-minute generation in 0.6 s)")
        self.time_scale = time_scale
        self._wall_origin = time.perf_counter()

    def now(self) -> float:
        """Model seconds since the clock started."""
        return (time.perf_counter() - self._wall_origin) * self.time_scale

    def wall_delay(self, model_seconds: float) -> float:
        """The wall seconds `model_seconds` of model time take."""
        return model_seconds / self.time_scale

    async def sleep(self, model_seconds: float) -> None:
        await asyncio.sleep(max(0.0, model_seconds) / self.time_scale)

    async def sleep_until(self, model_time: float) -> None:
        await asyncio.sleep(max(0.0, model_time - self.now()) / self.time_scale)
