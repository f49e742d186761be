"""What crosses the sandbox boundary, without running a program: the strict parser of the
records a run writes, the plain-data encoding of values, and the conversion of assert-style
function tests into calls compared on the host."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.data import CodeTests
from megatron_rl.rewards.code import CallCheck, Tolerance, _function_outcomes, convert_test
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
    "def check(candidate):\n    assert tuple(candidate(3)) == (3,)\ncheck(f)",
    "assert len([1]) == 1",           # a built-in, not the program's function
    "assert f(1) == 2\nprint(1)",
    "this is not python",
    # tolerance asserts the host does not evaluate
    "assert math.isclose(f(1), 2.0)",                        # math never imported
    "import math as m\nassert m.isclose(f(1), 2.0)",
    "from fake import math\nassert math.isclose(f(1), 2.0)",
    "import math, cmath as math\nassert math.isclose(f(1), 2.0)",
    "import math\nmath = None\nassert math.isclose(f(1), 2.0)",
    "assert math.isclose(f(1), 2.0)\nimport math",           # not imported yet
    "abs = len\nassert abs(f(1) - 2) < 1",                  # not the built-in abs
    "def check(abs):\n    assert abs(abs(1) - 2) < 1\ncheck(f)",
    "def check(candidate):\n    import math\n    math.pi = 3\n"
    "    assert math.fabs(candidate(1) - 2) < 1\ncheck(f)",
    "assert abs(f(1) - 2) > 1e-6",                           # the wrong way round
    "assert abs(f(1) + 2) < 1",
    "assert abs(f(1) - x) < 1",
    "assert abs(f(1) - 2) < True",                           # a bool is not a tolerance
    "assert abs(f(1) - 2, 3) < 1",
    "import math\nassert math.isclose(f(1), 2, tol=1)",
    "import math\nassert math.isclose(f(1), f(2))",
    "import math\nassert not math.isclose(f(1), 2)",
    # constants: bounded arithmetic over number literals only
    "assert f(10 ** 10 ** 9) == 1",
    "assert f(2 ** 5000) == 1",
    "assert f(1 / 0) == 1",
    "assert f((-8) ** 0.5) == 1",                            # complex
    "assert f('a' * 3) == 1",
    "assert f(True + 1) == 1",
    "assert f(len('a')) == 1",
])
def test_anything_else_goes_to_the_checker(test):
    assert convert_test(test) is None


def test_tolerance_asserts_become_host_side_checks():
    test = ("import math\n\ndef check(candidate):\n"
            "    assert abs(candidate(1.33) - 0.33) < 1e-6\n"
            "    assert abs(0.5 - candidate(2)) <= 1e-3\n"
            "    assert 1e-6 > abs(candidate(3) - 2.0/3.0)\n"
            "    assert math.fabs(candidate(4) - 1) < 1\n"
            "    assert math.isclose(3 * 0.1, candidate(5), rel_tol=1e-3)\n"
            "    assert math.isclose(candidate(6), -2, abs_tol=0.5, rel_tol=0)\n"
            "\ncheck(solve)\n")
    checks = convert_test(test)
    assert [(c.call.function, c.call.args, c.expect, c.expected, c.tolerance) for c in checks] == [
        ("solve", (1.33,), "close", 0.33, Tolerance("abs", bound=1e-6)),
        ("solve", (2,), "close", 0.5, Tolerance("abs", bound=1e-3, inclusive=True)),
        ("solve", (3,), "close", 0.6666666666666666, Tolerance("abs", bound=1e-6)),
        ("solve", (4,), "close", 1, Tolerance("fabs", bound=1)),
        ("solve", (5,), "close", 0.30000000000000004, Tolerance("isclose", rel_tol=1e-3)),
        ("solve", (6,), "close", -2, Tolerance("isclose", rel_tol=0, abs_tol=0.5))]
    inside = convert_test("def check(candidate):\n    import math\n"
                          "    assert math.isclose(candidate(1), 2.0)\ncheck(g)")
    assert inside[0].tolerance == Tolerance("isclose") and inside[0].call.function == "g"
    top = convert_test("assert abs(f(1) - 2) < 1e-6\nassert f(2) == 4")
    assert [c.expect for c in top] == ["close", "=="]


def test_constant_arithmetic_is_evaluated_on_the_host():
    test = ("def check(candidate):\n"
            "    assert candidate(3 * 19) == [3, 19]\n"
            "    assert candidate([1, 0**0], -(2**3)) == (3 + 5 + 7, 3 * 5 * 7)\n"
            "    assert candidate('abcde' + 'cade', 7 // 2, 7 % 4, 2 ** -1) == 1e3 / 8\n"
            "check(f)")
    checks = convert_test(test)
    assert [(c.call.args, c.expected) for c in checks] == [
        ((57,), [3, 19]), (([1, 1], -8), (15, 105)), (("abcdecade", 3, 3, 0.5), 125.0)]
    assert type(checks[1].call.args[0][1]) is int and type(checks[2].expected) is float


ABS = Tolerance("abs", bound=1e-6)


@pytest.mark.parametrize("tolerance, value, expected, passes", [
    (ABS, 0.33, 0.33, True),
    (ABS, 0.3300005, 0.33, True),               # 5e-7 away
    (ABS, 0.330001, 0.33, True),                # 9.9999999997e-7 away (float rounding)
    (ABS, 0.3300011, 0.33, False),              # 1.09999999998e-6 away
    (ABS, 0.32, 0.33, False),
    (ABS, 1, 1.0, True),                        # an int is a number
    (ABS, True, 1.0, False),                    # a bool is not
    (ABS, False, 0, False),
    (ABS, math.nan, 0.33, False),
    (ABS, math.nan, math.nan, False),
    (ABS, math.inf, 0.33, False),
    (ABS, -math.inf, 0.33, False),
    (ABS, math.inf, math.inf, False),           # inf - inf is NaN
    (ABS, 10 ** 400, 0.5, False),               # too large for a float: OverflowError
    (Tolerance("abs", bound=2), 10 ** 400 + 1, 10 ** 400, True),  # exact int arithmetic
    (Tolerance("fabs", bound=2), 10 ** 400 + 1, 10 ** 400, True),
    (Tolerance("fabs", bound=2), 10 ** 400, 0, False),           # fabs overflows
    (Tolerance("abs", bound=0.5), 1.5, 1.0, False),
    (Tolerance("abs", bound=0.5, inclusive=True), 1.5, 1.0, True),
    (Tolerance("abs", bound=math.nan, inclusive=True), 1.0, 1.0, False),
    (ABS, 0.33 + 0j, 0.33, False),              # complex
    (ABS, "0.33", 0.33, False),
    (ABS, [0.33], 0.33, False),                 # nested
    (ABS, (0.33,), 0.33, False),
    (ABS, {"v": 0.33}, 0.33, False),
    (ABS, None, 0.33, False),
    (Tolerance("isclose", rel_tol=1e-3), 100.0, 100.1, True),   # 0.1 <= 1e-3 * 100.1
    (Tolerance("isclose", rel_tol=1e-4), 100.0, 100.1, False),
    (Tolerance("isclose"), 1.0, 1.0 + 1e-10, True),              # rel_tol 1e-9
    (Tolerance("isclose"), 1.0, 1.0 + 1e-8, False),
    (Tolerance("isclose", abs_tol=0.5), 0.4, 0, True),
    (Tolerance("isclose"), True, 1.0, False),
    (Tolerance("isclose"), math.nan, math.nan, False),
    (Tolerance("isclose"), math.inf, math.inf, True),             # as math.isclose says
    (Tolerance("isclose"), math.inf, 1e308, False),
    (Tolerance("isclose"), 10 ** 400, 1.0, False),
    (Tolerance("isclose", rel_tol=-1), 1.0, 1.0, False),          # isclose raises ValueError
])
def test_tolerance_is_python_semantics_over_numbers_only(tolerance, value, expected, passes):
    assert tolerance.accepts(value, expected) is passes
    check = CallCheck(FunctionCall(function="f"), "close", expected, tolerance)
    assert check.passes(CallOutcome(returned=True, value=value)) is passes


def test_tolerance_checks_see_what_crossed_the_boundary():
    """NaN and inf cross as JSON (NaN, Infinity) and still fail; raising or not returning fails;
    the failure says what was expected."""
    test = "def check(candidate):\n    assert abs(candidate(1.33) - 0.33) < 1e-6\ncheck(f)"
    (check,) = convert_test(test)
    for text in ("NaN", "Infinity", "-Infinity", "true", '{"tuple": [0.33]}', "0.34"):
        assert not check.passes(CallOutcome(returned=True, value=decode_value(json.loads(text))))
    assert check.passes(CallOutcome(returned=True, value=decode_value(json.loads("0.33"))))
    assert not check.passes(CallOutcome(returned=False, error="raised ValueError"))
    assert not check.passes(None)
    nan = CallOutcome(returned=True, value=math.nan)
    reason, detail = _function_outcomes([(check,)], _result([nan]))[0]
    assert reason == Reason.WRONG and "returned nan, expected within < 1e-06 of 0.33" in detail


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


def test_tests_are_compiled_on_the_host_as_the_checker_would(tmp_path):
    """The checker runs code the host compiled: asserts kept even in a `python -O` trainer, no
    `__future__` flag of sandbox.py (annotations stay objects), a test that does not compile
    left to the checker (which then fails it), and the names the tests take from the program."""
    script = tmp_path / "compile.py"
    script.write_text(
        "import marshal\n"
        "from megatron_rl.rewards.sandbox import _tests_payload\n"
        "tests = ('def g(x: int) -> None:\\n    pass\\nassert f(1) == 2', 'def (')\n"
        "payload = marshal.loads(_tests_payload(tests))\n"
        "namespace = {'f': lambda x: x}\n"
        "try:\n"
        "    exec(payload['code'][0], namespace)\n"
        "    print('assert skipped')\n"
        "except AssertionError:\n"
        "    print('assert kept')\n"
        "print(namespace['g'].__annotations__ == {'x': int, 'return': None})\n"
        "print(payload['code'][1], payload['names'], payload['tests'] == list(tests))\n")
    done = subprocess.run([sys.executable, "-O", str(script)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)
    assert done.stdout.split("\n") == ["assert kept", "True", "None ['f'] True", ""], done.stderr
