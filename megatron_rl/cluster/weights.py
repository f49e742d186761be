"""Pushing the trainer's new weights into the generator engines, in flight (the engines pause,
load, continue: docs/pipeline.md), and, colocated, releasing the engines' memory for the training
phase and taking it back for the weights and the KV cache (SGLang's memory saver; the order is
SGLang's: weights first, then the rest once they are loaded).
"""
from __future__ import annotations

import time
from collections.abc import Callable

from megatron_rl.config import RunConfig
from megatron_rl.console import notice

# Tries of one push: a generator that fails during a sync is taken out and the sync retried;
# another may fail during the retry (at scale, or a node's engines failing one by one), which
# must not stop the run while others are up. Bounded: a sync that keeps failing is no engine's.
SYNC_ATTEMPTS = 3


class WeightPusher:
    """`urls()` gives the engines' current URLs (a restart may change them), `clients` the run's
    HTTP clients (their activity counters measure what a pause cost), `api_key` the engines'.
    `wait(coroutine)` runs a wait for generation on the rollout loop while the generators are
    health-checked, and a graceful stop abandons it (GeneratorHealth.wait)."""

    def __init__(self, cfg: RunConfig, *, loop, manager, urls: Callable[[], list[str]],
                 clients: list, colocated: bool, wait: Callable, api_key: str | None = None):
        self.cfg, self.loop, self.manager = cfg, loop, manager
        self._urls, self.clients, self.colocated = urls, clients, colocated
        self._api_key, self._wait = api_key, wait
        self.released = False  # colocated: the engines' memory is released for training

    def release(self) -> float:
        """Colocated: free the engines' memory for the training phase, once nothing generates
        (SGLang requires an idle engine; the synchronous schedules RunConfig requires admit
        nothing new before the next version, and under ppo_off_policy this waits for the rest
        of the round's groups). Returns the seconds it took."""
        started = time.perf_counter()
        self._wait(self.manager.wait_until_idle())
        for url in self._urls():
            self._engine(url).release_memory()
        self.released = True
        return time.perf_counter() - started

    def _resume(self, tags) -> None:
        for url in self._urls():
            self._engine(url).resume_memory(tags)

    def _engine(self, url: str):
        """An engine's control client: a request waits at most weight_sync.timeout_s (with the
        client's retries), like every step of a sync."""
        from megatron_rl.rollout import SGLangGenerator

        return SGLangGenerator(url, api_key=self._api_key,
                               request_timeout_s=self.cfg.weight_sync.timeout_s)

    def push(self, sync: Callable, check_generators: Callable[..., None]):
        """Sync the new weights into the engines (`sync()` runs the trainer group's sync and
        returns its report); a generator that fails during the sync is restarted
        (`check_generators`) and the sync retried, SYNC_ATTEMPTS tries in all. Returns (report,
        generator-seconds of requests held by the pause)."""
        from megatron_rl.rollout import SGLangGenerator
        from megatron_rl.rollout.async_client import activity_since
        from megatron_rl.weight_sync import WeightSyncError

        if self.released:  # colocated: the weights' memory back, to load into
            self._resume(SGLangGenerator.MEMORY_WEIGHTS)
        check_generators(now=True)  # a dead generator is restarted before, not during
        before = self._activity()
        for attempt in range(1, SYNC_ATTEMPTS + 1):
            try:
                report = sync()
                break
            except WeightSyncError as exc:  # a generator failed during the sync: restart, retry
                if attempt == SYNC_ATTEMPTS:
                    raise
                notice(f"{str(exc).splitlines()[0][:300]}; checking the generators and "
                       f"retrying (attempt {attempt + 1} of {SYNC_ATTEMPTS})")
                check_generators(now=True, strikes=1)  # a failed sync is the first strike
        after = self._activity()
        if self.released:
            self._resume(SGLangGenerator.MEMORY_AFTER_WEIGHTS)
            self.released = False
        # Requests in flight while the generators were paused made no progress: that time is
        # not busy (a generator with nothing in flight lost nothing to the pause).
        paused_busy = sum(min(report.paused_s, window.busy_s)
                          for window in activity_since(after, before))
        return report, paused_busy

    def _activity(self) -> list:
        from megatron_rl.rollout.async_client import activities

        return activities(self.clients)
