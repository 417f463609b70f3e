"""Grouped expert GEMM on Hopper's wgmma (Pallas Mosaic GPU) for prefill-sized steps.

``out[r] = x[r] @ w[g(r)]^T`` for rows sorted by group, as `grouped.grouped_gemm` computes it,
but through the Mosaic GPU backend: TMA copies x and w tiles into swizzled shared memory, a
pipelined K loop (`plgpu.emit_pipeline`, `max_concurrent_steps` tiles in flight) feeds bf16
wgmma with a float32 register accumulator, and a persistent grid (one program per SM) walks
the (row tile, column tile) pairs. The Triton kernel issues mma.sync on 64x128 tiles, which
leaves Hopper's tensor cores short of their peak; wgmma on 128x128 tiles is what Hopper needs.

Only the experts in use are read: the tiles come from `aligned_tile_schedule`, computed in XLA
and read by the kernel from global memory. A tile is one group's rows within one block of
block_m rows aligned to block_m (a block holding rows of several groups is one tile per group:
the TMA box of x must start at a row the compiler can prove a multiple of the shared-memory
tiling). Rows past the groups' sum form one extra "zero group" whose tiles store zeros without
a K loop, so the output needs no zero-filled buffer of its own. A tile's rows are stored from
shared memory with a ladder of TMA stores of 2^i rows (a TMA box has a static shape, the number
of rows is known only at run time), so neighbouring groups' rows are never overwritten.

Supported (the rest of `grouped_gemm`'s contract stays on the Triton kernel, see
`mosaic_supports`): bf16 x; bf16 w (G, N, K), or fp8 w with 128x128 block scales, dequantised
tile by tile into shared memory as bf16 before the wgmma (gemm_impl "bf16" semantics; one
warpgroup only); a layer stack (L, G, N, K) indexed in place by `layer` (the TMA descriptor
covers the whole stack, with 64-bit addresses); `row_scale`; float32 or bf16 output. N must be
a multiple of the block's columns, K of block_k.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._common import BLOCK, FP8, SHARED_MEMORY_BYTES, cdiv, fail, match_vma, num_sms, result, use_interpret, vma_union

_FN = "grouped_gemm_mgpu"
_SWIGLU_FN = "grouped_swiglu_mgpu"
MOSAIC_MIN_ROWS = 2048  # dispatch: steps with more rows than this (prefill) take the wgmma kernel
MOSAIC_AUTO_FP8 = False  # dispatch: fp8 weights stay on Triton under "auto" (Mosaic is not the faster one for them)


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tile sizes and pipeline depth of `grouped_gemm_mgpu` (the knobs a benchmark sweeps).

    block_m x block_n is one warpgroup's float32 accumulator (128 x 128: 128 registers a thread);
    block_k is one pipeline step's K extent (64 bf16 = one 128-byte swizzle row);
    max_concurrent_steps is how many K steps' tiles are in flight in shared memory. The
    persistent loop walks (row tile, column tile) pairs row by row when grid_tile_width is 0 (a
    row tile's x stays in L2 while all its columns are computed, and the few groups in flight
    keep their weights there), else in bands of grid_tile_width row tiles, column after column
    (`plgpu.planar_snake` with the row dimension minor).
    compute_wgs 1: one warpgroup issues both TMA and wgmma (`plgpu.emit_pipeline`); 2: warp
    specialisation (`plgpu.emit_pipeline_warp_specialized`), a memory warpgroup feeding two
    compute warpgroups whose block_m x block_n tiles sit side by side along wg_split ("n": a
    block tile of block_m x 2 block_n, "m": 2 block_m x block_n). epi_n: columns of the result
    stored at a time through shared memory (0: block_n; 64 halves a float32 128 x 128 tile's
    64 KiB, which makes room for more pipeline steps).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_tile_width: int = 0
    compute_wgs: int = 1
    wg_split: str = "n"
    epi_n: int = 0

    @classmethod
    def parse(cls, text: str) -> "MosaicTiles":
        """'block_m=128,max_concurrent_steps=4,compute_wgs=2,wg_split=m' -> MosaicTiles (unnamed
        fields default)."""
        fields = {f.name: f.type for f in dataclasses.fields(cls)}
        kwargs = {}
        for item in filter(None, text.split(",")):
            key, _, value = (part.strip() for part in item.partition("="))
            if key not in fields or not (value.isdigit() or (key == "wg_split" and value)):
                raise ValueError(f"MosaicTiles: bad item {item!r} in {text!r}; expected NAME=VALUE with NAME in "
                                 f"{sorted(fields)}")
            kwargs[key] = value if key == "wg_split" else int(value)
        return cls(**kwargs)

    def label(self) -> str:
        """A short name for tables: block_m x block_n x block_k, steps, warpgroups/split, epi_n, order."""
        wgs = "1wg" if self.compute_wgs == 1 else f"2wg-{self.wg_split}"
        return (f"{self.block_m}x{self.block_n}x{self.block_k} s{self.max_concurrent_steps} {wgs} "
                f"e{self.epi_cols} w{self.grid_tile_width}")

    @property
    def cta_m(self) -> int:
        """Rows of one block's tile (the schedule's row block)."""
        return self.block_m * (2 if self.compute_wgs == 2 and self.wg_split == "m" else 1)

    @property
    def cta_n(self) -> int:
        """Output columns of one block's tile."""
        return self.block_n * (2 if self.compute_wgs == 2 and self.wg_split == "n" else 1)

    def smem_bytes(self, out_dtype, fp8: bool = False, weights: int = 1) -> int:
        """Shared memory the kernel allocates: the pipeline's x and w tiles (`weights` of them a step: 2 in
        the SwiGLU kernel), the output tile(s) (and with fp8 weights two bf16 tiles of the dequantised weight)."""
        stage = (self.cta_m * 2 + weights * self.cta_n * (1 if fp8 else 2)) * self.block_k
        return (self.max_concurrent_steps * stage + (2 * self.block_n * self.block_k * 2 if fp8 else 0)
                + self.compute_wgs * self.block_m * self.epi_cols * jnp.dtype(out_dtype).itemsize)

    @property
    def epi_cols(self) -> int:
        """Columns of the result stored at a time (epi_n, or block_n when 0)."""
        return self.epi_n or self.block_n


