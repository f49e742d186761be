"""Prompt datasets: the typed record (prompt + task tag + what grading needs), loading (JSON
Lines, Parquet, saved `datasets` splits; our layout, verl's, question/answer) and saving, the
deterministic held-out split, and prompt sources from installed packages (reasoning-gym procedural
tasks, HumanEval). A run's prompts: megatron_rl.data.run_prompts (it reads the run config).
"""
from megatron_rl.data.loading import (
    FORMATS,
    PromptFile,
    PromptFileError,
    check_unique_ids,
    load_prompts,
    read_prompt_file,
    save_prompts,
)
from megatron_rl.data.records import OVERALL_TASK, ChatMessage, CodeTests, PromptRecord, StdioTest
from megatron_rl.data.sources import (
    PROCEDURAL_TASK_PREFIX,
    humaneval_prompts,
    reasoning_gym_prompts,
)
from megatron_rl.data.split import split_heldout

__all__ = [
    "FORMATS", "OVERALL_TASK", "PROCEDURAL_TASK_PREFIX", "ChatMessage", "CodeTests", "PromptFile",
    "PromptFileError", "PromptRecord", "StdioTest", "check_unique_ids", "humaneval_prompts",
    "load_prompts", "read_prompt_file", "reasoning_gym_prompts", "save_prompts", "split_heldout",
]
