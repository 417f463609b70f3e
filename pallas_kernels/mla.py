"""Absorbed-MLA decode attention over the latent cache, read in place (flash-decoding).

One new token per row attends to the rows' cached latents ``kv`` (positions < length) and to its
own new entry. Scores are ``(q_latent . kv_t + q_pe . pe_t) * scale``; the output is the
softmax-weighted sum of the latents (the caller projects it with wkv_b's value half). The cache
is the model's stacked cache (L, B, T, R): the kernel reads layer ``layer`` where it lies, so the
layer loop copies no cache window. Programs split the positions (split-K, "flash decoding") so
a single row still keeps many SMs streaming; a small XLA step merges the splits and the new entry.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import cdiv, fail, interpret_in_shard_map, match_vma, num_sms, result, use_interpret, vma_union

_FN = "mla_decode"
_NEG = -1e30  # finite "minus infinity": an empty split must not produce inf - inf
# Default split-K: enough programs for this many per SM. Over a long cache two 4-warp programs an SM keep
# more loads in flight than one and read it faster (benchmarks/NOTES.md, "thresholds").
PROGRAMS_PER_SM = 2


def mla_decode_ref(q_latent, q_pe, kv_cache, pe_cache, layer, lengths, new_kv, new_pe, *, scale: float):
    """Plain-XLA twin: the same attention through dense einsums over the whole cache window."""
    kv = jax.lax.dynamic_index_in_dim(kv_cache, layer, 0, keepdims=False)[: q_latent.shape[0]]
    pe = jax.lax.dynamic_index_in_dim(pe_cache, layer, 0, keepdims=False)[: q_latent.shape[0]]
    f32 = jnp.float32
    scores = (jnp.einsum("bhc,btc->bht", q_latent.astype(f32), kv.astype(f32))
              + jnp.einsum("bhr,btr->bht", q_pe.astype(f32), pe.astype(f32))) * scale
    scores = jnp.where(jnp.arange(kv.shape[1])[None, None, :] < lengths[:, None, None], scores, -jnp.inf)
    own = (jnp.einsum("bhc,bc->bh", q_latent.astype(f32), new_kv.astype(f32))
           + jnp.einsum("bhr,br->bh", q_pe.astype(f32), new_pe.astype(f32))) * scale
    probs = jax.nn.softmax(jnp.concatenate([scores, own[..., None]], axis=-1), axis=-1)
    return (jnp.einsum("bht,btc->bhc", probs[..., :-1], kv.astype(f32))
            + probs[..., -1:] * new_kv.astype(f32)[:, None, :])


def mla_decode(q_latent, q_pe, kv_cache, pe_cache, layer, lengths, new_kv, new_pe, *, scale: float,
               kv_len: int, block_t: int = 64, block_h: int = 16, splits: int | None = None,
               num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Attention of one new token per row over the cached latents plus its own entry -> (B, H, R) float32.

    Args:
      q_latent: (B, H, R) the query in latent space (q_nope absorbed through wkv_b's key half).
      q_pe: (B, H, r) the rotated rotary query.
      kv_cache, pe_cache: (L, Bmax, T, R) and (L, Bmax, T, r), B <= Bmax; read at `layer`.
      layer: int32 scalar; lengths: (B,) int32, row b attends cache positions [0, lengths[b]).
      new_kv, new_pe: (B, R), (B, r): this step's entry (not in the cache yet).
      kv_len: static bound on lengths (positions past it are never read).
    """
    batch, heads, rank = q_latent.shape
    rope = q_pe.shape[-1]
    if kv_cache.ndim != 4 or pe_cache.ndim != 4 or kv_cache.shape[-1] != rank or pe_cache.shape[-1] != rope:
        fail(_FN, f"caches {kv_cache.shape}, {pe_cache.shape} do not match q {q_latent.shape}, q_pe {q_pe.shape}")
    if kv_len > kv_cache.shape[2] or batch > kv_cache.shape[1]:
        fail(_FN, f"kv_len={kv_len} / batch={batch} exceed the cache {kv_cache.shape}")
    interpret = use_interpret()
    if interpret_in_shard_map(interpret, q_latent, kv_cache):
        return mla_decode_ref(q_latent, q_pe, kv_cache, pe_cache, layer, lengths, new_kv, new_pe, scale=scale)
    splits = splits or default_splits(batch, heads, kv_len, block_t, block_h)
    chunk = cdiv(cdiv(kv_len, splits), block_t) * block_t
    lengths = jnp.minimum(lengths.astype(jnp.int32), kv_len)
    meta = jnp.concatenate([jnp.asarray(layer, jnp.int32)[None], lengths])
    vma = vma_union(q_latent, kv_cache)
    operands = match_vma(vma, meta, q_latent, q_pe, kv_cache, pe_cache)
    kernel = functools.partial(_kernel, heads=heads, chunk=chunk, block_t=block_t, block_h=block_h, scale=scale)
    grid = (batch, cdiv(heads, block_h), splits)
    acc, m, l = pl.pallas_call(
        kernel,
        out_shape=(result((batch, splits, heads, rank), jnp.float32, vma),
                   result((batch, splits, heads), jnp.float32, vma),
                   result((batch, splits, heads), jnp.float32, vma)),
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="mla_decode",
    )(*operands)
    # merge the splits and the new entry: a log-sum-exp over (splits + 1) partial softmaxes
    f32 = jnp.float32
    own = (jnp.einsum("bhc,bc->bh", q_latent.astype(f32), new_kv.astype(f32))
           + jnp.einsum("bhr,br->bh", q_pe.astype(f32), new_pe.astype(f32))) * scale
    top = jnp.maximum(m.max(axis=1), own)
    weight = jnp.exp(m - top[:, None])  # (B, splits, H)
    own_weight = jnp.exp(own - top)
    total = (l * weight).sum(axis=1) + own_weight
    out = (acc * weight[..., None]).sum(axis=1) + own_weight[..., None] * new_kv.astype(f32)[:, None, :]
    return out / total[..., None]


