"""FP8 (e4m3) quantisation of the weights an FP8-serving generator holds, in SGLang 0.5.23's
checkpoint layout, and the rule saying which HF tensors those are.

Called on the sender after the gather and the HF conversion, per HF-named tensor (`to_hf`'s
output in sync.py `_convert`): `quantize_named` turns one `<module>.weight` into the FP8 weight
plus its scale tensor, named and shaped as an FP8 checkpoint on disk is, so SGLang's own FP8 weight
loader takes them unchanged (it narrows both per TP rank). `fp8_quantized` says, from the served
config's `quantization_config`, which HF tensors SGLang holds in FP8; everything else is sent as
it is. `served_quantization_config` is the served config's `quantization_config` for a run's
rollout settings; `SyncQuantiser` is what the sync (plan.py, sync.py) applies per HF tensor.

Layouts (SGLang 0.5.23, srt/layers/quantization/fp8.py):
- block-wise (`weight_block_size` [128, 128]): `Fp8LinearMethod.create_fp8_weight_` registers a
  float8_e4m3fn `weight` [N, K] and a float32 `weight_scale_inv` [ceil(N/bn), ceil(K/bk)] (a
  BlockQuantScaleParameter: partial edge blocks get their own scale). Despite the name it is the
  *dequantisation* factor, weight ~= fp8 * scale_inv (fp8_utils.block_quant_dequant multiplies):
  scale_inv = amax(block) / 448. Fp8MoEMethod stacks the per-expert ones the same way.
- per-tensor (no `weight_block_size`): a float32 `weight_scale` per HF tensor (a
  PerTensorScaleParameter slot per fused shard), again the dequantisation factor; computed here
  exactly as SGLang's own online quantisation does (fp8_utils.input_to_float8).
- UE8M0 (`scale_fmt: ue8m0`, what DeepGEMM requantises block scales to): the block scale rounded
  up to a power of two, 2^ceil(log2(amax / 448)), as fp8_utils.per_block_cast_to_fp8 (copied
  from DeepGEMM) computes it, including its amax floor of 1e-4.

Error bound (e4m3: 3 mantissa bits, normals down to 2^-6, subnormal spacing 2^-9, max 448): each
element x of a block with scale s is stored as q = round(x / s) with |x / s| <= 448, and
round-to-nearest makes |q - x/s| <= 2^-4 |x/s| for normals and <= 2^-10 below 2^-6, so
|q * s - x| <= max(2^-4 |x|, 2^-10 s) (plus float32 rounding of x / s, 2^-24 relative). In
particular every element is within amax(block) / 28 of its value (half a step at the top binade).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK_SIZE = (128, 128)
# A block's amax is floored before dividing by it (an all-zero block would give 0 / 0). 1e-4 is
# the floor of SGLang's / DeepGEMM's per_block_cast_to_fp8, kept in both scale formats so a UE8M0
# result is bit-identical to SGLang's; a block whose amax is below it is stored with the
# absolute error bound above (2^-10 * 1e-4 / 448 ~ 2e-10), not the relative one.
BLOCK_AMAX_FLOOR = 1e-4
# Per-tensor: fp8_utils.input_to_float8's floor.
TENSOR_AMAX_FLOOR = 1e-12


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Layout:
    """How a served FP8 model stores its quantised weights: `weight_block_size` (None:
    per-tensor scales) and whether block scales are UE8M0 powers of two."""

    weight_block_size: tuple[int, int] | None = BLOCK_SIZE
    ue8m0: bool = False

    def __post_init__(self) -> None:
        if self.weight_block_size is not None and (
                len(self.weight_block_size) != 2 or min(self.weight_block_size) < 1):
            raise ValueError(f"weight_block_size must be two positive sizes [rows, cols] or None "
                             f"(per-tensor), got {self.weight_block_size}")
        if self.ue8m0 and self.weight_block_size is None:
            raise ValueError("UE8M0 (power-of-two) scales are block scales; set "
                             "weight_block_size or ue8m0=False")

    @classmethod
    def from_quantization_config(cls, quantization_config: Mapping) -> "Fp8Layout":
        """The layout of an HF config's `quantization_config` (the keys SGLang's
        Fp8Config.from_config reads: quant_method, weight_block_size, scale_fmt)."""
        method = quantization_config.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization_config.quant_method is {method!r}; this quantiser "
                             "writes SGLang's 'fp8' layout only (mxfp8, fp4 and int8 are not "
                             "supported)")
        activation_scheme = quantization_config.get("activation_scheme", "dynamic")
        if activation_scheme != "dynamic":
            raise ValueError(f"quantization_config.activation_scheme is {activation_scheme!r}; "
                             "static activation scales (`input_scale`) come from calibration, "
                             "which the weight sync cannot redo: serve with 'dynamic'")
        block = quantization_config.get("weight_block_size")
        return cls(weight_block_size=tuple(block) if block is not None else None,
                   ue8m0=quantization_config.get("scale_fmt") == "ue8m0")

    def scale_name(self, weight_name: str) -> str:
        """The HF name of `weight_name`'s scale tensor: `<module>.weight_scale_inv` (block) or
        `<module>.weight_scale` (per-tensor), the names SGLang's loaders look up."""
        if not weight_name.endswith(".weight"):
            raise ValueError(f"{weight_name!r} is not a `<module>.weight` tensor; SGLang's FP8 "
                             "loaders pair scales with `.weight` names only (send Llama-4's "
                             "fused `experts.gate_up_proj` / `experts.down_proj` through "
                             "unfuse_llama4_experts first)")
        suffix = "weight_scale_inv" if self.weight_block_size is not None else "weight_scale"
        return weight_name[:-len("weight")] + suffix


