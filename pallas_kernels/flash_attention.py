"""Prefill attention that never materialises the (query, key) scores: `flash_attention`.

    out = flash_attention(q, k, v, positions, scale=s, kv_start=0, impl="auto")

MLA prefill in its expanded per-head form: q (B, S, H, d_qk), k (B, T, H, d_qk), v (B, T, H, d_v)
(DeepSeek: d_qk 192 = nope 128 + rope 64, d_v 128), positions (B, S) int32: query (b, s) is at
absolute position positions[b, s], key t at position t (0..T-1). Key t is visible to query (b, s)
iff kv_start <= t <= positions[b, s]; out[b, s, h] = softmax_t(scale * q . k_t over the visible
keys) @ v, with float32 scores, softmax and accumulation, cast to q's dtype. A query that sees no
key gets zeros.

impl "mosaic": the Hopper kernel (`flash_attention_mgpu`; Mosaic GPU interpret mode off a GPU);
"jnp": `flash_attention_ref`, an online softmax over key blocks in plain XLA that runs anywhere;
"auto": mosaic on an sm_90 GPU when the operands suit it (`mosaic_unsupported`), jnp otherwise.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ._common import fail, hopper, match_vma, use_interpret, vma_union
from .flash_attention_mgpu import M_FLOOR, FlashTiles, flash_attention_mgpu, mosaic_unsupported

_FN = "flash_attention"
IMPLS = ("auto", "mosaic", "jnp")


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *, scale: float,
                    kv_start: int = 0, impl: str = "auto", tiles: FlashTiles | None = None) -> jax.Array:
    """Causal attention by per-row positions, (B, S, H, d_v) in q's dtype (see the module docstring).

    The caller passes the key/value window with the chunk's own entries already in place (a
    cache window [0, T) or, in a full-sequence pass, the chunk itself with positions 0..S-1).
    scale: a Python float (> 0); kv_start (a static int) hides keys before it; tiles: the Mosaic
    kernel's tiling (None: default).
    """
    _check(q, k, v, positions, scale, kv_start, impl)
    if impl == "auto":
        impl = "mosaic" if hopper() and mosaic_unsupported(q.shape, k.shape, v.shape, q.dtype) is None else "jnp"
    if impl == "mosaic":
        return flash_attention_mgpu(q, k, v, positions, scale=scale, kv_start=kv_start, tiles=tiles,
                                    interpret=use_interpret())
    return flash_attention_ref(q, k, v, positions, scale=scale, kv_start=kv_start)


def _check(q, k, v, positions, scale, kv_start, impl) -> None:
    if impl not in IMPLS:
        fail(_FN, f"impl is {impl!r}, expected one of {', '.join(IMPLS)}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        fail(_FN, f"q, k, v must be (B, S, H, d), (B, T, H, d), (B, T, H, d_v); got shapes {q.shape}, "
                  f"{k.shape}, {v.shape}")
    (b, s, h, d_qk), (t, d_v) = q.shape, (k.shape[1], v.shape[-1])
    if k.shape != (b, t, h, d_qk) or v.shape != (b, t, h, d_v):
        fail(_FN, f"k {k.shape} and v {v.shape} do not match q {q.shape} (expected k (B, T, H, d_qk) "
                  f"and v (B, T, H, d_v) with the same B, T, H)")
    if positions.shape != (b, s) or not jnp.issubdtype(positions.dtype, jnp.integer):
        fail(_FN, f"positions must be integer (B, S) = {(b, s)}, got {positions.dtype} {positions.shape}")
    if not (k.dtype == v.dtype == q.dtype):
        fail(_FN, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not isinstance(kv_start, int) or kv_start < 0:
        fail(_FN, f"kv_start must be a static int >= 0, got {kv_start!r}")
    if not float(scale) > 0:
        fail(_FN, f"scale must be positive, got {scale!r}")


def key_block(t: int) -> int:
    """The twin's default key block: 128 where it divides T, else 64 (T itself if T <= 64)."""
    return t if t <= 64 else (128 if t % 128 == 0 else 64)


