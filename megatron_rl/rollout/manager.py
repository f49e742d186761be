"""The rollout manager: keeps the generators busy under the staleness bound and hands the trainer
finished, scored groups (SCALERL.md section 7; DESIGN.md data flow steps 1-2).

One asyncio event loop (a Ray async actor in a cluster run, or the driver's own loop) runs:
- admission: while the gate (staleness.py) allows it and the buffer has room, take the next prompt
  (a re-queued stale one first, else the No-Positive-Resampling sampler) and start its group;
- per group: G completions, each a forced-interruption state machine (interruption.py) on the
  same server (one group shares its prompt's prefix cache, namespaced by the admission version
  through `extra_key`), then scoring off the event loop (verifiers block: a worker thread);
- take: the trainer asks for `prompts_per_step` groups; each is checked against the staleness
  bound at take time (fresh: trained; stale: re-queued or dropped, as the gate's policy says).

A failing generator or verifier stops the manager: `take` raises `RolloutError` naming it, never
a silent partial batch.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
from collections.abc import Callable, Sequence

from megatron_rl.rollout.interruption import (InterruptionSettings, bind_generate,
                                               generate_completion)
from megatron_rl.rollout.samples import RolloutSample
from megatron_rl.rollout.staleness import AdmissionGate, TakeDecision
from megatron_rl.rollout.types import SamplingParams

# (completion texts, their prompt records) -> reward results, in order (RewardRegistry.score_many)
ScoreFn = Callable[[list, list], list]


class RolloutError(RuntimeError):
    """Rollouts cannot go on (a generator died, a verifier raised); the message names it."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class FinishedGroup:
    """G scored completions of one prompt."""

    group_id: int
    prompt_index: int  # into the manager's prompt list
    admission_version: int
    samples: tuple[RolloutSample, ...]
    results: tuple  # megatron_rl.rewards.RewardResult per sample

    @property
    def oldest_version(self) -> int:
        """The oldest policy version of any sampled token (the admission version if none)."""
        versions = [s.oldest_version for s in self.samples if s.oldest_version is not None]
        return min(versions, default=self.admission_version)


