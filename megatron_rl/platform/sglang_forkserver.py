"""Preloaded by the forkserver that SGLang's CPU server processes are forked from
(megatron_rl/platform/sglang_cpu.py, fix 12); not meant to be imported anywhere else.

Importing it
- ties this process's life to its parent, the SGLang server process, and the life of every child
  it forks to its own (megatron_rl.rollout.engine_lifetime: PR_SET_PDEATHSIG, and an exit when the
  server has already died). The forkserver would otherwise outlive a SIGKILLed server, since it
  only exits once every process holding its "alive" pipe has, and the children it forked hold it.
  Killing the server therefore still ends every process of it;
- makes this process pass a SIGQUIT on to the server process: SGLang's children signal a crash to
  their parent with SIGQUIT, and the server process's handler ends the whole server;
- applies the CPU fixes and imports the modules whose functions the scheduler and detokenizer
  processes run, so each forked child starts with them loaded instead of importing sglang again.
"""
import os
import signal

from megatron_rl.rollout.engine_lifetime import tie_forked_children, tie_to_launcher

tie_to_launcher()
tie_forked_children()


def _relay_to_parent(signum, frame) -> None:
    del frame
    os.kill(os.getppid(), signum)


signal.signal(signal.SIGQUIT, _relay_to_parent)

from megatron_rl.platform.sglang_cpu import apply_sglang_cpu_fixes  # noqa: E402

apply_sglang_cpu_fixes()

import sglang.srt.managers.detokenizer_manager  # noqa: E402,F401
import sglang.srt.managers.scheduler  # noqa: E402,F401
