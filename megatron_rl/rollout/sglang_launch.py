"""The entry point of an SGLang server process: `python -m megatron_rl.rollout.sglang_launch
<SGLang server arguments>`.

The module body sets the engine's NCCL variables (megatron_rl.platform.environment: the values
trainer ranks use too; ones already in the environment, e.g. from the Ray job, stay) and applies
megatron_rl.platform.sglang_cpu's fixes (a no-op with CUDA), both before SGLang is imported (SGLang
keeps NCCL values it finds set). SGLang starts its scheduler and detokenizer with multiprocessing's
spawn, which re-imports this module (as `__mp_main__`) in each child, so every process of the
server gets the same settings and fixes. The `__main__` guard keeps the children from launching
servers of their own.
"""
from megatron_rl.platform.environment import apply_generator_environment
from megatron_rl.platform.sglang_cpu import apply_sglang_cpu_fixes

apply_generator_environment()
apply_sglang_cpu_fixes()



def _exit_with_parent(poll_s: float = 1.0) -> None:
    """Stop this server when the process that launched it dies (a Ray actor killed with its
    driver): the server runs in a session of its own, so nothing else would. SGLang's scheduler
    and detokenizer already end with this process (PR_SET_PDEATHSIG)."""
    import os
    import threading
    import time

    from sglang.srt.utils import kill_process_tree

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        kill_process_tree(os.getpid(), include_parent=True)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


if __name__ == "__main__":
    import os
    import sys

    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    _exit_with_parent()
    try:
        run_server(prepare_server_args(sys.argv[1:]))
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
