"""Issue 39.2 (Blackwell): SGLang 0.5.23's own argument resolution of a GPU engine of a tiny
Llama-4 on torch_native. Its model step (`handle_model_specific_adjustments`) refuses torch_native
for Llama-4 off CPU; with megatron_rl's chunked-attention fix applied (as every engine process
does, megatron_rl.rollout.sglang_launch) it accepts it, and torch_native stays the backend the
later steps see. SGLang's step runs for real on a real ServerArgs and ModelConfig built from the
registry's tiny Llama-4 config; no GPU is needed, since the step only reads the arguments and the
config. A subprocess: the CPU stand-ins SGLang's imports need here must not enter the pytest
process."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, sys
from megatron_rl.platform.sglang_cpu import apply_sglang_cpu_fixes
apply_sglang_cpu_fixes()  # CPU stand-ins for SGLang's imports (and the chunked-attention fix)
from models import get_model_family
model_dir = sys.argv[1]
text = dict(get_model_family("llama4").hf_config("demo"))
text.pop("architectures", None)
with open(f"{model_dir}/config.json", "w") as f:
    json.dump({"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
               "text_config": text, "vision_config": {"model_type": "llama4_vision_model"}}, f)
from sglang.srt.arg_groups import model_hook
from sglang.srt.arg_groups.model_override_base import model_config_of, resolved_view
from sglang.srt.arg_groups.resolution_hooks import run_hook
from sglang.srt.server_args import ServerArgs


def record():
    args = ServerArgs(model_path=model_dir, device="cuda", attention_backend="torch_native",
                      disable_hybrid_swa_memory=True)
    args._resolved_overrides = []  # as the resolution pipeline starts it
    return args


out = {}
try:
    model_hook.handle_model_specific_adjustments(record())  # SGLang's step alone
    out["unpatched"] = "accepted"
except AssertionError as exc:
    out["unpatched"] = str(exc)
patched = record()
run_hook(model_hook.handle_model_specific_adjustments, patched)  # with the registered fix
out["patched_backend"] = resolved_view(patched).attention_backend
out["chunk"] = model_config_of(patched).attention_chunk_size
out["sources"] = [source for source, _ in patched._resolved_overrides]
print(json.dumps(out))
'''


def test_sglang_resolves_a_torch_native_llama4_gpu_engine_once_patched(tmp_path):
    from models import get_model_family

    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "required for Llama4 model but got torch_native" in out["unpatched"]
    assert out["chunk"] == get_model_family("llama4").hf_config("demo")["attention_chunk_size"]
    assert out["patched_backend"] == "torch_native"
    assert "megatron_rl.platform.sglang_chunked_attention" not in out["sources"]

