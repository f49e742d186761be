"""Recovery while a run goes on (docs/fault_tolerance.md): generators that die or hang are taken
out of the rotation, their groups re-queued, and restarted and re-synced while the others go on;
reward workers that die or hang are recorded (MathVerifier has already replaced them and graded
their samples again); a trainer rank that dies or hangs raises `TrainerFailure`, and the driver
restores the trainer group from the last checkpoint (`TrainerRestarts` bounds how often). Every
fault goes to faults.jsonl.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

from megatron_rl.config import RunConfig
from megatron_rl.console import notice
from megatron_rl.resilience import ledger

_STABLE_S = 300.0  # a generator up this long since its restart has recovered
_HEALTH_STRIKES = 2  # health checks in a row a generator must fail to count as hung


class TrainerFailure(RuntimeError):
    """A trainer rank died or hung (the run restores the trainer group from a checkpoint)."""


class RunStopped(RuntimeError):
    """The run stopped itself (a checkpoint was written); the message says why and what next."""


def trainer_call(call: Callable):
    """Run a call on the trainer group; a rank that died (Ray actor death) or hung (no answer
    within its timeout) raises TrainerFailure."""
    import ray

    try:
        return call()
    except (ray.exceptions.RayActorError, TimeoutError) as exc:
        raise TrainerFailure(f"{type(exc).__name__}: {str(exc).splitlines()[0][:500]}") from exc


class GeneratorHealth:
    """Health of the generator engines and the reward workers while the driver waits.

    `clients` is the run's list of HTTP clients (one per engine), shared with the rollout
    manager and the metrics; a restart replaces its entry. `resync(endpoint)` brings a restarted
    engine to the current weights and version; `new_client(url)` makes its client;
    `on_restarted()` runs after a restart (processes.json)."""

    def __init__(self, cfg: RunConfig, out: Path, *, generators, loop, manager,
                 clients: list, math_verifier, resync: Callable, new_client: Callable,
                 on_restarted: Callable[[], None]):
        self.cfg, self.out = cfg, out
        self.generators, self.loop, self.manager, self.clients = generators, loop, manager, clients
        self.math_verifier = math_verifier
        self._resync, self._new_client, self._on_restarted = resync, new_client, on_restarted
        # Restarts of a generator in a row: one that fails again within _STABLE_S of its
        # restart (a crash loop) counts on; rollout.max_generator_restarts of them: given up.
        self._restarts: dict[int, int] = {}
        self._restarted_at: dict[int, float] = {}
        self._strikes: dict[int, int] = {}  # failed timer health checks in a row
        self._given_up: set[int] = set()
        self._last_check = 0.0
        self._failures: list = []  # GeneratorFailure reports not yet recovered

    def wait(self, coroutine):
        """Run a coroutine on the rollout loop; while it runs, failed generators are restarted
        and failed reward workers recorded."""
        future = self.loop.submit(coroutine)
        try:
            while True:
                try:
                    return future.result(timeout=1.0)
                except TimeoutError:
                    self.record_reward_faults()
                    self.check()
        except BaseException:
            future.cancel()  # the run is stopping: nothing waits for the result
            raise

    def record_reward_faults(self) -> None:
        """faults.jsonl records of the math workers that died or hung and were replaced; their
        samples were graded again already (MathVerifier), so nothing is redone."""
        for fault in self.math_verifier.take_faults():
            ledger.record_fault(self.out, **fault, requeued_groups=0, steps_lost=0)
            notice(f"reward worker: {fault['what']}; its samples are scored again by a fresh "
                   "worker")

    def check(self, *, now: bool = False, strikes: int = _HEALTH_STRIKES) -> None:
        """Health-check every generator (every rollout.health_check_interval_s, or `now`),
        take the ones failing `strikes` checks in a row, a request, or the liveness rule (no
        progress for rollout.no_progress_timeout_s, docs/pipeline.md) out of the rotation and
        restart them. A failed rollout task (RolloutError) is raised here."""
        self.loop.run(self.manager.raise_if_failed)  # a rollout task's failure stops the run
        interval = self.cfg.rollout.health_check_interval_s
        if now or time.monotonic() - self._last_check >= interval:
            self._last_check = time.monotonic()
            up = set(range(len(self.clients))) - self.loop.run(lambda: self.manager.down)
            unhealthy = self.generators.unhealthy(timeout_s=30.0)
            for index in up:
                self._strikes[index] = self._strikes.get(index, 0) + 1 \
                    if index in unhealthy else 0
                if self._strikes[index] >= strikes:  # a busy engine may miss one
                    self._strikes[index] = 0
                    self.loop.run(lambda i=index, r=str(unhealthy[index]):
                                  self.manager.mark_down(i, r))
            if not now:  # `now` comes from a weight sync, whose pause makes no progress
                # Engines with requests in flight and no progress (no answer, no passed
                # /health_generate) for rollout.no_progress_timeout_s: marked down.
                self.loop.call(self.manager.check_liveness(
                    self.cfg.rollout.no_progress_timeout_s))
        self._failures += self.loop.run(self.manager.take_failures)
        down = self.loop.run(lambda: self.manager.down) - self._given_up
        for index in sorted(down):
            self._restart(index)
        if len(self._given_up) == len(self.clients):
            raise RunStopped("every generator failed and could not be restarted "
                             f"(rollout.max_generator_restarts="
                             f"{self.cfg.rollout.max_generator_restarts}); "
                             "see the generator logs in output_dir")

    def _restart(self, index: int) -> None:
        """Restart generator `index`, bring it to the current weights and version over a group
        of its own, and put it back in the rotation; bounded attempts with backoff."""
        failure = next((f for f in self._failures if f.index == index), None)
        name = self.generators.names[index]
        fault = dict(kind="generator", what=failure.reason if failure else name,
                     detected_at=failure.detected_at if failure else time.time(),
                     requeued_groups=failure.requeued_groups if failure else 0, steps_lost=0)
        limit = self.cfg.rollout.max_generator_restarts
        if time.monotonic() - self._restarted_at.get(index, -math.inf) > _STABLE_S:
            self._restarts[index] = 0  # it served a while: a new failure, not a loop
        while True:
            attempt = self._restarts.get(index, 0)
            if attempt >= limit:
                self._given_up.add(index)
                notice(f"generator {name!r}: given up after {attempt} restart(s) that did not "
                       f"last {_STABLE_S:.0f} s; the run goes on with the others")
                ledger.record_fault(self.out, recovered=False, **fault)
                return
            notice(f"generator {name!r} failed ({fault['what'].splitlines()[0][:200]}); "
                   f"restarting it (attempt {attempt + 1} of {limit})")
            self._restarts[index] = attempt + 1
            try:
                endpoint = self.generators.restart(index, timeout_s=self.cfg.train.step_timeout_s)
                version = self._resync(endpoint)
                break
            except TrainerFailure:
                raise
            except Exception as exc:  # noqa: BLE001 (retried with backoff, then given up)
                notice(f"generator {name!r}: restart failed: {type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:300]}")
                time.sleep(min(60.0, 2.0 * 2 ** attempt))
        self._restarted_at[index] = time.monotonic()
        client = self._new_client(endpoint.url)
        old, self.clients[index] = self.clients[index], client
        self.loop.call(old.close())
        self.loop.run(lambda: self.manager.mark_up(index, client))
        self._on_restarted()
        if failure is not None:
            self._failures.remove(failure)
        ledger.record_fault(self.out, **fault)
        notice(f"generator {name!r} is back at {endpoint.url} with policy version {version}")


class TrainerRestarts:
    """Counts the trainer group's restarts against train.max_trainer_restarts and records each
    recovery in faults.jsonl."""

    def __init__(self, cfg: RunConfig, out: Path):
        self.cfg, self.out = cfg, out
        self.count = 0

    def begin(self, failure: TrainerFailure, *, failed_step: int) -> float:
        """A restart is about to happen: counted, or RunStopped past the limit. Returns the
        time the failure was detected."""
        detected = time.time()
        self.count += 1
        limit = self.cfg.train.max_trainer_restarts
        if self.count > limit:
            raise RunStopped(f"the trainer failed at step {failed_step} ({failure}) and has "
                             f"been restarted {limit} time(s) already "
                             "(train.max_trainer_restarts); resume with --resume once the "
                             "cause is fixed") from failure
        notice(f"trainer failed at step {failed_step}: {failure}; restarting the trainer ranks "
               f"(attempt {self.count} of {limit})")
        return detected

    def done(self, failure: TrainerFailure, *, detected: float, failed_step: int,
             restored_step: int, restored_from: Path | None) -> None:
        lost = failed_step - 1 - restored_step
        ledger.record_fault(self.out, kind="trainer", what=str(failure), detected_at=detected,
                            restored_step=restored_step, steps_lost=lost)
        notice(f"trainer restored to step {restored_step} "
               f"({restored_from.name if restored_from is not None else 'the start of the run'}"
               f"); {lost} step(s) are redone")
