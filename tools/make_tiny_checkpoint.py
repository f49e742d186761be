#!/usr/bin/env python
"""Write a randomly initialised Hugging Face checkpoint of a registered model family's size, with
a tokenizer trained here, for runs and tests on machines without a model hub (the tiny CPU
recipes point `model.hf_checkpoint` at its output).

Usage: python tools/make_tiny_checkpoint.py OUTPUT_DIR [--family llama] [--size tiny] [--seed 0]
                                            [--never-stops]

The tokenizer is a BPE over printable ASCII (no byte fallback: the tiny sizes' vocabularies of
256 cannot hold 256 byte symbols plus special tokens), trained on arithmetic-style text and the
ScaleRL interruption phrase so those tokenize compactly; its size never exceeds the model's
vocabulary. Rerunning with the same arguments writes the same weights.

`--never-stops` (dense Llama): a model that never ends a completion by itself, for tests of
generation to a length budget. A random model samples its end-of-sequence or end-of-thinking token
now and then (about 1 in 256 per token), and a 16k-token completion would not reach its budget.
Here one hidden feature is a constant 1 in every token's embedding that no layer writes to (its
rows of the attention and MLP output projections are zero), so after the final norm it is
positive at every position, and the output rows of `</s>` and `</think>` read only that feature,
with weight -100: their logits are below -50 everywhere (probability < e^-50). The model stays an
ordinary Llama checkpoint: SGLang and the Megatron trainer compute the same log-probs from it.
"""
import argparse
import string
import sys
from pathlib import Path

# Runnable from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3


def _training_text() -> list[str]:
    from megatron_rl.config import INTERRUPTION_PHRASE

    lines = [INTERRUPTION_PHRASE, "<think> </think> <answer> </answer>",
             "Think step by step, then give only the final answer between <answer> and "
             "</answer> tags."]
    lines += [f"Calculate {a} + {b} - {a * b} * ( {b} / {a + 1} )." for a in range(30)
              for b in range(10)]
    return lines * 4


def train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    alphabet = list(string.printable.strip()) + ["▁"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet))
    tokenizer.train_from_iterator(_training_text(), trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_tiny_checkpoint(output_dir: str, *, family: str = "llama", size: str = "tiny",
                         seed: int = 0, never_stops: bool = False) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from models import get_model_family

    config_dict = dict(get_model_family(family).hf_config(size))
    config_dict.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tokenizer = train_tokenizer(config.vocab_size)
    if never_stops:
        _never_stop(model, tokenizer)
    output = Path(output_dir)
    model.save_pretrained(output)
    tokenizer.save_pretrained(output)
    return output


def _never_stop(model, tokenizer) -> None:
    """`--never-stops` (module docstring): `</s>` and `</think>` can never be sampled."""
    import torch

    if model.config.model_type != "llama":
        raise ValueError(f"--never-stops is for the dense Llama family, not "
                         f"{model.config.model_type!r}")
    (think_end,) = tokenizer.encode("</think>", add_special_tokens=False)
    feature = model.config.hidden_size - 1  # the constant feature
    with torch.no_grad():
        model.model.embed_tokens.weight[:, feature] = 1.0
        for layer in model.model.layers:  # nothing is added to it along the residual stream
            layer.self_attn.o_proj.weight[feature, :] = 0.0
            layer.mlp.down_proj.weight[feature, :] = 0.0
        for token in (tokenizer.eos_token_id, think_end):
            model.lm_head.weight[token, :] = 0.0
            model.lm_head.weight[token, feature] = -100.0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir")
    parser.add_argument("--family", default="llama")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--never-stops", action="store_true",
                        help="the end-of-sequence and end-of-thinking tokens are never sampled "
                             "(tests of generation to a length budget)")
    args = parser.parse_args(argv)
    from megatron_rl.console import quiet_known_warnings

    quiet_known_warnings()
    path = make_tiny_checkpoint(args.output_dir, family=args.family, size=args.size,
                                seed=args.seed, never_stops=args.never_stops)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
