#!/usr/bin/env python
"""Wait until a Ray cluster has its nodes, then print each node's role and resources.

Usage: python examples/launch/wait_for_nodes.py --address HEAD_IP:6379 --nodes N [--timeout 600]

The launch scripts (slurm.sbatch, ssh.sh) run it between starting the Ray nodes and submitting
`megatron-rl train`: the run reserves its placement group at once, and the trainer / generator
roles (megatron_rl.cluster.placement: the custom resources megatron_rl_trainer and
megatron_rl_generator) are only seen once every node has joined. Exit status 1 when the nodes
did not all join in time, or when only one of the two roles is present.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # runnable from a checkout


def node_roles(nodes: list[dict]) -> list[tuple[str, str, dict]]:
    """(address, role, resources) of each alive node; role from the role resources."""
    from megatron_rl.cluster.placement import GENERATOR_NODE_RESOURCE, TRAINER_NODE_RESOURCE

    rows = []
    for node in nodes:
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        roles = [name for name, resource in (("trainer", TRAINER_NODE_RESOURCE),
                                             ("generator", GENERATOR_NODE_RESOURCE))
                 if resources.get(resource)]
        shown = {k: v for k, v in sorted(resources.items())
                 if k in ("CPU", "GPU", TRAINER_NODE_RESOURCE, GENERATOR_NODE_RESOURCE)}
        rows.append((node.get("NodeManagerAddress", "?"), "+".join(roles) or "any", shown))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="the head's HOST:PORT")
    parser.add_argument("--nodes", type=int, required=True, help="nodes expected (head included)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds")
    args = parser.parse_args(argv)

    import ray

    deadline = time.monotonic() + args.timeout
    while True:  # the head may still be starting (SLURM starts it in the background)
        try:
            ray.init(address=args.address, log_to_driver=False, logging_level="ERROR")
            break
        except (ConnectionError, RuntimeError) as exc:
            if time.monotonic() > deadline:
                print(f"wait_for_nodes: no Ray head at {args.address} within "
                      f"{args.timeout:.0f} s: {exc}", file=sys.stderr)
                return 1
            time.sleep(2.0)
    try:
        while True:
            rows = node_roles(ray.nodes())
            if len(rows) >= args.nodes or time.monotonic() > deadline:
                break
            time.sleep(2.0)
    finally:
        ray.shutdown()
    for address, role, resources in rows:
        print(f"node {address}: {role} {resources}")
    if len(rows) < args.nodes:
        print(f"wait_for_nodes: {len(rows)} of {args.nodes} nodes joined within "
              f"{args.timeout:.0f} s; look at the Ray logs of the missing nodes "
              "(/tmp/ray/session_latest/logs/raylet.err)", file=sys.stderr)
        return 1
    roles = {role for _, role, _ in rows}
    if ("trainer" in roles) != ("generator" in roles):
        print(f"wait_for_nodes: only {roles & {'trainer', 'generator'}} nodes: give the others "
              "the other role (examples/launch/common.sh)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
