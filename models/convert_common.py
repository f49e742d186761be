"""What every family's HF <-> Megatron weight mapping shares: the `WeightGroup` unit, the two
streaming iterators over groups, the fused-QKV and gated-MLP layouts, and a meta-device model build.

A mapping is an ordered list of `WeightGroup`s. A group names the HF tensors and the Megatron
tensors that determine each other (one layer's q/k/v <-> its fused linear_qkv; a layer's fused HF
experts <-> its per-expert Megatron linear_fc1s) and converts them both ways. Megatron names are the
parameter names of a TP1/EP1/PP1 GPTModel built with the local spec: full tensors, layers and
experts numbered globally. Consumers never hold more than one group's tensors: the checkpoint tools
pull each group's inputs from disk, and the live weight sync (later) feeds TP/EP-gathered tensors.
Pure torch; the meta build imports megatron.core only when called.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

TensorDict = dict[str, torch.Tensor]
TensorGetter = Callable[[str], torch.Tensor]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class WeightGroup:
    """HF tensors `hf_names` <-> Megatron tensors `megatron_names`, convertible as one unit.

    `to_megatron(hf)` takes {hf_name: tensor} for every name in `hf_names` and returns {megatron
    name: tensor} for every name in `megatron_names`; `to_hf` is its exact inverse (values are
    moved, never rounded: a round trip is bit-exact). Both work on meta tensors (shape planning).
    """

    hf_names: tuple[str, ...]
    megatron_names: tuple[str, ...]
    to_megatron: Callable[[TensorDict], TensorDict]
    to_hf: Callable[[TensorDict], TensorDict]


def renamed(hf_name: str, megatron_name: str) -> WeightGroup:
    """A tensor stored identically on both sides under two names."""
    return WeightGroup(hf_names=(hf_name,), megatron_names=(megatron_name,),
                       to_megatron=lambda hf: {megatron_name: hf[hf_name]},
                       to_hf=lambda mg: {hf_name: mg[megatron_name]})


def concatenated(hf_names: tuple[str, ...], megatron_name: str) -> WeightGroup:
    """Megatron's tensor is the HF tensors concatenated along dim 0 (e.g. fc1 = [gate; up])."""

    def to_hf(mg: TensorDict) -> TensorDict:
        parts = mg[megatron_name].chunk(len(hf_names), dim=0)
        return dict(zip(hf_names, parts))

    return WeightGroup(hf_names=hf_names, megatron_names=(megatron_name,),
                       to_megatron=lambda hf: {megatron_name: torch.cat([hf[n] for n in hf_names])},
                       to_hf=to_hf)


def fused_qkv(q_name: str, k_name: str, v_name: str, megatron_name: str, *,
              num_attention_heads: int, num_query_groups: int) -> WeightGroup:
    """Megatron's fused linear_qkv: per query group g the rows [its q heads; k_g; v_g].

    HF q_proj [heads * d, H], k_proj / v_proj [groups * d, H]; Megatron [(heads + 2 groups) d, H].
    """
    if num_attention_heads % num_query_groups:
        raise ValueError(f"num_attention_heads {num_attention_heads} is not a multiple of "
                         f"num_query_groups {num_query_groups}")

    def to_megatron(hf: TensorDict) -> TensorDict:
        q, k, v = hf[q_name], hf[k_name], hf[v_name]
        hidden = q.shape[-1]
        qkv = torch.cat([q.reshape(num_query_groups, -1, hidden),
                         k.reshape(num_query_groups, -1, hidden),
                         v.reshape(num_query_groups, -1, hidden)], dim=1)
        return {megatron_name: qkv.reshape(-1, hidden)}

    def to_hf(mg: TensorDict) -> TensorDict:
        qkv = mg[megatron_name]
        hidden = qkv.shape[-1]
        head_dim = qkv.shape[0] // (num_attention_heads + 2 * num_query_groups)
        q_rows = num_attention_heads // num_query_groups * head_dim
        per_group = qkv.reshape(num_query_groups, -1, hidden)  # [groups, (heads/groups + 2) d, H]
        q, k, v = per_group.split([q_rows, head_dim, head_dim], dim=1)
        return {q_name: q.reshape(-1, hidden), k_name: k.reshape(-1, hidden),
                v_name: v.reshape(-1, hidden)}

    return WeightGroup(hf_names=(q_name, k_name, v_name), megatron_names=(megatron_name,),
                       to_megatron=to_megatron, to_hf=to_hf)


def plain_text_config(config_cls: type):
    """`hf_text_config_from_dict` of a family whose checkpoint config.json is its text config
    (no multimodal wrapper): the config class built from every field but the two class tags."""

    def hf_text_config_from_dict(config: dict):
        return config_cls(**{k: v for k, v in config.items()
                             if k not in ("architectures", "model_type")})

    return hf_text_config_from_dict


def no_weight_prefix(config: dict) -> str:
    """`hf_weight_prefix` of a text-only checkpoint: its weights have no prefix."""
    del config
    return ""


