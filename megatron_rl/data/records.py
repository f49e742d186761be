"""The prompt record every dataset loader produces and every verifier consumes: a prompt, its task
tag (which selects the reward function: "math", "code", "rg/<reasoning-gym dataset>", ...), and
what grading needs (a reference answer, code tests, or task metadata), with its JSON form.

A prompt is a text (one user turn) or, when the dataset gives more (a system prompt, earlier
turns), a conversation of chat messages that the tokenizer's chat template renders as it is.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

OVERALL_TASK = "all"  # reserved: the validation curve over every task
CHAT_ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ChatMessage:
    role: str
    content: str

    def __post_init__(self) -> None:
        if self.role not in CHAT_ROLES:
            raise ValueError(f"chat message role {self.role!r} is not one of {CHAT_ROLES}")
        if not isinstance(self.content, str):
            raise ValueError(f"a {self.role} message's content must be text, got "
                             f"{type(self.content).__name__} (only text prompts are read)")

    def to_json(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


def parse_messages(value: Any) -> tuple[ChatMessage, ...]:
    """Chat messages from their JSON form, a list of {"role": ..., "content": ...} objects (as
    verl and chat-template datasets store prompts); ValueError names what is wrong."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("a conversation prompt must be a non-empty list of "
                         '{"role": ..., "content": ...} messages')
    messages = []
    for index, message in enumerate(value):
        if not isinstance(message, Mapping) or not {"role", "content"} <= set(message):
            raise ValueError(f"prompt message {index} must be an object with 'role' and "
                             f"'content', got {message!r:.80}")
        try:
            messages.append(ChatMessage(role=message["role"], content=message["content"]))
        except ValueError as exc:
            raise ValueError(f"prompt message {index}: {exc}") from None
    if messages[-1].role != "user":
        raise ValueError(f"the last prompt message is a {messages[-1].role!r} one; a prompt "
                         "conversation must end with the user's turn (the policy answers it)")
    return tuple(messages)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StdioTest:
    """Run the program with `stdin`; it passes if stdout matches `expected_stdout` line by line
    (trailing whitespace and trailing blank lines ignored)."""

    stdin: str
    expected_stdout: str


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CodeTests:
    """stdin/stdout tests (one sandbox run each) and function-call tests (HumanEval style: Python
    snippets run after the program in its namespace, e.g. `check(candidate)`, passing when they
    raise nothing). `prelude` is prepended to the candidate's code (e.g. the imports the problem
    statement's signature relies on)."""

    stdio: tuple[StdioTest, ...] = ()
    function_calls: tuple[str, ...] = ()
    prelude: str = ""

    def __post_init__(self) -> None:
        if not self.stdio and not self.function_calls:
            raise ValueError("CodeTests needs at least one stdio test or function-call test")

    @property
    def num_tests(self) -> int:
        return len(self.stdio) + len(self.function_calls)

    def to_json(self) -> dict[str, Any]:
        return {"stdio": [{"stdin": t.stdin, "stdout": t.expected_stdout} for t in self.stdio],
                "function_calls": list(self.function_calls), "prelude": self.prelude}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, where: str = "") -> CodeTests:
        if not isinstance(obj, Mapping):
            raise ValueError(f"{where}'tests' must be an object with 'stdio' and/or "
                             f"'function_calls', got {type(obj).__name__}")
        try:
            stdio = tuple(StdioTest(stdin=str(t["stdin"]), expected_stdout=str(t["stdout"]))
                          for t in obj.get("stdio") or ())
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}each 'tests.stdio' entry needs 'stdin' and 'stdout' "
                             f"strings ({exc!r})") from None
        calls = tuple(str(c) for c in obj.get("function_calls") or ())
        try:
            return cls(stdio=stdio, function_calls=calls, prelude=str(obj.get("prelude") or ""))
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PromptRecord:
    """`prompt` is the user's question. `messages`, when the dataset gives a conversation beyond
    that one user turn, is the whole of it (ending with that question: `prompt` is its last
    message); the policy is then prompted with the conversation (`conversation`)."""

    prompt_id: str
    task: str
    prompt: str
    answer: str | None = None          # math reference / procedural oracle answer
    tests: CodeTests | None = None     # code tasks
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # JSON-serialisable
    messages: tuple[ChatMessage, ...] = ()

    def __post_init__(self) -> None:
        for name in ("prompt_id", "task", "prompt"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"PromptRecord.{name} must be a non-empty string, got {value!r}")
        if self.task == OVERALL_TASK:
            raise ValueError(f"task {OVERALL_TASK!r} is reserved for the overall validation "
                             "curve; give the prompt its own task tag")
        if self.messages and (self.messages[-1].role != "user"
                              or self.messages[-1].content != self.prompt):
            raise ValueError("PromptRecord.messages must end with the user message `prompt`")

    @classmethod
    def with_prompt(cls, prompt: str | list | tuple, **fields: Any) -> PromptRecord:
        """A record whose prompt is a text or a conversation (a list of chat messages, dicts or
        ChatMessage); a conversation of one user message is stored as its text."""
        if isinstance(prompt, str):
            return cls(prompt=prompt, **fields)
        messages = parse_messages([m.to_json() if isinstance(m, ChatMessage) else m
                                   for m in prompt])
        if len(messages) == 1:
            return cls(prompt=messages[0].content, **fields)
        return cls(prompt=messages[-1].content, messages=messages, **fields)

    @property
    def conversation(self) -> list[dict[str, str]]:
        """What the policy is prompted with, as chat messages (for a chat template)."""
        if self.messages:
            return [m.to_json() for m in self.messages]
        return [{"role": "user", "content": self.prompt}]

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"id": self.prompt_id, "task": self.task,
                               "prompt": self.conversation if self.messages else self.prompt}
        if self.answer is not None:
            obj["answer"] = self.answer
        if self.tests is not None:
            obj["tests"] = self.tests.to_json()
        if self.metadata:
            obj["metadata"] = dict(self.metadata)
        return obj

    @classmethod
    def from_json(cls, obj: Mapping[str, Any], *, where: str = "") -> PromptRecord:
        """From the JSON form (`id`, `task`, `prompt` (a text, or a conversation: a list of
        {"role", "content"} messages), optional `answer`, `tests`, `metadata`; `metadata` may
        also be a JSON string, as stored in Parquet files)."""
        if not isinstance(obj, Mapping):
            raise ValueError(f"{where}a prompt must be a JSON object, got {type(obj).__name__}")
        missing = [key for key in ("id", "task", "prompt") if obj.get(key) in (None, "")]
        if missing:
            raise ValueError(f"{where}missing field(s) {missing}: every prompt needs 'id', "
                             "'task' (e.g. 'math', 'code', 'rg/leg_counting') and 'prompt'")
        metadata = obj.get("metadata") or {}
        if isinstance(metadata, str):
            metadata = json.loads(metadata)
        if not isinstance(metadata, Mapping):
            raise ValueError(f"{where}'metadata' must be an object, got {type(metadata).__name__}")
        tests = obj.get("tests")
        answer = obj.get("answer")
        prompt = obj["prompt"]
        try:
            return cls.with_prompt(prompt if isinstance(prompt, (list, tuple)) else str(prompt),
                                   prompt_id=str(obj["id"]), task=str(obj["task"]),
                                   answer=None if answer is None else str(answer),
                                   tests=None if tests is None else CodeTests.from_json(tests),
                                   metadata=dict(metadata))
        except ValueError as exc:
            raise ValueError(f"{where}{exc}") from None
