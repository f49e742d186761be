"""The supervised cold start (`megatron-rl sft`): its token cross-entropy against torch's, the
trainer's SFT loss against transformers' logits on the same weights (response tokens only), loss
falling over a few steps, and the data path (batches, masks, order, refused inputs)."""
import json

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.algorithms import aggregate_loss, cross_entropy_loss
from megatron_rl.data.sft_examples import SFTExample, load_sft_examples, save_sft_examples
from megatron_rl.sft import (SFTSettings, batch_indices, load_examples, main, sft_batch,
                             tokenize_examples)

pytestmark = pytest.mark.unit


def test_cross_entropy_loss_equals_torch_cross_entropy_on_response_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 11, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, 11, (9,), generator=gen)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0], dtype=torch.bool)  # two "responses"
    logits.requires_grad_(True)
    logp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    out = cross_entropy_loss(logp, loss_mask=mask)
    reference = F.cross_entropy(logits, targets, reduction="none")
    torch.testing.assert_close(out.token_loss, torch.where(mask, reference, 0.0))
    assert out.ratio.tolist() == [1.0] * 9 and not out.clipped.any()
    assert out.abs_logp_diff.abs().sum() == 0
    # Token aggregation = torch's mean cross-entropy over the masked tokens, value and gradient.
    loss = aggregate_loss(out.token_loss, "token", mask, None, None)
    expected = F.cross_entropy(logits[mask], targets[mask])
    torch.testing.assert_close(loss, expected)
    (grad,) = torch.autograd.grad(loss, logits)
    (expected_grad,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(grad, expected_grad)
    assert grad[~mask].abs().sum() == 0  # prompt positions get no gradient
    # By hand on one token: -log softmax([0, ln 3])[1] = -log(3 / 4).
    hand = torch.log_softmax(torch.tensor([[0.0, torch.log(torch.tensor(3.0))]]), -1)[:, 1]
    torch.testing.assert_close(cross_entropy_loss(hand).token_loss,
                               torch.tensor([-torch.log(torch.tensor(0.75))]))
    with pytest.raises(ValueError, match="1-D floating-point"):
        cross_entropy_loss(torch.zeros(2, 3))


class _CharTokenizer:
    """Characters as ids 4.., BOS 1 prepended like a prompt encode, EOS 2."""

    eos_token_id = 2
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [4 + ord(c) % 50 for c in text]


def test_tokenized_batch_masks_exactly_the_response_and_its_eos():
    examples = [SFTExample(prompt="ab", response="xyz"), SFTExample(prompt="abcd", response="q")]
    encoded = tokenize_examples(_CharTokenizer(), examples, max_tokens=16)
    assert encoded[0] == ([1, 4 + ord("a") % 50, 4 + ord("b") % 50],
                          [4 + ord(c) % 50 for c in "xyz"] + [2], [1, 1, 1, 1])
    batch = sft_batch(encoded, [1, 0])
    assert [t.tolist() for t in batch.loss_mask] == [[0, 0, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1, 1]]
    assert batch.sample_num_loss_tokens() == [2, 4]  # response + EOS
    assert batch.prompt_ids.tolist() == [0, 1]
    with pytest.raises(ValueError, match="example 0 has 7 tokens, more than 6"):
        tokenize_examples(_CharTokenizer(), examples, max_tokens=6)


def test_observation_pieces_are_in_the_sequence_without_loss(tmp_path):
    """A multi-turn response: {"observation": ...} pieces are tokenized on their own and masked
    0 (as the rollout's observations), the model's text and EOS 1; the file round-trips."""
    data = tmp_path / "turns.jsonl"
    data.write_text(json.dumps({"prompt": "ab", "response": ["xy", {"observation": "OUT"},
                                                             "z"]}) + "\n"
                    + json.dumps({"prompt": "p", "response": "plain"}) + "\n")
    tool, plain = load_sft_examples(data)
    assert tool.response == "xyOUTz" and tool.observations == ((2, 5),)
    assert tool.pieces() == [("xy", False), ("OUT", True), ("z", False)]
    assert plain.observations == () and plain.to_json() == {"prompt": "p", "response": "plain"}
    save_sft_examples([tool, plain], tmp_path / "again.jsonl")
    assert load_sft_examples(tmp_path / "again.jsonl") == [tool, plain]
    assert (tmp_path / "again.jsonl").read_text() == data.read_text()

    def ids(text):
        return [4 + ord(c) % 50 for c in text]

    encoded = tokenize_examples(_CharTokenizer(), [tool, plain], max_tokens=16)
    assert encoded[0] == ([1, *ids("ab")], [*ids("xyOUTz"), 2], [1, 1, 0, 0, 0, 1, 1])
    assert encoded[1][2] == [1] * 6  # no observation: all of the response and EOS
    batch = sft_batch(encoded, [0])
    assert batch.loss_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert batch.sample_num_loss_tokens() == [4]
    # Refused, each saying what a piece may be.
    for response, message in (
            (["x", {"obs": "y"}], r"turns.jsonl:1: response piece 1 is \{\"obs\": \"y\"\}; a "
                                  r"piece is a string"),
            ([{"observation": "y"}], "the response is all observation"),
            ([], r"missing or empty field\(s\) \['response'\]")):
        data.write_text(json.dumps({"prompt": "p", "response": response}) + "\n")
        with pytest.raises(ValueError, match=message):
            load_sft_examples(data)
    with pytest.raises(ValueError, match="ordered, non-overlapping spans"):
        SFTExample(prompt="p", response="abc", observations=((1, 2), (1, 3)))


def test_batch_order_is_epochs_of_seeded_permutations():
    batches = list(batch_indices(10, batch_size=4, num_steps=5, seed=7))
    flat = [i for b in batches for i in b]
    assert all(len(b) == 4 for b in batches)
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert batches == list(batch_indices(10, batch_size=4, num_steps=5, seed=7))
    assert batches != list(batch_indices(10, batch_size=4, num_steps=5, seed=8))


def test_bad_inputs_are_refused_with_the_fix(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"give a \.jsonl"):
        SFTSettings(hf_checkpoint="x", data="data.csv", output_dir="o")
    with pytest.raises(ValueError, match="--rg-config applies to rg/<dataset> data only"):
        SFTSettings(hf_checkpoint="x", data="d.jsonl", output_dir="o", rg_config={"a": 1})
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "p"}) + "\n")
    with pytest.raises(ValueError, match=r"sft.jsonl:1: missing or empty field\(s\) "
                                         r"\['response'\]"):
        load_sft_examples(data)
    save_sft_examples([SFTExample(prompt="held out?", response="r"),
                       SFTExample(prompt="fine", response="r")], data)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "a", "task": "rg/chain_sum", "prompt": "held out?"})
                       + "\n")
    settings = SFTSettings(hf_checkpoint="x", data=str(data), output_dir="o",
                           exclude_prompts=str(prompts))
    with pytest.raises(ValueError, match="1 example.*have a prompt of --exclude-prompts"):
        load_examples(settings)
    assert main([str(tmp_path / "missing"), str(data), str(tmp_path / "out")]) == 2
    assert "no config.json there" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the trainer

