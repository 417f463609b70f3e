"""Decode-sized projections in one launch, with the RMSNorm that feeds them in their prologue (`norm_project`).

In a decode step a projection is a GEMV: a few rows against a large weight, whose bytes are its whole cost, and at
batch 1 a launch's fixed cost rivals them. XLA runs the norm, then each projection, as kernels of their own.
`norm_project` computes y_i = RMSNorm(x) W_i^T for several weights W_i that read the same normed rows (MLA's query
and latent projections) in one launch: the programs split the weights' output columns between them and each
normalises the rows it reads itself (x is a few KB against a weight tile's tens), so no normed copy is written.

Weights are in x's dtype, or float8_e4m3fn with 128x128 block scales, then either dequantized tile by tile to x's
dtype (`weight_dequant`, then the product: gemm_impl "bf16"'s math) or multiplied on the tensor cores in fp8 after
the normed rows are quantized per 128 columns as `act_quant` quantizes them (then `fp8_gemm`: gemm_impl "fp8"'s).
A stack of layers (L, N, K) is read at `layer` in place, as is a stacked norm weight (L, K).
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import (AMAX_FLOOR, BLOCK, FP8, FP8_MAX, cdiv, exact_div, fail, interpret_in_shard_map, launch_dependents,
                      match_vma, pow2_ceil, result, use_interpret, vma_union)
from .norm import rms_norm_ref
from .reference import act_quant_ref, fp8_gemm_ref, weight_dequant_ref

_FN = "norm_project"
QUANTIZE = (None, "e4m3", "ue8m0")  # fp8 weights: dequantized to x's dtype, or the rows quantized (act_quant)
FP8_N_MULTIPLE = 32  # an fp8 weight's N: a multiple of every tiling's block_n (a program's tiles are whole)
# at most this many rows run as vector products (a row at a time against the weight tile, summed over K) rather than
# as a dot of 16 (Triton's least side), which would read and multiply mostly padding
VECTOR_MAX_ROWS = 4


class Tiles(NamedTuple):
    """A launch's tiling: output columns a program (a divisor of 128, so one row of block scales covers them), K
    columns a step (at most K rounded up to a power of two; a K it does not divide ends in a masked step; 128 for
    fp8 weights, one block scale a step) and Triton's warps and pipeline stages a program."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tiles_for(rows: int) -> Tiles:
    """The default tiling of a launch of `rows` rows, by measurement (vector products, then a dot)."""
    return Tiles(16, 512, 8, 3) if rows <= VECTOR_MAX_ROWS else Tiles(32, 256, 4, 3)


class Plan(NamedTuple):
    """The launch's shape: rows a program (a power of two >= 16 for a dot; the rows themselves, at most
    VECTOR_MAX_ROWS, as vector products), output columns a program, K a step, and per weight its first program and
    its output width."""
    block_m: int
    block_n: int
    block_k: int
    firsts: tuple[int, ...]
    widths: tuple[int, ...]
    vector: bool

    @property
    def programs(self) -> int:
        return self.firsts[-1] + cdiv(self.widths[-1], self.block_n)


def norm_project_ref(x, weights, *, scales=None, norm=None, eps: float = 1e-6, layer=None, quantize=None,
                     out_dtype=None) -> list:
    """The jnp twin: the model's RMSNorm (`rms_norm_ref`: float32, cast to x's dtype), then each weight's product as
    `weight_dequant` + dot (float32 accumulation), or `act_quant` + `fp8_gemm_ref` with `quantize`."""
    pick = (lambda a: a) if layer is None else (lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False))
    rows = x if norm is None else rms_norm_ref(x, norm, eps=eps, layer=layer)
    out_dtype = out_dtype or x.dtype
    outs = []
    for i, weight in enumerate(weights):
        w, s = pick(weight), None if scales is None else pick(scales[i])
        if quantize is not None:
            a, a_s = act_quant_ref(rows, scale_fmt=None if quantize == "e4m3" else quantize)
            outs.append(fp8_gemm_ref(a, a_s, w, s, out_dtype=out_dtype))
            continue
        w = w if s is None else weight_dequant_ref(w, s, BLOCK, x.dtype)
        precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
        y = jax.lax.dot_general(rows, w, (((rows.ndim - 1,), (1,)), ((), ())), precision=precision,
                                preferred_element_type=jnp.float32)
        outs.append(y.astype(out_dtype))
    return outs


