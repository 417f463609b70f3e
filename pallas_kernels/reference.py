"""Plain-jnp twins of the Pallas kernels: the tests' oracle and a readable statement of the math.

Each twin computes exactly what its kernel is specified to compute, with the same float32
operations where the result must match bit for bit (act_quant, weight_dequant): divisions are
IEEE (see _common.ieee_div; XLA would otherwise multiply by a reciprocal). Prefer running them
on a CPU when comparing bits: XLA's GPU division instruction is not guaranteed to be IEEE.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ._common import AMAX_FLOOR, BLOCK, FP8, FP8_MAX, ieee_div


def act_quant_ref(x: jax.Array, block_size: int = BLOCK, scale_fmt: str | None = None):
    """(y, s) with s = max(amax, 1e-4) / 448 per 128 elements (ue8m0: next power of two)."""
    *lead, k = x.shape
    g = k // block_size
    xb = x.astype(jnp.float32).reshape(*lead, g, block_size)
    amax = jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), jnp.float32(AMAX_FLOOR))
    s = ieee_div(amax, FP8_MAX)
    if scale_fmt == "ue8m0":
        # 2**ceil(log2(s)) exactly: frexp gives s = mant * 2**e with mant in [0.5, 1); s is itself
        # a power of two iff mant == 0.5, and then log2(s) = e - 1.
        mant, e = jnp.frexp(s)
        s = jnp.ldexp(jnp.ones_like(s), jnp.where(mant == 0.5, e - 1, e))
    y = ieee_div(xb, s[..., None]).astype(FP8).reshape(x.shape)
    return y, s


def weight_dequant_ref(w: jax.Array, s: jax.Array, block_size: int = BLOCK, out_dtype=jnp.bfloat16):
    """w * s[i // 128, j // 128] in float32, cast to out_dtype."""
    m, n = w.shape
    s_full = jnp.repeat(jnp.repeat(s, block_size, axis=0), block_size, axis=1)[:m, :n]
    return (w.astype(jnp.float32) * s_full).astype(out_dtype)


def fp8_gemm_ref(a: jax.Array, a_s: jax.Array, b: jax.Array, b_s: jax.Array, out_dtype=jnp.bfloat16):
    """sum over K-blocks of (A_q[:, kb] @ B_q[:, kb]^T) * a_s[:, kb] * b_s[n // 128, kb], float32."""
    *lead, k = a.shape
    n, g = b.shape[0], k // BLOCK
    a3 = a.reshape(-1, g, BLOCK).astype(jnp.float32)
    b3 = b.reshape(n, g, BLOCK).astype(jnp.float32)
    part = jnp.einsum("mgk,ngk->gmn", a3, b3, precision=jax.lax.Precision.HIGHEST)
    sa = a_s.reshape(-1, g).T[:, :, None]  # (g, m, 1)
    sb = jnp.repeat(b_s, BLOCK, axis=0)[:n].T[:, None, :]  # (g, 1, n)
    c = (part * sa * sb).sum(axis=0)
    return c.astype(out_dtype).reshape(*lead, n)


def grouped_gemm_ref(x: jax.Array, w: jax.Array, group_sizes: jax.Array | None, w_scale: jax.Array | None = None,
                     out_dtype=jnp.float32, row_scale: jax.Array | None = None,
                     row_groups: jax.Array | None = None, x_scale: jax.Array | None = None) -> jax.Array:
    """`grouped_gemm`: dequantise (if fp8) to x's dtype, then `ragged_dot` in float32 (with
    `row_groups`: each row times its own group's weight, rows naming no group zero), times
    row_scale[r] per row (if given), cast to out_dtype; rows past the groups are zero. An fp8 x with
    `x_scale` is dequantised to float32 first (its products then exact, as on the fp8 tensor cores)."""
    if x_scale is not None:
        x = x.astype(jnp.float32) * jnp.repeat(x_scale, BLOCK, axis=1)[:, : x.shape[1]]
    if w_scale is not None:
        full = jnp.repeat(jnp.repeat(w_scale, BLOCK, axis=1), BLOCK, axis=2)[:, : w.shape[1], : w.shape[2]]
        w = (w.astype(jnp.float32) * full).astype(x.dtype)
    if row_groups is not None:
        named = (row_groups >= 0) & (row_groups < w.shape[0])
        per_row = jnp.take(w, jnp.clip(row_groups, 0, w.shape[0] - 1), axis=0).astype(x.dtype)
        out = jnp.einsum("mk,mnk->mn", x, per_row, preferred_element_type=jnp.float32,
                         precision=jax.lax.Precision.HIGHEST)
        out = jnp.where(named[:, None], out, 0.0)
    else:
        dims = jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
        out = jax.lax.ragged_dot_general(x, w.astype(x.dtype), group_sizes.astype(jnp.int32), dims,
                                         preferred_element_type=jnp.float32)
    if row_scale is not None:
        out = out * row_scale.astype(jnp.float32)[:, None]
    return out.astype(out_dtype)


def grouped_gemm_swiglu_ref(x: jax.Array, w1: jax.Array, w3: jax.Array, group_sizes: jax.Array | None,
                            w1_scale: jax.Array | None = None, w3_scale: jax.Array | None = None,
                            out_dtype=None, row_groups: jax.Array | None = None,
                            x_scale: jax.Array | None = None) -> jax.Array:
    """`grouped_gemm_swiglu`: silu(x W1_g^T) * (x W3_g^T) from float32 products, cast to out_dtype
    (default x's dtype; bfloat16 for an fp8 x with x_scale); rows past the groups (or naming none) are zero."""
    a1 = grouped_gemm_ref(x, w1, group_sizes, w1_scale, row_groups=row_groups, x_scale=x_scale)
    a3 = grouped_gemm_ref(x, w3, group_sizes, w3_scale, row_groups=row_groups, x_scale=x_scale)
    default = jnp.bfloat16 if x_scale is not None else x.dtype
    return (jax.nn.silu(a1) * a3).astype(default if out_dtype is None else out_dtype)


def route_ref(logits: jax.Array, bias: jax.Array | None = None, *, topk: int, n_groups: int = 1,
              topk_groups: int = 1, score_func: str = "softmax", route_scale: float = 1.0,
              normalize: bool = False) -> tuple[jax.Array, jax.Array]:
    """`router.route`, the MoE gate after its GEMM (the reference's Gate.forward): float32 logits
    (N, E) -> (weights (N, topk) float32, expert indices (N, topk) int32).

    scores = softmax or sigmoid of the logits; a score-correction bias shifts the scores used to
    SELECT experts but not the weights; with expert groups only the best `topk_groups` groups
    compete (group score: max, or the sum of the top two with a bias)."""
    scores = jax.nn.softmax(logits, axis=-1) if score_func == "softmax" else jax.nn.sigmoid(logits)
    original = scores
    if bias is not None:
        scores = scores + bias
    if n_groups > 1:
        grouped = scores.reshape(scores.shape[0], n_groups, -1)
        group_scores = grouped.max(axis=-1) if bias is None else jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
        _, keep = jax.lax.top_k(group_scores, topk_groups)
        kept = jnp.zeros(group_scores.shape, bool).at[jnp.arange(scores.shape[0])[:, None], keep].set(True)
        scores = jnp.where(kept[..., None], grouped, -jnp.inf).reshape(scores.shape)
    _, indices = jax.lax.top_k(scores, topk)
    weights = jnp.take_along_axis(original, indices, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights * route_scale, indices.astype(jnp.int32)


def attention_dense_ref(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *, scale: float,
                        kv_start: int = 0) -> jax.Array:
    """`flash_attention` materialised: the whole (B, S, H, T) float32 score tensor, masked
    (kv_start <= t <= positions[b, s]) and soft-maxed at once; rows that see no key give zeros.
    O(S*T) memory: small shapes, and the baseline the flash kernels replace."""
    t = k.shape[1]
    s = jnp.einsum("bshd,bthd->bsht", q, k, preferred_element_type=jnp.float32) * scale
    key = jnp.arange(t)
    visible = (key[None, None, :] <= positions[:, :, None]) & (key >= kv_start)[None, None, :]
    s = jnp.where(visible[:, :, None, :], s, -jnp.inf)
    p = jnp.exp(s - jnp.maximum(s.max(axis=-1, keepdims=True), -jnp.finfo(jnp.float32).max))
    total = p.sum(axis=-1, keepdims=True)
    p = (p / jnp.where(total == 0.0, 1.0, total)).astype(v.dtype)
    return jnp.einsum("bsht,bthd->bshd", p, v, preferred_element_type=jnp.float32).astype(q.dtype)
