"""Reward dispatch by task tag and the reasoning-gym procedural reward (graded by the datasets'
own scorers; the expected answers come from the generated entries, the arithmetic by hand)."""
import pytest

from megatron_rl.data import PromptRecord, reasoning_gym_prompts
from megatron_rl.rewards import (
    ProceduralReward,
    ProceduralRewardConfig,
    Reason,
    RewardRegistry,
    RewardResult,
    RewardScale,
    UnknownTaskError,
    make_result,
)

pytestmark = pytest.mark.unit


def _exact_match(completion: str, record: PromptRecord) -> RewardResult:
    return make_result(Reason.CORRECT if completion == record.answer else Reason.WRONG,
                       RewardScale())


def _record(task: str, answer: str | None = "42", prompt_id: str = "p") -> PromptRecord:
    return PromptRecord(prompt_id=prompt_id, task=task, prompt="q", answer=answer)


def test_dispatch_by_exact_tag_and_family():
    registry = RewardRegistry()
    registry.register("echo", _exact_match, requires=("answer",))
    registry.register("fam/", lambda c, r: make_result(Reason.WRONG, RewardScale()))
    assert registry.tasks == ("echo", "fam/*")
    assert registry.score("42", _record("echo")).reason == Reason.CORRECT
    assert registry.score("41", _record("echo")).reason == Reason.WRONG
    assert registry.score("42", _record("fam/x")).reason == Reason.WRONG
    results = registry.score_many(["42", "1", "42"], [_record("echo"), _record("echo"),
                                                      _record("echo", answer="1")])
    assert [r.reason for r in results] == [Reason.CORRECT, Reason.WRONG, Reason.WRONG]


def test_unknown_tag_error_lists_registered_tags():
    registry = RewardRegistry()
    registry.register("math", _exact_match)
    registry.register("rg/", _exact_match)
    for task in ("poetry", "rg/", "mat"):
        with pytest.raises(UnknownTaskError, match=r"'math', 'rg/\*'"):
            registry.score("x", _record(task))
    with pytest.raises(UnknownTaskError, match="poetry"):  # before any work starts
        registry.score_many(["x", "y"], [_record("math"), _record("poetry", prompt_id="q")])


def test_registration_errors_and_record_check():
    registry = RewardRegistry()
    registry.register("math", _exact_match, requires=("answer",))
    with pytest.raises(ValueError, match="already registered"):
        registry.register("math", _exact_match)
    with pytest.raises(ValueError, match="not PromptRecord fields"):
        registry.register("x", _exact_match, requires=("gold",))
    registry.check([_record("math")])
    with pytest.raises(ValueError, match=r"p \(task 'math'\) lacks \['answer'\]"):
        registry.check([_record("math", answer=None)])


def test_procedural_reward_uses_the_dataset_scorer():
    records = reasoning_gym_prompts("basic_arithmetic", num_prompts=2, seed=3)
    reward = ProceduralReward()
    record = records[0]
    right = reward(f"<think>work</think> <answer>{record.answer}</answer>", record)
    assert (right.reason, right.reward, right.pass_fraction) == (Reason.CORRECT, 1.0, 1.0)
    wrong_value = str(int(float(record.answer)) + 1)
    wrong = reward(f"<think>work</think><answer>{wrong_value}</answer>", record)
    assert (wrong.reason, wrong.reward) == (Reason.WRONG, 0.0)
    assert reward(f"<think>work</think> {record.answer}", record).reason == Reason.NO_ANSWER
    assert reward(f"<think><answer>{record.answer}</answer>", record).reason == Reason.NO_ANSWER
    # only the answer after the thinking part counts
    inside = reward(f"<think><answer>{record.answer}</answer></think><answer>x</answer>", record)
    assert inside.reason == Reason.WRONG


