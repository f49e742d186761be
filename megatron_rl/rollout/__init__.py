"""Generators for RL rollouts: the Generator interface, its SGLang implementation (server
launch, health, HTTP client, pause / continue, weight-update endpoints) and the typed messages
they exchange. Importing this package imports neither SGLang nor Megatron."""
from megatron_rl.rollout.generator import Generator
from megatron_rl.rollout.sglang_server import (SGLangGenerator, SGLangServer,
                                               SGLangServerSettings, wait_for_health)
from megatron_rl.rollout.types import (GenerationResult, GeneratorDeadError, GeneratorError,
                                       SamplingParams, TensorSpec, WeightUpdateGroup,
                                       logprob_mismatch)

__all__ = [
    "GenerationResult",
    "Generator",
    "GeneratorDeadError",
    "GeneratorError",
    "SGLangGenerator",
    "SGLangServer",
    "SGLangServerSettings",
    "SamplingParams",
    "TensorSpec",
    "WeightUpdateGroup",
    "logprob_mismatch",
    "wait_for_health",
]
