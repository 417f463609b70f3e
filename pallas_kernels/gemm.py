"""Block-scaled FP8 GEMM (DeepSeek-V3's ``fp8_gemm``): C = A_q B_q^T with per-block scales.

``C[m, n] = sum_kb (A_q[m, kb] . B_q[n, kb]) * a_s[m, kb] * b_s[n // 128, kb]``: A is an
activation quantised per row per 128 elements of K, B a weight quantised per 128x128 tile. Each
K-block's partial product comes out of the tensor cores in float32 and is scaled before it is
added to the float32 accumulator (the scales change every 128 elements of K, so they cannot be
pulled out of the sum).

Two regimes, one kernel:
  * large M (prefill): compute-bound; 128x128 tiles, 8 warps, a software-pipelined K loop.
  * small M (decode, M <= 64): reading B dominates; narrow N tiles plus split-K so that every SM
    streams a slice of the weight, then a small XLA sum over the splits.

How fast each regime runs, and why large M stops short of the tensor cores' peak: benchmarks/NOTES.md.

On Hopper (compute capability 9.x), products with M >= MOSAIC_MIN_M, N and K multiples of 128
take a second kernel instead, written for Pallas' Mosaic GPU backend (gemm_mgpu.py): it issues
fp8 wgmma, which the Triton lowering never does. `fp8_gemm_path` says which kernel a call takes;
`fp8_gemm(..., impl=...)` forces one.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import (BLOCK, FP8, byte_pairs, cdiv, check_dtype, check_last_dim, check_out_dtype, even_odd_columns,
                      fail, fp8_pairs, hopper, interpret_in_shard_map, launch_dependents, match_vma, num_sms, result,
                      rows, use_interpret, vma_union)
from .gemm_mgpu import MosaicGemmConfig, fp8_gemm_mosaic_2d, mosaic_unsupported
from .reference import fp8_gemm_ref, weight_dequant_ref

_FN = "fp8_gemm"
_FN_DEQUANT = "dequant_gemm"
IMPLS = ("auto", "triton", "mosaic")
# Smallest M for which "auto" picks the Mosaic kernel on sm_90. Below it the Triton kernel's narrow
# tiles and split-K (reading B dominates) are the faster path until measured otherwise.
MOSAIC_MIN_M = 128


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Tiling of one fp8_gemm launch.

    bm, bn: output tile (powers of two, >= 16, bn <= 128 so that one b_s value covers a tile's
      columns). split: number of K ranges computed by separate programs and summed afterwards
      (must divide K / 128). num_warps, num_stages: Triton's warps per program and pipeline depth.
      mma: operand type fed to the tensor cores. "fp8" multiplies the e4m3 tiles directly; Pallas
      leaves Triton's max_num_imprecise_acc at 0 for them, which rules out Hopper's wgmma, so they
      run on mma.sync. "f16" converts the tiles to float16 first (exact: e4m3 is a subset of f16)
      and is eligible for wgmma at the 16-bit rate.
    byte_pairs: read B as uint16 pairs of its fp8 bytes (`byte_pairs`), each K block of A reordered to meet them
      (its even columns, then its odd ones): a 1-byte weight stack of 2^31 to 2^32 elements is then addressable
      in place. fp8_gemm and dequant_gemm set it for such stacks.
    """
    bm: int = 128
    bn: int = 128
    split: int = 1
    num_warps: int = 8
    num_stages: int = 3
    mma: str = "fp8"
    byte_pairs: bool = False

    def check(self, nkb: int) -> None:
        def pow2(v):
            return v >= 16 and v & (v - 1) == 0
        if not (pow2(self.bm) and pow2(self.bn) and self.bn <= BLOCK):
            raise ValueError(f"{_FN}: {self} needs bm, bn powers of two >= 16, bn <= 128")
        if self.split < 1 or nkb % self.split:
            raise ValueError(f"{_FN}: {self} needs split to divide K/128 = {nkb}")
        if self.mma not in ("fp8", "f16"):
            raise ValueError(f"{_FN}: {self} needs mma 'fp8' or 'f16'")


