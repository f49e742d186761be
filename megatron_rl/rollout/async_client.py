"""An asyncio client for one SGLang server: one completion per request, for the rollout manager,
which runs every sample as its own small state machine (forced interruption continues a sample
with a second request) and so needs many requests in flight from one event loop.

Requests and responses are those of `SGLangGenerator.generate` (token ids in and out, per-token
log-probs and policy versions); `extra_key` namespaces SGLang's prefix cache (the group's
admission version: cached KV of other policy versions is never reused). Errors name the server.

A connection that breaks before a response arrives is retried (`connection_retries` times, with
backoff) before the server counts as dead: an HTTP server closes idle keep-alive connections
(uvicorn after 5 s, e.g. across a weight update's pause), and a request sent on one at that moment
fails with "Can not write request body" although the server is fine. A request the server did
receive and then lost its connection is generated twice; the result kept is the retry's, with its
own log-probs and versions. The client also drops its own idle connections after
KEEPALIVE_S, sooner than the server does, which avoids most of these races.

The client also keeps the generator's activity for the run's metrics (`activity()`): how long at
least one request was in flight (the engine had work; a weight update's pause is subtracted by
the caller, who knows it) and how many tokens came back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

from megatron_rl.rollout.sglang_server import _generation_result
from megatron_rl.rollout.types import (GenerationResult, GeneratorDeadError, GeneratorError,
                                       SamplingParams)

KEEPALIVE_S = 2.0  # below uvicorn's 5 s keep-alive timeout (SGLang's HTTP server)


@dataclasses.dataclass(frozen=True, slots=True)
class GeneratorActivity:
    """Cumulative counters of one generator client (differences of two give a window)."""

    busy_s: float  # wall time with at least one request in flight
    tokens: int  # completion tokens returned
    requests: int  # requests answered

    def __sub__(self, other: "GeneratorActivity") -> "GeneratorActivity":
        return GeneratorActivity(self.busy_s - other.busy_s, self.tokens - other.tokens,
                                 self.requests - other.requests)


class AsyncSGLangClient:
    """Use inside a running event loop; `close()` (or `async with`) releases its connections."""

    def __init__(self, url: str, *, request_timeout_s: float = 300.0,
                 connection_retries: int = 3, backoff_s: float = 0.2,
                 return_routed_experts: bool = False):
        self.url = url.rstrip("/")
        # Routing replay: every result carries its positions' routed experts (the server must
        # run with enable_return_routed_experts).
        self.return_routed_experts = return_routed_experts
        self.request_timeout_s = request_timeout_s
        self.connection_retries = connection_retries
        self.backoff_s = backoff_s
        self.reconnects = 0  # requests resent after a broken connection (all time)
        self._session = None
        self._in_flight = 0
        self._busy_since = 0.0
        self._busy_s = 0.0
        self._tokens = 0
        self._requests = 0

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
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self):
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
                connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S))
        return self._session

    async def generate_one(self, input_ids: Sequence[int], max_new_tokens: int,
                           params: SamplingParams, *,
                           extra_key: str | None = None) -> GenerationResult:
        """One completion of `input_ids` of at most `max_new_tokens` tokens, sampled with
        `params` (its max_new_tokens and num_samples are not used; seed is)."""
        sampling = params.to_sglang()
        sampling["max_new_tokens"] = int(max_new_tokens)
        payload = {"input_ids": [int(t) for t in input_ids], "sampling_params": sampling,
                   "return_logprob": True}
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
                if attempt == self.connection_retries:
                    raise GeneratorDeadError(
                        f"SGLang server {self.url} does not answer /generate (after "
                        f"{attempt + 1} attempts): {exc.__class__.__name__}: {exc}") from None
                self.reconnects += 1
                await asyncio.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    async def _post_generate_once(self, payload: dict,
                                  input_ids: Sequence[int]) -> GenerationResult:
        try:
            async with self._client().post(f"{self.url}/generate", json=payload) as response:
                if response.status >= 400:
                    raise GeneratorError(f"SGLang server {self.url}: /generate failed with HTTP "
                                         f"{response.status}: {(await response.text())[:2000]}")
                out = await response.json()
        except TimeoutError:  # a hung server: the same recovery as a dead one
            raise GeneratorDeadError(f"SGLang server {self.url}: /generate timed out after "
                                     f"{self.request_timeout_s:.0f} s") from None
        if not isinstance(out, dict) or "meta_info" not in out:
            raise GeneratorError(f"SGLang server {self.url}: /generate returned "
                                 f"{type(out).__name__}, not one completion")
        return _generation_result(out, input_ids, 0, 0, self.url,
                                  routed_experts=self.return_routed_experts)
