"""An asyncio client for one SGLang server: one completion per request, for the rollout manager,
which runs every sample as its own small state machine (forced interruption continues a sample
with a second request) and so needs many requests in flight from one event loop.

Requests and responses are those of `SGLangGenerator.generate` (token ids in and out, per-token
log-probs and policy versions); `extra_key` namespaces SGLang's prefix cache (the group's
admission version: cached KV of other policy versions is never reused). Errors name the server.
Every request carries the engine's API key (`api_key`, SGLangServerSettings.api_key) when it has
one.

A connection that breaks before a response arrives is retried (`connection_retries` times, with
backoff) before the server counts as dead: an HTTP server closes idle keep-alive connections
(uvicorn after 5 s, e.g. across a weight update's pause), and a request sent on one at that moment
fails with "Can not write request body" although the server is fine. A request the server did
receive and then lost its connection is generated twice; the result kept is the retry's, with its
own log-probs and versions. The client also drops its own idle connections after
KEEPALIVE_S, sooner than the server does, which avoids most of these races.

The engine, not the client, holds the queue: the client opens one connection per request in
flight, with no cap (aiohttp's pool limits, total and per host, are off). A capped pool would
hold the requests beyond its size first-in-first-out in the client: an engine would never batch
more than the pool's size, and a continuation (rollout.continuations_first, SGLang priority)
would wait behind every fresh request queued there instead of going first at the engine. The
driver holds one socket per request in flight across its engines (ScaleRL's default: (k + 1) x
48 groups x 16 training requests, plus a validation's 1000 x 16), so `reserve_open_files`
raises the process's open-file limit at the start of a run, and a request that meets the
limit anyway fails naming it, not the engine (which would be taken out as dead).

The client also keeps the generator's activity for the run's metrics (`activity()`): how long at
least one request was in flight (the engine had work; a weight update's pause is subtracted by
the caller, who knows it) and how many tokens came back.

A request has no time limit of its own by default: its wall time is queueing behind every other
request on the engine (validation sends thousands at once), decoding up to 32k tokens and
weight-update pauses, so no per-request bound tells a slow engine from a hung one. Liveness is
judged per engine, from progress (`progress()`, `probe()`; the rollout manager's
`check_liveness` decides): the last time any of its requests was answered, or SGLang's
/health_generate confirmed a completed forward step. A caller may still set
`request_timeout_s`; its expiry is a GeneratorError (the request took too long), never a death.
"""
from __future__ import annotations

import asyncio
import dataclasses
import errno
import time
from collections.abc import Sequence

from megatron_rl.rollout.sglang_server import (_generation_result, auth_headers,
                                               unauthorized_message)
from megatron_rl.rollout.types import (GenerationResult, GeneratorDeadError, GeneratorError,
                                       SamplingParams)

KEEPALIVE_S = 2.0  # below uvicorn's 5 s keep-alive timeout (SGLang's HTTP server)
# A server that does not even accept a TCP connection this long is not answering (the kernel
# accepts connections for a busy server); it counts like a broken connection (retried, then dead).
CONNECT_TIMEOUT_S = 30.0
# Open files of the driver besides its requests' sockets: Ray's connections, logs, verifier
# workers' pipes, the probe connections, the weight-update calls.
RESERVED_OPEN_FILES = 1024


