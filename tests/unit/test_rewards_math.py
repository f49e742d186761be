"""Math grading: a table of equivalences and non-equivalences with the verdict written by hand,
the no-answer / parse-error reasons, thinking stripping, and the reward scale. In-process
(`grade_math_answer`); the worker processes and their timeouts are tested in
tests/integration/test_sandbox_math_timeout.py."""
import pytest

from megatron_rl.rewards import (
    MathVerifier,
    MathVerifyConfig,
    Reason,
    RewardScale,
    final_answer,
    grade_math_answer,
    make_result,
)

pytestmark = pytest.mark.unit

C, W = Reason.CORRECT, Reason.WRONG
# (reference answer, answer text after </think>, expected verdict)
TABLE = [
    # fractions and decimals
    (r"\frac{1}{2}", r"The answer is $\boxed{0.5}$", C),
    ("0.5", r"$\boxed{\frac{1}{2}}$", C),
    (r"\frac{1}{2}", r"\boxed{\frac{2}{4}}", C),
    (r"\dfrac{3}{4}", r"\boxed{0.75}", C),
    (r"-\frac{1}{3}", r"\boxed{-1/3}", C),
    (r"\frac{1}{3}", r"\boxed{0.333333}", C),   # equal at float_rounding=6
    ("2", r"\boxed{2.0}", C),
    ("1000", r"\boxed{1,000}", C),
    (r"\frac{1}{2}", r"\boxed{0.6}", W),
    ("1/3", r"\boxed{0.33}", W),                # not equal at 6 decimals
    # radicals, constants, symbolic expressions
    (r"\sqrt{8}", r"\boxed{2\sqrt{2}}", C),
    (r"2\sqrt{3}", r"\boxed{\sqrt{12}}", C),
    (r"\frac{\sqrt{3}}{2}", r"\boxed{\frac{1}{2}\sqrt{3}}", C),
    (r"\pi/2", r"\boxed{\frac{\pi}{2}}", C),
    ("x^2+2x+1", r"\boxed{(x+1)^2}", C),
    ("a+b", r"\boxed{b+a}", C),
    (r"\sqrt{2}", r"\boxed{1.41}", W),
    (r"\pi", r"\boxed{3.14}", W),
    ("x^2+2x+1", r"\boxed{(x-1)^2}", W),
    ("a+b", r"\boxed{a-b}", W),
    ("x+y", r"\boxed{x+z}", W),
    ("2", r"\boxed{x}", W),
    # sets and intervals
    (r"\{1,2,3\}", r"\boxed{\{3,2,1\}}", C),
    (r"\{1,2\}", r"\boxed{1,2}", C),
    (r"\{1,2\}", r"\boxed{\{1,2,3\}}", W),
    (r"\{1,2\}", r"\boxed{\{1\}}", W),
    ("(1,2]", r"\boxed{(1,2]}", C),
    (r"[0,\infty)", r"\boxed{[0, \infty)}", C),
    (r"(1,2)\cup(3,4)", r"\boxed{(3,4)\cup(1,2)}", C),
    ("(1,2]", r"\boxed{[1,2]}", W),
    (r"[0,\infty)", r"\boxed{(0,\infty)}", W),
    # integers, percentages, units, assignments, plain text answers
    ("3", "The answer is 3.", C),
    (r"10\%", r"\boxed{10\%}", C),
    ("12", r"\boxed{12 \text{ cm}}", C),
    ("5", r"\boxed{x=5}", C),
    (r"\infty", r"\boxed{\infty}", C),
    ("3", r"\boxed{-3}", W),
    ("5", r"\boxed{50}", W),
    ("7", "I think 8", W),
]


@pytest.mark.parametrize("gold, answer, expected", TABLE)
def test_math_verdicts(gold, answer, expected):
    reason, _ = grade_math_answer(answer, gold)
    assert reason == expected


def test_table_is_large_and_balanced():
    assert len(TABLE) >= 30
    assert sum(e == C for *_, e in TABLE) >= 15 and sum(e == W for *_, e in TABLE) >= 15


@pytest.mark.parametrize("answer, expected", [
    ("I don't know.", Reason.NO_ANSWER),        # nothing extractable
    ("   ", Reason.NO_ANSWER),
    (r"\boxed{\frac{}{}}", Reason.PARSE_ERROR),  # extracted, not convertible
    (r"\boxed{\sqrt{}}", Reason.PARSE_ERROR),
    (r"\boxed{abc \frac{1}{}}", Reason.PARSE_ERROR),
])
def test_no_answer_and_parse_error(answer, expected):
    reason, detail = grade_math_answer(answer, "3")
    assert reason == expected and detail


def test_unparseable_reference_is_reported_as_the_dataset_problem():
    reason, detail = grade_math_answer(r"\boxed{3}", r"\frac{")
    assert reason == Reason.PARSE_ERROR and "reference" in detail


def test_final_answer_is_after_the_last_think_end():
    assert final_answer("<think>5</think> 4") == " 4"
    assert final_answer("<think>a</think>b</think>c") == "c"
    assert final_answer("<think>still thinking, boxed{5}") is None
    assert final_answer("no thinking 7", think_end=None) == "no thinking 7"


def test_thinking_part_is_not_graded():
    answer = final_answer(r"<think>the answer is \boxed{5}</think> so \boxed{4}")
    assert grade_math_answer(answer, "4")[0] == C
    assert grade_math_answer(answer, "5")[0] == W


def test_verifier_reasons_that_need_no_worker():
    verifier = MathVerifier(MathVerifyConfig(scale=RewardScale(incorrect_reward=-1.0)))
    try:
        truncated = verifier.grade(r"<think> ... \boxed{3}", "3")  # thinking never ended
        assert (truncated.reason, truncated.reward, truncated.passed) == (Reason.NO_ANSWER, -1.0,
                                                                           False)
        empty = verifier.grade("<think>x</think>  \n", "3")
        assert empty.reason == Reason.NO_ANSWER
    finally:
        verifier.close()


def test_reward_scale():
    default = RewardScale()
    assert make_result(C, default).reward == 1.0 and make_result(W, default).reward == 0.0
    signed = RewardScale(incorrect_reward=-1.0)
    assert make_result(W, signed).reward == -1.0
    assert make_result(Reason.TIMEOUT, signed).reward == -1.0
    partial = RewardScale(incorrect_reward=-1.0, partial_credit=True)
    # 3 of 4 tests: -1 + 2 * 0.75 = 0.5
    assert make_result(W, partial, pass_fraction=0.75).reward == 0.5
    assert make_result(C, partial).reward == 1.0
    with pytest.raises(ValueError, match="must exceed"):
        RewardScale(correct_reward=0.0, incorrect_reward=0.0)
