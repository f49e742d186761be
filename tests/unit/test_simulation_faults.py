"""The `--faults` grammar of simulation/faults.py (FaultPlan.parse) and its seeded random mode;
what a plan does to a running cluster is tests/scale/test_scale_faults.py's."""
from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest

from megatron_rl.simulation.faults import Fault, FaultPlan, When

pytestmark = pytest.mark.unit


def test_every_kind_of_fault_and_moment_parses():
    plan = FaultPlan.parse("kill=4@300s,hang=2@step2,slow=8x3@10min,node=1@step1+20s,"
                           "trainer-node@step3,trainer-node=1@1.5h,seed=7")
    assert plan.faults == [
        Fault("kill", When(model_s=300.0), count=4),
        Fault("hang", When(step=2), count=2),
        Fault("slow", When(model_s=600.0), count=8, factor=3.0),
        Fault("node", When(step=1, delay_s=20.0), node=1),
        Fault("trainer-node", When(step=3), node=0),
        Fault("trainer-node", When(model_s=5400.0), node=1)]
    assert plan.seed == 7 and plan.random is None
    assert [str(f.when) for f in plan.faults] == ["300s", "step2", "600s", "step1+20s",
                                                  "step3", "5400s"]


def test_the_random_mode_parses_rates_factor_and_window():
    plan = FaultPlan.parse("random=die:0.5+hang:0.2+slow:0.3x2.5@step1..40min")
    assert plan.random.rates == {"die": 0.5, "hang": 0.2, "slow": 0.3}
    assert plan.random.slow_factor == 2.5
    assert plan.random.start == When(step=1) and plan.random.end == When(model_s=2400.0)
    whole_run = FaultPlan.parse("random=die:1").random
    assert whole_run.start == When(model_s=0.0) and whole_run.end is None
    assert whole_run.slow_factor == 4.0


@pytest.mark.parametrize("spec, names", [
    ("", "no fault given"),
    ("kill=4", "no moment"),
    ("kill=0@1s", "'0' is not a count"),
    ("kill=x@1s", "'x' is not a count"),
    ("hang=2@soon", "'soon' is not a moment"),
    ("hang=2@5m", "'5m' is not a moment"),  # minutes are min: m would read as metres
    ("slow=8@600s", "slow=NxF"),
    ("slow=8x0@600s", "factor '0' is not a number > 0"),
    ("node=@step1", "needs the generator node's number"),
    ("melt=1@1s", "unknown fault 'melt'"),
    ("kill=1@1s,,hang=1@2s", "an empty item"),
    ("kill=1@1s,", "an empty item"),
    ("seed=x", "seed 'x' is not a whole number"),
    ("random=die:a", "rate 'a' is not a number"),
    ("random=burn:1", "'burn:1' is not a rate"),
    ("random=die:1+die:2", "die given twice"),
    ("random=die:0", "every rate is 0"),
    ("random=die:1@step1..", "a window needs its end"),
    ("random=die:1,random=hang:1", "random given twice"),
])
def test_a_bad_spec_names_the_bad_part_and_the_grammar(spec, names):
    with pytest.raises(ValueError) as raised:
        FaultPlan.parse(spec)
    message = str(raised.value)
    assert message.startswith("--faults: ") and names in message
    assert "Grammar: kill=N@WHEN" in message


def test_random_draws_are_a_seeded_poisson_process_at_the_stated_rates():
    plan = FaultPlan.parse("random=die:0.5+hang:0.2+slow:0.3,seed=7")
    draws = list(itertools.islice(plan.random_draws(64), 4000))
    assert draws == list(itertools.islice(FaultPlan.parse(
        "random=die:0.5+hang:0.2+slow:0.3,seed=7").random_draws(64), 4000))  # same seed
    assert draws != list(itertools.islice(FaultPlan.parse(
        "random=die:0.5+hang:0.2+slow:0.3,seed=8").random_draws(64), 4000))
    times = [t for t, _ in draws]
    assert times == sorted(times)
    # 1 fault per engine-hour over 64 engines: one every 3600 / 64 = 56.25 model s on average
    # (4000 draws: the sample mean is within 5 % with overwhelming probability, and the seed
    # fixes it anyway).
    assert times[-1] / len(times) == pytest.approx(3600 / 64, rel=0.05)
    kinds = Counter(kind for _, kind in draws)
    for kind, rate in (("die", 0.5), ("hang", 0.2), ("slow", 0.3)):
        assert kinds[kind] / len(draws) == pytest.approx(rate, abs=0.03)
    assert math.isfinite(times[0]) and times[0] > 0


def test_model_time_needs_an_installed_plan():
    with pytest.raises(RuntimeError, match="not installed"):
        FaultPlan.parse("kill=1@1s").model_time(0.0)
