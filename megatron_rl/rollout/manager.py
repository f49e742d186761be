"""The rollout manager: keeps the generators busy under the staleness bound and hands the trainer
finished, scored groups (SCALERL.md section 7; DESIGN.md data flow steps 1-2).

One asyncio event loop (a Ray async actor in a cluster run, or the driver's own loop) runs:
- admission: while the gate (staleness.py) allows it and the buffer has room, take the next prompt
  (a re-queued stale one first, else the No-Positive-Resampling sampler) and start its group;
- per group: G completions, each a forced-interruption state machine (interruption.py) on the
  same server (one group shares its prompt's prefix cache, namespaced by the admission version
  through `extra_key`), then scoring off the event loop (verifiers block: a worker thread);
  a record whose environment is multi-turn (`multi_turn`, rollout/multi_turn.py) gets G
  trajectories instead, each scored by its environment (same seeds, same prefix-cache key; a
  cancelled group's sessions are closed as it is cancelled);
- take: the trainer asks for `prompts_per_step` groups; each is checked against the staleness
  bound at take time (fresh: trained; stale: re-queued or dropped, as the gate's policy says);
  `put_back` undoes a take whose groups never reached the trainer (a stop as it completed).

Generator failures (a request that finds the server gone, the driver's health check through
`mark_down`, or `check_liveness`: requests in flight and no progress for
rollout.no_progress_timeout_s) take that engine out of the rotation: its groups in flight are
cancelled and re-queued once each under their own group ids (same prompt, same sampling seeds) for
the engines still up, and the failure is reported through `take_failures()`; the driver restarts
the engine, re-syncs its weights and returns it with `mark_up`. A request's wall time alone
never condemns an engine (async_client.py). A verifier that raises, or any other error in a
task of the manager (admission included: e.g. No-Positive-Resampling has retired every prompt),
stops the manager: `take` and `raise_if_failed` raise `RolloutError` naming it, never a silent
partial batch or a wait forever; every task's failure is consumed here (no "Task exception was
never retrieved").

A stale group re-queued at take time is regenerated as a new group (the staleness gate's policy)
at most `max_requeues` times, and not at all once No-Positive-Resampling has retired its prompt.
The prefix-cache key of a request (`prefix_cache_key`) names the policy version and the
manager's incarnation, which every `load_state_dict` (a resume, or a restore after a trainer
failure) advances: the versions redone after a restore are other weights than the abandoned
branch's versions of the same number, and must not reuse their KV.

`state_dict()` / `load_state_dict()` carry the manager (with its sampler and admission gate)
through a run checkpoint: the buffered groups with their samples, the groups in flight (as tickets:
regenerated under the same group ids on resume), the re-queued prompts (with how often each was
regenerated) and the next group id.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import time
from collections.abc import Callable, Sequence

from megatron_rl.rollout.interruption import InterruptionSettings, bind_generate
from megatron_rl.rollout.multi_turn import MultiTurnRollout, generate_sample
from megatron_rl.rollout.samples import RolloutSample
from megatron_rl.rollout.staleness import AdmissionGate, TakeDecision
from megatron_rl.rollout.types import GeneratorDeadError, SamplingParams

# (completion texts, their prompt records) -> reward results, in order (RewardRegistry.score_many)
ScoreFn = Callable[[list, list], list]
# Longest wait for one /health_generate probe: SGLang answers 503 after its own 20 s window, and
# an HTTP server busy taking in thousands of requests may start on the probe late.
PROBE_TIMEOUT_S = 30.0


class RolloutError(RuntimeError):
    """Rollouts cannot go on (a generator died, a verifier raised); the message names it."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GroupTicket:
    """An admitted group not finished yet: what regenerates it (same id, same seeds)."""

    group_id: int
    prompt_index: int


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GeneratorFailure:
    """A generator taken out of the rotation (`RolloutManager.take_failures`)."""

    index: int  # into the manager's clients
    reason: str
    detected_at: float  # time.time()
    requeued_groups: int  # its groups in flight, re-queued under their ids


