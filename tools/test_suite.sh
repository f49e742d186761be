#!/usr/bin/env bash
# `make test`: the whole suite in five streams at once: e2e in two (whole `megatron-rl train`
# runs), integration (SGLang servers, Ray, sandboxes), unit + dist (+ a few integration files), and
# the GPU image's dependency resolution (network-bound) with the sweep's and the long-generation
# e2e.
# The e2e and integration tests spend much of their time waiting on process start-up and on their
# own subprocesses, leaving cores idle; one after the other the suite took 22 minutes on 2 cores.
# Each stream's output is printed when all are done, in this order; the exit status is non-zero
# if any stream failed. One tier alone: `make test-unit` (or -dist, -integration, -e2e).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
logs=$(mktemp -d -t megatron_rl_tests.XXXXXX)
# Balanced by the tests' durations on 2 cores (pytest prints the slowest 20 of each stream; the
# suite keeps both cores ~95% busy, so only less work makes it faster): the tensor/expert-parallel
# engine tests (integration) and the colocated run (e2e) go with the unit and dist tiers.
tp_ep=(tests/integration/test_sglang_tp_ep_tp2.py tests/integration/test_sglang_tp_ep_llama4.py)
# With the image's network wait: the sweep's e2e, the PP2 x 2-engine sync module and the engine
# lifetime kills, which the other streams cannot take in their 25 minutes.
tp_ep2_moe=tests/integration/test_sglang_tp_ep2_moe.py
lifetime=tests/integration/test_engine_lifetime.py
colocated=tests/e2e/test_train_colocated.py
# The multi-turn tool-use run (~4 min: the tool demo's tiny warm-up, then 5 steps) with the unit
# and dist tiers (19m27 in the last CI with it; the longest stream 23m54).
tool_use=tests/e2e/test_tool_use.py
# The GPU image's install set resolved against PyPI (pip --dry-run): ~2.5 min of mostly network
# wait, so a stream of its own adds little CPU and no wall time to the others.
image=tests/integration/test_gpu_image.py
# The whole-run tests in three streams (the node-loss run and the demo apart from the resume
# and 16k-token runs: the chaos run got shorter when restarts stopped blocking the driver,
# and the 16k-token run, ~5.5 min in the suite, left the image's stream, which had reached 23m54);
# the sweep's (three tiny runs) beside the image's network wait.
node_loss=tests/e2e/test_fault_tolerance.py::test_node_loss_generator_node_leaves_and_comes_back_trainer_node_stops_for_resume
demo=tests/e2e/test_demo.py
sweep=tests/e2e/test_sweep.py
# The chaos run (~5 min) beside the image's network wait: with the resume and 16k-token runs its
# stream had reached 23 minutes in CI, the image's 11.
chaos=tests/e2e/test_fault_tolerance.py::test_chaos_generators_trainer_and_reward_workers_die_and_hang_nothing_is_lost
# The real control plane on the simulated cluster (~3.5 min in the suite: the 1000 x 16
# validation on 64 engines ~1.5 min, the faults ~50 s, 256 engines ~30 s), beside the node-loss
# run and the demo.
scale=tests/scale
streams=("tests/e2e --ignore=$colocated --ignore=$tool_use --ignore=$demo --ignore=$sweep --deselect=$node_loss --deselect=$chaos"
         "$node_loss $demo $scale"
         "tests/integration ${tp_ep[*]/#/--ignore=} --ignore=$tp_ep2_moe --ignore=$lifetime --ignore=$image"
         "tests/unit tests/dist ${tp_ep[*]} $colocated $tool_use"
         "$image $sweep $tp_ep2_moe $lifetime $chaos")
# The machine's CPU time over the suite (/proc/stat: user nice system idle iowait irq softirq
# steal, in clock ticks), printed with the summary: busy near 2 x wall says the suite was
# CPU-bound; steal is time the host gave to others (a slower run on the same work).
cpu_ticks() { [ -r /proc/stat ] && awk '/^cpu /{print $2+$3+$4+$7+$8, $5, $6, $9}' /proc/stat; }
cpu_start=$(cpu_ticks)
suite_start=$SECONDS
pids=()
for i in "${!streams[@]}"; do
    # -p no:cacheprovider: the streams would all write .pytest_cache.
    # shellcheck disable=SC2086  # a stream is a list of pytest arguments
    "$PY" -m pytest -p no:cacheprovider ${streams[$i]} >"$logs/$i.log" 2>&1 &
    pids+=($!)
done
trap 'kill "${pids[@]}" 2>/dev/null' INT TERM
status=0
summary=()
for i in "${!streams[@]}"; do
    wait "${pids[$i]}"
    rc=$?
    [ "$rc" -eq 0 ] || status=1
    summary+=("  ${streams[$i]}: rc=$rc, $(grep -E '^=+ .*(passed|failed|error).* in ' \
        "$logs/$i.log" | tail -1 | tr -d '=')")
done
for i in "${!streams[@]}"; do
    echo "=================== stream: ${streams[$i]} ==================="
    cat "$logs/$i.log"
done
echo "=================== make test: ${#streams[@]} streams ==================="
printf '%s\n' "${summary[@]}"
if [ -n "$cpu_start" ]; then
    read -r busy0 idle0 iowait0 steal0 <<<"$cpu_start"
    read -r busy1 idle1 iowait1 steal1 <<<"$(cpu_ticks)"
    hz=$(getconf CLK_TCK)
    echo "  CPU over $((SECONDS - suite_start)) s on $(nproc) cores: busy $(((busy1 - busy0) / hz)) s," \
         "idle $(((idle1 - idle0) / hz)) s, iowait $(((iowait1 - iowait0) / hz)) s," \
         "steal $(((steal1 - steal0) / hz)) s"
fi
exit "$status"
