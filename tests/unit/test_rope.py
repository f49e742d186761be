"""The CPU trainer's RoPE (megatron_rl/ops/rope.py, bound by CPU shim 14 into megatron's attention)
against the function it replaces, megatron-core's unfused `_apply_rotary_pos_emb_bshd`: forward
bit-identical, gradient of the input equal (fp32 to 1e-6, bf16 to bf16 rounding) with halves and
interleaved pairs, partial rotary, mscale and non-contiguous [s, b, h, d] inputs; the attention
calls it (one autograd node per query and key in a tiny Llama-4 attention, the same output and
gradients as with megatron's function) and leaves what it does not cover to megatron's own."""
import pytest
import torch

pytestmark = pytest.mark.unit

SEQ, BATCH, HEADS, HEAD_DIM = 13, 2, 3, 16


@pytest.fixture(autouse=True, scope="module")
def cpu_shims():
    from megatron_rl.platform import activate_cpu_compat

    activate_cpu_compat()  # before the first import of megatron.core


def _freqs(rotary_percent: float, interleaved: bool) -> torch.Tensor:
    """Megatron's own frequencies, [SEQ, 1, 1, rot_dim] fp32 (llama3 scaling for varied angles)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    rope = RotaryEmbedding(kv_channels=HEAD_DIM, rotary_percent=rotary_percent,
                           rotary_interleaved=interleaved, rotary_base=500000, rope_scaling=True,
                           use_cpu_initialization=True)
    return rope(SEQ)


def _config_for_rope(**changes):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                  use_cpu_initialization=True)
    return TransformerConfig(**{**fields, **changes})


def _input(dtype: torch.dtype, contiguous: bool, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if contiguous:
        return torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen).to(dtype)
    # As the attention's query is: a view into the fused QKV projection's output.
    mixed = torch.randn(SEQ, BATCH, HEADS, 3 * HEAD_DIM, generator=gen).to(dtype)
    return mixed[..., HEAD_DIM:2 * HEAD_DIM]


def _forward_backward(fn, t, grad_out):
    leaf = t.detach().clone().requires_grad_()
    out = fn(leaf)
    out.backward(grad_out)
    return out.detach(), leaf.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("rotary_percent,mscale,contiguous", [
    (1.0, 1.0, True), (0.5, 1.0, True), (1.0, 1.3, False), (0.5, 0.8, False)],
    ids=["full", "partial", "mscale-strided", "partial-mscale-strided"])
def test_same_as_megatrons_unfused_rope(dtype, interleaved, rotary_percent, mscale, contiguous):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from megatron_rl.ops.rope import apply_rotary

    freqs = _freqs(rotary_percent, interleaved)
    assert freqs.shape == (SEQ, 1, 1, int(HEAD_DIM * rotary_percent))
    t = _input(dtype, contiguous)
    grad_out = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM,
                           generator=torch.Generator().manual_seed(1)).to(dtype)
    expected, expected_grad = _forward_backward(
        lambda x: _apply_rotary_pos_emb_bshd(x, freqs, rotary_interleaved=interleaved,
                                             mscale=mscale), t, grad_out)
    got, grad = _forward_backward(
        lambda x: apply_rotary(x, freqs, interleaved=interleaved, mscale=mscale), t, grad_out)
    assert got.dtype == expected.dtype == dtype
    assert torch.equal(got, expected)  # the same ops in the same order
    tolerance = dict(atol=1e-6, rtol=0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(grad, expected_grad, **tolerance)
    # Not vacuous: the rotation moved the rotated channels, and the rest passed through.
    rot_dim = freqs.shape[-1]
    assert (got[..., :rot_dim] - t[..., :rot_dim]).abs().max() > 0.1
    assert torch.equal(got[..., rot_dim:], t[..., rot_dim:])
    assert torch.equal(grad[..., rot_dim:], grad_out[..., rot_dim:])


@pytest.mark.parametrize("interleaved", [False, True], ids=["halves", "interleaved"])
def test_the_transposed_rotation_is_the_negated_rotation(interleaved):
    # R^T = -R, which the closed-form backward relies on: as matrices over one head's channels.
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    from megatron_rl.ops.rope import _rotate_transposed

    eye = torch.eye(HEAD_DIM).reshape(HEAD_DIM, 1, 1, HEAD_DIM)  # row i: basis vector e_i
    rotation = _rotate_half(eye, interleaved).reshape(HEAD_DIM, HEAD_DIM)  # row i: R e_i
    transposed = _rotate_transposed(eye, interleaved).reshape(HEAD_DIM, HEAD_DIM)
    assert torch.equal(transposed, rotation.T)  # row i: R^T e_i
    assert torch.equal(rotation.T, -rotation)


def test_frequencies_that_need_a_gradient_are_refused():
    from megatron_rl.ops.rope import apply_rotary

    freqs = _freqs(1.0, False).requires_grad_()
    with pytest.raises(ValueError, match="freqs requires grad"):
        apply_rotary(_input(torch.float32, True), freqs, interleaved=False)


def _graph_nodes(output: torch.Tensor) -> list[str]:
    seen, stack, names = set(), [output.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.append(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def test_the_attention_calls_the_one_node_rope(megatron_process_group, monkeypatch):
    import models
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer import attention

    assert attention.apply_rotary_pos_emb is not rope_utils.apply_rotary_pos_emb  # shim 14
    family = models.get_model_family("llama4")
    config = family.transformer_config("tiny_maverick")
    assert config.rotary_interleaved and config.is_rope_layer(1)
    torch.manual_seed(0)
    model = family.build_model(config, pre_process=True, post_process=True)
    layer = model.decoder.layers[0].self_attention  # a RoPE (chunked) layer
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(20, 2, config.hidden_size, generator=gen)
    grad_out = torch.randn(20, 2, config.hidden_size, generator=gen)

    def run():
        leaf = hidden.clone().requires_grad_()
        out, _ = layer(leaf, attention_mask=None, rotary_pos_emb=model.rotary_pos_emb(20))
        nodes = _graph_nodes(out)
        out.backward(grad_out)
        return out.detach(), leaf.grad, nodes

    got, grad, nodes = run()
    with monkeypatch.context() as patch:
        patch.setattr(attention, "apply_rotary_pos_emb", rope_utils.apply_rotary_pos_emb)
        expected, expected_grad, reference_nodes = run()
    assert nodes.count("_RotaryBackward") == 2  # the query and the key
    assert "_RotaryBackward" not in reference_nodes
    # megatron's composite: 11 nodes per call here (slices, neg, stack, view, mul, add, cat)
    assert len(reference_nodes) - len(nodes) >= 2 * 8, (len(reference_nodes), len(nodes))
    assert torch.equal(got, expected)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", ["cu_seqlens", "mla_interleaved", "mrope", "freqs_grad",
                                  "not_4d"])
def test_what_it_does_not_cover_is_megatrons_own(megatron_process_group, case, monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.parallel_state import get_context_parallel_group
    from megatron.core.transformer import attention

    from megatron_rl.ops import rope

    calls = []
    one_node = rope._Rotary.apply
    monkeypatch.setattr(rope._Rotary, "apply", lambda *args: calls.append(1) or one_node(*args))
    config = _config_for_rope()
    t, freqs, kwargs = _input(torch.float32, True), _freqs(1.0, False), {}
    attention.apply_rotary_pos_emb(t, freqs, config=config, cp_group=get_context_parallel_group())
    assert len(calls) == 1  # the covered case
    if case == "cu_seqlens":  # packed [tokens, h, d]
        t = t[:, 0]
        kwargs["cu_seqlens"] = torch.tensor([0, 5, SEQ], dtype=torch.int32)
    elif case == "mla_interleaved":
        kwargs["mla_rotary_interleaved"] = True
    elif case == "mrope":
        config = _config_for_rope(mrope_section=[2, 3, 3])
    elif case == "freqs_grad":
        freqs = freqs.clone().requires_grad_()
    else:
        t = t[None]
    kwargs.update(config=config, cp_group=get_context_parallel_group())
    got = attention.apply_rotary_pos_emb(t, freqs, **kwargs)
    assert len(calls) == 1
    assert torch.equal(got, rope_utils.apply_rotary_pos_emb(t, freqs, **kwargs))
