"""act_quant's launch time (µs, from a trace) at the decode shapes of the V3 cut: the routed down launch's input
(9 x 2048 at b=1, 72 x 2048 at b=8), wo's (1 x 16384) and neighbours, by tile (item 83: at b=1 the routed one
took ~5.7 µs in every profile since item 68, the wo one ~1.4: 6 programs of 4,096 elements against 16 of 1,024, the
per-element IEEE division a chain of ~32 a thread on one warp a scheduler).
    cd <tree> && PYTHONPATH=.:scripts python3 <this>"""
import json
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import quantize as AQ
from profile_step import launch_us

LAYERS, REPEATS = 8, 5
rows_out = []
for m, k in [(9, 2048), (72, 2048), (1, 16384)]:
    x = jax.random.normal(jax.random.key(m * k), (LAYERS, m, k), jnp.float32).astype(jnp.bfloat16)
    g = k // 128
    tiles = [None, (1, 8, 4), (1, 4, 2), (1, 2, 1), (1, 1, 1), (1, 16, 4), (2, 8, 4)]
    for tile in tiles:
        if tile is not None and (tile[1] > g):
            continue
        fn = lambda layer, ops, tile=tile: AQ._act_quant_2d(ops[layer].reshape(m, g, 128), False, False, tile)
        try:
            us = launch_us("act_quant", fn, LAYERS, REPEATS, x)
        except Exception as e:  # noqa: BLE001 - a tile that fails to compile is reported, not fatal
            print(f"m={m} k={k} tile={tile}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        row = dict(m=m, k=k, tile=tile or AQ.default_tile(m, g, 2), default=tile is None, us=round(us, 2))
        rows_out.append(row)
        print(json.dumps(row), flush=True)
json.dump(rows_out, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w"))
