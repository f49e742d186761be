"""Loops over constants and statements that do nothing, in function tests, converted into calls
compared on the host: each converted test must give the verdict the original test gives when
run as Python (the reference here: exec of the program and the test in one namespace), on right
and wrong answers alike; what cannot keep that exactly goes to the sandbox's checker."""
import copy
import json

import pytest

from megatron_rl.rewards.code import convert_test
from megatron_rl.rewards.sandbox import CallOutcome
from megatron_rl.rewards.sandbox_server import decode_value, encode_value

pytestmark = pytest.mark.unit


def _original_passes(program: str, test: str) -> bool:
    """The reference: the test run as plain Python against the program."""
    namespace: dict = {}
    exec(program, namespace)
    try:
        exec(test, namespace)
    except Exception:
        return False
    return True


def _converted_passes(program: str, test: str) -> bool:
    """The host path: each call made with copied arguments, its value sent across as plain
    data (as the sandbox does: what encode_value refuses is a failed call), then compared."""
    checks = convert_test(test)
    assert checks is not None, "expected the test to convert"
    namespace: dict = {}
    exec(program, namespace)
    for check in checks:
        call = check.call
        try:
            value = namespace[call.function](*copy.deepcopy(call.args),
                                             **copy.deepcopy(dict(call.kwargs)))
            outcome = CallOutcome(returned=True,
                                  value=decode_value(json.loads(json.dumps(encode_value(value)))))
        except Exception:
            outcome = CallOutcome(returned=False, error="raised")
        if not check.passes(outcome):
            return False
    return True


CHANGE_BASE = ("def change_base(x, base):\n    digits = ''\n    while x > 0:\n"
               "        digits = str(x % base) + digits\n        x //= base\n    return digits\n")
HUMANEVAL_44 = ("def check(candidate):\n    assert candidate(8, 3) == '22'\n"
                "    for x in range(2, 8):\n        assert candidate(x, x + 1) == str(x)\n"
                "\ncheck(change_base)\n")
