"""The simulated cluster: SGLang engines and trainers whose timing is modelled (from the cost
model's formulas and a hardware profile) on a fast simulated clock, so that the real control
plane (the async client, the rollout manager, the driver) runs at production scale on a CPU.

- profiles.py: hardware profiles (H100, H200, B200, GB200, H20 from scaling/hardware.py; `cpu`,
  measured on this machine by benchmarks/cpu_profile.py) with the links a weight push and a
  checkpoint use;
- measured.py: a measured profile's fitted times, used in place of the cost model's roofline;
- clock.py: the shared simulated clock (model time = wall time x time_scale);
- timing.py: an engine's decode / prefill / weight-load times and KV capacity;
- engine.py: the simulated SGLang server (HTTP API, continuous batching, KV retraction,
  priority queue, per-token versions, faults) and a fleet of them in one process;
- trainer.py: the trainer group's score / train step / checkpoint / weight-push times.
- cluster.py: the simulated cluster behind cluster/backend.py's seam (generator pool over
  simulated engines, trainer group sleeping TrainerTiming's durations);
- simulate.py: `megatron-rl simulate RECIPE.yaml`, the real driver on the simulated cluster;
- anchors.py: the model shapes of the published async-vs-sync figures (benchmarks/
  simulated_anchors.py).
docs/simulation.md says what is modelled, what is not, and what is still to be built.
"""
from megatron_rl.simulation.clock import SimClock
from megatron_rl.simulation.profiles import PROFILES, HardwareProfile, get_profile
from megatron_rl.simulation.timing import EngineTiming
from megatron_rl.simulation.trainer import TrainerTiming

__all__ = ["PROFILES", "CompletionLengths", "EngineFleet", "EngineSettings", "EngineTiming",
           "HardwareProfile", "SimClock", "SimulatedEngine", "TrainerTiming", "get_profile"]


def __getattr__(name: str):
    # The engine imports aiohttp and the SGLang client module (torch): only when asked for.
    if name in ("CompletionLengths", "EngineFleet", "EngineSettings", "SimulatedEngine"):
        from megatron_rl.simulation import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
