"""What crosses the sandbox boundary, without running a program: the strict parser of the
records a run writes, the plain-data encoding of values, and the conversion of assert-style
function tests into calls compared on the host."""
import json
import math

import pytest

from megatron_rl.data import CodeTests
from megatron_rl.rewards.code import CallCheck, _function_outcomes, convert_test
from megatron_rl.rewards.sandbox import (
    _RESULT_RECORDS,
    _STATUS_RECORDS,
    CallOutcome,
    ExecutionResult,
    FunctionCall,
    parse_records,
)
from megatron_rl.rewards.sandbox_server import decode_value, encode_value
from megatron_rl.rewards.types import Reason

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("value", [
    None, True, 0, -7, 2 ** 100, 1.5, math.inf, "é\n", [1, [2, []]], (1, (2,)), {1, 2},
    frozenset({"a"}), {"k": [1], 2: (3,)}, b"\x00\xff", 1 + 2j, [(1, 2.0), {None: True}],
])
def test_plain_data_round_trips_with_its_types(value):
    back = decode_value(json.loads(json.dumps(encode_value(value))))
    assert back == value and type(back) is type(value)


class _Sneaky(int):
    def __eq__(self, other):
        return True


@pytest.mark.parametrize("value", [_Sneaky(1), object(), [1, _Sneaky(2)], {"k": range(3)}])
def test_only_exact_built_in_types_are_plain_data(value):
    with pytest.raises(TypeError, match="not plain data"):
        encode_value(value)


@pytest.mark.parametrize("data", [{"tuple": 1}, {"a": 1, "b": 2}, {"set": [[1]]}, {"bytes": "zz"},
                                  {"complex": ["x", 1]}, {"object": []}])
def test_decoding_builds_nothing_but_plain_data(data):
    with pytest.raises((ValueError, TypeError)):
        decode_value(data)


def test_nesting_is_bounded_both_ways():
    deep = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(ValueError, match="nested deeper"):
        encode_value(deep)
    with pytest.raises(ValueError, match="nested deeper"):
        decode_value(deep)


def test_the_parser_never_raises_and_counts_what_it_rejects():
    text = ("E [12, \"Name\", 0, \"\"]\nE 12 a b 0\nP \"SyntaxError\"\nR [[\"ok\", 1]]\n"
            "D 12\nX forged\nT 0 1 -\n\udcff\x00garbage\nD [1]\n" + "R " + "[" * 100_000 + "\n")
    records, malformed = parse_records(text, _RESULT_RECORDS)
    assert [kind for kind, _ in records] == ["E", "P", "R", "D"]
    assert malformed == 6
    status, bad = parse_records('S {"exit_code": true}\nS 0 0 - 0 0 x 0 1\n', _STATUS_RECORDS)
    assert status == [] and bad == 2


def test_plain_asserts_become_calls_with_host_side_expectations():
    test = ("METADATA = {'author': 'x'}\nimport math\n\ndef check(candidate):\n"
            "    '''doc'''\n    assert candidate(1, [2]) == (3,)\n    assert candidate(0, k=-1)\n"
            "    assert not candidate(2, [])\n    assert candidate(4, []) is None\n"
            "    assert True, 'always'\n\ncheck(solve)\n")
    checks = convert_test(test)
    assert [(c.call.function, c.call.args, c.call.kwargs, c.expect) for c in checks] == [
        ("solve", (1, [2]), (), "=="), ("solve", (0,), (("k", -1),), "truthy"),
        ("solve", (2, []), (), "falsy"), ("solve", (4, []), (), "is")]
    assert convert_test("assert f(1) == 2\nassert 3 == g()")[1].call.function == "g"


@pytest.mark.parametrize("test", [
    "def check(candidate):\n    assert abs(candidate(1) - 2) < 1e-6\ncheck(f)",
    "def check(candidate):\n    for x in range(3):\n        assert candidate(x) == x\ncheck(f)",
    "def check(candidate):\n    assert candidate(3 * 19) == [3, 19]\ncheck(f)",
    "assert len([1]) == 1",           # a built-in, not the program's function
    "assert f(1) == 2\nprint(1)",
    "this is not python",
])
def test_anything_else_goes_to_the_checker(test):
    assert convert_test(test) is None


def _result(outcomes, test_passed=(), status="ok") -> ExecutionResult:
    return ExecutionResult(status=status, stdout="", stderr="", test_passed=test_passed,
                           exit_code=0, signal=None, wall_time_s=0.0, cpu_time_s=0.0,
                           max_rss_bytes=0, isolation="namespaces", uid=None,
                           call_outcomes=tuple(outcomes))


def test_host_comparison_is_plain_equality_per_test():
    f = FunctionCall(function="f", args=(1,))
    converted = [(CallCheck(f, "==", [1, 2]), CallCheck(f, "truthy")), None,
                 (CallCheck(f, "is", True),)]
    returned = [CallOutcome(returned=True, value=[1, 2]), CallOutcome(returned=True, value=[0]),
                CallOutcome(returned=True, value=1)]  # 1 is not True
    outcomes = _function_outcomes(converted, _result(returned, test_passed=(True,)))
    assert [r for r, _ in outcomes] == [Reason.CORRECT, Reason.CORRECT, Reason.WRONG]
    assert "returned 1, expected True" in outcomes[2][1]
    missing = _function_outcomes(converted, _result([None] * 3, test_passed=(False,)))
    assert [r for r, _ in missing] == [Reason.WRONG] * 3
    assert CodeTests(function_calls=("assert f(1) == 2",)).function_calls