# (test, {program: whether the original test passes})
CASES = {
    "HumanEval/44's loop": (HUMANEVAL_44, {
        CHANGE_BASE: True,
        "def change_base(x, base):\n    return '22' if x == 8 else str(x) if x < 7 else '0'\n":
            False,  # wrong in the last iteration only
        "def change_base(x, base):\n    return 22 if x == 8 else x\n": False,  # ints, not str
        "def change_base(x, base):\n    raise ValueError(x)\n": False,
    }),
    "tuples unpacked": (
        "def check(candidate):\n    for a, (b, c) in [(1, (2, 'x')), (3, (4, 'y'))]:\n"
        "        assert candidate(a, c) == b\ncheck(f)", {
            "def f(a, c):\n    return a + 1\n": True,
            "def f(a, c):\n    return a + 1 if c == 'x' else 0\n": False,
            "def f(a, c):\n    return float(a + 1)\n": True,  # 2.0 == 2, as in Python
        }),
    "nested, and the variable after the loop": (
        "def check(candidate):\n    for i in range(3):\n        for j in (1, 2):\n"
        "            assert candidate(i, j) == i * j\n"
        "    assert candidate(i, 10) == 2 * 10\ncheck(f)", {
            "def f(i, j):\n    return i * j\n": True,
            "def f(i, j):\n    return i * j if j < 10 else 0\n": False,
        }),
    "characters of a string": (
        "for c in 'ab':\n    assert f(c) == c + c\n    assert not f('')\n", {
            "def f(c):\n    return c * 2\n": True,
            "def f(c):\n    return c * 2 or None\n": True,
            "def f(c):\n    return c.upper() * 2\n": False,
        }),
    "tolerance inside a loop": (
        "def check(candidate):\n    for x in (0.5, 1.5, 3):\n"
        "        assert abs(candidate(x) - x / 2) < 1e-9\ncheck(half)", {
            "def half(x):\n    return x / 2\n": True,
            "def half(x):\n    return x // 2\n": False,
            "def half(x):\n    return round(x / 2, 1)\n": False,  # 0.2 for 0.25
        }),
    "an empty range runs nothing": (
        "def check(candidate):\n    for x in range(3, 3):\n        assert candidate(x) == 'never'\n"
        "    assert candidate(1) == 1\ncheck(f)", {
            "def f(x):\n    return x\n": True,
            "def f(x):\n    return 'never'\n": False,
        }),
    "statements that do nothing (HumanEval/129's bare print)": (
        "def check(candidate):\n    '''doc'''\n    print\n    pass\n    assert True, 'msg'\n"
        "    assert candidate([[1, 2], [3, 4]], 3) == [1, 2, 1]\ncheck(minPath)", {
            "def minPath(grid, k):\n    return [1, 2, 1][:k]\n": True,
            "def minPath(grid, k):\n    return (1, 2, 1)\n": False,  # a tuple is not the list
        }),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_converted_loops_give_the_original_verdicts(case):
    test, programs = CASES[case]
    for program, passes in programs.items():
        assert _original_passes(program, test) is passes, program  # the reference itself
        assert _converted_passes(program, test) is passes, program


def test_humaneval_44_unrolls_into_its_calls():
    checks = convert_test(HUMANEVAL_44)
    assert [(c.call.function, c.call.args, c.expected) for c in checks] == [
        ("change_base", (8, 3), "22")] + [("change_base", (x, x + 1), str(x))
                                          for x in range(2, 8)]


def test_non_built_in_return_values_still_fail_in_loops():
    """A str subclass with its own __eq__ passes the original test; it is not plain data (the
    sandbox reports it unserialisable), so it fails here, as in every host-compared call."""
    program = ("class Yes(str):\n    def __eq__(self, other):\n        return True\n"
               "    __hash__ = str.__hash__\n"
               "def change_base(x, base):\n    return Yes()\n")
    assert _original_passes(program, HUMANEVAL_44)
    assert not _converted_passes(program, HUMANEVAL_44)


@pytest.mark.parametrize("test", [
    "def check(candidate):\n    for x in range(3):\n        assert candidate(x) == x\n"
    "    else:\n        pass\ncheck(f)",                                    # for-else
    "def check(candidate):\n    for xs in [[1], [2]]:\n        assert candidate(xs) == xs\n"
    "check(f)",                                 # a list item: a call may change what is reused
    "for x in range(10 ** 6):\n    assert f(x) == x\n",                   # past the budget
    "for i in range(100):\n    for j in range(100):\n        assert f(i, j) == 0\n",
    "for i in range(10 ** 4):\n    for j in range(10 ** 4):\n        pass\n",  # no checks, long
    "for x in range(0, 5, 0):\n    assert f(x) == x\n",                   # range raises
    "for x in range(10 ** 30):\n    assert f(x) == x\n",
    "for x in range(1.5):\n    assert f(x) == x\n",
    "def check(candidate):\n    for x in values:\n        assert candidate(x) == x\ncheck(f)",
    "def check(candidate):\n    for x in {1, 2}:\n        assert candidate(x) == x\ncheck(f)",
    "def check(candidate):\n    for candidate in (1, 2):\n        assert candidate(1) == 1\n"
    "check(f)",                                                   # rebinds the program's name
    "def check(candidate):\n    for x in range(3):\n        if x:\n            break\n"
    "        assert candidate(x) == x\ncheck(f)",
    "def check(candidate):\n    for x in range(3):\n        continue\ncheck(f)",
    "def check(candidate):\n    for a, b in [(1, 2, 3)]:\n        assert candidate(a) == b\n"
    "check(f)",                                                   # unpacking raises
    "def check(candidate):\n    for a, *b in [(1, 2, 3)]:\n        assert candidate(a) == b\n"
    "check(f)",
    "for str in ('a',):\n    assert f(1) == str(1)\n",                   # not the built-in str
    "range = lambda n: [5]\nfor x in range(2):\n    assert f(x) == x\n",  # not the built-in
    "def check(candidate):\n    assert candidate(x) == 1\n    for x in range(2):\n        pass\n"
    "check(f)",                                                 # read before the loop binds it
    "def check(candidate):\n    for x in range(2):\n        assert candidate(x) == str(x, 'u')\n"
    "check(f)",
    "def check(candidate):\n    for x in ([1],):\n        assert candidate(x) == str(x)\ncheck(f)",
    "def check(candidate):\n    undefined_name\n    assert candidate(1) == 1\ncheck(f)",
    "def check(candidate):\n    print(1)\n    assert candidate(1) == 1\ncheck(f)",
    "for x in range(3):\n    x = 2\n    assert f(x) == 2\n",
])
def test_loops_that_cannot_be_unrolled_exactly_go_to_the_checker(test):
    assert convert_test(test) is None