def no_ignored_prefixes(config: dict) -> tuple[str, ...]:
    """`hf_ignored_prefixes` of a text-only checkpoint: nothing to skip."""
    del config
    return ()


def unchanged_config(config: dict) -> dict:
    """`text_only_hf_config` of a text-only checkpoint: its config as it is."""
    return dict(config)


def decoder_weight_groups(hf, layer_groups: Callable[[object, int, str], list[WeightGroup]], *,
                          prefix: str = "") -> list[WeightGroup]:
    """A decoder-only model's mapping in checkpoint order: embeddings, layers 0..L-1 (each from
    `layer_groups(hf, layer, prefix)`), final norm, and the LM head unless tied. `hf` is the
    family's HF config (num_hidden_layers, tie_word_embeddings)."""
    groups = [renamed(f"{prefix}model.embed_tokens.weight", "embedding.word_embeddings.weight")]
    for layer in range(hf.num_hidden_layers):
        groups += layer_groups(hf, layer, prefix)
    groups.append(renamed(f"{prefix}model.norm.weight", "decoder.final_layernorm.weight"))
    if not hf.tie_word_embeddings:
        groups.append(renamed(f"{prefix}lm_head.weight", "output_layer.weight"))
    return groups


def attention_groups(hf, hf_layer: str, megatron_layer: str, *,
                     qk_norm: bool = False) -> list[WeightGroup]:
    """A Llama-style layer's attention block: input norm, fused GQA qkv, (per-head q/k norms),
    output projection and the post-attention norm (Megatron's pre_mlp_layernorm). `hf_layer` /
    `megatron_layer` are the layer's name prefixes, ending in a dot."""
    h, m = hf_layer, megatron_layer
    groups = [
        renamed(h + "input_layernorm.weight", m + "input_layernorm.weight"),
        fused_qkv(h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight",
                  h + "self_attn.v_proj.weight", m + "self_attention.linear_qkv.weight",
                  num_attention_heads=hf.num_attention_heads,
                  num_query_groups=hf.num_key_value_heads),
    ]
    if qk_norm:
        groups += [
            renamed(h + "self_attn.q_norm.weight", m + "self_attention.q_layernorm.weight"),
            renamed(h + "self_attn.k_norm.weight", m + "self_attention.k_layernorm.weight"),
        ]
    return groups + [
        renamed(h + "self_attn.o_proj.weight", m + "self_attention.linear_proj.weight"),
        renamed(h + "post_attention_layernorm.weight", m + "pre_mlp_layernorm.weight"),
    ]


def iterate_hf_to_megatron(groups: Iterable[WeightGroup],
                           get_hf: TensorGetter) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron name, tensor) for every group, pulling each group's HF inputs from `get_hf`."""
    for group in groups:
        yield from group.to_megatron({name: get_hf(name) for name in group.hf_names}).items()


def iterate_megatron_to_hf(groups: Iterable[WeightGroup],
                           get_megatron: TensorGetter) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every group, pulling each group's Megatron inputs from
    `get_megatron` (full tensors: TP/EP-gathered, global layer and expert numbers)."""
    for group in groups:
        yield from group.to_hf({name: get_megatron(name) for name in group.megatron_names}).items()


def convert_state_dict(groups: Iterable[WeightGroup], tensors: Mapping[str, torch.Tensor], *,
                       to: str) -> TensorDict:
    """Whole-dict convenience (tests, small models): `to` is "megatron" or "hf"."""
    if to == "megatron":
        return dict(iterate_hf_to_megatron(groups, tensors.__getitem__))
    if to == "hf":
        return dict(iterate_megatron_to_hf(groups, tensors.__getitem__))
    raise ValueError(f"to must be 'megatron' or 'hf', got {to!r}")


_FACTORIES = (torch.empty, torch.zeros, torch.ones, torch.full, torch.rand, torch.randn,
              torch.randint, torch.arange, torch.tensor, torch.empty_strided, torch.linspace)


class _ForceMetaDevice(torch.overrides.TorchFunctionMode):
    # Megatron creates many parameters with an explicit device (the current CUDA device, the
    # CPU under the CPU shim); `with torch.device("meta")` only covers calls without one.
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FACTORIES:
            kwargs["device"] = torch.device("meta")
        elif func is torch.Tensor.cuda or func is torch.Tensor.cpu:
            return args[0]
        elif func is torch.Tensor.to and args[0].is_meta:
            # Keep dtype changes, drop device moves (a meta tensor cannot be copied out).
            dtypes = [a for a in args[1:] if isinstance(a, torch.dtype)]
            if isinstance(kwargs.get("dtype"), torch.dtype):
                dtypes.append(kwargs["dtype"])
            return args[0].to(dtypes[0]) if dtypes else args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def meta_device():
    """Every tensor created inside lives on the meta device (shapes only, no memory): a model
    of any size can be built to read its parameter names and checkpoint layout."""
    with _ForceMetaDevice():
        yield