def norm_project(x: jax.Array, weights: Sequence[jax.Array], *, scales: Sequence[jax.Array] | None = None,
                 norm: jax.Array | None = None, eps: float = 1e-6, layer=None, quantize: str | None = None,
                 out_dtype=None, tiles: Tiles | None = None) -> list:
    """[RMSNorm(x) @ W_i^T for each W_i in `weights`] in one launch (x itself where `norm` is None).

    Args:
      x: (..., K) float; its rows are flattened (decode-sized: the programs each read all of them).
      weights: (N_i, K) each, in x's dtype or float8_e4m3fn; or stacks (L, N_i, K) with `layer`.
      scales: with fp8 weights, one per weight: float32 block scales ((L,) ceil(N_i / 128), K / 128).
      norm: the RMSNorm weight (K,), or a stack (L, K) with `layer`; `eps` its epsilon.
      layer: int32 scalar, the layer of the stacks to read.
      quantize: with fp8 weights, None (weight tiles dequantized to x's dtype) or "e4m3" / "ue8m0" (the normed
        rows quantized per 128 columns as act_quant(scale_fmt=None / "ue8m0") does, the products in fp8).
      out_dtype: of the results (default x's dtype); accumulation is float32.
      tiles: the launch's tiling (default `tiles_for(rows)`).
    Returns: a list of (..., N_i).
    """
    tiles = tiles or tiles_for(x.size // max(x.shape[-1], 1))
    plan = _check(x, weights, scales, norm, layer, quantize, tiles)
    out_dtype = out_dtype or x.dtype
    interpret = use_interpret()
    operands = (x, *weights, *(scales or ()), *(() if norm is None else (norm,)))
    if x.size == 0 or interpret_in_shard_map(interpret, *operands):
        return norm_project_ref(x, weights, scales=scales, norm=norm, eps=eps, layer=layer, quantize=quantize,
                                out_dtype=out_dtype)
    stacked = layer is not None
    rows = x.reshape(-1, x.shape[-1])
    index = jnp.reshape(jnp.asarray(0 if layer is None else layer, jnp.int32), (1,))
    stacks = [w if stacked else w[None] for w in weights] + [s if stacked else s[None] for s in scales or ()]
    norms = [] if norm is None else [norm if stacked else norm[None]]
    vma = vma_union(rows, *stacks, *norms)
    kernel = functools.partial(_kernel, plan=plan, m=rows.shape[0], eps=float(eps), normed=norm is not None,
                               fp8=scales is not None, quantize=quantize, interpret=interpret)
    outs = pl.pallas_call(
        kernel,
        out_shape=[result((rows.shape[0], n), out_dtype, vma) for n in plan.widths],
        grid=(plan.programs, cdiv(rows.shape[0], plan.block_m)),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages),
        interpret=interpret,
        name=_FN,
    )(*match_vma(vma, index, rows, *norms, *stacks))
    return [y.reshape(*x.shape[:-1], y.shape[-1]) for y in outs]


