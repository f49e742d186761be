"""The run configuration: one tree of frozen dataclasses (`RunConfig` and its sections) that YAML
recipes and dotted command-line overrides (`train.lr=5e-7`) fill, and the only place run settings
are defined. Every field is type- and range-checked when its section is built, cross-section rules
when the `RunConfig` is built, and every error names the field by its dotted path with the allowed
values or the fix; a config is never mutated afterwards (derive a new one with
`dataclasses.replace`). Defaults are the ScaleRL recipe (SCALERL.md); field names follow
Megatron's and SGLang's own where one exists. The docs (`docs/config.md`) and the default recipe
(`examples/configs/scalerl_default.yaml`) are generated from these dataclasses and their help
texts, so they cannot drift from the code.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import json
import math
import operator
import re
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml

__all__ = [
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "DataConfig",
    "EnvironmentConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "RolloutConfig",
    "RunConfig",
    "TrainConfig",
    "WandbConfig",
    "config_reference_markdown",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "save_config",
]

# Used only when the models/ registry is not importable; the registry is the source of truth.
MODEL_FAMILIES = ("llama", "llama4", "qwen3_moe")
# Families whose layers include MoE blocks: Megatron needs sequence parallelism with TP > 1 there.
MOE_MODEL_FAMILIES = frozenset({"llama4", "qwen3_moe"})
# Each loss's own parameters and their defaults (SCALERL.md section 3); the surrogate clip ranges
# equal megatron_rl.algorithms.losses.DEFAULT_CLIP_RANGE (a unit test keeps them equal; this
# module stays free of torch).
LOSS_DEFAULTS: dict[str, dict[str, float]] = {
    "cispo": {"eps_max": 5.0},
    "dapo": {"eps_low": 0.2, "eps_high": 0.28},
    "grpo": {"eps_low": 0.2, "eps_high": 0.2},
    "gspo": {"gspo_eps_low": 3e-4, "gspo_eps_high": 4e-4},
}
_LOSS_PARAMETERS = ("eps_max", "eps_low", "eps_high", "gspo_eps_low", "gspo_eps_high")
INTERRUPTION_PHRASE = (
    "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
)


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the field and the fix."""


_BOUNDS = {
    "ge": (operator.ge, ">="),
    "gt": (operator.gt, ">"),
    "le": (operator.le, "<="),
    "lt": (operator.lt, "<"),
}


def _field(default: Any, help: str, **bounds: float) -> Any:
    """A config field: its default, its one-line meaning (docs, YAML comments, error messages)
    and optional numeric bounds (ge / gt / le / lt), checked on construction."""
    assert set(bounds) <= set(_BOUNDS), bounds
    return field(default=default, metadata={"help": help, "bounds": bounds})


def _section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help, "bounds": {}})


# --------------------------------------------------------------------------------------------
# Field checking shared by every section
# --------------------------------------------------------------------------------------------

