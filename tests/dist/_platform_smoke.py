"""Subprocess body of test_platform_cpu_compat.py: the shims patch process-wide torch state, so
they are exercised in a fresh interpreter, never inside the pytest process. Prints one JSON line."""
import json
import os

import torch

from megatron_rl.platform import (activate_cpu_compat, destroy_distributed, has_cuda,
                                  has_transformer_engine, init_distributed)


def main() -> None:
    result = {"active": activate_cpu_compat(), "active_again": activate_cpu_compat(),
              "has_cuda": has_cuda(), "has_te": has_transformer_engine()}
    # Shim 2/3/5/6: CUDA requests land on the CPU; type strings pass Megatron's checks.
    result["zeros_device"] = str(torch.zeros(1, device="cuda").device)
    result["to_device"] = str(torch.ones(2).to("cuda").device)
    result["current_device_tensor"] = str(torch.empty(1, device=torch.cuda.current_device()).device)
    result["type_string"] = torch.ones(1).type()
    # Shim 15: Megatron's torch.compile'd fused functions are the plain functions (eager); the
    # probe shows the check sees a compiled one (torch.compile wraps it).
    from megatron.core.fusions.fused_bias_swiglu import swiglu

    result["torchdynamo_disable"] = os.environ.get("TORCHDYNAMO_DISABLE")
    result["megatron_swiglu_compiled"] = hasattr(swiglu, "_torchdynamo_orig_callable")
    os.environ["TORCHDYNAMO_DISABLE"] = "0"
    result["probe_compiled"] = hasattr(torch.compile(lambda x: x + 1),
                                       "_torchdynamo_orig_callable")
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch.cuda.synchronize()
    event = torch.cuda.current_stream().record_event()
    event.synchronize()

    init_distributed(seed=7)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        normalization="RMSNorm", use_cpu_initialization=True, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        num_moe_experts=4, moe_router_topk=1, moe_router_pre_softmax=True,
        moe_shared_expert_intermediate_size=32, moe_token_dispatcher_type="alltoall")
    spec = get_gpt_layer_local_spec(num_experts=4, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=64, max_sequence_length=16,
                     position_embedding_type="rope")
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).expand(2, 8)
    logits = model(tokens, positions, None)  # [batch, seq, vocab]
    megatron_loss = model(tokens, positions, None, labels=tokens)  # [batch, seq]
    torch_loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 64).float(), tokens.reshape(-1), reduction="none").reshape(2, 8)
    result["max_loss_diff_vs_torch"] = (megatron_loss - torch_loss).abs().max().item()
    megatron_loss.mean().backward()
    grads = [p.grad for p in model.parameters()]
    result["num_params"] = len(grads)
    result["num_params_without_grad"] = sum(g is None for g in grads)
    result["all_grads_finite"] = all(bool(torch.isfinite(g).all()) for g in grads if g is not None)
    result["grad_abs_sum"] = sum(g.abs().sum().item() for g in grads if g is not None)
    destroy_distributed()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