class _Rows(NamedTuple):
    """What a program reads of x: its rows (a slice and its mask for a dot; row numbers as vector products), the
    program's output columns and K's step, and each row's inverse RMS (None without a norm)."""
    x_ref: object
    norm_ref: object
    layer: object
    rows: object
    row_ok: object
    block_n: int
    block_k: int
    inv: object

    def load(self, t, row=None):
        """The rows at K step t (`row`: that row alone, as a vector), normed (rounded to x's dtype, as the model's
        norm is) where there is a norm; columns past K (a last, partial step) read as zeros."""
        ks, k_ok = k_step(t, self.block_k, self.x_ref.shape[1])
        if row is None:
            mask = self.row_ok[:, None] if k_ok is None else self.row_ok[:, None] & k_ok[None, :]
            a = plgpu.load(self.x_ref.at[self.rows, ks], mask=mask, other=0)
        else:  # a traced index: Pallas' interpreter cannot index a ref by a Python int here
            a = plgpu.load(self.x_ref.at[jnp.int32(row), ks], **masked(k_ok))
        if self.inv is None:
            return a
        w = plgpu.load(self.norm_ref.at[self.layer, ks], **masked(k_ok)).astype(jnp.float32)
        inv = self.inv[:, None] if row is None else self.inv[row]
        return (a.astype(jnp.float32) * inv * w).astype(a.dtype)


def k_step(t, block_k: int, k: int):
    """K step t's columns and, where block_k does not divide K, their mask (None: the step is whole)."""
    ks = pl.ds(pl.multiple_of(t * block_k, block_k), block_k)
    return ks, None if k % block_k == 0 else t * block_k + jnp.arange(block_k) < k


def masked(mask) -> dict:
    """`plgpu.load`'s keywords for a load under `mask` (None: unmasked), zeros where it is False."""
    return {} if mask is None else dict(mask=mask, other=0)


def _kernel(layer_ref, x_ref, *refs, plan: Plan, m, eps, normed, fp8, quantize, interpret):
    """Program (p, r): rows block r, the block_n output columns p of the weight whose programs include p."""
    refs = list(refs)
    norm_ref = refs.pop(0) if normed else None
    count = len(plan.widths)
    w_refs, s_refs, o_refs = refs[:count], (refs[count:2 * count] if fp8 else [None] * count), refs[-count:]
    p, r = launch_dependents(pl.program_id(0)), pl.program_id(1)
    if plan.vector:
        rows, row_ok = tuple(range(m)), None
    else:
        rows = pl.ds(r * plan.block_m, plan.block_m)
        row_ok = r * plan.block_m + jnp.arange(plan.block_m) < m
    inv = _inverse_rms(x_ref, rows, row_ok, plan.block_k, eps) if normed else None
    x = _Rows(x_ref, norm_ref, layer_ref[0], rows, row_ok, plan.block_n, plan.block_k, inv)
    for i in range(count):
        first, width = plan.firsts[i], plan.widths[i]
        block = functools.partial(_project_block, x, w_refs[i], s_refs[i], o_refs[i], width=width,
                                  steps=cdiv(x_ref.shape[1], plan.block_k), quantize=quantize, interpret=interpret)
        mine = (p >= first) & (p < first + cdiv(width, plan.block_n))
        pl.when(mine)(lambda block=block, first=first: block(p - first))


def _inverse_rms(x_ref, rows, row_ok, block_k: int, eps: float):
    """rsqrt(mean(x^2) + eps) per row (float32), from a first pass over the rows: (block_m,) for a slice of rows
    (with its mask `row_ok`), a tuple of scalars for a tuple of row numbers (Triton stacks no vectors into a tile)."""
    k = x_ref.shape[1]

    def body(t, squares):
        ks, k_ok = k_step(t, block_k, k)
        if row_ok is not None:
            mask = row_ok[:, None] if k_ok is None else row_ok[:, None] & k_ok[None, :]
            a = plgpu.load(x_ref.at[rows, ks], mask=mask, other=0).astype(jnp.float32)
            return squares + a * a
        return tuple(sq + plgpu.load(x_ref.at[jnp.int32(row), ks], **masked(k_ok)).astype(jnp.float32) ** 2
                     for row, sq in zip(rows, squares))

    if row_ok is not None:
        squares = jax.lax.fori_loop(0, cdiv(k, block_k), body, jnp.zeros((row_ok.shape[0], block_k), jnp.float32))
        return jax.lax.rsqrt(jnp.sum(squares, axis=1) / k + eps)
    squares = jax.lax.fori_loop(0, cdiv(k, block_k), body, tuple(jnp.zeros((block_k,), jnp.float32) for _ in rows))
    return tuple(jax.lax.rsqrt(jnp.sum(sq) / k + eps) for sq in squares)


