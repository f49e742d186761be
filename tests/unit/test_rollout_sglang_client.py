"""The SGLang client pieces that need no SGLang: server-argument mapping, response parsing,
error messages, retries, dead-server detection, and the CPU stand-ins (platform/sglang_cpu.py)."""
import http.server
import json
import subprocess
import sys
import threading

import pytest
import torch

from megatron_rl.platform import sglang_cpu
from megatron_rl.rollout import (GeneratorDeadError, GeneratorError, SamplingParams,
                                 SGLangGenerator, SGLangServerSettings, logprob_mismatch)
from megatron_rl.rollout import sglang_server
from megatron_rl.rollout.sglang_server import SGLangServer, free_port, listen_port

pytestmark = pytest.mark.unit
URL = "http://127.0.0.1:30000"


def test_server_args_map_our_config_and_fp32_head_is_on_by_default(tmp_path):
    from megatron_rl.config import RolloutConfig

    rollout = RolloutConfig(tp_size=2, ep_size=2, dtype="bfloat16", mem_fraction_static=0.5,
                            thinking_budget_min=10, thinking_budget=20)
    settings = SGLangServerSettings.from_rollout_config(rollout, str(tmp_path), device="cpu")
    args = settings.server_args(port=1234)
    pairs = dict(zip(args, args[1:]))
    assert pairs["--tp-size"] == "2" and pairs["--ep-size"] == "2"
    assert pairs["--dtype"] == "bfloat16" and pairs["--mem-fraction-static"] == "0.5"
    assert pairs["--port"] == "1234" and pairs["--attention-backend"] == "torch_native"
    assert "--enable-fp32-lm-head" in args and "--skip-tokenizer-init" in args
    assert "--sleep-on-idle" in args  # an idle scheduler must not spin a core
    # rollout.continuations_first (default): priority scheduling, unprioritised requests at 0,
    # no preemption of a running request.
    assert "--enable-priority-scheduling" in args and "--disable-priority-preemption" in args
    assert pairs["--default-priority-value"] == "0"
    fcfs = SGLangServerSettings.from_rollout_config(
        RolloutConfig(continuations_first=False), str(tmp_path), device="cpu")
    assert "--enable-priority-scheduling" not in fcfs.server_args(port=1)
    off = SGLangServerSettings(model_path=str(tmp_path), enable_fp32_lm_head=False,
                               sleep_on_idle=False)
    assert "--enable-fp32-lm-head" not in off.server_args(port=1)
    assert "--sleep-on-idle" not in off.server_args(port=1)
    assert "--disable-hybrid-swa-memory" not in args
    # Chunked local attention (Llama-4, in text_config) on CPU: one KV pool (sglang_cpu fix 7).
    (tmp_path / "config.json").write_text('{"text_config": {"attention_chunk_size": 8192}}')
    chunked = SGLangServerSettings(model_path=str(tmp_path), device="cpu")
    assert "--disable-hybrid-swa-memory" in chunked.server_args(port=1)
    gpu = SGLangServerSettings(model_path=str(tmp_path), device="cuda")
    assert "--disable-hybrid-swa-memory" not in gpu.server_args(port=1)
    with pytest.raises(ValueError, match="ep_size must divide tp_size"):
        SGLangServerSettings(model_path=str(tmp_path), tp_size=2, ep_size=4)
    with pytest.raises(FileNotFoundError, match="config.json"):
        SGLangServerSettings(model_path=str(tmp_path / "missing"))


def test_the_api_key_is_never_shown_and_a_bad_one_is_named(tmp_path):
    from megatron_rl.cluster import GeneratorEndpoint

    key = "k3y-Of-this-run_only"
    settings = SGLangServerSettings(model_path=str(tmp_path), api_key=key)
    assert key not in repr(settings) and key not in " ".join(settings.server_args(port=1))
    endpoint = GeneratorEndpoint(name="g", url=URL, num_ranks=1, node_id="n", node_ip="ip",
                                 pid=1, started_at=0.0, log_path="log", api_key=key)
    assert key not in repr(endpoint) and key not in endpoint.describe()
    for bad in ("", "two words", "line\nbreak"):
        with pytest.raises(ValueError, match="api_key: a non-empty string without spaces"):
            SGLangServerSettings(model_path=str(tmp_path), api_key=bad)


