"""Grouped GEMM for routed experts that reads only the experts in use (decode-sized batches).

``out[r] = x[r] @ w[g(r)]^T`` for rows sorted by group (expert), ``group_sizes[g]`` rows each.
XLA's ``ragged_dot`` streams every expert's weights whatever the group sizes; here each program
owns one (tile of at most ``block_m`` rows of one group) x (``block_n`` output columns) and loads
only that group's weight slice, so a decode step reads just the selected experts. Each program
finds its tile (group, first row, group end) from the group sizes (`sized_tile`); over more than
SIZED_TILE_MAX_GROUPS groups XLA computes the tile table once and the kernel reads it as data.

An fp8 weight (float8_e4m3fn with float32 128x128 block scales) is dequantised tile by tile in
the kernel, to x's dtype, as ``weight_dequant`` then a matmul would: the "bf16" GEMM path.

The routed experts' feed-forward in two launches (fewer kernels per decode layer):
``grouped_gemm_swiglu`` computes h = silu(x W1^T) * (x W3^T) with the x tile loaded once per K
block for both weights, and ``grouped_gemm(..., row_scale=routing weights)`` the down projection
already weighted. Both share one kernel body (`_kernel` over the K loop `_k_loop`) and schedule.

The kernel reads an fp8 weight as pairs of bytes (a uint16 view) and x with each 128-column
block's even columns before its odd ones. The reason is a limit of Pallas' Triton lowering
(jax 0.11.2): it indexes a ref with 32-bit signed element offsets whenever the ref holds at most
2^32 bytes, so a 1-byte ref of 2^31..2^32 elements (one V3 MoE layer's experts: 256 x 2048 x
7168) is addressed out of bounds (CUDA_ERROR_ILLEGAL_ADDRESS, or NaN from the wrong bytes when
the stack is larger). As uint16 the same bytes are half as many elements, always addressable.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import (BLOCK, FP8, SHARED_MEMORY_BYTES, byte_pairs, cdiv, even_odd_columns, fail, fp8_pairs, hopper,
                      interpret_in_shard_map, launch_dependents, match_vma, result, use_interpret, vma_union)
from .grouped_mgpu import (MOSAIC_AUTO_FP8, MOSAIC_MIN_ROWS, SWIGLU_TILES, MosaicTiles, grouped_gemm_mgpu,
                           grouped_swiglu_mgpu, mosaic_supports)
from .reference import grouped_gemm_ref, grouped_gemm_swiglu_ref  # noqa: F401 (re-exported)

_FN = "grouped_gemm"
# launches over at most this many group sizes (V2-Lite's 64 experts and 2 shared chunks) find each program's tile
# in the program (`sized_tile`); over more (V3's 256 experts) XLA builds the tile table once, since each program's
# cumulative sum over 512 sizes then costs more than the table (benchmarks/NOTES.md)
SIZED_TILE_MAX_GROUPS = 128


def grouped_gemm(x: jax.Array, w: jax.Array, group_sizes: jax.Array | None = None, w_scale: jax.Array | None = None,
                 *, row_groups: jax.Array | None = None, layer: jax.Array | int | None = None,
                 row_scale: jax.Array | None = None, out_dtype=jnp.float32, block_m: int = 16, block_n: int = 64,
                 num_warps: int = 4, num_stages: int = 3, backend: str = "auto",
                 mosaic_tiles: MosaicTiles | None = None, shared_w: jax.Array | None = None,
                 shared_w_scale: jax.Array | None = None, x_scale: jax.Array | None = None,
                 slot_experts: jax.Array | None = None, expert_offset=0, x_rows: jax.Array | None = None) -> jax.Array:
    """Rows of x (M, K), sorted by group, times their group's w (G, N, K) transposed -> (M, N).

    The groups of the rows come either as `group_sizes` (rows sorted by group) or as `row_groups`
    (rows in any order, each naming its group): with `row_groups` every row is a tile of its own,
    so no sort and no schedule is computed, at the price of reading a group's weights once per row
    that names it. That suits a decode step of a few tokens, whose (token, choice) slots mostly
    name distinct experts.

    Two kernels compute it: the Triton one below (mma.sync; any shape) and
    `grouped_mgpu.grouped_gemm_mgpu` (wgmma through Pallas Mosaic GPU; bf16 x, group_sizes only),
    which `backend="auto"` picks on an sm_90 GPU for steps of more than MOSAIC_MIN_ROWS rows (prefill)
    with bf16 weights (fp8 weights: with backend="mosaic", or under "auto" once MOSAIC_AUTO_FP8);
    `grouped_gemm_backend` says which one a call takes.

    Args:
      x: bfloat16/float32 (M, K), K a multiple of 128.
      w: (G, N, K) in x's dtype, or float8_e4m3fn with w_scale float32 (G, ceil(N/128), K/128).
        With `layer`, w is a stack (L, G, N, K) (w_scale (L, G, ...)) and layer[()] picks one: the
        kernel indexes the stack itself, so a layer loop need not copy its slice out first.
      group_sizes: int32 (G,): rows of each group, in order; rows past their sum come out zero. With
        `shared_w`, (G + S,): the routed groups' rows, then each shared chunk's.
      row_groups: int32 (M,), instead of group_sizes: the group of each row; rows naming no group
        (< 0 or >= G, e.g. another rank's expert) come out zero.
      row_scale: optional float32 (M,): row r's float32 result is multiplied by row_scale[r] before
        the store (the MoE routing weight of the down projection, without a kernel of its own).
      block_m, block_n: rows and output columns per program (powers of two >= 16; block_n <= 128
        with an fp8 weight, so that one scale covers a tile's columns). Triton kernel only.
      backend: "auto", "triton" or "mosaic" (the latter in Mosaic GPU interpret mode off a GPU).
      mosaic_tiles: the Mosaic kernel's tiles and pipeline depth (default `MosaicTiles()`).
      shared_w: optional (N, S * K) (fp8: with shared_w_scale (ceil(N/128), S * K/128)), with any form of
        the groups: S more groups G .. G + S - 1 that are K-chunks of one wide weight, group G + s its columns
        [s K, (s + 1) K): the down projection of shared experts stored as one MLP (see
        `grouped_gemm_swiglu`'s shared_w1), run as experts every token selects, in the same launch.
        With `layer`, a stack (L, N, S * K) of which the kernel reads the same layer as of w.
      x_scale: with x float8_e4m3fn and an fp8 w, x's float32 (M, K/128) scales (`act_quant`'s pair):
        the products run on the fp8 tensor cores and each K block's partial sum is scaled by
        x_scale * w_scale, fp8_gemm's math (the reference's fp8 GEMM path). Triton kernel only.
      slot_experts: int32 (T, k), instead of group_sizes or row_groups: the experts T tokens chose, k each
        (an MoE decode step's router output); group = expert - `expert_offset` (a rank's first expert),
        ids naming no group come out zero. The rows of x and of the output are the T k slots token-major,
        then with `shared_w` each shared chunk's T rows; row_scale (T k,) weighs the routed slots only.
        Each program finds its rows from the ids: no schedule, sort or padded copy is computed.
      x_rows: optional int32 (M,) with group_sizes: the sorted rows are x[x_rows] (x (T, K), any T; x_scale (T,
        K/128)), gathered by the Triton kernel as it loads its tiles instead of from a gathered copy of x (the
        wgmma kernel takes such a copy).
    """
    groups = _groups(_FN, group_sizes, row_groups, slot_experts, expert_offset, x_rows)
    if shared_w is not None:
        return _grouped(_FN, x, (w,), (w_scale,), groups, layer, row_scale, False, out_dtype, block_m, block_n,
                        num_warps, num_stages, shared=_Shared("k", (shared_w,), (shared_w_scale,)), x_scale=x_scale,
                        x_rows=x_rows)
    tiles = MosaicTiles() if mosaic_tiles is None else mosaic_tiles
    if grouped_gemm_backend(_launch_rows(x, x_rows), w, w_scale, out_dtype=out_dtype, backend=backend,
                            mosaic_tiles=tiles, row_groups=row_groups if slot_experts is None else slot_experts,
                            x_scale=x_scale) == "mosaic":
        return grouped_gemm_mgpu(_gathered(x, x_rows), w, group_sizes, w_scale, layer=layer, row_scale=row_scale,
                                 out_dtype=out_dtype, tiles=tiles)
    return _grouped(_FN, x, (w,), (w_scale,), groups, layer, row_scale, False, out_dtype,
                    block_m, block_n, num_warps, num_stages, x_scale=x_scale, x_rows=x_rows)


BACKENDS = ("auto", "triton", "mosaic")


def grouped_gemm_backend(x: jax.Array, w: jax.Array, w_scale: jax.Array | None = None, *, out_dtype=jnp.float32,
                         backend: str = "auto", mosaic_tiles: MosaicTiles | None = None,
                         row_groups: jax.Array | None = None, x_scale: jax.Array | None = None,
                         swiglu: bool = False, shared: bool = False) -> str:
    """"mosaic" or "triton": the kernel `grouped_gemm` (`swiglu`: `grouped_gemm_swiglu`) runs with these
    arguments (benchmarks record it).

    "auto" takes the wgmma kernel on a GPU of compute capability 9.x when x has more than
    MOSAIC_MIN_ROWS rows (prefill: tall tiles keep the tensor cores busy) and the call is one
    it supports (see `mosaic_supports`; rows given by `row_groups` are not, nor `shared` experts in the
    launch) with bf16 weights (fp8 ones only if MOSAIC_AUTO_FP8, and never in the SwiGLU kernel);
    otherwise, and everywhere off a GPU, Triton.
    """
    fn = _SWIGLU if swiglu else _FN
    if backend not in BACKENDS:
        fail(fn, f"backend is {backend!r}, expected one of {BACKENDS}")
    tiles = (SWIGLU_TILES if swiglu else MosaicTiles()) if mosaic_tiles is None else mosaic_tiles
    reason = ("rows given by row_groups" if row_groups is not None
              else "fp8 activations (x_scale)" if x_scale is not None
              else "shared experts in the launch" if shared else None)
    if backend == "mosaic":
        reason = reason or mosaic_supports(x, w, w_scale, out_dtype, tiles, swiglu)
        if reason:
            fail(fn, f"backend='mosaic' does not support this call: {reason}")
        return "mosaic"
    prefill_sized = hopper() and x.ndim == 2 and x.shape[0] > MOSAIC_MIN_ROWS
    if backend == "auto" and reason is None and prefill_sized and (w_scale is None or MOSAIC_AUTO_FP8) \
            and mosaic_supports(x, w, w_scale, out_dtype, tiles, swiglu) is None:
        return "mosaic"
    return "triton"


def grouped_gemm_swiglu(x: jax.Array, w1: jax.Array, w3: jax.Array, group_sizes: jax.Array | None = None,
                        w1_scale: jax.Array | None = None, w3_scale: jax.Array | None = None, *,
                        row_groups: jax.Array | None = None, layer: jax.Array | int | None = None, out_dtype=None,
                        block_m: int = 16, block_n: int = 64, num_warps: int = 4, num_stages: int = 3,
                        shared_w1: jax.Array | None = None, shared_w3: jax.Array | None = None,
                        shared_w1_scale: jax.Array | None = None, shared_w3_scale: jax.Array | None = None,
                        x_scale: jax.Array | None = None, slot_experts: jax.Array | None = None,
                        expert_offset=0, backend: str = "auto", mosaic_tiles: MosaicTiles | None = None,
                        x_rows: jax.Array | None = None) -> jax.Array:
    """The gated hidden state of routed experts in one launch: h = silu(x W1_g^T) * (x W3_g^T).

    Same rows, groups (`group_sizes` or `row_groups`), weight forms (bf16 or fp8 + 128x128 scales,
    optionally a layer stack with `layer`) and tiles as `grouped_gemm`; w1 and w3 have one shape. Each program
    loads its x tile once and both weights' tiles of the same columns, keeps two float32 accumulators and applies
    silu(a1) * a3 in float32 before storing h in `out_dtype` (default: x's dtype; bfloat16 for fp8 x with
    `x_scale`, grouped_gemm's fp8 products). Rows past the groups come out zero.

    shared_w1, shared_w3 (S * N, K) (fp8: with their scales), with any form of the groups (group_sizes then
    (G + S,)): the shared experts of an MoE layer stored as one MLP of S * N hidden units, run as S more
    groups G .. G + S - 1, group G + s their hidden units [s N, (s + 1) N): experts every token selects, in
    the same launch. With `layer`, stacks (L, S * N, K) read at that layer in place, as w1 and w3 are.

    slot_experts (T, k), expert_offset: as `grouped_gemm`'s, with x (T, K) one row a token: the output's
    rows are the T k routed slots token-major, then each shared chunk's T rows (the down projection's x).

    x_rows (M,) with group_sizes: as `grouped_gemm`'s, the sorted rows gathered from x (T, K) by the kernel.

    backend, mosaic_tiles: as `grouped_gemm`'s (`grouped_gemm_backend` with swiglu=True): prefill-sized steps of
    bf16 weights without shared experts run `grouped_mgpu.grouped_swiglu_mgpu` on sm_90 (default tiles
    `SWIGLU_TILES`).
    """
    if (w1_scale is None) != (w3_scale is None) or w1.shape != w3.shape or w1.dtype != w3.dtype:
        fail(_SWIGLU, f"w1 and w3 must have one shape and dtype and both or neither a scale; got {w1.shape} "
                      f"{w1.dtype} and {w3.shape} {w3.dtype}")
    shared = None
    if shared_w1 is not None or shared_w3 is not None:
        if shared_w1 is None or shared_w3 is None or shared_w1.shape != shared_w3.shape:
            fail(_SWIGLU, "shared_w1 and shared_w3 go together, with one shape")
        shared = _Shared("n", (shared_w1, shared_w3), (shared_w1_scale, shared_w3_scale))
    default_out = jnp.bfloat16 if x_scale is not None else x.dtype
    out_dtype = default_out if out_dtype is None else out_dtype
    groups = _groups(_SWIGLU, group_sizes, row_groups, slot_experts, expert_offset, x_rows)
    tiles = SWIGLU_TILES if mosaic_tiles is None else mosaic_tiles
    if grouped_gemm_backend(_launch_rows(x, x_rows), w1, w1_scale, out_dtype=out_dtype, backend=backend,
                            mosaic_tiles=tiles, row_groups=row_groups if slot_experts is None else slot_experts,
                            x_scale=x_scale, swiglu=True, shared=shared is not None) == "mosaic":
        return grouped_swiglu_mgpu(_gathered(x, x_rows), w1, w3, group_sizes, layer=layer, out_dtype=out_dtype,
                                   tiles=tiles)
    return _grouped(_SWIGLU, x, (w1, w3), (w1_scale, w3_scale), groups, layer,
                    None, True, out_dtype, block_m, block_n, num_warps,
                    num_stages, shared=shared, x_scale=x_scale, x_rows=x_rows)


_SWIGLU = "grouped_gemm_swiglu"


def _launch_rows(x, x_rows):
    """The rows a launch multiplies, as `grouped_gemm_backend` weighs them: x, or x[x_rows]'s shape."""
    return x if x_rows is None else jax.ShapeDtypeStruct((x_rows.shape[0], *x.shape[1:]), x.dtype)


def _gathered(x, x_rows):
    """x[x_rows] as a copy, for the wgmma kernel, whose TMA loads read contiguous rows."""
    return x if x_rows is None else jnp.take(x, x_rows, axis=0)


class _Shared(NamedTuple):
    """Always-selected experts stored as one wide weight per kernel weight (2-D, fp8 with scales): chunked
    along the output ("n": w1, w3 (S N, K)) or the input ("k": w2 (N, S K)); chunk s is group G + s."""

    axis: str
    weights: tuple
    scales: tuple

    def count(self, fn: str, n: int, k: int, fp8: bool, dtype, stacked: bool) -> int:
        """S, the number of chunks, after checking the weights against the routed ones' (N, K); a stack
        of layers (L, ., .) iff the routed weights are one (the kernel indexes the same layer)."""
        shape = tuple(self.weights[0].shape)
        # (the chunked axis, its chunk size, the other axis, its size), counted from the end
        wide, step, other, size = (-2, n, -1, k) if self.axis == "n" else (-1, k, -2, n)
        form = ("(L, " if stacked else "(") + ("S * N, K)" if self.axis == "n" else "N, S * K)")
        if len(shape) != 2 + stacked or shape[other] != size or not shape[wide] or shape[wide] % step:
            fail(fn, f"shared weight has shape {shape}, expected {form} with N={n}, K={k}")
        for weight, scale in zip(self.weights, self.scales, strict=True):
            if (scale is not None) != fp8 or weight.dtype != (FP8 if fp8 else dtype) or weight.shape != shape:
                fail(fn, "shared weights must take the routed weights' form (dtype, and a scale iff fp8), one shape")
            if fp8 and (self.axis == "n" and n % BLOCK or tuple(scale.shape) != shape[:-2] + tuple(
                    cdiv(d, BLOCK) for d in shape[-2:])):
                fail(fn, f"shared fp8 weights {shape} need their 128x128 block scales, and N={n} a multiple of "
                         f"{BLOCK} when chunked by output")
        return shape[wide] // step

    def as_groups(self, count: int, n: int, k: int, pick) -> tuple[tuple, tuple]:
        """The chunks of the weights' layer `pick` takes (from a stack, or the one layer) as a (S, N, K)
        group stack per weight (and (S, ., .) scales): the twin's view."""
        weights, scales = tuple(map(pick, self.weights)), tuple(map(pick, self.scales))
        if self.axis == "n":
            weights = tuple(w.reshape(count, n, k) for w in weights)
            scales = tuple(None if c is None else c.reshape(count, -1, c.shape[-1]) for c in scales)
        else:
            weights = tuple(w.reshape(n, count, k).swapaxes(0, 1) for w in weights)
            scales = tuple(None if c is None else c.reshape(c.shape[0], count, -1).swapaxes(0, 1) for c in scales)
        return weights, scales


class _Slots(NamedTuple):
    """The "slots" form of the groups: expert ids (T, k) of T tokens' k choices, minus `offset` (an int32
    scalar, traced or not) a group."""
    experts: jax.Array
    offset: jax.Array


def _groups(fn: str, group_sizes, row_groups, slot_experts=None, expert_offset=0, x_rows=None) -> tuple[str, object]:
    """("sizes", group_sizes), ("rows", row_groups) or ("slots", _Slots): exactly one form of the groups (x_rows
    only with group_sizes)."""
    given = [name for name, value in (("group_sizes", group_sizes), ("row_groups", row_groups),
                                      ("slot_experts", slot_experts)) if value is not None]
    if len(given) != 1:
        fail(fn, "give the rows' groups as one of group_sizes (rows sorted by group), row_groups or slot_experts; "
                 f"got {' and '.join(given) or 'none'}")
    if x_rows is not None and (group_sizes is None or x_rows.ndim != 1
                               or not jnp.issubdtype(x_rows.dtype, jnp.integer)):
        fail(fn, f"x_rows goes with group_sizes, an integer vector (M,); got {x_rows.dtype} {tuple(x_rows.shape)} "
                 f"with {given[0]}")
    if slot_experts is not None:
        if slot_experts.ndim != 2 or not jnp.issubdtype(slot_experts.dtype, jnp.integer):
            fail(fn, f"slot_experts must be integer (T, k), got {slot_experts.dtype} {tuple(slot_experts.shape)}")
        return "slots", _Slots(slot_experts, jnp.asarray(expert_offset, jnp.int32))
    return ("sizes", group_sizes) if row_groups is None else ("rows", row_groups)


def _slot_layout(fn: str, x, slots: _Slots, n_shared: int, row_scale) -> _SlotLayout:
    """The slots form's row layout, after checking x's rows and row_scale against it."""
    tokens, topk = slots.experts.shape
    layout = _SlotLayout(tokens, topk, n_shared, x_by_token=x.shape[0] != tokens * (topk + n_shared))
    if x.shape[0] not in (tokens, layout.rows):
        fail(fn, f"x has {x.shape[0]} rows; with slot_experts of {tokens} tokens it needs one a token ({tokens}) or "
                 f"one a slot ({layout.rows}: {topk} routed and {n_shared} shared a token)")
    if row_scale is not None and (row_scale.shape != (layout.routed,) or row_scale.dtype != jnp.float32):
        fail(fn, f"row_scale has shape {tuple(row_scale.shape)} {row_scale.dtype}, expected float32 "
                 f"({layout.routed},): the routed slots' weights")
    return layout


def _slot_rows(layout: _SlotLayout, slots: _Slots, n_groups: int, x, x_scale, row_scale):
    """The slots form as the rows form (`row_groups`): what the twin computes from."""
    ids = slots.experts.reshape(-1).astype(jnp.int32) - slots.offset
    shared_groups = n_groups + jnp.repeat(jnp.arange(layout.chunks, dtype=jnp.int32), layout.tokens)
    row_groups = jnp.concatenate([jnp.where((ids >= 0) & (ids < n_groups), ids, -1), shared_groups])
    per_row = lambda a: None if a is None else jnp.concatenate(  # noqa: E731
        [jnp.repeat(a, layout.topk, axis=0), jnp.tile(a, (layout.chunks, 1))])
    x, x_scale = (per_row(x), per_row(x_scale)) if layout.x_by_token else (x, x_scale)
    if row_scale is not None:
        row_scale = jnp.concatenate([row_scale, jnp.ones((layout.rows - layout.routed,), jnp.float32)])
    return ("rows", row_groups), x, x_scale, row_scale


def _grouped(fn, x, ws, scales, groups, layer, row_scale, swiglu, out_dtype, block_m, block_n,
             num_warps, num_stages, shared: _Shared | None = None, x_scale=None, x_rows=None):
    """The shared wrapper: checks, the XLA fallback, the tile schedule and one pallas_call over
    weights `ws` (one for a plain GEMM, w1 and w3 for swiglu), and the `shared` chunks' groups after them;
    with `x_rows` the rows x[x_rows], gathered by the kernel."""
    stacked = layer is not None
    w, w_scale = ws[0], scales[0]
    if stacked != (w.ndim == 4):
        fail(fn, f"w has shape {tuple(w.shape)}: a stack (L, G, N, K) goes with `layer`, (G, N, K) without")
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
    form, group_data = groups
    ids = group_data.experts.reshape(-1) if form == "slots" else group_data
    group_operands = (ids, group_data.offset) if form == "slots" else (ids,) if x_rows is None else (ids, x_rows)
    m, k = _check(fn, x, w[0] if stacked else w, (form, ids), None if w_scale is None else
                  (w_scale[0] if stacked else w_scale), block_m, block_n, x_scale)
    m = m if x_rows is None else x_rows.shape[0]
    if form != "slots" and row_scale is not None and (row_scale.shape != (m,) or row_scale.dtype != jnp.float32):
        fail(fn, f"row_scale has shape {tuple(row_scale.shape)} {row_scale.dtype}, expected float32 ({m},)")
    n, n_groups, fp8 = w.shape[-2], w.shape[-3], w_scale is not None
    n_shared = 0 if shared is None else shared.count(fn, n, k, fp8, x.dtype, stacked)
    if form == "sizes" and ids.shape[0] != n_groups + n_shared:
        fail(fn, f"group_sizes has {ids.shape[0]} entries for {n_groups} groups in w"
                 + (f" and {n_shared} shared chunks" if n_shared else ""))
    slots = None if form != "slots" else _slot_layout(fn, x, group_data, n_shared, row_scale)
    interpret = use_interpret()
    if m == 0 or n == 0 or interpret_in_shard_map(interpret, x, *ws, *group_operands):
        if slots is not None:
            groups, x, x_scale, row_scale = _slot_rows(slots, group_data, n_groups, x, x_scale, row_scale)
        if x_rows is not None:
            x, x_scale = (None if a is None else jnp.take(a, x_rows, axis=0) for a in (x, x_scale))
        return _twin(x, ws, scales, groups, layer if stacked else None, row_scale, swiglu, out_dtype, shared,
                     n_shared, x_scale)
    shared_ws, shared_scales = ((), ()) if shared is None else (shared.weights, shared.scales)
    if not stacked:  # a one-layer stack
        ws, shared_ws = tuple(a[None] for a in ws), tuple(a[None] for a in shared_ws)
        scales, shared_scales = (tuple(None if c is None else c[None] for c in group)
                                 for group in (scales, shared_scales))
    if fp8:
        ws, shared_ws, x = tuple(map(byte_pairs, ws)), tuple(map(byte_pairs, shared_ws)), even_odd_columns(x)
    launch = _Launch(fn, swiglu, fp8, out_dtype, block_m, block_n, num_warps, num_stages, n_groups,
                     None if shared is None else shared.axis, interpret, vma_union(x, *ws, *group_operands))
    weights = ([*ws, *shared_ws] + (list(scales) + list(shared_scales) if fp8 else []))
    if slots is not None:
        # no schedule and no padded copies: each program finds its rows from the ids, loads masked
        table = [layer.reshape(1), group_data.offset.reshape(1), ids.astype(jnp.int32)]
        return launch(x, x_scale, weights, row_scale, table, slots.rows, slots.rows, pad=0, slots=slots)
    # a tile's rows [row, row + block_m) are masked; past decode sizes the refs keep a tile of slack past the
    # last row, as masked loads past the end of the refs measured slower in prefill (benchmarks/NOTES.md), while a
    # decode-sized launch reads masked rather than wait on XLA's padded copies of x, its scales and row_scale
    pad = block_m if m > MOSAIC_MIN_ROWS else 0
    if form == "sizes":
        sizes, programs = group_data.astype(jnp.int32), max_sized_tiles(m, block_m, ids.shape[0])
        if ids.shape[0] <= SIZED_TILE_MAX_GROUPS:  # each program finds its tile: no schedule table from XLA
            return launch(x, x_scale, weights, row_scale, [layer.reshape(1), sizes], m, programs, pad=pad,
                          x_rows=x_rows, sized=True)[:m]
        schedule, _ = tile_schedule(sizes, m, block_m, layer)
        return launch(x, x_scale, weights, row_scale, [schedule], m, programs, pad=pad, x_rows=x_rows)[:m]
    schedule = row_schedule(group_data.astype(jnp.int32), n_groups + n_shared, layer,
                            merge_from=n_groups if n_shared else None, block_m=block_m)
    return launch(x, x_scale, weights, row_scale, [schedule], m, m, pad=pad, x_rows=x_rows)[:m]


class _Launch(NamedTuple):
    """One pallas_call of `_kernel`, with what does not vary between the forms of the groups."""
    fn: str
    swiglu: bool
    fp8: bool
    out_dtype: object
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    n_groups: int
    shared_axis: str | None
    interpret: bool
    vma: frozenset

    def __call__(self, x, x_scale, weights, row_scale, table: list, m: int, programs: int, *, pad: int,
                 slots: _SlotLayout | None = None, x_rows=None, sized: bool = False):
        """Output (m + pad, N) over `programs` row programs; `table` the schedule operands (`sized`: the layer and
        the group sizes, from which each program finds its tile); x, x_scale (or, with `x_rows`, the rows' indices
        into them) and row_scale padded by `pad` rows (their slack, whose output rows are left unwritten). Every
        output row below m is in one program's tile (its group's, its shared run's, or past the groups), which
        stores zeros where the tile does not exist: the output needs no zeroed buffer."""
        n_weights = 2 if self.swiglu else 1
        w, k, n, vma = weights[0], x.shape[1], weights[0].shape[-2], self.vma
        padded = (lambda a: a) if not pad else (  # noqa: E731
            lambda a: jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)))
        by_row = padded if x_rows is None else (lambda a: a)  # noqa: E731 (gathered: x keeps its own rows)
        operands = (table + ([] if x_rows is None else [padded(x_rows.astype(jnp.int32))]) + [by_row(x)]
                    + ([] if x_scale is None else [by_row(x_scale)]) + weights
                    + ([] if row_scale is None else [padded(row_scale)]))
        operands = match_vma(vma, *operands)
        # Triton keeps num_stages copies of a K step's tiles in shared memory: with two weights and tall
        # tiles three stages need more than a Hopper block may have (e.g. swiglu at 64 x 128 in bf16:
        # 3 x 80 KiB), so the pipeline is cut to what fits
        stage_bytes = self.block_m * BLOCK * x.dtype.itemsize + n_weights * self.block_n * BLOCK * (
            1 if self.fp8 else w.dtype.itemsize)
        num_stages = max(1, min(self.num_stages, SHARED_MEMORY_BYTES // stage_bytes))
        kernel = functools.partial(_kernel, n=n, k=k, block_m=self.block_m, block_n=self.block_n,
                                   fp8=self.fp8, n_weights=n_weights, row_scale=row_scale is not None,
                                   swiglu=self.swiglu,
                                   n_groups=self.n_groups, shared_axis=self.shared_axis,
                                   x_scaled=x_scale is not None, x_gathered=x_rows is not None, slots=slots,
                                   m=m, sized_groups=table[1].shape[0] if sized else None)
        return pl.pallas_call(
            kernel,
            out_shape=result((m + pad, n), self.out_dtype, vma),
            grid=(programs, cdiv(n, self.block_n)),
            compiler_params=plgpu.CompilerParams(num_warps=self.num_warps, num_stages=num_stages),
            interpret=self.interpret,
            name=self.fn,
        )(*operands)


def _twin(x, ws, scales, groups, layer, row_scale, swiglu, out_dtype, shared: _Shared | None, n_shared: int,
          x_scale):
    """`_grouped`'s result from the jnp twins: layer `layer` of stacked weights (None: unstacked), the
    shared chunks as more groups."""
    pick = (lambda a: a) if layer is None else (  # noqa: E731
        lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False))
    ws, scales = tuple(map(pick, ws)), tuple(map(pick, scales))
    n, k = ws[0].shape[-2:]
    if n_shared:
        extra_ws, extra_scales = shared.as_groups(n_shared, n, k, pick)
        ws = tuple(jnp.concatenate([a, b]) for a, b in zip(ws, extra_ws))
        scales = tuple(None if a is None else jnp.concatenate([a, b]) for a, b in zip(scales, extra_scales))
    form, group_data = groups
    sizes, row_groups = (group_data, None) if form == "sizes" else (None, group_data)
    if swiglu:
        return grouped_gemm_swiglu_ref(x, *ws, sizes, *scales, out_dtype=out_dtype, row_groups=row_groups,
                                       x_scale=x_scale)
    return grouped_gemm_ref(x, ws[0], sizes, scales[0], out_dtype, row_scale=row_scale, row_groups=row_groups,
                            x_scale=x_scale)


def max_sized_tiles(m: int, block_m: int, groups: int) -> int:
    """T = ceil(M / block_m) + min(G, M): a bound on the tiles of any split of M rows into G groups, which leaves at
    least ceil((M - sum) / block_m) tiles past the groups' ones."""
    return cdiv(m, block_m) + min(groups, m)


def sized_tile_width(groups: int) -> int:
    """The power-of-two length of the group-size vector `sized_tile` reads: past the groups, a spare entry (0)."""
    return max(16, 1 << groups.bit_length())


def sized_tile(group_sizes: jax.Array, tile, *, m: int, block_m: int, groups: int) -> tuple:
    """Tile `tile` of M rows sorted by group, as (group, first row, end row, exists), int32 scalars, from the
    group sizes alone (the first `groups` entries of `group_sizes`, a `sized_tile_width` vector; the rest zeros).
    Each group's rows are tiles of block_m rows in order, ending at the group's end; the tiles past them
    (exists 0, group `groups` - 1) zero the rows past the groups' sum, block_m rows each, up to M: they belong to
    entry `groups`, a spare one whose tiles start where the groups' end and never end. One cumulative sum over
    (tiles, rows) pairs and one sum of the owning entry's four values: a kernel's cross-warp reductions each cost
    barriers before the program's first load (each grouped-kernel program computes its own, up to
    SIZED_TILE_MAX_GROUPS groups)."""
    width = group_sizes.shape[0]
    if width <= groups:
        raise ValueError(f"sized_tile: {width} group sizes leave no spare entry past {groups} groups")
    index = jnp.arange(width, dtype=jnp.int32)
    counts = jnp.stack([(group_sizes + block_m - 1) // block_m, group_sizes], axis=-1)
    ends = jnp.cumsum(counts, axis=0)
    (tile_start, row_start), (tile_end, row_end) = _pair(ends - counts), _pair(ends)
    spare = index == groups
    owner = (tile_start <= tile) & ((tile < tile_end) | spare)
    values = jnp.stack([jnp.stack([jnp.where(spare, -1, index), row_start], axis=-1),
                        jnp.stack([tile_start, jnp.where(spare, m, row_end)], axis=-1)], axis=-1)
    (group, row), (first_tile, end) = map(_pair, _pair(jnp.sum(jnp.where(owner[:, None, None], values, 0), axis=0)))
    exists = group >= 0
    return (jnp.where(exists, group, groups - 1), row + (tile - first_tile) * block_m, end,
            exists.astype(jnp.int32))


def _pair(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """a[..., 0], a[..., 1] of a last axis of two (Triton splits a pair; it takes no other slice of a value)."""
    first, second = jnp.split(a, 2, axis=-1)
    return first.reshape(a.shape[:-1]), second.reshape(a.shape[:-1])


def tile_schedule(group_sizes: jax.Array, m: int, block_m: int, layer=0) -> tuple[jax.Array, int]:
    """int32 (5, T): per tile (`sized_tile`) its group, first row, end row, 1 if the tile exists (0: its rows are
    zeroed), and the weight stack's layer, with T = `max_sized_tiles`: the schedule the kernel's programs compute."""
    groups = group_sizes.shape[0]
    max_tiles = max_sized_tiles(m, block_m, groups)
    padded = jnp.pad(group_sizes.astype(jnp.int32), (0, sized_tile_width(groups) - groups))
    tile = functools.partial(sized_tile, padded, m=m, block_m=block_m, groups=groups)
    group, row, end, exists = jax.vmap(tile)(jnp.arange(max_tiles, dtype=jnp.int32))
    layers = jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (max_tiles,))
    return jnp.stack([group, row, end, exists, layers]).astype(jnp.int32), max_tiles


# schedule code of a row that another row's tile covers: its program does nothing
COVERED = -1


def row_schedule(row_groups: jax.Array, groups: int, layer=0, merge_from: int | None = None,
                 block_m: int = 16) -> jax.Array:
    """The `tile_schedule` of rows that name their groups (M tiles): tile r is row r alone, and
    exists iff the row names one of the `groups` groups. Rows naming groups >= `merge_from` (the
    shared experts, which a step's tokens all select) merge: a run of consecutive rows of one such
    group is read in tiles of up to `block_m` rows, each tile the program of its first row; the other
    rows' programs are COVERED (they do nothing), so the group's weights are read once per tile, not
    once per row."""
    m = row_groups.shape[0]
    rows = jnp.arange(m, dtype=jnp.int32)
    exists = ((row_groups >= 0) & (row_groups < groups)).astype(jnp.int32)
    ends = rows + 1
    if merge_from is not None and m:
        merges = (row_groups >= merge_from) & (row_groups < groups)
        same = jnp.concatenate([jnp.zeros((1,), bool), merges[1:] & (row_groups[1:] == row_groups[:-1])])
        run_start = jax.lax.cummax(jnp.where(same, 0, rows))
        run_end = jax.lax.cummin(jnp.where(jnp.concatenate([~same[1:], jnp.ones((1,), bool)]), rows + 1, m),
                                 reverse=True)
        first = (rows - run_start) % block_m == 0
        ends = jnp.where(merges, jnp.minimum(rows + block_m, run_end), ends)
        exists = jnp.where(merges & ~first, COVERED, exists)
    return jnp.stack([jnp.clip(row_groups, 0, groups - 1), rows, ends, exists,
                      jnp.broadcast_to(jnp.asarray(layer, jnp.int32), (m,))])


class _Tile(NamedTuple):
    """What a program computes: `exists` 1 (its tile), 0 (zeros over its rows) or COVERED
    (nothing); the group and weight layer; output rows [row, end), read from x's rows [x_row, x_row + end - row)."""
    exists: jax.Array
    group: jax.Array
    layer: jax.Array
    row: jax.Array
    end: jax.Array
    x_row: jax.Array


def _sized_program_tile(layer_ref, sizes_ref, tile, *, groups: int, m: int, block_m: int) -> _Tile:
    """Tile `tile` of the sorted rows (`sized_tile`), from the group sizes loaded as a power-of-two vector."""
    width = sized_tile_width(groups)
    sizes = plgpu.load(sizes_ref.at[pl.ds(0, width)], mask=jnp.arange(width) < groups, other=0)
    group, row, end, exists = sized_tile(sizes, tile, m=m, block_m=block_m, groups=groups)
    return _Tile(exists, group, layer_ref[0], row, end, row)


def _scheduled_tile(sched_ref, tile) -> _Tile:
    """Tile `tile` of a `tile_schedule` / `row_schedule` table (x's rows are the output's)."""
    return _Tile(sched_ref[3, tile], sched_ref[0, tile], sched_ref[4, tile], sched_ref[1, tile], sched_ref[2, tile],
                 sched_ref[1, tile])


class _SlotLayout(NamedTuple):
    """The "slots" form's rows: `tokens` x `topk` routed slots token-major, then `chunks` shared groups' rows
    chunk-major, one per token; routed slot (t, c) names expert ids[t topk + c], its group that minus the
    offset operand. x holds a row per token (`x_by_token`: the swiglu's input) or per output row (the down
    projection's)."""
    tokens: int
    topk: int
    chunks: int
    x_by_token: bool

    @property
    def routed(self) -> int:
        return self.tokens * self.topk

    @property
    def rows(self) -> int:
        return self.tokens * (self.topk + self.chunks)


def _slot_tile(layer_ref, offset_ref, ids_ref, tile, *, slots: _SlotLayout, n_groups: int, block_m: int) -> _Tile:
    """Program `tile` of the slots form, from the expert ids alone (no schedule table): a routed slot is a
    tile of its own row; a shared chunk's rows go in tiles of up to block_m tokens, each the program of its
    first row (the others COVERED), so the chunk's weights are read once per tile."""
    routed = tile < slots.routed
    group = ids_ref[jnp.minimum(tile, slots.routed - 1)] - offset_ref[0]
    named = ((group >= 0) & (group < n_groups)).astype(jnp.int32)
    shared_row = jnp.maximum(tile - slots.routed, 0)
    chunk, token = shared_row // slots.tokens, shared_row % slots.tokens
    # typed constants: Triton's lowering gives a weak literal of a scalar select the predicate's type (i1)
    first = jnp.where(token % block_m == 0, jnp.int32(1), jnp.int32(COVERED))
    end = jnp.minimum(tile + block_m, slots.routed + (chunk + 1) * slots.tokens)
    x_row = jnp.where(routed, tile // slots.topk, token) if slots.x_by_token else tile
    return _Tile(jnp.where(routed, named, first), jnp.where(routed, jnp.clip(group, 0, n_groups - 1), n_groups + chunk),
                 layer_ref[0], tile, jnp.where(routed, tile + 1, end), x_row)


def _kernel(*refs, n, k, block_m, block_n, fp8, n_weights, row_scale, swiglu, n_groups, shared_axis,
            x_scaled, x_gathered=False, slots: _SlotLayout | None = None, m: int = 0, sized_groups: int | None = None):
    """One (row tile, column tile) program. refs: the schedule table (with `sized_groups`, the layer and the
    group sizes of m sorted rows; with `slots`, the layer, the expert offset and the expert ids), the rows'
    indices into x (if `x_gathered`), x, x's scales (if `x_scaled`), the weights (n_weights), the shared chunks'
    wide weights (n_weights, if `shared_axis`), the scales of both (if fp8), row_scale (if given; with `slots` the
    routed rows' only), then the output, where a tile that does not exist stores zeros over its rows."""
    tile, j = launch_dependents(pl.program_id(0)), pl.program_id(1)
    info, rows_ref, x_ref, refs = _program_tile(refs, tile, slots=slots, n_groups=n_groups, block_m=block_m,
                                                x_gathered=x_gathered, m=m, sized_groups=sized_groups)
    x_scale_ref, refs = (refs[0], refs[1:]) if x_scaled else (None, refs)
    refs, w_refs = _take(refs, n_weights)
    refs, shared_refs = _take(refs, n_weights if shared_axis else 0)
    refs, scale_refs = _take(refs, n_weights if fp8 else 0)
    refs, shared_scale_refs = _take(refs, n_weights if fp8 and shared_axis else 0)
    row_scale_ref, o_ref = (refs[0] if row_scale else None), refs[-1]
    exists, group, layer = info.exists > 0, info.group, info.layer

    def tile_rows():
        row_ok = (info.row + jnp.arange(block_m)) < info.end
        col_ok = (j * block_n + jnp.arange(block_n)) < n
        return pl.ds(info.row, block_m), pl.ds(j * block_n, block_n), row_ok, col_ok

    def finish(accs, rows, cols, row_ok, col_ok, scaled):
        if swiglu:
            acc = jax.nn.sigmoid(accs[0]) * accs[0] * accs[1]  # silu(x W1^T) * (x W3^T), in float32
        else:
            (acc,) = accs
        if scaled:
            acc = acc * plgpu.load(row_scale_ref.at[rows], mask=row_ok)[:, None]
        plgpu.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])

    def run(loaders, scaled=row_scale):
        rows, cols, row_ok, col_ok = tile_rows()
        tiles, scales = loaders(cols, col_ok)
        x_rows = (pl.ds(info.x_row, block_m) if rows_ref is None
                  else plgpu.load(rows_ref.at[rows], mask=row_ok, other=0))  # a gather: x's rows by index
        accs = _k_loop(x_ref, x_scale_ref, tiles, scales, x_rows, row_ok, k=k, block_n=block_n, fp8=fp8)
        finish(accs, rows, cols, row_ok, col_ok, scaled)

    def routed(cols, col_ok):
        tiles = [lambda start, width, w_ref=w_ref: plgpu.load(w_ref.at[layer, group, cols, pl.ds(start, width)],
                                                              mask=col_ok[:, None]) for w_ref in w_refs]
        scales = [lambda kb, s_ref=s_ref: s_ref[layer, group, (j * block_n) // BLOCK, kb] for s_ref in scale_refs]
        return tiles, scales

    @pl.when(exists & (group < n_groups))
    def _():
        run(routed)

    if shared_axis:
        @pl.when(exists & (group >= n_groups))
        def _():
            run(functools.partial(_shared_loaders, shared_refs, shared_scale_refs, layer, group - n_groups, j, n=n, k=k,
                                  block_n=block_n, fp8=fp8, axis=shared_axis), scaled=row_scale and slots is None)

    @pl.when(info.exists == 0)
    def _():
        rows, cols, row_ok, col_ok = tile_rows()
        plgpu.store(o_ref.at[rows, cols], jnp.zeros((block_m, block_n), o_ref.dtype),
                    mask=row_ok[:, None] & col_ok[None, :])


def _program_tile(refs, tile, *, slots, n_groups, block_m, x_gathered, m, sized_groups):
    """`_kernel`'s tile `tile` from its leading refs -> (its _Tile, the ref of x's row indices or None, x's ref, the
    refs after x)."""
    if slots is not None:
        (layer_ref, offset_ref, ids_ref, x_ref), refs = refs[:4], refs[4:]
        return (_slot_tile(layer_ref, offset_ref, ids_ref, tile, slots=slots, n_groups=n_groups, block_m=block_m),
                None, x_ref, refs)
    if sized_groups:
        (layer_ref, sizes_ref), refs = refs[:2], refs[2:]
        info = _sized_program_tile(layer_ref, sizes_ref, tile, groups=sized_groups, m=m, block_m=block_m)
    else:
        info, refs = _scheduled_tile(refs[0], tile), refs[1:]
    rows_ref, refs = (refs[0], refs[1:]) if x_gathered else (None, refs)
    return info, rows_ref, refs[0], refs[1:]


def _take(refs: tuple, count: int) -> tuple[tuple, tuple]:
    return refs[count:], refs[:count]


def _shared_loaders(w_refs, scale_refs, layer, chunk, j, cols, col_ok, *, n, k, block_n, fp8, axis):
    """Tile and scale loaders of shared chunk `chunk`, inside layer `layer` of wide weight stacks (L, S N, K)
    ("n") or (L, N, S K) ("k")."""
    if axis == "n":
        out_rows = pl.ds(chunk * n + j * block_n, block_n)
        tiles = [lambda start, width, w_ref=w_ref: plgpu.load(w_ref.at[layer, out_rows, pl.ds(start, width)],
                                                              mask=col_ok[:, None]) for w_ref in w_refs]
        scales = [lambda kb, s_ref=s_ref: s_ref[layer, (chunk * n + j * block_n) // BLOCK, kb] for s_ref in scale_refs]
        return tiles, scales
    words = k // 2 if fp8 else k  # a chunk's K columns (as uint16 pairs of fp8 bytes)
    tiles = [lambda start, width, w_ref=w_ref: plgpu.load(
        w_ref.at[layer, cols, pl.ds(pl.multiple_of(chunk * words + start, width), width)], mask=col_ok[:, None])
        for w_ref in w_refs]
    scales = [lambda kb, s_ref=s_ref: s_ref[layer, (j * block_n) // BLOCK, chunk * (k // BLOCK) + kb]
              for s_ref in scale_refs]
    return tiles, scales


def _k_loop(x_ref, x_scale_ref, tiles, scales, rows, row_ok, *, k, block_n, fp8):
    """The K loop shared by every grouped kernel: float32 (block_m, block_n) x-tile times w-tile^T for
    each weight (`tiles[i](start, width)` loads its (block_n, width) tile at K offset `start`, in fp8
    byte pairs when fp8, `scales[i](kb)` its scale at K block kb), the x tile of `rows` (a slice of x's rows,
    or a (block_m,) vector of their indices) loaded once per K block. With `x_scale_ref` (fp8 x) the fp8
    tiles meet on the tensor cores as they are and each K block's product is scaled by both scales;
    otherwise an fp8 tile is dequantized to x's dtype first."""

    def x_tile(start, width):
        if isinstance(rows, pl.Slice):
            return plgpu.load(x_ref.at[rows, pl.ds(start, width)], mask=row_ok[:, None])
        # gathered rows: the columns as indices too (Pallas' interpreter takes no mix of indices and slices)
        return plgpu.load(x_ref.at[rows[:, None], (start + jnp.arange(width))[None, :]], mask=row_ok[:, None])

    def dot(xb, wb):
        precision = jax.lax.Precision.HIGHEST if xb.dtype == jnp.float32 else None  # no tf32 for float32
        return jax.lax.dot_general(xb, wb, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    def body(kb, accs):
        # masked rows / columns hold garbage that reaches only output rows / columns not stored
        start = pl.multiple_of(kb * BLOCK, BLOCK)
        if not fp8:
            xb = x_tile(start, BLOCK)
            return tuple(acc + dot(xb, tile(start, BLOCK)) for acc, tile in zip(accs, tiles))
        half = BLOCK // 2  # the block's even columns of x meet the low bytes, its odd ones the high
        x_even, x_odd = x_tile(start, half), x_tile(start + half, half)
        x_scale = None if x_scale_ref is None else plgpu.load(x_scale_ref.at[rows, kb], mask=row_ok, other=0)
        out = []
        for acc, tile, scale_at in zip(accs, tiles, scales):
            words, scale = tile(pl.multiple_of(kb * half, half), half), scale_at(kb)
            w_even, w_odd = fp8_pairs(words)
            if x_scale is not None:
                out.append(acc + (dot(x_even, w_even) + dot(x_odd, w_odd)) * (x_scale[:, None] * scale))
                continue
            out.append(acc + dot(x_even, (w_even.astype(jnp.float32) * scale).astype(x_even.dtype))
                       + dot(x_odd, (w_odd.astype(jnp.float32) * scale).astype(x_odd.dtype)))
        return tuple(out)

    zeros = tuple(jnp.zeros((row_ok.shape[0], block_n), jnp.float32) for _ in tiles)
    return jax.lax.fori_loop(0, k // BLOCK, body, zeros)


def _check(fn, x, w, groups_form, w_scale, block_m, block_n, x_scale=None) -> tuple[int, int]:
    form, group_data = groups_form
    name = {"sizes": "group_sizes", "rows": "row_groups", "slots": "slot_experts"}[form]
    if x.ndim != 2 or w.ndim != 3 or group_data.ndim != 1:
        fail(fn, f"expects x (M, K), w (G, N, K), {name} ({'G' if form == 'sizes' else 'M'},); got {x.shape}, "
                 f"{w.shape}, {group_data.shape}")
    m, k = x.shape
    groups, n, kw = w.shape
    if kw != k:
        fail(fn, f"w has shape {tuple(w.shape)}, expected (G, N, {k}) with K from x")
    if k % BLOCK:
        fail(fn, f"x has last dim K={k}, which must be a multiple of {BLOCK}")
    if form == "rows" and group_data.shape[0] != m:
        fail(fn, f"row_groups has {group_data.shape[0]} entries for the {m} rows of x")
    if not jnp.issubdtype(group_data.dtype, jnp.integer):
        fail(fn, f"{name} has dtype {group_data.dtype}, expected an integer type")
    if x_scale is not None:
        if x.dtype != FP8 or w_scale is None:
            fail(fn, f"x_scale goes with an fp8 x and an fp8 w (act_quant's output); x has dtype {x.dtype}")
        if tuple(x_scale.shape) != (m, k // BLOCK) or x_scale.dtype != jnp.float32:
            fail(fn, f"x_scale has shape {tuple(x_scale.shape)} {x_scale.dtype}, expected float32 ({m}, {k // BLOCK})")
    elif x.dtype not in (jnp.bfloat16, jnp.float32, jnp.float16):
        fail(fn, f"x has dtype {x.dtype}, expected bfloat16, float16 or float32 (or float8_e4m3fn with x_scale)")
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            fail(fn, f"{name}={value} must be a power of two >= 16")
    if w_scale is None:
        if w.dtype != x.dtype:
            fail(fn, f"w has dtype {w.dtype}; without w_scale it must match x ({x.dtype})")
    else:
        if w.dtype != FP8:
            fail(fn, f"w has dtype {w.dtype}; with w_scale it must be float8_e4m3fn")
        want = (groups, cdiv(n, BLOCK), k // BLOCK)
        if tuple(w_scale.shape) != want or w_scale.dtype != jnp.float32:
            fail(fn, f"w_scale has shape {tuple(w_scale.shape)} {w_scale.dtype}, expected float32 {want}")
        if block_n > BLOCK or BLOCK % block_n:
            fail(fn, f"block_n={block_n} must divide {BLOCK} with an fp8 weight")
    return m, k
