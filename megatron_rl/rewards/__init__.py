"""Verifiable rewards: math answers (math-verify, timeout from any thread), code run in a sandbox
(namespaces, rlimits, unprivileged uid; stdin/stdout and HumanEval-style tests), reasoning-gym
procedural tasks, the registry that dispatches a completion to its reward by task tag, and the
accounting of verifier failures (no reward, group dropped, the run stops past a limit).
docs/rewards.md lists the reason codes and the sandbox's limits.
"""
from megatron_rl.rewards.code import (
    CodeReward,
    CodeRewardConfig,
    CodeTestReport,
    extract_code,
    outputs_match,
    run_code_tests,
)
from megatron_rl.rewards.failures import (
    VerifierFailureCounter,
    VerifierFailureError,
    reward_values,
)
from megatron_rl.rewards.math import MathVerifier, MathVerifyConfig, grade_math_answer
from megatron_rl.rewards.procedural import ProceduralReward, ProceduralRewardConfig
from megatron_rl.rewards.registry import (
    RewardFn,
    RewardRegistry,
    UnknownTaskError,
    default_registry,
)
from megatron_rl.rewards.sandbox import (
    ExecutionRequest,
    ExecutionResult,
    Sandbox,
    SandboxConfig,
    SandboxLimits,
)
from megatron_rl.rewards.types import (
    THINK_END,
    VERIFIER_FAILURES,
    Reason,
    RewardResult,
    RewardScale,
    final_answer,
    make_result,
)

__all__ = [
    "THINK_END", "VERIFIER_FAILURES", "CodeReward", "CodeRewardConfig", "CodeTestReport",
    "ExecutionRequest", "ExecutionResult", "MathVerifier", "MathVerifyConfig", "ProceduralReward",
    "ProceduralRewardConfig", "Reason", "RewardFn", "RewardRegistry", "RewardResult",
    "RewardScale", "Sandbox", "SandboxConfig", "SandboxLimits", "UnknownTaskError",
    "VerifierFailureCounter", "VerifierFailureError", "default_registry", "extract_code",
    "final_answer", "grade_math_answer", "make_result", "outputs_match", "reward_values",
    "run_code_tests",
]