def quantize_blockwise(weight: torch.Tensor, block_size: tuple[int, int] = BLOCK_SIZE, *,
                       ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [..., M, N], scale_inv float32 [..., ceil(M/bm), ceil(N/bn)]) of `weight`
    [..., M, N] (leading dims: stacked experts, each quantised on its own), with
    weight ~= fp8 * scale_inv block by block. Partial edge blocks are padded with zeros, which
    leave their amax unchanged."""
    if weight.dim() < 2 or not weight.is_floating_point():
        raise ValueError(f"block quantisation needs a floating-point tensor of at least 2 dims, "
                         f"got {weight.dtype} of shape {tuple(weight.shape)}")
    *batch, rows, cols = weight.shape
    block_rows, block_cols = block_size
    num_row_blocks, num_col_blocks = -(-rows // block_rows), -(-cols // block_cols)
    padded = weight.new_zeros(*batch, num_row_blocks * block_rows, num_col_blocks * block_cols,
                              dtype=torch.float32)
    padded[..., :rows, :cols] = weight
    blocks = padded.view(*batch, num_row_blocks, block_rows, num_col_blocks, block_cols)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)  # [..., nrb, 1, ncb, 1]
    _check_finite(amax, weight)
    scale = amax.clamp(min=BLOCK_AMAX_FLOOR) / FP8_MAX
    if ue8m0:
        scale = ceil_to_power_of_two(scale)
    # |blocks / scale| <= 448 up to float32 rounding; the clamp keeps the cast in range (CPU
    # torch saturates, other backends may give NaN).
    quantized = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    quantized = quantized.view(*batch, num_row_blocks * block_rows, num_col_blocks * block_cols)
    return (quantized[..., :rows, :cols].contiguous(),
            scale.view(*batch, num_row_blocks, num_col_blocks).contiguous())


def dequantize_blockwise(quantized: torch.Tensor, scale_inv: torch.Tensor,
                         block_size: tuple[int, int] = BLOCK_SIZE) -> torch.Tensor:
    """float32 [..., M, N]: each element times its block's scale_inv (the inverse of
    quantize_blockwise, up to its rounding)."""
    rows, cols = quantized.shape[-2:]
    expanded = scale_inv.repeat_interleave(block_size[0], dim=-2).repeat_interleave(
        block_size[1], dim=-1)[..., :rows, :cols]
    return quantized.float() * expanded


def quantize_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8, scale float32 0-dim) with weight ~= fp8 * scale: the arithmetic of SGLang's own
    online quantisation (fp8_utils.input_to_float8), so a pre-quantised tensor equals what the
    engine would make of the BF16 one."""
    amax = weight.abs().amax().float()
    _check_finite(amax, weight)
    inverse = FP8_MAX / amax.clamp(min=TENSOR_AMAX_FLOOR)
    quantized = (weight.float() * inverse).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.contiguous(), inverse.reciprocal()


