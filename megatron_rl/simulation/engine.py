"""A simulated SGLang engine: an aiohttp server that speaks the HTTP API the project uses (the
endpoints and fields of rollout/async_client.py and rollout/sglang_server.py's SGLangGenerator),
so the real clients talk to it unmodified, with SGLang's scheduling as it matters for RL and step
times from the cost model's formulas (timing.py) on a simulated clock (clock.py). Many engines
run in one process and one event loop, each on its own port (`EngineFleet`).

What it models, per engine:
- continuous batching: up to `max_running_requests` requests decode together; a finished request
  frees its slot at the step it finishes and the next queued request is admitted (prefilled) then;
- a KV cache of `max_total_tokens` tokens: a request is admitted only if its prompt (and any
  output it already has) fits; when the growing running batch would overflow it, running requests
  are retracted as SGLang does (fewest output tokens first), their KV dropped, and re-prefilled
  from prompt + output when readmitted;
- the waiting queue: first come first served, or by priority (higher first) with
  `enable_priority_scheduling` (SGLang's --enable-priority-scheduling, preemption off); a
  retracted request keeps its place (its arrival number);
- time: a decode step of batch b and total context C takes `EngineTiming.decode_step_seconds(b,
  C)`, a prefill of n tokens `prefill_seconds(n)`, a weight bucket `weight_load_seconds(bytes)`,
  each times the slow-down factor; the engine decodes in chunks up to the next event (a request
  finishing, the KV cache filling) and is woken at the current step by control calls (pause,
  abort, version change) and by arrivals while it has a free slot;
- completions: token ids and log-probs from a generator seeded by the engine seed and the
  request's sampling_seed (or its arrival number), lengths from a lognormal distribution
  (`CompletionLengths`) capped at max_new_tokens, ending in EOS (or one of the request's stop
  tokens) when shorter; per-token weight-version spans that are exact across in-flight updates
  (tokens decoded after `/update_weight_version` carry the new version);
- faults on demand: `kill()` (the server closes its port and connections), `hang()` (it stops
  answering anything, health included), `slow_down(factor)`; `EngineFleet.lose_node` kills the
  engines of one node together.
What it does not model: the prefix cache (prefill is always the full input), chunked prefill,
speculative decoding, the first token coming out of the prefill, a tokenizer (token ids only, as
the project runs SGLang with skip_tokenizer_init), prompt log-probs beyond placeholders.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from megatron_rl.rollout.sglang_server import _STALE_SESSION
from megatron_rl.simulation.clock import SimClock
from megatron_rl.simulation.timing import EngineTiming

# SGLang answers these without the API key (its --api-key guards everything else).
OPEN_PATHS = frozenset({"/health", "/health_generate", "/ready", "/metrics"})
PAUSE_MODES = ("in_place", "retract", "abort")
_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
                "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class CompletionLengths:
    """Completion lengths: lognormal with median `median_tokens` and log-scale `sigma`
    (p99 / median = exp(2.33 sigma): 10x at sigma 1), capped at the request's max_new_tokens
    (finish "length"); a shorter completion ends in EOS (finish "stop")."""

    median_tokens: float = 2048.0
    sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.median_tokens < 1 or self.sigma < 0:
            raise ValueError(f"CompletionLengths: median_tokens={self.median_tokens} must be >= 1 "
                             f"and sigma={self.sigma} >= 0")

    def draw(self, rng: np.random.Generator) -> int:
        return max(1, math.ceil(self.median_tokens * math.exp(self.sigma
                                                              * rng.standard_normal())))


@dataclasses.dataclass(kw_only=True, slots=True, frozen=True)
class EngineSettings:
    """One simulated engine. Field names are SGLang's server arguments where they exist."""

    max_running_requests: int = 256
    max_total_tokens: int | None = None  # KV-cache tokens; None: EngineTiming.kv_capacity_tokens
    enable_priority_scheduling: bool = False
    tp_size: int = 1  # reported by /server_info (the ranks of a weight-update group)
    api_key: str | None = dataclasses.field(default=None, repr=False)
    random_seed: int = 0
    vocab_size: int = 32000
    eos_token_id: int = 2
    lengths: CompletionLengths = CompletionLengths()
    mean_neg_logprob: float = 0.7  # log-probs are -Exponential(this mean)
    max_chunk_steps: int = 4096  # longest run of decode steps timed as one (context grows)
    weight_version: int = 0  # --weight-version at start
    # Model tokens each returned token stands for. The real client spends ~5 us of CPU on every
    # token it parses, so at full fidelity 64 engines outrun one core; at granularity g a
    # decode step is timed as g steps at g times the context, a prefill as g times the tokens,
    # the KV cache holds 1/g as many, and the recipe's token budgets (max_new_tokens, prompt
    # lengths, lengths.median_tokens) are given in units of g tokens.
    token_granularity: int = 1
    # Keep, per answered request, when each of its running segments began (EngineStats.
    # requests): the per-token version check of the scale tests. Off by default (memory).
    record_requests: bool = False

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "tp_size", "vocab_size", "max_chunk_steps",
                     "token_granularity"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineSettings: {name}={getattr(self, name)} must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 2:
            raise ValueError(f"EngineSettings: max_total_tokens={self.max_total_tokens} must be "
                             ">= 2 or None (from the timing model)")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"EngineSettings: eos_token_id={self.eos_token_id} is outside the "
                             f"vocabulary [0, {self.vocab_size})")


