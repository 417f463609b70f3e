"""Grouped GEMM for routed experts that reads only the experts in use (decode-sized batches).

``out[r] = x[r] @ w[g(r)]^T`` for rows sorted by group (expert), ``group_sizes[g]`` rows each.
XLA's ``ragged_dot`` streams every expert's weights whatever the group sizes; here each program
owns one (tile of at most ``block_m`` rows of one group) x (``block_n`` output columns) and loads
only that group's weight slice, so a decode step reads just the selected experts. The tile
schedule (group, first row, group end) is computed in plain XLA and read by the kernel as data.

An fp8 weight (float8_e4m3fn with float32 128x128 block scales) is dequantised tile by tile in
the kernel, to x's dtype, as ``weight_dequant`` then a matmul would: the "bf16" GEMM path.

The kernel reads an fp8 weight as pairs of bytes (a uint16 view) and x with each 128-column
block's even columns before its odd ones. The reason is a limit of Pallas' Triton lowering
(jax 0.11.2): it indexes a ref with 32-bit signed element offsets whenever the ref holds at most
2^32 bytes, so a 1-byte ref of 2^31..2^32 elements (one V3 MoE layer's experts: 256 x 2048 x
7168) is addressed out of bounds (CUDA_ERROR_ILLEGAL_ADDRESS, or NaN from the wrong bytes when
the stack is larger). As uint16 the same bytes are half as many elements, always addressable.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import BLOCK, FP8, cdiv, fail, interpret_in_shard_map, match_vma, result, use_interpret, vma_union

_FN = "grouped_gemm"


def grouped_gemm_ref(x: jax.Array, w: jax.Array, group_sizes: jax.Array, w_scale: jax.Array | None = None,
                     out_dtype=jnp.float32) -> jax.Array:
    """The plain-XLA twin: dequantise (if fp8) then `ragged_dot`; rows past the groups are zero."""
    if w_scale is not None:
        full = jnp.repeat(jnp.repeat(w_scale, BLOCK, axis=1), BLOCK, axis=2)[:, : w.shape[1], : w.shape[2]]
        w = (w.astype(jnp.float32) * full).astype(x.dtype)
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    out = jax.lax.ragged_dot_general(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), dims,
                                     preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def grouped_gemm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, w_scale: jax.Array | None = None,
                 *, layer: jax.Array | int | None = None, out_dtype=jnp.float32, block_m: int = 16,
                 block_n: int = 64, num_warps: int = 4, num_stages: int = 3) -> jax.Array:
    """Rows of x (M, K), sorted by group, times their group's w (G, N, K) transposed -> (M, N).

    Args:
      x: bfloat16/float32 (M, K), K a multiple of 128.
      w: (G, N, K) in x's dtype, or float8_e4m3fn with w_scale float32 (G, ceil(N/128), K/128).
        With `layer`, w is a stack (L, G, N, K) (w_scale (L, G, ...)) and layer[()] picks one: the
        kernel indexes the stack itself, so a layer loop need not copy its slice out first.
      group_sizes: int32 (G,): rows of each group, in order; rows past their sum come out zero.
      block_m, block_n: rows and output columns per program (powers of two >= 16; block_n <= 128
        with an fp8 weight, so that one scale covers a tile's columns).
    """
    stacked = layer is not None
    if stacked != (w.ndim == 4):
        fail(_FN, f"w has shape {tuple(w.shape)}: a stack (L, G, N, K) goes with `layer`, (G, N, K) without")
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    m, k = _check(x, w[0] if stacked else w, group_sizes, None if w_scale is None else
                  (w_scale[0] if stacked else w_scale), block_m, block_n)
    n = w.shape[-2]
    interpret = use_interpret()
    if m == 0 or n == 0 or interpret_in_shard_map(interpret, x, w, group_sizes):
        if stacked:
            w = jax.lax.dynamic_index_in_dim(w, layer, 0, keepdims=False)
            w_scale = None if w_scale is None else jax.lax.dynamic_index_in_dim(w_scale, layer, 0, keepdims=False)
        return grouped_gemm_ref(x, w, group_sizes, w_scale, out_dtype)
    if not stacked:
        w, w_scale = w[None], None if w_scale is None else w_scale[None]
    if w_scale is not None:
        w, x = byte_pairs(w), even_odd_columns(x)
    schedule, max_tiles = tile_schedule(group_sizes.astype(jnp.int32), m, block_m, layer)
    vma = vma_union(x, w, group_sizes)
    operands = [schedule, jnp.pad(x, ((0, block_m), (0, 0))), w] + ([w_scale] if w_scale is not None else [])
    operands = match_vma(vma, *operands)
    zeros = match_vma(vma, jnp.zeros((m + block_m, n), out_dtype))[0]
    kernel = functools.partial(_kernel, n=n, k=k, block_m=block_m, block_n=block_n, fp8=w_scale is not None)
    out = pl.pallas_call(
        kernel,
        out_shape=result((m + block_m, n), out_dtype, vma),
        grid=(max_tiles, cdiv(n, block_n)),
        input_output_aliases={len(operands): 0},  # the zeroed output: rows no tile owns stay zero
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_gemm",
    )(*operands, zeros)
    return out[:m]


def byte_pairs(w: jax.Array) -> jax.Array:
    """A 1-byte (..., K) array viewed as uint16 (..., K/2): byte 2i in the low half of word i."""
    return jax.lax.bitcast_convert_type(w.reshape(*w.shape[:-1], w.shape[-1] // 2, 2), jnp.uint16)


def even_odd_columns(x: jax.Array) -> jax.Array:
    """x (M, K) with each 128-column block reordered as its 64 even columns, then its 64 odd ones,
    to meet the low and high bytes of `byte_pairs` (a copy of x: small next to the weights)."""
    m, k = x.shape
    return x.reshape(m, k // BLOCK, BLOCK // 2, 2).swapaxes(2, 3).reshape(m, k)


def _unpack_fp8_pairs(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint16 words -> (low bytes, high bytes) as float32 values of their e4m3 codes."""
    low = jax.lax.bitcast_convert_type((words & jnp.uint16(0xFF)).astype(jnp.uint8), FP8)
    high = jax.lax.bitcast_convert_type((words >> jnp.uint16(8)).astype(jnp.uint8), FP8)
    return low.astype(jnp.float32), high.astype(jnp.float32)


def tile_schedule(group_sizes: jax.Array, m: int, block_m: int, layer=0) -> tuple[jax.Array, int]:
    """int32 (5, T): per tile its group, first row, the group's end row, 1 if the tile exists, and
    the weight stack's layer.

    T = ceil(M / block_m) + min(G, M) bounds the tiles of any split of M rows into G groups.
    """
    groups = group_sizes.shape[0]
    max_tiles = cdiv(m, block_m) + min(groups, m)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    tiles = (group_sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles)
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    # compare_all: one fused comparison; the default "scan" method is a loop (a device round trip per
    # iteration on a GPU) that would run inside every MoE layer
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right", method="compare_all"), groups - 1).astype(jnp.int32)
    first_tile = tile_ends[group] - tiles[group]
    row = starts[group] + (t - first_tile) * block_m
    exists = (t < tile_ends[-1]).astype(jnp.int32)
    layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (max_tiles,))
    return jnp.stack([group, row, ends[group], exists, layers]).astype(jnp.int32), max_tiles