def test_procedural_reward_on_a_hand_checked_problem():
    # leg_counting: the generated metadata lists the animals; legs per animal written by hand.
    legs = {"human": 2, "chicken": 2, "duck": 2, "cat": 4, "dog": 4, "tiger": 4, "spider": 8,
            "woodlouse": 14, "leech": 0, "beetle": 6, "lobster": 10, "firefly": 6, "snake": 0}
    num_checked = 0
    for record in reasoning_gym_prompts("leg_counting", num_prompts=8, seed=1):
        animals = record.metadata["animals"]
        if not set(animals) <= set(legs):
            continue
        total = sum(legs[a] * n for a, n in animals.items())
        result = ProceduralReward()(f"</think><answer>{total}</answer>", record)
        assert result.reason == Reason.CORRECT, (animals, total, record.answer)
        num_checked += 1
    assert num_checked >= 2


def test_procedural_partial_credit_and_scale():
    record = reasoning_gym_prompts("leg_counting", num_prompts=1, seed=0)[0]
    config = ProceduralRewardConfig(scale=RewardScale(incorrect_reward=-1.0))
    wrong = ProceduralReward(config)("</think><answer>zzz</answer>", record)
    assert (wrong.reason, wrong.reward) == (Reason.WRONG, -1.0)
    # leg_counting keeps reasoning-gym's default scorer: len(oracle) / len(answer) when the
    # oracle is inside the answer, e.g. "500 x" -> 3 / 5.
    partial = ProceduralReward(ProceduralRewardConfig(scale=RewardScale(partial_credit=True)))
    result = partial(f"</think><answer>{record.answer} x</answer>", record)
    expected = len(record.answer) / (len(record.answer) + 2)
    assert result.reason == Reason.WRONG
    assert result.pass_fraction == pytest.approx(expected)
    assert result.reward == pytest.approx(expected)
    with pytest.raises(ValueError, match="not a procedural task"):
        ProceduralReward()("x", _record("math"))


def test_a_raising_reward_fails_only_its_own_sample():
    """A reward function that raises on one completion (a verifier bug, or a program that broke
    a parser) is a verifier failure for that sample; the rest of the batch is scored."""
    def fragile(completion: str, record: PromptRecord) -> RewardResult:
        if completion == "boom":
            raise ValueError("could not parse 'a b'")
        return _exact_match(completion, record)

    registry = RewardRegistry()
    registry.register("echo", fragile, requires=("answer",))
    results = registry.score_many(["42", "boom", "41"], [_record("echo")] * 3, retries=1)
    assert [r.reason for r in results] == [Reason.CORRECT, Reason.VERIFIER_ERROR, Reason.WRONG]
    assert results[1].reward is None and "ValueError: could not parse" in results[1].detail


def test_a_sandbox_that_cannot_isolate_still_raises():
    from megatron_rl.rewards.sandbox import SandboxUnavailableError

    def unavailable(completion: str, record: PromptRecord) -> RewardResult:
        raise SandboxUnavailableError("unshare(namespaces) refused")

    registry = RewardRegistry()
    registry.register("code", unavailable)
    with pytest.raises(SandboxUnavailableError, match="refused"):
        registry.score_many(["x"], [_record("code")])


def test_sandbox_isolation_comes_from_the_run_config():
    """algorithm.sandbox_isolation is the run's opt-in to the seccomp fallback; its values are
    the sandbox's own."""
    import typing

    from megatron_rl.config import AlgorithmConfig, ConfigError, load_config
    from megatron_rl.rewards.sandbox import ISOLATIONS, SandboxConfig

    hint = typing.get_type_hints(AlgorithmConfig)["sandbox_isolation"]
    assert typing.get_args(hint) == ISOLATIONS
    assert SandboxConfig.from_run_config(load_config(None)).isolation == "namespaces"
    run = load_config(None, ["algorithm.sandbox_isolation=auto"])
    config = SandboxConfig.from_run_config(run, num_workers=3)
    assert (config.isolation, config.num_workers) == ("auto", 3)
    with pytest.raises(ConfigError, match="algorithm.sandbox_isolation"):
        load_config(None, ["algorithm.sandbox_isolation=none"])
