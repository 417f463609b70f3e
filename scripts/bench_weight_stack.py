"""fp8_gemm and dequant_gemm reading each layer of a weight stack in turn, as the decode step's layer scan does.

    PYTHONPATH=. python3 scripts/bench_weight_stack.py --rows 1,8 --out x.json

The stacks are V3's wq_b (61 layers of 24,576 x 1,536 fp8): whole, as a device holds it when attention is
replicated ("dp-attn": 2.3e9 bytes, past 2^31) and as one device of eight holds it under "tp" (3,072 rows a layer).
Each call is one jit of a loop over every layer, the product of `rows` activation rows with that layer; the time a
layer is the call's over the layer count (median of several calls). The floor is a layer's bytes at 4.3 TB/s.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from pallas_kernels import act_quant, dequant_gemm, fp8_gemm
from bench_model import HBM_BYTES_PER_S

LAYERS, K = 61, 1536
STACKS = {"whole (dp-attn)": 24576, "tp=8 shard": 3072}


def stack(n: int):
    """A random fp8 stack (LAYERS, n, K) and its block scales, built a layer at a time (bounded scratch)."""
    key = jax.random.PRNGKey(n)
    layers = [jax.random.uniform(jax.random.fold_in(key, i), (n, K), jnp.bfloat16, -1.9, 1.9).astype(jnp.float8_e4m3fn)
              for i in range(LAYERS)]
    scales = jnp.exp2(jnp.floor(jax.random.uniform(key, (LAYERS, n // 128, K // 128), minval=-8, maxval=-3)))
    return jnp.stack(layers), scales


def per_layer_seconds(product, b, b_s, calls: int = 20) -> float:
    """Median seconds a layer of one jit looping `product(layer)` over every layer of the stack."""
    def every_layer(b, b_s):
        def body(layer, acc):
            return acc + product(b, b_s, layer).astype(jnp.float32).sum()
        return jax.lax.fori_loop(0, LAYERS, body, jnp.float32(0))
    run = jax.jit(every_layer)
    run(b, b_s).block_until_ready()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        run(b, b_s).block_until_ready()
        samples.append((time.perf_counter() - t0) / LAYERS)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8", help="activation rows, comma-separated")
    p.add_argument("--out", help="JSON file for the results")
    args = p.parse_args()
    out = []
    for name, n in STACKS.items():
        b, b_s = stack(n)
        floor_us = n * K / HBM_BYTES_PER_S * 1e6
        for m in map(int, args.rows.split(",")):
            x = jax.random.normal(jax.random.PRNGKey(m), (m, K), jnp.float32).astype(jnp.bfloat16)
            a, a_s = act_quant(x)
            gemms = {"fp8_gemm": lambda b, b_s, layer: fp8_gemm(a, a_s, b, b_s, layer=layer),
                     "dequant_gemm": lambda b, b_s, layer: dequant_gemm(x, b, b_s, layer=layer)}
            for gemm, product in gemms.items():
                us = per_layer_seconds(product, b, b_s) * 1e6
                out.append(dict(stack=name, bytes=b.size, rows=m, gemm=gemm, us_per_layer=us, floor_us=floor_us))
                print(f"{name:16} {b.size / 1e9:.2f} GB  rows {m:3}  {gemm:12} {us:8.2f} µs a layer "
                      f"(floor {floor_us:.2f}: {floor_us / us:.0%})", flush=True)
        del b, b_s
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=out), f, indent=1)


if __name__ == "__main__":
    main()
