"""The Llama-4 "demo" size (the demo's base model, tools/make_demo_base.py) served by the real SGLang
CPU engine in the layout the build writes. (The build itself, run twice for determinism, is in
tests/e2e/test_demo.py, which trains on it.)

Serving: a random demo-size model (initializer_range 0.1: peaked distributions, so that a wrong
mechanism moves log-probs by far more than bf16 noise), written by `write_sglang_layout` in bf16,
scored by SGLang on sequences 8 tokens longer than one attention chunk (two chunks; the NoPE
layer reads across them) against transformers computing in FP32 on the same bf16 weights. Both engines compute in
bf16, whose rounding alone moves a log-prob by up to 0.4 on this model (transformers' own bf16 run
vs its FP32 run; mean 0.02), so SGLang must stay within MEAN_TOLERANCE on average and within 1.5x
transformers' own bf16 worst case (measured: mean 0.018, max 0.20). The same check against
transformers with chunking switched off fails by far more past the first chunk (measured: mean
1.15), so the comparison sees the chunked attention.

Then, on the same server: SIGKILL to the server process alone (a crashed or killed generator)
ends every process of it. This server's scheduler and detokenizer start from a forkserver
(platform/sglang_cpu.py, fix 12's fallback; the default forks them from the server process, and
tests/integration/test_sglang_weight_sync.py ends such a server), so this checks the chain the
fallback relies on: the forkserver ends with the server process, the children with the
forkserver.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
import pytest
import torch

pytestmark = pytest.mark.integration

MEAN_TOLERANCE = 0.03

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _workers import still_alive  # noqa: E402


@pytest.fixture(scope="module")
def served_demo_size(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_rl.platform.sglang_cpu import CHILD_START_ENV
    from megatron_rl.rollout import SGLangGenerator, SGLangServer, SGLangServerSettings
    from models import get_model_family
    from models.llama4.convert import write_sglang_layout

    directory = tmp_path_factory.mktemp("demo_size")
    config_dict = dict(get_model_family("llama4").hf_config("demo"), initializer_range=0.1)
    model_type = config_dict.pop("model_type")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config_dict))
    model.to(torch.bfloat16).save_pretrained(directory / "text")
    served = write_sglang_layout(directory / "text", directory / "served")
    # This server's children start from the forkserver (fix 12's fallback, which the default
    # fork takes when the server process runs other threads): the SIGKILL test checks its chain.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CHILD_START_ENV, "forkserver")
        server = SGLangServer.launch(SGLangServerSettings(
            model_path=str(served), dtype="bfloat16", mem_fraction_static=0.05,
            max_total_tokens=4096, startup_timeout_s=900, request_timeout_s=120,
            log_path=str(directory / "server.log")))
    try:
        yield directory / "text", SGLangGenerator(server.url, server=server)
    finally:
        server.shutdown()


def _transformers_logprobs(model_dir: Path, sequences, *, dtype=torch.float32,
                           **config_changes) -> torch.Tensor:
    """log pi(token t | tokens < t) [num_sequences, length - 1] from transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    for key, value in config_changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=dtype).eval()
    with torch.no_grad():
        logits = model(torch.tensor(sequences)).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(2, torch.tensor(sequences)[:, 1:, None])[..., 0]


def test_sglang_serves_the_demo_size_like_transformers(served_demo_size):
    model_dir, generator = served_demo_size
    gen = torch.Generator().manual_seed(3)
    # Ids below 250: SGLang 0.5.23 reads the last id of this 256-token vocabulary (255) back as 0
    # (seen in input_token_logprobs); the demo tokenizer has 246 tokens, so never sends it.
    from models import get_model_family

    chunk = get_model_family("llama4").hf_config("demo")["attention_chunk_size"]
    sequences = [torch.randint(4, 250, (chunk + 8,), generator=gen).tolist() for _ in range(4)]
    served = torch.stack(generator.score(sequences))
    reference = _transformers_logprobs(model_dir, sequences)
    # bf16 compute rounds activations: transformers' own bf16 run is the noise yardstick.
    noise = (_transformers_logprobs(model_dir, sequences, dtype=torch.bfloat16)
             - reference).abs()
    error = (served - reference).abs()
    print(f"|sglang - fp32|: mean {error.mean():.4f} max {error.max():.4f}; transformers bf16: "
          f"mean {noise.mean():.4f} max {noise.max():.4f}")
    assert error.mean() < MEAN_TOLERANCE and error.max() <= 1.5 * noise.max()
    # Positions past the first chunk differ without chunked attention: the check sees it.
    unchunked = _transformers_logprobs(model_dir, sequences, attention_chunk_size=4096)
    gap = (served - unchunked).abs()
    print(f"|sglang - fp32 without chunks| past position {chunk}: "
          f"mean {gap[:, chunk:].mean():.4f}")
    assert gap[:, chunk:].mean() > 10 * MEAN_TOLERANCE
    assert gap[:, :chunk - 1].mean() < MEAN_TOLERANCE  # the first chunk is the same either way


def test_sigkill_of_the_server_process_ends_all_of_its_processes(served_demo_size):
    _, generator = served_demo_size
    server = generator.server
    children = psutil.Process(server.process.pid).children(recursive=True)
    names = {" ".join(p.cmdline()) for p in children}
    assert any("sglang::scheduler" in n for n in names), names
    assert any("multiprocessing.forkserver" in n for n in names), names  # fix 12's fallback is active
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait()
    alive = still_alive(children, timeout_s=60)
    assert not alive, [" ".join(p.cmdline()) for p in alive]