def _kernel(sched_ref, x_ref, w_ref, *refs, n, k, block_m, block_n, fp8):
    scale_ref = refs[0] if fp8 else None
    o_ref = refs[-1]
    tile, j = pl.program_id(0), pl.program_id(1)

    @pl.when(sched_ref[3, tile] > 0)
    def _():
        group, row, end, layer = sched_ref[0, tile], sched_ref[1, tile], sched_ref[2, tile], sched_ref[4, tile]
        row_ok = (row + jnp.arange(block_m)) < end
        col_ok = (j * block_n + jnp.arange(block_n)) < n
        rows, cols = pl.ds(row, block_m), pl.ds(j * block_n, block_n)

        def dot(xb, wb):
            precision = jax.lax.Precision.HIGHEST if xb.dtype == jnp.float32 else None  # no tf32 for float32
            return jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32)

        def body(kb, acc):
            # masked rows / columns hold garbage that reaches only output rows / columns not stored
            start = pl.multiple_of(kb * BLOCK, BLOCK)
            if not fp8:
                xb = plgpu.load(x_ref.at[rows, pl.ds(start, BLOCK)], mask=row_ok[:, None])
                wb = plgpu.load(w_ref.at[layer, group, cols, pl.ds(start, BLOCK)], mask=col_ok[:, None])
                return acc + dot(xb, wb)
            half = BLOCK // 2  # the block's even columns of x meet the low bytes, its odd ones the high
            x_even = plgpu.load(x_ref.at[rows, pl.ds(start, half)], mask=row_ok[:, None])
            x_odd = plgpu.load(x_ref.at[rows, pl.ds(start + half, half)], mask=row_ok[:, None])
            words = plgpu.load(w_ref.at[layer, group, cols, pl.ds(pl.multiple_of(kb * half, half), half)],
                               mask=col_ok[:, None])
            scale = scale_ref[layer, group, (j * block_n) // BLOCK, kb]
            w_even, w_odd = _unpack_fp8_pairs(words)
            return (acc + dot(x_even, (w_even * scale).astype(x_even.dtype))
                    + dot(x_odd, (w_odd * scale).astype(x_odd.dtype)))

        acc = jax.lax.fori_loop(0, k // BLOCK, body, jnp.zeros((block_m, block_n), jnp.float32))
        plgpu.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


def _check(x, w, group_sizes, w_scale, block_m, block_n) -> tuple[int, int]:
    if x.ndim != 2 or w.ndim != 3 or group_sizes.ndim != 1:
        fail(_FN, f"expects x (M, K), w (G, N, K), group_sizes (G,); got {x.shape}, {w.shape}, {group_sizes.shape}")
    m, k = x.shape
    groups, n, kw = w.shape
    if kw != k:
        fail(_FN, f"w has shape {tuple(w.shape)}, expected (G, N, {k}) with K from x")
    if k % BLOCK:
        fail(_FN, f"x has last dim K={k}, which must be a multiple of {BLOCK}")
    if group_sizes.shape[0] != groups:
        fail(_FN, f"group_sizes has {group_sizes.shape[0]} entries for {groups} groups in w")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        fail(_FN, f"group_sizes has dtype {group_sizes.dtype}, expected an integer type")
    if x.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        fail(_FN, f"x has dtype {x.dtype}, expected bfloat16, float16 or float32")
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            fail(_FN, f"{name}={value} must be a power of two >= 16")
    if w_scale is None:
        if w.dtype != x.dtype:
            fail(_FN, f"w has dtype {w.dtype}; without w_scale it must match x ({x.dtype})")
    else:
        if w.dtype != FP8:
            fail(_FN, f"w has dtype {w.dtype}; with w_scale it must be float8_e4m3fn")
        want = (groups, cdiv(n, BLOCK), k // BLOCK)
        if tuple(w_scale.shape) != want or w_scale.dtype != jnp.float32:
            fail(_FN, f"w_scale has shape {tuple(w_scale.shape)} {w_scale.dtype}, expected float32 {want}")
        if block_n > BLOCK or BLOCK % block_n:
            fail(_FN, f"block_n={block_n} must divide {BLOCK} with an fp8 weight")
    return m, k
