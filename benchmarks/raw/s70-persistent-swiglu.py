"""A persistent swiglu launch against the "fused" path's at V2-Lite b=256 (item 85): 2,048 sorted rows over 66
groups (64 routed experts with ~24 rows each, two 256-row shared chunks), w1 and w3 (66, 1,408, 2,048) bf16 a
layer. Main's launch (`grouped_gemm_swiglu`, 32 x 64 tiles, 3 stages) runs one program a tile, each filling its
own K pipeline (16 steps) before it streams; here `programs` programs each walk the tiles pid, pid + programs, ...
in ONE flattened loop over (tile, K step), so Triton's software pipeline runs through tile boundaries (cp.async
groups in flight across them) and no program waits on a fill but its first. The tile table is loaded once, as one
packed int32 vector (group << 24 | first row << 12 | end row), and each step picks its tile by a masked sum:
a scalar load of the table inside the loop would put a dependent global load before the step's copies, and Triton
then does not pipeline them at all (PTX: `cp.async.wait_group 0` in the loop, checked on the CPU). Also timed:
the same kernel with a program a tile (main's structure, to tell the two effects apart) and K steps of 256.
    cd <tree> && PYTHONPATH=.:scripts python3 <this> OUT.json
Prints one JSON line a launch: µs (trace), TB/s of its weight bytes, and the largest difference from main's output."""
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import num_sms
from pallas_kernels.grouped import grouped_gemm_swiglu
from profile_step import launch_us

LAYERS, REPEATS = 6, 5
GROUPS, INTER, DIM, TOKENS, TOPK, SHARED_ROWS = 66, 1408, 2048, 256, 6, 256


def _kernel(layer_ref, table_ref, x_ref, w1_ref, w3_ref, o_ref, *, items, col_blocks, ksteps, block_m, block_n,
            block_k, programs):
    pid = pl.program_id(0)
    layer = layer_ref[0]
    packed = table_ref[...]
    tiles = jnp.arange(packed.shape[0])

    def body(t, accs):
        item = pid + jax.lax.div(t, jnp.int32(ksteps)) * programs
        kb = jax.lax.rem(t, jnp.int32(ksteps))
        tile, j = jax.lax.div(item, jnp.int32(col_blocks)), jax.lax.rem(item, jnp.int32(col_blocks))
        entry = jnp.sum(jnp.where(tiles == tile, packed, 0))
        group, row0, row_end = entry >> 24, (entry >> 12) & 4095, entry & 4095
        ok = row0 + jnp.arange(block_m) < row_end
        cols, ks = pl.ds(j * block_n, block_n), pl.ds(kb * block_k, block_k)
        x = plgpu.load(x_ref.at[pl.ds(row0, block_m), ks], mask=ok[:, None], other=0)
        dims = (((1,), (1,)), ((), ()))
        first = kb == 0
        a1, a3 = (jnp.where(first, 0.0, acc)
                  + jax.lax.dot_general(x, plgpu.load(w_ref.at[layer, group, cols, ks]), dims,
                                        preferred_element_type=jnp.float32)
                  for acc, w_ref in zip(accs, (w1_ref, w3_ref)))

        @pl.when(kb == ksteps - 1)
        def _():
            out = (a1 * jax.nn.sigmoid(a1) * a3).astype(o_ref.dtype)
            plgpu.store(o_ref.at[pl.ds(row0, block_m), cols], out, mask=ok[:, None])
        return a1, a3

    my_items = jax.lax.div(jnp.int32(items + programs - 1) - pid, jnp.int32(programs))
    zeros = jnp.zeros((block_m, block_n), jnp.float32)
    jax.lax.fori_loop(0, my_items * ksteps, body, (zeros, zeros))


def packed_tiles(sizes, block_m: int) -> np.ndarray:
    """Each block_m-row tile of each group's rows as group << 24 | first row << 12 | end row, padded with empty
    tiles (end row 0) to a power of two."""
    out, start = [], 0
    for group, size in enumerate(sizes):
        out += [group << 24 | row << 12 | (start + size) for row in range(start, start + size, block_m)]
        start += size
    return np.asarray(out + [0] * ((1 << (len(out) - 1).bit_length()) - len(out)), np.int32)