VOCAB = 256


@pytest.fixture(scope="module")
def demo_model_and_trainer(tmp_path_factory):
    """A random Llama-4 "demo"-size model in transformers (the independent reference) and the
    project's trainer loaded with the same weights through the converter. initializer_range 0.2:
    peaked next-token distributions, so per-token losses differ widely and a wrong mask shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.convert import convert_hf_to_megatron
    from megatron_rl.platform import destroy_distributed
    from megatron_rl.sft import trainer_settings
    from megatron_rl.trainer import RLTrainer
    from models import get_model_family, model_family_for_hf_config

    directory = tmp_path_factory.mktemp("demo_model")
    config_dict = dict(get_model_family("llama4").hf_config("demo"), initializer_range=0.2)
    model_type = config_dict.pop("model_type")
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config_dict),
                                                dtype=torch.float32).eval()
    hf_model.save_pretrained(directory / "hf")
    convert_hf_to_megatron(directory / "hf", directory / "megatron", progress=False)
    family = model_family_for_hf_config(json.loads((directory / "hf/config.json").read_text()))
    settings = SFTSettings(hf_checkpoint=str(directory / "hf"), data="rg/chain_sum",
                           output_dir=str(directory / "out"), lr=2e-3, lr_warmup_steps=0,
                           lr_schedule="constant", clip_grad=1.0)
    trainer = RLTrainer(trainer_settings(settings, family_name="llama4", num_steps=100),
                        family=family)
    trainer.load_model_weights(str(directory / "megatron"))
    yield hf_model, trainer
    destroy_distributed()


def _encoded_batch():
    """Three examples longer than the demo size's 48-token attention chunk; the second has an
    observation (response tokens 6-14, loss mask 0) between two pieces of the model's text."""
    gen = torch.Generator().manual_seed(1)
    lengths = [(40, 12), (28, 25), (38, 14)]  # (prompt, response incl. EOS)
    masks = [[1] * 12, [1] * 6 + [0] * 9 + [1] * 10, [1] * 14]
    return [(torch.randint(4, VOCAB, (p,), generator=gen).tolist(),
             torch.randint(4, VOCAB, (r,), generator=gen).tolist(), mask)
            for (p, r), mask in zip(lengths, masks)]


def test_trainer_sft_loss_equals_transformers_cross_entropy_then_falls(demo_model_and_trainer):
    hf_model, trainer = demo_model_and_trainer
    encoded = _encoded_batch()
    losses, masks = [], []
    observed = []
    for prompt, response, response_mask in encoded:
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logits = hf_model(ids).logits[0, :-1].double()
        losses.append(F.cross_entropy(logits, ids[0, 1:], reduction="none"))
        # Position i predicts token i + 1: a response token that is not an observation's.
        targets = torch.tensor([0] * len(prompt) + response_mask)[1:]
        masks.append(targets == 1)
        observed.append(torch.tensor([0] * len(prompt) + [1 - m for m in response_mask])[1:] == 1)
    per_token, mask = torch.cat(losses), torch.cat(masks)
    expected = per_token[mask].mean().item()  # token aggregation: mean over response tokens
    # Not vacuous: averaging over every position (prompt included), or over the response with
    # its observation, gives a number farther from the expected one than 10x the tolerance of
    # the comparison below.
    assert abs(per_token.mean().item() - expected) > 1e-4 * expected
    with_observation = per_token[mask | torch.cat(observed)].mean().item()
    assert abs(with_observation - expected) > 1e-4 * expected

    batch = sft_batch(encoded, range(len(encoded)))
    first = trainer.train_step(batch)
    assert first.num_loss_tokens == int(mask.sum()) == sum(sum(m) for _, _, m in encoded)
    assert first.loss == pytest.approx(expected, rel=1e-5)
    assert first.mean_ratio == pytest.approx(1.0) and first.clip_fraction == 0.0
    steps = [trainer.train_step(batch) for _ in range(12)]
    assert not any(s.skipped for s in steps)
    assert steps[-1].loss < 0.5 * first.loss, [round(s.loss, 3) for s in steps]