@dataclasses.dataclass(eq=False, slots=True)
class _Request:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    length: int  # tokens it generates in all (<= max_new_tokens)
    stop_token: int | None  # its last token when it ends by stop
    priority: int
    arrival: int
    token_seed: tuple[int, ...]
    future: asyncio.Future
    stop_token_ids: tuple[int, ...]
    want_input_logprobs: bool
    generated: int = 0  # output tokens before the current running segment
    segment_start: int = -1  # engine step the running segment began at; -1: not running
    segment: int = 0  # running segments so far (tells stale finish-heap entries apart)
    spans: list[list[int]] = dataclasses.field(default_factory=list)  # [version, first token]
    starts: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (token, step)
    done: bool = False
    queued_model_s: float = 0.0  # model time it arrived (EngineStats.queue_wait_*)

    @property
    def queue_key(self) -> tuple[int, int]:
        return (-self.priority, self.arrival)


@dataclasses.dataclass(slots=True)
class EngineStats:
    """What the engine did (for the simulator's report and tests)."""

    max_batch: int = 0  # most requests decoding at once
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    retractions: int = 0
    finished: int = 0
    aborted: int = 0
    dropped: int = 0  # requests in flight (queued or running) when it died
    busy_model_s: float = 0.0  # model seconds spent decoding, prefilling and loading weights
    # How far behind the clock the engine fell (model seconds): near 0 while the process keeps
    # up; large when the CPU sets the pace (lower time_scale, or raise token_granularity).
    max_lag_model_s: float = 0.0
    admission_order: list[str] = dataclasses.field(default_factory=list)  # rids, first admission
    # Priority scheduling as the control plane drives it (continuations at priority 1 with
    # rollout.continuations_first): first admissions of a request with priority > 0, how many
    # lower-priority requests that had arrived earlier were still queued at each of them (the
    # requests it went ahead of), and admissions made while a higher-priority request waited
    # (0 under SGLang's priority order; only the KV cache may hold the head back).
    priority_admissions: int = 0
    priority_overtaken: int = 0
    admitted_past_priority: int = 0
    max_queued: int = 0  # most requests waiting at once
    # (engine step, version) at every version change: when the engine took each update.
    version_steps: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    # With EngineSettings.record_requests: (input tokens, first 16 output ids) of each answered
    # request -> the (first output token, engine step) of each of its running segments; output
    # token i of a segment starting at (t0, s0) was decoded at engine step s0 + i - t0.
    requests: dict[tuple, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    # Model seconds requests waited in the queue from arrival to their first admission (a
    # retracted request's second wait is not counted): total (mean = total / admitted) and most.
    queue_wait_total_model_s: float = 0.0
    queue_wait_max_model_s: float = 0.0


class SimulatedEngine:
    """One simulated SGLang server. `await start()` serves it on `url`; `await kill()` is its
    death (or the end of a test); faults: `hang()`, `unhang()`, `slow_down(factor)`."""

    def __init__(self, settings: EngineSettings, timing: EngineTiming, clock: SimClock, *,
                 name: str = "engine", node: int = 0):
        self.settings = settings
        self.timing = timing
        self.clock = clock
        self.name = name
        self.node = node
        self.kv_capacity = (settings.max_total_tokens or timing.kv_capacity_tokens) \
            // settings.token_granularity
        self.stats = EngineStats()
        self.weight_version = settings.weight_version
        self.slowdown = 1.0
        self.paused = False
        self.alive = False
        self.url = ""
        self.port = 0
        self._hung: asyncio.Event | None = None  # set = answering; clear = hung
        self._queue: list[tuple[tuple[int, int], _Request]] = []
        self._running: dict[str, _Request] = {}
        self._finish_heap: list[tuple[int, int, int, _Request]] = []
        self._requests: dict[str, _Request] = {}
        self._context = 0  # KV tokens of the running requests
        self._step = 0
        self._cursor: float | None = None  # model time accounted for; None while idle
        self._ops: list[tuple[Callable[[], tuple[Any, float]], asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self._arrivals = itertools.count()
        self._session_open = False
        self._groups: set[str] = set()

    # ------------------------------------------------------------------ life

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on `host`:`port` (0: a port the kernel picks, bound at once) and return the
        URL. A killed engine starts again fresh (no requests, its start-up weight version)."""
        if self.alive:
            raise RuntimeError(f"simulated engine {self.name} is already serving at {self.url}")
        self._reset()
        self._wake = asyncio.Event()
        self._hung = asyncio.Event()
        self._hung.set()
        app = web.Application(middlewares=[self._auth], client_max_size=1 << 30)
        app.add_routes(self._routes())
        # handler_cancellation: a client that goes away aborts its request (as SGLang does);
        # shutdown_timeout 1 ms: a killed engine drops its connections at once (0 would mean no
        # limit to aiohttp: a kill would wait for every client with a request in flight to
        # give up).
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1e-3,
                               access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=4096)
        await site.start()
        self._runner = runner
        self.port = runner.addresses[0][1]
        self.url = f"http://{host}:{self.port}"
        self.alive = True
        self._loop_task = asyncio.create_task(self._scheduler(), name=f"{self.name}-scheduler")
        return self.url

    async def kill(self) -> None:
        """The engine dies: its port closes, open connections drop (clients see a broken
        connection, then a refused one), every request is lost."""
        if not self.alive:
            return
        self.alive = False
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for request in self._requests.values():  # before the cleanup: its handlers end now
            if not request.future.done():
                request.future.cancel()
                self.stats.dropped += 1
        for _, future in self._ops:
            if not future.done():
                future.cancel()
        if self._runner is not None:
            await self._runner.cleanup()  # cancels the handlers, closes their connections
        self._reset()
        self._runner = self._loop_task = None

    close = kill

    def hang(self) -> None:
        """Stop answering: no endpoint replies (health included) and decoding stops; TCP
        connections are still accepted, as by a wedged process."""
        self._hung.clear()
        self._wake.set()  # stop at the current step

    def unhang(self) -> None:
        self._hung.set()
        self._wake.set()

    def slow_down(self, factor: float) -> None:
        """Every step and transfer takes `factor` times as long (1.0: normal again)."""
        if factor <= 0:
            raise ValueError(f"slow_down factor {factor} must be > 0")
        self.slowdown = factor
        self._wake.set()  # from the current step on, not after the chunk under way

    @property
    def hung(self) -> bool:
        """Whether it stopped answering (`hang()`), until `unhang()` or its death."""
        return self.alive and self._hung is not None and not self._hung.is_set()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    def _reset(self) -> None:
        self._queue, self._running, self._finish_heap, self._requests = [], {}, [], {}
        self._ops = []
        self._context = self._step = 0
        self._cursor = None
        self.paused = self._session_open = False
        self.weight_version = self.settings.weight_version
        self._groups = set()

    # ------------------------------------------------------------------ scheduler

    def _submit(self, op: Callable[[], tuple[Any, float]]) -> asyncio.Future:
        """Run `op` in the scheduler at the current step boundary; it returns (answer, model
        seconds the engine is then busy). The future has the answer once that time passed."""
        future = asyncio.get_running_loop().create_future()
        self._ops.append((op, future))
        self._wake.set()
        return future

    async def _scheduler(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._hung.is_set():
                await self._hung.wait()
                if self._cursor is not None:  # no progress while it hung: nothing to catch up
                    self._cursor = self.clock.now()
            if self._ops:
                await self._run_ops()
                continue
            if self.paused or not (self._running or self._queue):
                self._cursor = None  # idle: model time passes without work
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._cursor is None:
                self._cursor = self.clock.now()
            prefill = self._admit()
            if prefill:
                await self._busy(self.timing.prefill_seconds(
                    prefill * self.settings.token_granularity) * self.slowdown)
                continue
            if not self._running:
                if self._queue:  # its head does not fit even an empty cache
                    self._refuse_oversized()
                continue
            await self._decode_chunk(loop)

    async def _busy(self, model_seconds: float) -> None:
        """The engine works `model_seconds` (prefill, a weight load) without being interrupted."""
        start = self._cursor if self._cursor is not None else self.clock.now()
        self._cursor = start + model_seconds
        self.stats.busy_model_s += model_seconds
        await self.clock.sleep_until(self._cursor)

    async def _run_ops(self) -> None:
        ops, self._ops = self._ops, []
        busy, answers = 0.0, []
        for op, future in ops:
            try:
                answer, seconds = op()
            except Exception as exc:  # an answer for the HTTP handler, which reports it
                answers.append((future, exc))
                continue
            busy += seconds
            answers.append((future, answer))
        if busy:
            await self._busy(busy * self.slowdown)
        for future, answer in answers:
            if future.done():
                continue
            if isinstance(answer, Exception):
                future.set_exception(answer)
            else:
                future.set_result(answer)

    async def _decode_chunk(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = len(self._running)
        room = self.kv_capacity - self._context
        if room < batch:  # the next step would overflow the KV cache
            self._retract_one()
            return
        steps = min(room // batch, self.settings.max_chunk_steps)
        while self._finish_heap:
            finish_step, _, segment, request = self._finish_heap[0]
            if request.done or request.segment != segment or request.segment_start < 0:
                heapq.heappop(self._finish_heap)  # finished, aborted or retracted since
                continue
            steps = min(steps, finish_step - self._step)
            break
        steps = max(steps, 1)
        granularity, slowdown = self.settings.token_granularity, self.slowdown
        step_s = self.timing.decode_step_seconds(
            batch, (self._context + batch * (steps - 1) / 2) * granularity) \
            * granularity * slowdown
        target = self._cursor + steps * step_s
        delay = self.clock.wall_delay(target - self.clock.now())
        if delay > 0:
            self._wake.clear()
            timer = loop.call_later(delay, self._wake.set)
            await self._wake.wait()
            timer.cancel()
        else:  # behind the clock (a loaded CPU): catch up, but let the other engines run
            await asyncio.sleep(0)
        now = self.clock.now()
        self.stats.max_lag_model_s = max(self.stats.max_lag_model_s, now - target)
        done = steps if now >= target else min(steps, int((now - self._cursor) / step_s))
        if done < steps and self.slowdown != slowdown:
            # The rate changed mid-step: the partial step at the old rate is not caught up at
            # the new one (after a crawl, that would be a burst of free steps).
            self._cursor = now - done * step_s
        if done == 0:
            return
        self._cursor = target if done == steps else self._cursor + done * step_s
        self._step += done
        self._context += batch * done
        self.stats.decode_steps += done
        self.stats.decode_tokens += batch * done
        self.stats.busy_model_s += done * step_s
        self.stats.max_batch = max(self.stats.max_batch, batch)
        while self._finish_heap and self._finish_heap[0][0] <= self._step:
            _, _, segment, request = heapq.heappop(self._finish_heap)
            if not request.done and request.segment == segment and request.segment_start >= 0:
                self._finish(request, self._finish_reason(request))

    def _admit(self) -> int:
        """Admit queued requests while a slot is free and their KV fits; the tokens to prefill."""
        prefill = 0
        while self._queue and len(self._running) < self.settings.max_running_requests:
            request = self._queue[0][1]
            if request.done:
                heapq.heappop(self._queue)
                continue
            tokens = len(request.input_ids) + request.generated
            # Room for the prompt and one decode step of the whole batch it joins.
            if self._context + tokens + len(self._running) + 1 > self.kv_capacity:
                break
            heapq.heappop(self._queue)
            if request.segment == 0:
                self.stats.admission_order.append(request.rid)
                self._count_priority(request)
                # The step boundary it is admitted at; an engine behind the clock can be at a
                # model time before the arrival's (that wait is 0).
                wait = max(0.0, self._cursor - request.queued_model_s)
                self.stats.queue_wait_total_model_s += wait
                self.stats.queue_wait_max_model_s = max(self.stats.queue_wait_max_model_s, wait)
            request.segment += 1
            request.segment_start = self._step
            if self.settings.record_requests:
                request.starts.append((request.generated, self._step))
            if not request.spans or request.spans[-1][0] != self.weight_version:
                request.spans.append([self.weight_version, request.generated])
            self._running[request.rid] = request
            self._context += tokens
            prefill += tokens
            heapq.heappush(self._finish_heap, (self._step + request.length - request.generated,
                                               request.arrival, request.segment, request))
        self.stats.prefill_tokens += prefill
        return prefill

    def _count_priority(self, request: _Request) -> None:
        """EngineStats' priority counters at `request`'s first admission (it has just left the
        queue)."""
        if self._queue and self._queue[0][1].priority > request.priority \
                and not self._queue[0][1].done:
            self.stats.admitted_past_priority += 1
        if request.priority > 0:
            self.stats.priority_admissions += 1
            self.stats.priority_overtaken += sum(
                1 for _, waiting in self._queue if not waiting.done
                and waiting.priority < request.priority and waiting.arrival < request.arrival)

    def _refuse_oversized(self) -> None:
        request = heapq.heappop(self._queue)[1]
        if not request.done:
            request.done = True
            request.future.set_exception(web.HTTPBadRequest(
                text=f"request {request.rid}: its {len(request.input_ids) + request.generated} "
                     f"input tokens exceed the KV cache ({self.kv_capacity} tokens, "
                     "max_total_tokens)"))

    def _retract_one(self) -> None:
        """SGLang's retract_decode: the running request with the fewest output tokens (longest
        input on ties) goes back to the queue; its KV is dropped and recomputed when readmitted."""
        request = min(self._running.values(),
                      key=lambda r: (self._tokens_now(r), -len(r.input_ids)))
        self._stop_running(request)
        heapq.heappush(self._queue, (request.queue_key, request))
        self.stats.retractions += 1

    def _tokens_now(self, request: _Request) -> int:
        if request.segment_start < 0:
            return request.generated
        return request.generated + self._step - request.segment_start

    def _stop_running(self, request: _Request) -> None:
        if request.segment_start < 0:
            return
        tokens = self._tokens_now(request)
        self._context -= len(request.input_ids) + tokens
        request.generated = tokens
        request.segment_start = -1
        del self._running[request.rid]

    def _finish_reason(self, request: _Request) -> dict:
        if request.stop_token is not None:
            return {"type": "stop", "matched": request.stop_token}
        return {"type": "length", "length": request.length}

    def _finish(self, request: _Request, finish_reason: dict) -> None:
        self._stop_running(request)
        request.done = True
        self._requests.pop(request.rid, None)
        if finish_reason["type"] == "abort":
            self.stats.aborted += 1
        else:
            self.stats.finished += 1
        if not request.future.done():
            request.future.set_result(self._response(request, finish_reason))

    def _abort(self, request: _Request) -> None:
        if not request.done:
            self._finish(request, {"type": "abort", "message": "Abort request"})

    def _set_version(self, version: int) -> None:
        """Tokens decoded from the current step on carry `version`."""
        if version != self.weight_version:  # a sync labels it twice (the bucket, the call)
            self.stats.version_steps.append((self._step, version))
        self.weight_version = version
        for request in self._running.values():
            tokens = self._tokens_now(request)
            if request.spans[-1][1] == tokens:
                request.spans[-1][0] = version
            elif request.spans[-1][0] != version:
                request.spans.append([version, tokens])

    # ------------------------------------------------------------------ completions

    def _new_request(self, input_ids: list[int], sampling: dict, rid: str | None,
                     priority: int | None, want_input_logprobs: bool) -> _Request:
        arrival = next(self._arrivals)
        max_new = int(sampling.get("max_new_tokens", 128))
        if not input_ids or max_new < 1:
            raise web.HTTPBadRequest(text="a request needs input_ids and max_new_tokens >= 1")
        stop_ids = tuple(int(t) for t in sampling.get("stop_token_ids") or ())
        seed = sampling.get("sampling_seed")
        key = (self.settings.random_seed, 0 if seed is None else 1,
               arrival if seed is None else int(seed) % (1 << 63))
        natural = self.settings.lengths.draw(np.random.default_rng((*key, 1)))
        stop_token = None
        if natural < max_new and not sampling.get("ignore_eos"):
            stops = (self.settings.eos_token_id, *stop_ids)
            stop_token = stops[arrival % len(stops)] if seed is None else stops[key[2] % len(stops)]
        length = min(natural, max_new)
        if priority is None or not self.settings.enable_priority_scheduling:
            priority = 0
        return _Request(rid=rid or f"{self.name}-{arrival}", input_ids=input_ids,
                        max_new_tokens=max_new, length=length, stop_token=stop_token,
                        priority=int(priority), arrival=arrival, token_seed=key,
                        future=asyncio.get_running_loop().create_future(),
                        stop_token_ids=stop_ids, want_input_logprobs=want_input_logprobs,
                        queued_model_s=self.clock.now())

    def _response(self, request: _Request, finish_reason: dict) -> dict:
        num_tokens = request.generated
        rng = np.random.default_rng((*request.token_seed, 2))
        ids = rng.integers(0, self.settings.vocab_size, size=request.length)
        logprobs = -rng.exponential(self.settings.mean_neg_logprob, size=request.length)
        # A stop token ends a completion: none may come before its last token.
        stops = {self.settings.eos_token_id, *request.stop_token_ids}
        ids[np.isin(ids, list(stops))] = next(t for t in itertools.count() if t not in stops)
        if request.stop_token is not None:
            ids[-1] = request.stop_token
        ids, logprobs = ids[:num_tokens].tolist(), np.round(logprobs[:num_tokens], 6).tolist()
        if self.settings.record_requests and finish_reason["type"] != "abort":
            self.stats.requests[(len(request.input_ids), tuple(ids[:16]))] = request.starts
        spans = []
        for (version, start), following in itertools.zip_longest(
                request.spans, request.spans[1:], fillvalue=None):
            end = num_tokens if following is None else following[1]
            if end > start:
                spans.append({"version": str(version), "start": start, "end": end})
        # SGLang's [log-prob, token id, text] per token: a million small lists for a fleet's
        # worth of long completions, whose allocation would set off full garbage collections
        # (4x slower); they hold no cycles, so collection is off while they are built.
        collecting = gc.isenabled()
        gc.disable()
        try:
            entries = [[lp, t, None] for lp, t in zip(logprobs, ids)]
        finally:
            if collecting:
                gc.enable()
        meta = {"id": request.rid, "finish_reason": finish_reason,
                "prompt_tokens": len(request.input_ids), "completion_tokens": num_tokens,
                "cached_tokens": 0, "weight_version": str(self.weight_version),
                "weight_versions": spans, "output_token_logprobs": entries}
        if request.want_input_logprobs:
            meta["input_token_logprobs"] = [[None if i == 0 else -self.settings.mean_neg_logprob,
                                             t, None] for i, t in enumerate(request.input_ids)]
        return {"text": "", "output_ids": ids, "meta_info": meta}

    # ------------------------------------------------------------------ HTTP

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        await self._hung.wait()  # a hung engine answers nothing
        key = self.settings.api_key
        if key is not None and request.path not in OPEN_PATHS \
                and request.headers.get("Authorization") != f"Bearer {key}":
            return web.json_response({"error": {"message": "Unauthorized"}}, status=401)
        return await handler(request)

    def _routes(self) -> list:
        post = {"/generate": self._generate, "/abort_request": self._abort_request,
                "/pause_generation": self._pause, "/continue_generation": self._continue,
                "/update_weight_version": self._update_weight_version,
                "/begin_weight_update": self._begin_weight_update,
                "/end_weight_update": self._end_weight_update,
                "/init_weights_update_group": self._init_group,
                "/destroy_weights_update_group": self._destroy_group,
                "/update_weights_from_distributed": self._update_from_distributed,
                "/update_weights_from_tensor": self._update_from_tensor,
                "/update_weights_from_disk": self._update_from_disk,
                "/flush_cache": self._flush_cache, "/freeze_gc": self._ok,
                "/release_memory_occupation": self._ok, "/resume_memory_occupation": self._ok}
        get = {"/health": self._health, "/health_generate": self._health_generate,
               "/ready": self._health, "/server_info": self._server_info,
               "/get_server_info": self._server_info, "/model_info": self._model_info,
               "/get_model_info": self._model_info, "/flush_cache": self._flush_cache}
        return [web.post(path, handler) for path, handler in post.items()] \
            + [web.get(path, handler) for path, handler in get.items()]

    @staticmethod
    def _json(body: Any, status: int = 200) -> web.Response:
        return web.Response(body=orjson.dumps(body), status=status,
                            content_type="application/json")

    async def _body(self, request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        body = await request.json(loads=orjson.loads)
        return body if isinstance(body, dict) else {}

    async def _generate(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        input_ids = body.get("input_ids")
        if not isinstance(input_ids, list) or not input_ids:
            raise web.HTTPBadRequest(text="/generate needs input_ids (token ids: this server "
                                          "runs with skip_tokenizer_init)")
        batched = isinstance(input_ids[0], list)
        prompts = input_ids if batched else [input_ids]
        sampling = body.get("sampling_params") or {}
        samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(prompts)
        if any(rid is not None and str(rid) in self._requests for rid in rids):
            raise web.HTTPBadRequest(text=f"rid {rids} is already in use on this engine")
        want_input = body.get("logprob_start_len") is not None and body.get("return_logprob")
        requests = [self._new_request([int(t) for t in ids], dict(sp),
                                      None if rid is None else str(rid), body.get("priority"),
                                      want_input)
                    for ids, sp, rid in zip(prompts, samplings, rids)]
        for request in requests:
            self._requests[request.rid] = request
            heapq.heappush(self._queue, (request.queue_key, request))
        self.stats.max_queued = max(self.stats.max_queued, len(self._queue))
        if len(self._running) < self.settings.max_running_requests:
            self._wake.set()  # a free slot: admit it at the next step, not after the chunk
        try:
            outputs = await asyncio.gather(*(r.future for r in requests))
        except asyncio.CancelledError:
            # The client went away (or the engine is dying): SGLang aborts its requests, at the
            # scheduler's next step boundary (the running batch changes only there).
            if self.alive:
                self._submit(lambda: ([self._abort(r) for r in requests], 0.0))
            raise
        return self._json(outputs if batched else outputs[0])

    async def _abort_request(self, http: web.Request) -> web.Response:
        body = await self._body(http)

        def op():
            if body.get("abort_all"):
                targets = list(self._requests.values())
            else:
                targets = [self._requests[body["rid"]]] if body.get("rid") in self._requests \
                    else []
            for request in targets:
                self._abort(request)
            return None, 0.0

        await self._submit(op)
        return self._json({"success": True})

    async def _pause(self, http: web.Request) -> web.Response:
        mode = (await self._body(http)).get("mode", "abort")
        if mode not in PAUSE_MODES:
            return self._json({"error": {"message": f"pause mode {mode!r} is not one of "
                                                    f"{PAUSE_MODES}"}}, status=400)

        def op():
            self.paused = True
            if mode == "abort":
                for request in list(self._requests.values()):
                    self._abort(request)
            elif mode == "retract":
                for request in list(self._running.values()):
                    self._stop_running(request)
                    heapq.heappush(self._queue, (request.queue_key, request))
                    self.stats.retractions += 1
            return None, 0.0

        await self._submit(op)
        return self._json({"success": True})

    async def _continue(self, http: web.Request) -> web.Response:
        def op():
            self.paused = False
            return None, 0.0

        await self._submit(op)
        return self._json({"success": True})

    async def _timed_update(self, seconds: float, version: Any) -> web.Response:
        def op():
            return None, seconds

        await self._submit(op)
        if version is not None:
            await self._submit(lambda: (self._set_version(int(version)), 0.0))
        return self._json({"success": True, "message": "Succeeded to update model weights."})

    async def _update_weight_version(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        version = int(body["new_version"])

        def op():
            if body.get("abort_all_requests", True):  # SGLang's default
                for request in list(self._requests.values()):
                    self._abort(request)
            self._set_version(version)
            return None, 0.0

        await self._submit(op)
        return self._json({"success": True, "message": "Weight version updated",
                           "new_version": str(version)})

    async def _begin_weight_update(self, http: web.Request) -> web.Response:
        if self._session_open:
            return self._json({"success": False, "message": f"{_STALE_SESSION}; end it first"})
        self._session_open = True
        return self._json({"success": True, "message": ""})

    async def _end_weight_update(self, http: web.Request) -> web.Response:
        self._session_open = False
        return self._json({"success": True, "message": ""})

    async def _init_group(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        self._groups.add(str(body.get("group_name")))
        await self._submit(lambda: (None, self.timing.init_group_seconds))
        return self._json({"success": True, "message": "Succeeded to initialize group."})

    async def _destroy_group(self, http: web.Request) -> web.Response:
        self._groups.discard(str((await self._body(http)).get("group_name")))
        return self._json({"success": True, "message": ""})

    async def _update_from_distributed(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        if body.get("group_name") not in self._groups:
            return self._json({"success": False, "message": f"weight-update group "
                               f"{body.get('group_name')!r} was not initialised on this engine "
                               "(/init_weights_update_group first)"})
        num_bytes = sum(math.prod(shape) * _DTYPE_BYTES.get(str(dtype).removeprefix("torch."), 2)
                        for shape, dtype in zip(body.get("shapes", []), body.get("dtypes", [])))
        return await self._timed_update(self.timing.weight_load_seconds(num_bytes),
                                        body.get("weight_version"))

    async def _update_from_tensor(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        # Colocated: handles to tensors already in device memory; the copy runs at HBM speed.
        num_bytes = sum(len(s) for s in body.get("serialized_named_tensors", []))
        seconds = num_bytes / self.timing.profile.accelerator.hbm_bytes_per_s
        return await self._timed_update(seconds, body.get("weight_version"))

    async def _update_from_disk(self, http: web.Request) -> web.Response:
        body = await self._body(http)
        return await self._timed_update(self.timing.disk_load_seconds(),
                                        body.get("weight_version"))

    async def _flush_cache(self, http: web.Request) -> web.Response:
        if self._requests:
            return web.Response(status=400, text="Cache not flushed because there are pending "
                                                 "requests")
        return web.Response(text="Cache flushed.")

    async def _ok(self, http: web.Request) -> web.Response:
        return self._json({"success": True, "message": ""})

    async def _health(self, http: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _health_generate(self, http: web.Request) -> web.Response:
        await self._submit(lambda: (None, 0.0))  # answered once the scheduler turns over
        return web.Response(status=200)

    async def _server_info(self, http: web.Request) -> web.Response:
        await self._submit(lambda: (None, 0.0))  # the scheduler answers (a wedged one does not)
        return self._json({
            "tp_size": self.settings.tp_size, "max_running_requests":
                self.settings.max_running_requests, "max_total_tokens": self.kv_capacity,
            "enable_priority_scheduling": self.settings.enable_priority_scheduling,
            "weight_version": str(self.weight_version), "simulated": True,
            "internal_states": [{"num_running_reqs": len(self._running),
                                 "num_queue_reqs": len(self._queue)}]})

    async def _model_info(self, http: web.Request) -> web.Response:
        return self._json({"model_path": "simulated", "is_generation": True,
                           "weight_version": str(self.weight_version)})


class EngineFleet:
    """Many simulated engines in this process and event loop, `engines_per_node` to a node
    (a node loss kills them together)."""

    def __init__(self, num_engines: int, settings: EngineSettings, timing: EngineTiming,
                 clock: SimClock, *, engines_per_node: int = 8):
        if num_engines < 1 or engines_per_node < 1:
            raise ValueError(f"EngineFleet: num_engines={num_engines} and engines_per_node="
                             f"{engines_per_node} must be >= 1")
        self.engines = [SimulatedEngine(dataclasses.replace(settings,
                                                            random_seed=settings.random_seed + i),
                                        timing, clock, name=f"engine{i}",
                                        node=i // engines_per_node)
                        for i in range(num_engines)]

    @property
    def urls(self) -> list[str]:
        return [engine.url for engine in self.engines]

    async def start(self, host: str = "127.0.0.1") -> list[str]:
        await asyncio.gather(*(engine.start(host) for engine in self.engines))
        return self.urls

    async def close(self) -> None:
        await asyncio.gather(*(engine.kill() for engine in self.engines))

    async def lose_node(self, node: int) -> list[SimulatedEngine]:
        """Every engine of `node` dies at once; returns them."""
        lost = [engine for engine in self.engines if engine.node == node]
        if not lost:
            raise ValueError(f"no engine on node {node}; nodes 0..{self.engines[-1].node}")
        await asyncio.gather(*(engine.kill() for engine in lost))
        return lost

    async def __aenter__(self) -> "EngineFleet":
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def sum_stats(engines: Sequence[SimulatedEngine]) -> dict[str, float]:
    """Totals over engines (max_batch: the largest any engine reached)."""
    return {"max_batch": max(e.stats.max_batch for e in engines),
            "max_lag_model_s": max(e.stats.max_lag_model_s for e in engines),
            "queue_wait_max_model_s": max(e.stats.queue_wait_max_model_s for e in engines),
            "admitted": sum(len(e.stats.admission_order) for e in engines),
            "queue_wait_total_model_s": sum(e.stats.queue_wait_total_model_s for e in engines),
            **{name: sum(getattr(e.stats, name) for e in engines)
               for name in ("decode_steps", "decode_tokens", "prefill_tokens", "retractions",
                            "finished", "aborted", "busy_model_s")}}
