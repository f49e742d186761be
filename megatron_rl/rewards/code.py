"""Code rewards: the candidate program (the last fenced code block after `</think>`) run against
stdin/stdout tests and HumanEval-style function-call tests in the sandbox. The reward comes from
the pass fraction; the reason is "correct" when every test passes, else the first failing test's
reason (wrong, timeout, runtime_error, memory_limit, ... see Reason).

No expected value ever enters the sandbox. A function-call test made of plain asserts
(`assert candidate(<constants>) == <constant>`, `assert candidate(...)`, `assert not ...`,
`assert abs(candidate(...) - <number>) < <number>` and `math.isclose(candidate(...), ...)`,
inside HumanEval's `def check(candidate)` or at top level) becomes a list of `FunctionCall`s: the
sandbox returns the program's return values as plain data and they are compared here. Constants
are literals or arithmetic over number literals (`2.0/3.0`, `3 * 19`), evaluated here. Any other
test runs in the sandbox's checker, a separate clean interpreter that sees the program's
functions only through plain-data calls (sandbox.py). stdin/stdout tests are compared here too.

If the sandbox fails on any test (`sandbox_error`), the whole result is `sandbox_error` (no
reward): a pass fraction with tests that never ran would grade the completion on part of its tests.
Nothing a program does can produce `sandbox_error`: what it can write is parsed as its own output.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import math
import operator
import re
from typing import Any

from megatron_rl.data.records import CodeTests, StdioTest
from megatron_rl.rewards.sandbox import (
    CallOutcome,
    ExecutionRequest,
    ExecutionResult,
    FunctionCall,
    Sandbox,
    SandboxLimits,
)
from megatron_rl.rewards.types import (
    THINK_END,
    VERIFIER_FAILURES,
    Reason,
    RewardResult,
    RewardScale,
    final_answer,
    make_result,
)

_CODE_BLOCK = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\r?\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("", "python", "python3", "py")
# Arithmetic a test's constants may use; ints stay below this many bits (no `10**10**9`).
_ARITHMETIC = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
               ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
               ast.Pow: operator.pow}
_MAX_CONSTANT_BITS = 4096
_MAX_CONSTANT_DEPTH = 50
# A test's loops are unrolled into at most this many calls (else the checker runs it).
_MAX_UNROLLED_CHECKS = 1000
# What a loop may bind: values no call can change (arguments cross as copies, so a list a test
# passes and reuses could differ from what the original test would see after the call).
_IMMUTABLE = (int, float, str, bool, type(None), bytes, complex)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CodeRewardConfig:
    think_end: str | None = THINK_END
    limits: SandboxLimits | None = None  # None: the sandbox's own limits
    scale: RewardScale = dataclasses.field(default_factory=RewardScale)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CodeTestReport:
    """Per-test outcomes (stdio tests first, then function-call tests) and their summary."""

    outcomes: tuple[Reason, ...]
    pass_fraction: float
    reason: Reason
    detail: str = ""


def extract_code(answer_text: str) -> str | None:
    """The last ```python (or untagged) fenced block; None when there is none."""
    blocks = [body for tag, body in _CODE_BLOCK.findall(answer_text)
              if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else None


def outputs_match(actual: str, expected: str) -> bool:
    """Line by line, ignoring trailing whitespace on each line and trailing blank lines."""
    def lines(text: str) -> list[str]:
        return [line.rstrip() for line in text.rstrip().splitlines()]
    return lines(actual) == lines(expected)


def _stdio_outcome(test: StdioTest, result: ExecutionResult) -> tuple[Reason, str]:
    if not result.ok:
        return Reason(result.status), result.detail
    if outputs_match(result.stdout, test.expected_stdout):
        return Reason.CORRECT, ""
    return Reason.WRONG, f"expected {test.expected_stdout[:60]!r}, got {result.stdout[:60]!r}"


def _is_number(value: Any) -> bool:
    return type(value) in (int, float)  # exact: bool is not a number here


@dataclasses.dataclass(frozen=True, slots=True)
class Tolerance:
    """A numeric assert with a tolerance, as the test wrote it: `abs(value - expected) < bound`
    (`<=` when inclusive; `math.fabs` for form "fabs") or `math.isclose(value, expected,
    rel_tol=..., abs_tol=...)` (form "isclose"). Evaluated with Python's own semantics, but only
    for an int or float value: a bool, complex, NaN or anything else is a wrong answer, and so is
    a value the arithmetic cannot handle (an int too large for a float)."""

    form: str                # "abs", "fabs" or "isclose"
    bound: float = 0.0
    inclusive: bool = False
    rel_tol: float = 1e-09   # math.isclose's defaults
    abs_tol: float = 0.0

    def accepts(self, value: Any, expected: Any) -> bool:
        if not _is_number(value) or value != value:  # NaN fails every comparison below too
            return False
        try:
            if self.form == "isclose":
                return math.isclose(value, expected, rel_tol=self.rel_tol, abs_tol=self.abs_tol)
            difference = value - expected
            distance = math.fabs(difference) if self.form == "fabs" else abs(difference)
            return distance <= self.bound if self.inclusive else distance < self.bound
        except (OverflowError, ValueError, TypeError):
            return False

    def describe(self, expected: Any) -> str:
        if self.form == "isclose":
            return f"isclose to {expected!r} (rel_tol={self.rel_tol}, abs_tol={self.abs_tol})"
        return f"within {'<=' if self.inclusive else '<'} {self.bound} of {expected!r}"


@dataclasses.dataclass(frozen=True, slots=True)
class CallCheck:
    """One assert of a converted test: the call, and what its outcome must be."""

    call: FunctionCall
    expect: str          # "==", "is", "truthy", "falsy" or "close" (within `tolerance`)
    expected: Any = None
    tolerance: Tolerance | None = None

    def passes(self, outcome: CallOutcome | None) -> bool:
        if outcome is None or not outcome.returned:
            return False
        if self.expect == "==":
            return _equal(outcome.value, self.expected)
        if self.expect == "is":
            return outcome.value is self.expected
        if self.expect == "close":
            return self.tolerance is not None and self.tolerance.accepts(outcome.value,
                                                                         self.expected)
        return bool(outcome.value) == (self.expect == "truthy")


def _equal(value: Any, expected: Any) -> bool:
    """`==` of two plain-data values (built-in types only: no program code runs here)."""
    try:
        return bool(value == expected)
    except RecursionError:
        return False


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


class _NotConstant(Exception):
    pass


@dataclasses.dataclass(slots=True)
class _Scope:
    """What a test's expressions may use here: the values its unrolled loops have bound so far
    (`env`, immutable values only), and which built-ins and helpers ("abs", "str", "range",
    "math" once a plain `import math` ran, and every built-in name) the test never rebinds."""

    helpers: frozenset[str] = frozenset()
    env: dict[str, Any] = dataclasses.field(default_factory=dict)
    builtins: frozenset[str] = frozenset()

    def with_helpers(self, extra: set[str]) -> _Scope:
        return _Scope(self.helpers | extra, self.env, self.builtins)


_NO_SCOPE = _Scope()


def _constant(node: ast.expr, scope: _Scope = _NO_SCOPE) -> tuple[bool, Any]:
    """A literal, or a tuple / list of constants and arithmetic over number literals (`2.0/3.0`,
    `3 * 19`, `0**0`, `'ab' + 'c'`), a loop's variable (`x + 1`) or `str` of a constant,
    evaluated here, with ints bounded in size; (False, None) for anything else."""
    ok, value = _literal(node)
    if ok:
        return ok, value
    try:
        return True, _evaluate(node, 0, scope)
    except (_NotConstant, ArithmeticError, ValueError, TypeError, MemoryError, RecursionError):
        return False, None


def _evaluate(node: ast.expr, depth: int, scope: _Scope) -> Any:
    if depth > _MAX_CONSTANT_DEPTH:
        raise _NotConstant
    if isinstance(node, ast.Constant) and type(node.value) in (int, float, str):
        return node.value
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in scope.env:
        return scope.env[node.id]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "str"
            and "str" in scope.helpers and len(node.args) == 1 and not node.keywords
            and not isinstance(node.args[0], ast.Starred)):
        value = _evaluate(node.args[0], depth + 1, scope)
        if type(value) not in (int, float, str, bool, type(None)):
            raise _NotConstant  # str() of these is plain Python, the same here as there
        return str(value)
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_evaluate(item, depth + 1, scope) for item in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = _evaluate(node.operand, depth + 1, scope)
        if not _is_number(operand):
            raise _NotConstant
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITHMETIC:
        left = _evaluate(node.left, depth + 1, scope)
        right = _evaluate(node.right, depth + 1, scope)
        if isinstance(node.op, ast.Add) and type(left) is str and type(right) is str:
            return left + right
        if not (_is_number(left) and _is_number(right)):
            raise _NotConstant
        if type(left) is int and type(right) is int and (
                isinstance(node.op, ast.Mult)
                and left.bit_length() + right.bit_length() > _MAX_CONSTANT_BITS
                or isinstance(node.op, ast.Pow)
                and max(left.bit_length(), 1) * abs(right) > _MAX_CONSTANT_BITS):
            raise _NotConstant
        value = _ARITHMETIC[type(node.op)](left, right)
        if not _is_number(value):  # (-8) ** 0.5 is complex
            raise _NotConstant
        return value
    raise _NotConstant


def _number(node: ast.expr, scope: _Scope = _NO_SCOPE) -> tuple[bool, Any]:
    ok, value = _constant(node, scope)
    return (True, value) if ok and _is_number(value) else (False, None)


def _call_of(node: ast.expr, names: set[str],
             scope: _Scope = _NO_SCOPE) -> FunctionCall | None:
    """`f(<constants>, k=<constant>)` with f in `names` (the call's function is the program's)."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in names):
        return None
    args, kwargs = [], []
    for arg in node.args:
        ok, value = _constant(arg, scope)
        if not ok or isinstance(arg, ast.Starred):
            return None
        args.append(value)
    for keyword in node.keywords:
        ok, value = _constant(keyword.value, scope)
        if not ok or keyword.arg is None:
            return None
        kwargs.append((keyword.arg, value))
    return FunctionCall(function=node.func.id, args=tuple(args), kwargs=tuple(kwargs))


def _check_of(statement: ast.stmt, names: set[str], function: dict[str, str],
              scope: _Scope = _NO_SCOPE) -> CallCheck | None:
    """An assert statement as a CallCheck; None when it is anything else."""
    if not isinstance(statement, ast.Assert):
        return None
    test = statement.test
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    call = _call_of(test.operand if negated else test, names, scope)
    check = None
    if call is not None:
        check = CallCheck(call, "falsy" if negated else "truthy")
    elif isinstance(test, ast.Compare) and len(test.ops) == 1:
        left, right = test.left, test.comparators[0]
        call = _call_of(left, names, scope)
        if call is None:  # `expected == f(...)`
            left, right, call = right, left, _call_of(right, names, scope)
        ok, expected = _constant(right, scope)
        if call is not None and ok:
            if isinstance(test.ops[0], ast.Eq):
                check = CallCheck(call, "==", expected)
            elif isinstance(test.ops[0], ast.Is) and expected in (True, False, None) \
                    and type(expected) in (bool, type(None)):
                check = CallCheck(call, "is", expected)
    if check is None:
        check = _tolerance_check(test, names, scope)
    if check is None:
        return None
    real = function.get(check.call.function, check.call.function)  # candidate -> entry point
    return dataclasses.replace(check, call=dataclasses.replace(check.call, function=real))


def _helper(node: ast.expr, helpers: frozenset[str]) -> str | None:
    """Which of abs, math.fabs and math.isclose `node` names ("abs", "fabs", "isclose"), where
    the test did not rebind it; else None."""
    if isinstance(node, ast.Name) and node.id == "abs" and "abs" in helpers:
        return "abs"
    if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "math" and "math" in helpers
            and node.attr in ("fabs", "isclose")):
        return node.attr
    return None


def _tolerance_check(test: ast.expr, names: set[str], scope: _Scope) -> CallCheck | None:
    """`abs(f(...) - x) < tol` (or `<=`, `tol > ...`, `math.fabs`, `x - f(...)`) and
    `math.isclose(f(...), x, rel_tol=..., abs_tol=...)` (either order) with number constants."""
    if isinstance(test, ast.Call) and _helper(test.func, scope.helpers) == "isclose":
        if len(test.args) != 2 or any(isinstance(a, ast.Starred) for a in test.args):
            return None
        tolerances = {}
        for keyword in test.keywords:
            ok, value = _number(keyword.value, scope)
            if not ok or keyword.arg not in ("rel_tol", "abs_tol") or keyword.arg in tolerances:
                return None
            tolerances[keyword.arg] = value
        call, expected = _call_and_number(test.args[0], test.args[1], names, scope)
        if call is None:
            return None
        return CallCheck(call, "close", expected, Tolerance("isclose", **tolerances))
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    op, distance, bound_node = test.ops[0], test.left, test.comparators[0]
    if isinstance(op, (ast.Gt, ast.GtE)):  # `tol > abs(...)`
        distance, bound_node = bound_node, distance
    elif not isinstance(op, (ast.Lt, ast.LtE)):
        return None
    if not (isinstance(distance, ast.Call) and len(distance.args) == 1 and not distance.keywords
            and isinstance(distance.args[0], ast.BinOp)
            and isinstance(distance.args[0].op, ast.Sub)):
        return None
    form = _helper(distance.func, scope.helpers)
    ok, bound = _number(bound_node, scope)
    if form not in ("abs", "fabs") or not ok:
        return None
    difference = distance.args[0]
    call, expected = _call_and_number(difference.left, difference.right, names, scope)
    if call is None:
        return None
    return CallCheck(call, "close", expected,
                     Tolerance(form, bound=bound, inclusive=isinstance(op, (ast.LtE, ast.GtE))))


def _call_and_number(a: ast.expr, b: ast.expr, names: set[str],
                     scope: _Scope) -> tuple[FunctionCall | None, Any]:
    """(the call, the number) of `f(...)` and a number constant, in either order."""
    for call_node, number_node in ((a, b), (b, a)):
        call = _call_of(call_node, names, scope)
        ok, number = _number(number_node, scope)
        if call is not None and ok:
            return call, number
    return None, None


def _rebound_names(module: ast.Module) -> set[str]:
    """Every name the test binds anywhere, except by a plain `import math`."""
    bound = set()
    for node in ast.walk(module):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and not _imports_math(node):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
    return bound


def _imports_math(statement: ast.stmt) -> bool:
    return isinstance(statement, ast.Import) and all(
        a.name == "math" and a.asname in (None, "math") for a in statement.names)


def convert_test(test: str) -> tuple[CallCheck, ...] | None:
    """A function-call test as plain calls and expected values, when it is only asserts over
    calls with constant arguments and constant expected values (or tolerances), loops over
    constants around them, and statements that do nothing: HumanEval's `def check(candidate):
    assert candidate(...) == ...` + `check(entry_point)`, or top-level `assert f(...) == ...`.
    None for anything else (it then runs in the sandbox's checker)."""
    try:
        module = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    checks: list[CallCheck] = []
    check_functions: dict[str, ast.FunctionDef] = {}
    defined = set()
    for statement in module.body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in statement.names)
        elif isinstance(statement, ast.Assign) and _literal(statement.value)[0]:
            defined.update(t.id for t in statement.targets if isinstance(t, ast.Name))
        elif isinstance(statement, ast.FunctionDef):
            check_functions[statement.name] = statement
            defined.add(statement.name)
    rebound = _rebound_names(module)
    # "math" once a plain `import math` has run
    scope = _Scope(helpers=frozenset({"abs", "str", "range"} - rebound),
                   builtins=frozenset(dir(builtins)) - rebound)
    budget = [_MAX_UNROLLED_CHECKS]
    for statement in module.body:
        if _imports_math(statement) and "math" not in rebound:
            scope = scope.with_helpers({"math"})
        if isinstance(statement, (ast.Import, ast.ImportFrom, ast.Assign, ast.FunctionDef)):
            continue  # used only through the statements below
        if isinstance(statement, (ast.Assert, ast.For, ast.Pass)) or _does_nothing(statement,
                                                                                 scope):
            # The program's functions: what the test reads and never binds itself.
            names = {n.id for n in ast.walk(statement) if isinstance(n, ast.Name)} - defined \
                - set(dir(builtins)) - rebound
            converted = _statement_checks(statement, names, {}, scope, budget)
        else:
            converted = _converted_check_call(statement, check_functions, defined, scope,
                                              "math" not in rebound, budget)
        if converted is None:
            return None
        checks.extend(converted)
    return tuple(checks) if checks else None


def _does_nothing(statement: ast.stmt, scope: _Scope) -> bool:
    """A docstring, `pass`, `assert True, ...` or a bare built-in name (HumanEval/129's `print`):
    statements that cannot fail or change anything."""
    if isinstance(statement, ast.Pass):
        return True
    if isinstance(statement, ast.Expr):
        value = statement.value
        return isinstance(value, ast.Constant) or (
            isinstance(value, ast.Name) and value.id in scope.builtins)
    return (isinstance(statement, ast.Assert) and isinstance(statement.test, ast.Constant)
            and statement.test.value is True)


def _statement_checks(statement: ast.stmt, names: set[str], function: dict[str, str],
                      scope: _Scope, budget: list[int]) -> list[CallCheck] | None:
    """The checks of one statement of a test: an assert, a loop over constants (unrolled), or
    a statement that does nothing; None for anything else, or past the unrolling budget."""
    if _does_nothing(statement, scope):
        return []
    if isinstance(statement, ast.Assert):
        check = _check_of(statement, names, function, scope)
        budget[0] -= 1
        return None if check is None or budget[0] < 0 else [check]
    if isinstance(statement, ast.For):
        return _unrolled(statement, names, function, scope, budget)
    return None


def _unrolled(loop: ast.For, names: set[str], function: dict[str, str], scope: _Scope,
              budget: list[int]) -> list[CallCheck] | None:
    """`for <target> in <range(constants) | constant tuple, list or str>: <body>`: the body's
    checks once per item, with the target bound to the item, as Python would run it (also after
    the loop: the target keeps the last item). Items must be immutable, so that no call can
    change what a later one sees; at most `_MAX_UNROLLED_CHECKS` items and checks in all."""
    if loop.orelse or names & _target_names(loop.target):
        return None
    items = _loop_items(loop.iter, scope)
    if items is None:
        return None
    checks: list[CallCheck] = []
    for item in items:
        budget[0] -= 1
        bound = _unpacked(loop.target, item) if _immutable(item) else None
        if bound is None or budget[0] < 0:
            return None
        scope.env.update(bound)
        for statement in loop.body:
            body = _statement_checks(statement, names, function, scope, budget)
            if body is None:
                return None
            checks.extend(body)
    return checks


def _loop_items(node: ast.expr, scope: _Scope) -> list | None:
    """The items of `range(<int constants>)` (the built-in range) or of a constant tuple, list
    or string; None for anything else or more than `_MAX_UNROLLED_CHECKS` items."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "range" and "range" in scope.helpers and not node.keywords
            and 1 <= len(node.args) <= 3):
        bounds = []
        for arg in node.args:
            ok, value = _constant(arg, scope)
            if not ok or isinstance(arg, ast.Starred) or type(value) not in (int, bool):
                return None
            bounds.append(value)
        try:
            items = range(*bounds)
            return list(items) if len(items) <= _MAX_UNROLLED_CHECKS else None
        except (ValueError, OverflowError):  # a zero step; a length beyond sys.maxsize
            return None
    ok, value = _constant(node, scope)
    if ok and type(value) in (tuple, list, str) and len(value) <= _MAX_UNROLLED_CHECKS:
        return list(value)
    return None


def _target_names(target: ast.expr) -> set[str]:
    return {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}


def _unpacked(target: ast.expr, item: Any) -> dict[str, Any] | None:
    """What `for <target> in ...` binds for `item` (names and tuples of them), or None where
    Python would raise (a length mismatch) or the target is anything else."""
    if isinstance(target, ast.Name):
        return {target.id: item}
    if not isinstance(target, (ast.Tuple, ast.List)) or type(item) not in (tuple, str) \
            or len(item) != len(target.elts):
        return None
    bound: dict[str, Any] = {}
    for element, value in zip(target.elts, item):
        inner = _unpacked(element, value)
        if inner is None:
            return None
        bound.update(inner)
    return bound


def _immutable(value: Any) -> bool:
    return type(value) in _IMMUTABLE or (type(value) is tuple and all(map(_immutable, value)))


def _converted_check_call(statement: ast.stmt, check_functions: dict[str, ast.FunctionDef],
                          defined: set[str], scope: _Scope, math_importable: bool,
                          budget: list[int]) -> list[CallCheck] | None:
    """`check(entry_point)` where check is `def check(candidate)` made of convertible
    statements (and `import math`)."""
    if not (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)):
        return None
    call = statement.value
    function = check_functions.get(getattr(call.func, "id", None))
    if (function is None or call.keywords or len(call.args) != 1
            or not isinstance(call.args[0], ast.Name) or call.args[0].id in defined):
        return None
    arguments = function.args
    if (len(arguments.args) != 1 or arguments.vararg or arguments.kwarg or arguments.kwonlyargs
            or arguments.posonlyargs or arguments.defaults or function.decorator_list):
        return None
    parameter, entry_point = arguments.args[0].arg, call.args[0].id
    scope = _Scope(scope.helpers, {}, scope.builtins)  # the function's own local variables
    checks = []
    for statement in function.body:
        if _imports_math(statement) and math_importable:
            scope = scope.with_helpers({"math"})
            continue
        body = _statement_checks(statement, {parameter}, {parameter: entry_point}, scope,
                                 budget)
        if body is None:
            return None
        checks.extend(body)
    return checks


def _function_tests(tests: CodeTests) -> tuple[list[tuple[CallCheck, ...] | None], list[str]]:
    """Per function test, its checks (converted) or None (for the checker); the checker's
    snippets."""
    converted = [convert_test(test) for test in tests.function_calls]
    return converted, [t for t, c in zip(tests.function_calls, converted) if c is None]


def run_code_tests(program: str, tests: CodeTests, sandbox: Sandbox, *,
                   limits: SandboxLimits | None = None) -> CodeTestReport:
    """Run every test of `tests` against `program` (concurrently, within the sandbox's bound)."""
    program = f"{tests.prelude}\n{program}" if tests.prelude else program
    requests = [ExecutionRequest(program=program, stdin=t.stdin, limits=limits)
                for t in tests.stdio]
    converted, snippets = _function_tests(tests)
    calls = tuple(check.call for checks in converted if checks for check in checks)
    if tests.function_calls:
        requests.append(ExecutionRequest(program=program, calls=calls, tests=tuple(snippets),
                                         limits=limits))
    results = sandbox.map(requests)
    outcomes = [_stdio_outcome(t, r) for t, r in zip(tests.stdio, results)]
    if tests.function_calls:
        outcomes += _function_outcomes(converted, results[-1])
    num_passed = sum(reason == Reason.CORRECT for reason, _ in outcomes)
    verifier_failure = next(((r, d) for r, d in outcomes if r in VERIFIER_FAILURES), None)
    first_failure = next(((r, d) for r, d in outcomes if r != Reason.CORRECT), None)
    reason, detail = verifier_failure or first_failure or (Reason.CORRECT, "")
    return CodeTestReport(outcomes=tuple(r for r, _ in outcomes),
                          pass_fraction=num_passed / len(outcomes), reason=reason, detail=detail)


def _function_outcomes(converted: list[tuple[CallCheck, ...] | None],
                       result: ExecutionResult) -> list[tuple[Reason, str]]:
    """One (reason, detail) per function test, in the tests' order."""
    failed = (Reason(result.status), result.detail) if not result.ok else (Reason.WRONG, "")
    if result.status == "sandbox_error":
        return [failed] * len(converted)
    call_outcomes = iter(result.call_outcomes or ())
    test_passed = iter(result.test_passed or ())
    outcomes = []
    for checks in converted:
        if checks is None:
            passed, why = next(test_passed, False), ""
        else:
            passed, why = True, ""
            for check in checks:
                outcome = next(call_outcomes, None)
                if passed and not check.passes(outcome):
                    passed, why = False, _mismatch(check, outcome)
        reason, detail = failed
        outcomes.append((Reason.CORRECT, "") if passed
                        else (reason, detail or why) if reason == Reason.WRONG else failed)
    return outcomes


def _mismatch(check: CallCheck, outcome: CallOutcome | None) -> str:
    call = f"{check.call.function}{check.call.args!r}"[:60]
    if outcome is None:
        return f"{call} was not reached"
    if not outcome.returned:
        return f"{call} {outcome.error}"
    want = (repr(check.expected)[:40] if check.expect in ("==", "is")
            else check.tolerance.describe(check.expected)[:80] if check.tolerance
            else check.expect)
    return f"{call} returned {repr(outcome.value)[:40]}, expected {want}"


class CodeReward:
    """Reward of a completion for code tests; thread-safe (the sandbox bounds concurrency)."""

    def __init__(self, sandbox: Sandbox, config: CodeRewardConfig | None = None) -> None:
        self.sandbox = sandbox
        self.config = config or CodeRewardConfig()

    def __call__(self, completion: str, tests: CodeTests) -> RewardResult:
        scale = self.config.scale
        answer = final_answer(completion, think_end=self.config.think_end)
        if answer is None:
            return make_result(Reason.NO_ANSWER, scale, detail=f"no {self.config.think_end}")
        program = extract_code(answer)
        if program is None:
            return make_result(Reason.NO_ANSWER, scale, detail="no ```python code block")
        report = run_code_tests(program, tests, self.sandbox, limits=self.config.limits)
        return make_result(report.reason, scale, pass_fraction=report.pass_fraction,
                           detail=report.detail)
