"""Observation tokens (environments/turns.py) against independent references: the tokens of the
whole conversation rendered by the chat template and tokenised in one go (what a server given the
conversation would see), a hand-written rendering, and the plain template's text encoded."""
import pytest

from megatron_rl.data.tokenizer import TAG_TOKENS, prompt_token_ids, train_tokenizer
from megatron_rl.environments import (
    ChatTemplateTurns,
    PlainTurns,
    stop_token_ids,
    turn_format_for,
)

pytestmark = pytest.mark.unit

# Qwen2.5's template, abridged (no tools list): a default system message, and consecutive tool
# messages grouped into one user message of <tool_response> blocks.
QWEN_STYLE = (
    "{%- if messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}"
    "{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CHAT_TOKENS = ("<|im_start|>", "<|im_end|>", "<tool>", "</tool>")
CONVERSATION = [{"role": "user", "content": "What is 6 * 7?"}]
OBSERVATIONS = [{"role": "tool", "content": "42\n"}, {"role": "tool", "content": "done"}]


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["What is 6 * 7? You are helpful. system user assistant tool_response print(6 * 7)",
             "<tool_response>\n42\n</tool_response> done"] * 4
    return train_tokenizer(texts, vocab_size=200, added_tokens=TAG_TOKENS + CHAT_TOKENS)


@pytest.fixture()
def chat_tokenizer(tokenizer):
    tokenizer.chat_template = QWEN_STYLE
    yield tokenizer
    tokenizer.chat_template = None


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _whole(tokenizer, conversation):
    return list(tokenizer.apply_chat_template(conversation, tokenize=True,
                                              add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("turn_closed", [False, True])
def test_chat_template_observations_continue_the_sequence_as_the_whole_conversation(
        chat_tokenizer, turn_closed):
    """Model turns ending at "</tool>" (the closure is added) or at <|im_end|> (it is there)."""
    im_end = chat_tokenizer.convert_tokens_to_ids("<|im_end|>")
    formats = ChatTemplateTurns(chat_tokenizer)
    assert formats.closure_ids == tuple(_ids(chat_tokenizer, "<|im_end|>\n"))
    sequence = prompt_token_ids(chat_tokenizer, CONVERSATION)
    conversation = list(CONVERSATION)
    for turn, observation in (("<tool>print(6 * 7)</tool>", OBSERVATIONS),
                              ("<tool>print('done')</tool>", OBSERVATIONS[1:])):
        sequence += _ids(chat_tokenizer, turn) + ([im_end] if turn_closed else [])
        sequence += formats.observation_ids(observation, turn_closed=turn_closed)
        conversation += [{"role": "assistant", "content": turn}, *observation]
        assert sequence == _whole(chat_tokenizer, conversation)
    delta = formats.observation_ids(OBSERVATIONS, turn_closed=False)
    assert chat_tokenizer.decode(delta) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n\n</tool_response>\n"
        "<tool_response>\ndone\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_templates_that_cannot_carry_turns_are_refused(tokenizer):
    tokenizer.chat_template = ("{{ messages | length }}{% for m in messages %}{{ m.content }}"
                               "{% endfor %}")  # the history changes as the conversation grows
    try:
        with pytest.raises(ValueError, match="history is not a prefix"):
            ChatTemplateTurns(tokenizer).observation_ids(OBSERVATIONS, turn_closed=False)
        tokenizer.chat_template = ("{% for m in messages %}{% if m.role == 'tool' %}"
                                   "{{ raise_exception('no tool role') }}{% endif %}"
                                   "{{ m.content }}{% endfor %}")
        with pytest.raises(ValueError, match=r"cannot render a conversation \(user, assistant, "
                                             r"tool, tool\).*no tool role.*ToolSettings.role"):
            ChatTemplateTurns(tokenizer).observation_ids(OBSERVATIONS, turn_closed=False)
    finally:
        tokenizer.chat_template = None


def test_plain_turns_encode_each_message_through_the_template(tokenizer):
    formats = turn_format_for(tokenizer, "<answer>{content}</answer>")
    assert isinstance(formats, PlainTurns)
    for turn_closed in (False, True):
        assert formats.observation_ids(OBSERVATIONS, turn_closed=turn_closed) == tuple(
            _ids(tokenizer, "<answer>42\n</answer>") + _ids(tokenizer, "<answer>done</answer>"))
    with pytest.raises(ValueError, match="must contain {content}"):
        PlainTurns(tokenizer, "<output>{role}</output>")
    with pytest.raises(ValueError, match="only {content} and {role}"):
        PlainTurns(tokenizer, "{text}")


def test_turn_format_for_a_chat_template(chat_tokenizer):
    assert isinstance(turn_format_for(chat_tokenizer, "<output>{content}</output>"),
                      ChatTemplateTurns)


def test_stop_texts_must_be_single_tokens(tokenizer):
    assert stop_token_ids(tokenizer, ["</tool>", "</answer>"]) == (
        tokenizer.convert_tokens_to_ids("</tool>"), tokenizer.convert_tokens_to_ids("</answer>"))
    with pytest.raises(ValueError, match=r"stop text '</calc>' is \d+ tokens \[.*add it to the "
                                         r"tokenizer as a token"):
        stop_token_ids(tokenizer, ["</tool>", "</calc>"])
