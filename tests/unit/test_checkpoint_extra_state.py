"""A Transformer Engine model loads a converted checkpoint (issue 39.1).

TE's RMSNorm (pre_mlp_layernorm, final_layernorm) and its attention keep FP8 metadata as
`_extra_state`, which megatron-core saves as ShardedObjects; a checkpoint written from the local
spec (megatron_rl/convert.py) has none, and Megatron's load planner refuses a state dict with keys
the checkpoint lacks. Transformer Engine is not on CPU, so modules of the real local-spec model
get an `_extra_state` of their own (a subclass with get/set_extra_state, the hooks TE's modules
define): megatron-core's sharded-state machinery then makes the same ShardedObjects, under the
same keys, that it makes for TE's modules.
"""
import json

import pytest
import torch

from megatron_rl.trainer.checkpoint import (MODEL_SHARDED_METADATA, CheckpointMismatchError,
                                            load_model_weights)

pytestmark = pytest.mark.unit

# Where the TE spec has modules with `_extra_state` that the local spec's lack (every layer's:
# megatron-core shards a layer's object over the layers).
TE_STATE_SUFFIXES = ("final_layernorm", "pre_mlp_layernorm", "self_attention.core_attention")


def _te_state_modules(model) -> list[str]:
    return sorted(name for name, _ in model.named_modules() if name.endswith(TE_STATE_SUFFIXES))


def _with_extra_state(module: torch.nn.Module, state) -> None:
    """Give `module` an `_extra_state` (as TE's modules have): get returns `state`, set records
    what the load gave it."""
    base = type(module)

    class WithExtraState(base):
        def get_extra_state(self):
            return self._own_state

        def set_extra_state(self, value):
            self.loaded_state = value

    module.__class__ = WithExtraState
    module._own_state = state
    module.loaded_state = None


@pytest.fixture(scope="module")
def converted(megatron_process_group, tmp_path_factory):
    """A tiny Llama converted from its HF checkpoint (the local-spec converter) and the family."""
    import transformers

    from megatron_rl.convert import convert_hf_to_megatron
    from models import get_model_family

    family = get_model_family("llama")
    directory = tmp_path_factory.mktemp("extra_state")
    config = dict(family.hf_config("tiny"))
    model_type = config.pop("model_type")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(model_type, **config), dtype=torch.float32)
    hf.save_pretrained(directory / "hf")
    convert_hf_to_megatron(directory / "hf", directory / "megatron", progress=False)
    assert json.loads((directory / "megatron" / "metadata.json").read_text())
    return family, directory / "megatron"


def _model(family, *, seed: int):
    torch.manual_seed(seed)
    config = family.transformer_config("tiny")
    return family.build_model(config, pre_process=True, post_process=True)


def _sharded_objects(model) -> list[str]:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return sorted(key for key, entry in
                  model.sharded_state_dict(metadata=dict(MODEL_SHARDED_METADATA)).items()
                  if isinstance(entry, ShardedObject))


def test_a_model_with_extra_state_loads_a_checkpoint_without_it(converted):
    family, checkpoint = converted
    reference = _model(family, seed=1)
    load_model_weights(checkpoint, reference)  # the local-spec model: no objects at all
    model = _model(family, seed=2)
    modules = dict(model.named_modules())
    TE_STATE_MODULES = _te_state_modules(model)
    assert len(TE_STATE_MODULES) == 1 + 2 * model.config.num_layers
    plain_objects = _sharded_objects(model)
    for name in TE_STATE_MODULES:
        _with_extra_state(modules[name], {"fp8_meta": name})
    # The objects stand where TE's would (megatron-core's own keys).
    assert sorted(set(_sharded_objects(model)) - set(plain_objects)) == \
        [f"{name}._extra_state" for name in TE_STATE_MODULES]
    load_model_weights(checkpoint, model)  # main: "Missing key in checkpoint state_dict"
    expected = reference.state_dict()
    for name, tensor in model.state_dict().items():
        if not name.endswith("_extra_state"):
            assert torch.equal(tensor, expected[name]), name
    # Each module without state in the checkpoint kept its own.
    assert [modules[name].loaded_state for name in TE_STATE_MODULES] == \
        [{"fp8_meta": name} for name in TE_STATE_MODULES]


def test_extra_state_the_checkpoint_holds_is_loaded(converted, tmp_path):
    from megatron.core import dist_checkpointing

    family, _ = converted
    saved = _model(family, seed=3)
    TE_STATE_MODULES = _te_state_modules(saved)
    for name in TE_STATE_MODULES:
        _with_extra_state(dict(saved.named_modules())[name], {"saved": name})
    dist_checkpointing.save(
        {"model": saved.sharded_state_dict(metadata=dict(MODEL_SHARDED_METADATA))}, tmp_path)
    model = _model(family, seed=4)
    modules = dict(model.named_modules())
    for name in TE_STATE_MODULES:
        _with_extra_state(modules[name], {"own": name})
    load_model_weights(tmp_path, model)
    assert [modules[name].loaded_state for name in TE_STATE_MODULES] == \
        [{"saved": name} for name in TE_STATE_MODULES]
    assert torch.equal(model.output_layer.weight, saved.output_layer.weight)


def test_only_extra_state_may_be_missing(converted):
    """Any other object the checkpoint lacks is a mismatch, named."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_rl.trainer.checkpoint import _drop_missing_extra_state

    sharded = {"decoder.router_state": ShardedObject("decoder.router_state", {}, (1,), (0,)),
               "decoder.norm._extra_state": ShardedObject("decoder.norm._extra_state", None,
                                                          (1,), (0,))}
    with pytest.raises(CheckpointMismatchError, match="decoder.router_state"):
        _drop_missing_extra_state(dict(sharded), {}, "ckpt")
    del sharded["decoder.router_state"]
    assert _drop_missing_extra_state(sharded, {}, "ckpt") == ["decoder.norm._extra_state"]
    assert sharded == {}