class RolloutManager:
    def __init__(self, *, clients: Sequence, prompt_token_ids: Sequence[Sequence[int]],
                 records: Sequence, sampler, gate: AdmissionGate, params: SamplingParams,
                 interruption: InterruptionSettings, score: ScoreFn,
                 decode: Callable[[Sequence[int]], str], max_finished_groups: int,
                 seed: int = 0):
        if len(prompt_token_ids) != len(records):
            raise ValueError(f"{len(prompt_token_ids)} tokenized prompts but {len(records)} "
                             "records")
        if not clients:
            raise ValueError("the rollout manager needs at least one generator client")
        self.clients = list(clients)
        self.prompt_token_ids = [tuple(int(t) for t in p) for p in prompt_token_ids]
        self.records = list(records)
        self.sampler = sampler
        self.gate = gate
        self.params = params
        self.interruption = interruption
        self.score = score
        self.decode = decode
        self.max_finished_groups = max_finished_groups
        self.seed = seed
        self.version = 0  # the newest policy version the generators hold
        self._finished: collections.deque[FinishedGroup] = collections.deque()
        self._requeued: collections.deque[int] = collections.deque()
        self._running: set[asyncio.Task] = set()
        self._next_group_id = 0
        self._error: BaseException | None = None
        # Set on every change (a version, a finished group, a take, an error); one event per
        # waiter, so that neither can clear the other's wake-up.
        self._admission_wakeup = asyncio.Event()
        self._take_wakeup = asyncio.Event()
        self._idle_wakeup = asyncio.Event()
        self._admitter: asyncio.Task | None = None

    # ------------------------------------------------------------------ control

    def start(self) -> None:
        """Begin admitting groups (call from inside the running event loop)."""
        self._admitter = asyncio.get_running_loop().create_task(self._admit_forever())

    async def stop(self) -> None:
        """Cancel admission and every group in flight."""
        tasks = [t for t in (self._admitter, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._running.clear()

    def publish_version(self, version: int) -> None:
        """The generators now hold policy `version` (after a completed weight sync)."""
        self.version = version
        self._notify()

    def _notify(self) -> None:
        self._admission_wakeup.set()
        self._take_wakeup.set()
        self._idle_wakeup.set()

    @property
    def num_in_flight(self) -> int:
        return len(self._running)

    @property
    def num_finished(self) -> int:
        return len(self._finished)

    # ------------------------------------------------------------------ take

    async def take(self, num_groups: int) -> list[FinishedGroup]:
        """`num_groups` fresh groups for the trainer's next step (from the current version);
        stale ones on the way are re-queued or dropped by the gate's policy. Each taken group's
        verified pass rate goes to the No-Positive-Resampling sampler."""
        taken: list[FinishedGroup] = []
        while len(taken) < num_groups:
            self._raise_if_failed()
            if not self._finished or not self.gate.may_take(len(self._finished)):
                self._take_wakeup.clear()
                await self._take_wakeup.wait()
                continue
            group = self._finished.popleft()
            decision = self.gate.on_take(group.oldest_version, self.version)
            if decision == TakeDecision.FRESH:
                taken.append(group)
                if not any(r.verifier_failed for r in group.results):  # no verdict, no history
                    passed = sum(r.passed for r in group.results) / len(group.results)
                    self.sampler.update([group.prompt_index], [passed])
            elif decision == TakeDecision.REQUEUE:
                self._requeued.append(group.prompt_index)
            self._notify()  # buffer room: admission may go on
        return taken

    async def wait_until_idle(self) -> None:
        """Return once no group is generating (colocated placement: before the generators'
        memory is released for training; the synchronous schedules admit nothing new until the
        next version, so this ends)."""
        while self._running:
            self._raise_if_failed()
            self._idle_wakeup.clear()
            await self._idle_wakeup.wait()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RolloutError(f"rollouts stopped: {self._error}") from self._error

    # ------------------------------------------------------------------ admission

    async def _admit_forever(self) -> None:
        while True:
            while (self.gate.may_admit(self.version) and self._error is None
                   and len(self._finished) + len(self._running) < self.max_finished_groups):
                self._admit_one()
            self._admission_wakeup.clear()
            await self._admission_wakeup.wait()

    def _admit_one(self) -> None:
        prompt_index = self._requeued.popleft() if self._requeued else self.sampler.sample(1)[0]
        self.gate.on_admit(self.version)
        group_id, self._next_group_id = self._next_group_id, self._next_group_id + 1
        task = asyncio.get_running_loop().create_task(
            self._run_group(group_id, prompt_index, self.version))
        self._running.add(task)
        task.add_done_callback(self._group_done)

    def _group_done(self, task: asyncio.Task) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is not None and self._error is None:
            self._error = task.exception()
        self._notify()

    async def _run_group(self, group_id: int, prompt_index: int, version: int) -> None:
        client = self.clients[group_id % len(self.clients)]
        extra_key = f"v{version}"  # no cached KV of another policy version is ever reused

        samples = await asyncio.gather(*(
            generate_completion(bind_generate(  # each sample its own seed: SamplingParams.seed
                                    client, self.params.for_sample("train", group_id, k),
                                    extra_key=extra_key),
                                self.prompt_token_ids[prompt_index],
                                settings=self.interruption,
                                rng=random.Random(f"{self.seed}/{group_id}/{k}"),
                                group_id=group_id, sample_index=k)
            for k in range(self.params.num_samples)))
        texts = [self.decode(sample.token_ids) for sample in samples]
        record = self.records[prompt_index]
        results = await asyncio.to_thread(self.score, texts, [record] * len(texts))
        self._finished.append(FinishedGroup(group_id=group_id, prompt_index=prompt_index,
                                            admission_version=version, samples=tuple(samples),
                                            results=tuple(results)))
        self._notify()