def default_splits(batch: int, heads: int, kv_len: int, block_t: int, block_h: int) -> int:
    """Split-K count: PROGRAMS_PER_SM programs an SM over the grid, no split shorter than one block."""
    programs = batch * cdiv(heads, block_h)
    return max(1, min(cdiv(kv_len, block_t), cdiv(PROGRAMS_PER_SM * num_sms(), programs)))


def _kernel(meta_ref, q_ref, qpe_ref, kv_ref, pe_ref, acc_ref, m_ref, l_ref, *, heads, chunk, block_t, block_h,
            scale):
    b, hb, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    layer, length = meta_ref[0], meta_ref[1 + b]
    head_ok = hb * block_h + jnp.arange(block_h) < heads
    hs = pl.ds(hb * block_h, block_h)
    q = plgpu.load(q_ref.at[b, hs, :], mask=head_ok[:, None], other=0)
    qpe = plgpu.load(qpe_ref.at[b, hs, :], mask=head_ok[:, None], other=0)
    start = split * chunk
    blocks = jnp.maximum(0, jnp.minimum(chunk, length - start) + block_t - 1) // block_t

    def body(i, carry):
        m, l, acc = carry
        t0 = start + i * block_t
        ts = pl.ds(t0, block_t)
        valid = t0 + jnp.arange(block_t) < length
        kv = plgpu.load(kv_ref.at[layer, b, ts, :], mask=valid[:, None], other=0)
        pe = plgpu.load(pe_ref.at[layer, b, ts, :], mask=valid[:, None], other=0)
        s = (jax.lax.dot_general(q, kv, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
             + jax.lax.dot_general(qpe, pe, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)) * scale
        s = jnp.where(valid[None, :], s, _NEG)
        m_new = jnp.maximum(m, s.max(axis=1))
        p = jnp.exp(s - m_new[:, None])
        rescale = jnp.exp(m - m_new)
        l = l * rescale + p.sum(axis=1)
        acc = acc * rescale[:, None] + jax.lax.dot_general(p.astype(kv.dtype), kv, (((1,), (0,)), ((), ())),
                                                           preferred_element_type=jnp.float32)
        return m_new, l, acc

    rank = q.shape[-1]
    init = (jnp.full((block_h,), _NEG, jnp.float32), jnp.zeros((block_h,), jnp.float32),
            jnp.zeros((block_h, rank), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0, blocks, body, init)
    plgpu.store(acc_ref.at[b, split, hs, :], acc, mask=head_ok[:, None])
    plgpu.store(m_ref.at[b, split, hs], m, mask=head_ok)
    plgpu.store(l_ref.at[b, split, hs], l, mask=head_ok)
