"""`megatron-rl sft`: the supervised cold start before RL. Token cross-entropy on the response
tokens of prompt + response pairs, trained by the project's Megatron trainer (`RLTrainer` with
`LossSettings(kind="sft")`: the same model build, FP32 chunked head, aggregation, optimizer and
checkpoints as RL), starting from a Hugging Face checkpoint and ending with a Megatron checkpoint
and its HF export through the project's converter (megatron_rl/convert.py).

Data: a .jsonl of {"prompt", "response"} objects, or `rg/<dataset>`: reasoning-gym problems with
worked solutions written by code (megatron_rl/data/worked_solutions.py). Prompts are tokenized as
an RL run tokenizes them for its generators (the chat template when the tokenizer has one, else
the text with the tokenizer's special tokens, e.g. BOS); the response follows as its own tokens
plus EOS, and only those carry loss, so the model learns to continue exactly the token sequence
the generators will give it. A multi-turn response's observations (a tool's output: pieces
{"observation": ...}, megatron_rl/data/sft_examples.py) are in the sequence with loss mask 0, as
in RL: the model reads them and never learns to write them. `--exclude-prompts FILE` names a
prompt file (an RL run's prompts) whose prompts must never be trained on: rg data skips them, a
.jsonl containing any is refused.

Batches are `batch_size` examples per optimizer step, drawn epoch by epoch in an order fixed by
`seed`; with the same inputs and settings on the same machine, a rerun writes identical weights.
Outputs in OUTPUT_DIR: megatron/ (trainer checkpoint), hf/ (HF export), tensorboard/
(sft/loss, sft/grad_norm, sft/learning_rate), settings.json. Runs alone or under torchrun at any
TP / PP / EP layout the trainer supports; rank 0 logs and converts.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.data.sft_examples import SFTExample
from megatron_rl.data.tokenizer import prompt_token_ids

PRECISIONS = {"float32": "fp32", "bfloat16": "bf16"}
AGGREGATIONS = ("token", "sample")
LR_SCHEDULES = ("constant", "linear", "cosine")
# torchrun's variables: a conversion subprocess started by rank 0 must run alone.
_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SFTSettings:
    hf_checkpoint: str  # start weights, architecture (config.json) and tokenizer
    data: str  # .jsonl of {"prompt", "response"}, or rg/<dataset> (worked solutions)
    output_dir: str
    num_steps: int | None = None  # None: one epoch
    batch_size: int = 32  # examples per optimizer step
    lr: float = 1e-5
    lr_warmup_steps: int = 10
    lr_schedule: str = "cosine"  # after warm-up: constant, linear or cosine to min_lr
    min_lr: float | None = None  # None: lr / 10
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    aggregation: str = "token"  # token: mean over all response tokens; sample: per example
    params_dtype: str = "float32"  # float32 | bfloat16
    micro_batch_max_tokens: int = 8192
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    seed: int = 1234  # example order and the trainer's RNG
    # rg/<dataset> only: how many problems, their reasoning-gym seed and config.
    num_examples: int = 4096
    data_seed: int = 0
    rg_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    exclude_prompts: str | None = None  # prompt file (.jsonl / .parquet) never trained on
    hf_dtype: str | None = None  # HF export dtype; None: as trained
    overwrite: bool = False
    progress_bar: bool = True

    def __post_init__(self) -> None:
        def need(condition: bool, message: str) -> None:
            if not condition:
                raise ValueError(message)

        need(self.data.startswith("rg/") or self.data.endswith(".jsonl"),
             f"--data {self.data!r}: give a .jsonl of {{\"prompt\", \"response\"}} objects or "
             "rg/<reasoning-gym dataset> (e.g. rg/chain_sum)")
        need(self.num_steps is None or self.num_steps >= 1,
             f"--num-steps must be >= 1, got {self.num_steps}")
        for name in ("batch_size", "micro_batch_max_tokens", "num_examples",
                     "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "expert_model_parallel_size"):
            need(getattr(self, name) >= 1,
                 f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        need(self.lr > 0, f"--lr must be > 0, got {self.lr}")
        need(self.min_lr is None or 0 <= self.min_lr <= self.lr,
             f"--min-lr must be in [0, lr={self.lr}], got {self.min_lr}")
        need(self.lr_warmup_steps >= 0, f"--lr-warmup-steps must be >= 0, got "
             f"{self.lr_warmup_steps}")
        need(self.lr_schedule in LR_SCHEDULES,
             f"--lr-schedule {self.lr_schedule!r} is not one of {LR_SCHEDULES}")
        need(self.aggregation in AGGREGATIONS,
             f"--aggregation {self.aggregation!r} is not one of {AGGREGATIONS}")
        need(self.params_dtype in PRECISIONS,
             f"--params-dtype {self.params_dtype!r} is not one of {tuple(PRECISIONS)}")
        need(self.hf_dtype is None or self.hf_dtype in ("float32", "bfloat16", "float16"),
             f"--hf-dtype {self.hf_dtype!r} is not one of float32, bfloat16, float16")
        need(self.clip_grad >= 0, f"--clip-grad must be >= 0 (0 disables), got {self.clip_grad}")
        need(not self.rg_config or self.data.startswith("rg/"),
             "--rg-config applies to rg/<dataset> data only; remove it for a .jsonl")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SFTResult:
    losses: tuple[float, ...]  # per optimizer step (mean response-token cross-entropy)
    num_examples: int
    num_steps: int
    num_skipped_steps: int
    megatron_checkpoint: str
    hf_checkpoint: str
    seconds: float


# ----------------------------------------------------------------------------- data


def load_examples(settings: SFTSettings) -> list[SFTExample]:
    """The training examples, none of them with a prompt of `settings.exclude_prompts`."""
    from megatron_rl.data.loading import load_prompts
    from megatron_rl.data.sft_examples import load_sft_examples
    from megatron_rl.data.worked_solutions import worked_solution_examples

    excluded = set()
    if settings.exclude_prompts is not None:
        excluded = {r.prompt for r in load_prompts(settings.exclude_prompts)}
    if settings.data.startswith("rg/"):
        return worked_solution_examples(
            settings.data.removeprefix("rg/"), num_examples=settings.num_examples,
            seed=settings.data_seed, config=settings.rg_config, exclude_prompts=excluded)
    examples = load_sft_examples(settings.data)
    overlap = [i for i, e in enumerate(examples) if e.prompt in excluded]
    if overlap:
        raise ValueError(
            f"{settings.data}: {len(overlap)} example(s) (lines of examples {overlap[:5]}, "
            f"0-based) have a prompt of --exclude-prompts {settings.exclude_prompts}; training "
            "on them would leak those prompts (e.g. the held-out set) into the model: remove "
            "them from the SFT data")
    return examples


def tokenize_examples(tokenizer, examples: Sequence[SFTExample], *,
                      max_tokens: int) -> list[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, response ids + EOS, the response's loss mask) per example; a whole example
    must fit `max_tokens`. A response with observations is tokenized piece by piece (as the
    rollout tokenizes an observation apart from the turns around it), its observation tokens
    masked 0; EOS and the model's text 1."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: SFT ends every response with it so the "
                         "model learns to stop; set eos_token in tokenizer_config.json")
    encoded = []
    for index, example in enumerate(examples):
        prompt = prompt_token_ids(tokenizer, example.prompt)
        response, mask = [], []
        for text, observation in example.pieces():  # one piece without observations
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            response += ids
            mask += [0 if observation else 1] * len(ids)
        if example.observations and not any(mask):
            raise ValueError(f"example {index}: the model's text of the response encodes to no "
                             "tokens; only its observations do")
        response.append(eos)
        mask.append(1)
        if not prompt:
            raise ValueError(f"example {index}: the prompt encodes to no tokens")
        if len(prompt) + len(response) > max_tokens:
            raise ValueError(
                f"example {index} has {len(prompt) + len(response)} tokens, more than "
                f"{max_tokens} (the model's max_position_embeddings or "
                "--micro-batch-max-tokens + 1): shorten it or raise --micro-batch-max-tokens")
        encoded.append((prompt, response, mask))
    return encoded


def batch_indices(num_examples: int, *, batch_size: int, num_steps: int,
                  seed: int) -> Iterator[list[int]]:
    """`num_steps` batches of example indices: epoch after epoch, each a permutation drawn from
    (seed, epoch); a batch may span two epochs."""
    import torch

    pending: list[int] = []
    epoch = 0
    for _ in range(num_steps):
        while len(pending) < batch_size:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            pending += torch.randperm(num_examples, generator=generator).tolist()
            epoch += 1
        yield pending[:batch_size]
        pending = pending[batch_size:]


def sft_batch(encoded: Sequence[tuple[list[int], list[int], list[int]]],
              indices: Sequence[int]):
    """The trainer's TrainBatch of examples `indices`: loss mask 1 on the response tokens only
    (observations excluded); each example is its own prompt group; no behaviour log-probs or
    advantages (unused by SFT)."""
    import torch

    from megatron_rl.trainer import TrainBatch

    token_ids, loss_mask = [], []
    for i in indices:
        prompt, response, mask = encoded[i]
        token_ids.append(torch.tensor(prompt + response, dtype=torch.long))
        loss_mask.append(torch.tensor([0] * len(prompt) + mask, dtype=torch.long))
    num = len(indices)
    return TrainBatch(token_ids=token_ids, loss_mask=loss_mask,
                      old_logprobs=[torch.zeros(len(t)) for t in token_ids],
                      advantages=torch.zeros(num), prompt_ids=torch.arange(num),
                      sample_ids=torch.arange(num))


# ----------------------------------------------------------------------------- run


def trainer_settings(settings: SFTSettings, *, family_name: str, num_steps: int):
    from megatron_rl.trainer import (LossSettings, OptimizerSettings, ParallelLayout,
                                     TrainerSettings)

    return TrainerSettings(
        # The family comes bound to the checkpoint's config.json (HFConfigFamily): no size name.
        model_name=family_name, model_size="hf_checkpoint",
        layout=ParallelLayout(
            tensor_model_parallel_size=settings.tensor_model_parallel_size,
            pipeline_model_parallel_size=settings.pipeline_model_parallel_size,
            expert_model_parallel_size=settings.expert_model_parallel_size,
            sequence_parallel=settings.sequence_parallel),
        precision=PRECISIONS[settings.params_dtype],
        loss=LossSettings(kind="sft", aggregation=settings.aggregation),
        temperature=1.0,
        optimizer=OptimizerSettings(
            lr=settings.lr, lr_warmup_steps=settings.lr_warmup_steps,
            lr_schedule=settings.lr_schedule,
            min_lr=settings.lr / 10 if settings.min_lr is None else settings.min_lr,
            num_steps=num_steps, clip_grad=settings.clip_grad,
            weight_decay=settings.weight_decay, adam_beta1=settings.adam_beta1,
            adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps),
        micro_batch_max_tokens=settings.micro_batch_max_tokens, seed=settings.seed)


def _check_output(settings: SFTSettings) -> Path:
    output = Path(settings.output_dir)
    if output.exists() and any(output.iterdir()) and not settings.overwrite:
        raise ValueError(f"output directory {output} is not empty; pass --overwrite to replace "
                         "its contents or choose another directory")
    return output


def _convert(direction: str, source: Path, target: Path, *, world_size: int,
             **kwargs: Any) -> None:
    """A conversion in this process when it runs alone, else in a fresh single-rank process
    (the converter needs a TP/PP/EP 1/1/1 Megatron state of its own)."""
    from megatron_rl.convert import DTYPES, convert_hf_to_megatron, convert_megatron_to_hf

    if world_size == 1:
        if direction == "hf-to-megatron":
            convert_hf_to_megatron(source, target, overwrite=True, progress=False)
        else:
            convert_megatron_to_hf(source, target, overwrite=True, progress=False,
                                   hf_config_dir=kwargs["hf_config_dir"],
                                   dtype=DTYPES.get(kwargs.get("dtype") or ""))
        return
    command = [sys.executable, "-m", "megatron_rl.cli", "convert", direction, str(source),
               str(target), "--overwrite", "--no-progress"]
    if direction == "megatron-to-hf":
        command += ["--hf-config", str(kwargs["hf_config_dir"])]
        if kwargs.get("dtype"):
            command += ["--dtype", kwargs["dtype"]]
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV}
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed (rc {done.returncode}):\n"
                           f"{done.stderr[-4000:]}")


def run_sft(settings: SFTSettings) -> SFTResult:
    """Train and export; collective over the trainer ranks (torchrun) when there are several."""
    import torch
    from transformers import AutoTokenizer

    from models import model_family_for_hf_config
    from megatron_rl.trainer import RLTrainer

    started = time.perf_counter()
    source = Path(settings.hf_checkpoint)
    if not (source / "config.json").is_file():
        raise ValueError(f"--hf-checkpoint {source}: no config.json there; give a Hugging Face "
                         "model folder (config.json, safetensors, tokenizer files)")
    hf_config = json.loads((source / "config.json").read_text())
    family = model_family_for_hf_config(hf_config)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    examples = load_examples(settings)
    max_tokens = min(settings.micro_batch_max_tokens + 1,
                     family.hf_config.max_position_embeddings)
    encoded = tokenize_examples(tokenizer, examples, max_tokens=max_tokens)
    vocab_size = family.hf_config.vocab_size
    too_big = max(max(prompt + response) for prompt, response, _ in encoded)
    if too_big >= vocab_size:
        raise ValueError(f"the tokenizer produced token id {too_big}, outside the model's "
                         f"vocabulary of {vocab_size}: tokenizer and model do not belong together")
    num_steps = settings.num_steps or math.ceil(len(encoded) / settings.batch_size)
    output = _check_output(settings)

    trainer = RLTrainer(trainer_settings(settings, family_name=family.family.name,
                                         num_steps=num_steps), family=family)
    world_size = torch.distributed.get_world_size()
    is_rank0 = torch.distributed.get_rank() == 0
    if is_rank0:
        output.mkdir(parents=True, exist_ok=True)
        (output / "settings.json").write_text(json.dumps(
            {**dataclasses.asdict(settings), "num_steps": num_steps,
             "num_examples": len(encoded)}, indent=2, sort_keys=True) + "\n")
        _convert("hf-to-megatron", source, output / "start_checkpoint", world_size=world_size)
    torch.distributed.barrier()
    trainer.load_model_weights(str(output / "start_checkpoint"))

    losses = _train(trainer, encoded, settings, num_steps=num_steps, output=output,
                    log=is_rank0)
    megatron_dir, hf_dir = output / "megatron", output / "hf"
    if is_rank0 and megatron_dir.exists():
        shutil.rmtree(megatron_dir)
    torch.distributed.barrier()
    trainer.save_checkpoint(str(megatron_dir))
    torch.distributed.barrier()
    if is_rank0:
        shutil.rmtree(output / "start_checkpoint")
        _convert("megatron-to-hf", megatron_dir, hf_dir, world_size=world_size,
                 hf_config_dir=source, dtype=settings.hf_dtype)
    torch.distributed.barrier()
    return SFTResult(losses=tuple(losses), num_examples=len(encoded), num_steps=num_steps,
                     num_skipped_steps=trainer.num_skipped_steps,
                     megatron_checkpoint=str(megatron_dir), hf_checkpoint=str(hf_dir),
                     seconds=time.perf_counter() - started)


def _train(trainer, encoded, settings: SFTSettings, *, num_steps: int, output: Path,
           log: bool) -> list[float]:
    from torch.utils.tensorboard import SummaryWriter

    from megatron_rl.console import progress

    writer = SummaryWriter(str(output / "tensorboard")) if log else None
    losses = []
    batches = batch_indices(len(encoded), batch_size=settings.batch_size, num_steps=num_steps,
                            seed=settings.seed)
    # a bar in a terminal, one line per step in a log (console.progress)
    bar = progress(batches, total=num_steps, desc="sft", unit="step", file=sys.stderr,
                   disable=not (log and settings.progress_bar))
    try:
        for step, indices in enumerate(bar, start=1):
            metrics = trainer.train_step(sft_batch(encoded, indices))
            losses.append(metrics.loss)
            bar.set_postfix(loss=f"{metrics.loss:.4f}", lr=f"{metrics.learning_rate:.2e}")
            if writer is not None:
                writer.add_scalar("sft/loss", metrics.loss, step)
                writer.add_scalar("sft/grad_norm", metrics.grad_norm, step)
                writer.add_scalar("sft/learning_rate", metrics.learning_rate, step)
                writer.add_scalar("sft/num_loss_tokens", metrics.num_loss_tokens, step)
                writer.add_scalar("sft/skipped", float(metrics.skipped), step)
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    return losses


# ----------------------------------------------------------------------------- CLI


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, e.g. '{{\"max_terms\": 3}}', "
                                         f"got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    defaults = SFTSettings(hf_checkpoint="", data="rg/", output_dir="")
    parser = argparse.ArgumentParser(
        prog="megatron-rl sft",
        description="Supervised cold start: token cross-entropy on the responses of prompt + "
                    "response pairs, trained by the Megatron trainer from an HF checkpoint; "
                    "writes OUTPUT_DIR/megatron (checkpoint), OUTPUT_DIR/hf (HF export) and "
                    "OUTPUT_DIR/tensorboard. Reference: docs/sft.md.")
    parser.add_argument("hf_checkpoint", help="HF model folder to start from (config.json, "
                        "safetensors, tokenizer)")
    parser.add_argument("data", help='a .jsonl of {"prompt": ..., "response": ...} objects (a '
                        'multi-turn response: a list of strings and {"observation": ...} pieces, '
                        "the observations not trained on), or rg/<dataset> for reasoning-gym "
                        "problems with worked solutions")
    parser.add_argument("output_dir")

    def option(name: str, kind=None, help: str = "", **kwargs) -> None:
        field = name.removeprefix("--").replace("-", "_")
        default = getattr(defaults, field)
        parser.add_argument(name, dest=field, type=kind, default=default,
                            help=f"{help} (default: {default})", **kwargs)

    option("--num-steps", int, "optimizer steps; default one epoch")
    option("--batch-size", int, "examples per optimizer step")
    option("--lr", float, "peak learning rate")
    option("--lr-warmup-steps", int, "linear warm-up steps")
    option("--lr-schedule", str, "after warm-up", choices=LR_SCHEDULES)
    option("--min-lr", float, "learning rate reached at the last step (decaying schedules); "
           "default lr / 10")
    option("--weight-decay", float, "AdamW weight decay")
    option("--adam-beta1", float, "AdamW beta1")
    option("--adam-beta2", float, "AdamW beta2")
    option("--adam-eps", float, "AdamW epsilon")
    option("--clip-grad", float, "gradient-norm clipping (0: off)")
    option("--aggregation", str, "token: mean over the batch's response tokens; sample: mean "
           "of the per-example means", choices=AGGREGATIONS)
    option("--params-dtype", str, "trainer parameter dtype", choices=tuple(PRECISIONS))
    option("--micro-batch-max-tokens", int, "padded tokens per micro-batch")
    option("--tensor-model-parallel-size", int, "TP (under torchrun)")
    option("--pipeline-model-parallel-size", int, "PP (under torchrun)")
    option("--expert-model-parallel-size", int, "EP (under torchrun)")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="sequence parallelism (needs TP > 1)")
    option("--seed", int, "example order and trainer RNG")
    option("--num-examples", int, "rg/<dataset>: number of distinct problems")
    option("--data-seed", int, "rg/<dataset>: reasoning-gym seed")
    parser.add_argument("--rg-config", type=_json_object, default={},
                        help='rg/<dataset>: dataset config as JSON, e.g. \'{"min_terms": 2, '
                        '"max_terms": 3, "max_digits": 1}\'')
    option("--exclude-prompts", str, "prompt file (.jsonl / .parquet) whose prompts must never "
           "be trained on, e.g. the RL run's prompts")
    option("--hf-dtype", str, "HF export dtype; default as trained",
           choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the contents of a non-empty OUTPUT_DIR")
    parser.add_argument("--no-progress", dest="progress_bar", action="store_false")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from megatron_rl.convert import ConversionError

    args = vars(_parser().parse_args(argv))
    try:
        result = run_sft(SFTSettings(**args))
    except (ValueError, ConversionError) as err:
        print(f"megatron-rl sft: error: {err}", file=sys.stderr)
        return 2
    finally:
        import torch

        if torch.distributed.is_initialized():
            from megatron_rl.platform import destroy_distributed

            destroy_distributed()
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: one summary
        return 0
    print(f"sft: {result.num_steps} steps on {result.num_examples} examples in "
          f"{result.seconds:.0f} s, loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}; "
          f"Megatron checkpoint {result.megatron_checkpoint}, HF {result.hf_checkpoint}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