def test_generation_result_from_sglang_payload():
    out = {"output_ids": [7, 8, 9], "meta_info": {
        "finish_reason": {"type": "length", "length": 3},
        "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None], [-2.0, 9, None]],
        "weight_versions": [{"version": "3", "start": 0, "end": 1},
                            {"version": "4", "start": 1, "end": 3}]}}
    result = sglang_server._generation_result(out, [1, 2], prompt_index=1, sample_index=0,
                                              url=URL)
    assert result.token_ids == (7, 8, 9) and result.logprobs == (-0.5, -1.25, -2.0)
    assert result.versions == (3, 4, 4) and result.finish_reason == "length"
    assert result.prompt_token_ids == (1, 2)
    out["meta_info"]["output_token_logprobs"][1][1] = 99
    with pytest.raises(GeneratorError, match="do not match"):
        sglang_server._generation_result(out, [1, 2], prompt_index=1, sample_index=0,
                                         url=URL)


def _payload(**meta):
    return {"output_ids": [7, 8, 9], "meta_info": {
        "finish_reason": {"type": "stop"},
        "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None], [-2.0, 9, None]], **meta}}


@pytest.mark.parametrize("meta, message", [
    # A server started without --weight-version labels everything "default": not version 0.
    ({"weight_versions": [{"version": "default", "start": 0, "end": 3}],
      "weight_version": "default"}, "reports weight version 'default'"),
    # No spans at all: not "every token is the final version".
    ({"weight_version": "5"}, "without per-token weight versions"),
    ({"weight_versions": []}, "without per-token weight versions"),
    # Spans that leave tokens unlabelled: not "version 0".
    ({"weight_versions": [{"version": "3", "start": 0, "end": 2}]}, r"tokens \[2\] of 3"),
])
def test_versions_are_never_guessed(meta, message):
    """Versions feed the staleness bound: a missing or non-integer label is an error naming the
    server, not a fallback to 0 or to the final version."""
    with pytest.raises(GeneratorError, match=f"SGLang server {URL}.*{message}"):
        sglang_server._generation_result(_payload(**meta), [1], prompt_index=0, sample_index=0,
                                         url=URL)
    empty = {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort"}}}
    assert sglang_server._generation_result(empty, [1], 0, 0, url=URL).versions == ()


def test_sampling_params_and_mismatch_metric():
    params = SamplingParams(max_new_tokens=4, temperature=0.7, stop_token_ids=(1,), seed=5)
    assert params.to_sglang() == {"max_new_tokens": 4, "temperature": 0.7, "top_p": 1.0,
                                  "top_k": -1, "ignore_eos": False, "stop_token_ids": [1],
                                  "sampling_seed": 5}
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(max_new_tokens=1, top_p=0.0)
    # mean(|-1 - -1.5|, |-2 - -2|, |-0.5 - 0.5|) = (0.5 + 0 + 1) / 3
    assert logprob_mismatch(torch.tensor([-1.0, -2.0, -0.5]),
                            torch.tensor([-1.5, -2.0, 0.5])) == pytest.approx(0.5)


@pytest.mark.parametrize("truncation, named", [
    ({"top_p": 0.9}, "top_p=0.9"), ({"top_k": 20}, "top_k=20"), ({"min_p": 0.05}, "min_p=0.05"),
    ({"temperature": 0.0}, "temperature=0"),
    ({"top_p": 0.95, "top_k": 1}, "top_p=0.95, top_k=1"),
])
def test_training_sampling_refuses_truncation_and_evaluation_allows_it(truncation, named):
    """SGLang records log-probs of the untruncated softmax(logits / T) (its sampler.py) while
    top-p / top-k / min-p / greedy sample from a truncated distribution: training rollouts would
    carry biased importance ratios, so they are refused with the reason; evaluation may cut."""
    with pytest.raises(ValueError, match=f"training rollouts cannot use {named}.*biased"):
        SamplingParams(max_new_tokens=4, **truncation)
    with pytest.raises(ValueError, match="purpose='eval'"):
        SamplingParams(max_new_tokens=4, purpose="train", **truncation)
    evaluation = SamplingParams(max_new_tokens=4, purpose="eval", **truncation).to_sglang()
    assert {key: evaluation[key] for key in truncation} == truncation
    assert "purpose" not in evaluation  # ours, not an SGLang sampling parameter


def test_training_sampling_at_a_temperature_is_accepted_and_bad_values_are_named():
    params = SamplingParams(max_new_tokens=4, temperature=0.7)
    assert params.purpose == "train"
    assert params.to_sglang()["temperature"] == 0.7 and "min_p" not in params.to_sglang()
    for bad, match in (({"purpose": "rollout"}, "purpose must be one of"),
                       ({"top_k": 0}, "top_k must be -1"), ({"min_p": 1.5}, "min_p must be")):
        with pytest.raises(ValueError, match=match):
            SamplingParams(max_new_tokens=4, **bad)


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.dumps({"success": False, "message": "weights are on fire"}).encode()
        self.send_response(400)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_errors_carry_the_server_message_and_dead_servers_are_named():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = SGLangGenerator(f"http://127.0.0.1:{server.server_address[1]}")
        with pytest.raises(GeneratorError, match="HTTP 400: weights are on fire"):
            client.begin_weight_update()
    finally:
        server.shutdown()
    dead = SGLangGenerator(f"http://127.0.0.1:{free_port()}", max_retries=2, backoff_s=0.01)
    with pytest.raises(GeneratorDeadError, match="after 3 attempt"):
        dead.abort()
    assert not dead.is_healthy()


def test_an_exited_server_process_is_reported_with_its_log(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, "-c",
                                    "print('ValueError: bad --model-path'); raise SystemExit(3)"],
                                   stdout=out, stderr=subprocess.STDOUT)
    server = SGLangServer(SGLangServerSettings(model_path=str(tmp_path)), process, free_port(),
                          str(log))
    with pytest.raises(GeneratorDeadError, match="exited with code 3(.|\n)*bad --model-path"):
        server.wait_until_healthy(timeout_s=30)
    client = SGLangGenerator(server.url, server=server)
    with pytest.raises(GeneratorDeadError, match="exited with code 3"):
        client.score([[1, 2]])


def test_cpu_stand_in_kernels_match_hand_computed_values():
    req_to_token = torch.zeros(3, 6, dtype=torch.int32)
    # request 0 -> pool row 2, slots [1, 3); request 1 -> pool row 0, slots [0, 3)
    sglang_cpu.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([1, 0]), torch.tensor([3, 3]),
        torch.tensor([10, 11, 20, 21, 22]), 6)
    assert req_to_token[2].tolist() == [0, 10, 11, 0, 0, 0]
    assert req_to_token[0].tolist() == [20, 21, 22, 0, 0, 0]
    k, v = torch.arange(12.0).reshape(4, 3), 100 + torch.arange(12.0).reshape(4, 3)
    pointers = torch.tensor([k.data_ptr(), v.data_ptr()])
    row_bytes = torch.tensor([3 * 4, 3 * 4])
    sglang_cpu.copy_all_layer_kv_cache_cpu(pointers, row_bytes, torch.tensor([0, 3]),
                                           torch.tensor([2, 1]))
    assert k[0].tolist() == [6.0, 7.0, 8.0] and k[3].tolist() == [3.0, 4.0, 5.0]
    assert v[0].tolist() == [106.0, 107.0, 108.0]


def test_native_moe_router_weight_on_input_wrapper():
    """Top-1 with the router weight on the input == expert(w * x) combined with weight 1."""
    import collections
    import dataclasses

    TopK = collections.namedtuple("TopK", "topk_weights topk_ids router_logits")

    @dataclasses.dataclass
    class Config:
        apply_router_weight_on_input: bool

    seen = {}

    def forward(layer, x, topk, config):
        seen.update(x=x, weights=topk.topk_weights, flag=config.apply_router_weight_on_input)
        return torch.tanh(x) * topk.topk_weights  # a non-linear "expert"

    wrapped = sglang_cpu._native_moe_with_input_weights(forward)
    x, w = torch.tensor([[1.0, -2.0], [0.5, 3.0]]), torch.tensor([[0.25], [2.0]])
    out = wrapped(None, x, TopK(w, torch.zeros(2, 1, dtype=torch.long), None), Config(True))
    assert torch.equal(out, torch.tanh(x * w)) and seen["flag"] is False
    assert torch.equal(seen["weights"], torch.ones(2, 1))
    with pytest.raises(NotImplementedError, match="top_k > 1"):
        wrapped(None, x, TopK(torch.ones(2, 2), None, None), Config(True))


def test_llama4_rope_is_written_back_into_the_qkv_views():
    """CPU fix 6: the rotary result lands in the q / k views of the fused qkv buffer, which is
    what SGLang's Llama-4 attention reads afterwards; NoPE layers (no rotary) are left alone."""
    import types

    def forward(positions, query, key):  # like forward_native: new tensors, inputs untouched
        return query * 10 + positions[:, None], -key

    class Attention:  # stand-in for sglang.srt.models.llama4.Llama4Attention
        def __init__(self, use_rope: bool):
            self.rotary_emb = types.SimpleNamespace(forward=forward) if use_rope else None

    sglang_cpu._patch_llama4_rope(types.SimpleNamespace(Llama4Attention=Attention))
    assert Attention(use_rope=False).rotary_emb is None
    qkv = torch.arange(12.0).reshape(2, 6)  # [tokens, q (2) | k (2) | v (2)]
    q, k = qkv[:, :4].split([2, 2], dim=-1)
    out_q, out_k = Attention(use_rope=True).rotary_emb.forward(torch.tensor([1, 2]), q, k)
    assert out_q is q and out_k is k
    assert qkv.tolist() == [[1.0, 11.0, -2.0, -3.0, 4.0, 5.0],
                            [62.0, 72.0, -8.0, -9.0, 10.0, 11.0]]


def test_chunked_attention_masks_and_torch_native_wrapper():
    """CPU fix 7: chunk-block causal masks (prefill from position 0, decode at an offset), used
    by the backend for chunked (use_irope) layers only and only for the call; a chunked model on
    the hybrid sliding-window KV pool is refused."""
    import types

    mask = sglang_cpu._chunked_causal_mask(q_len=5, kv_len=5, sliding_window_size=2,
                                           device="cpu")
    assert mask.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0],
                                   [0, 0, 1, 1, 0], [0, 0, 0, 0, 1]]
    decode = sglang_cpu._chunked_causal_mask(q_len=1, kv_len=6, sliding_window_size=4,
                                             device="cpu", query_offset=5)
    assert decode.int().tolist() == [[0, 0, 0, 0, 1, 1]]

    class Backend:  # stand-in for TorchNativeAttnBackend's dispatch on the layer's window
        use_sliding_window_kv_pool = False

        def __init__(self, model_runner):
            del model_runner

        @staticmethod
        def _make_sliding_window_mask(**kwargs):
            return "window"

        def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            if layer.sliding_window_size > -1:
                return self._make_sliding_window_mask(
                    q_len=3, kv_len=3, sliding_window_size=layer.sliding_window_size,
                    device="cpu")
            return "causal"

        forward_decode = forward_extend

    sglang_cpu._patch_torch_native_chunked_attention(
        types.SimpleNamespace(TorchNativeAttnBackend=Backend))
    backend = Backend(types.SimpleNamespace(attention_chunk_size=2))
    chunked = types.SimpleNamespace(use_irope=True, sliding_window_size=-1)
    full = types.SimpleNamespace(use_irope=False, sliding_window_size=-1)
    assert backend.forward_extend(None, None, None, chunked, None).int().tolist() == \
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    assert chunked.sliding_window_size == -1 and "_make_sliding_window_mask" not in vars(backend)
    assert backend.forward_decode(None, None, None, full, None) == "causal"
    unchunked_model = Backend(types.SimpleNamespace())  # no attention_chunk_size
    assert unchunked_model.forward_extend(None, None, None, chunked, None) == "causal"
    Backend.use_sliding_window_kv_pool = True
    with pytest.raises(RuntimeError, match="--disable-hybrid-swa-memory"):
        Backend(types.SimpleNamespace(attention_chunk_size=2))


