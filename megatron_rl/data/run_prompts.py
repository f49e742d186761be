"""The prompts of a training run, read before anything starts or is written: the records of
data.prompts (a prompt file in any accepted layout, docs/data.md, or `rg/<dataset>` generated),
checked against the reward registry (and the environments, when the run has them), split into
training and held-out prompts, and tokenized as the policy sees them (a multi-turn environment's
first messages, `Environment.initial_messages`; the record's conversation otherwise); and the
check that the rollout budgets (a multi-turn trajectory's too) fit the model's context. Every
problem is a ConfigError, one line "WHERE: what is wrong; the fix" (the driver prints it and
exits with status 2), WHERE being the file and line (or row) of the offending prompt.

The registries are only read (their registrations): their verifiers need not be running.
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


def load_run_prompts(cfg: RunConfig, tokenizer, registry, environments=None) -> RunPrompts:
    """The run's prompts, split and tokenized; ConfigError for any problem with them.
    `environments` (an EnvironmentRegistry; None: every task is its verifier) decides which
    prompts are multi-turn: their environment checks them and gives their first messages."""
    check_context_length(cfg)
    records, locations, source = _read_records(cfg)
    multi_turn = _check_gradable(records, locations, registry, environments)
    if any(multi_turn):
        check_trajectory_length(cfg)
    num_heldout = cfg.eval.num_heldout_prompts
    if num_heldout >= len(records):
        raise ConfigError(f"eval.num_heldout_prompts: {num_heldout} held-out prompts leave none "
                          f"of the {len(records)} prompts of {source} to train on; set it below "
                          f"{len(records)} or give more prompts")
    token_ids = _tokenize(records, locations, tokenizer, environments, multi_turn)
    _check_prompt_lengths(cfg, records, locations, token_ids)
    train, heldout = split_heldout(records, num_heldout=num_heldout, seed=_split_seed(cfg))
    ids_of = {record.prompt_id: ids for record, ids in zip(records, token_ids)}
    return RunPrompts(train_records=train, heldout_records=heldout,
                      train_prompt_ids=[ids_of[r.prompt_id] for r in train],
                      heldout_prompt_ids=[ids_of[r.prompt_id] for r in heldout])


def _split_seed(cfg: RunConfig) -> int:
    return cfg.seed if cfg.data.split_seed is None else cfg.data.split_seed


def _model_context(cfg: RunConfig) -> int | None:
    """max_position_embeddings of the checkpoint's text model (None: no checkpoint, or unset)."""
    from transformers import AutoConfig

    path = cfg.model.hf_checkpoint
    if path is None:
        return None
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.hf_checkpoint: {path} has no config.json transformers can "
                          f"read ({exc}); give a Hugging Face model folder") from None
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def check_context_length(cfg: RunConfig) -> None:
    """The longest request (rollout.max_prompt_tokens + thinking_budget + solution_budget) must
    fit the checkpoint's context (max_position_embeddings of its text model): SGLang refuses a
    longer one (HTTP 400) and every generation would fail."""
    path, context = cfg.model.hf_checkpoint, _model_context(cfg)
    rollout = cfg.rollout
    if context is not None and rollout.max_sequence_tokens > context:
        raise ConfigError(
            f"rollout.max_prompt_tokens + rollout.thinking_budget + rollout.solution_budget = "
            f"{rollout.max_prompt_tokens} + {rollout.thinking_budget} + "
            f"{rollout.solution_budget} = {rollout.max_sequence_tokens} tokens, more than the "
            f"model's context of {context} (max_position_embeddings in {path}/config.json), so "
            "the generators would refuse every request; lower them to fit")


def check_trajectory_length(cfg: RunConfig) -> None:
    """With multi-turn prompts, a prompt and its longest trajectory (rollout.max_prompt_tokens +
    RunConfig.max_trajectory_tokens) is one trained sequence and the last turn's request: it
    must fit a micro-batch (the trainer refuses a longer sequence) and the model's context."""
    longest = cfg.rollout.max_prompt_tokens + cfg.max_trajectory_tokens
    what = (f"rollout.max_prompt_tokens + the trajectory budget (environment."
            f"max_trajectory_tokens, or max_turns x (thinking_budget + solution_budget)) = "
            f"{cfg.rollout.max_prompt_tokens} + {cfg.max_trajectory_tokens} = {longest} tokens")
    if cfg.train.micro_batch_max_tokens < longest:
        raise ConfigError(f"train.micro_batch_max_tokens: {cfg.train.micro_batch_max_tokens} "
                          f"cannot hold a multi-turn trajectory: {what}; raise it to >= "
                          f"{longest} or lower environment.max_trajectory_tokens / max_turns")
    context = _model_context(cfg)
    if context is not None and longest > context:
        raise ConfigError(f"environment.max_trajectory_tokens: {what}, more than the model's "
                          f"context of {context} (max_position_embeddings in "
                          f"{cfg.model.hf_checkpoint}/config.json); lower it (or max_turns) to "
                          "fit")


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


def _check_gradable(records: list[PromptRecord], locations: list[str], registry,
                    environments) -> list[bool]:
    """Every prompt's task has a reward (or a multi-turn environment), and the prompt has what
    that needs; which prompts are multi-turn (their environment checks them)."""
    problems, multi_turn = [], []
    for record, where in zip(records, locations):
        try:
            multi_turn.append(environments is not None
                              and environments.for_task(record.task).multi_turn)
            if multi_turn[-1]:
                continue
            missing = registry.missing_fields(record)
        except ValueError as exc:  # UnknownTaskError, from either registry
            problems.append(f"{where}: {exc}")
            continue
        if missing:
            fields = " and ".join(f"'{name}'" for name in missing)
            problems.append(f"{where}: prompt {record.prompt_id!r} (task {record.task!r}) has no "
                            f"{fields}, which its reward needs; add it or remove the prompt")
    if problems:
        more = f" ({len(problems)} prompts cannot be graded)" if len(problems) > 1 else ""
        raise ConfigError(problems[0] + more)
    if any(multi_turn):
        try:
            environments.check([r for r, multi in zip(records, multi_turn) if multi])
        except ValueError as exc:
            raise ConfigError(f"data.prompts: {exc}") from None
    return multi_turn


def _tokenize(records: list[PromptRecord], locations: list[str], tokenizer, environments,
              multi_turn: list[bool]) -> list[list[int]]:
    token_ids = []
    for record, where, multi in zip(records, locations, multi_turn):
        try:
            conversation = (environments.for_task(record.task).initial_messages(record) if multi
                            else record.conversation)
            token_ids.append(prompt_token_ids(tokenizer, conversation))
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
