"""The entry point of an SGLang server process: `python -m megatron_rl.rollout.sglang_launch
<SGLang server arguments>`.

First the server ties its life to the process that launched it (megatron_rl.rollout.
engine_lifetime: SIGKILL at the launcher's death, and so for every process it forks). The module
body then sets the engine's NCCL variables (megatron_rl.platform.environment: the values trainer
ranks use too; ones already in the environment, e.g. from the Ray job, stay) and applies
megatron_rl.platform.sglang_cpu's fixes (a no-op with CUDA) and, on CPU and GPU alike,
megatron_rl.platform.sglang_chunked_attention's (Llama-4's chunked attention on torch_native, a
no-op for other models and backends), all before SGLang is imported (SGLang keeps NCCL values it
finds set). SGLang starts its scheduler and detokenizer with multiprocessing
(forked on CPU, platform/sglang_cpu.py fix 12; spawned on GPU, which re-imports this module as
`__mp_main__` in each child), so every process of the server gets the same settings and fixes.
The `__main__` guard keeps the children from launching servers of their own.

The server's API key (SGLangServerSettings.api_key) arrives in API_KEY_ENV (sglang_server.py),
never on the command line (`ps` shows that to every user of the node); it is taken out of the
environment before SGLang starts its children, and left out of the server arguments SGLang logs
at start.
"""
from megatron_rl.rollout.engine_lifetime import tie_forked_children, tie_to_launcher

if __name__ in ("__main__", "__mp_main__"):  # before the slow imports below
    tie_to_launcher()
    tie_forked_children()

from megatron_rl.platform.environment import apply_generator_environment  # noqa: E402
from megatron_rl.platform.sglang_chunked_attention import apply_chunked_attention_fix  # noqa: E402
from megatron_rl.platform.sglang_cpu import apply_sglang_cpu_fixes  # noqa: E402
from megatron_rl.rollout.sglang_server import API_KEY_ENV  # noqa: E402

apply_generator_environment()
apply_sglang_cpu_fixes()
apply_chunked_attention_fix()  # GPU engines too: torch_native serves Llama-4 on Blackwell

_KEY_FIELDS = ("api_key", "admin_api_key")


def _keep_keys_out_of_the_log() -> None:
    """SGLang 0.5.23 logs every resolved server argument at start (`_launch_subprocesses`), the
    API keys included (it hides only watermark secrets): log them as "<hidden>"."""
    from sglang.srt.entrypoints import engine

    shown = engine._server_args_for_logging

    def hidden(server_args):
        return {k: ("<hidden>" if k in _KEY_FIELDS and v else v)
                for k, v in shown(server_args).items()}

    engine._server_args_for_logging = hidden


if __name__ == "__main__":
    import os
    import sys

    from sglang.launch_server import run_server
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    api_key = os.environ.pop(API_KEY_ENV, None)
    server_args = prepare_server_args(sys.argv[1:])
    if api_key:
        server_args.api_key = api_key
    _keep_keys_out_of_the_log()
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
