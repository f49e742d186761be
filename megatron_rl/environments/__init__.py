"""Environments: what a trajectory is generated against (base.py; docs/environments.md)."""
from megatron_rl.environments.base import Environment, EnvironmentSession, Message, StepResult

__all__ = ["Environment", "EnvironmentSession", "Message", "StepResult"]
