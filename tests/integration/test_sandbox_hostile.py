"""Hostile programs in the real sandbox: each is contained (the right reason, nothing left
running, nothing written outside, no secret or network reached) and the host process is
unaffected (its children and memory back to normal). Short limits keep the file fast."""
import os
import socket
import time
import uuid

import psutil
import pytest

from megatron_rl.data import CodeTests, StdioTest
from megatron_rl.rewards import CodeReward, CodeRewardConfig, Reason, Sandbox, SandboxConfig
from megatron_rl.rewards import SandboxLimits
from megatron_rl.rewards.sandbox import DEFAULT_UID_RANGE

# Runs as root, like the sandbox in production (namespaces and per-run uids need it).
pytestmark = pytest.mark.integration

LIMITS = SandboxLimits(wall_time_s=2.0, cpu_time_s=2.0, memory_bytes=256 << 20, num_processes=8,
                       max_output_bytes=64 << 10, file_size_bytes=1 << 20, tmpfs_bytes=4 << 20)
# For programs expected to end by another limit: room for a loaded host, so it is never timeout.
ROOMY = SandboxLimits(wall_time_s=20.0, cpu_time_s=20.0, memory_bytes=256 << 20,
                      num_processes=8, max_output_bytes=64 << 10, file_size_bytes=1 << 20,
                      tmpfs_bytes=4 << 20)


def _sandbox_processes() -> list[psutil.Process]:
    """Live (non-zombie) processes running as any sandbox uid."""
    lo, hi = DEFAULT_UID_RANGE
    found = []
    for proc in psutil.process_iter(["uids", "status"]):
        uids = proc.info["uids"]
        if uids and lo <= uids.real < hi and proc.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(proc)
    return found


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(num_workers=2, limits=LIMITS)) as sb:
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
    assert sandbox.run(program).status == "timeout"


def test_infinite_loop_and_sleep_time_out(sandbox):
    assert sandbox.run("while True:\n    pass").status == "timeout"
    slept = sandbox.run("import time\ntime.sleep(60)")
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
    assert result.stdout == "written: []\nok ['inside.txt']\n"
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
    with Sandbox(SandboxConfig(num_workers=1, limits=LIMITS)) as sb:
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
        with Sandbox(SandboxConfig(num_workers=1, limits=LIMITS, isolation=isolation)) as sb:
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
    assert sandbox.run(program).status == "timeout"
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
    with Sandbox(SandboxConfig(num_workers=1, limits=ROOMY, isolation="seccomp")) as sb:
        bomb = sb.run("import os\nwhile True:\n    os.fork()")
        escaped = sb.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                         "    time.sleep(120)\nprint('bye')")
    assert (bomb.status, bomb.isolation) == ("process_limit", "seccomp")
    assert (escaped.status, escaped.stdout) == ("ok", "bye\n")
