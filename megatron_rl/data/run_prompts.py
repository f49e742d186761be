"""The prompts of a training run, read before anything starts or is written: the records of
data.prompts (a prompt file in any accepted layout, docs/data.md, or `rg/<dataset>` generated),
checked against the reward registry, split into training and held-out prompts, and tokenized as
the policy sees them; and the check that the rollout budgets fit the model's context. Every
problem is a ConfigError, one line "WHERE: what is wrong; the fix" (the driver prints it and
exits with status 2), WHERE being the file and line (or row) of the offending prompt.

The registry is only read (its registrations): its verifiers need not be running.
"""
from __future__ import annotations

import dataclasses

from megatron_rl.config import ConfigError, RunConfig
from megatron_rl.data.loading import PromptFileError, read_prompt_file
from megatron_rl.data.records import PromptRecord
from megatron_rl.data.sources import PROCEDURAL_TASK_PREFIX, reasoning_gym_prompts
from megatron_rl.data.split import split_heldout
from megatron_rl.data.tokenizer import prompt_token_ids


@dataclasses.dataclass(frozen=True)
class RunPrompts:
    train_records: list[PromptRecord]
    heldout_records: list[PromptRecord]
    train_prompt_ids: list[list[int]]    # train_records[i] as token ids
    heldout_prompt_ids: list[list[int]]  # heldout_records[i] as token ids


def load_run_prompts(cfg: RunConfig, tokenizer, registry) -> RunPrompts:
    """The run's prompts, split and tokenized; ConfigError for any problem with them."""
    check_context_length(cfg)
    records, locations, source = _read_records(cfg)
    _check_gradable(records, locations, registry)
    num_heldout = cfg.eval.num_heldout_prompts
    if num_heldout >= len(records):
        raise ConfigError(f"eval.num_heldout_prompts: {num_heldout} held-out prompts leave none "
                          f"of the {len(records)} prompts of {source} to train on; set it below "
                          f"{len(records)} or give more prompts")
    token_ids = _tokenize(records, locations, tokenizer)
    _check_prompt_lengths(cfg, records, locations, token_ids)
    train, heldout = split_heldout(records, num_heldout=num_heldout, seed=_split_seed(cfg))
    ids_of = {record.prompt_id: ids for record, ids in zip(records, token_ids)}
    return RunPrompts(train_records=train, heldout_records=heldout,
                      train_prompt_ids=[ids_of[r.prompt_id] for r in train],
                      heldout_prompt_ids=[ids_of[r.prompt_id] for r in heldout])


def _split_seed(cfg: RunConfig) -> int:
    return cfg.seed if cfg.data.split_seed is None else cfg.data.split_seed


def check_context_length(cfg: RunConfig) -> None:
    """The longest request (rollout.max_prompt_tokens + thinking_budget + solution_budget) must
    fit the checkpoint's context (max_position_embeddings of its text model): SGLang refuses a
    longer one (HTTP 400) and every generation would fail."""
    from transformers import AutoConfig

    path = cfg.model.hf_checkpoint
    if path is None:
        return
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.hf_checkpoint: {path} has no config.json transformers can "
                          f"read ({exc}); give a Hugging Face model folder") from None
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    rollout = cfg.rollout
    if context is not None and rollout.max_sequence_tokens > context:
        raise ConfigError(
            f"rollout.max_prompt_tokens + rollout.thinking_budget + rollout.solution_budget = "
            f"{rollout.max_prompt_tokens} + {rollout.thinking_budget} + "
            f"{rollout.solution_budget} = {rollout.max_sequence_tokens} tokens, more than the "
            f"model's context of {context} (max_position_embeddings in {path}/config.json), so "
            "the generators would refuse every request; lower them to fit")


def _read_records(cfg: RunConfig) -> tuple[list[PromptRecord], list[str], str]:
    """(records, where each one is, the source in words)."""
    source = cfg.data.prompts
    if source.startswith(PROCEDURAL_TASK_PREFIX):
        try:
            records = reasoning_gym_prompts(source[len(PROCEDURAL_TASK_PREFIX):],
                                            num_prompts=cfg.data.num_generated_prompts,
                                            seed=_split_seed(cfg))
        except ValueError as exc:
            raise ConfigError(f"data.prompts: {exc}") from None
        locations = [f"data.prompts {source} item {index}" for index in range(len(records))]
        return records, locations, f"{source} (data.num_generated_prompts)"
    try:
        prompts = read_prompt_file(source)
    except PromptFileError as exc:
        raise ConfigError(str(exc)) from None
    return prompts.records, prompts.locations, source


def _check_gradable(records: list[PromptRecord], locations: list[str], registry) -> None:
    """Every prompt's task has a reward, and the prompt has what that reward needs."""
    from megatron_rl.rewards.registry import UnknownTaskError

    problems = []
    for record, where in zip(records, locations):
        try:
            missing = registry.missing_fields(record)
        except UnknownTaskError as exc:
            problems.append(f"{where}: {exc}")
            continue
        if missing:
            fields = " and ".join(f"'{name}'" for name in missing)
            problems.append(f"{where}: prompt {record.prompt_id!r} (task {record.task!r}) has no "
                            f"{fields}, which its reward needs; add it or remove the prompt")
    if problems:
        more = f" ({len(problems)} prompts cannot be graded)" if len(problems) > 1 else ""
        raise ConfigError(problems[0] + more)


def _tokenize(records: list[PromptRecord], locations: list[str], tokenizer) -> list[list[int]]:
    token_ids = []
    for record, where in zip(records, locations):
        try:
            token_ids.append(prompt_token_ids(tokenizer, record.conversation))
        except ValueError as exc:  # a conversation and no chat template
            raise ConfigError(f"{where}: prompt {record.prompt_id!r}: {exc}") from None
    return token_ids


def _check_prompt_lengths(cfg: RunConfig, records: list[PromptRecord], locations: list[str],
                          token_ids: list[list[int]]) -> None:
    limit = cfg.rollout.max_prompt_tokens
    too_long = [(where, record.prompt_id, len(ids))
                for record, where, ids in zip(records, locations, token_ids) if len(ids) > limit]
    if too_long:
        where, prompt_id, length = too_long[0]
        more = (f" ({len(too_long)} prompts are, e.g. {[p for _, p, _ in too_long[:3]]})"
                if len(too_long) > 1 else "")
        raise ConfigError(f"{where}: prompt {prompt_id!r} is {length} tokens long, more than "
                          f"rollout.max_prompt_tokens = {limit}{more}; raise it (and "
                          "train.micro_batch_max_tokens) or remove the long prompts")
