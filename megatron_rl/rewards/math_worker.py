"""The math grading worker process: `python -m megatron_rl.rewards.math_worker FD OPTIONS`,
started by `megatron_rl.rewards.math.MathVerifier`. It grades requests from the connection on
FD one at a time in its main thread, where a float `setitimer` soft timeout can interrupt
Python-level work; its parent kills it if even that does not answer in time.
"""
from __future__ import annotations

import json
import logging
import signal
import sys
from multiprocessing.connection import Connection

from megatron_rl.rewards.math import grade_math_answer
from megatron_rl.rewards.types import Reason


class _SoftTimeout(BaseException):
    """BaseException: math-verify and SymPy catch Exception in places; this must get through."""


def _raise_soft_timeout(signum, frame) -> None:
    raise _SoftTimeout


def serve(conn: Connection, options: dict) -> None:
    import math_verify  # noqa: F401  (import before reporting ready: it takes seconds)

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" warnings
    # The first grading imports and builds math-verify's LaTeX parser (about a second, more on
    # a loaded machine): pay it before "ready", so that no real grading's timeout counts it.
    try:
        grade_math_answer("$1$", "1", **options)
    except Exception:  # noqa: BLE001 - a broken grader is reported by the real gradings
        pass
    signal.signal(signal.SIGALRM, _raise_soft_timeout)
    conn.send("ready")
    while True:
        try:
            answer_text, gold, timeout_s = conn.recv()
        except EOFError:
            return
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            reason, detail = grade_math_answer(answer_text, gold, **options)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except _SoftTimeout:
            reason, detail = Reason.TIMEOUT, f"grading exceeded {timeout_s} s"
        except Exception as exc:  # noqa: BLE001 - a grader bug must not kill the worker
            # ... nor become a wrong answer: the verifier failed, not the completion.
            signal.setitimer(signal.ITIMER_REAL, 0)
            reason = Reason.VERIFIER_ERROR
            detail = f"math-verify failed: {type(exc).__name__}: {exc}"
        conn.send((reason.value, detail))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])), json.loads(sys.argv[2]))
