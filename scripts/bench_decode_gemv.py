"""Decode-sized projections (M = 1..32 rows times a dense (N, K) bf16 weight): XLA's dot beside the grouped
GEMM kernel run as one group (`grouped_gemm(x, w[None], [M])`) at several column tiles, with the HBM floor.

    PYTHONPATH=. python3 scripts/bench_decode_gemv.py --out benchmarks/decode-gemv-h200.json

At b=1 XLA runs such a dot as a reduce fusion; the question this answers is whether a Pallas GEMV
streams the weight faster (the routed experts' slot kernels do). Timing as scripts/bench_kernels.py
(`time_op`: R distinct input sets per jitted call, median of repeats).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from bench_kernels import HBM, time_op
from pallas_kernels import grouped_gemm

# (name, N, K) of the bf16 weights a decode step reads through dense projections
SHAPES = [("V2-Lite wq", 3072, 2048), ("V2-Lite wkv_a", 576, 2048), ("V2-Lite wo", 2048, 2048),
          ("V2-Lite dense w1", 10944, 2048), ("V2-Lite dense w2", 2048, 10944),
          ("V3 wq_a", 1536, 7168), ("V3 wq_b", 24576, 1536), ("V3 wkv_a", 576, 7168), ("V3 wo", 7168, 16384)]


def xla(x, w):
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def kernel(block_n: int):
    return lambda x, w: grouped_gemm(x, w[None], jnp.array([x.shape[0]], jnp.int32), out_dtype=jnp.float32,
                                     block_m=16, block_n=block_n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,8,32")
    p.add_argument("--block-n", default="16,32,64")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="one tiny shape: a CPU dry run of the script")
    o = p.parse_args()
    shapes = [("smoke", 256, 256)] if o.smoke else SHAPES
    variants = {"xla": xla} | {f"kernel n{b}": kernel(int(b)) for b in o.block_n.split(",")}
    results = []
    for name, n, k in shapes:
        for m in (int(r) for r in o.rows.split(",")):
            nbytes = n * k * 2 + m * k * 2 + m * n * 4
            floor = nbytes / HBM

            def make(i, m=m, n=n, k=k):
                key = jax.random.fold_in(jax.random.PRNGKey(n + k), i)
                return (jax.random.normal(key, (m, k), jnp.bfloat16),
                        (0.02 * jax.random.normal(jax.random.fold_in(key, 1), (n, k))).astype(jnp.bfloat16))

            row = {"name": name, "M": m, "N": n, "K": k, "bytes": nbytes, "floor_us": floor * 1e6}
            want = jax.jit(xla)(*make(0))
            row["max_rel_vs_xla"] = max(float(jnp.max(jnp.abs(jax.jit(fn)(*make(0)) - want)) / jnp.max(jnp.abs(want)))
                                        for label, fn in variants.items() if label != "xla")
            for label, fn in variants.items():
                t = time_op(fn, make, nbytes, floor, 64)
                row[label] = {"us": t["s"] * 1e6, "TBps": nbytes / t["s"] / 1e12, "spread": t["spread"]}
            results.append(row)
            print(f"{name:18s} M={m:3d} (kernels vs xla {row['max_rel_vs_xla']:.1e}): floor {row['floor_us']:6.2f} us | "
                  + " | ".join(
                f"{label} {row[label]['us']:6.2f} us {row[label]['TBps']:4.2f} TB/s" for label in variants), flush=True)
    if o.out:
        o.out.write_text(json.dumps({"hbm_Bps": HBM, "results": results}, indent=1))


if __name__ == "__main__":
    main()
