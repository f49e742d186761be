"""Fault plans for the simulated cluster (`megatron-rl simulate RECIPE --faults SPEC`): which
engines die, hang or slow down, which node is lost, and when, on the cluster's model clock or at
the driver's optimizer steps. The faults act on the simulated cluster only (SimulatedEngine's
kill / hang / slow_down, SimulatedCluster.lose_node); detecting and recovering from them is the
real control plane's work (GeneratorHealth, the rollout manager, the driver).

Grammar (items separated by commas, no spaces):

    kill=N@WHEN          N engines die (port closed, requests lost)
    hang=N@WHEN          N engines stop answering anything, /health included
    slow=NxF@WHEN        N engines take F times as long for every step and transfer, from then on
    node=I@WHEN          generator node I is lost: its engines die together (nodes hold
                         engines_per_node engines: generator j is on node j // engines_per_node)
    trainer-node[=I]@WHEN  trainer node I (default 0) is lost: the run stops (NodeLost, exit 75)
    random=RATE[+RATE...][@WHEN[..WHEN]]
                         faults drawn at random (a Poisson process per engine) while the window
                         is open (default: the whole run); RATE is die:R, hang:R or slow:RxF,
                         R faults per engine-hour of model time
    seed=S               the seed of the choice of engines and of the random faults (default 0)

    WHEN := T UNIT       model time since the cluster started; UNIT s, min or h (e.g. 300s)
          | stepN[+T UNIT]   once the trainer has taken N optimizer steps, plus a delay

e.g. `kill=4@300s,hang=2@step2,slow=8x3@600s,node=1@step1+20s,trainer-node@step3,
random=die:0.5+hang:0.2+slow:0.3x4@step1..step5,seed=7`. The N engines of kill / hang / slow
are drawn (seeded) from those serving and answering at the moment, not slowed already.

`FaultPlan.parse(spec)` -> plan; `plan.install(cluster)` (SimulatedBackend's on_start) starts a
daemon thread that injects the faults as their moments come; `plan.record()` says what was
injected (model time, step, kind, targets) for the run's JSON report.
"""
from __future__ import annotations

import dataclasses
import math
import random
import re
import threading
import time

GRAMMAR = ("kill=N@WHEN, hang=N@WHEN, slow=NxF@WHEN, node=I@WHEN, trainer-node[=I]@WHEN, "
           "random=die:R+hang:R+slow:RxF[@WHEN[..WHEN]] (R per engine-hour), seed=S; "
           "WHEN = T{s,min,h} of model time or stepN[+T{s,min,h}]; items separated by commas, "
           "e.g. kill=4@300s,hang=2@step2,slow=8x3@600s,node=1@step1+20s")
_UNITS = {"s": 1.0, "min": 60.0, "h": 3600.0}
_NUMBER = r"\d+(?:\.\d*)?|\.\d+"
_DURATION = re.compile(rf"^({_NUMBER})(s|min|h)$")
_STEP = re.compile(r"^step(\d+)(?:\+(.+))?$")
POLL_S = 0.02  # wall seconds between the fault thread's looks at the clock and the step count


def _fail(part: str, why: str) -> ValueError:
    return ValueError(f"--faults: {part!r}: {why}. Grammar: {GRAMMAR}")


@dataclasses.dataclass(frozen=True, slots=True)
class When:
    """A moment: `model_s` of model time since the start, or `delay_s` after the trainer's
    `step`-th optimizer step."""

    model_s: float | None = None
    step: int | None = None
    delay_s: float = 0.0

    @classmethod
    def parse(cls, text: str, part: str) -> "When":
        if match := _STEP.match(text):
            delay = _seconds(match[2], part) if match[2] is not None else 0.0
            return cls(step=int(match[1]), delay_s=delay)
        return cls(model_s=_seconds(text, part))

    def __str__(self) -> str:
        if self.step is None:
            return f"{self.model_s:g}s"
        return f"step{self.step}" + (f"+{self.delay_s:g}s" if self.delay_s else "")