def test_weight_update_receive_buffer_is_reused_on_cpu():
    """CPU fix 5: every received bucket is a view of one buffer, grown to the largest bucket;
    layouts (and errors) still come from SGLang's own `empty`; other devices are untouched."""
    import types

    calls = []

    def empty(names, dtypes, shapes, device):  # SGLang's FlattenedTensorBucket.empty contract
        calls.append(str(device))
        size = sum(torch.Size(s).numel() * getattr(torch, d).itemsize
                   for d, s in zip(dtypes, shapes))
        return types.SimpleNamespace(
            flattened_tensor=torch.empty(size, dtype=torch.uint8, device=device))

    reuse = sglang_cpu._reuse_receive_buffer(empty)
    first = reuse(["a", "b"], ["float32", "bfloat16"], [[2, 3], [4]], "cpu")
    second = reuse(["c"], ["float32"], [[3]], "cpu")
    assert first.flattened_tensor.numel() == 32 and second.flattened_tensor.numel() == 12
    assert first.flattened_tensor.device.type == "cpu"
    assert second.flattened_tensor.data_ptr() == first.flattened_tensor.data_ptr()
    bigger = reuse(["d"], ["float32"], [[100]], "cpu")  # grows once, then reused again
    again = reuse(["e"], ["float32"], [[50]], "cpu")
    assert bigger.flattened_tensor.numel() == 400
    assert again.flattened_tensor.data_ptr() == bigger.flattened_tensor.data_ptr()
    assert calls == ["meta"] * 4  # layout from SGLang's code, no memory of its own
    other = reuse(["f"], ["float32"], [[2]], "meta")  # not CPU: SGLang's allocation as is
    assert other.flattened_tensor.device.type == "meta" and calls[-1] == "meta"


