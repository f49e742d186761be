"""A small tokenizer trained here with HF `tokenizers` (no download), for models made from scratch
(the demo's base model): BPE over printable ASCII in which every digit is a token of its own, so
that numbers are spelled digit by digit, and the thinking / answer tags are single tokens.

Pre-tokenization isolates each digit and leaves the text between digits whole, so BPE merges only
inside those pieces and may merge across words (as SentencePiece does without whitespace
splitting): on a narrow task corpus, fixed instruction text becomes a few tokens, which keeps
sequences short where every token costs CPU time. `<think>`, `</think>`, `<answer>`, `</answer>`
are added (not special) tokens: always one token each, kept when decoding. Special tokens: <pad>
0, <s> 1 (prepended by `encode` with special tokens, as a prompt is encoded), </s> 2 (end of a
response), <unk> 3. Training is deterministic: the same texts and vocabulary size give the same
tokenizer. `prompt_token_ids` is how every run encodes a prompt for its policy (RL generators and
SFT alike).
"""
from __future__ import annotations

import re
import string
from collections.abc import Iterable, Mapping, Sequence

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")
PIECE_PATTERN = r"\d|[^\d]+"


def train_tokenizer(texts: Iterable[str], *, vocab_size: int,
                    added_tokens: Sequence[str] = TAG_TOKENS):
    """A `transformers.PreTrainedTokenizerFast` trained on `texts`, at most `vocab_size` tokens
    (special, alphabet, merges and `added_tokens` together)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, \
        processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE_PATTERN), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    alphabet = sorted(set(string.printable) - set("\t\r\x0b\x0c"))  # with " " and "\n"
    budget = vocab_size - len(added_tokens)
    if budget < len(SPECIAL_TOKENS) + len(alphabet):
        raise ValueError(f"vocab_size {vocab_size} cannot hold the {len(SPECIAL_TOKENS)} special "
                         f"tokens, {len(alphabet)} characters and {len(added_tokens)} tags; "
                         f"use at least {len(SPECIAL_TOKENS) + len(alphabet) + len(added_tokens)}")
    trainer = trainers.BpeTrainer(vocab_size=budget, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                  show_progress=False)
    # Encoding splits the text at the added tokens first; train on the same pieces, so that no
    # merge is spent on (or across) a tag. They are added after training, which would drop them.
    splitter = re.compile("|".join(re.escape(t) for t in added_tokens)) if added_tokens else None
    pieces = (piece for text in texts
              for piece in (splitter.split(text) if splitter else [text]) if piece)
    tokenizer.train_from_iterator(pieces, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", SPECIAL_TOKENS.index("<s>"))])
    if tokenizer.get_vocab_size() > vocab_size:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > {vocab_size}")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")


def prompt_token_ids(tokenizer, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
    """A prompt as the policy sees it, in RL runs (megatron_rl/data/run_prompts.py) and SFT
    alike. `prompt` is a text (one user turn) or a conversation (chat messages, e.g.
    `PromptRecord.conversation`: a system prompt, earlier turns). With a chat template: the
    conversation rendered by it, with the generation prompt. Without one: the text of a single
    user turn with the tokenizer's special tokens (e.g. a BOS); a longer conversation then has no
    faithful rendering and raises ValueError."""
    conversation = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                    else [dict(message) for message in prompt])
    if getattr(tokenizer, "chat_template", None):
        # return_dict=False: transformers 5 returns a BatchEncoding by default.
        return list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    if len(conversation) == 1 and conversation[0]["role"] == "user":
        return list(tokenizer.encode(conversation[0]["content"], add_special_tokens=True))
    roles = ", ".join(message["role"] for message in conversation)
    raise ValueError(f"the prompt is a conversation ({roles}) and the tokenizer has no chat "
                     "template to render it; use a tokenizer with one (tokenizer_config.json's "
                     "chat_template) or single-turn prompts")
