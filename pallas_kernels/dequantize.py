"""Block-wise FP8 weight dequantisation (DeepSeek-V3's ``weight_dequant``).

``out[i, j] = w[i, j] * s[i // 128, j // 128]`` in float32, cast to ``out_dtype``. Used by the
"bf16" GEMM path and by checkpoint conversion. Memory-bound (read 1 byte, write 2 per element):
each program converts a (rows x cols) tile inside one 128-row scale band and reads that band's
few scales with it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import (BLOCK, FP8, cdiv, check_block_size, check_dtype, check_out_dtype, fail,
                      interpret_in_shard_map, match_vma, pow2_at_most, result, use_interpret,
                      vma_union)
from .reference import weight_dequant_ref

_FN = "weight_dequant"


def weight_dequant(w: jax.Array, s: jax.Array, block_size: int = BLOCK, out_dtype=jnp.bfloat16):
    """Dequantise a float8_e4m3fn weight ``w`` (M, N) with float32 block scales ``s``.

    Args:
      w: float8_e4m3fn (M, N); M and N need not be multiples of 128.
      s: float32 (ceil(M/128), ceil(N/128)): the scale of each 128x128 tile.
      block_size: must be 128.
      out_dtype: bfloat16 (default), float16 or float32.
    """
    check_block_size(_FN, block_size)
    out_dtype = check_out_dtype(_FN, out_dtype)
    check_dtype(_FN, "w", w, (FP8,), "float8_e4m3fn")
    check_dtype(_FN, "s", s, (jnp.float32,), "float32")
    if w.ndim != 2:
        fail(_FN, f"w has shape {tuple(w.shape)}, expected 2-D (M, N)")
    m, n = w.shape
    want = (cdiv(m, BLOCK), cdiv(n, BLOCK))
    if tuple(s.shape) != want:
        fail(_FN, f"s has shape {tuple(s.shape)}, expected {want} = (ceil(M/128), ceil(N/128))")
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    interpret = use_interpret()
    if interpret_in_shard_map(interpret, w, s):
        return weight_dequant_ref(w, s, out_dtype=out_dtype)
    return _weight_dequant(w, s, out_dtype, interpret)


def default_tile(m: int, n: int) -> tuple[int, int, int]:
    """(rows, cols, num_warps) per program: a 16x1024 tile (16 KiB of fp8 in, 32 KiB out), the
    fastest of those tried (benchmarks/NOTES.md, "Tilings")."""
    return pow2_at_most(m, 16), max(BLOCK, pow2_at_most(n, 1024)), 4


def _weight_dequant(w, s, out_dtype, interpret: bool, tile: tuple[int, int, int] | None = None):
    m, n = w.shape
    bm, bn, warps = tile or default_tile(m, n)
    if BLOCK % bm or bn % BLOCK:
        raise ValueError(f"weight_dequant tile ({bm}, {bn}): rows must divide 128, cols be a multiple of 128")
    vma = vma_union(w, s)  # non-empty inside shard_map
    w, s = match_vma(vma, w, s)
    return pl.pallas_call(
        functools.partial(_kernel, m=m, n=n),
        out_shape=result((m, n), out_dtype, vma),
        grid=(cdiv(m, bm), cdiv(n, bn)),
        # The scale block: one row (block index = row index for 1-row blocks) of bn/128 scales.
        in_specs=[pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
                  pl.BlockSpec((1, bn // BLOCK), lambda i, j: ((i * bm) // BLOCK, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="weight_dequant",
    )(w, s)


def _kernel(w_ref, s_ref, o_ref, *, m, n):
    bm, bn = w_ref.shape
    i, j = pl.program_id(0), pl.program_id(1)
    col_ok = (j * bn + jnp.arange(bn)) < n if n % bn else None
    if bn == BLOCK:
        scale = s_ref[0, 0]  # one scale for the whole tile
    else:  # gather: the scale of column c is s[0, c // 128]
        scale = plgpu.load(s_ref.at[0, jnp.arange(bn) // BLOCK], mask=col_ok)[None, :]
    mask = None  # edge tiles only
    if m % bm or n % bn:
        mask = ((i * bm + jnp.arange(bm)) < m)[:, None]
        if col_ok is not None:
            mask = mask & col_ok[None, :]
    w = plgpu.load(w_ref, mask=mask).astype(jnp.float32)
    plgpu.store(o_ref, (w * scale).astype(o_ref.dtype), mask=mask)