def default_config(m: int, n: int, k: int, sms: int | None = None) -> GemmConfig:
    """Heuristic tiling for an (m, k) x (n, k)^T product on a GPU with `sms` multiprocessors."""
    if m <= 16:
        cfg = GemmConfig(bm=16, bn=64, num_warps=4, num_stages=4)
    elif m <= 64:
        cfg = GemmConfig(bm=64 if m > 32 else 32, bn=64, num_warps=4, num_stages=4)
    elif m <= 512:
        cfg = GemmConfig(bm=64, bn=128, num_warps=4, num_stages=4)
    else:  # every large-M tiling tried ran alike (benchmarks/NOTES.md, "Tilings")
        return GemmConfig(bm=128, bn=128, num_warps=8, num_stages=3)
    return dataclasses.replace(cfg, split=auto_split(m, n, k, cfg.bm, cfg.bn, sms))


def auto_split(m: int, n: int, k: int, bm: int, bn: int, sms: int | None = None) -> int:
    """Smallest split of K (a divisor of K/128 leaving >= 4 K-blocks per program) that gives
    about two programs per SM, so that small-M products stream the weight with the whole GPU.

    The float32 partial sums cost 8 * split * M * N bytes (written, then read by the reduction)
    against the weight's N * K: split stays <= K / (32 M) to keep that under a quarter.
    """
    sms = sms or num_sms()
    nkb = k // BLOCK
    tiles = cdiv(m, bm) * cdiv(n, bn)
    split = 1
    for d in range(1, min(nkb, max(1, k // (32 * m))) + 1):
        if nkb % d == 0 and nkb // d >= 4:
            split = d
            if tiles * d >= 2 * sms:
                break
    return split


def choose_path(m: int, n: int, k: int, impl: str, sm90: bool) -> str:
    """"mosaic" or "triton": the kernel fp8_gemm runs for an (m, k) x (n, k)^T product.

    "auto" takes the Mosaic kernel on sm_90 for m >= MOSAIC_MIN_M when it supports (n, k);
    "mosaic" insists (a one-line ValueError says why a shape cannot take it); "triton" never.
    """
    if impl not in IMPLS:
        fail(_FN, f"impl is {impl!r}, expected one of {', '.join(map(repr, IMPLS))}")
    why = mosaic_unsupported(n, k)
    if impl == "mosaic":
        if why is not None:
            fail(_FN, f"impl='mosaic' cannot run this product: {why}")
        return "mosaic"
    if impl == "auto" and sm90 and m >= MOSAIC_MIN_M and why is None:
        return "mosaic"
    return "triton"


def fp8_gemm_path(m: int, n: int, k: int, impl: str = "auto") -> str:
    """The kernel ("mosaic" or "triton") fp8_gemm(..., impl=impl) runs on the default device for
    an (m, k) x (n, k)^T product: for benchmarks and logs to record which one ran."""
    return choose_path(m, n, k, impl, hopper())


def fp8_gemm_reads_stacks_in_place(m: int) -> bool:
    """Whether fp8_gemm(..., layer=...) on m rows (impl "auto", the default device) reads its layer of a
    weight stack in place (the Triton kernel) rather than slicing it out (the Mosaic kernel)."""
    return choose_path(m, BLOCK, BLOCK, "auto", hopper()) == "triton"


def fp8_gemm(a: jax.Array, a_s: jax.Array, b: jax.Array, b_s: jax.Array, out_dtype=jnp.bfloat16,
             impl: str = "auto", mosaic_config: MosaicGemmConfig | None = None, *, layer=None):
    """Block-scaled FP8 matrix product ``C = (A * a_s) @ (B * b_s)^T``.

    Args:
      a: float8_e4m3fn (..., K), K a multiple of 128; leading dims are flattened into M.
      a_s: float32 (..., K // 128): one scale per row per 128 elements (from ``act_quant``).
      b: float8_e4m3fn (N, K), the weight in (out, in) layout; N need not be a multiple of 128.
      b_s: float32 (ceil(N / 128), K // 128): one scale per 128x128 tile of b.
      out_dtype: bfloat16 (default), float16 or float32; accumulation is float32.
      impl: "auto" (default: see fp8_gemm_path), "triton" or "mosaic" (the Mosaic GPU kernel; on
        a CPU it runs in Mosaic GPU's interpreter, for tests).
      mosaic_config: tiling of the Mosaic kernel (default: gemm_mgpu.default_mosaic_config).
      layer: with b a stack of layers' weights (L, N, K) and b_s (L, ceil(N / 128), K // 128), the
        layer (int32 scalar) to multiply by. The Triton kernel reads it in place (a layer sliced out
        of a stack inside the layer scan would be copied first); the Mosaic kernel takes a slice.

    Returns:
      C with shape (..., N) and dtype out_dtype.
    """
    out_dtype = check_out_dtype(_FN, out_dtype)
    b, b_s, layer = _weight_stack(_FN, b, b_s, layer)
    m, n, k = _check(a, a_s, b, b_s)
    path = choose_path(m, n, k, impl, hopper())
    if m == 0 or n == 0:
        return jnp.zeros((*a.shape[:-1], n), out_dtype)
    interpret = use_interpret()
    if interpret_in_shard_map(interpret, a, a_s, b, b_s):
        return fp8_gemm_ref(a, a_s, *_one_layer(b, b_s, layer), out_dtype=out_dtype)
    a2, a_s2 = a.reshape(m, k), a_s.reshape(m, k // BLOCK)
    if path == "mosaic":
        c = _mosaic_2d(a2, a_s2, *_one_layer(b, b_s, layer), out_dtype, mosaic_config, interpret)
    else:
        c = _fp8_gemm_2d(a2, a_s2, b, b_s, layer, out_dtype, _addressing(default_config(m, n, k), b), interpret)
    return c.reshape(*a.shape[:-1], n)


def dequant_gemm(a: jax.Array, b: jax.Array, b_s: jax.Array, out_dtype=jnp.float32, *, layer=None,
                 config: GemmConfig | None = None):
    """``C = A @ (B * b_s)^T`` with B's tiles dequantized to A's dtype as they are loaded: gemm_impl "bf16"'s
    math on an fp8 weight (each tile rounded as ``weight_dequant`` rounds it, float32 accumulation), reading the
    fp8 bytes only. The Triton kernel of fp8_gemm with A unquantized: at decode-sized M, narrow N tiles and
    split-K, so that a weight of few output columns is still streamed by every SM.

    a: bfloat16, float16 or float32 (..., K), K a multiple of 128; b: float8_e4m3fn (N, K), or a stack
    (L, N, K) with `layer` (int32 scalar, read in place); b_s: float32 (ceil(N / 128), K // 128) (with a
    leading L for a stack); config: the kernel's tiling (default: `default_config`). Returns (..., N) in out_dtype.
    """
    out_dtype = check_out_dtype(_FN_DEQUANT, out_dtype)
    check_dtype(_FN_DEQUANT, "a", a, (jnp.bfloat16, jnp.float16, jnp.float32), "bfloat16, float16 or float32")
    b, b_s, layer = _weight_stack(_FN_DEQUANT, b, b_s, layer)
    m, n, k = _check_weight(_FN_DEQUANT, a, b, b_s)
    if m == 0 or n == 0:
        return jnp.zeros((*a.shape[:-1], n), out_dtype)
    interpret = use_interpret()
    if interpret_in_shard_map(interpret, a, b, b_s):
        w = weight_dequant_ref(*_one_layer(b, b_s, layer), out_dtype=a.dtype)
        return jnp.einsum("...k,nk->...n", a, w, precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32).astype(out_dtype)
    cfg = _addressing(config or default_config(m, n, k), b)
    c = _fp8_gemm_2d(a.reshape(m, k), None, b, b_s, layer, out_dtype, cfg, interpret)
    return c.reshape(*a.shape[:-1], n)


def _weight_stack(fn: str, b, b_s, layer):
    """b, b_s as a stack of layers (L, N, K), (L, ceil(N/128), K/128) (a 2-D weight: one layer) and `layer` as
    (1,) int32."""
    if b.ndim not in (2, 3) or (b.ndim == 3) != (layer is not None):
        fail(fn, f"b has shape {tuple(b.shape)}: a stack (L, N, K) goes with `layer`, (N, K) without")
    layer = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1)
    return (b, b_s, layer) if b.ndim == 3 else (b[None], b_s[None], layer)


def _addressing(cfg: GemmConfig, b) -> GemmConfig:
    """cfg, reading the weight stack b as byte pairs where Pallas' Triton lowering would address its 1-byte elements
    with 32-bit signed offsets (2^31 to 2^32 of them), so that the stack is still read in place."""
    return dataclasses.replace(cfg, byte_pairs=True) if 2**31 <= b.size < 2**32 else cfg


def _one_layer(b, b_s, layer):
    """Layer `layer` ((1,) int32) of a weight stack and its scales, sliced out."""
    return tuple(jax.lax.dynamic_index_in_dim(x, layer[0], 0, keepdims=False) for x in (b, b_s))


def fp8_gemm_with_config(a, a_s, b, b_s, config: GemmConfig, out_dtype=jnp.bfloat16,
                         interpret: bool | None = None):
    """fp8_gemm with an explicit tiling: for tuning, benchmarks and tests of every code path."""
    out_dtype = check_out_dtype(_FN, out_dtype)
    m, n, k = _check(a, a_s, b[None], b_s[None])
    interpret = use_interpret() if interpret is None else interpret
    c = _fp8_gemm_2d(a.reshape(m, k), a_s.reshape(m, k // BLOCK), b[None], b_s[None], jnp.zeros((1,), jnp.int32),
                     out_dtype, config, interpret)
    return c.reshape(*a.shape[:-1], n)


def _mosaic_2d(a, a_s, b, b_s, out_dtype, config: MosaicGemmConfig | None, interpret: bool):
    c = fp8_gemm_mosaic_2d(a, a_s, b, b_s, out_dtype, config, interpret)
    # plgpu.kernel traces without shard_map's varying-axes types: restore them on the result
    [c] = match_vma(vma_union(a, a_s, b, b_s), c)
    return c


def _check(a, a_s, b, b_s) -> tuple[int, int, int]:
    """(M, N, K) of a product with a stack of weights b (L, N, K), its scales b_s (L, ceil(N/128), K/128)."""
    check_dtype(_FN, "a", a, (FP8,), "float8_e4m3fn")
    check_dtype(_FN, "a_s", a_s, (jnp.float32,), "float32")
    m, n, k = _check_weight(_FN, a, b, b_s)
    want = (*a.shape[:-1], k // BLOCK)
    if tuple(a_s.shape) != want:
        fail(_FN, f"a_s has shape {tuple(a_s.shape)}, expected {want} = (..., K/128)")
    return m, n, k


def _check_weight(fn: str, a, b, b_s) -> tuple[int, int, int]:
    """(M, N, K) of a times a stack of fp8 weights b (L, N, K) with block scales b_s (L, ceil(N/128), K/128)."""
    check_dtype(fn, "b", b, (FP8,), "float8_e4m3fn")
    check_dtype(fn, "b_s", b_s, (jnp.float32,), "float32")
    k = check_last_dim(fn, "a", a)
    if b.shape[-1] != k:
        fail(fn, f"b has shape {tuple(b.shape[1:])}, expected (N, {k}) = (N, K) with K from a")
    n = b.shape[1]
    want = (b.shape[0], cdiv(n, BLOCK), k // BLOCK)
    if tuple(b_s.shape) != want:
        fail(fn, f"b_s has shape {tuple(b_s.shape[1:])}, expected {want[1:]} = (ceil(N/128), K/128)")
    return rows(a.shape), n, k


def _fp8_gemm_2d(a, a_s, b, b_s, layer, out_dtype, cfg: GemmConfig, interpret: bool):
    """The Triton kernel on A (M, K) and layer `layer` ((1,) int32) of the weight stack b (L, N, K); a_s None:
    A unquantized, B's tiles dequantized to A's dtype (`dequant_gemm`)."""
    (m, k), n = a.shape, b.shape[1]
    nkb = k // BLOCK
    cfg.check(nkb)
    bm, bn, split = cfg.bm, cfg.bn, cfg.split
    kbp = nkb // split  # K-blocks per program
    scaled = a_s is not None
    vma = vma_union(*(x for x in (a, a_s, b, b_s) if x is not None))  # inside shard_map: the operands' axes
    if cfg.byte_pairs:
        a, b = even_odd_columns(a), byte_pairs(b)
    kernel = functools.partial(_kernel, m=m, n=n, bn=bn, kbp=kbp, scaled=scaled,
                               mma_dtype=jnp.float16 if cfg.mma == "f16" else None)
    layer, a, b, b_s = match_vma(vma, layer, a, b, b_s)
    a_s = match_vma(vma, a_s)[0] if scaled else None
    if split == 1:
        out_shape = result((m, n), out_dtype, vma)
        out_spec = pl.BlockSpec((bm, bn), lambda i, j, s: (i, j))
    else:  # float32 partial sums, reduced below
        out_shape = result((split, m, n), jnp.float32, vma)
        out_spec = pl.BlockSpec((None, bm, bn), lambda i, j, s: (s, i, j))
    # Program (i, j, s) sees its rows i of A and their scales for K-range s; the weight stack and its
    # scales are whole refs (the layer is a runtime value), indexed in the kernel.
    c = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        # M tiles vary fastest, so the programs running together share B tiles in L2.
        grid=(cdiv(m, bm), cdiv(n, bn), split),
        in_specs=[
            pl.no_block_spec,
            pl.BlockSpec((bm, kbp * BLOCK), lambda i, j, s: (i, s)),
            *([pl.BlockSpec((bm, kbp), lambda i, j, s: (i, s))] if scaled else []),
            pl.no_block_spec,
            pl.no_block_spec,
        ],
        out_specs=out_spec,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="fp8_gemm" if scaled else "dequant_gemm",
    )(layer, a, *([a_s] if scaled else []), b, b_s)
    if split > 1:
        c = c.sum(axis=0).astype(out_dtype)
    return c


def _kernel(layer_ref, a_ref, *refs, m, n, bn, kbp, mma_dtype, scaled):
    """One (bm, bn) output tile over this program's K range. `scaled`: A is fp8 with per-row block scales (the
    refs start with them), each K-block's product scaled by both; else A is unquantized and each B tile is
    multiplied by its scale in float32 and rounded to A's dtype (as weight_dequant rounds it) before the dot."""
    as_ref, b_ref, bs_ref, o_ref = refs if scaled else (None, *refs)
    bm = a_ref.shape[0]
    i, j, split = pl.program_id(0), launch_dependents(pl.program_id(1)), pl.program_id(2)
    layer = layer_ref[0]
    # Rows of A / B past the edge are not loaded; the garbage they leave in registers only
    # reaches output rows / columns that are masked at the store.
    row_ok = (i * bm + jnp.arange(bm)) < m if m % bm else None
    col_ok = (j * bn + jnp.arange(bn)) < n if n % bn else None
    row_mask = None if row_ok is None else row_ok[:, None]
    col_mask = None if col_ok is None else col_ok[:, None]
    b_rows = pl.ds(pl.multiple_of(j * bn, bn), bn)
    scale_row = (j * bn) // BLOCK  # bn <= 128: one weight scale row for the whole tile
    precision = jax.lax.Precision.HIGHEST if a_ref.dtype == jnp.float32 else None  # no TF32 rounding of A

    def dot(a, b):  # (bm, bn) float32 from the tensor cores; contracting b's dim 1 = A . B^T
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision,
                                   preferred_element_type=jnp.float32)

    def operands(t, kb):
        """The (A, B) tiles whose products make K-block t of this program (kb in the whole K): one pair, or with
        B in byte pairs (uint16) A's even columns with B's low bytes and its odd ones with the high bytes."""
        if b_ref.dtype != jnp.uint16:
            a = plgpu.load(a_ref.at[:, pl.ds(pl.multiple_of(t * BLOCK, BLOCK), BLOCK)], mask=row_mask)
            return [(a, plgpu.load(b_ref.at[layer, b_rows, pl.ds(pl.multiple_of(kb * BLOCK, BLOCK), BLOCK)],
                                   mask=col_mask))]
        half = BLOCK // 2
        words = plgpu.load(b_ref.at[layer, b_rows, pl.ds(pl.multiple_of(kb * half, half), half)], mask=col_mask)
        halves = [plgpu.load(a_ref.at[:, pl.ds(pl.multiple_of(t * BLOCK + h, half), half)], mask=row_mask)
                  for h in (0, half)]
        return list(zip(halves, fp8_pairs(words)))

    def body(t, acc):
        kb = split * kbp + t  # the K-block in the whole K
        pairs = operands(t, kb)
        sb = bs_ref[layer, pl.ds(scale_row, 1), pl.ds(kb, 1)]  # (1, 1): one weight scale for the whole tile
        if not scaled:
            return acc + _sum(dot(a, (b.astype(jnp.float32) * sb).astype(a.dtype)) for a, b in pairs)
        sa = plgpu.load(as_ref.at[:, pl.ds(t, 1)], mask=row_mask)  # (bm, 1)
        if mma_dtype is not None:
            pairs = [(a.astype(mma_dtype), b.astype(mma_dtype)) for a, b in pairs]
        return acc + _sum(dot(a, b) for a, b in pairs) * (sa * sb)

    acc = jax.lax.fori_loop(0, kbp, body, jnp.zeros((bm, bn), jnp.float32))
    mask = row_mask
    if col_ok is not None:
        mask = col_ok[None, :] if mask is None else mask & col_ok[None, :]
    plgpu.store(o_ref, acc.astype(o_ref.dtype), mask=mask)


def _sum(terms):
    """The sum of one or more arrays, without a zero to start from."""
    return functools.reduce(jnp.add, terms)