def test_training_sampling_params_from_the_run_config():
    from megatron_rl.config import load_config

    rollout = load_config(None, ["rollout.temperature=0.7", "rollout.samples_per_prompt=4"]).rollout
    params = SamplingParams.for_training(rollout, max_new_tokens=32, seed=3)
    assert (params.temperature, params.top_p, params.num_samples, params.purpose) \
        == (0.7, 1.0, 4, "train")
    assert params.max_new_tokens == 32 and params.seed == 3


async def _stand_in_generate_server(generate):
    """An in-process aiohttp server answering POST /generate with `generate` -> (url, runner)."""
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    port = listen_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return f"http://127.0.0.1:{port}", runner


def test_async_client_activity_counts_the_union_of_requests_in_flight_and_their_tokens():
    """Busy time is wall time with at least one request in flight (two overlapping requests
    count once), tokens are what came back. The server is an in-process aiohttp stand-in that
    answers /generate after a delay (bookkeeping only; the live path is in tests/integration)."""
    import asyncio
    import time

    from aiohttp import web

    from megatron_rl.rollout.async_client import AsyncSGLangClient

    async def generate(request):
        body = await request.json()
        await asyncio.sleep(body["sampling_params"]["max_new_tokens"] / 10)
        n = body["sampling_params"]["max_new_tokens"]
        # The prefix-cache hit (SGLang's meta_info["cached_tokens"]) on one of the requests.
        cached = {"cached_tokens": 1} if n == 3 else {}
        return web.json_response({"output_ids": list(range(n)), "meta_info": {
            "finish_reason": {"type": "length", "length": n},
            "output_token_logprobs": [[-0.5, t, None] for t in range(n)],
            "weight_versions": [{"version": "0", "start": 0, "end": n}], **cached}})

    async def scenario():
        url, runner = await _stand_in_generate_server(generate)
        client = AsyncSGLangClient(url)
        params = SamplingParams(max_new_tokens=1, purpose="eval")
        try:
            start = client.activity()
            assert (start.busy_s, start.tokens, start.requests) == (0.0, 0, 0)
            began = time.perf_counter()
            results = await asyncio.gather(client.generate_one([1], 3, params),
                                           client.generate_one([1], 2, params))
            overlapped = time.perf_counter() - began
            assert [r.cached_tokens for r in results] == [1, None]
            await asyncio.sleep(0.3)  # idle: not busy
            between = client.activity() - start
            await client.generate_one([1], 1, params)
            return between, client.activity() - start, overlapped
        finally:
            await client.close()
            await runner.cleanup()

    between, total, overlapped = asyncio.run(scenario())
    assert between.tokens == 5 and between.requests == 2
    # Busy covers the longer request (0.3 s of server delay) and no more than the wall time of
    # the overlapping pair (the sum of the two, 0.5 s, would mean they were counted twice).
    assert 0.3 <= between.busy_s <= overlapped
    assert total.tokens == 6 and total.requests == 3
    assert total.busy_s >= between.busy_s + 0.1


