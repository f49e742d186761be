"""How much simulated-engine load one process carries: N simulated SGLang engines
(megatron_rl/simulation/engine.py) served in this process and event loop, each sent R requests
through the REAL AsyncSGLangClient (at most --in-flight at a time per engine: each request
in flight holds a connection, two file descriptors in this process, client and server side, and
the open-file limit here is 20000), completions drawn lognormal (median M tokens, sigma S,
capped at max_new_tokens). Prints the wall time, the tokens and requests per wall second, the
model time the simulated clock covered, the largest batch an engine reached and the engines'
busy share of that model time (low: the process, not the engines, set the pace).

    python benchmarks/simulated_fleet.py --engines 64 --requests 1000 --median-tokens 256

The wall time is dominated by the per-token work of the real client (JSON decoding of SGLang's
[log-prob, id, text] triples and its parsing of them, ~5 us a token on one core), not by the
engines' scheduling: size a scale test by its total tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import time


async def run(args: argparse.Namespace) -> dict:
    from megatron_rl.rollout.async_client import AsyncSGLangClient
    from megatron_rl.rollout.types import SamplingParams
    from megatron_rl.scaling.cost import PRESETS
    from megatron_rl.simulation import EngineTiming, SimClock, get_profile
    from megatron_rl.simulation.engine import (CompletionLengths, EngineFleet, EngineSettings,
                                               sum_stats)

    profile = get_profile(args.hardware)
    timing = EngineTiming(model=profile.cost_config(PRESETS[args.preset]), profile=profile)
    settings = EngineSettings(lengths=CompletionLengths(median_tokens=args.median_tokens,
                                                        sigma=args.sigma),
                              token_granularity=args.token_granularity)
    clock = SimClock(args.time_scale)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    prompt = list(range(1, args.prompt_tokens + 1))
    async with EngineFleet(args.engines, settings, timing, clock) as fleet:
        clients = [AsyncSGLangClient(url) for url in fleet.urls]
        gc.freeze()  # start-up objects: later collections walk only the completions
        began, model_began = time.perf_counter(), clock.now()
        async def one(client: AsyncSGLangClient, slots: asyncio.Semaphore):
            async with slots:
                return await client.generate_one(prompt, args.max_new_tokens, params)

        try:
            results = await asyncio.gather(*(
                one(client, slots) for client in clients
                for slots in [asyncio.Semaphore(args.in_flight)] for _ in range(args.requests)))
        finally:
            for client in clients:
                await client.close()
        wall = time.perf_counter() - began
        stats = sum_stats(fleet.engines)
    tokens = sum(len(r.token_ids) for r in results)
    return {"engines": args.engines, "requests": len(results), "tokens": tokens,
            "wall_s": wall, "tokens_per_wall_s": tokens / wall,
            "requests_per_wall_s": len(results) / wall, "model_s": clock.now() - model_began,
            "max_batch": stats["max_batch"], "retractions": stats["retractions"],
            "max_lag_model_s": stats["max_lag_model_s"],
            "decode_busy_share": stats["busy_model_s"] / (args.engines
                                                          * (clock.now() - model_began))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1000, help="per engine")
    parser.add_argument("--in-flight", type=int, default=100, help="per engine")
    parser.add_argument("--median-tokens", type=float, default=256.0)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--max-new-tokens", type=int, default=32768)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--time-scale", type=float, default=1000.0)
    parser.add_argument("--token-granularity", type=int, default=1,
                        help="model tokens per returned token (EngineSettings)")
    parser.add_argument("--hardware", default="H100")
    parser.add_argument("--preset", default="paper-8b")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    for name, value in result.items():
        print(f"{name:>20}: {value:,.2f}" if isinstance(value, float) else
              f"{name:>20}: {value:,}")


if __name__ == "__main__":
    main()