# the SwiGLU kernel's default: two 128 x 64 float32 accumulators (w1's and w3's columns) in one warpgroup
SWIGLU_TILES = MosaicTiles(block_n=64)


def mosaic_supports(x: jax.Array, w: jax.Array, w_scale, out_dtype, tiles: MosaicTiles = MosaicTiles(),
                    swiglu: bool = False) -> str | None:
    """None if `grouped_gemm_mgpu` (`swiglu`: `grouped_swiglu_mgpu`) computes this call, else the reason it does
    not (a phrase)."""
    if swiglu and (w_scale is not None or tiles.compute_wgs != 1):
        return "the SwiGLU kernel takes bf16 weights and one warpgroup (compute_wgs=1)"
    if x.dtype != jnp.bfloat16:
        return f"x {jnp.dtype(x.dtype).name}, not bf16"
    if w_scale is None and w.dtype != jnp.bfloat16:
        return f"weights {jnp.dtype(w.dtype).name} without scales, not bf16"
    if w_scale is not None:
        if w.dtype != FP8:
            return f"weights {jnp.dtype(w.dtype).name} with scales, not float8_e4m3fn"
        if tiles.compute_wgs != 1 or BLOCK % tiles.block_n or BLOCK % tiles.block_k:
            return f"fp8 weights need compute_wgs=1 and block_n, block_k dividing {BLOCK} (tiles {tiles.label()})"
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        return f"out_dtype {jnp.dtype(out_dtype).name}"
    n, k = w.shape[-2:]
    if n % tiles.cta_n or k % tiles.block_k:
        return f"N={n} or K={k} not a multiple of the tile's {tiles.cta_n} columns / block_k={tiles.block_k}"
    return None


