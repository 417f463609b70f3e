"""Block-wise activation quantisation to float8_e4m3fn (DeepSeek-V3's ``act_quant``).

Per row, every 128 consecutive elements of the last dim share one float32 scale:
``amax = max(|x|)`` clamped to >= 1e-4, ``s = amax / 448`` (rounded up to a power of two with
``scale_fmt="ue8m0"``), ``y = e4m3(x / s)``. The op is memory-bound (read 2 bytes, write 1 per
element), so the kernel streams large tiles and does one pass.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import (AMAX_FLOOR, BLOCK, FP8, FP8_MAX, cdiv, check_block_size, check_dtype,
                      check_last_dim, exact_div, fail, interpret_in_shard_map, num_sms,
                      pow2_at_most, pow2_ceil, result, rows, use_interpret, vma_union)
from .reference import act_quant_ref

_FN = "act_quant"
SCALE_FMTS = (None, "ue8m0")


def act_quant(x: jax.Array, block_size: int = BLOCK, scale_fmt: str | None = None):
    """Quantise ``x`` (..., K) to float8_e4m3fn with one float32 scale per 128 elements.

    Args:
      x: bfloat16 / float16 / float32 array, K = x.shape[-1] a multiple of 128.
      block_size: must be 128.
      scale_fmt: None (s = amax/448) or "ue8m0" (s rounded up to a power of two, as the
        checkpoints with ``scale_fmt: ue8m0`` expect).

    Returns:
      (y, s): y float8_e4m3fn with x's shape, s float32 (..., K // 128), with x ~= y * s blockwise.
    """
    check_block_size(_FN, block_size)
    if scale_fmt not in SCALE_FMTS:
        fail(_FN, f"scale_fmt is {scale_fmt!r}, expected None or 'ue8m0'")
    check_dtype(_FN, "x", x, (jnp.bfloat16, jnp.float16, jnp.float32), "bfloat16, float16 or float32")
    k = check_last_dim(_FN, "x", x)
    lead, g, m = x.shape[:-1], k // BLOCK, rows(x.shape)
    if m == 0 or g == 0:
        return jnp.zeros(x.shape, FP8), jnp.zeros((*lead, g), jnp.float32)
    interpret = use_interpret()
    if interpret_in_shard_map(interpret, x):
        return act_quant_ref(x, scale_fmt=scale_fmt)
    y, s = _act_quant_2d(x.reshape(m, g, BLOCK), scale_fmt == "ue8m0", interpret)
    return y.reshape(x.shape), s.reshape(*lead, g)


def default_tile(m: int, g: int, itemsize: int) -> tuple[int, int, int]:
    """(rows, groups, num_warps) per program, power-of-two sides: 4096 elements (32 per thread) where the launch
    still has a program an SM; a launch of fewer (decode rows) halves its tiles, rows first, until it has one an SM
    or one 128-block a program, on fewer warps below 1,024 elements (8 per thread).

    Small tiles won (benchmarks/NOTES.md, "Tilings"): the per-element IEEE division makes the kernel partly
    ALU-bound, and more, lighter programs hide it better; in a launch of a few programs each thread's chain of
    divisions is most of its time.
    """
    del itemsize
    bg = pow2_at_most(g, 8)
    bm = pow2_at_most(m, max(1, 4096 // (bg * BLOCK)))
    while cdiv(m, bm) * cdiv(g, bg) < num_sms() and bm * bg > 1:
        bm, bg = (bm // 2, bg) if bm > 1 else (bm, bg // 2)
    return bm, bg, max(1, min(4, bm * bg * BLOCK // 256))


def _act_quant_2d(x3: jax.Array, ue8m0: bool, interpret: bool, tile: tuple[int, int, int] | None = None):
    """x3 (M, G, 128) -> (y (M, G, 128) e4m3, s (M, G) float32). `tile` overrides default_tile."""
    m, g, _ = x3.shape
    bm, bg, warps = tile or default_tile(m, g, x3.dtype.itemsize)
    vma = vma_union(x3)  # non-empty inside shard_map: the results vary like x
    kernel = functools.partial(_kernel, m=m, g=g, ue8m0=ue8m0, interpret=interpret)
    return pl.pallas_call(
        kernel,
        out_shape=(result(x3.shape, FP8, vma), result((m, g), jnp.float32, vma)),
        grid=(cdiv(m, bm), cdiv(g, bg)),
        in_specs=[pl.BlockSpec((bm, bg, BLOCK), lambda i, j: (i, j, 0))],
        out_specs=(pl.BlockSpec((bm, bg, BLOCK), lambda i, j: (i, j, 0)),
                   pl.BlockSpec((bm, bg), lambda i, j: (i, j))),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="act_quant",
    )(x3)


def _kernel(x_ref, y_ref, s_ref, *, m, g, ue8m0, interpret):
    bm, bg, _ = x_ref.shape
    mask = mask3 = None  # edge tiles only: rows past M / groups past G are neither read nor written
    if m % bm or g % bg:
        r = pl.program_id(0) * bm + jnp.arange(bm)
        c = pl.program_id(1) * bg + jnp.arange(bg)
        mask = (r < m)[:, None] & (c < g)[None, :]
        mask3 = mask[:, :, None]
    x = plgpu.load(x_ref, mask=mask3).astype(jnp.float32)
    amax = jnp.maximum(jnp.max(jnp.abs(x), axis=-1), jnp.float32(AMAX_FLOOR))
    s = exact_div(amax, FP8_MAX, interpret)
    if ue8m0:
        s = pow2_ceil(s)
    y = exact_div(x, s[:, :, None], interpret)
    plgpu.store(y_ref, y.astype(FP8), mask=mask3)
    plgpu.store(s_ref, s, mask=mask)
