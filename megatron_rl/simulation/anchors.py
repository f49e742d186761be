"""The model shapes of the published async-vs-sync figures the simulator is checked against
(../shared/ANCHOR_FIGURES.md section 0; benchmarks/simulated_anchors.py runs the cases;
docs/simulation.md, "Against published figures"): Qwen2.5-Math-7B, Qwen3-30B-A3B,
Qwen3-235B-A22B and DeepSeek-V3, as CostConfigs.

The total and active parameter counts are computed here from the architecture (embeddings,
attention, SwiGLU FFNs, routed and shared experts, routers, norms) rather than copied from the
model names, so that a wrong shape shows up as a wrong count (tests/unit/
test_simulation_anchors.py compares them with the published totals).

CostConfig sizes the KV cache as K and V of `num_kv_heads x head_dim` per layer. DeepSeek-V3's
MLA caches one latent per token and layer instead: kv_lora_rank 512 + the decoupled RoPE key 64 =
576 elements. It is given as num_kv_heads 1 x head_dim 288, so that 2 x 288 = 576: the bytes per
token are exact; nothing else in the cost model reads the head shape.
"""
from __future__ import annotations

import dataclasses

from megatron_rl.scaling.cost import CostConfig


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """A transformer's shape, enough to count its parameters and size its KV cache. MoE:
    `num_experts` routed experts of `expert_ffn` each, top `experts_per_token`, plus
    `shared_experts` always-active ones, in every layer but the first `dense_layers` (which have
    a dense FFN of `ffn`)."""

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int  # dense FFN width (the dense layers of an MoE)
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2.5
    qk_norm: bool = False  # Qwen3: RMSNorm of q and k per head
    num_experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0  # leading layers with a dense FFN (DeepSeek-V3: 3)
    # MLA (DeepSeek-V3): low-rank q and kv projections; 0 = standard (GQA) attention.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    # What to cite for the figures: where the shape and the published totals come from.
    source: str = ""
    published_total: float = 0.0
    published_active: float = 0.0

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def attention_params(self) -> int:
        h = self.hidden
        if self.kv_lora_rank:  # MLA
            qk_head = self.qk_nope_dim + self.qk_rope_dim
            return (h * self.q_lora_rank + self.q_lora_rank  # q down + its norm
                    + self.q_lora_rank * self.num_heads * qk_head  # q up
                    + h * (self.kv_lora_rank + self.qk_rope_dim) + self.kv_lora_rank  # kv down
                    + self.kv_lora_rank * self.num_heads * (self.qk_nope_dim + self.v_head_dim)
                    + self.num_heads * self.v_head_dim * h)  # output
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        params = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            params += q + 2 * kv
        if self.qk_norm:
            params += 2 * self.head_dim
        return params

    def _ffn(self, width: int) -> int:
        return 3 * self.hidden * width  # SwiGLU: gate, up, down

    def _layer_params(self, layer: int, *, active: bool) -> int:
        params = self.attention_params() + 2 * self.hidden  # + the two norms
        if not self.moe or layer < self.dense_layers:
            return params + self._ffn(self.ffn)
        routed = self.experts_per_token if active else self.num_experts
        return (params + self.hidden * self.num_experts  # router
                + (routed + self.shared_experts) * self._ffn(self.expert_ffn))

    def _embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    @property
    def total_params(self) -> int:
        return self._embedding_params() + sum(self._layer_params(i, active=False)
                                              for i in range(self.num_layers))

    @property
    def active_params(self) -> int:
        """Parameters a token uses (all of a dense model's)."""
        return self._embedding_params() + sum(self._layer_params(i, active=True)
                                              for i in range(self.num_layers))

    @property
    def kv_elements_per_token_layer(self) -> int:
        """KV-cache elements one token keeps per layer: K and V of every KV head, or MLA's
        latent plus its RoPE key."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.qk_rope_dim
        return 2 * self.num_kv_heads * self.head_dim

    def cost_config(self, **workload) -> CostConfig:
        """The CostConfig of this shape; `workload` sets the rest (batch, lengths, hardware,
        the efficiency knobs)."""
        if self.kv_lora_rank:  # the latent as one "head" of half its width, K and V
            kv_heads, head_dim = 1, self.kv_elements_per_token_layer // 2
        else:
            kv_heads, head_dim = self.num_kv_heads, self.head_dim
        moe = dict(active_params=float(self.active_params), num_experts=self.num_experts,
                   experts_per_token=self.experts_per_token) if self.moe else {}
        return CostConfig(total_params=float(self.total_params), num_layers=self.num_layers,
                          num_kv_heads=kv_heads, head_dim=head_dim, **moe, **workload)


_QWEN = "Megatron-Bridge qwen_provider.py @07d0d14 (ANCHOR_FIGURES.md section 0); vocab and " \
        "head_dim from the models' HF config.json"

SHAPES: dict[str, ModelShape] = {s.name: s for s in (
    # Qwen2.5-7B architecture (Qwen2.5-Math-7B is the same), untied embeddings, qkv bias.
    ModelShape(name="qwen2.5-math-7b", num_layers=28, hidden=3584, num_heads=28, num_kv_heads=4,
               head_dim=128, ffn=18944, vocab=152064, qkv_bias=True, source=_QWEN,
               published_total=7.61e9),  # Qwen2.5-7B model card
    ModelShape(name="qwen3-30b-a3b", num_layers=48, hidden=2048, num_heads=32, num_kv_heads=4,
               head_dim=128, ffn=6144, vocab=151936, qk_norm=True, num_experts=128,
               experts_per_token=8, expert_ffn=768, source=_QWEN,
               published_total=30.5e9, published_active=3.3e9),  # Qwen3 model card
    ModelShape(name="qwen3-235b-a22b", num_layers=94, hidden=4096, num_heads=64, num_kv_heads=4,
               head_dim=128, ffn=12288, vocab=151936, qk_norm=True, num_experts=128,
               experts_per_token=8, expert_ffn=1536, source=_QWEN,
               published_total=235e9, published_active=22e9),
    # 61 layers, the first 3 dense (FFN 18432), then 256 routed experts (top-8) + 1 shared of
    # 2048; MLA with q_lora_rank 1536, kv_lora_rank 512, qk nope 128 + rope 64, v 128. The
    # multi-token-prediction module (14B of HF's 685B) is not counted: 671B / 37B published.
    ModelShape(name="deepseek-v3", num_layers=61, hidden=7168, num_heads=128, num_kv_heads=128,
               head_dim=128, ffn=18432, vocab=129280, num_experts=256, experts_per_token=8,
               expert_ffn=2048, shared_experts=1, dense_layers=3, q_lora_rank=1536,
               kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128, v_head_dim=128,
               source="Megatron-Bridge deepseek_provider.py @066adea; DeepSeek-V3 report",
               published_total=671e9, published_active=37e9),
)}