def ceil_to_power_of_two(scale: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(scale)) of positive float32 values, exactly (frexp: scale = m * 2^e with
    m in [0.5, 1); m == 0.5 is already a power of two)."""
    mantissa, exponent = torch.frexp(scale)
    return torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).to(exponent.dtype))


def quantize_named(name: str, tensor: torch.Tensor,
                   layout: Fp8Layout) -> dict[str, torch.Tensor]:
    """{`name`: the fp8 weight, its scale's name: the scale} for one HF tensor SGLang holds in
    FP8 (`fp8_quantized` says which). 2-D weights and per-expert stacks [E, N, K] (block
    layout: scale [E, ceil(N/bn), ceil(K/bk)]) in the Linear orientation [out, in]."""
    scale_name = layout.scale_name(name)
    if layout.weight_block_size is None:
        quantized, scale = quantize_per_tensor(tensor)
    else:
        quantized, scale = quantize_blockwise(tensor, layout.weight_block_size,
                                              ue8m0=layout.ue8m0)
    return {name: quantized, scale_name: scale}


def unfuse_llama4_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Llama-4's fused HF expert tensor as per-expert tensors in the Linear orientation, the form
    whose FP8 scales SGLang's Llama-4 loader takes: `...experts.gate_up_proj` [E, H, 2I] ->
    `...experts.{e}.gate_proj.weight` and `.up_proj.weight` [I, H] (the first and second half of
    the last dim, as mllama4.py _handle_expert_weight_params chunks it); `...experts.down_proj`
    [E, I, H] -> `...experts.{e}.down_proj.weight` [H, I]. Those names go through SGLang's
    per-expert mapping (FusedMoE.make_expert_params_mapping) with their `.weight_scale_inv`;
    the fused names cannot carry per-expert block scales (_handle_expert_scale_params writes one
    scale into every expert)."""
    base, _, leaf = name.rpartition(".")
    if not base.endswith(".experts") or leaf not in LLAMA4_FUSED_EXPERT_TENSORS \
            or tensor.dim() != 3:
        raise ValueError(f"{name!r} {tuple(tensor.shape)} is not a Llama-4 fused expert tensor "
                         "(`...experts.gate_up_proj` [E, H, 2I] or `...experts.down_proj` "
                         "[E, I, H])")
    return dict(iter_unfused_llama4_experts(name, tensor))


def iter_unfused_llama4_experts(name: str, tensor: torch.Tensor):
    """`unfuse_llama4_experts` one (name, tensor) at a time: each per-expert copy is made when
    it is asked for, so the sync holds one at a time besides the fused tensor."""
    base, _, leaf = name.rpartition(".")
    if leaf == "down_proj":
        for e, expert in enumerate(tensor):
            yield f"{base}.{e}.down_proj.weight", expert.T.contiguous()
        return
    for e, expert in enumerate(tensor):
        for proj, half in zip(("gate_proj", "up_proj"), expert.chunk(2, dim=-1)):
            yield f"{base}.{e}.{proj}.weight", half.T.contiguous()


def check_llama4_block_rows(layout: Fp8Layout, head_dim: int) -> None:
    """SGLang's Llama-4 loader reorders the rows of q_proj / k_proj within each head after the
    FP8 bytes arrive (mllama4.py permute_qk_weight_for_rotary: interleaved -> half-split rotary
    pairs) and leaves their scales as they are: a row moved into another block would be scaled
    by that block's scale. Rows stay in their block only when each block holds whole heads."""
    if layout.weight_block_size is not None and layout.weight_block_size[0] % head_dim:
        raise ValueError(f"weight_block_size rows {layout.weight_block_size[0]} must be a "
                         f"multiple of head_dim {head_dim} for Llama-4: SGLang reorders q/k rows "
                         "within each head after loading without moving their block scales; "
                         "use blocks of whole heads (Scout: head_dim 128, blocks [128, 128]) or "
                         "per-tensor scales")


# Which HF modules SGLang builds as a quantisable layer (a LinearBase given the model's
# quant_config, or a FusedMoE): Fp8Config.get_quant_method returns an FP8 method for those two
# classes only (VocabParallelEmbedding / ParallelLMHead, norms and RadixAttention's weights stay
# high precision). The leaf module names are those of SGLang 0.5.23's model files:
# models/llama.py + llama4.py (qkv_proj <- q/k/v_proj, o_proj: QKVParallelLinear /
# RowParallelLinear; gate_up_proj <- gate/up_proj, down_proj: MergedColumnParallelLinear /
# RowParallelLinear, dense MLP and shared expert; `experts`: FusedMoE) and models/qwen3_moe.py
# (the same attention; `experts.{e}.{gate,up,down}_proj`: FusedMoE). The routers are LinearBase
# built with quant_config=None (llama4.py Llama4MoE.router, qwen3_moe.py Qwen3MoeSparseMoeBlock
# .gate: "the online Fp8/mxfp8 path keeps the gate in bf16"), so they are not listed.
# tests/integration/test_fp8_sglang.py checks this against the parameters SGLang's models create.
QUANTISED_LEAF_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                    "up_proj", "down_proj", "gate_up_proj"})
LLAMA4_FUSED_EXPERT_TENSORS = frozenset({"gate_up_proj", "down_proj"})


