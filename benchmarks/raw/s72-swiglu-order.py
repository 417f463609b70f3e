"""Why item 86's one-program-a-tile prototype ran the V2-Lite b=256 "fused" swiglu launch in 274 µs against main's
305 (item 87: main's tile prologue at 4 barriers instead of 24 gained ~0.1 % of the step, so not that). The two
other differences, timed apart on the same 2,048 sorted rows over 66 groups: the programs' order (main's grid is
(tiles, column blocks), tile fastest, so a column block's tiles run together; the prototype is tile-major, a tile's
22 column blocks one after another) and the empty programs (main launches the bound, 130 tiles x 22 = 2,860
programs, 1,056 of them without a tile; the prototype the real 82 x 22). Each variant is one program a tile with
its tile from a packed table (one load and a masked sum), a tile past the table's real ones returning at once;
and two or one programs an SM walking the (tile, column block) items tile-major, stopping at the real tiles' end
(no program launched without a tile).
    cd <tree> && PYTHONPATH=.:scripts python3 <this> TAG OUT.json [tree]    (tree: the tree's launch only)
Prints one JSON line a launch: µs (trace), TB/s of its weight bytes, the largest difference from main's output."""
import functools
import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels._common import num_sms
from pallas_kernels.grouped import grouped_gemm_swiglu, max_sized_tiles
from profile_step import launch_us

_SPEC = importlib.util.spec_from_file_location("item86", pathlib.Path(__file__).with_name("s70-persistent-swiglu.py"))
item86 = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(item86)
LAYERS, REPEATS, GROUPS, INTER, DIM = item86.LAYERS, item86.REPEATS, item86.GROUPS, item86.INTER, item86.DIM
BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 128


def _kernel(layer_ref, table_ref, x_ref, w1_ref, w3_ref, o_ref, *, tiles, col_blocks, tile_major, programs):
    """One (tile, column block) item a program, or with `programs` each program the items pid, pid + programs, ...
    in turn (tile-major), stopping at the first past the table's real tiles."""
    pid, packed = pl.program_id(0), table_ref[...]
    if programs is None:
        if tile_major:
            _item(layer_ref, packed, x_ref, w1_ref, w3_ref, o_ref, jax.lax.div(pid, jnp.int32(col_blocks)),
                  jax.lax.rem(pid, jnp.int32(col_blocks)))
        else:
            _item(layer_ref, packed, x_ref, w1_ref, w3_ref, o_ref, jax.lax.rem(pid, jnp.int32(tiles)),
                  jax.lax.div(pid, jnp.int32(tiles)))
        return
    real = jnp.sum((packed & 4095) > 0)

    def cond(item):
        return jax.lax.div(item, jnp.int32(col_blocks)) < real

    def body(item):
        _item(layer_ref, packed, x_ref, w1_ref, w3_ref, o_ref, jax.lax.div(item, jnp.int32(col_blocks)),
              jax.lax.rem(item, jnp.int32(col_blocks)))
        return item + programs

    jax.lax.while_loop(cond, body, pid)