def _check_arguments(x, w, group_sizes, w_scale, layer, row_scale, out_dtype, tiles: MosaicTiles, w3=None) -> None:
    """`grouped_gemm_mgpu`'s argument checks (with `w3`: `grouped_swiglu_mgpu`'s): one clear error naming the
    argument at fault."""
    fn = _FN if w3 is None else _SWIGLU_FN
    if w3 is not None and (w3.shape != w.shape or w3.dtype != w.dtype):
        fail(fn, f"w1 and w3 must have one shape and dtype; got {tuple(w.shape)} {w.dtype} and {tuple(w3.shape)} "
                 f"{w3.dtype}")
    stacked = layer is not None
    if stacked != (w.ndim == 4):
        fail(fn, f"w has shape {tuple(w.shape)}: a stack (L, G, N, K) goes with `layer`, (G, N, K) without")
    if x.ndim != 2 or w.ndim not in (3, 4) or group_sizes.ndim != 1:
        fail(fn, f"expects x (M, K), w (G, N, K), group_sizes (G,); got {x.shape}, {w.shape}, {group_sizes.shape}")
    m, k = x.shape
    groups, n, kw = w.shape[-3:]
    if kw != k:
        fail(fn, f"w has shape {tuple(w.shape)}, expected (..., G, N, {k}) with K from x")
    if group_sizes.shape[0] != groups:
        fail(fn, f"group_sizes has {group_sizes.shape[0]} entries for {groups} groups in w")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        fail(fn, f"group_sizes has dtype {group_sizes.dtype}, expected an integer type")
    reason = mosaic_supports(x, w, w_scale, out_dtype, tiles, swiglu=w3 is not None)
    if reason:
        fail(fn, f"unsupported: {reason}")
    fp8 = w_scale is not None
    if fp8:
        want = (*w.shape[:-2], cdiv(n, BLOCK), k // BLOCK)
        if tuple(w_scale.shape) != want or w_scale.dtype != jnp.float32:
            fail(fn, f"w_scale has shape {tuple(w_scale.shape)} {w_scale.dtype}, expected float32 {want}")
    if row_scale is not None and (row_scale.shape != (m,) or row_scale.dtype != jnp.float32):
        fail(fn, f"row_scale has shape {tuple(row_scale.shape)} {row_scale.dtype}, expected float32 ({m},)")
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    if (bm % 64 or bn % 64 or bk % 64 or tiles.max_concurrent_steps < 2 or tiles.grid_tile_width < 0
            or tiles.compute_wgs not in (1, 2) or tiles.wg_split not in ("m", "n") or tiles.epi_cols % 64
            or bn % tiles.epi_cols):
        fail(fn, f"tiles {tiles}: block_m, block_n, block_k must be multiples of 64, max_concurrent_steps >= 2, "
                  f"grid_tile_width >= 0, compute_wgs 1 or 2, wg_split 'm' or 'n', epi_n 0 or a multiple of 64 "
                  f"dividing block_n")
    smem = tiles.smem_bytes(out_dtype, fp8, weights=1 if w3 is None else 2)
    if smem > SHARED_MEMORY_BYTES:
        fail(fn, f"tiles {tiles} need {smem} bytes of shared memory, more than {SHARED_MEMORY_BYTES}")


def grouped_gemm_mgpu(x: jax.Array, w: jax.Array, group_sizes: jax.Array, w_scale: jax.Array | None = None, *,
                      layer: jax.Array | int | None = None,
                      row_scale: jax.Array | None = None, out_dtype=jnp.float32,
                      tiles: MosaicTiles = MosaicTiles(), interpret: bool | None = None) -> jax.Array:
    """Rows of x (M, K) bf16, sorted by group, times their group's w (G, N, K) bf16 transposed.

    Args:
      x: bfloat16 (M, K).
      w: bfloat16 (G, N, K), or float8_e4m3fn with w_scale float32 (G, ceil(N/128), K/128): each
        fp8 tile is dequantised in the kernel (w * its 128x128 block's scale, rounded to bf16, as
        `weight_dequant` would) into shared memory before its wgmma. With `layer`, w (and w_scale)
        is a stack (L, G, ...) of which layer[()] is read in place.
      group_sizes: int32 (G,): rows of each group, in order; rows past their sum come out zero.
      row_scale: optional float32 (M,): row r's float32 result times row_scale[r] before the store.
      out_dtype: float32 or bfloat16.
      tiles: tile sizes and pipeline depth (`MosaicTiles`).
      interpret: run in Mosaic GPU interpret mode; None: when the default backend is not a GPU
        (False lets a CPU-only test lower the kernel for CUDA).

    Returns (M, N) in out_dtype. Runs compiled on an sm_90 GPU; elsewhere in Mosaic GPU interpret
    mode (a CPU simulation of the threads, TMA and wgmma: slow, for tests at small shapes).
    """
    _check_arguments(x, w, group_sizes, w_scale, layer, row_scale, out_dtype, tiles)
    body = _grouped_gemm_mgpu_kernel if tiles.compute_wgs == 1 else _grouped_gemm_mgpu_ws_kernel
    body = functools.partial(body, row_scale=row_scale is not None, **(dict(fp8=True) if w_scale is not None else {}))
    return _launch(body, x, [w], group_sizes, w_scale, layer, row_scale, out_dtype, tiles, interpret)


def grouped_swiglu_mgpu(x: jax.Array, w1: jax.Array, w3: jax.Array, group_sizes: jax.Array, *,
                        layer: jax.Array | int | None = None, out_dtype=jnp.bfloat16,
                        tiles: MosaicTiles = SWIGLU_TILES, interpret: bool | None = None) -> jax.Array:
    """The gated hidden rows silu(x W1_g^T) * (x W3_g^T) of x's rows, sorted by group, in one launch.

    `grouped_gemm_mgpu`'s rows, groups, layer stacks and persistent grid, with bf16 w1 and w3 of one shape (G, N, K)
    (or (L, G, N, K) with `layer`): each K step brings one x tile and both weights' tiles of the same columns, two
    wgmma accumulators of block_m x block_n float32 each, and the tile's rows leave as silu(a1) * a3, computed in
    float32 and stored in `out_dtype`: no float32 product of w1 or w3 goes through memory. Rows past the groups'
    sum come out zero. One warpgroup (compute_wgs=1); `SWIGLU_TILES` keeps the two accumulators at 128 registers
    a thread.
    """
    _check_arguments(x, w1, group_sizes, None, layer, None, out_dtype, tiles, w3=w3)
    return _launch(_grouped_swiglu_mgpu_kernel, x, [w1, w3], group_sizes, None, layer, None, out_dtype, tiles,
                   interpret)


def _launch(body, x, weights: list, group_sizes, w_scale, layer, row_scale, out_dtype, tiles: MosaicTiles,
            interpret: bool | None) -> jax.Array:
    """`body` on a persistent grid (one program per SM) over the (row tile, column tile) pairs of x's groups, its
    operands the tile schedule, x, `weights` (the first one's (G, N) set the groups and columns), w_scale and the
    padded row_scale where given."""
    m, k = x.shape
    groups, n = weights[0].shape[-3:-1]
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    if layer is None:
        weights, w_scale = [w[None] for w in weights], None if w_scale is None else w_scale[None]
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)

    # rows past the groups' sum: one more group, whose tiles store zeros
    sizes = group_sizes.astype(jnp.int32)
    sizes = jnp.concatenate([sizes, jnp.maximum(m - sizes.sum(), 0)[None]])
    schedule, max_tiles = aligned_tile_schedule(sizes, m, tiles.cta_m, layer)
    m_blocks = cdiv(m, tiles.cta_m) * tiles.cta_m
    interpret = use_interpret() if interpret is None else interpret
    if m_blocks > m and (interpret or m % 8 or m < tiles.cta_m):
        # the last x box reaches past x. A GPU's TMA reads zeros there, but its descriptor needs
        # x's rows in whole 8-row tiles and at least one box of them, and the interpreter's dynamic
        # slice would move the box back inside x instead: then x gets the missing rows for real
        # (a copy of x)
        x = jnp.pad(x, ((0, m_blocks - m), (0, 0)))
    operands = [schedule, x, *weights] + ([w_scale] if w_scale is not None else [])
    if row_scale is not None:
        operands.append(jnp.pad(row_scale, (0, m_blocks - m)))
    vma = vma_union(x, weights[0], group_sizes)  # inside shard_map: operands and result vary alike
    operands = match_vma(vma, *operands)

    kernel = functools.partial(body, groups=groups, n=n, k=k, max_tiles=max_tiles, tiles=tiles)
    threads = {} if tiles.compute_wgs == 1 else dict(num_threads=tiles.compute_wgs + 1, thread_name="wg")
    call = plgpu.kernel(
        kernel,
        out_type=result((m, n), out_dtype, vma),
        grid=(min(num_sms(), max_tiles * (n // tiles.cta_n)),),
        grid_names=("sm",),
        **threads,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    return call(*operands)


def aligned_tile_schedule(group_sizes: jax.Array, m: int, block_m: int, layer=0) -> tuple[jax.Array, int]:
    """int32 (6, T): per tile its group, row block (x rows block*block_m .. +block_m), the first
    and end row of the group within that block, 1 if the tile exists, and the weight stack's layer.

    Row blocks are aligned to block_m (the kernel's TMA boxes must start at a provable multiple of
    the shared-memory tiling); a block holding rows of several groups is one tile per group, so
    T = ceil(M / block_m) + min(G, M) bounds the tiles of any split of M rows into G groups.
    """
    groups = group_sizes.shape[0]
    max_tiles = cdiv(m, block_m) + min(groups, m)
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    first_block = starts // block_m
    tiles = jnp.where(group_sizes > 0, (ends - 1) // block_m - first_block + 1, 0)
    tile_ends = jnp.cumsum(tiles)
    t = jnp.arange(max_tiles, dtype=jnp.int32)
    # compare_all: one fused comparison, not a loop of device round trips (see grouped.tile_schedule)
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right", method="compare_all"), groups - 1).astype(jnp.int32)
    block = first_block[group] + t - (tile_ends[group] - tiles[group])
    lo = jnp.maximum(starts[group], block * block_m)
    hi = jnp.minimum(ends[group], (block + 1) * block_m)
    exists = (t < tile_ends[-1]).astype(jnp.int32)
    layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (max_tiles,))
    return jnp.stack([group, block, lo, hi, exists, layers]).astype(jnp.int32), max_tiles


def _grouped_gemm_mgpu_kernel(sched_gmem, x_gmem, w_gmem, *refs, groups, n, k, max_tiles, tiles, row_scale,
                              fp8=False):
    """One SM's share of the (row tile, column tile) pairs. refs: the weight scales (if fp8),
    row_scale (if given), the output."""
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    scale_gmem = refs[0] if fp8 else None
    rs_gmem = refs[1 if fp8 else 0] if row_scale else None
    o_gmem = refs[-1]
    grid_n = n // bn

    @plgpu.nd_loop((max_tiles * grid_n,), collective_axes="sm")
    def _tile_loop(info: plgpu.NDLoopInfo):
        t, j = _tile_order(info.index[0], max_tiles, grid_n, tiles.grid_tile_width)
        group, block, lo, hi, exists, layer = (sched_gmem[i, t] for i in range(6))

        @pl.when(exists > 0)
        def _():
            start = block * bm  # the x box's first row

            def acc_scope(acc_ref, dequant_smem=None):
                def step(idx, x_smem, w_smem):
                    if fp8:
                        _dequant_step(idx[0], x_smem, w_smem, acc_ref, scale_gmem.at[layer, group, (j * bn) // BLOCK],
                                      dequant_smem, bk)
                    else:
                        plgpu.wgmma(acc_ref, x_smem, w_smem.transpose((1, 0)))
                    # the previous step's wgmma is done: its slot (delay_release=1) may be refilled
                    plgpu.wgmma_wait(1)

                @pl.when(group < groups)  # the zero group keeps the zero-initialised accumulator
                def _():
                    plgpu.emit_pipeline(
                        step,
                        grid=(k // bk,),
                        in_specs=[plgpu.BlockSpec((bm, bk), lambda kb: (0, kb), delay_release=1),
                                  plgpu.BlockSpec((bn, bk), lambda kb: (0, kb), delay_release=1)],
                        max_concurrent_steps=tiles.max_concurrent_steps,
                    )(x_gmem.at[pl.ds(start, bm)], w_gmem.at[layer, group, pl.ds(j * bn, bn)])

                return acc_ref[...]

            # with fp8 weights: two bf16 tiles of the dequantised weight (one read by the wgmma in
            # flight, one being written)
            if fp8:
                acc = pl.run_scoped(lambda smem: pl.run_scoped(lambda acc_ref: acc_scope(acc_ref, smem),
                                                               plgpu.ACC((bm, bn))),
                                    plgpu.SMEM((2, bn, bk), jnp.bfloat16))
            else:
                acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))
            if row_scale:
                acc = acc * _load_rows(rs_gmem, start, bm)[:, None]
            _store_rows(acc, o_gmem, lo - start, lo, hi - lo, j * bn, bm, bn, tiles.epi_cols)


def _grouped_swiglu_mgpu_kernel(sched_gmem, x_gmem, w1_gmem, w3_gmem, o_gmem, *, groups, n, k, max_tiles, tiles):
    """One SM's share of the (row tile, column tile) pairs, as `_grouped_gemm_mgpu_kernel`'s, with two weights:
    a K step issues x @ w1^T and x @ w3^T into their accumulators, the tile stores silu(a1) * a3."""
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k

    @plgpu.nd_loop((max_tiles * (n // bn),), collective_axes="sm")
    def _tile_loop(info: plgpu.NDLoopInfo):
        t, j = _tile_order(info.index[0], max_tiles, n // bn, tiles.grid_tile_width)
        group, block, lo, hi, exists, layer = (sched_gmem[i, t] for i in range(6))

        @pl.when(exists > 0)
        def _():
            start = block * bm

            def acc_scope(acc1, acc3):
                def step(_, x_smem, w1_smem, w3_smem):
                    plgpu.wgmma(acc1, x_smem, w1_smem.transpose((1, 0)))
                    plgpu.wgmma(acc3, x_smem, w3_smem.transpose((1, 0)))
                    # the previous step's two wgmmas are done: their slots (delay_release=1) may be refilled
                    plgpu.wgmma_wait(2)

                @pl.when(group < groups)  # the zero group keeps the zero-initialised accumulators: silu(0) * 0
                def _():
                    w_spec = plgpu.BlockSpec((bn, bk), lambda kb: (0, kb), delay_release=1)
                    plgpu.emit_pipeline(
                        step,
                        grid=(k // bk,),
                        in_specs=[plgpu.BlockSpec((bm, bk), lambda kb: (0, kb), delay_release=1), w_spec, w_spec],
                        max_concurrent_steps=tiles.max_concurrent_steps,
                    )(x_gmem.at[pl.ds(start, bm)], w1_gmem.at[layer, group, pl.ds(j * bn, bn)],
                      w3_gmem.at[layer, group, pl.ds(j * bn, bn)])

                return acc1[...], acc3[...]

            a1, a3 = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)), plgpu.ACC((bm, bn)))
            hidden = a1 / (1.0 + jnp.exp(-a1)) * a3  # silu(a1) * a3 in float32
            _store_rows(hidden, o_gmem, lo - start, lo, hi - lo, j * bn, bm, bn, tiles.epi_cols)


def _grouped_gemm_mgpu_ws_kernel(sched_gmem, x_gmem, w_gmem, *refs, groups, n, k, max_tiles, tiles, row_scale):
    """The warp-specialised variant: warpgroups 0 and 1 compute, warpgroup 2 issues the TMA loads.

    Every warpgroup walks the same tiles (the schedule is read by all); a tile of the zero group
    skips the pipeline and the compute warpgroups store zeros."""
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    cta_m, cta_n, split_m = tiles.cta_m, tiles.cta_n, tiles.wg_split == "m"
    rs_gmem = refs[0] if row_scale else None
    o_gmem = refs[-1]
    grid_n = n // cta_n

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k // bk,), memory_registers=40,
            in_specs=[plgpu.BlockSpec((cta_m, bk), lambda kb: (0, kb), delay_release=1),
                      plgpu.BlockSpec((cta_n, bk), lambda kb: (0, kb), delay_release=1)],
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=tiles.max_concurrent_steps,
            compute_context=compute_context)

    ignore = lambda *_, **__: None  # noqa: E731  (the bodies do not change what the pipeline allocates)

    @functools.partial(pl.run_scoped, allocations=pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0, 0]),
                       o_smem=plgpu.SMEM((2, bm, tiles.epi_cols), o_gmem.dtype), rs_smem=plgpu.SMEM((2, bm), jnp.float32),
                       barriers=plgpu.Barrier(num_barriers=2), collective_axes="wg")
    def _scope(allocations, o_smem, rs_smem, barriers):
        wg = jax.lax.axis_index("wg")

        @plgpu.nd_loop((max_tiles * grid_n,), collective_axes="sm")
        def _tile_loop(info: plgpu.NDLoopInfo):
            t, j = _tile_order(info.index[0], max_tiles, grid_n, tiles.grid_tile_width)
            group, block, lo, hi, exists, layer = (sched_gmem[i, t] for i in range(6))
            start = block * cta_m
            first = start + wg * bm if split_m else start  # this warpgroup's rows and columns
            col = j * cta_n if split_m else j * cta_n + wg * bn
            own_lo = jnp.clip(lo, first, first + bm)
            own_hi = jnp.clip(hi, first, first + bm)

            def epilogue(acc):
                if row_scale:
                    acc = acc * _load_rows(rs_gmem, first, bm, rs_smem.at[wg], barriers.at[wg])[:, None]
                _store_rows(acc, o_gmem, own_lo - first, own_lo, own_hi - own_lo, col, bm, bn, tiles.epi_cols, o_smem.at[wg])

            def compute_context(eval_pipeline):
                def acc_scope(acc_ref):
                    eval_pipeline(acc_ref)
                    return acc_ref[...]

                epilogue(pl.run_scoped(acc_scope, plgpu.ACC((bm, bn))))

            def mma(_, x_smem, w_smem, acc_ref):
                xs = x_smem.at[pl.ds(wg * bm, bm)] if split_m else x_smem
                ws = w_smem if split_m else w_smem.at[pl.ds(wg * bn, bn)]
                plgpu.wgmma(acc_ref, xs, ws.transpose((1, 0)))
                plgpu.wgmma_wait(1)
                return acc_ref

            @pl.when((exists > 0) & (group < groups))
            def _():
                pipeline(mma, compute_context)(x_gmem.at[pl.ds(start, cta_m)],
                                               w_gmem.at[layer, group, pl.ds(j * cta_n, cta_n)],
                                               allocations=allocations)

            @pl.when((exists > 0) & (group == groups) & (wg < 2))
            def _():
                _store_rows(jnp.zeros((bm, bn), jnp.float32), o_gmem, own_lo - first, own_lo, own_hi - own_lo,
                            col, bm, bn, tiles.epi_cols, o_smem.at[wg])


def _dequant_step(kb, x_smem, w_smem, acc_ref, scales, dequant_smem, bk):
    """One K step with an fp8 weight tile: w * its block's scale (scales: the tile's row of
    per-128-column-block scales), rounded to bf16 into dequant_smem[kb % 2], then the wgmma.

    At most one wgmma is in flight here (the previous step's, reading the other buffer: the
    caller waits after each issue), so the buffer written here is free; the conversion overlaps
    that wgmma."""
    scale = scales[(kb * bk) // BLOCK]
    w = (w_smem[...].astype(jnp.float32) * scale).astype(jnp.bfloat16)
    buf = dequant_smem.at[kb % 2]
    buf[...] = w
    plgpu.commit_smem()
    plgpu.wgmma(acc_ref, x_smem, buf.transpose((1, 0)))


def _tile_order(index, max_tiles, grid_n, width):
    """(row tile, column tile) of the persistent loop's index-th pair (see MosaicTiles)."""
    if width == 0:
        return index // grid_n, index % grid_n
    return plgpu.planar_snake(index, (max_tiles, grid_n), 0, width)


def _load_rows(rs_gmem, start, bm, rs_smem=None, barrier=None):
    """row_scale[start : start + bm] (float32) through shared memory (allocated here unless given:
    a multi-warpgroup kernel must allocate it for all warpgroups at once)."""
    if rs_smem is None:
        return pl.run_scoped(lambda smem, bar: _load_rows(rs_gmem, start, bm, smem, bar),
                             plgpu.SMEM((bm,), jnp.float32), plgpu.Barrier())
    plgpu.copy_gmem_to_smem(rs_gmem.at[pl.ds(start, bm)], rs_smem, barrier)
    plgpu.barrier_wait(barrier)
    return rs_smem[...]


def _store_rows(acc, o_gmem, offset, row, size, col, bm, bn, epi_n, o_smem=None):
    """Rows offset .. offset+size of the (bm, bn) tile `acc` to o_gmem[row : row+size, col : col+bn],
    epi_n columns at a time through o_smem (bm, epi_n) (allocated here unless given: a
    multi-warpgroup kernel must allocate it for all warpgroups at once).

    A TMA box has a static shape: the `size` rows go out as boxes of 2^i rows, one for each bit
    set in `size` (at most log2(bm) + 1 stores)."""
    if o_smem is None:
        return pl.run_scoped(lambda smem: _store_rows(acc, o_gmem, offset, row, size, col, bm, bn, epi_n, smem),
                             plgpu.SMEM((bm, epi_n), o_gmem.dtype))
    for c in range(0, bn, epi_n):
        o_smem[...] = acc[:, c:c + epi_n].astype(o_smem.dtype)
        plgpu.commit_smem()
        done = jnp.int32(0)
        rows = 1 << (bm.bit_length() - 1)
        while rows:
            @pl.when((size & rows) != 0)
            def _():
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(offset + done, rows)],
                                        o_gmem.at[pl.ds(row + done, rows), pl.ds(col + c, epi_n)])

            done = done + (size & rows)
            rows //= 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem is read before it is overwritten