def fp8_quantized(quantization_config: Mapping, param_names: Iterable[str]) -> set[str]:
    """The HF parameter names among `param_names` that SGLang holds in FP8 when serving a model
    with this `quantization_config`: the `.weight` of every projection module (attention,
    MLP, shared and routed experts; Llama-4's fused expert tensors) that the config's
    `ignored_layers` / `modules_to_not_convert` do not exclude. Embeddings, LM head, routers and norms stay in
    high precision."""
    Fp8Layout.from_quantization_config(quantization_config)  # refuses other quant methods
    ignored = _normalised_ignored(quantization_config)
    quantised = set()
    for name in param_names:
        module, _, leaf = name.rpartition(".")
        projection = leaf == "weight" and module.rpartition(".")[2] in QUANTISED_LEAF_MODULES
        # Llama-4's HF checkpoint stores each MoE layer's experts fused, without `.weight`
        # (`feed_forward.experts.gate_up_proj` [E, H, 2I], `.down_proj` [E, I, H]); SGLang loads
        # them into the FusedMoE `experts` module (mllama4.py _handle_expert_weight_params).
        fused_experts = module.endswith(".experts") and leaf in LLAMA4_FUSED_EXPERT_TENSORS
        if (projection or fused_experts) and not _skipped(_sglang_prefix(module), ignored):
            quantised.add(name)
    return quantised


# The run's FP8 copy of its checkpoint, which the generators serve: output_dir/SERVED_FP8_DIR
# (written by cluster/served_checkpoint.py; the disk transport takes its config.json).
SERVED_FP8_DIR = "served_fp8"


def served_quantization_config(rollout) -> dict | None:
    """The `quantization_config` of the config.json FP8-serving generators load, from a run's
    rollout settings (megatron_rl.config RolloutConfig, or anything with its `precision`,
    `fp8_block_size` and `fp8_scale_fmt`); None for bf16 (no quantisation). The keys are the ones
    SGLang's Fp8Config.from_config reads (quant_method, activation_scheme, weight_block_size,
    scale_fmt; `fmt` is the HF checkpoints' record of e4m3). One builder for the served
    checkpoint and the sync, so the two cannot disagree on the layout."""
    if rollout.precision == "bf16":
        return None
    if rollout.precision != "fp8":
        raise ValueError(f"rollout.precision {rollout.precision!r}: choose bf16 or fp8")
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if rollout.fp8_block_size is not None:
        config["weight_block_size"] = [rollout.fp8_block_size, rollout.fp8_block_size]
    if rollout.fp8_scale_fmt == "ue8m0":
        if rollout.fp8_block_size is None:
            raise ValueError("rollout.fp8_scale_fmt: ue8m0 (power-of-two) scales are block "
                             "scales; set rollout.fp8_block_size (e.g. 128) or "
                             "rollout.fp8_scale_fmt=float32 for per-tensor scales")
        config["scale_fmt"] = "ue8m0"
    return config


