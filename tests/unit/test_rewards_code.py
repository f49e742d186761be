"""Code reward helpers that run no program: code extraction from completions, stdout comparison,
the reasons given before anything reaches the sandbox, and the sandbox configuration checks."""
import pytest

from megatron_rl.data import CodeTests, StdioTest
from megatron_rl.rewards import (
    CodeReward,
    Reason,
    Sandbox,
    SandboxConfig,
    SandboxLimits,
    extract_code,
    outputs_match,
)

pytestmark = pytest.mark.unit


def test_extract_code_takes_the_last_python_block():
    text = "first\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```\n"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nx = 3\n```") == "x = 3\n"          # untagged block
    assert extract_code("```bash\nls\n```") is None               # other language
    assert extract_code("```python\nprint(1)\n```\n```text\nout\n```") == "print(1)\n"
    assert extract_code("no code here") is None
    assert extract_code("```python\nunterminated") is None


@pytest.mark.parametrize("actual, expected, same", [
    ("3\n", "3", True),
    ("1 2  \n3\n\n\n", "1 2\n3", True),   # trailing spaces and blank lines ignored
    ("1\n2", "1\n2\n", True),
    ("12", "1 2", False),
    ("1\n\n2", "1\n2", False),            # inner blank lines matter
    ("", "0", False),
    (" 3", "3", False),                   # leading space matters
])
def test_outputs_match(actual, expected, same):
    assert outputs_match(actual, expected) is same


def test_reasons_given_before_running_anything():
    sandbox = Sandbox()  # never started: no program reaches it
    reward = CodeReward(sandbox)
    tests = CodeTests(stdio=(StdioTest(stdin="", expected_stdout="1"),))
    assert reward("<think>print(1)", tests).reason == Reason.NO_ANSWER
    assert reward("<think>x</think> print(1)", tests).reason == Reason.NO_ANSWER
    assert sandbox.server_pid is None
    sandbox.close()


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="docker")
    with pytest.raises(ValueError, match="wall_time_s"):
        SandboxLimits(wall_time_s=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxLimits(memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="uid_range"):
        SandboxConfig(uid_range=(5, 5))
    with pytest.raises(ValueError, match="uid_lock_dir must be an absolute path"):
        SandboxConfig(uid_lock_dir="locks")
    assert SandboxConfig().isolation == "namespaces"  # the fallback is an explicit choice
    with pytest.raises(ValueError, match="at least one"):
        CodeTests()
