"""Time the MLA decode kernel (`pallas_kernels.mla_decode`) alone over a long latent cache, for a sweep of
its split-K and launch settings, beside the bytes floor (the cache rows read over 4.3 TB/s).

    python scripts/bench_mla_decode.py --context 131072 --heads 16 --batch 1

The default settings (`splits=None`: one split per SM's worth of work) are the first row.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import mla_decode
from bench_model import HBM_BYTES_PER_S


def time_call(fn, repeats: int = 200) -> float:
    for _ in range(repeats // 4):  # warm-up long enough for the clocks to settle
        out = fn()
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rank", type=int, default=512)
    parser.add_argument("--rope", type=int, default=64)
    parser.add_argument("--splits", default="0,264,528,1056", help="0: the kernel's default")
    parser.add_argument("--block-t", default="64,128")
    parser.add_argument("--num-warps", default="4,8")
    parser.add_argument("--num-stages", default="2")
    parser.add_argument("--out")
    opts = parser.parse_args()
    b, h, t = opts.batch, opts.heads, opts.context
    key = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(key[0], (b, h, opts.rank), jnp.bfloat16)
    q_pe = jax.random.normal(key[1], (b, h, opts.rope), jnp.bfloat16)
    kv = jax.random.normal(key[2], (1, b, t, opts.rank), jnp.bfloat16)
    pe = jax.random.normal(key[3], (1, b, t, opts.rope), jnp.bfloat16)
    lengths = jnp.full((b,), t - 1, jnp.int32)
    floor_s = b * t * (opts.rank + opts.rope) * 2 / HBM_BYTES_PER_S
    rows = []
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    settings = itertools.product(ints(opts.splits), ints(opts.block_t), ints(opts.num_warps), ints(opts.num_stages))
    for splits, block_t, warps, stages in settings:
        fn = jax.jit(lambda q, q_pe, kv, pe, lengths, s=splits, bt=block_t, w=warps, st=stages: mla_decode(
            q, q_pe, kv, pe, 0, lengths, q[:, 0], q_pe[:, 0], scale=0.1, kv_len=t, block_t=bt, splits=s or None,
            num_warps=w, num_stages=st))
        try:
            seconds = time_call(lambda: fn(q, q_pe, kv, pe, lengths))
        except Exception as err:  # a setting the compiler refuses: report and go on
            print(f"splits={splits} block_t={block_t} warps={warps} stages={stages}: "
                  f"{type(err).__name__}: {str(err)[:120]}")
            continue
        rows.append(dict(splits=splits, block_t=block_t, num_warps=warps, num_stages=stages, us=seconds * 1e6,
                         tb_s=floor_s * HBM_BYTES_PER_S / seconds / 1e12, pct_floor=100 * floor_s / seconds))
        print(f"splits={splits or 'default'} block_t={block_t} warps={warps} stages={stages}: {seconds * 1e6:.1f} us "
              f"({rows[-1]['tb_s']:.2f} TB/s, floor {floor_s * 1e6:.1f} us)", flush=True)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump({"context": t, "heads": h, "batch": b, "floor_us": floor_s * 1e6, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