def persistent_swiglu(x, w1, w3, packed, tiles: int, layer, *, block_m=32, block_n=64, block_k=128, programs=264,
                      num_warps=4, num_stages=3, interpret=None):
    m, k = x.shape
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    col_blocks = w1.shape[-2] // block_n
    programs = min(programs, tiles * col_blocks)
    kernel = functools.partial(_kernel, items=tiles * col_blocks, col_blocks=col_blocks, ksteps=k // block_k,
                               block_m=block_m, block_n=block_n, block_k=block_k,
                               programs=programs)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((m, w1.shape[-2]), x.dtype), grid=(programs,),
                          compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                          name="persistent_swiglu", interpret=interpret)(jnp.reshape(layer, (1,)), packed, x, w1, w3)


def swiglu_inputs():
    """The launch's group sizes (seeded expert choices of 256 tokens, then the two shared chunks), x and w1, w3."""
    rng = np.random.default_rng(0)
    routed = np.bincount(rng.integers(0, GROUPS - 2, TOKENS * TOPK), minlength=GROUPS - 2)
    sizes = [int(s) for s in routed] + [SHARED_ROWS, SHARED_ROWS]
    key = jax.random.key(0)
    x = (jax.random.normal(key, (sum(sizes), DIM), jnp.float32) * 0.5).astype(jnp.bfloat16)
    w1, w3 = ((jax.random.normal(jax.random.fold_in(key, i), (LAYERS, GROUPS, INTER, DIM), jnp.float32) * 0.02)
              .astype(jnp.bfloat16) for i in (1, 2))
    return sizes, x, w1, w3


def main():
    sizes, x, w1, w3 = swiglu_inputs()
    group_sizes = jnp.asarray(sizes, jnp.int32)
    weight_bytes = 2 * GROUPS * INTER * DIM * 2
    main_fn = lambda layer, ops: grouped_gemm_swiglu(ops[0], ops[1], ops[2], ops[3], layer=layer, block_m=32,
                                                     block_n=64, num_stages=3)
    want = np.asarray(jax.jit(main_fn)(jnp.int32(1), (x, w1, w3, group_sizes)), np.float32)
    results = []

    def report(name, us, **launch):
        row = dict(name=name, us=round(us, 2), tb_s=round(weight_bytes / us / 1e6, 3), **launch)
        results.append(row)
        print(json.dumps(row), flush=True)

    operands = (x, w1, w3, group_sizes)
    report("main 32 x 64, 3 stages", launch_us("grouped_gemm_swiglu", main_fn, LAYERS, REPEATS, operands))
    sms = num_sms()
    # (block_m, block_n, block_k, stages, programs an SM; None: a program a tile, as main's launch): as many as the
    # stages' shared memory lets stay resident (Triton keeps stages - 1 buffers: 32 x 64 x 128 at 3 stages 82 KB,
    # at 4 122 KB; 32 x 32 x 128 at 4 74 KB; 32 x 128 x 128 at 3 146 KB; 32 x 32 x 256 at 3 98 KB). block_k 256
    # reads each weight row in 512-byte runs a step, not 256 (main's K step is the fp8 scale block, 128)
    for block_m, block_n, block_k, stages, per_sm in [
            (32, 64, 128, 3, None), (32, 64, 128, 3, 2), (32, 64, 128, 3, 1), (32, 64, 128, 4, 1),
            (32, 32, 128, 4, 3), (32, 128, 128, 3, 1), (32, 32, 256, 3, None), (32, 32, 256, 3, 2)]:
        packed = jnp.asarray(packed_tiles(sizes, block_m))
        tiles = int(sum(-(-s // block_m) for s in sizes))
        launch = dict(block_m=block_m, block_n=block_n, block_k=block_k, stages=stages,
                      programs=tiles * (INTER // block_n) if per_sm is None else sms * per_sm)
        fn = lambda layer, ops, launch=launch, packed=packed, tiles=tiles: persistent_swiglu(
            ops[0], ops[1], ops[2], packed, tiles, layer, block_m=launch["block_m"], block_n=launch["block_n"],
            block_k=launch["block_k"], programs=launch["programs"], num_stages=launch["stages"])
        try:
            got = np.asarray(jax.jit(fn)(jnp.int32(1), (x, w1, w3)), np.float32)
            us = launch_us("persistent_swiglu", fn, LAYERS, REPEATS, (x, w1, w3))
        except Exception as e:  # noqa: BLE001 - a launch that fails to compile is reported, not fatal
            print(json.dumps(dict(error=f"{type(e).__name__}: {str(e)[:300]}", **launch)), flush=True)
            continue
        diff = dict(max_diff=float(np.abs(got - want).max()), max_out=float(np.abs(want).max()))
        report("a program a tile" if per_sm is None else "persistent", us, **diff, **launch)
    json.dump(results, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w"), indent=1)


if __name__ == "__main__":
    main()
