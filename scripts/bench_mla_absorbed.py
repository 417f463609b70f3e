"""The absorbed MLA decode attention's three launches (`mla_absorb_query`, `mla_decode_splits`,
`mla_decode_output`) timed one by one at decode shapes, for a sweep of each one's launch settings, beside
the bytes floor of what each reads.

    PYTHONPATH=. python3 scripts/bench_mla_absorbed.py --out benchmarks/mla-absorbed-h200.json

Timing as scripts/bench_kernels.py (`time_op`: R distinct input sets per jitted call, so each call reads
its own wkv_b layer and cache from HBM, as the layers of a step do). The first setting of each sweep
is the kernels' default.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp

from bench_kernels import HBM, time_op
from pallas_kernels.mla import mla_absorb_query, mla_decode_output, mla_decode_splits

# (heads, wkv_b in fp8 with block scales); both models have 128 key and value dims per head, a 512 + 64 latent
SHAPES = {"V2-Lite": (16, False), "V3": (128, False), "V3-fp8": (128, True)}
NOPE = V_DIM = 128
RANK, ROPE = 512, 64
SWEEPS = {
    "absorb": [dict(block_c=c, num_warps=w, num_stages=st) for c, w, st in
               ((128, 4, 1), (64, 4, 1), (32, 4, 1), (64, 2, 1), (128, 4, 2), (128, 8, 1))],
    "splits": [dict(block_t=t, num_warps=w) for t, w in ((64, 4), (32, 4), (16, 4), (32, 2), (16, 2))],
    "output": [dict(block_v=v, num_warps=w, num_stages=st) for v, w, st in
               ((32, 4, 1), (32, 4, 2), (32, 4, 3), (16, 4, 2), (64, 4, 2), (128, 8, 2), (32, 8, 2))],
}


def operands(i: int, batch: int, heads: int, context: int, fp8: bool) -> dict:
    key = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(batch * heads + context), i), 9)
    normal = lambda k, shape, s=1.0: (s * jax.random.normal(k, shape)).astype(jnp.bfloat16)  # noqa: E731
    rows = heads * (NOPE + V_DIM)
    wkv_b = normal(key[1], (rows, RANK), 0.05)
    scale = jnp.exp2(jax.random.uniform(key[8], (rows // 128, RANK // 128), minval=-8, maxval=-4)) if fp8 else None
    return dict(q_nope=normal(key[0], (batch, heads, NOPE)),
                wkv_b=(wkv_b * 20).astype(jnp.float8_e4m3fn) if fp8 else wkv_b, wkv_b_scale=scale,
                q_pe=normal(key[2], (batch, heads, ROPE)), kv=normal(key[3], (1, batch, context, RANK)),
                pe=normal(key[4], (1, batch, context, ROPE)), new_kv=normal(key[5], (batch, RANK)),
                new_pe=normal(key[6], (batch, ROPE)), lengths=jnp.full((batch,), context - 1, jnp.int32))


def launches(setting: dict, kernel: str, context: int):
    """(fn, how its inputs are made from `operands`) for one kernel under `setting`."""
    def absorb(o):
        return mla_absorb_query(o["q_nope"], o["wkv_b"], wkv_b_scale=o["wkv_b_scale"],
                                **(setting if kernel == "absorb" else {}))

    def splits(o, q_latent):
        return mla_decode_splits(q_latent, o["q_pe"], o["kv"], o["pe"], 0, o["lengths"], kv_len=context, scale=0.05,
                                 **(setting if kernel == "splits" else {}))

    def output(o, q_latent, parts):
        return mla_decode_output(*parts, q_latent, o["q_pe"], o["new_kv"], o["new_pe"], o["wkv_b"], scale=0.05,
                                 v_dim=V_DIM, wkv_b_scale=o["wkv_b_scale"], **(setting if kernel == "output" else {}))
    return absorb, splits, output


def bytes_read(kernel: str, batch: int, heads: int, context: int, fp8: bool) -> int:
    half = heads * NOPE * RANK * (1 if fp8 else 2)
    return {"absorb": half, "splits": batch * context * (RANK + ROPE) * 2, "output": half}[kernel]


def sweep(kernel: str, name: str, batch: int, context: int, max_sets: int) -> list[dict]:
    (heads, fp8), rows = SHAPES[name], []
    for setting in SWEEPS[kernel]:
        absorb, splits, output = launches(setting, kernel, context)

        def make(i):
            o = operands(i, batch, heads, context, fp8)
            q_latent = jax.jit(absorb)(o)
            return o, q_latent, jax.jit(splits)(o, q_latent)
        fn = {"absorb": lambda o, q, p: absorb(o), "splits": lambda o, q, p: splits(o, q),
              "output": lambda o, q, p: output(o, q, p)}[kernel]
        nbytes = bytes_read(kernel, batch, heads, context, fp8)
        timing = time_op(fn, make, nbytes, nbytes / HBM, max_sets=max_sets)
        rows.append(dict(kernel=kernel, shape=name, batch=batch, context=context, **setting, us=timing["s"] * 1e6,
                         floor_us=nbytes / HBM * 1e6, spread=timing["spread"]))
        print(f"{name:8s} b={batch:<3d} T={context:<5d} {kernel:6s} {setting}: {rows[-1]['us']:7.2f} us "
              f"(floor {rows[-1]['floor_us']:.2f} us)", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--contexts", default="512,4096")
    p.add_argument("--shapes", default="V2-Lite,V3,V3-fp8")
    p.add_argument("--kernels", default="absorb,splits,output")
    p.add_argument("--max-sets", type=int, default=64, help="at most this many distinct input sets a timing")
    p.add_argument("--out", type=Path, default=None)
    o = p.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    contexts = ints(o.contexts)
    rows = [row for name in o.shapes.split(",") for batch in ints(o.batches) for context in contexts
            for kernel in o.kernels.split(",") if kernel != "absorb" or context == contexts[0]  # reads no cache
            for row in sweep(kernel, name, batch, context, o.max_sets)]
    if o.out:
        o.out.write_text(json.dumps({"gpu": jax.devices()[0].device_kind, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