def _item(layer_ref, packed, x_ref, w1_ref, w3_ref, o_ref, tile, j):
    entry = jnp.sum(jnp.where(jnp.arange(packed.shape[0]) == tile, packed, 0))
    group, row0, row_end = entry >> 24, (entry >> 12) & 4095, entry & 4095
    layer = layer_ref[0]

    @pl.when(row_end > row0)
    def _():
        ok = row0 + jnp.arange(BLOCK_M) < row_end
        cols, dims = pl.ds(j * BLOCK_N, BLOCK_N), (((1,), (1,)), ((), ()))

        def body(kb, accs):
            ks = pl.ds(pl.multiple_of(kb * BLOCK_K, BLOCK_K), BLOCK_K)
            x = plgpu.load(x_ref.at[pl.ds(row0, BLOCK_M), ks], mask=ok[:, None], other=0)
            return tuple(acc + jax.lax.dot_general(x, plgpu.load(w_ref.at[layer, group, cols, ks]), dims,
                                                   preferred_element_type=jnp.float32)
                         for acc, w_ref in zip(accs, (w1_ref, w3_ref)))

        zeros = jnp.zeros((BLOCK_M, BLOCK_N), jnp.float32)
        a1, a3 = jax.lax.fori_loop(0, x_ref.shape[1] // BLOCK_K, body, (zeros, zeros))
        plgpu.store(o_ref.at[pl.ds(row0, BLOCK_M), cols], (a1 * jax.nn.sigmoid(a1) * a3).astype(o_ref.dtype),
                    mask=ok[:, None])


def packed_tiles(sizes, length: int) -> np.ndarray:
    """Each BLOCK_M-row tile of each group's rows as group << 24 | first row << 12 | end row, then empty entries
    (end row 0) up to `length`."""
    out, start = [], 0
    for group, size in enumerate(sizes):
        out += [group << 24 | row << 12 | (start + size) for row in range(start, start + size, BLOCK_M)]
        start += size
    return np.asarray(out + [0] * (length - len(out)), np.int32)


def table_swiglu(x, w1, w3, packed, tiles: int, layer, *, tile_major: bool, programs: int | None = None):
    """Programs over `tiles` tiles (the real ones, or a bound whose extra entries are empty) x the column blocks;
    or `programs` programs walking them."""
    col_blocks = w1.shape[-2] // BLOCK_N
    kernel = functools.partial(_kernel, tiles=tiles, col_blocks=col_blocks, tile_major=tile_major, programs=programs)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((x.shape[0], w1.shape[-2]), x.dtype),
                          grid=(tiles * col_blocks if programs is None else programs,),
                          compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
                          name="table_swiglu", interpret=jax.default_backend() == "cpu")(
        jnp.reshape(layer, (1,)), packed, x, w1, w3)


def main():
    tag, out_path = sys.argv[1], sys.argv[2]
    sizes, x, w1, w3 = item86.swiglu_inputs()  # item 86's launch: the same rows and weights
    rows = sum(sizes)
    weight_bytes = 2 * GROUPS * INTER * DIM * 2
    main_fn = lambda layer, ops: grouped_gemm_swiglu(ops[0], ops[1], ops[2], ops[3], layer=layer, block_m=BLOCK_M,
                                                     block_n=BLOCK_N, num_stages=3)
    operands = (x, w1, w3, jnp.asarray(sizes, jnp.int32))
    want = np.asarray(jax.jit(main_fn)(jnp.int32(1), operands), np.float32)
    results = []

    def report(name, us, **launch):
        row = dict(tree=tag, name=name, us=round(us, 2), tb_s=round(weight_bytes / us / 1e6, 3), **launch)
        results.append(row)
        print(json.dumps(row), flush=True)

    for _ in range(2):
        us = launch_us("grouped_gemm_swiglu", main_fn, LAYERS, REPEATS, operands)
        report("the tree's grouped_gemm_swiglu", us)
    if sys.argv[3:] == ["tree"]:
        json.dump(results, open(out_path, "w"), indent=1)
        return
    real = int(sum(-(-s // BLOCK_M) for s in sizes))
    bound = max_sized_tiles(rows, BLOCK_M, GROUPS)
    sms = num_sms()
    for tiles, tile_major, programs in [(real, True, None), (real, False, None), (bound, True, None),
                                        (bound, False, None), (bound, True, 2 * sms), (bound, True, sms),
                                        (real, True, None)]:
        packed = jnp.asarray(packed_tiles(sizes, 1 << (tiles - 1).bit_length()))
        def fn(layer, ops, packed=packed, tiles=tiles, tile_major=tile_major, programs=programs):
            return table_swiglu(ops[0], ops[1], ops[2], packed, tiles, layer, tile_major=tile_major,
                                programs=programs)
        got = np.asarray(jax.jit(fn)(jnp.int32(1), operands), np.float32)
        us = launch_us("table_swiglu", fn, LAYERS, REPEATS, operands)
        report("table", us, tiles=tiles, real_tiles=real, order="tile-major" if tile_major else "column-major",
               programs=programs, max_diff=float(np.abs(got - want).max()), max_out=float(np.abs(want).max()))
    json.dump(results, open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