class SyncQuantiser:
    """The weight sync's FP8 step for one served model, applied after the gather and the HF
    conversion to each HF tensor `to_hf` produces: a tensor SGLang holds in FP8
    (`fp8_quantized` over the names the sync sends) is replaced by its fp8 weight and scale
    (Llama-4's fused experts unfused per expert first); None for everything else, which is sent
    as it is. `planned` gives the same names, dtypes and shapes on meta tensors, which the
    bucket plan is made of; `quantize` the tensors. `head_dim` (the trainer's kv_channels) is
    checked against the block rows when the model is Llama-4 (its fused expert tensors exist in
    no other family's HF layout)."""

    def __init__(self, quantization_config: Mapping, hf_names: Iterable[str], *,
                 head_dim: int | None = None):
        hf_names = list(hf_names)
        self.layout = Fp8Layout.from_quantization_config(quantization_config)
        self.quantised = frozenset(fp8_quantized(quantization_config, hf_names))
        if head_dim is not None and any(is_llama4_fused_experts(n) for n in hf_names):
            check_llama4_block_rows(self.layout, head_dim)

    def planned(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """What `quantize(name, tensor)` returns, as meta tensors (name -> dtype, shape)."""
        if name not in self.quantised:
            return None
        pieces = unfuse_llama4_experts(name, tensor) if is_llama4_fused_experts(name) \
            else {name: tensor}
        out = {}
        for piece_name, piece in pieces.items():
            *batch, rows, cols = piece.shape
            if self.layout.weight_block_size is None:
                scale_shape = ()
            else:
                block_rows, block_cols = self.layout.weight_block_size
                scale_shape = (*batch, -(-rows // block_rows), -(-cols // block_cols))
            out[piece_name] = torch.empty(piece.shape, dtype=FP8_DTYPE, device="meta")
            out[self.layout.scale_name(piece_name)] = torch.empty(
                scale_shape, dtype=torch.float32, device="meta")
        return out

    def quantize(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """{HF name: fp8 weight or its scale} sent in place of `name`; None: send it as it is."""
        if name not in self.quantised:
            return None
        return dict(self.iter_quantized(name, tensor))

    def iter_quantized(self, name: str, tensor: torch.Tensor):
        """`quantize(name, tensor)` one (HF name, tensor) at a time, each piece quantised when
        asked for: the sync copies each into its bucket slot before the next is made (Scout's
        fused expert stack is 2.7 GB in bf16; its quantised pieces together would be half that
        again)."""
        unfused = iter_unfused_llama4_experts(name, tensor) \
            if is_llama4_fused_experts(name) else [(name, tensor)]
        for piece_name, piece in unfused:
            yield from quantize_named(piece_name, piece, self.layout).items()


def is_llama4_fused_experts(name: str) -> bool:
    """Llama-4's fused HF expert tensors (`...experts.gate_up_proj` / `.down_proj`), which are
    quantised per expert (`unfuse_llama4_experts`)."""
    base, _, leaf = name.rpartition(".")
    return base.endswith(".experts") and leaf in LLAMA4_FUSED_EXPERT_TENSORS


def _sglang_prefix(module: str) -> str:
    """The prefix SGLang asks is_layer_skipped about for an HF module: an expert's is its
    FusedMoE's (`...mlp.experts`: all experts of a layer are one module, skipped or not as a
    whole); q/k/v_proj and gate/up_proj are asked shard by shard, as here."""
    head, found, _ = module.partition(".experts.")
    return head + ".experts" if found else module


def _normalised_ignored(quantization_config: Mapping) -> list[str]:
    # Fp8Config.from_config: ignored_layers or else modules_to_not_convert, each with and without
    # the "model." prefix.
    ignored = (quantization_config.get("ignored_layers")
               or quantization_config.get("modules_to_not_convert") or [])
    out = []
    for layer in ignored:
        base = layer.removeprefix("model.")
        out += [base, f"model.{base}"]
    return out


def _skipped(module: str, ignored: list[str]) -> bool:
    """SGLang's is_layer_skipped (srt/layers/quantization/utils.py) for an unfused module
    prefix: a match on dotted-path boundaries (`_module_path_match`), and for experts also an
    ignored entry naming experts that contains the prefix. A fused SGLang module (qkv_proj,
    gate_up_proj) is skipped iff all its shards are (it refuses mixed ones), so deciding per HF
    shard agrees with it."""
    if any(_module_path_match(entry, module) for entry in ignored):
        return True
    return "experts" in module and any(module in entry for entry in ignored
                                       if "experts" in entry)


def _module_path_match(ignored: str, prefix: str) -> bool:
    ignored, prefix = ignored.rstrip("."), prefix.rstrip(".")
    return (ignored == prefix or prefix.startswith(ignored + ".")
            or f".{ignored}." in f".{prefix}.")


def _check_finite(amax: torch.Tensor, weight: torch.Tensor) -> None:
    if not bool(torch.isfinite(amax).all()):
        raise ValueError(f"cannot quantise a tensor of shape {tuple(weight.shape)} holding NaN "
                         "or inf: the trainer's weights are not finite (check the loss and the "
                         "learning rate)")