def _project_block(x: _Rows, w_ref, s_ref, o_ref, j, *, width, steps, quantize, interpret):
    """Output columns [j * block_n, (j + 1) * block_n) of one weight, over every K step."""
    block_n, block_k = x.block_n, x.block_k
    cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
    col_ok = j * block_n + jnp.arange(block_n) < width
    scale_row = (j * block_n) // BLOCK  # block_n divides 128: one row of weight scales a program

    def weight_tile(t):
        """The tile at K step t, and its block scale (None for weights in x's dtype)."""
        ks, k_ok = k_step(t, block_k, w_ref.shape[-1])
        if s_ref is None:  # fp8 tiles are always whole (an fp8 weight's N is a multiple of block_n, K of 128)
            mask = col_ok[:, None] if k_ok is None else col_ok[:, None] & k_ok[None, :]
            return plgpu.load(w_ref.at[x.layer, cols, ks], mask=mask, other=0), None
        return plgpu.load(w_ref.at[x.layer, cols, ks]), s_ref[x.layer, scale_row, t * block_k // BLOCK]

    if x.row_ok is not None:
        body = functools.partial(_dot_step, x, weight_tile, quantize=quantize, interpret=interpret)
        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((x.row_ok.shape[0], block_n), jnp.float32))
        plgpu.store(o_ref.at[x.rows, cols], acc.astype(o_ref.dtype), mask=x.row_ok[:, None] & col_ok[None, :])
        return
    body = functools.partial(_vector_step, x, weight_tile, quantize=quantize, interpret=interpret)
    accs = jax.lax.fori_loop(0, steps, body, tuple(jnp.zeros((block_n, block_k), jnp.float32) for _ in x.rows))
    for row, acc in zip(x.rows, accs):
        plgpu.store(o_ref.at[jnp.int32(row), cols], jnp.sum(acc, axis=1).astype(o_ref.dtype), mask=col_ok)


def _dot_step(x: _Rows, weight_tile, t, acc, *, quantize, interpret):
    """One K step of a rows block (block_m >= 16) as a dot on the tensor cores."""
    a = x.load(t)
    w, w_scale = weight_tile(t)
    if quantize is not None:
        a, a_scale = _quantized(a, quantize, interpret)
        part = jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return acc + part * (a_scale[:, None] * w_scale)
    if w_scale is not None:
        w = (w.astype(jnp.float32) * w_scale).astype(a.dtype)
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None  # no tf32 for float32
    return acc + jax.lax.dot_general(a, w, (((1,), (1,)), ((), ())), precision=precision,
                                     preferred_element_type=jnp.float32)


def _vector_step(x: _Rows, weight_tile, t, accs, *, quantize, interpret):
    """One K step of a few rows, each row's products with the tile added elementwise to its (block_n, block_k)
    accumulator, which is summed over K once at the end: no reduction across threads in the loop, so the steps'
    loads overlap. In float32 (the products of fp8 values, and of bf16 ones, are exact in float32 as on the tensor
    cores)."""
    w, w_scale = weight_tile(t)
    if w_scale is not None and quantize is None:
        w = (w.astype(jnp.float32) * w_scale).astype(x.x_ref.dtype)
    w = w.astype(jnp.float32)
    out = []
    for row, acc in zip(x.rows, accs):
        a = x.load(t, row)
        if quantize is None:
            out.append(acc + w * a.astype(jnp.float32)[None, :])
            continue
        q, a_scale = _quantized(a[None, :], quantize, interpret)  # (1, 128): Triton's inline division takes tiles
        out.append(acc + w * q.astype(jnp.float32) * (a_scale * w_scale))
    return tuple(out)