def _seconds(text: str, part: str) -> float:
    match = _DURATION.match(text)
    if not match:
        raise _fail(part, f"{text!r} is not a moment (a model time such as 300s, 5min, 1.5h, "
                          "or stepN[+delay])")
    return float(match[1]) * _UNITS[match[2]]


def _count(text: str, part: str, what: str) -> int:
    if not text.isdigit() or int(text) < (0 if what == "node" else 1):
        raise _fail(part, f"{text!r} is not a {what} (a whole number"
                          f"{'' if what == 'node' else ' >= 1'})")
    return int(text)


def _factor(text: str, part: str) -> float:
    if not re.fullmatch(_NUMBER, text) or float(text) <= 0:
        raise _fail(part, f"slow-down factor {text!r} is not a number > 0")
    return float(text)


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    """One planned fault: `kind` kill | hang | slow | node | trainer-node."""

    kind: str
    when: When
    count: int = 0  # engines (kill, hang, slow)
    factor: float = 1.0  # slow
    node: int = 0  # node, trainer-node


@dataclasses.dataclass(frozen=True, slots=True)
class RandomFaults:
    """Faults per engine-hour of model time ({"die" | "hang" | "slow": rate}) inside a window."""

    rates: dict
    slow_factor: float = 4.0
    start: When = When(model_s=0.0)
    end: When | None = None


