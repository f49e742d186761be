"""A step window's generator figures when an engine restarts inside it (docs/pipeline.md,
utilisation): the restarted engine's new client counts from zero, so its counters are its whole
window's, never the difference with the old client's (which made the chaos e2e's
perf/generation_tokens_per_s negative when both engines restarted in one window). The engine
clients are stand-ins holding counters; RunMetrics and activity_since are the real ones."""
import pytest

from megatron_rl.rollout.async_client import GeneratorActivity, activities, activity_since

pytestmark = pytest.mark.unit


class _Client:
    reconnects = 0

    def __init__(self, busy_s: float, tokens: int):
        self.counters = GeneratorActivity(busy_s, tokens, 0)

    def activity(self):
        return self.counters


def test_a_client_replaced_in_the_window_counts_from_zero():
    old, steady = _Client(50.0, 5000), _Client(40.0, 4000)
    clients = [old, steady]
    before = activities(clients)
    steady.counters = GeneratorActivity(45.0, 4600, 0)  # +5 s, +600 tokens
    clients[0] = _Client(2.0, 300)  # engine 0 restarted: a new client, 300 tokens so far
    window = activity_since(activities(clients), before)
    assert [(w.busy_s, w.tokens) for w in window] == [(2.0, 300), (5.0, 600)]


def test_the_step_metrics_stay_true_when_every_engine_restarts_in_a_window(tmp_path,
                                                                             monkeypatch):
    from megatron_rl import metrics as metrics_module
    from megatron_rl.config import load_config
    from megatron_rl.metrics import RunMetrics

    now = [100.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: now[0])
    clients = [_Client(30.0, 3000), _Client(20.0, 2000)]
    cfg = load_config(None, [f"output_dir={tmp_path}", "rollout.num_generators=2",
                             "logging.progress_bar=false"])
    metrics = RunMetrics(cfg, tmp_path, clients=clients, num_devices=3)
    metrics.open_logs(purge_after=None)
    metrics.progress(range(cfg.train.num_steps))
    now[0] = 110.0
    clients[0], clients[1] = _Client(4.0, 400), _Client(6.0, 600)  # both restarted
    window = metrics._window_metrics({})
    metrics.close()
    assert window["perf/generation_tokens_per_s"] == pytest.approx(1000 / 10.0)
    assert window["perf/generator_busy_fraction"] == pytest.approx(10.0 / (10.0 * 2))
