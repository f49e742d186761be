"""The tiny SGLang CPU servers the integration tests share, one per configuration per session.

Starting a server costs ~30 s on 2 cores, so the fp32 tiny Llama-3-style server (and the fp32 tiny
Qwen3-MoE one) is launched once, on first use, and handed to each test as if just launched
(`SharedServer.fresh`): not paused, no request running, its own weights reloaded from its model
folder at weight version 0, the prefix cache flushed. Tests that sync weights into it
(test_sglang_weight_sync.py, test_sglang_inflight.py) therefore cannot change what a later test
sees, whatever the order. The reset is checked: after it the server's log-probs of fixed sequences
must equal those it gave right after launch, bit for bit; a server that cannot be reset (it died,
or a test left it wedged) is relaunched, with a warning.

Each server runs with an API key of its own (SGLangServerSettings.api_key, as a run's engines do),
so every test against it also checks that its clients send the key: the clients made from the
server pass it on (`SGLangGenerator(server=...)`), others take `server.settings.api_key` (worker
scripts get it in their environment: _workers.ENGINE_KEY_ENV).

A test asks for `llama_generator` / `qwen3_moe_generator` (a fresh client of the reset server); a
module-scoped fixture calls `tiny_llama_server.fresh()` itself. The modules sharing a server run
back to back (collection order otherwise kept) and the server is shut down after its last test:
test_sandbox_hostile.py requires this process to have no other child processes.
"""
from __future__ import annotations

import secrets
import sys
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # _hf_families, _workers

# Scored after launch and after every reset; ids below the tiny vocabulary of 320.
PROBE_SEQUENCES = [[5, 17, 42, 99, 7, 250, 3, 64, 128, 11], [200, 4, 4, 31, 77, 150, 9, 18]]
SERVER_FIXTURES = ("tiny_llama_server", "tiny_qwen3_moe_server")

_started: dict[str, "SharedServer"] = {}  # fixture name -> its server, while the fixture lives
_last_user: dict[str, str] = {}  # fixture name -> node id of the last test that uses it


class SharedServer:
    """One fp32 SGLang CPU server of a tiny model, reused by every test that asks for it."""

    def __init__(self, save_model, directory: Path):
        self._save_model = save_model
        self._directory = directory
        self.server = None  # SGLangServer while launched
        self._launch_scores = None  # log-probs of PROBE_SEQUENCES right after launch

    def fresh(self):
        """An SGLangGenerator client of the server in its launch state (launched on first use)."""
        if self.server is not None:
            problem = self._reset()
            if problem is not None:
                warnings.warn(f"relaunching the shared SGLang server {self.server.url}: "
                              f"{problem}", stacklevel=2)
                self.close()
        if self.server is None:
            self._launch()
        return self._client()

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None

    def _client(self):
        from megatron_rl.rollout import SGLangGenerator

        return SGLangGenerator(self.server.url, server=self.server,
                               request_timeout_s=self.server.settings.request_timeout_s)

    def _launch(self) -> None:
        from megatron_rl.rollout import SGLangServer, SGLangServerSettings

        model_dir = self._directory / "model"
        if not model_dir.exists():
            self._save_model(model_dir)
        self.server = SGLangServer.launch(SGLangServerSettings(
            # 0.001 leaves SGLang's memory profile no room: the server starts only through
            # platform/sglang_cpu.py fix 11 (the KV cache is max_total_tokens).
            model_path=str(model_dir), dtype="float32", mem_fraction_static=0.001,
            max_total_tokens=8192, startup_timeout_s=300, request_timeout_s=240,
            log_path=str(self._directory / "server.log"), api_key=secrets.token_urlsafe(16)))
        self._launch_scores = self._client().score(PROBE_SEQUENCES)

    def _reset(self) -> str | None:
        """Back to the launch state; what went wrong, or None."""
        import torch

        from megatron_rl.rollout import GeneratorError

        client = self._client()
        try:
            client.resume()  # a test that failed mid-update may have left it paused
            client.abort()  # ... or requests running
            # Also labels the weights version 0 and flushes the prefix cache.
            client.update_weights_from_disk(self.server.settings.model_path, version=0)
            scores = client.score(PROBE_SEQUENCES)
        except GeneratorError as exc:
            return f"{type(exc).__name__}: {exc}"
        if client.server_weight_version() != "0":
            return f"weight version {client.server_weight_version()!r} after the reset, not '0'"
        if not all(torch.equal(a, b) for a, b in zip(scores, self._launch_scores)):
            return "the reloaded weights' log-probs differ from those right after launch"
        return None


def _shared_server(name: str, save_model, tmp_path_factory):
    server = _started[name] = SharedServer(save_model, tmp_path_factory.mktemp(name))
    try:
        yield server
    finally:
        server.close()
        del _started[name]


@pytest.fixture(scope="session")
def tiny_llama_server(tmp_path_factory):
    """The tiny Llama-3-style server (_hf_families.save_tiny_llama, fp32)."""
    from _hf_families import save_tiny_llama

    yield from _shared_server("tiny_llama_server", save_tiny_llama, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_qwen3_moe_server(tmp_path_factory):
    """The tiny Qwen3-MoE server (_hf_families.save_tiny_qwen3_moe, fp32)."""
    from _hf_families import save_tiny_qwen3_moe

    yield from _shared_server("tiny_qwen3_moe_server", save_tiny_qwen3_moe, tmp_path_factory)


@pytest.fixture
def llama_generator(tiny_llama_server):
    return tiny_llama_server.fresh()


@pytest.fixture
def qwen3_moe_generator(tiny_qwen3_moe_server):
    return tiny_qwen3_moe_server.fresh()


def _servers_of(items) -> set[str]:
    return {name for item in items for name in SERVER_FIXTURES if name in item.fixturenames}


def pytest_collection_modifyitems(items):
    """Modules sharing a server run back to back: each module whole, pulled forward to the
    first module it shares a server with; tests outside this folder keep their places."""
    positions = [i for i, item in enumerate(items) if HERE in item.path.parents]
    modules: dict[Path, list] = {}
    for i in positions:
        modules.setdefault(items[i].path, []).append(items[i])
    servers = {path: _servers_of(module_items) for path, module_items in modules.items()}
    order: list[Path] = []
    for path in modules:
        if path in order:
            continue
        order.append(path)
        group = set(servers[path])
        while joining := [other for other in modules
                          if other not in order and servers[other] & group]:
            order.append(joining[0])
            group |= servers[joining[0]]
    reordered = [item for path in order for item in modules[path]]
    for i, item in zip(positions, reordered):
        items[i] = item


def pytest_collection_finish(session):
    _last_user.clear()
    for item in session.items:
        for name in _servers_of([item]):
            _last_user[name] = item.nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """Shut a shared server down after its last test, not at the end of the session."""
    try:
        return (yield)
    finally:
        for name, last in _last_user.items():
            if last == item.nodeid and name in _started:
                _started[name].close()