def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _literal_values(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(v for arg in typing.get_args(hint) for v in _literal_values(arg))
    return ()


def _describe(hint: Any) -> str:
    """The allowed values of a type hint, in words (error messages and docs)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(hint))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if origin is tuple:
        return f"a list, each {_describe(typing.get_args(hint)[0])}"
    names = {bool: "true/false", int: "an integer", float: "a number", str: "a string",
             type(None): "null"}
    if hint in names:
        return names[hint]
    return f"a {hint.__name__}"


def _suggest(word: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _coerce(path: str, value: Any, hint: Any) -> Any:
    """`value` checked against `hint`; an int where a float is expected becomes a float. Bools are
    not integers and strings are not numbers here: YAML's `true` or `"5"` in a numeric field is a
    mistake to report, not to guess around."""
    origin = typing.get_origin(hint)
    ok = False
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        for option in typing.get_args(hint):
            if option is not type(None):
                try:
                    return _coerce(path, value, option)
                except ConfigError:
                    pass
    elif origin is Literal:
        ok = isinstance(value, str) and value in typing.get_args(hint)
    elif hint is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        _require(math.isfinite(value), f"{path}: must be a finite number, got {value!r}")
        return float(value)
    elif hint is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint in (bool, str) or dataclasses.is_dataclass(hint):
        ok = isinstance(value, hint)
    elif origin is tuple and isinstance(value, (list, tuple)):  # tuple[X, ...]: a YAML list
        item = typing.get_args(hint)[0]
        return tuple(_coerce(f"{path}[{i}]", v, item) for i, v in enumerate(value))
    if ok:
        return value
    got = "null" if value is None else f"{type(value).__name__} {value!r}"
    message = f"{path}: expected {_describe(hint)}, got {got}"
    accepted = (hint, *typing.get_args(hint)) if origin is not tuple else (hint,)
    literals = _literal_values(hint)
    if literals and isinstance(value, str):
        message += _suggest(value, literals)
    elif isinstance(value, str) and (int in accepted or float in accepted):
        message += " (write numbers unquoted, e.g. 5e-7 not '5e-7')"
    elif str in accepted and value is not None:
        message += " (quote it to make it a string)"
    raise ConfigError(message)


def _check_bounds(path: str, value: Any, bounds: dict[str, float], help: str) -> None:
    if value is None:
        return
    for key, limit in bounds.items():
        compare, symbol = _BOUNDS[key]
        if not compare(value, limit):
            raise ConfigError(f"{path}: must be {symbol} {limit}, got {value!r} ({help})")


def _check_fields(obj: Any) -> None:
    """Type- and range-check every field of a section (named by its `SECTION` dotted path)."""
    hints = _type_hints(type(obj))
    for f in fields(obj):
        path = _join(obj.SECTION, f.name)
        value = _coerce(path, getattr(obj, f.name), hints[f.name])
        _check_bounds(path, value, f.metadata["bounds"], f.metadata["help"])
        object.__setattr__(obj, f.name, value)  # only the int -> float normalisation changes it


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------

@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig:
    """The policy model: a family registered in models/ and one of its sizes. `name` and `size`
    are checked against `models.get_model_family` when the registry is importable. FP8 needs
    Transformer Engine (`use_transformer_engine: true`, GPU only)."""

    SECTION: ClassVar[str] = "model"

    name: str = _field("llama4", "model family registered in models/: llama (dense Llama-3), "
                       "llama4 or qwen3_moe")
    size: str = _field("tiny", "size variant of the family (llama: tiny, llama3_8b; llama4: tiny, "
                       "tiny_maverick, demo, scout, maverick; qwen3_moe: tiny, 30b_a3b)")
    hf_checkpoint: str | None = _field(None, "Hugging Face checkpoint directory to start from; "
                                       "null = random initialisation (tests, tiny runs)")
    params_dtype: Literal["bfloat16", "float32"] = _field(
        "bfloat16", "trainer parameter and compute dtype (Megatron params_dtype)")
    use_transformer_engine: bool = _field(
        False, "Transformer Engine layer spec (GPU only); false = Megatron's local spec (CPU)")
    fp8: Literal["delayed", "current", "mxfp8"] | None = _field(
        None, "FP8 training: delayed or current (per-tensor) scaling (Hopper), or MXFP8 block "
        "scaling (Blackwell), Megatron fp8_recipe 'delayed' / 'tensorwise' / 'mxfp8'; null = no "
        "FP8; needs use_transformer_engine")
    fp32_lm_head: bool = _field(
        True, "LM-head logits GEMM in FP32 (SCALERL.md section 6); false = in params_dtype (the "
        "ablation); log-probs and entropy are FP32 and chunked either way")

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self.fp8 is None or self.use_transformer_engine,
                 f"model.fp8: FP8 ({self.fp8!r}) runs only on Transformer Engine layers; set "
                 "model.use_transformer_engine=true (GPU) or model.fp8=null")
        _check_model_family(self.name, self.size)
        if self.hf_checkpoint is not None:
            check_served_checkpoint(self.hf_checkpoint)


def check_served_checkpoint(directory: str, *, name: str = "model.hf_checkpoint") -> None:
    """Refuse an HF checkpoint that SGLang would serve quantised (named `name` in the error):
    config.json's quantization_config or compression_config (top level or text_config), or an
    hf_quant_config.json beside it, which is how SGLang 0.5.23 finds quantisation
    (srt/configs/model_config.py). The trainer starts from this checkpoint and needs its bf16
    (or fp32) weights; a quantised release has lost them. Serving FP8 is rollout.precision=fp8:
    the run writes the FP8 copy the generators load (cluster/served_checkpoint.py) and the weight
    sync quantises every update in the same layout. Refused here, at config load, and again
    when the trainer connects to the generators. A folder without config.json is left to the
    loaders to report."""
    folder = Path(directory)
    found = []
    if (folder / "config.json").is_file():
        try:
            config = json.loads((folder / "config.json").read_text())
        except ValueError:
            config = {}
        for prefix, section in (("", config), ("text_config.", config.get("text_config"))):
            for key in ("quantization_config", "compression_config"):
                if isinstance(section, dict) and section.get(key):
                    method = section[key].get("quant_method") \
                        if isinstance(section[key], dict) else None
                    found.append(f"config.json {prefix}{key}"
                                 + (f" (quant_method {method!r})" if method else ""))
    if (folder / "hf_quant_config.json").is_file():
        found.append("hf_quant_config.json")
    _require(not found, f"{name}: {directory} is a quantised checkpoint ({'; '.join(found)}): "
             "the trainer starts from the checkpoint's weights and needs them unquantised; use "
             "the model's bf16 release, and set rollout.precision=fp8 to serve it in FP8 (the "
             "run quantises the generators' copy and every weight update)")


# The families whose FP8 serving is checked against SGLang's FP8 loader: the weight sync's rule
# of which tensors SGLang holds in FP8 (weight_sync/fp8.py fp8_quantized) is tested on llama4 and
# qwen3_moe (tests/integration/test_fp8_sglang.py); llama's projections are the same SGLang
# layers (models/llama.py), served per-tensor end to end in tests/e2e/test_fp8_rollout.py.
FP8_SERVED_FAMILIES = ("llama", "llama4", "qwen3_moe")


def _fp8_partition_sizes(text: dict, tp_size: int, ep_size: int) -> list[int]:
    """The shard sizes SGLang requires to be multiples of the FP8 block, by the planner's own
    rule (megatron_rl.scaling.plan.fp8_partition_sizes), for the HF text config of a Llama-4 or
    Qwen3-MoE model (transformers' defaults where a key is absent: Llama4TextConfig,
    Qwen3MoeConfig). Raises ValueError where the heads or widths do not split over TP."""
    from megatron_rl.scaling.plan import Architecture, fp8_partition_sizes

    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    if text.get("model_type") == "llama4_text":  # every expert layer has a shared expert
        experts, expert_width = text.get("num_local_experts", 16), text["intermediate_size"]
        shared, dense = expert_width, text.get("intermediate_size_mlp", 0)
        all_moe = text.get("interleave_moe_layer_step", 1) == 1 and not text.get("moe_layers")
    else:  # qwen3_moe
        experts, expert_width = text.get("num_experts", 128), text.get("moe_intermediate_size",
                                                                        768)
        shared, dense = 0, text.get("intermediate_size", 0)
        all_moe = text.get("decoder_sparse_step", 1) == 1 and not text.get("mlp_only_layers")
    pattern = (1,) if all_moe else (1, 0)
    arch = Architecture(num_layers=len(pattern), hidden_size=text["hidden_size"],
                        num_attention_heads=heads,
                        num_query_groups=text.get("num_key_value_heads") or heads,
                        head_dim=head_dim, ffn_hidden_size=dense, vocab_size=0,
                        num_experts=experts, moe_ffn_hidden_size=expert_width,
                        shared_expert_size=shared, moe_layer_pattern=pattern)
    sizes = fp8_partition_sizes(arch, tp_size=tp_size, ep_size=math.gcd(ep_size, tp_size))
    return list(sizes.values())


def fp8_serving_problem(family: str, hf_config: dict, block_size: int | None,
                        tp_size: int, ep_size: int = 1) -> str | None:
    """Why rollout.precision=fp8 cannot serve this model, in one line (None: it can). SGLang
    0.5.23's FP8 layers (srt/layers/quantization/fp8.py `validate_block_quant_shapes`,
    `create_fp8_moe_weight_`) refuse a block size that does not divide each fused projection's
    shards per TP rank (q / k / v, gate / up, the experts' intermediate size per MoE-TP rank)
    and each row-parallel input (the planner's rule: _fp8_partition_sizes); Llama-4's loader
    needs blocks of whole heads (weight_sync/fp8.py check_llama4_block_rows). The message names
    the block sizes that would work."""
    if family not in FP8_SERVED_FAMILIES:
        return (f"rollout.precision: fp8 is not available for model family {family!r} (its "
                "tensors SGLang holds in FP8 are checked for "
                f"{', '.join(FP8_SERVED_FAMILIES)}); use rollout.precision=bf16")
    if block_size is None:
        return None
    if family == "llama":
        return (f"rollout.fp8_block_size: {block_size} cannot serve a llama model: SGLang "
                "0.5.23's Llama loader renames `weight_scale_inv` to `weight_scale` "
                "(models/llama.py LlamaForCausalLM._legacy_load_weights) and so drops block "
                "scales; use rollout.fp8_block_size=null (per-tensor scales)")
    text = hf_config.get("text_config") or hf_config
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    try:
        sizes = _fp8_partition_sizes(text, tp_size, ep_size)
    except ValueError as err:
        return (f"rollout.tp_size: {tp_size} cannot serve this {family} model: {err}; choose a "
                "rollout.tp_size dividing it")
    whole_heads = text.get("model_type") == "llama4_text"
    fits = [b for b in (128, 64, 32, 16, 8, 4, 2, 1) if all(size % b == 0 for size in sizes)
            and (not whole_heads or b % head_dim == 0)]
    if block_size in fits:
        return None
    why = (f"SGLang's FP8 layers need every fused projection shard per TP rank "
           f"({', '.join(map(str, sorted(set(sizes))))} at rollout.tp_size {tp_size}) to be a "
           "multiple of the block" + (f", and Llama-4 blocks of whole heads (head_dim "
                                       f"{head_dim})" if whole_heads else ""))
    fix = (f"rollout.fp8_block_size={fits[0]}" if fits else "no block size does") + \
        " or null (per-tensor scales)"
    return (f"rollout.fp8_block_size: {block_size} cannot serve this {family} model in FP8: "
            f"{why}; use {fix}")


def _model_registry() -> Any:
    """`models.get_model_family`, or None when the registry is not importable (config is usable
    without the model packages, e.g. by the cost model)."""
    try:
        module = importlib.import_module("models")
    except ModuleNotFoundError as err:
        if err.name == "models":
            return None
        raise
    return getattr(module, "get_model_family", None)


def _check_model_family(name: str, size: str) -> None:
    get_model_family = _model_registry()
    if get_model_family is None:
        _require(name in MODEL_FAMILIES,
                 f"model.name: unknown model family {name!r}; choose one of "
                 f"{', '.join(MODEL_FAMILIES)}{_suggest(name, MODEL_FAMILIES)}")
        return
    try:
        family = get_model_family(name)
    except LookupError as err:  # KeyError and IndexError
        raise ConfigError(f"model.name: {err.args[0] if err.args else err}") from err
    except ValueError as err:
        raise ConfigError(f"model.name: {err}") from err
    sizes = tuple(family.sizes)
    _require(size in sizes, f"model.size: {size!r} is not a size of model family {name!r}; "
             f"choose one of {', '.join(sizes)}{_suggest(size, sizes)}")


@dataclass(kw_only=True, slots=True, frozen=True)
class ParallelismConfig:
    """How the trainer ranks are split (Megatron's names and rules). tensor x pipeline x context
    parallel sizes must divide `world_size`; the rest is data parallel. Expert layers use their
    own grid: expert_model_parallel_size x expert_tensor_parallel_size x
    pipeline_model_parallel_size must divide `world_size` too (megatron/core/parallel_state.py).
    Sequence parallelism needs tensor parallelism; MoE models with tensor parallelism need
    sequence parallelism (checked on the run config, which knows the model)."""

    SECTION: ClassVar[str] = "parallelism"

    world_size: int = _field(1, "number of trainer ranks (generators are separate: "
                             "rollout.num_generators)", ge=1)
    tensor_model_parallel_size: int = _field(1, "tensor-parallel size (TP)", ge=1)
    pipeline_model_parallel_size: int = _field(1, "pipeline-parallel size (PP)", ge=1)
    context_parallel_size: int = _field(1, "context-parallel size (CP): splits each sequence",
                                        ge=1)
    expert_model_parallel_size: int = _field(1, "expert-parallel size (EP): experts split "
                                             "across ranks", ge=1)
    expert_tensor_parallel_size: int = _field(1, "tensor-parallel size inside each expert (ETP)",
                                              ge=1)
    sequence_parallel: bool = _field(False, "shard norms/dropout activations along the sequence "
                                     "over the TP group (needs TP > 1)")

    def __post_init__(self) -> None:
        _check_fields(self)
        dense = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                 * self.context_parallel_size)
        _require(self.world_size % dense == 0,
                 f"parallelism.world_size: tensor_model_parallel_size "
                 f"({self.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                 f"({self.pipeline_model_parallel_size}) x context_parallel_size "
                 f"({self.context_parallel_size}) = {dense} must divide world_size "
                 f"({self.world_size}); use a world_size that is a multiple of {dense} or "
                 "smaller parallel sizes")
        expert = (self.expert_model_parallel_size * self.expert_tensor_parallel_size
                  * self.pipeline_model_parallel_size)
        _require(self.world_size % expert == 0,
                 f"parallelism.expert_model_parallel_size: expert_model_parallel_size "
                 f"({self.expert_model_parallel_size}) x expert_tensor_parallel_size "
                 f"({self.expert_tensor_parallel_size}) x pipeline_model_parallel_size "
                 f"({self.pipeline_model_parallel_size}) = {expert} must divide world_size "
                 f"({self.world_size}) (Megatron's expert grid); lower EP/ETP or raise world_size")
        _require(not self.sequence_parallel or self.tensor_model_parallel_size > 1,
                 "parallelism.sequence_parallel: needs tensor_model_parallel_size > 1 (Megatron "
                 "rejects it otherwise); set parallelism.sequence_parallel=false or raise TP")

    @property
    def data_parallel_size(self) -> int:
        """world_size / (TP x PP x CP): replicas of the dense layers."""
        return self.world_size // (self.tensor_model_parallel_size
                                   * self.pipeline_model_parallel_size
                                   * self.context_parallel_size)

    @property
    def expert_data_parallel_size(self) -> int:
        """world_size / (EP x ETP x PP): replicas of each expert."""
        return self.world_size // (self.expert_model_parallel_size
                                   * self.expert_tensor_parallel_size
                                   * self.pipeline_model_parallel_size)


@functools.cache
def _sglang_attention_backends() -> tuple[str, ...] | None:
    """SGLang's own list of attention backends, read from its choices module without importing
    the sglang package (which takes ~15 s); None if SGLang is absent or laid out differently."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "srt/arg_groups/choices.py"
    if not path.is_file():
        return None
    namespace: dict[str, Any] = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # plain lists of strings
    choices = namespace.get("ATTENTION_BACKEND_CHOICES")
    return tuple(choices) if choices else None


@dataclass(kw_only=True, slots=True, frozen=True)
class RolloutConfig:
    """The generators (SGLang engines) and how completions are sampled. A completion has at most
    thinking_budget + solution_budget tokens; with forced interruption, a generation that reaches
    a budget drawn uniformly in [thinking_budget_min, thinking_budget] gets `interruption_phrase`
    appended (excluded from the loss; its tokens count against the solution budget) and continues
    for up to solution_budget tokens (SCALERL.md section 5). Pipeline-RL (`mode: pipeline`) pushes
    weights to the generators in flight and keeps the trainer at most max_off_policyness steps
    ahead of its oldest data (k = 0 is synchronous on-policy); `ppo_off_policy` generates
    k x prompts_per_step prompts with one policy and then takes k optimizer steps (k >= 1).
    tp_size, ep_size, dtype, mem_fraction_static, enable_fp32_lm_head and attention_backend are
    SGLang server arguments of each generator (ep_size must divide tp_size)."""

    SECTION: ClassVar[str] = "rollout"

    backend: Literal["sglang"] = _field("sglang", "generation engine")
    mode: Literal["pipeline", "ppo_off_policy"] = _field(
        "pipeline", "asynchrony: Pipeline-RL with in-flight weight updates, or the "
        "PPO-off-policy-k baseline (SCALERL.md section 7)")
    num_generators: int = _field(1, "number of generator engines", ge=1)
    min_generators: int | None = _field(
        1, "engines the run needs in the rotation: it goes on with any number in "
        "[min_generators, num_generators] (the engines of a lost node, or given up after "
        "max_generator_restarts, leave the rotation; lost ones are re-created when Ray can place "
        "them again); below it, it waits up to engine_start_timeout_s for placement, then stops "
        "(docs/fault_tolerance.md). null: num_generators (no engine may be missing)", ge=1)
    samples_per_prompt: int = _field(16, "G: completions sampled per prompt (the group of the "
                                     "group-relative advantage)", ge=2)
    max_prompt_tokens: int = _field(2048, "longest prompt in tokens (part of the sequence "
                                    "budget)", ge=1)
    thinking_budget: int = _field(12288, "most thinking tokens of one completion", ge=1)
    thinking_budget_min: int = _field(10240, "low end of the forced-interruption budget, drawn "
                                      "uniformly in [thinking_budget_min, thinking_budget]", ge=1)
    solution_budget: int = _field(2048, "most tokens after the thinking part (incl. the "
                                  "interruption phrase)", ge=1)
    forced_interruption: bool = _field(True, "append interruption_phrase at the thinking budget "
                                       "and let the model answer (ScaleRL length control)")
    interruption_phrase: str = _field(INTERRUPTION_PHRASE, "text appended at a forced "
                                      "interruption (not sampled: excluded from the loss)")
    temperature: float = _field(1.0, "sampling temperature", gt=0.0)
    top_p: float = _field(1.0, "nucleus-sampling mass; training rollouts need 1.0 (the recorded "
                          "log-probs are of the untruncated distribution)", gt=0.0, le=1.0)
    max_off_policyness: int = _field(8, "k: most optimizer steps the trainer may be ahead of the "
                                     "oldest data it consumes (Pipeline-RL-k; 0 = synchronous)",
                                     ge=0)
    stale_group_policy: Literal["requeue", "drop"] = _field(
        "requeue", "a finished group older than the bound at take time is regenerated "
        "(requeue: no bias against long generations, which are the ones that go stale) or "
        "dropped; both are counted")
    max_requeues: int = _field(3, "times one prompt is regenerated after going stale before it "
                               "is dropped instead (a generation that always outlasts k steps "
                               "would be regenerated forever); a prompt retired by "
                               "No-Positive-Resampling meanwhile is never regenerated", ge=0)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = _field(
        "auto", "generator weight/activation dtype (SGLang dtype; auto = the checkpoint's)")
    tp_size: int = _field(1, "tensor-parallel size of each generator (SGLang tp_size)", ge=1)
    ep_size: int = _field(1, "expert-parallel size of each generator (SGLang ep_size)", ge=1)
    mem_fraction_static: float | None = _field(
        None, "fraction of device memory for weights + KV cache (SGLang mem_fraction_static); "
        "null = SGLang's choice", gt=0.0, lt=1.0)
    max_total_tokens: int | None = _field(
        None, "KV-cache size of each generator in tokens (SGLang max_total_tokens); null = as "
        "much as mem_fraction_static leaves. On CPU a server with it set starts however other "
        "processes use memory meanwhile (platform/sglang_cpu.py, fix 11)", ge=1)
    enable_fp32_lm_head: bool = _field(True, "FP32 logits on the generator (SGLang "
                                       "enable_fp32_lm_head; SCALERL.md section 6)")
    attention_backend: str | None = _field(None, "SGLang attention_backend (e.g. "
                                           "torch_native on CPU); null = SGLang's default")
    disable_overlap_schedule: bool = _field(
        True, "SGLang --disable-overlap-schedule: with the overlap schedule the token in flight "
        "when an update pauses generation is labelled with the new version though the old "
        "weights produced it; off only for generation without in-flight updates")
    continuations_first: bool = _field(
        True, "a request that continues a completion (its answer after the thinking, a "
        "resubmission after an abort) goes before the fresh requests waiting at the engine "
        "(SGLang priority scheduling, no preemption); false = first come first served, where a "
        "saturated engine makes a completion wait behind every thinking request queued before "
        "its answer")
    deterministic: bool = _field(
        False, "one request at a time per generator and no prefix cache, so that a completion "
        "depends only on its prompt, seed and weights (bit-identical reruns and resumes; "
        "slow: for tests and debugging)")
    routing_replay: bool = _field(
        True, "rollout routing replay (R3) for MoE families: the generators return each token's "
        "routed experts and the trainer's routers replay them (gating weights recomputed by the "
        "trainer); no effect on dense families (docs/routing_replay.md)")
    routing_replay_compare: bool = _field(
        False, "with routing replay: also score each step's batch without replay (one more "
        "forward per step) for train/logp_mismatch_without_replay, the mismatch replay removes")
    health_check_interval_s: float = _field(10.0, "how often every generator is health-checked "
                                            "while the trainer waits for groups", gt=0.0)
    health_check_timeout_s: float = _field(
        30.0, "longest wait for one health check's answers (the Ray call and /server_info); a "
        "generator that does not answer within it fails that check", gt=0.0)
    engine_start_timeout_s: float = _field(
        900.0, "longest wait for one generator engine to start (server up, weights loaded, "
        "answering): at launch, at a restart and when re-created on another node; also how "
        "long the run goes on below min_generators waiting for Ray to place engines. A large "
        "checkpoint on GPU takes minutes", ge=10.0)
    max_generator_restarts: int = _field(3, "restarts of one generator in a row (with backoff; "
                                         "a restart that fails again within 5 minutes counts "
                                         "on; an engine re-created after its node's loss "
                                         "starts a fresh count) before it is given up; the run "
                                         "goes on without it while others are up", ge=0)
    no_progress_timeout_s: float = _field(
        120.0, "a generator with requests in flight that shows no progress this long (none of "
        "its requests answered, and SGLang's /health_generate saw no completed forward step) "
        "is hung: taken out of the rotation and restarted. A request itself has no time limit "
        "(it includes queueing behind every other request and weight-update pauses). At least "
        "30 s: SGLang's own health window is 20 s", ge=30.0)
    precision: Literal["bf16", "fp8"] = _field(
        "bf16", "weights the generators serve: bf16 (the trainer's weights as they are) or fp8 "
        "(e4m3, quantised by the weight sync in the layout SGLang's FP8 loader reads; "
        "docs/low_precision.md)")
    fp8_block_size: int | None = _field(
        128, "with precision fp8: square block of the block-wise scales (SGLang "
        "weight_block_size [n, n]; every fused projection's shard must be a multiple of it); "
        "null = one scale per tensor", ge=1)
    fp8_scale_fmt: Literal["float32", "ue8m0"] = _field(
        "float32", "with precision fp8 and blocks: the block scales as float32, or as powers "
        "of two (ue8m0: SGLang's DeepGEMM path on Blackwell requantises to them)")

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self.thinking_budget_min <= self.thinking_budget,
                 f"rollout.thinking_budget_min: {self.thinking_budget_min} exceeds "
                 f"rollout.thinking_budget ({self.thinking_budget}); the interruption budget is "
                 "drawn from [thinking_budget_min, thinking_budget]")
        _require(not self.forced_interruption or self.interruption_phrase.strip() != "",
                 "rollout.interruption_phrase: empty; give the phrase or set "
                 "rollout.forced_interruption=false")
        _require(self.top_p == 1.0,
                 f"rollout.top_p: {self.top_p} truncates the sampling distribution, but the "
                 "generators record log-probs of the untruncated one (SGLang: log softmax(z / T) "
                 "before top-p), so CISPO's importance ratio and the mismatch metric would be "
                 "wrong; training rollouts need rollout.top_p=1.0 (top-p is for evaluation "
                 "sampling only)")
        _require(self.mode != "ppo_off_policy" or self.max_off_policyness >= 1,
                 "rollout.max_off_policyness: ppo_off_policy takes k >= 1 optimizer steps per "
                 "generated batch; got 0")
        _require(self.min_generators is None or self.min_generators <= self.num_generators,
                 f"rollout.min_generators: {self.min_generators} exceeds rollout.num_generators "
                 f"({self.num_generators}); give a number in [1, {self.num_generators}] or null "
                 "(all of them)")
        _require(self.tp_size % self.ep_size == 0,
                 f"rollout.ep_size: {self.ep_size} must divide rollout.tp_size ({self.tp_size}) "
                 "(SGLang splits each generator's TP group into expert-parallel groups)")
        if self.attention_backend is not None:
            backends = _sglang_attention_backends()
            _require(backends is None or self.attention_backend in backends,
                     f"rollout.attention_backend: {self.attention_backend!r} is not an SGLang "
                     f"attention backend; choose one of {', '.join(backends or ())} or null"
                     f"{_suggest(self.attention_backend, backends or ())}")

    @property
    def min_engines(self) -> int:
        """min_generators resolved: the engines the run needs in the rotation."""
        return self.num_generators if self.min_generators is None else self.min_generators

    @property
    def max_response_tokens(self) -> int:
        """thinking_budget + solution_budget: the longest completion."""
        return self.thinking_budget + self.solution_budget

    @property
    def max_sequence_tokens(self) -> int:
        """max_prompt_tokens + max_response_tokens: the longest prompt + completion."""
        return self.max_prompt_tokens + self.max_response_tokens


@dataclass(kw_only=True, slots=True, frozen=True)
class WeightSyncConfig:
    """How the trainer pushes weights to the generators after each optimizer step
    (megatron_rl.weight_sync, docs/generators.md). The generators receive weights in
    rollout.dtype (auto = the trainer's dtype). The sender of each pipeline stage holds two
    buckets of bucket_mb plus scratch for one bucket's gathered tensors."""

    SECTION: ClassVar[str] = "weight_sync"

    transport: Literal["distributed", "tensor", "disk"] = _field(
        "distributed", "broadcast over a torch.distributed group with the generator ranks (NCCL "
        "on GPU, gloo on CPU); tensor = colocated in-memory hand-over; disk = an HF folder")
    bucket_mb: int = _field(512, "bucket size in MiB (larger: fewer requests, more memory on "
                            "the sender)", ge=1)
    pause_mode: Literal["in_place", "retract", "abort", "none"] = _field(
        "in_place", "what running requests do during an update: in_place keeps them and their "
        "KV cache (Pipeline-RL), retract requeues them, abort ends them, none does not pause")
    timeout_s: float = _field(600.0, "longest wait for the generators at any point of a sync",
                              gt=0.0)
    sync_timeout_s: float = _field(
        1800.0, "the driver's wait for one whole sync on the trainer ranks (every bucket and "
        "retry; also connecting to the engines and a restarted engine's first sync); past it "
        "the trainer counts as hung and is restored. At least timeout_s", gt=0.0)
    update_attempts: int = _field(3, "tries of one update's loading (each over a rebuilt "
                                  "weight-update group) while the generators stay paused; then "
                                  "they are failed by name, never resumed half-loaded", ge=1)
    disk_dir: str | None = _field(None, "transport=disk: where the HF folder is written; null "
                                  "= <output_dir>/weight_sync")

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self.sync_timeout_s >= self.timeout_s,
                 f"weight_sync.sync_timeout_s: {self.sync_timeout_s:g} is shorter than "
                 f"weight_sync.timeout_s ({self.timeout_s:g}), the wait at one point of a sync; "
                 "raise it")


@dataclass(kw_only=True, slots=True, frozen=True)
class AlgorithmConfig:
    """The RL objective (SCALERL.md sections 3-5). `loss` picks CISPO (truncated importance
    sampling at eps_max; ScaleRL), DAPO / GRPO (clipped surrogate with eps_low / eps_high) or GSPO
    (sequence-level ratio clipped at gspo_eps_low / gspo_eps_high). Each loss has its own
    defaults for its own parameters (LOSS_DEFAULTS: CISPO eps_max 5; GRPO 0.2 / 0.2; DAPO
    0.2 / 0.28; GSPO 3e-4 / 4e-4), filled in when left null; setting a parameter of another loss
    is an error. The length penalty (DAPO-style, an ablation alternative to forced interruption)
    needs length_penalty_cache_length < length_penalty_max_length. The train / rollout mismatch
    corrections (docs/low_precision.md; all off, as ScaleRL) are tis_cap (not with CISPO) and the
    windows mismatch_sequence_* / mismatch_token_*, each set with both bounds, low < 1 < high."""

    SECTION: ClassVar[str] = "algorithm"

    loss: Literal["cispo", "dapo", "grpo", "gspo"] = _field("cispo", "policy loss")
    eps_max: float | None = _field(None, "CISPO: importance-ratio truncation, sg(min(ratio, "
                                   "eps_max)) (paper: 4, 5, 8 alike); null = 5", gt=0.0)
    eps_low: float | None = _field(None, "DAPO/GRPO: lower clip, ratio >= 1 - eps_low; null = "
                                   "0.2", gt=0.0, lt=1.0)
    eps_high: float | None = _field(None, "DAPO/GRPO: upper clip, ratio <= 1 + eps_high; null = "
                                    "0.28 (dapo) or 0.2 (grpo)", gt=0.0)
    gspo_eps_low: float | None = _field(None, "GSPO: lower clip of the sequence ratio; null = "
                                        "3e-4", gt=0.0, lt=1.0)
    gspo_eps_high: float | None = _field(None, "GSPO: upper clip of the sequence ratio; null = "
                                         "4e-4", gt=0.0)
    aggregation: Literal["prompt", "sample", "token"] = _field(
        "prompt", "how token losses become the scalar loss (global denominators): per-prompt "
        "token average (ScaleRL), per-sample mean, or token mean (DAPO)")
    advantage_normalization: Literal["batch", "prompt", "none"] = _field(
        "batch", "divide group-centred advantages by the batch std (ScaleRL), the group's std "
        "(GRPO) or nothing")
    zero_variance_filter: bool = _field(True, "drop prompts whose G rewards are all equal from "
                                        "the loss and the batch std")
    no_positive_resampling: bool = _field(True, "retire prompts whose pass rate reached "
                                          "npr_threshold from later epochs")
    npr_threshold: float = _field(0.9, "pass rate at which No-Positive-Resampling retires a "
                                  "prompt", gt=0.0, le=1.0)
    max_verifier_failure_fraction: float = _field(
        0.05, "stop the run when the verifier itself fails (sandbox or grader error, not a wrong "
        "answer) on more than this fraction of the samples scored so far; such samples get no "
        "reward and their groups are dropped", ge=0.0, le=1.0)
    sandbox_isolation: Literal["namespaces", "auto", "seccomp"] = _field(
        "namespaces", "code sandbox isolation (docs/rewards.md: threat model): namespaces = "
        "required, the run stops where the host refuses them; auto = namespaces where "
        "permitted, else the weaker seccomp fallback (logged); seccomp = always the fallback")
    length_penalty: bool = _field(False, "add the DAPO overlong penalty to correct answers' "
                                  "rewards")
    length_penalty_max_length: int = _field(14336, "L_max: completions longer than this get the "
                                            "full penalty -1", ge=1)
    length_penalty_cache_length: int = _field(2048, "L_cache: the penalty ramps from 0 to -1 "
                                              "over the last L_cache tokens before L_max", ge=1)
    tis_cap: float | None = _field(
        None, "DAPO/GRPO/GSPO: token-level truncated importance sampling against the generator, "
        "each token's loss times sg(min(pi_train_old / pi_gen, tis_cap)), the loss's own ratio "
        "then against the trainer's old log-probs (not with CISPO, whose ratio already is this); "
        "null = off", gt=0.0)
    mismatch_sequence_low: float | None = _field(
        None, "drop a completion whose geometric-mean pi_train / pi_gen is below this (MIS / "
        "seq-mask; with mismatch_sequence_high); null = off", ge=0.0, lt=1.0)
    mismatch_sequence_high: float | None = _field(
        None, "drop a completion whose geometric-mean pi_train / pi_gen is above this; null = "
        "off", gt=1.0)
    mismatch_token_low: float | None = _field(
        None, "drop tokens whose pi_train / pi_gen is below this (IcePop; with "
        "mismatch_token_high); null = off", ge=0.0, lt=1.0)
    mismatch_token_high: float | None = _field(
        None, "drop tokens whose pi_train / pi_gen is above this; null = off", gt=1.0)

    def __post_init__(self) -> None:
        _check_fields(self)
        own = LOSS_DEFAULTS[self.loss]
        for name in _LOSS_PARAMETERS:
            value = getattr(self, name)
            if name in own and value is None:
                object.__setattr__(self, name, own[name])  # this loss's own default
            _require(name in own or value is None,
                     f"algorithm.{name}: set to {value!r}, but loss {self.loss!r} does not use "
                     f"it (it uses {', '.join(own)}); remove it or set algorithm.{name}=null")
        _require(self.length_penalty_cache_length < self.length_penalty_max_length,
                 f"algorithm.length_penalty_cache_length: {self.length_penalty_cache_length} must "
                 f"be < algorithm.length_penalty_max_length ({self.length_penalty_max_length})")
        _require(self.tis_cap is None or self.loss != "cispo",
                 f"algorithm.tis_cap: set to {self.tis_cap!r}, but CISPO already weighs each "
                 "token by sg(min(pi_train / pi_gen, eps_max)) against the generator's own "
                 "log-probs, which is truncated importance sampling; a second factor would count "
                 "the mismatch twice. Remove tis_cap (tune eps_max) or use loss dapo / grpo / gspo")
        for window in ("sequence", "token"):
            low, high = (getattr(self, f"mismatch_{window}_{end}") for end in ("low", "high"))
            _require((low is None) == (high is None),
                     f"algorithm.mismatch_{window}_low / _high: set both (the window of ratios "
                     f"kept, low < 1 < high, e.g. 0.5 and 2.0) or neither; got {low!r} / {high!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig:
    """The optimizer-step loop of the trainers. global_batch_size counts completions per
    optimizer step and must be a multiple of rollout.samples_per_prompt (whole groups);
    micro_batch_max_tokens must fit the longest sequence (rollout.max_sequence_tokens). Both are
    checked on the run config. Learning-rate schedule: linear warm-up over lr_warmup_steps, then
    constant (ScaleRL) or a linear / cosine decay to min_lr at num_steps (Megatron
    lr_decay_style)."""

    SECTION: ClassVar[str] = "train"

    num_steps: int = _field(1000, "optimizer steps of the run (paper: 7,000+ on large runs)",
                            ge=1)
    global_batch_size: int = _field(768, "completions per optimizer step (48 prompts x 16)", ge=1)
    micro_batch_max_tokens: int = _field(16384, "token budget of one packed micro-batch "
                                         "(per trainer model replica)", ge=1)
    recompute_granularity: Literal["none", "selective", "full"] = _field(
        "none", "activation recomputation (Megatron recompute_granularity): none, selective "
        "(core attention) or full (every layer, uniform, one layer per checkpoint); "
        "`megatron-rl plan` shows what each saves")
    moe_routing_imbalance: float = _field(
        1.5, "memory planning (`megatron-rl plan`): tokens the busiest expert-parallel rank's "
        "experts receive, as a multiple of the balanced share (1 = perfectly balanced "
        "routing); no token is dropped, so that rank's expert activations grow by it", ge=1.0)
    lr: float = _field(5e-7, "peak learning rate (paper A.3)", gt=0.0)
    min_lr: float = _field(0.0, "learning rate at num_steps for decaying schedules", ge=0.0)
    lr_warmup_steps: int = _field(100, "linear warm-up steps from 0 to lr", ge=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = _field(
        "constant", "after warm-up: constant (ScaleRL) or decay to min_lr")
    clip_grad: float = _field(1.0, "gradient-norm clipping threshold; 0 = off", ge=0.0)
    max_consecutive_skipped_steps: int = _field(
        5, "stop the run (with a checkpoint) after this many optimizer steps in a row skipped "
        "for a non-finite loss or gradient; 0 = never stop", ge=0)
    step_timeout_s: float = _field(3600.0, "a trainer step (or weight sync) not done in this "
                                   "time counts as a hung trainer rank", gt=0.0)
    start_timeout_s: float = _field(900.0, "longest wait for the trainer ranks to start (Ray "
                                    "places them, torch.distributed, the model is built)",
                                    gt=0.0)
    graceful_stop_timeout_s: float = _field(
        300.0, "after a first SIGTERM / SIGINT: how long a trainer call under way (a step, a "
        "weight sync, a checkpoint) may take to finish before the run stops without a new "
        "checkpoint (waits for generation are abandoned at once); below the scheduler's grace "
        "period", gt=0.0)
    max_trainer_restarts: int = _field(3, "times the trainer ranks are restarted from the last "
                                       "checkpoint after a rank died or hung; then the run "
                                       "stops", ge=0)
    rank_monitor: bool = _field(True, "each trainer rank runs nvidia-resiliency-ext's rank "
                                "monitor, which kills the rank when a step, weight sync or "
                                "save stays open past its timeout (a hang then restores the "
                                "trainer at once); where nvrx does not import, the driver's "
                                "step_timeout_s alone (with a message)")
    hang_timeout_factor: float | None = _field(
        None, "rank monitor: after 3 steps a train step counts as hung after this many times "
        "the longest step seen (nvrx's calculated timeouts); null = after step_timeout_s",
        gt=1.0)

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self.min_lr <= self.lr,
                 f"train.min_lr: {self.min_lr} exceeds train.lr ({self.lr})")


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerConfig:
    """The optimizer (paper A.3: AdamW, eps 1e-15, weight decay 0.01). Megatron's `adam` is
    AdamW (decoupled weight decay)."""

    SECTION: ClassVar[str] = "optimizer"

    name: Literal["adamw"] = _field("adamw", "optimizer")
    adam_beta1: float = _field(0.9, "AdamW beta1", ge=0.0, lt=1.0)
    adam_beta2: float = _field(0.999, "AdamW beta2", ge=0.0, lt=1.0)
    adam_eps: float = _field(1e-15, "AdamW epsilon", gt=0.0)
    weight_decay: float = _field(0.01, "decoupled weight decay", ge=0.0)
    use_distributed_optimizer: bool = _field(True, "shard optimizer state over data-parallel "
                                             "ranks (Megatron distributed optimizer)")

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(kw_only=True, slots=True, frozen=True)
class EvalConfig:
    """Held-out validation feeding the compute-scaling curve (SCALERL.md section 1): mean pass
    rate over samples_per_prompt samples of num_heldout_prompts prompts held out of training."""

    SECTION: ClassVar[str] = "eval"

    interval_steps: int = _field(100, "evaluate every this many optimizer steps; 0 = never", ge=0)
    num_heldout_prompts: int = _field(1000, "prompts held out of the training data", ge=1)
    samples_per_prompt: int = _field(16, "samples per held-out prompt (mean@16)", ge=1)
    at_step_zero: bool = _field(True, "evaluate before training: R0 of the curve fit")
    warmup_compute_gpu_hours: float = _field(1500.0, "curve points before this much compute are "
                                             "excluded from fits", ge=0.0)

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointConfig:
    """Run checkpoints (megatron_rl/resilience, docs/fault_tolerance.md): model, optimizer, RNG,
    sampler/NPR state, the rollout buffer and the prompts in flight, the scaling log and the
    recipe, written atomically with a manifest of checksums. `dir` defaults to
    <output_dir>/checkpoints (RunConfig.checkpoint_dir)."""

    SECTION: ClassVar[str] = "checkpoint"

    dir: str | None = _field(None, "where checkpoints are written; null = "
                             "<output_dir>/checkpoints")
    interval_steps: int = _field(100, "save every this many optimizer steps, and after the "
                                 "last one; 0 = only after the last one", ge=0)
    keep_last: int = _field(3, "checkpoints kept on disk (older ones deleted); 0 = keep all",
                            ge=0)
    load: str | None = _field(None, "a run checkpoint (a step_<N> directory) to resume from; "
                              "null = the newest valid one in dir, as resume says")
    resume: Literal["auto", "always", "never"] = _field(
        "auto", "auto: resume from the newest valid checkpoint in dir when there is one, else "
        "start fresh; always: a checkpoint is required (megatron-rl train --resume); never: "
        "start fresh (output_dir must not hold a previous run)")
    format: Literal["torch_dist"] = _field("torch_dist", "checkpoint format (Megatron "
                                           "ckpt_format; resharding across parallel layouts)")
    timeout_s: float = _field(1800.0, "longest wait for the trainer ranks to write a checkpoint "
                              "(or finish writing an asynchronous one) or to load one; past "
                              "it the trainer counts as hung", gt=0.0)
    async_save: Literal["auto", "always", "never"] = _field(
        "auto", "write the trainer's shards in the background while training goes on (Megatron "
        "async save; the checkpoint is committed once they are complete): auto = where the "
        "trainer ranks have CUDA (Megatron stages tensors with CUDA; on CPU the save is "
        "synchronous, with a message), always = required (an error without CUDA), never")

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig:
    """The prompts: a prompt file (.jsonl, .parquet, or a directory of a Hugging Face datasets
    split saved with save_to_disk; in megatron_rl's layout with any mix of tasks, verl's, or
    question/answer: docs/data.md) or `rg/<dataset>`, problems generated by reasoning-gym's
    procedural dataset (graded by its own scorer). eval.num_heldout_prompts of them are held out
    for validation (split per task, deterministic in data.split_seed, by default the run's
    seed)."""

    SECTION: ClassVar[str] = "data"

    prompts: str = _field("rg/basic_arithmetic", "a .jsonl / .parquet prompt file, a saved "
                          "datasets split (directory), or rg/<reasoning-gym dataset> to generate "
                          "them (docs/data.md)")
    num_generated_prompts: int = _field(2000, "rg/<dataset>: how many problems to generate "
                                        "(training + held out)", ge=2)
    split_seed: int | None = _field(
        None, "the seed of the held-out split and of rg/<dataset> problems; null: the run's "
        "seed. Fixed across a sweep's seeds, every seed validates on the same problems", ge=0)

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self.prompts.startswith("rg/") or self.prompts.endswith((".jsonl", ".parquet"))
                 or Path(self.prompts).suffix == "" or Path(self.prompts).is_dir(),
                 f"data.prompts: {self.prompts!r} is neither a .jsonl / .parquet prompt file, a "
                 "saved datasets split (a directory), nor rg/<reasoning-gym dataset> (e.g. "
                 "rg/basic_arithmetic)")


@dataclass(kw_only=True, slots=True, frozen=True)
class ClusterConfig:
    """Where the run's processes go (Ray). Without an address a local Ray cluster is started on
    this machine (loopback only); with one, the run joins that cluster. Disaggregated placement
    gives trainer ranks and generator engines their own devices; colocated placement shares
    them (memory released and resumed between phases)."""

    SECTION: ClassVar[str] = "cluster"

    address: str | None = _field(None, "Ray cluster address to join (e.g. 10.0.0.1:6379); null "
                                 "= start a local cluster")
    colocated: bool = _field(False, "trainer ranks and generators share devices: generation and "
                             "training alternate, the generators' memory released during "
                             "training (needs a synchronous schedule, rollout.num_generators x "
                             "rollout.tp_size = parallelism.world_size, "
                             "rollout.mem_fraction_static set, and on GPU "
                             "weight_sync.transport=tensor); false = disaggregated")
    num_cpus: int | None = _field(None, "local cluster: the CPUs Ray offers (each CPU trainer "
                                  "rank and generator takes one; more than the machine has "
                                  "oversubscribes it); null = the machine's count", ge=1)
    placement_timeout_s: float = _field(
        300.0, "longest wait for Ray to reserve the run's placement group (its trainer and "
        "generator bundles) at start; on a shared cluster, or with a sweep's parallel runs "
        "queued behind each other, raise it to the time a run may wait for room", gt=0)

    def __post_init__(self) -> None:
        _check_fields(self)
        _require(self.address is None or self.num_cpus is None,
                 f"cluster.num_cpus: only for a local cluster; joining {self.address!r} uses "
                 "that cluster's resources: set it to null")


@dataclass(kw_only=True, slots=True, frozen=True)
class WandbConfig:
    """Weights & Biases logging, off by default. When on, the run's TensorBoard scalars, its
    config and, at the end, its fitted scaling-curve plot also go to a W&B run
    (megatron_rl/wandb_logging.py; needs the `wandb` package, which `make setup` installs).
    `offline` writes the run under `dir` without network (upload it later with `wandb sync`);
    `online` needs a W&B login (WANDB_API_KEY)."""

    SECTION: ClassVar[str] = "logging.wandb"

    mode: Literal["disabled", "online", "offline"] = _field(
        "disabled", "W&B's run mode (wandb.init mode): disabled = no W&B; offline = written to "
        "disk only, for `wandb sync` later")
    project: str = _field("megatron_rl", "W&B project")
    entity: str | None = _field(None, "W&B entity (user or team); null = the login's default")
    run_name: str | None = _field(None, "W&B run name; null = the run's `name`")
    dir: str | None = _field(None, "folder W&B writes its run files under (<dir>/wandb/); "
                             "null = <output_dir>")

    def __post_init__(self) -> None:
        _check_fields(self)


@dataclass(kw_only=True, slots=True, frozen=True)
class LoggingConfig:
    """Metrics output. `tensorboard_dir` defaults to <output_dir>/tensorboard
    (RunConfig.tensorboard_dir)."""

    SECTION: ClassVar[str] = "logging"

    tensorboard_dir: str | None = _field(None, "TensorBoard event directory; null = "
                                         "<output_dir>/tensorboard")
    log_interval: int = _field(1, "log metrics every this many optimizer steps", ge=1)
    progress_bar: bool = _field(True, "show the driver's progress on stderr: a bar in a "
                                "terminal, one plain line per step in a log file")
    rollout_samples: bool = _field(
        False, "write the shape of every trained completion to "
        "<output_dir>/rollout_samples/step_<N>.jsonl: lengths, the drawn thinking budget, "
        "interruption, the policy versions of its tokens (runs), reward; no text")
    wandb: WandbConfig = _section(WandbConfig, "Weights & Biases (off by default)")

    def __post_init__(self) -> None:
        _check_fields(self)


# A dotted Python module name (environment.modules).
_MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


@dataclass(kw_only=True, slots=True, frozen=True)
class EnvironmentConfig:
    """Environments (megatron_rl/environments, docs/environments.md): what a task's trajectories
    are generated against. The verifiers are single-turn environments: math, code and rg/ tasks
    are generated and scored exactly as without this section. A task "tool/<task>" runs the
    Python tool environment (the model calls the code sandbox between tool_call_open and
    tool_call_close; stdout, stderr and the exit status come back as the observation), graded by
    the reward of <task>; `modules` register the user's own environments. A multi-turn
    trajectory has at most max_turns model turns, each within rollout.thinking_budget +
    rollout.solution_budget tokens, and at most max_trajectory_tokens tokens after the prompt
    (model and observation tokens; observations have loss mask 0); a prompt plus its longest
    trajectory must fit train.micro_batch_max_tokens and the model's context (checked at load
    when a task is multi-turn)."""

    SECTION: ClassVar[str] = "environment"

    modules: tuple[str, ...] = _field(
        (), "Python modules (dotted names, on PYTHONPATH or installed; imported by the driver) "
        "that define register_environments(registry, **context) and register the user's own "
        "environments by task tag, as verifiers are registered; [] = the built-in ones only")
    max_turns: int = _field(8, "most model turns of a multi-turn trajectory (the environment "
                            "gives its verdict after the last one)", ge=1)
    max_trajectory_tokens: int | None = _field(
        None, "most tokens of a multi-turn trajectory after the prompt (model turns and "
        "observations); null = max_turns x (rollout.thinking_budget + rollout.solution_budget)",
        ge=1)
    tool_call_open: str = _field("<tool>", "text that opens a tool call in a model turn")
    tool_call_close: str = _field("</tool>", "text that closes a tool call and ends the model's "
                                  "turn (one token of the policy tokenizer: a stop token)")
    tool_wall_time_s: float = _field(5.0, "wall-time limit of one tool call in the sandbox; a "
                                     "call past it is a tool error the model reads", gt=0.0)
    tool_max_output_chars: int = _field(1000, "longest tool output shown to the model; longer "
                                        "output is cut, with a note of how much", ge=1)
    step_timeout_s: float = _field(
        1800.0, "longest wait for an environment's start, one step or close on a trajectory; "
        "past it the call is cancelled and the trajectory ends as a verifier failure (its group "
        "dropped, as with a failed verifier), so a hung environment cannot stall the run. The "
        "wait includes the environment's own queue (a tool call waits for a sandbox worker: "
        "allow calls in flight / sandbox workers x tool_wall_time_s); more than "
        "tool_wall_time_s", gt=0.0)
    tool_system_prompt: str | None = _field(
        None, "system message prepended to a tool task's conversation (how to call the tool); "
        "null = the conversation as the prompt file gives it")
    observation_template: str = _field(
        "{content}", "how an observation message becomes text for a tokenizer without a chat "
        "template (e.g. '<output>{content}</output>'); with a chat template the template "
        "renders it")

    def __post_init__(self) -> None:
        _check_fields(self)
        bad = [name for name in self.modules if not _MODULE_NAME.match(name)]
        _require(not bad, f"environment.modules: {bad[0]!r} is not a Python module name "
                 "(dotted identifiers, e.g. my_envs or my_package.environments); give the "
                 "module to import, not a file path" if bad else "")
        for name in ("tool_call_open", "tool_call_close"):
            _require(getattr(self, name).strip() != "",
                     f"environment.{name}: empty; give the text that marks a tool call, e.g. "
                     "'<tool>' and '</tool>'")
        _require(self.tool_call_open != self.tool_call_close,
                 f"environment.tool_call_close: equal to tool_call_open "
                 f"({self.tool_call_open!r}); a call needs distinct open and close texts")
        _require(self.tool_system_prompt is None or self.tool_system_prompt.strip() != "",
                 "environment.tool_system_prompt: empty; give the system message or null")
        _require(self.step_timeout_s > self.tool_wall_time_s,
                 f"environment.step_timeout_s ({self.step_timeout_s:g}) must exceed "
                 f"environment.tool_wall_time_s ({self.tool_wall_time_s:g}): a step runs a tool "
                 "call, and one past its wall time is an observation the model reads, not a "
                 "hung environment; raise step_timeout_s")
        _check_observation_template(self.observation_template)


def _check_observation_template(template: str) -> None:
    """environment.observation_template: a str.format template of {content} alone."""
    import string

    try:
        names = [name for _, name, _, _ in string.Formatter().parse(template)
                 if name is not None]
    except ValueError as err:
        raise ConfigError(f"environment.observation_template: {template!r} is not a format "
                          f"string ({err}); write literal braces as {{{{ and }}}}") from None
    _require("content" in names and set(names) == {"content"},
             f"environment.observation_template: {template!r} must contain {{content}} (the "
             f"observation's text) and no other field, got fields {names}; e.g. "
             "'<output>{content}</output>'")


def _check_fp8_serving(cfg: "RunConfig") -> None:
    """rollout.precision=fp8 refused at config load where it cannot work (fp8_serving_problem),
    on the model's config.json (model.hf_checkpoint, which `megatron-rl train` needs and the
    served FP8 copy is made from). Without one (plan, cost) the shard sizes are not checked:
    the registry's configs live in the family packages, which import Megatron."""
    hf_config = None
    if cfg.model.hf_checkpoint is not None:
        path = Path(cfg.model.hf_checkpoint) / "config.json"
        if path.is_file():
            hf_config = json.loads(path.read_text())
    _require(cfg.rollout.fp8_block_size is not None or cfg.rollout.fp8_scale_fmt == "float32",
             "rollout.fp8_scale_fmt: ue8m0 (power-of-two) scales are block scales; set "
             "rollout.fp8_block_size (e.g. 128) or rollout.fp8_scale_fmt=float32")
    # SGLang's Fp8Config.get_supported_act_dtypes: the model loader refuses float32 with fp8.
    stored = (hf_config or {}).get("torch_dtype") or (hf_config or {}).get("dtype")
    served = stored if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
    _require(served != "float32",
             f"rollout.dtype: {cfg.rollout.dtype}"
             + (f" (the checkpoint's {stored})" if cfg.rollout.dtype == "auto" else "")
             + " cannot serve FP8: SGLang's FP8 layers compute in bfloat16 or float16; set "
             "rollout.dtype=bfloat16")
    if cfg.model.name not in FP8_SERVED_FAMILIES or hf_config is not None:
        problem = fp8_serving_problem(cfg.model.name, hf_config or {}, cfg.rollout.fp8_block_size,
                                      cfg.rollout.tp_size, cfg.rollout.ep_size)
        _require(problem is None, problem or "")


@dataclass(kw_only=True, slots=True, frozen=True)
class RunConfig:
    """One RL run. Rules spanning sections: train.global_batch_size is a multiple of
    rollout.samples_per_prompt; train.micro_batch_max_tokens >= rollout.max_sequence_tokens;
    MoE models with tensor parallelism need parallelism.sequence_parallel;
    environment.max_trajectory_tokens (when set) >= one turn's budget. `seed` is the one seed
    of the run (model init, prompt order and sampling seeds derive from it)."""

    SECTION: ClassVar[str] = ""

    name: str = _field("scalerl", "run name (logs, TensorBoard)")
    output_dir: str = _field("runs/scalerl", "run directory: saved config, default checkpoint "
                             "and TensorBoard directories")
    seed: int = _field(1234, "the run's seed", ge=0)
    model: ModelConfig = _section(ModelConfig, "the policy model")
    parallelism: ParallelismConfig = _section(ParallelismConfig, "trainer parallel layout")
    rollout: RolloutConfig = _section(RolloutConfig, "generators and sampling")
    weight_sync: WeightSyncConfig = _section(WeightSyncConfig, "trainer -> generator weight "
                                             "transfer")
    algorithm: AlgorithmConfig = _section(AlgorithmConfig, "RL objective")
    train: TrainConfig = _section(TrainConfig, "optimizer-step loop")
    optimizer: OptimizerConfig = _section(OptimizerConfig, "optimizer")
    eval: EvalConfig = _section(EvalConfig, "held-out validation")
    checkpoint: CheckpointConfig = _section(CheckpointConfig, "checkpoints")
    data: DataConfig = _section(DataConfig, "prompts")
    cluster: ClusterConfig = _section(ClusterConfig, "Ray cluster and placement")
    logging: LoggingConfig = _section(LoggingConfig, "metrics output")
    environment: EnvironmentConfig = _section(EnvironmentConfig, "environments and multi-turn "
                                              "trajectories")

    def __post_init__(self) -> None:
        _check_fields(self)
        group = self.rollout.samples_per_prompt
        batch = self.train.global_batch_size
        lower = batch - batch % group
        nearest = f"{lower} or {lower + group}" if lower else f"{group}"
        _require(batch % group == 0,
                 f"train.global_batch_size: {batch} is not a multiple of "
                 f"rollout.samples_per_prompt ({group}); a step takes whole groups: use "
                 f"{nearest}")
        longest = self.rollout.max_sequence_tokens
        _require(self.train.micro_batch_max_tokens >= longest,
                 f"train.micro_batch_max_tokens: {self.train.micro_batch_max_tokens} cannot hold "
                 f"the longest sequence (rollout.max_sequence_tokens = max_prompt_tokens + "
                 f"thinking_budget + solution_budget = {longest}); raise it to >= {longest} or "
                 "lower the rollout budgets")
        par = self.parallelism
        _require(self.model.name not in MOE_MODEL_FAMILIES or par.tensor_model_parallel_size == 1
                 or par.sequence_parallel,
                 f"parallelism.sequence_parallel: MoE model {self.model.name!r} with "
                 f"tensor_model_parallel_size={par.tensor_model_parallel_size} needs "
                 "sequence parallelism; set parallelism.sequence_parallel=true")
        _require(not self.cluster.colocated or self.rollout.mode == "ppo_off_policy"
                 or self.rollout.max_off_policyness == 0,
                 f"cluster.colocated: generators and trainer ranks share devices, so generation "
                 f"and training alternate; rollout.mode pipeline with max_off_policyness="
                 f"{self.rollout.max_off_policyness} would generate during training. Set "
                 f"rollout.max_off_policyness=0 (synchronous) or rollout.mode=ppo_off_policy")
        _require(not self.cluster.colocated or self.rollout.num_generators * self.rollout.tp_size
                 == par.world_size,
                 f"cluster.colocated: the generators' devices (rollout.num_generators "
                 f"{self.rollout.num_generators} x rollout.tp_size {self.rollout.tp_size}) must be "
                 f"the trainer's (parallelism.world_size {par.world_size})")
        _require(not self.cluster.colocated or self.rollout.mem_fraction_static is not None,
                 "cluster.colocated: rollout.mem_fraction_static is null, so each engine would "
                 "take SGLang's default share of devices the trainer ranks also hold; set "
                 "rollout.mem_fraction_static (`megatron-rl plan RECIPE.yaml` reports the "
                 "largest that fits beside the trainer)")
        _require(par.context_parallel_size == 1 or self.model.use_transformer_engine,
                 f"parallelism.context_parallel_size: {par.context_parallel_size} needs "
                 "Transformer Engine attention on a GPU (model.use_transformer_engine=true); the "
                 "local (CPU) layer spec has no context-parallel attention: set it to 1 on CPU")
        _require(self.model.name in MOE_MODEL_FAMILIES or par.expert_model_parallel_size == 1,
                 f"parallelism.expert_model_parallel_size: dense model {self.model.name!r} has no "
                 f"experts to split (got {par.expert_model_parallel_size}); set it to 1")
        if self.rollout.precision == "fp8":
            _check_fp8_serving(self)
        env = self.environment
        _require(env.max_trajectory_tokens is None
                 or env.max_trajectory_tokens >= self.rollout.max_response_tokens,
                 f"environment.max_trajectory_tokens: {env.max_trajectory_tokens} is less than "
                 f"one turn's budget (rollout.thinking_budget + rollout.solution_budget = "
                 f"{self.rollout.max_response_tokens}); raise it to >= "
                 f"{self.rollout.max_response_tokens} or null (max_turns x that budget)")

    @property
    def prompts_per_step(self) -> int:
        """train.global_batch_size / rollout.samples_per_prompt: prompts per optimizer step."""
        return self.train.global_batch_size // self.rollout.samples_per_prompt

    @property
    def checkpoint_dir(self) -> str:
        """checkpoint.dir, or <output_dir>/checkpoints."""
        return self.checkpoint.dir or str(Path(self.output_dir) / "checkpoints")

    @property
    def tensorboard_dir(self) -> str:
        """logging.tensorboard_dir, or <output_dir>/tensorboard."""
        return self.logging.tensorboard_dir or str(Path(self.output_dir) / "tensorboard")

    @property
    def max_trajectory_tokens(self) -> int:
        """environment.max_trajectory_tokens, or max_turns x rollout.max_response_tokens."""
        if self.environment.max_trajectory_tokens is not None:
            return self.environment.max_trajectory_tokens
        return self.environment.max_turns * self.rollout.max_response_tokens


# --------------------------------------------------------------------------------------------
# YAML: loading, overrides, saving
# --------------------------------------------------------------------------------------------

# PyYAML implements YAML 1.1, where `5e-7` (no dot) is a string; the YAML 1.2 float syntax below
# makes `train.lr=5e-7` a float, and the dumper uses the same rule so strings that look like
# floats are quoted on save and round-trip as strings.
_FLOAT = re.compile(r"""^(?:
     [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _field_names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]


def _section_class(cls: type, name: str) -> type | None:
    hint = _type_hints(cls)[name]
    return hint if dataclasses.is_dataclass(hint) else None


def _unknown_key(cls: type, prefix: str, key: Any) -> ConfigError:
    names = _field_names(cls)
    where = f"in '{prefix}'" if prefix else "at the top level"
    close = difflib.get_close_matches(str(key), names, n=1)
    hint = f"did you mean '{_join(prefix, close[0])}'? " if close else ""
    return ConfigError(f"{_join(prefix, str(key))}: unknown field; {hint}"
                       f"valid names {where}: {', '.join(names)}")


def _from_dict(cls: type, data: dict[str, Any], prefix: str) -> Any:
    """Build `cls` from a nested dict, rejecting unknown keys with the closest valid name."""
    names = set(_field_names(cls))
    for key in data:
        if key not in names:
            raise _unknown_key(cls, prefix, key)
    kwargs = {}
    for name, value in data.items():
        sub = _section_class(cls, name)
        if sub is not None:
            path = _join(prefix, name)
            value = {} if value is None else value  # `train:` with every field commented out
            _require(isinstance(value, dict),
                     f"{path}: expected a mapping of {path}.* fields, got "
                     f"{type(value).__name__} {value!r}")
            value = _from_dict(sub, value, path)
        kwargs[name] = value
    return cls(**kwargs)


def _parse_override(raw: dict[str, Any], text: str) -> None:
    """Apply one `section.field=value` override to the raw nested dict; the value is YAML."""
    key, sep, value_text = text.partition("=")
    key = key.strip()
    _require(bool(sep) and bool(key),
             f"override {text!r}: expected FIELD=VALUE or SECTION.FIELD=VALUE, e.g. "
             "train.lr=5e-7 or model.fp8=null")
    try:
        value = yaml.load(value_text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as err:
        raise ConfigError(f"override {text!r}: the value is not valid YAML ({err})") from err
    cls, node, prefix = RunConfig, raw, ""
    parts = key.split(".")
    for i, part in enumerate(parts):
        if part not in _field_names(cls):
            raise _unknown_key(cls, prefix, part)
        path = _join(prefix, part)
        sub = _section_class(cls, part)
        last = i == len(parts) - 1
        if last:
            if sub is not None:
                raise ConfigError(f"override {text!r}: {path} is a section; override its fields "
                                  f"one by one, e.g. {path}.{_field_names(sub)[0]}=VALUE")
            node[part] = value
        else:
            _require(sub is not None, f"override {text!r}: {path} is a field, not a section; "
                     f"write {path}=VALUE")
            if node.get(part) is None:
                node[part] = {}
            child = node[part]
            _require(isinstance(child, dict), f"{path}: expected a mapping of {path}.* fields, "
                     f"got {type(child).__name__} {child!r}")
            cls, node, prefix = sub, child, path


def _read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError as err:
        raise ConfigError(f"config file {str(path)!r} does not exist") from err
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {err}") from err
    if data is None:
        return {}
    _require(isinstance(data, dict), f"config file {str(path)!r}: expected a mapping of "
             f"sections at the top level, got {type(data).__name__}")
    return data


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run configuration from a YAML file (None = all defaults) and dotted overrides such as
    `train.lr=5e-7` or `model.fp8=null`, applied in order (values are parsed as YAML)."""
    _require(not isinstance(overrides, str),
             f"overrides must be a list of 'section.field=value' strings, got the string "
             f"{overrides!r}")
    raw = _read_yaml(path) if path is not None else {}
    for text in overrides:
        _parse_override(raw, text)
    return _from_dict(RunConfig, raw, "")


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict of a config (or of one section): YAML-, JSON- and pickle-safe."""
    return dataclasses.asdict(cfg)


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, tuple):  # a list field (tuple[X, ...]), written as a flow list: [a, b]
        return yaml.dump(list(value), Dumper=_Dumper, width=sys.maxsize, allow_unicode=True,
                         default_flow_style=True).rstrip("\n")
    line = yaml.dump({"x": value}, Dumper=_Dumper, width=sys.maxsize, allow_unicode=True)
    return line[len("x: "):].rstrip("\n")


def config_to_yaml(cfg: RunConfig, *, comments: bool = True) -> str:
    """The whole config as YAML, every field spelled out; with `comments`, each field is preceded
    by its meaning and allowed values. `load_config` of the text gives back an equal config."""
    lines = []
    if comments:
        lines += ["# megatron_rl run configuration (megatron_rl/config.py): every field with its",
                  "# meaning and allowed values; reference: docs/config.md.",
                  "# `python -m megatron_rl.config [RECIPE] [OVERRIDES...]` prints this for any",
                  "# recipe; with no arguments it prints the ScaleRL defaults",
                  "# (examples/configs/scalerl_default.yaml).", ""]

    def emit(obj: Any, indent: str) -> None:
        hints = _type_hints(type(obj))
        for f in fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                if comments:
                    lines.append(f"{indent}# {_first_sentence(type(value))}")
                lines.append(f"{indent}{f.name}:")
                emit(value, indent + "  ")
                lines.append("")
                continue
            if comments:
                text = f"{f.metadata['help']} [{_describe(hints[f.name])}{_bounds_text(f)}]"
                lines.extend(textwrap.wrap(text, width=98, initial_indent=f"{indent}# ",
                                           subsequent_indent=f"{indent}#   "))
            lines.append(f"{indent}{f.name}: {_yaml_scalar(value)}")

    emit(cfg, "")
    return "\n".join(lines).rstrip("\n") + "\n"


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write `cfg` as commented YAML; `load_config(path)` returns an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(cfg))


# --------------------------------------------------------------------------------------------
# Reference documentation
# --------------------------------------------------------------------------------------------

def _first_sentence(cls: type) -> str:
    return re.split(r"\.\s", inspect.getdoc(cls).replace("\n", " "), maxsplit=1)[0] + "."


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _bounds_text(f: dataclasses.Field) -> str:
    return "".join(f", {_BOUNDS[k][1]} {v}" for k, v in f.metadata["bounds"].items())


def _markdown_section(cls: type, title: str) -> list[str]:
    lines = [f"## {title}", "", inspect.getdoc(cls).replace("\n", " "), "",
             "| field | default | allowed | meaning |", "|---|---|---|---|"]
    hints = _type_hints(cls)
    for f in fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            default, allowed = f"see `{f.name}` below", f"`{hint.__name__}`"
        else:
            default = f"`{_yaml_scalar(f.default)}`"
            allowed = (_describe(hint) + _bounds_text(f)).replace("'", "`")
        cells = (f"`{f.name}`", default, allowed, f.metadata["help"])
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    derived = [(n, p) for n, p in vars(cls).items() if isinstance(p, property)]
    if derived:
        lines += ["", "Derived, read-only:", ""]
        lines += [f"- `{name}`: {inspect.getdoc(prop)}" for name, prop in derived]
    return lines + [""]


def config_reference_markdown() -> str:
    """docs/config.md: every section and field with its default, allowed values and meaning."""
    lines = ["# Run configuration reference", "",
             "Generated from the dataclasses in `megatron_rl/config.py` by "
             "`config_reference_markdown()`; do not edit by hand. Regenerate with "
             "`.venv/bin/python -m megatron_rl.config --markdown > docs/config.md` (a unit test "
             "checks that this file is current).", "",
             "A run is loaded with `load_config(path, overrides)`: a YAML file (see "
             "`examples/configs/`) and dotted overrides such as `train.lr=5e-7` or "
             "`model.fp8=null`, whose values are read as YAML. Unknown names, wrong types "
             "(integers are accepted for numbers, but `true` is not an integer and `\"5\"` is "
             "not a number) and inconsistent values are errors naming the field.", ""]
    lines += _markdown_section(RunConfig, "Top level (`RunConfig`)")
    hints = _type_hints(RunConfig)
    for f in fields(RunConfig):
        if dataclasses.is_dataclass(hints[f.name]):
            lines += _markdown_section(hints[f.name], f"`{f.name}` (`{hints[f.name].__name__}`)")
            inner = _type_hints(hints[f.name])  # sections within a section (logging.wandb)
            lines += [line for g in fields(hints[f.name]) if dataclasses.is_dataclass(inner[g.name])
                      for line in _markdown_section(
                          inner[g.name], f"`{f.name}.{g.name}` (`{inner[g.name].__name__}`)")]
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_rl.config",
        description="Print a resolved run configuration as YAML, or the reference docs.")
    parser.add_argument("config", nargs="?", help="YAML recipe (default: all defaults)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=5e-7")
    parser.add_argument("--markdown", action="store_true",
                        help="print docs/config.md (the field reference) instead")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(config_reference_markdown())
        return 0
    if args.config is not None and "=" in args.config and not Path(args.config).exists():
        args.overrides.insert(0, args.config)  # no recipe: the defaults with overrides
        args.config = None
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(config_to_yaml(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