def test_async_client_resends_after_a_broken_connection_and_names_a_dead_server():
    """An HTTP server closes idle keep-alive connections (uvicorn after 5 s); a request written
    to one at that moment fails although the server is fine. The stand-in (in-process aiohttp,
    bookkeeping only) drops the connection of the first two requests without answering: the
    client resends and returns the third answer; a server that never answers is named dead after
    its retries."""
    import asyncio

    from aiohttp import web

    from megatron_rl.rollout.async_client import AsyncSGLangClient

    calls = []

    async def generate(request):
        calls.append(await request.json())
        if len(calls) <= 2:
            request.transport.close()  # the connection breaks before a response
            await asyncio.sleep(0.1)
        return web.json_response({"output_ids": [7], "meta_info": {
            "finish_reason": {"type": "length", "length": 1},
            "output_token_logprobs": [[-0.5, 7, None]],
            "weight_versions": [{"version": "2", "start": 0, "end": 1}]}})

    async def scenario():
        url, runner = await _stand_in_generate_server(generate)
        params = SamplingParams(max_new_tokens=1, purpose="eval")
        try:
            async with AsyncSGLangClient(url, backoff_s=0.01) as client:
                result = await client.generate_one([1, 2], 1, params)
                return result, client.reconnects, client.activity()
        finally:
            await runner.cleanup()

    result, reconnects, activity = asyncio.run(scenario())
    assert result.token_ids == (7,) and result.versions == (2,)
    assert reconnects == 2 and len(calls) == 3 and activity.requests == 1

    async def dead():
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        async with AsyncSGLangClient(url, connection_retries=2, backoff_s=0.01) as client:
            try:
                await client.generate_one([1], 1, SamplingParams(max_new_tokens=1))
            finally:
                assert client.reconnects == 2

    with pytest.raises(GeneratorDeadError, match=r"does not answer /generate \(after 3 attempts"):
        asyncio.run(dead())


