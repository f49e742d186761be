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
from megatron_rl.rollout.sglang_server import SGLangServer, free_port

pytestmark = pytest.mark.unit


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
    off = SGLangServerSettings(model_path=str(tmp_path), enable_fp32_lm_head=False)
    assert "--enable-fp32-lm-head" not in off.server_args(port=1)
    with pytest.raises(ValueError, match="ep_size must divide tp_size"):
        SGLangServerSettings(model_path=str(tmp_path), tp_size=2, ep_size=4)
    with pytest.raises(FileNotFoundError, match="config.json"):
        SGLangServerSettings(model_path=str(tmp_path / "missing"))


def test_generation_result_from_sglang_payload():
    out = {"output_ids": [7, 8, 9], "meta_info": {
        "finish_reason": {"type": "length", "length": 3},
        "output_token_logprobs": [[-0.5, 7, None], [-1.25, 8, None], [-2.0, 9, None]],
        "weight_versions": [{"version": "3", "start": 0, "end": 1},
                            {"version": "4", "start": 1, "end": 3}]}}
    result = sglang_server._generation_result(out, [1, 2], prompt_index=1, sample_index=0)
    assert result.token_ids == (7, 8, 9) and result.logprobs == (-0.5, -1.25, -2.0)
    assert result.versions == (3, 4, 4) and result.finish_reason == "length"
    assert result.prompt_token_ids == (1, 2)
    out["meta_info"]["output_token_logprobs"][1][1] = 99
    with pytest.raises(GeneratorError, match="do not match"):
        sglang_server._generation_result(out, [1, 2], prompt_index=1, sample_index=0)


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