def query_block(batch: int, rows: int, heads: int, block_kv: int) -> int:
    """The twin's default query chunk: about 2^24 scores a key block (enough work per step for a
    GPU), at least 256 rows, at most all of them."""
    return min(rows, max(256, (1 << 24) // (batch * heads * block_kv)))


def flash_attention_ref(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *, scale: float,
                        kv_start: int = 0, block_kv: int | None = None, block_q: int | None = None) -> jax.Array:
    """`flash_attention` in plain XLA: query chunks of block_q rows one after another (lax.map), each
    a scan over key blocks keeping the running max m, the sum l and the float32 accumulator, so
    temporaries are O(B*block_q*H*block_kv), never O(S*T). A chunk skips the key blocks wholly
    past its rows' positions (about half the work of a causal prefill) or before kv_start.

    Same rounding points as the kernel: scores and softmax in float32, the probabilities cast to
    v's dtype before the P @ V product (float32 accumulation).
    """
    batch, rows, heads, _ = q.shape
    t = k.shape[1]
    bk = block_kv or key_block(t)
    if t % bk:  # whole key blocks: pad keys past T, which the mask hides
        k, v = (jnp.pad(x, ((0, 0), (0, -t % bk), (0, 0), (0, 0))) for x in (k, v))
    positions = jnp.minimum(positions.astype(jnp.int32), t - 1)  # no key past T - 1 exists
    bq = block_q or query_block(batch, rows, heads, bk)
    if bq >= rows:
        return _attend_chunk(q, k, v, positions, scale, kv_start, bk)
    chunks = -(-rows // bq)
    if rows % bq:  # whole chunks: pad rows at position -1 see nothing and are dropped
        q = jnp.pad(q, ((0, 0), (0, chunks * bq - rows), (0, 0), (0, 0)))
        positions = jnp.pad(positions, ((0, 0), (0, chunks * bq - rows)), constant_values=-1)

    def chunk(i):
        rows_i = [lax.dynamic_slice_in_dim(x, i * bq, bq, axis=1) for x in (q, positions)]
        return _attend_chunk(rows_i[0], k, v, rows_i[1], scale, kv_start, bk)

    out = lax.map(chunk, jnp.arange(chunks))  # (chunks, B, bq, H, d_v)
    return jnp.moveaxis(out, 0, 1).reshape(batch, chunks * bq, heads, -1)[:, :rows]


def _attend_chunk(q, k, v, positions, scale, kv_start, bk):
    """One query chunk against the key blocks of k, v (T a multiple of bk)."""
    batch, rows, heads, _ = q.shape
    last = jnp.max(positions)  # no row of the chunk sees a key past this
    # XLA:CPU has no fast bf16 dot: there the (exact) float32 upcast of one block is the cheap way
    up = (lambda x: x.astype(jnp.float32)) if jax.default_backend() == "cpu" else (lambda x: x)
    qs = up(q)

    def block(carry, j):
        def update(carry):
            m, l, acc = carry
            kj, vj = (lax.dynamic_slice_in_dim(x, j * bk, bk, axis=1) for x in (k, v))
            s = jnp.einsum("bshd,bthd->bsht", qs, up(kj), preferred_element_type=jnp.float32) * scale
            key = j * bk + jnp.arange(bk)
            visible = (key[None, None, :] <= positions[:, :, None]) & (key >= kv_start)[None, None, :]
            s = jnp.where(visible[:, :, None, :], s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=-1))
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            pv = jnp.einsum("bsht,bthd->bshd", up(p.astype(v.dtype)), up(vj), preferred_element_type=jnp.float32)
            return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None] + pv

        return lax.cond(j * bk <= last, update, lambda c: c, carry), None

    init = (jnp.full((batch, rows, heads), M_FLOOR, jnp.float32), jnp.zeros((batch, rows, heads), jnp.float32),
            jnp.zeros((batch, rows, heads, v.shape[-1]), jnp.float32))
    init = tuple(match_vma(vma_union(q, k, v, positions), *init))  # inside shard_map: vary as the updates do
    (_, l, acc), _ = lax.scan(block, init, jnp.arange(kv_start // bk, k.shape[1] // bk))
    return (acc / jnp.where(l == 0.0, 1.0, l)[..., None]).astype(q.dtype)