def test_only_the_served_architectures_model_module_is_imported(tmp_path):
    """SGLang's registry imports all of sglang.srt.models in every scheduler process; for our
    families' architectures the launcher names the others in SGLANG_DISABLED_MODEL_ARCHS (the
    module of each architecture is the one whose EntryClass lists it); any other model, or a
    folder without a config, imports everything."""
    import ast
    import importlib.util
    import json
    from pathlib import Path

    from megatron_rl.rollout.sglang_server import _MODEL_MODULES, unused_model_modules

    models = Path(next(iter(importlib.util.find_spec("sglang").submodule_search_locations)),
                  "srt", "models")
    for architecture, module in _MODEL_MODULES.items():
        tree = ast.parse((models / f"{module}.py").read_text())
        entry = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                     and any(getattr(t, "id", None) == "EntryClass" for t in node.targets))
        assert architecture in ast.unparse(entry), (architecture, module)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"]}))
    unused = unused_model_modules(str(tmp_path))
    assert "qwen3_moe" not in unused and {"llama", "qwen2_moe", "deepseek_v2"} <= set(unused)
    assert len(unused) == len(list(models.glob("*.py"))) - 1
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MistralForCausalLM"]}))
    assert unused_model_modules(str(tmp_path)) is None
    assert unused_model_modules(str(tmp_path / "missing")) is None


