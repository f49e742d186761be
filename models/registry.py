"""The registry of model families: one name -> one per-model folder under models/.

A `ModelFamily` names a family ("llama", "llama4", "qwen3_moe"), its sizes and the Hugging Face
architectures it converts from, and forwards the Megatron-facing calls (config factory, layer
spec, GPTModel kwargs, model build, HF config) to that family's package, imported on first use.
Nothing here switches on substrings of model names: callers look a family up by its exact
registered name, and an unknown name is an error that lists the registered ones.
`HFConfigFamily` binds a family to one Hugging Face config of any size (a checkpoint's config.json
rather than a registered size) and offers the same trainer-facing calls over the family's converter.

Importing this module does not import Megatron: family packages are imported lazily, after
`megatron_rl.platform.activate_cpu_compat()` (a no-op on GPU machines) has put the CPU shims in
place that `import megatron.core` needs on a CPU-only torch.
"""
from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelFamily:
    """One registered model family; methods delegate to `models.<module>`."""

    name: str
    sizes: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    module: str  # the family package, e.g. "models.llama4"

    def _impl(self) -> ModuleType:
        from megatron_rl.platform import activate_cpu_compat

        activate_cpu_compat()
        return importlib.import_module(self.module)

    def check_size(self, size: str) -> None:
        if size not in self.sizes:
            raise ValueError(
                f"model family {self.name!r} has no size {size!r}; choose one of {self.sizes}")

    def transformer_config(self, size: str, *, use_transformer_engine: bool = False,
                           **overrides: Any):
        """Megatron TransformerConfig of `size`; overrides are TransformerConfig field names."""
        self.check_size(size)
        return self._impl().transformer_config(
            size, use_transformer_engine=use_transformer_engine, **overrides)

    def layer_spec(self, config, *, use_transformer_engine: bool, vp_stage: int | None = None,
                   pp_rank: int | None = None):
        """The decoder spec for this pipeline stage (local modules on CPU, TE modules on GPU)."""
        return self._impl().layer_spec(
            config, use_transformer_engine=use_transformer_engine, vp_stage=vp_stage,
            pp_rank=pp_rank)

    def model_kwargs(self, size: str) -> dict[str, Any]:
        """GPTModel keyword arguments of `size` (vocab, sequence length, position embedding)."""
        self.check_size(size)
        return self._impl().model_kwargs(size)

    def build_model(self, config, *, pre_process: bool, post_process: bool,
                    use_transformer_engine: bool = False, vp_stage: int | None = None):
        """A megatron.core GPTModel for `config` (made by `transformer_config`)."""
        return self._impl().build_model(
            config, pre_process=pre_process, post_process=post_process,
            use_transformer_engine=use_transformer_engine, vp_stage=vp_stage)

    def converter(self) -> ModuleType:
        """The family's HF <-> Megatron weight mapping, `models.<name>.convert`: weight_groups,
        hf_text_config_from_dict, megatron_config and build_model from an HF config."""
        self._impl()  # the family package imports megatron.core: shims first
        return importlib.import_module(f"{self.module}.convert")

    def hf_config(self, size: str) -> dict[str, Any]:
        """The Hugging Face config.json content of `size`."""
        self.check_size(size)
        return self._impl().hf_config(size)


_FAMILIES: dict[str, ModelFamily] = {
    family.name: family
    for family in (
        ModelFamily(
            name="llama",
            sizes=("tiny", "tiny_long", "llama3_8b"),
            hf_architectures=("LlamaForCausalLM",),
            module="models.llama",
        ),
        ModelFamily(
            name="llama4",
            sizes=("tiny", "tiny_maverick", "scout", "maverick", "demo"),
            hf_architectures=("Llama4ForCausalLM", "Llama4ForConditionalGeneration"),
            module="models.llama4",
        ),
        ModelFamily(
            name="qwen3_moe",
            sizes=("tiny", "30b_a3b"),
            hf_architectures=("Qwen3MoeForCausalLM",),
            module="models.qwen3_moe",
        ),
    )
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class HFConfigFamily:
    """A family bound to one HF config (`hf_config`: the family's transformers text config).

    `transformer_config` / `build_model` have ModelFamily's signatures (the size argument is
    ignored: the config is the size), so RLTrainer accepts it as `family=`; `weight_groups()` is
    the config's HF <-> Megatron mapping (for WeightSync). Local spec only: the converters build
    megatron-core's local modules.
    """

    family: ModelFamily
    hf_config: Any

    def transformer_config(self, size: str | None = None, *, use_transformer_engine: bool = False,
                           **overrides: Any):
        del size
        self._check_local(use_transformer_engine)
        return self.family.converter().megatron_config(self.hf_config, **overrides)

    def build_model(self, config, *, pre_process: bool, post_process: bool,
                    use_transformer_engine: bool = False, vp_stage: int | None = None):
        self._check_local(use_transformer_engine)
        if vp_stage is not None:
            raise NotImplementedError("HFConfigFamily builds no virtual pipeline stages")
        return self.family.converter().build_model(self.hf_config, config,
                                                   pre_process=pre_process,
                                                   post_process=post_process)

    def weight_groups(self) -> list:
        return self.family.converter().weight_groups(self.hf_config)

    def _check_local(self, use_transformer_engine: bool) -> None:
        if use_transformer_engine:
            raise NotImplementedError(
                f"{self.family.name} from an HF config builds the local (CPU) spec only; use a "
                f"registered size ({', '.join(self.family.sizes)}) for Transformer Engine")


def list_model_families() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def get_model_family(name: str) -> ModelFamily:
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(
            f"unknown model family {name!r}; supported families: {', '.join(_FAMILIES)}"
        ) from None


def model_family_for_hf_architecture(architecture: str) -> ModelFamily:
    """The family that converts the HF class `architecture` (config.json "architectures")."""
    for family in _FAMILIES.values():
        if architecture in family.hf_architectures:
            return family
    known = sorted(a for f in _FAMILIES.values() for a in f.hf_architectures)
    raise ValueError(f"no model family converts HF architecture {architecture!r}; known: {known}")


def model_family_for_hf_config(config: dict[str, Any]) -> HFConfigFamily:
    """The family of a config.json's content (by its "architectures"), bound to that config
    (for a multimodal config.json, to its text config)."""
    architectures = config.get("architectures") or []
    if len(architectures) != 1:
        raise ValueError(f"config.json names architectures {architectures}; expected exactly one")
    family = model_family_for_hf_architecture(architectures[0])
    return HFConfigFamily(family=family,
                          hf_config=family.converter().hf_text_config_from_dict(config))