@dataclasses.dataclass
class FaultPlan:
    faults: list[Fault] = dataclasses.field(default_factory=list)
    random: RandomFaults | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self._records: list[dict] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._origin: tuple[float, float, float] | None = None  # (epoch s, model s, scale)

    # ------------------------------------------------------------------ the grammar

    @classmethod
    def parse(cls, spec: str) -> "FaultPlan":
        """The plan of a `--faults` spec (module docstring); ValueError naming the bad part."""
        plan = cls()
        if not spec.strip():
            raise _fail(spec, "no fault given")
        for part in spec.split(","):
            if not part:
                raise _fail(spec, "an empty item (two commas in a row, or a trailing comma)")
            head, at, when = part.partition("@")
            name, sep, target = head.partition("=")
            if name == "seed":
                if at or not target.isdigit():
                    raise _fail(part, f"seed {target!r} is not a whole number")
                plan.seed = int(target)
                continue
            if name == "random":
                if plan.random is not None:
                    raise _fail(part, "random given twice (join its rates with +)")
                plan.random = _parse_random(target, when if at else None, part)
                continue
            if name not in ("kill", "hang", "slow", "node", "trainer-node"):
                raise _fail(part, f"unknown fault {name!r}")
            if not at or not when:
                raise _fail(part, f"no moment: {head}@WHEN")
            moment = When.parse(when, part)
            if name == "slow":
                count, x, factor = target.partition("x")
                if not x:
                    raise _fail(part, "slow=NxF: N engines, F times slower (e.g. slow=8x3@600s)")
                plan.faults.append(Fault("slow", moment, count=_count(count, part, "count"),
                                         factor=_factor(factor, part)))
            elif name in ("kill", "hang"):
                plan.faults.append(Fault(name, moment, count=_count(target, part, "count")))
            elif name == "node":
                if not target:
                    raise _fail(part, "node=I@WHEN needs the generator node's number I")
                plan.faults.append(Fault("node", moment, node=_count(target, part, "node")))
            else:  # trainer-node[=I]
                node = _count(target, part, "node") if sep else 0
                plan.faults.append(Fault("trainer-node", moment, node=node))
        return plan

    # ------------------------------------------------------------------ injection

    def install(self, cluster) -> None:
        """Schedule the plan on `cluster` (a SimulatedCluster; usable as SimulatedBackend's
        on_start): a daemon thread injects each fault once its moment has come, until the
        cluster's engines are shut down."""
        if self._thread is not None:
            raise RuntimeError("this fault plan is installed already (make one per run)")
        for fault in self.faults:
            if fault.kind == "node" and fault.node not in cluster.generator_nodes():
                raise ValueError(f"--faults: node={fault.node}: the cluster's generator nodes "
                                 f"are 0..{max(cluster.generator_nodes())} "
                                 f"({cluster.engines_per_node} engines to a node)")
            if fault.kind == "trainer-node" and fault.node >= len(
                    {n.node_id for n in cluster.trainers.nodes}):
                raise ValueError(f"--faults: trainer-node={fault.node}: the trainer has nodes "
                                 f"0..{len({n.node_id for n in cluster.trainers.nodes}) - 1}")
        clock = cluster.clock
        self._origin = (time.time(), clock.now(), clock.time_scale)
        self._thread = threading.Thread(target=self._run, args=(cluster,), daemon=True,
                                        name="simulated-faults")
        self._thread.start()

    def record(self) -> list[dict]:
        """What was injected, in order: model_s (model time), step (optimizer steps taken),
        kind, targets (engine names), and indices, node, factor as the kind has them."""
        with self._lock:
            return [dict(r) for r in self._records]

    def model_time(self, epoch_s: float) -> float:
        """The cluster's model time at wall time `epoch_s` (time.time(), as faults.jsonl's
        detected_at / recovered_at are written)."""
        if self._origin is None:
            raise RuntimeError("the fault plan is not installed on a cluster")
        epoch, model, scale = self._origin
        return model + (epoch_s - epoch) * scale

    def _run(self, cluster) -> None:
        from megatron_rl.console import notice

        try:
            self._inject_all(cluster)
        except Exception as exc:  # noqa: BLE001 (the cluster stopped under it, or a bug)
            if not cluster.generators._stopped:
                notice(f"--faults: the fault thread stopped: {type(exc).__name__}: {exc}")
                with self._lock:
                    self._records.append({"kind": "error", "what": f"{type(exc).__name__}: "
                                                                   f"{exc}"})

    def _inject_all(self, cluster) -> None:
        pending = list(self.faults)
        step_seen: dict[int, float] = {}  # step -> model time it was first seen taken
        # The engines are chosen by their own generator: the random faults' moments and kinds
        # (random_draws) do not depend on which engines happened to be eligible.
        choose = random.Random(self.seed)
        random_next: float | None = None
        random_open = self.random is not None
        draws = self.random_draws(len(cluster.generators.engines)) if random_open else None
        pool = cluster.generators
        while not pool._stopped:
            now, step = cluster.clock.now(), cluster.trainers.steps
            for n in range(step + 1):
                step_seen.setdefault(n, now)

            def due(when: When) -> bool:
                if when.step is None:
                    return now >= when.model_s
                return when.step in step_seen and now >= step_seen[when.step] + when.delay_s

            for fault in [f for f in pending if due(f.when)]:
                pending.remove(fault)
                self._inject(cluster, fault, choose, now, step, origin="plan")
            if random_open:
                spec = self.random
                if spec.end is not None and due(spec.end):
                    random_open = False
                elif random_next is None and due(spec.start):
                    offset, kind = next(draws)
                    opened, random_next = now, now + offset
                elif random_next is not None and now >= random_next:
                    fault = Fault({"die": "kill"}.get(kind, kind), When(model_s=random_next),
                                  count=1, factor=spec.slow_factor)
                    self._inject(cluster, fault, choose, now, step, origin="random")
                    offset, kind = next(draws)
                    random_next = opened + offset
            time.sleep(POLL_S)

    def random_draws(self, num_engines: int):
        """The random faults of `num_engines` engines: (model seconds since the window opened,
        "die" | "hang" | "slow"), endlessly, the same for a seed. A Poisson process at the rates
        summed over the fleet (per engine-hour): exponential gaps, each fault's kind in
        proportion to its rate."""
        rng = random.Random(self.seed + 1)
        kinds = sorted(self.random.rates)
        weights = [self.random.rates[k] for k in kinds]
        per_s = sum(weights) * num_engines / 3600.0
        at = 0.0
        while True:
            at += rng.expovariate(per_s)
            yield at, rng.choices(kinds, weights=weights)[0]

    def _inject(self, cluster, fault: Fault, rng: random.Random, now: float, step: int, *,
                origin: str) -> None:
        from megatron_rl.simulation.cluster import _node_id

        pool = cluster.generators
        entry = {"model_s": round(now, 3), "step": step, "kind": fault.kind, "origin": origin,
                 "planned": str(fault.when)}
        if fault.kind == "trainer-node":
            node_ids = sorted({n.node_id for n in cluster.trainers.nodes})
            entry |= {"node": node_ids[fault.node], "targets": [
                f"trainer rank {r}" for r, n in enumerate(cluster.trainers.nodes)
                if n.node_id == node_ids[fault.node]]}
            cluster.lose_node(node_ids[fault.node])
        elif fault.kind == "node":
            on_node = cluster.generator_nodes().get(fault.node, [])
            indices = [i for i in on_node if pool.engines[i].alive]
            entry |= {"node": _node_id(fault.node), "indices": indices,
                      "targets": [pool.names[i] for i in indices],
                      "in_flight": [pool.engines[i].num_running + pool.engines[i].num_queued
                                    for i in indices],
                      # restarting there when it went: their start fails (then elsewhere)
                      "starting": [pool.names[i] for i in on_node if i not in indices]}
            cluster.lose_node(_node_id(fault.node))
        else:
            serving = pool.serving()
            eligible = [i for i in sorted(serving) if pool.engines[i].alive
                        and not pool.engines[i].hung and pool.engines[i].slowdown == 1.0
                        and not cluster.lost_nodes([_node_id(pool.engines[i].node)])]
            indices = sorted(rng.sample(eligible, min(fault.count, len(eligible))))
            entry |= {"indices": indices, "targets": [pool.names[i] for i in indices],
                      "asked": fault.count}
            engines = [pool.engines[i] for i in indices]
            entry["in_flight"] = [e.num_running + e.num_queued for e in engines]
            if fault.kind == "slow":
                entry |= {"factor": fault.factor,
                          "decode_tokens_before": [e.stats.decode_tokens for e in engines]}
            self._act(cluster, fault, engines)
        with self._lock:
            self._records.append(entry)

    @staticmethod
    def _act(cluster, fault: Fault, engines: list) -> None:
        import asyncio

        async def act():
            if fault.kind == "kill":
                await asyncio.gather(*(e.kill() for e in engines))
            for engine in engines:
                if fault.kind == "hang":
                    engine.hang()
                elif fault.kind == "slow":
                    engine.slow_down(fault.factor)

        if engines:
            cluster.loop.call(act())


def _parse_random(rates: str, window: str | None, part: str) -> RandomFaults:
    parsed, factor = {}, 4.0
    for item in rates.split("+"):
        kind, colon, value = item.partition(":")
        if kind not in ("die", "hang", "slow") or not colon:
            raise _fail(part, f"{item!r} is not a rate (die:R, hang:R or slow:RxF, R per "
                              "engine-hour)")
        if kind in parsed:
            raise _fail(part, f"{kind} given twice")
        if kind == "slow" and "x" in value:
            value, _, f = value.partition("x")
            factor = _factor(f, part)
        if not re.fullmatch(_NUMBER, value) or not math.isfinite(float(value)):
            raise _fail(part, f"rate {value!r} is not a number (faults per engine-hour)")
        parsed[kind] = float(value)
    if not any(parsed.values()):
        raise _fail(part, "every rate is 0")
    start, end = When(model_s=0.0), None
    if window is not None:
        first, dots, last = window.partition("..")
        start = When.parse(first, part) if first else start
        end = When.parse(last, part) if dots and last else None
        if dots and not last:
            raise _fail(part, "a window needs its end: @START..END")
    return RandomFaults(rates=parsed, slow_factor=factor, start=start, end=end)