def _quantized(a, quantize: str, interpret: bool):
    """act_quant's math on rows (rows, 128) in x's dtype: e4m3 values and the (rows,) float32 scales."""
    v = a.astype(jnp.float32)
    s = exact_div(jnp.maximum(jnp.max(jnp.abs(v), axis=1), jnp.float32(AMAX_FLOOR)), FP8_MAX, interpret)
    s = pow2_ceil(s) if quantize == "ue8m0" else s
    return exact_div(v, s[:, None], interpret).astype(FP8), s


def _check(x, weights, scales, norm, layer, quantize, tiles: Tiles) -> Plan:
    if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
        fail(_FN, f"x must be a float array (..., K), got {x.dtype} {x.shape}")
    k, stacked, fp8 = x.shape[-1], layer is not None, scales is not None
    if not weights or quantize not in QUANTIZE or (quantize is not None and not fp8):
        fail(_FN, f"needs at least one weight and quantize in {QUANTIZE} (not None only for fp8 weights), got "
                  f"{len(weights)} weights and quantize={quantize!r}")
    if fp8 and len(scales) != len(weights):
        fail(_FN, f"{len(weights)} fp8 weights need one scale array each, got {len(scales)}")
    for i, w in enumerate(weights):
        _check_weight(i, w, None if scales is None else scales[i], k, stacked, x.dtype)
    if norm is not None and (norm.shape[-1:] != (k,) or norm.ndim != 1 + stacked):
        fail(_FN, f"the norm weight has shape {norm.shape}, expected " + (f"(L, {k})" if stacked else f"({k},)"))
    block_k = BLOCK if fp8 else min(1 << max(0, (k - 1).bit_length()), tiles.block_k)
    if block_k < 16 or tiles.block_k & (tiles.block_k - 1):
        fail(_FN, f"K={k} and block_k={tiles.block_k} leave no power-of-two step of at least 16 (a Triton tile)")
    if tiles.block_n < 16 or BLOCK % tiles.block_n or FP8_N_MULTIPLE % tiles.block_n:
        fail(_FN, f"block_n={tiles.block_n} must be at least 16 and divide {FP8_N_MULTIPLE}")
    widths = tuple(w.shape[-2] for w in weights)
    firsts = tuple(sum(cdiv(n, tiles.block_n) for n in widths[:i]) for i in range(len(widths)))
    m = x.size // max(k, 1)
    if m <= VECTOR_MAX_ROWS:
        return Plan(max(m, 1), tiles.block_n, block_k, firsts, widths, vector=True)
    block_m = max(16, 1 << max(0, (m - 1).bit_length())) if m <= 64 else 64
    return Plan(block_m, tiles.block_n, block_k, firsts, widths, vector=False)


def _check_weight(i: int, w, s, k: int, stacked: bool, dtype) -> None:
    if w.ndim != 2 + stacked or w.shape[-1] != k:
        fail(_FN, f"weight {i} has shape {w.shape}, expected " + (f"(L, N, {k})" if stacked else f"(N, {k})")
             + " (a stack goes with `layer`)")
    if s is None:
        if w.dtype != dtype:
            fail(_FN, f"weight {i} has dtype {w.dtype}, expected x's {jnp.dtype(dtype).name} (or fp8 with scales)")
        return
    want = (*w.shape[:-2], cdiv(w.shape[-2], BLOCK), cdiv(k, BLOCK))
    if w.dtype != FP8 or s.dtype != jnp.float32 or s.shape != want or k % BLOCK or w.shape[-2] % FP8_N_MULTIPLE:
        fail(_FN, f"fp8 weight {i} needs float8_e4m3fn (N, K) with N a multiple of {FP8_N_MULTIPLE}, K of {BLOCK}, and "
                  f"float32 scales {want}; got {w.dtype} {w.shape} and {s.dtype} {s.shape}")
