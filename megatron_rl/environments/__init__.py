"""Environments: what a trajectory is generated against (base.py; docs/environments.md)."""
from megatron_rl.environments.base import Environment, EnvironmentSession, Message, StepResult
from megatron_rl.environments.python_tool import PythonToolEnvironment, ToolSettings
from megatron_rl.environments.registry import (
    TOOL_TASK_PREFIX,
    EnvironmentRegistry,
    default_environments,
    load_environment_modules,
)
from megatron_rl.environments.turns import (
    ChatTemplateTurns,
    PlainTurns,
    TurnFormat,
    stop_token_ids,
    turn_format_for,
)
from megatron_rl.environments.verifier import VerifierEnvironment

__all__ = [
    "TOOL_TASK_PREFIX",
    "ChatTemplateTurns",
    "Environment",
    "EnvironmentRegistry",
    "EnvironmentSession",
    "Message",
    "PlainTurns",
    "PythonToolEnvironment",
    "StepResult",
    "ToolSettings",
    "TurnFormat",
    "VerifierEnvironment",
    "default_environments",
    "load_environment_modules",
    "stop_token_ids",
    "turn_format_for",
]