def reserve_open_files(num_requests: int, *, sandbox_files: int = 0) -> int:
    """Make room for `num_requests` requests in flight at once in this process (one socket
    each), `sandbox_files` (the code sandbox's pipes with all its workers busy:
    Sandbox.max_open_files) and RESERVED_OPEN_FILES: the soft RLIMIT_NOFILE is raised as far as
    needed (an unprivileged process may, up to the hard limit). Returns the soft limit; a hard
    limit too low is an error naming the fix."""
    import resource

    needed = num_requests + sandbox_files + RESERVED_OPEN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:
        sandbox = (f", the code sandbox's programs up to {sandbox_files} pipe ends"
                   if sandbox_files else "")
        raise RuntimeError(
            f"up to {num_requests} generation requests may be in flight at once, one socket "
            f"each{sandbox}, but this process may open at most {hard} files (hard "
            f"RLIMIT_NOFILE); raise it to at least {needed} (`ulimit -Hn`, "
            "/etc/security/limits.conf, docker run --ulimit nofile=...) or lower the requests "
            "in flight (rollout.max_off_policyness, train.global_batch_size, "
            "eval.num_heldout_prompts, eval.samples_per_prompt)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    return needed


@dataclasses.dataclass(frozen=True, slots=True)
class GeneratorProgress:
    """One engine's liveness as the client saw it, at one moment (`AsyncSGLangClient.progress`)."""

    in_flight: int  # requests sent and not answered
    since_progress_s: float  # since the last answer, successful probe, or start of work


@dataclasses.dataclass(frozen=True, slots=True)
class GeneratorActivity:
    """Cumulative counters of one generator client (differences of two give a window)."""

    busy_s: float  # wall time with at least one request in flight
    tokens: int  # completion tokens returned
    requests: int  # requests answered

    def __sub__(self, other: "GeneratorActivity") -> "GeneratorActivity":
        return GeneratorActivity(self.busy_s - other.busy_s, self.tokens - other.tokens,
                                 self.requests - other.requests)


def activities(clients: Sequence) -> list:
    """(client, its cumulative GeneratorActivity) per engine, for `activity_since`."""
    return [(client, client.activity()) for client in clients]


def activity_since(now: list, before: list) -> list[GeneratorActivity]:
    """Each engine's activity between two `activities` readings: the difference for a client
    read both times; all of a client made in between (its engine restarted: the new client
    counts from zero, and the old one's counters ended with it)."""
    return [a - b if client is old else a for (client, a), (old, b) in zip(now, before)]


class AsyncSGLangClient:
    """Use inside a running event loop; `close()` (or `async with`) releases its connections."""

    def __init__(self, url: str, *, api_key: str | None = None,
                 request_timeout_s: float | None = None, connection_retries: int = 3,
                 backoff_s: float = 0.2, return_routed_experts: bool = False):
        self.url = url.rstrip("/")
        self._headers = auth_headers(api_key)  # the engine's API key (SGLangServerSettings)
        # Routing replay: every result carries its positions' routed experts (the server must
        # run with enable_return_routed_experts).
        self.return_routed_experts = return_routed_experts
        self.request_timeout_s = request_timeout_s
        self.connection_retries = connection_retries
        self.backoff_s = backoff_s
        self.reconnects = 0  # requests resent after a broken connection (all time)
        self._session = None
        self._probe_session = None  # its own connection: never queued behind the requests
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self._tokens = 0
        self._requests = 0
        self._last_progress = time.monotonic()

    def progress(self) -> GeneratorProgress:
        """Requests in flight and the time since this engine last showed progress: one of its
        requests answered (with an HTTP status: the server is serving), a `probe` passed, or it
        was given work while idle (its no-progress time starts then)."""
        return GeneratorProgress(self._in_flight, time.monotonic() - self._last_progress)

    async def probe(self, timeout_s: float) -> str | None:
        """SGLang's own liveness check, GET /health_generate: 200 once the scheduler completes a
        forward step (busy), or a one-token generation (idle), within SGLang's health window
        (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s); 503 otherwise. None when it passed (progress is
        recorded), else why not."""
        import aiohttp

        if self._probe_session is None:
            self._probe_session = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(force_close=True))
        try:
            async with self._probe_session.get(
                    f"{self.url}/health_generate",
                    timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
                if response.status == 200:
                    self._last_progress = time.monotonic()
                    return None
                return (f"/health_generate answered HTTP {response.status}: "
                        f"{(await response.text())[:200]}")
        except TimeoutError:
            return f"/health_generate did not answer within {timeout_s:g} s"
        except aiohttp.ClientError as exc:
            return f"/health_generate failed: {type(exc).__name__}: {exc}"

    def activity(self) -> GeneratorActivity:
        """The counters now (safe to call from another thread: a torn read is off by one
        request's bookkeeping at most)."""
        busy = self._busy_s
        if self._in_flight:
            busy += time.perf_counter() - self._busy_since
        return GeneratorActivity(busy, self._tokens, self._requests)

    def _request_started(self) -> None:
        if self._in_flight == 0:
            self._busy_since = time.perf_counter()
            self._last_progress = time.monotonic()  # idle until now: nothing was overdue
        self._in_flight += 1

    def _request_ended(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._busy_s += time.perf_counter() - self._busy_since

    async def __aenter__(self) -> "AsyncSGLangClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for session in (self._session, self._probe_session):
            if session is not None:
                await session.close()
        self._session = self._probe_session = None

    def _client(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s,
                                              sock_connect=CONNECT_TIMEOUT_S),
                # One connection per request in flight, no cap: the engine holds the queue
                # (module docstring). 0 lifts aiohttp's total and per-host pool limits.
                connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S, limit=0,
                                               limit_per_host=0))
        return self._session

    async def generate_one(self, input_ids: Sequence[int], max_new_tokens: int,
                           params: SamplingParams, *, extra_key: str | None = None,
                           priority: int | None = None) -> GenerationResult:
        """One completion of `input_ids` of at most `max_new_tokens` tokens, sampled with
        `params` (its max_new_tokens and num_samples are not used; seed is). `priority`: SGLang's
        request priority (higher first on a server with priority scheduling; ignored by one
        without)."""
        sampling = params.to_sglang()
        sampling["max_new_tokens"] = int(max_new_tokens)
        payload = {"input_ids": [int(t) for t in input_ids], "sampling_params": sampling,
                   "return_logprob": True}
        if priority is not None:
            payload["priority"] = int(priority)
        if self.return_routed_experts:
            payload["return_routed_experts"] = True
        if extra_key is not None:
            payload["extra_key"] = extra_key
        self._request_started()
        try:
            result = await self._post_generate(payload, input_ids)
        finally:
            self._request_ended()
        self._tokens += len(result.token_ids)
        self._requests += 1
        return result

    async def _post_generate(self, payload: dict, input_ids: Sequence[int]) -> GenerationResult:
        import aiohttp

        for attempt in range(self.connection_retries + 1):
            try:
                return await self._post_generate_once(payload, input_ids)
            except aiohttp.ClientConnectionError as exc:
                if getattr(exc, "errno", None) == errno.EMFILE:  # this process, not the server
                    raise GeneratorError(
                        f"no socket for a request to {self.url}: this process has as many open "
                        "files as RLIMIT_NOFILE allows (one per request in flight); raise the "
                        "limit (async_client.reserve_open_files, `ulimit -n`) or lower the "
                        "requests in flight") from exc
                if attempt == self.connection_retries:
                    raise GeneratorDeadError(
                        f"SGLang server {self.url} does not answer /generate (after "
                        f"{attempt + 1} attempts): {exc.__class__.__name__}: {exc}") from None
                self.reconnects += 1
                await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _post_generate_once(self, payload: dict,
                                  input_ids: Sequence[int]) -> GenerationResult:
        import aiohttp

        try:
            async with self._client().post(f"{self.url}/generate", json=payload) as response:
                self._last_progress = time.monotonic()  # it answers: alive, whatever it says
                if response.status == 401:
                    raise GeneratorError(unauthorized_message(self.url, "POST /generate",
                                                              bool(self._headers)))
                if response.status >= 400:
                    raise GeneratorError(f"SGLang server {self.url}: /generate failed with HTTP "
                                         f"{response.status}: {(await response.text())[:2000]}")
                out = await response.json()
        except aiohttp.ServerTimeoutError:
            raise  # no connection within CONNECT_TIMEOUT_S: retried like a broken one
        except TimeoutError:  # the caller's own ceiling, not a sign of death
            raise GeneratorError(
                f"SGLang server {self.url}: a /generate request took longer than its "
                f"request_timeout_s={self.request_timeout_s:g} s (queueing + decoding + "
                "pauses); raise or unset it: generator liveness comes from progress "
                "(rollout.no_progress_timeout_s)") from None
        if not isinstance(out, dict) or "meta_info" not in out:
            raise GeneratorError(f"SGLang server {self.url}: /generate returned "
                                 f"{type(out).__name__}, not one completion")
        return _generation_result(out, input_ids, 0, 0, self.url,
                                  routed_experts=self.return_routed_experts)
