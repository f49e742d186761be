"""A tiny GPT-MoE "model family" with the models-registry interface, for trainer tests that must
not depend on a real family's details (the real families are exercised too, see the workers)."""
from __future__ import annotations


class TinyMoEFamily:
    name = "tiny_moe_test"
    sizes = ("tiny",)
    vocab_size = 96

    def transformer_config(self, size, *, use_transformer_engine=False, **overrides):
        from megatron.core.transformer import TransformerConfig

        fields = dict(
            num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
            num_query_groups=2, normalization="RMSNorm", add_bias_linear=False,
            gated_linear_unit=True, num_moe_experts=4, moe_router_topk=1,
            moe_router_pre_softmax=True, moe_ffn_hidden_size=32,
            moe_shared_expert_intermediate_size=32, moe_token_dispatcher_type="alltoall",
            moe_aux_loss_coeff=0.0, moe_grouped_gemm=False, use_cpu_initialization=True)
        fields.update(overrides)
        return TransformerConfig(**fields)

    def build_model(self, config, *, pre_process, post_process, use_transformer_engine=False,
                    vp_stage=None):
        import torch.nn.functional as F
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        config.activation_func = F.silu
        spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts,
                                        moe_grouped_gemm=False, normalization="RMSNorm")
        return GPTModel(config, spec, vocab_size=self.vocab_size, max_sequence_length=64,
                        pre_process=pre_process, post_process=post_process,
                        position_embedding_type="rope", share_embeddings_and_output_weights=False)
