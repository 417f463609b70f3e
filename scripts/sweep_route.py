"""GPU time per launch of the one-launch MoE router (`pallas_kernels.router.route`) by rows a program and warps.

    PYTHONPATH=.:scripts python3 scripts/sweep_route.py --batches 1,8,16,32 --block-rows 1,2,4,8,16 --warps 1,2,4

DeepSeek-V3's routing (256 experts, sigmoid scores with the correction bias, 8 groups of which 4 compete, 8 experts
a token) and V2-Lite's (64 experts, softmax, 6 a token). One jit launches the router once per layer's logits; the
time is the kernel's duration from a profiler trace (`profile_step.launch_us`).
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from pallas_kernels._common import pow2_at_most
from pallas_kernels.router import route
from profile_step import launch_us

ROUTINGS = {"v3": (256, dict(topk=8, n_groups=8, topk_groups=4, score_func="sigmoid", route_scale=2.5,
                             normalize=True), True),
            "v2-lite": (64, dict(topk=6, score_func="softmax"), False)}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--routings", default="v3,v2-lite", help=f"of {sorted(ROUTINGS)}")
    p.add_argument("--batches", type=ints, default=[1, 8, 16, 32])
    p.add_argument("--block-rows", type=ints, default=[1, 2, 4, 8, 16])
    p.add_argument("--warps", type=ints, default=[1, 2, 4])
    p.add_argument("--layers", type=int, default=16, help="launches a jit call, each on its own logits")
    p.add_argument("--repeats", type=int, default=5, help="jit calls traced per setting")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    return p.parse_args()


def main() -> None:
    o = parse_args()
    rows = []
    for name in o.routings.split(","):
        experts, routing, with_bias = ROUTINGS[name]
        for batch in o.batches:
            keys = jax.random.split(jax.random.key(batch), 2)
            logits = jax.random.normal(keys[0], (o.layers, batch, experts), jnp.float32)
            bias = 0.1 * jax.random.normal(keys[1], (experts,), jnp.float32) if with_bias else None
            for block_rows in o.block_rows:
                if pow2_at_most(batch, block_rows) != block_rows:  # the same tiles as a smaller block_rows
                    continue
                for warps in o.warps:
                    def one(layer, ops, block_rows=block_rows, warps=warps):
                        return route(ops[layer], bias, block_rows=block_rows, num_warps=warps, **routing)
                    us = launch_us("route", one, o.layers, o.repeats, logits)
                    rows.append(dict(routing=name, batch=batch, block_rows=block_rows, warps=warps, us=round(us, 2)))
                    print(json.dumps(rows[-1]), flush=True)
    if o.out:
        with open(o.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