@dataclasses.dataclass(kw_only=True, slots=True)
class _Taken:
    """What a committed `take` changed, for `put_back`."""

    groups: tuple[FinishedGroup, ...]  # in the order they left the buffer
    requeue_counts: dict[int, int] = dataclasses.field(default_factory=dict)  # group id -> n
    scored: list[int] = dataclasses.field(default_factory=list)  # prompts given a pass rate
    retired: set[int] = dataclasses.field(default_factory=set)  # prompts that retired


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
                 seed: int = 0, multi_turn: MultiTurnRollout | None = None):
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
        self.multi_turn = multi_turn  # None: every record single-turn, scored by `score`
        self.version = 0  # the newest policy version the generators hold
        self.incarnation = 0  # advanced by every load_state_dict: part of the prefix-cache key
        self._finished: collections.deque[FinishedGroup] = collections.deque()
        # Stale prompts to admit again as new groups: (prompt index, times regenerated then).
        self._requeued: collections.deque[tuple[int, int]] = collections.deque()
        self._requeue_counts: dict[int, int] = {}  # group id -> times its prompt was regenerated
        self._retry: collections.deque[GroupTicket] = collections.deque()  # same group ids
        self._running: dict[asyncio.Task, tuple[GroupTicket, int]] = {}  # -> (ticket, client)
        self._requests: dict[asyncio.Task, int] = {}  # run_anywhere's requests -> client
        self._up_again = asyncio.Event()  # set (and replaced) by every mark_up
        self._down: set[int] = set()  # clients out of the rotation
        self._failures: list[GeneratorFailure] = []
        self._discarded: list[tuple[int, int, str]] = []  # (group id, prompt, decision)
        self._taking: list[FinishedGroup] = []  # fresh groups a `take` holds, not committed
        self._last_take: _Taken | None = None  # what `put_back` undoes
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
        self._admitter = asyncio.get_running_loop().create_task(self._admit_forever(),
                                                                name="rollout admission")
        self._admitter.add_done_callback(self._admission_done)

    def _admission_done(self, task: asyncio.Task) -> None:
        if task.cancelled():  # stop()
            return
        error = task.exception()  # consumed here: it reaches take() and the driver
        if error is not None and self._error is None:
            self._error = RolloutError(f"admitting new groups failed: {type(error).__name__}: "
                                       f"{error}")
            self._error.__cause__ = error
        self._notify()

    async def stop(self) -> None:
        """Cancel admission and every group in flight (take `state_dict` first to keep them)."""
        tasks = [t for t in (self._admitter, *self._running) if t is not None]
        self._admitter = None
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

    @property
    def next_group_id(self) -> int:
        return self._next_group_id

    def prefix_cache_key(self, version: int) -> str:
        """SGLang `extra_key` of requests generated at policy `version` (training groups use
        their admission version; validation the current one): requests share cached KV only
        with requests of the same weights, also across a restore (see the module docstring)."""
        return f"v{version}-r{self.incarnation}"

    def outstanding_group_ids(self) -> list[int]:
        """Admitted groups not taken yet: buffered, generating, or waiting to be regenerated;
        and the stale ones discarded since the last `take_discarded` (not in the ledger yet: a
        take that a graceful stop abandoned)."""
        return sorted([g.group_id for g in (*self._taking, *self._finished)]
                      + [d[0] for d in self._discarded]
                      + [t.group_id for t, _ in self._running.values()]
                      + [t.group_id for t in self._retry])

    # ------------------------------------------------------------------ generator failures

    @property
    def down(self) -> frozenset[int]:
        """Indices of the clients out of the rotation."""
        return frozenset(self._down)

    def mark_down(self, index: int, reason: str) -> None:
        """Take generator `index` out of the rotation: its groups in flight are cancelled and
        re-queued (once each, same group ids) for the others; reported by `take_failures`.
        A no-op for one already down."""
        if index in self._down:
            return
        self._down.add(index)
        requeued = 0
        for task, (ticket, client) in list(self._running.items()):
            if client == index:
                del self._running[task]  # its done-callback now ignores it
                task.cancel()
                self._retry.append(ticket)
                requeued += 1
        for task, client in self._requests.items():
            if client == index:
                task.cancel()  # run_anywhere sends it again to another generator
        self._failures.append(GeneratorFailure(index=index, reason=reason,
                                               detected_at=time.time(),
                                               requeued_groups=requeued))
        self._notify()

    def mark_up(self, index: int, client) -> None:
        """Generator `index` serves again (restarted and re-synced), through `client`."""
        self.clients[index] = client
        self._down.discard(index)
        self._up_again.set()
        self._up_again = asyncio.Event()
        self._notify()

    async def check_liveness(self, no_progress_timeout_s: float, *,
                             probe_timeout_s: float = PROBE_TIMEOUT_S) -> dict[int, str]:
        """Take out of the rotation (`mark_down`) every generator that is hung: it has requests
        in flight and has shown no progress for `no_progress_timeout_s` (rollout.
        no_progress_timeout_s): none of its requests was answered, and SGLang's own liveness
        check, /health_generate (a completed forward step, or a one-token generation when idle),
        failed. A slow engine (32k-token requests, thousands queued) answers the probe and is
        never taken out however long its requests take. Generators whose last progress is older
        than a quarter of the window are probed, so a hung one is taken out at the first call
        after the window has passed (and its probe, at most `probe_timeout_s`, failed). Call it
        periodically (the driver's health check), never while the generators are paused for a
        weight update (a paused engine makes no progress). Returns {index: reason} of the
        generators taken out."""
        if not (no_progress_timeout_s > 0 and probe_timeout_s > 0):
            raise ValueError(f"no_progress_timeout_s ({no_progress_timeout_s}) and "
                             f"probe_timeout_s ({probe_timeout_s}) must be > 0")
        watched = {index: client for index, client in enumerate(self.clients)
                   if index not in self._down and self._overdue(client, no_progress_timeout_s / 4)}
        if not watched:
            return {}
        failures = await asyncio.gather(*(c.probe(probe_timeout_s) for c in watched.values()))
        hung: dict[int, str] = {}
        for (index, client), failure in zip(watched.items(), failures):
            if index in self._down or self.clients[index] is not client:  # changed meanwhile
                continue
            progress = client.progress()
            if failure is not None and self._overdue(client, no_progress_timeout_s):
                hung[index] = (
                    f"generator {index} ({client.url}) is hung: {progress.in_flight} requests "
                    f"in flight and no progress for {progress.since_progress_s:.0f} s "
                    f"(rollout.no_progress_timeout_s={no_progress_timeout_s:g}); {failure}")
                self.mark_down(index, hung[index])
        return hung

    @staticmethod
    def _overdue(client, seconds: float) -> bool:
        progress = client.progress()
        return progress.in_flight > 0 and progress.since_progress_s >= seconds

    async def run_anywhere(self, key: int, request: Callable):
        """`await request(client)` on a generator in the rotation (the one of `key` modulo the
        generators while it is up): requests outside the training groups, such as validation.
        When that generator fails (the request finds it dead, or the driver's health check
        takes it out with `mark_down` or `check_liveness`), it is taken out of the rotation like
        for a group, and the request is sent again to another; with every generator down it waits for
        `mark_up`. The request must give the same answer on any generator (seeded sampling).
        Any other failure of the request raises RolloutError naming it."""
        while True:
            index = self._up_client(key)
            if index is None:
                await self._up_again.wait()
                continue
            task = asyncio.ensure_future(request(self.clients[index]))
            task.add_done_callback(_consume)  # also when the caller is cancelled meanwhile
            self._requests[task] = index
            try:
                await asyncio.wait({task})
            finally:
                del self._requests[task]
                task.cancel()  # a no-op once done; else the caller itself was cancelled
            if task.cancelled():  # its generator was taken out meanwhile
                continue
            error = task.exception()
            if isinstance(error, GeneratorDeadError):
                self.mark_down(index, str(error))
                continue
            if error is not None:  # routed as a rollout task's failure is (the run stops)
                raise RolloutError(f"a request on generator {index} failed: "
                                   f"{type(error).__name__}: {error}") from error
            return task.result()

    def take_failures(self) -> list[GeneratorFailure]:
        """The generators taken out of the rotation since the last call."""
        failures, self._failures = self._failures, []
        return failures

    def take_discarded(self) -> list[tuple[int, int, str]]:
        """(group id, prompt index, "requeue" | "drop") of the stale groups `take` discarded
        since the last call."""
        discarded, self._discarded = self._discarded, []
        return discarded

    # ------------------------------------------------------------------ take

    async def take(self, num_groups: int) -> list[FinishedGroup]:
        """`num_groups` fresh groups for the trainer's next step (from the current version), in
        group-id order; stale ones on the way are re-queued or dropped by the gate's policy.
        Each taken group's verified pass rate goes to the No-Positive-Resampling sampler.

        The fresh groups are taken (gate, sampler) only once all `num_groups` are in hand: a
        take cancelled while it waits (a graceful stop abandons it) puts the ones it holds back
        at the head of the buffer, so that nothing is lost or counted twice. (A stale group is
        decided as it comes: so one whose prompt a fresh group of the same take retires is
        re-queued, not dropped, and its prompt then skipped at admission.) A take that completed
        but whose groups never reached the trainer (its caller stopped meanwhile) is undone by
        `put_back`."""
        self._last_take = None
        fresh = self._taking = []  # in the buffer's books until committed (state_dict)
        try:
            while len(fresh) < num_groups:
                self.raise_if_failed()
                if not self._finished or not self.gate.may_take(len(self._finished)
                                                                + len(fresh)):
                    self._take_wakeup.clear()
                    await self._take_wakeup.wait()
                    continue
                group = self._finished.popleft()
                if self.gate.is_fresh(group.oldest_version, self.version):
                    fresh.append(group)
                else:
                    self._discard(group)
                self._notify()  # buffer room: admission may go on
        except BaseException:
            self._finished.extendleft(reversed(fresh))
            raise
        finally:
            self._taking = []
        taken = _Taken(groups=tuple(fresh))
        for group in fresh:
            if group.group_id in self._requeue_counts:
                taken.requeue_counts[group.group_id] = self._requeue_counts.pop(group.group_id)
            decision = self.gate.on_take(group.oldest_version, self.version)
            assert decision == TakeDecision.FRESH, decision
            if not any(r.verifier_failed for r in group.results):  # no verdict, no history
                passed = sum(r.passed for r in group.results) / len(group.results)
                taken.retired |= self.sampler.update([group.prompt_index], [passed])
                taken.scored.append(group.prompt_index)
        self._last_take = taken
        # The batch's order does not depend on which group finished first (deterministic runs).
        return sorted(fresh, key=lambda g: g.group_id)

    def put_back(self, groups: Sequence[FinishedGroup]) -> None:
        """Undo the latest `take`, whose `groups` never reached the trainer (its caller gave up
        as it completed: RolloutLoop.abandon): they go back to the head of the buffer, the gate
        counts them outstanding again and the sampler forgets their pass rates (and un-retires
        the prompts they retired), as if the take had been cancelled while it waited. So a
        checkpoint written on a stop holds them, and the ledger has no gap."""
        taken = self._last_take
        if taken is None or sorted(g.group_id for g in groups) \
                != sorted(g.group_id for g in taken.groups):
            raise RuntimeError(
                f"put_back of groups {sorted(g.group_id for g in groups)}: only the latest "
                f"take's groups can be put back "
                f"({'none' if taken is None else sorted(g.group_id for g in taken.groups)}), "
                "once and before any other take")
        self._last_take = None
        self.gate.on_put_back(len(taken.groups))
        self.sampler.withdraw(taken.scored, retired=taken.retired)
        self._requeue_counts.update(taken.requeue_counts)
        self._finished.extendleft(reversed(taken.groups))  # in the order they were buffered
        self._notify()

    def _discard(self, group: FinishedGroup) -> None:
        """A stale group at take time: re-queued or dropped, as the gate's policy says."""
        times_requeued = self._requeue_counts.pop(group.group_id, 0)
        decision = self.gate.on_take(group.oldest_version, self.version,
                                     times_requeued=times_requeued,
                                     retired=self.sampler.is_retired(group.prompt_index))
        self._discarded.append((group.group_id, group.prompt_index, str(decision)))
        if decision == TakeDecision.REQUEUE:
            self._requeued.append((group.prompt_index, times_requeued + 1))

    async def wait_until_idle(self) -> None:
        """Return once no group is generating (colocated placement: before the generators'
        memory is released for training; the synchronous schedules admit nothing new until the
        next version, so this ends)."""
        while self._running or self._retry:
            self.raise_if_failed()
            self._idle_wakeup.clear()
            await self._idle_wakeup.wait()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        """Raise RolloutError naming the failure that stopped the manager (a verifier, the
        admission, any task of it), if one did: the driver checks it while it waits."""
        if self._error is not None:
            raise RolloutError(f"rollouts stopped: {self._error}") from self._error

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """Everything needed to continue (call on the manager's event loop, so that it is one
        consistent moment): the sampler and gate states, the buffered groups, the groups in
        flight or waiting as tickets, the re-queued prompts, the next group id, the version."""
        return {
            "version": self.version,
            "next_group_id": self._next_group_id,
            "finished": [*self._taking, *self._finished],
            "discarded": list(self._discarded),  # not in the ledger yet (take_discarded)
            "tickets": sorted([t for t, _ in self._running.values()] + list(self._retry),
                              key=lambda t: t.group_id),
            "requeued": list(self._requeued),
            "requeue_counts": dict(self._requeue_counts),
            "sampler": self.sampler.state_dict(),
            "gate": self.gate.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a `state_dict` (before `start`, or after `stop`): the tickets are
        regenerated first, under their own group ids, with the current weights. A new
        incarnation begins (`prefix_cache_key`)."""
        if self._running or self._admitter is not None:
            raise RuntimeError("load_state_dict on a running rollout manager; stop() it first")
        self.sampler.load_state_dict(state["sampler"])
        self.gate.load_state_dict(state["gate"])
        self.version = state["version"]
        self._next_group_id = state["next_group_id"]
        self._finished = collections.deque(state["finished"])
        self._retry = collections.deque(state["tickets"])
        # Older checkpoints hold bare prompt indices: each was regenerated once then.
        self._requeued = collections.deque((entry, 1) if isinstance(entry, int) else tuple(entry)
                                           for entry in state["requeued"])
        self._requeue_counts = {int(g): int(n)
                                for g, n in state.get("requeue_counts", {}).items()}
        self.incarnation += 1
        self._discarded = [tuple(d) for d in state.get("discarded", ())]
        self._failures, self._error, self._last_take = [], None, None
        expected = len(self._finished) + len(self._retry)
        if self.gate.num_outstanding != expected:
            raise ValueError(f"rollout state: the admission gate counts "
                             f"{self.gate.num_outstanding} groups outstanding but the state "
                             f"holds {expected} (buffered + in flight); it is inconsistent")

    # ------------------------------------------------------------------ admission

    async def _admit_forever(self) -> None:
        while True:
            while self._retry and self._error is None and self._up_client(0) is not None:
                self._launch(self._retry.popleft())
            while (self.gate.may_admit(self.version) and self._error is None
                   and self._up_client(0) is not None
                   and len(self._finished) + len(self._running) + len(self._retry)
                   < self.max_finished_groups):
                self._admit_one()
            self._admission_wakeup.clear()
            await self._admission_wakeup.wait()

    def _up_client(self, group_id: int) -> int | None:
        """The client for a group: group_id modulo the clients when that one is up (the same
        engine every run), else the least busy one up; None when all are down."""
        preferred = group_id % len(self.clients)
        if preferred not in self._down:
            return preferred
        up = [i for i in range(len(self.clients)) if i not in self._down]
        if not up:
            return None
        load = collections.Counter(client for _, client in self._running.values())
        return min(up, key=lambda i: (load[i], i))

    def _admit_one(self) -> None:
        prompt_index, times_requeued = self._next_prompt()
        self.gate.on_admit(self.version)
        group_id, self._next_group_id = self._next_group_id, self._next_group_id + 1
        if times_requeued:
            self._requeue_counts[group_id] = times_requeued
        self._launch(GroupTicket(group_id=group_id, prompt_index=prompt_index))

    def _next_prompt(self) -> tuple[int, int]:
        """(prompt index, times regenerated): a re-queued stale prompt first, unless
        No-Positive-Resampling retired it since (another group of it passed); else the
        sampler's next (which raises once every prompt is retired)."""
        while self._requeued:
            prompt_index, times_requeued = self._requeued.popleft()
            if not self.sampler.is_retired(prompt_index):
                return prompt_index, times_requeued
        return self.sampler.sample(1)[0], 0

    def _launch(self, ticket: GroupTicket) -> None:
        client = self._up_client(ticket.group_id)
        task = asyncio.get_running_loop().create_task(
            self._run_group(ticket, client, self.version))
        self._running[task] = (ticket, client)
        task.add_done_callback(self._group_done)

    def _group_done(self, task: asyncio.Task) -> None:
        # Consumed first, whatever happens to the group: a group that failed just before
        # mark_down cancelled it (another group's failure on the same generator) is re-queued
        # by mark_down, and its exception must not surface as "never retrieved".
        error = None if task.cancelled() else task.exception()
        entry = self._running.pop(task, None)
        if entry is None:  # finished (took itself out), or cancelled by mark_down or stop()
            return
        if error is not None:
            if isinstance(error, GeneratorDeadError):
                ticket, client = entry
                self._retry.append(ticket)  # before mark_down, which re-queues the others
                self.mark_down(client, str(error))
            elif self._error is None:
                self._error = error
        self._notify()

    async def _run_group(self, ticket: GroupTicket, client_index: int, version: int) -> None:
        client = self.clients[client_index]
        group_id, prompt_index = ticket.group_id, ticket.prompt_index
        extra_key = self.prefix_cache_key(version)  # never cached KV of other weights
        record = self.records[prompt_index]

        def sample(k: int):
            generate_one = bind_generate(  # each sample its own seed: SamplingParams.seed
                client, self.params.for_sample("train", group_id, k), extra_key=extra_key,
                continuation_priority=self.interruption.continuation_priority)
            return generate_sample(generate_one, self.prompt_token_ids[prompt_index], record,
                                   multi_turn=self.multi_turn, interruption=self.interruption,
                                   rng=random.Random(f"{self.seed}/{group_id}/{k}"),
                                   group_id=group_id, sample_index=k)

        try:
            async with asyncio.TaskGroup() as samples_group:  # one failure cancels the rest
                tasks = [samples_group.create_task(sample(k))
                         for k in range(self.params.num_samples)]
        except BaseExceptionGroup as group:
            raise group.exceptions[0] from None  # the first failure, as it was raised
        samples, results = zip(*(task.result() for task in tasks))
        if results[0] is None:  # single-turn completions: their verifier, the group in one batch
            texts = [self.decode(s.token_ids) for s in samples]
            results = await asyncio.to_thread(self.score, texts, [record] * len(texts))
        # Out of `_running` in the same step as into `_finished`: the done-callback runs a loop
        # iteration later, and a state_dict taken in between would hold the group twice.
        self._running.pop(asyncio.current_task(), None)
        self._finished.append(FinishedGroup(group_id=group_id, prompt_index=prompt_index,
                                            admission_version=version, samples=tuple(samples),
                                            results=tuple(results)))
        self._notify()


def _consume(task: asyncio.Task) -> None:
    """Mark a task's exception retrieved (its owner handles or re-raises it where it matters)."""
    if not task.cancelled():
        task.exception()
