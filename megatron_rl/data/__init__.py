"""Prompt datasets: the typed record (prompt + task tag + what grading needs), loading and saving
(JSON Lines, Parquet), the deterministic held-out split, and prompt sources from installed
packages (reasoning-gym procedural tasks, HumanEval).
"""
from megatron_rl.data.loading import FORMATS, check_unique_ids, load_prompts, save_prompts
from megatron_rl.data.records import OVERALL_TASK, CodeTests, PromptRecord, StdioTest
from megatron_rl.data.sources import (
    PROCEDURAL_TASK_PREFIX,
    humaneval_prompts,
    reasoning_gym_prompts,
)
from megatron_rl.data.split import split_heldout

__all__ = [
    "FORMATS", "OVERALL_TASK", "PROCEDURAL_TASK_PREFIX", "CodeTests", "PromptRecord", "StdioTest",
    "check_unique_ids", "humaneval_prompts", "load_prompts", "reasoning_gym_prompts",
    "save_prompts", "split_heldout",
]