def test_a_port_a_server_binds_later_is_below_the_ephemeral_range():
    """listen_port: an SGLang server's port (and a TCPStore's) is picked below the range the
    kernel gives outgoing connections, which could take a port picked by binding port 0 before
    the server binds it (the suite saw an engine fail on "[Errno 98] address already in use")."""
    from megatron_rl.rollout.sglang_server import _ephemeral_port_floor

    floor = _ephemeral_port_floor()
    ports = {listen_port() for _ in range(20)}
    assert all(20000 <= port < floor for port in ports), (ports, floor)
    import socket

    for port in ports:  # free when picked
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_the_engine_not_the_client_holds_the_queue():
    """300 requests in flight at one engine (three times the 100 connections the client once
    capped each engine at) all reach it at once, and a continuation (SGLang priority 1,
    rollout.continuations_first) sent after them reaches it while they are all still open, not
    queued behind them in the client. The server is an in-process aiohttp stand-in for SGLang's
    HTTP API (POST /generate): it records the order in which requests arrive and holds each open
    until released (scheduling only; priority ordering inside SGLang is its own)."""
    import asyncio

    from aiohttp import web

    from megatron_rl.rollout.async_client import AsyncSGLangClient

    num_fresh = 300

    async def scenario():
        arrivals = []  # each request's priority, in arrival order
        held = {"now": 0}  # requests the server holds open
        release = asyncio.Event()
        arrived = {num_fresh: asyncio.Event(), num_fresh + 1: asyncio.Event()}

        async def generate(request):
            arrivals.append((await request.json()).get("priority"))
            held["now"] += 1
            if len(arrivals) in arrived:
                arrived[len(arrivals)].set()
            await release.wait()
            held["now"] -= 1
            return web.json_response({"output_ids": [7], "meta_info": {
                "finish_reason": {"type": "length", "length": 1},
                "output_token_logprobs": [[-0.5, 7, None]],
                "weight_versions": [{"version": "0", "start": 0, "end": 1}]}})

        app = web.Application()
        app.router.add_post("/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        port = listen_port()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        params = SamplingParams(max_new_tokens=1, purpose="eval")
        try:
            async with AsyncSGLangClient(f"http://127.0.0.1:{port}") as client:
                fresh = [asyncio.ensure_future(client.generate_one([1], 1, params))
                         for _ in range(num_fresh)]
                try:
                    await asyncio.wait_for(arrived[num_fresh].wait(), timeout=30)
                except TimeoutError:
                    pytest.fail(f"only {len(arrivals)} of {num_fresh} requests reached the "
                                "engine: the others wait in the client")
                at_once = held["now"]
                continuation = asyncio.ensure_future(
                    client.generate_one([1, 9], 1, params, priority=1))
                await asyncio.wait_for(arrived[num_fresh + 1].wait(), timeout=30)
                with_continuation = held["now"]
                release.set()
                results = await asyncio.gather(*fresh, continuation)
                return arrivals, at_once, with_continuation, results
        finally:
            release.set()  # a failed check leaves no request held through the cleanup
            await runner.cleanup()

    arrivals, at_once, with_continuation, results = asyncio.run(scenario())
    assert at_once == num_fresh  # the engine holds every fresh request at once
    # The continuation reached the engine while all of them were still there.
    assert with_continuation == num_fresh + 1
    assert arrivals == [None] * num_fresh + [1] and len(results) == num_fresh + 1


def test_the_open_file_limit_covers_the_requests_in_flight_or_the_error_names_it():
    """reserve_open_files raises the soft RLIMIT_NOFILE to the requests in flight plus
    RESERVED_OPEN_FILES (an unprivileged process may, up to the hard limit), and a hard limit
    too low is an error naming the fix; a request that meets the limit anyway is a
    GeneratorError naming it, not a dead engine (which would be taken out of the rotation).
    In a child process: its limits are lowered there."""
    script = """
import asyncio, os, resource
import aiohttp  # imported before the limit leaves no file to read it from
from megatron_rl.rollout.async_client import (RESERVED_OPEN_FILES, AsyncSGLangClient,
                                              reserve_open_files)
from megatron_rl.rollout import GeneratorDeadError, GeneratorError, SamplingParams

resource.setrlimit(resource.RLIMIT_NOFILE, (RESERVED_OPEN_FILES + 10, 3000))
assert reserve_open_files(5) == RESERVED_OPEN_FILES + 10  # enough already: unchanged
assert reserve_open_files(1500) == RESERVED_OPEN_FILES + 1500
assert resource.getrlimit(resource.RLIMIT_NOFILE) == (RESERVED_OPEN_FILES + 1500, 3000)
assert reserve_open_files(1500, sandbox_files=64) == RESERVED_OPEN_FILES + 1564
try:
    reserve_open_files(5000)
except RuntimeError as error:
    print("LIMIT", error)
try:
    reserve_open_files(1000, sandbox_files=2000)
except RuntimeError as error:
    print("SANDBOX", error)

async def no_file_left():
    client = AsyncSGLangClient("http://127.0.0.1:9", connection_retries=3, backoff_s=0.01)
    open_files = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, 3000))  # no socket left
    try:
        await client.generate_one([1], 1, SamplingParams(max_new_tokens=1))
    except GeneratorDeadError as error:
        print("DEAD", error)
    except GeneratorError as error:
        print("EMFILE", client.reconnects, error)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (open_files + 100, 3000))
        await client.close()

asyncio.run(no_file_left())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    assert "up to 5000 generation requests may be in flight" in lines["LIMIT"]
    assert "at most 3000 files (hard RLIMIT_NOFILE)" in lines["LIMIT"]
    assert "one socket each, the code sandbox's programs up to 2000 pipe ends, but this " \
        "process may open at most 3000 files" in lines["SANDBOX"]
    from megatron_rl.rollout.async_client import RESERVED_OPEN_FILES
    assert f"at least {RESERVED_OPEN_FILES + 3000}" in lines["SANDBOX"]
    assert "raise it to at least" in lines["LIMIT"] and "ulimit -Hn" in lines["LIMIT"]
    assert "DEAD" not in lines
    assert lines["EMFILE"].startswith("0 no socket for a request to http://127.0.0.1:9")
    assert "RLIMIT_NOFILE" in lines["EMFILE"]


def test_a_run_reserves_a_socket_for_every_request_it_can_have_in_flight(monkeypatch):
    """ScaleRL's defaults: (k + 1) x 48 groups x 16 training requests (k = 8) and a
    validation's 1000 x 16 requests may all be in flight at once, one socket each; and the
    code sandbox's pipes with all its workers busy (3 here: 3 x 8 pipes)."""
    import types

    from megatron_rl.config import load_config
    from megatron_rl.rewards.sandbox import Sandbox, SandboxConfig
    from megatron_rl.rollout import async_client
    from megatron_rl.run_setup import RunSetup

    reserved = []
    monkeypatch.setattr(async_client, "reserve_open_files",
                        lambda requests, **files: reserved.append((requests, files)))
    run = RunSetup(load_config(None, []))
    run.data = types.SimpleNamespace(heldout_records=[None] * 1000)
    run.sandbox = Sandbox(SandboxConfig(num_workers=3))  # its server starts at a first run
    run._reserve_open_files()
    assert reserved == [(9 * 48 * 16 + 1000 * 16, {"sandbox_files": 3 * 8 * 2})]
