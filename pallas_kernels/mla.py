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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ._common import (BLOCK, FP8, cdiv, fail, interpret_in_shard_map, launch_dependents, match_vma, num_sms, result,
                      use_interpret, vma_union)
from .norm import latent_norm_rope_ref
from .rotary import rotate_ref, rotate_rows
from .reference import weight_dequant_ref

_FN = "mla_decode"
_NEG = -1e30  # finite "minus infinity": an empty split must not produce inf - inf
# Default split-K: enough programs for this many per SM. Over a long cache two 4-warp programs an SM keep
# more loads in flight than one and read it faster (benchmarks/NOTES.md, "thresholds").
PROGRAMS_PER_SM = 2
# mla_decode_output merges this many splits a loop step, their loads issued together, where there are more
MERGE_GROUP = 8
# mla_decode_output's batches of more than this many rows take 128-wide V tiles (a head's whole value half: one
# program a head and row block) with a wkv_b in q_latent's dtype; from 17 rows up to it, 64-wide (benchmarks/NOTES.md)
WHOLE_VALUE_TILES_ABOVE_ROWS = 64


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
    if interpret_in_shard_map(use_interpret(), q_latent, kv_cache):
        return mla_decode_ref(q_latent, q_pe, kv_cache, pe_cache, layer, lengths, new_kv, new_pe, scale=scale)
    acc, m, l = mla_decode_splits(q_latent, q_pe, kv_cache, pe_cache, layer, lengths, kv_len=kv_len, scale=scale,
                                  block_t=block_t, block_h=block_h, splits=splits, num_warps=num_warps,
                                  num_stages=num_stages)
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


def mla_decode_splits_ref(q_latent, q_pe, kv_cache, pe_cache, layer, lengths, *, kv_len: int, scale: float):
    """Plain-XLA twin of `mla_decode_splits`: the window [0, kv_len) as one split."""
    batch, f32 = q_latent.shape[0], jnp.float32
    kv = jax.lax.dynamic_index_in_dim(kv_cache, layer, 0, keepdims=False)[:batch, :kv_len].astype(f32)
    pe = jax.lax.dynamic_index_in_dim(pe_cache, layer, 0, keepdims=False)[:batch, :kv_len].astype(f32)
    valid = jnp.arange(kv_len)[None, None, :] < lengths[:, None, None]
    scores = (jnp.einsum("bhc,btc->bht", q_latent.astype(f32), kv)
              + jnp.einsum("bhr,btr->bht", q_pe.astype(f32), pe)) * scale
    maxima = jnp.where(valid, scores, _NEG).max(axis=-1)
    probs = jnp.where(valid, jnp.exp(scores - maxima[..., None]), 0.0)
    return jnp.einsum("bht,btc->bhc", probs, kv)[:, None], maxima[:, None], probs.sum(axis=-1)[:, None]


def mla_decode_splits(q_latent, q_pe, kv_cache, pe_cache, layer, lengths, *, kv_len: int, scale: float,
                      block_t: int = 64, block_h: int = 16, splits: int | None = None, num_warps: int = 4,
                      num_stages: int = 2) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The cache part of `mla_decode` (arguments as there), unmerged: per split of the positions its
    float32 (B, S, H, R) softmax-weighted latents, (B, S, H) running maxima and (B, S, H) sums."""
    batch, heads, rank = q_latent.shape
    interpret = use_interpret()
    if interpret_in_shard_map(interpret, q_latent, kv_cache):
        return mla_decode_splits_ref(q_latent, q_pe, kv_cache, pe_cache, layer, lengths, kv_len=kv_len, scale=scale)
    splits = splits or default_splits(batch, heads, kv_len, block_t, block_h)
    chunk = cdiv(cdiv(kv_len, splits), block_t) * block_t
    # the layer and the lengths as operands of their own (clamped to kv_len in the kernel): no XLA kernel builds them
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    vma = vma_union(q_latent, kv_cache)
    operands = match_vma(vma, layer, lengths.astype(jnp.int32), q_latent, q_pe, kv_cache, pe_cache)
    kernel = functools.partial(_kernel, heads=heads, chunk=chunk, block_t=block_t, block_h=block_h, scale=scale,
                               kv_len=kv_len)
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
    return acc, m, l


def default_splits(batch: int, heads: int, kv_len: int, block_t: int, block_h: int) -> int:
    """Split-K count: as many splits as keep the grid within one wave of PROGRAMS_PER_SM programs an SM (a partial
    second wave leaves most SMs idle while it runs), but at least two (a row's whole cache in one program streams
    slower than two halves), and no split shorter than one block."""
    programs = batch * cdiv(heads, block_h)
    return max(1, min(cdiv(kv_len, block_t), max(2, PROGRAMS_PER_SM * num_sms() // programs)))


def _kernel(layer_ref, lengths_ref, q_ref, qpe_ref, kv_ref, pe_ref, acc_ref, m_ref, l_ref, *, heads, chunk, block_t,
            block_h, scale, kv_len):
    b, hb, split = launch_dependents(pl.program_id(0)), pl.program_id(1), pl.program_id(2)
    layer, length = layer_ref[0], jnp.minimum(lengths_ref[b], kv_len)
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


# ---------------------------------------------------------------- wkv_b's absorption around the decode attention
_QUERY, _OUTPUT = "mla_absorb_query", "mla_decode_output"


class _WkvB(NamedTuple):
    """wkv_b as the absorption kernels read it: a stack (L, H (D + V), C), its fp8 block scales
    (L, H (D + V) / 128, C / 128) or None, and the layer to read ((1,) int32)."""
    stack: jax.Array
    scale: jax.Array | None
    layer: jax.Array

    @property
    def refs(self) -> tuple:
        """The kernel operands after the layer: the stack, and its scales when fp8."""
        return (self.stack,) if self.scale is None else (self.stack, self.scale)


def fp8_wkv_b_aligned(nope: int, v_dim: int, rank: int) -> bool:
    """Whether the absorption kernels can read an fp8 wkv_b with its block scales: each 128x128 scale block
    within one head's key or value half (D, V and C multiples of 128)."""
    return not (nope % BLOCK or v_dim % BLOCK or rank % BLOCK)


def _wkv_b_stack(fn: str, wkv_b, layer, scale, heads: int, nope: int, rank: int, dtype) -> _WkvB:
    """wkv_b (H (D + V), C) or a stack (L, H (D + V), C) with `layer`: in `dtype`, or float8_e4m3fn with
    `scale`, its 128x128 block scales (one block never spans two heads' key or value halves)."""
    if (wkv_b.ndim == 3) != (layer is not None) or wkv_b.ndim not in (2, 3):
        fail(fn, f"wkv_b has shape {tuple(wkv_b.shape)}: a stack (L, H * (D + V), C) goes with `layer`, "
                 "(H * (D + V), C) without")
    stack = wkv_b if wkv_b.ndim == 3 else wkv_b[None]
    per_head = stack.shape[1] // heads
    if stack.shape[1] % heads or per_head <= nope or stack.shape[2] != rank:
        fail(fn, f"wkv_b has shape {tuple(wkv_b.shape)}, expected H * (D + V) rows for H={heads} heads of D={nope} "
                 f"key dims plus value dims, and C={rank} columns")
    if scale is None and stack.dtype != dtype:
        fail(fn, f"wkv_b has dtype {stack.dtype}, expected {jnp.dtype(dtype).name} (or float8_e4m3fn with its scale)")
    if scale is not None:
        scale = scale if scale.ndim == 3 else scale[None]
        want = (stack.shape[0], cdiv(stack.shape[1], BLOCK), cdiv(rank, BLOCK))
        if stack.dtype != FP8 or scale.dtype != jnp.float32 or tuple(scale.shape) != want:
            fail(fn, f"an fp8 wkv_b needs float8_e4m3fn weights and float32 block scales of shape {want}; got "
                     f"{stack.dtype} {tuple(wkv_b.shape)} and {scale.dtype} {tuple(scale.shape)}")
        if not fp8_wkv_b_aligned(nope, per_head - nope, rank):
            fail(fn, f"an fp8 wkv_b needs D={nope}, V={per_head - nope} and C={rank} multiples of {BLOCK} "
                     "(each scale block within one head's key or value half)")
    return _WkvB(stack, scale, jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(1))


def _wkv_b_layer(wkv_b, layer, heads: int, scale=None, dtype=None) -> jax.Array:
    """float32 (H, D + V, C): one layer of wkv_b, per head (an fp8 one dequantized to `dtype` first,
    as `weight_dequant` rounds it)."""
    pick = (lambda x: x) if layer is None else (lambda x: jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False))
    w = pick(wkv_b)
    if scale is not None:
        w = weight_dequant_ref(w, pick(scale), BLOCK, dtype)
    return w.astype(jnp.float32).reshape(heads, -1, w.shape[-1])


def _load_weight(ref, mask):
    """A wkv_b tile; rows or columns outside `mask` (None: the tile is whole) read as zeros. An fp8 wkv_b's
    tiles are always whole (its halves are 128-multiples): Triton has no fp8 fill value for a masked load."""
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)


def _dequantized(w, s, dtype):
    """An fp8 weight tile times its scale (a scalar, or one value per column) in float32, rounded to `dtype`."""
    return (w.astype(jnp.float32) * s).astype(dtype)


def _check_block(fn: str, name: str, value: int, most: int | None = None):
    if value < 16 or value & (value - 1) or (most is not None and value > most):
        fail(fn, f"{name}={value} must be a power of two >= 16 (a Triton dot's side)"
                 + (f" and <= {most} with an fp8 wkv_b" if most is not None else ""))


def _batch_block(batch: int) -> int:
    """Rows of one program: the batch up to 64, at least 16 (a Triton dot's side), a power of two."""
    return max(16, min(64, 1 << max(0, (batch - 1).bit_length())))


def mla_absorb_query_ref(q_nope, wkv_b, layer=None, *, wkv_b_scale=None, nope: int | None = None, rope=None,
                         latent_norm=None):
    """Plain-XLA twin of `mla_absorb_query`."""
    heads, nope = q_nope.shape[1], nope or q_nope.shape[2]
    w_k = _wkv_b_layer(wkv_b, layer, heads, wkv_b_scale, q_nope.dtype)[:, :nope]
    q_latent = jnp.einsum("bhd,hdc->bhc", q_nope[..., :nope].astype(jnp.float32), w_k).astype(q_nope.dtype)
    if rope is None:
        return q_latent
    cos, sin, interleaved = rope
    q_pe = rotate_ref(q_nope[..., nope:], cos[:, None, :], sin[:, None, :], interleaved)
    if latent_norm is None:
        return q_latent, q_pe
    kv, weight, eps = latent_norm
    return (q_latent, q_pe, *latent_norm_rope_ref(kv, weight, cos, sin, eps=eps, rank=weight.shape[-1], layer=layer,
                                                  interleaved=interleaved))


def mla_absorb_query(q_nope, wkv_b, layer=None, *, wkv_b_scale=None, nope: int | None = None, rope=None,
                     latent_norm=None, block_c: int = 64, num_warps: int = 4, num_stages: int = 1):
    """The decode query in latent space: q_latent[b, h] = q_nope[b, h] @ W[h, :D], in q_nope's dtype
    (float32 accumulation), where W = wkv_b viewed as (H, D + V, C): its key half absorbed into the query.

    q_nope: (B, H, D), D a power of two >= 16, or with `nope` = D the whole query (B, H, D + rope), whose
    first D columns the kernel reads in place (no slice of them copied out first); wkv_b: (H (D + V), C) in
    q_nope's dtype, or a stack of layers (L, H (D + V), C) with `layer` (int32 scalar), read in place. An fp8
    wkv_b comes with `wkv_b_scale`, its block scales ((L,) H (D + V) / 128, C / 128): each tile is dequantized to
    q_nope's dtype as it is loaded, as `weight_dequant` would. One program per (head, C block, batch block).
    rope: (cos, sin, interleaved), the angles (B, R / 2) float32 of the whole query's R = width - D rotary
    columns: then also q_pe, those columns rotated (B, H, R) in the query's dtype, is returned (the
    programs of C block 0 write it), so the query's rotary needs no kernel of its own.
    latent_norm: (kv, weight, eps) with rope and a wkv_b stack: wkv_a's output kv (B, C + R) of the same
    tokens and the latent norm's weight stack (L, C), read at `layer`; then the latent kv[:, :C] RMS-normed
    and the shared rotary key kv[:, C:] rotated by the query's angles are returned too (as `latent_norm_rope`
    computes them, in kv's dtype), by one more program per batch block beside the heads' programs.
    """
    batch, heads, width = q_nope.shape
    nope = width if nope is None else nope
    rank = wkv_b.shape[-1]
    w = _wkv_b_stack(_QUERY, wkv_b, layer, wkv_b_scale, heads, nope, rank, q_nope.dtype)
    _check_block(_QUERY, "D", nope)
    if nope > width:
        fail(_QUERY, f"nope={nope} exceeds the query's {width} columns")
    _check_block(_QUERY, "block_c", block_c, None if w.scale is None else BLOCK)
    angles = () if rope is None else _query_angles(rope, batch, width - nope)
    latent = () if latent_norm is None else _latent_operands(latent_norm, rope, layer, batch, width - nope)
    interpret = use_interpret()
    if batch == 0 or interpret_in_shard_map(interpret, q_nope, wkv_b):
        return mla_absorb_query_ref(q_nope, wkv_b, layer, wkv_b_scale=wkv_b_scale, nope=nope, rope=rope,
                                    latent_norm=latent_norm)
    block_b = _batch_block(batch)
    kernel = functools.partial(_query_kernel, batch=batch, nope=nope, per_head=w.stack.shape[1] // heads, rank=rank,
                               block_b=block_b, block_c=block_c, fp8=w.scale is not None,
                               interleaved=None if rope is None else bool(rope[2]),
                               eps=None if latent_norm is None else float(latent_norm[2]))
    outputs = [((batch, heads, rank), q_nope.dtype)]
    outputs += [] if rope is None else [((batch, heads, width - nope), q_nope.dtype)]
    if latent:
        outputs += [((batch, latent[1].shape[1]), latent[0].dtype), ((batch, width - nope), latent[0].dtype)]
    out = _per_head_launch(_QUERY, kernel, outputs, (cdiv(rank, block_c), cdiv(batch, block_b)),
                           (num_warps, num_stages), interpret, w.layer, q_nope, *w.refs, *angles, *latent,
                           programs=heads + bool(latent))
    return out[0] if rope is None else tuple(out)


def _latent_operands(latent_norm, rope, layer, batch: int, rope_width: int) -> tuple:
    """`mla_absorb_query`'s latent_norm argument checked: (kv, the norm's weight stack)."""
    kv, weight, _ = latent_norm
    rank = weight.shape[-1]
    if rope is None or layer is None or weight.ndim != 2 or rank < 16 or rank & (rank - 1):
        fail(_QUERY, f"latent_norm needs rope, a wkv_b stack with `layer` and a weight stack (L, C), C a power of two "
                     f">= 16; got weight {tuple(weight.shape)}" + (", no rope" if rope is None else ""))
    if kv.shape != (batch, rank + rope_width):
        fail(_QUERY, f"latent_norm's kv has shape {tuple(kv.shape)}, expected {(batch, rank + rope_width)} "
                     f"(the latent's {rank} columns, then the query's {rope_width} rotary ones)")
    return kv, weight


def _query_angles(rope, batch: int, width: int) -> tuple:
    """`mla_absorb_query`'s rope argument checked: the angles' cos and sin in float32."""
    cos, sin, _ = rope
    if width < 32 or width & (width - 1) or cos.shape != (batch, width // 2) or sin.shape != cos.shape:
        # 32: the angles' spread is a dot of side R / 2, at least 16 in Triton
        fail(_QUERY, f"rope needs the query's rotary columns ({width} after nope) a power of two >= 32 and cos, "
                     f"sin of shape {(batch, max(width, 0) // 2)}, got {cos.shape} and {sin.shape}")
    return cos.astype(jnp.float32), sin.astype(jnp.float32)


def _per_head_launch(name: str, kernel, outputs: list, blocks: tuple, launch: tuple[int, int], interpret: bool,
                     layer, *operands, programs: int | None = None):
    """One pallas_call over a (head, *blocks) grid of `kernel` on `layer` and `operands`, its `outputs` a list of
    ((B, H, ...), dtype) first; `launch` is Triton's (num_warps, num_stages); `programs` along the head axis
    (default H)."""
    vma = vma_union(*operands)
    num_warps, num_stages = launch
    return pl.pallas_call(
        kernel,
        out_shape=[result(shape, dtype, vma) for shape, dtype in outputs],
        grid=(programs or outputs[0][0][1], *blocks),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*match_vma(vma, layer, *operands))


def _query_kernel(layer_ref, q_ref, w_ref, *refs, batch, nope, per_head, rank, block_b, block_c, fp8, interleaved,
                  eps):
    """An fp8 wkv_b's key half is read in chunks of 128 rows, one scale each (block_c <= 128: one column).
    With `interleaved` (not None) the programs of C block 0 also rotate the query's rotary columns; with `eps`
    (not None) the programs past the heads norm the latent and rotate the shared key."""
    refs = list(refs)
    s_ref = refs.pop(0) if fp8 else None
    cos_ref, sin_ref = (refs.pop(0), refs.pop(0)) if interleaved is not None else (None, None)
    kv_ref, nw_ref = (refs.pop(0), refs.pop(0)) if eps is not None else (None, None)
    o_ref, *pe_refs = refs
    h, cb, bb = launch_dependents(pl.program_id(0)), pl.program_id(1), pl.program_id(2)
    layer = layer_ref[0]
    row_ok = bb * block_b + jnp.arange(block_b) < batch
    bs = pl.ds(bb * block_b, block_b)
    heads = q_ref.shape[1]

    def absorb():
        col_ok = cb * block_c + jnp.arange(block_c) < rank
        cs = pl.ds(cb * block_c, block_c)
        chunk = BLOCK if fp8 else nope
        acc = jnp.zeros((block_b, block_c), jnp.float32)
        for c in range(nope // chunk):
            q = plgpu.load(q_ref.at[bs, h, pl.ds(c * chunk, chunk)], mask=row_ok[:, None], other=0)
            w = _load_weight(w_ref.at[layer, pl.ds(h * per_head + c * chunk, chunk), cs],
                             None if rank % block_c == 0 else col_ok[None, :])
            if fp8:
                w = _dequantized(w, s_ref[layer, (h * per_head) // BLOCK + c, (cb * block_c) // BLOCK], q.dtype)
            acc += jax.lax.dot(q, w, preferred_element_type=jnp.float32)
        plgpu.store(o_ref.at[bs, h, cs], acc.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])
        if interleaved is not None:
            width = pe_refs[0].shape[2]
            pl.when(cb == 0)(lambda: _rotate_into(pe_refs[0].at[bs, h, :], q_ref.at[bs, h, pl.ds(nope, width)],
                                                  cos_ref.at[bs, :], sin_ref.at[bs, :], row_ok, interleaved))

    if eps is None:
        absorb()
        return
    pl.when(h < heads)(absorb)
    latent_ref, kpe_ref = pe_refs[1:]

    @pl.when((h == heads) & (cb == 0))
    def _():  # RMSNorm over the latent's columns in chunks (two passes, as the norm kernels), then the key's rotary
        rank = latent_ref.shape[1]
        chunks = [pl.ds(c * min(rank, BLOCK), min(rank, BLOCK)) for c in range(rank // min(rank, BLOCK))]

        def load(cs):
            return plgpu.load(kv_ref.at[bs, cs], mask=row_ok[:, None], other=0).astype(jnp.float32)

        squares = functools.reduce(jnp.add, [jnp.sum(jnp.square(load(cs)), axis=1) for cs in chunks])
        inv = jax.lax.rsqrt(squares / rank + eps)[:, None]
        for cs in chunks:
            normed = load(cs) * inv * plgpu.load(nw_ref.at[layer, cs]).astype(jnp.float32)[None, :]
            plgpu.store(latent_ref.at[bs, cs], normed.astype(latent_ref.dtype), mask=row_ok[:, None])
        _rotate_into(kpe_ref.at[bs, :], kv_ref.at[bs, pl.ds(rank, kpe_ref.shape[1])], cos_ref.at[bs, :],
                     sin_ref.at[bs, :], row_ok, interleaved)


def _rotate_into(out, x, cos, sin, row_ok, interleaved: bool):
    """The (block_b, R) rows of view x rotated by the (block_b, R / 2) angles of views cos, sin, stored in out."""
    rows = plgpu.load(x, mask=row_ok[:, None], other=0)
    cos, sin = (plgpu.load(r, mask=row_ok[:, None], other=0.0) for r in (cos, sin))
    plgpu.store(out, rotate_rows(rows, cos, sin, interleaved).astype(out.dtype), mask=row_ok[:, None])


def mla_decode_output_ref(acc, m, l, q_latent, q_pe, new_kv, new_pe, wkv_b, layer=None, *, scale: float,
                          v_dim: int, wkv_b_scale=None):
    """Plain-XLA twin of `mla_decode_output`."""
    f32 = jnp.float32
    own = (jnp.einsum("bhc,bc->bh", q_latent.astype(f32), new_kv.astype(f32))
           + jnp.einsum("bhr,br->bh", q_pe.astype(f32), new_pe.astype(f32))) * scale
    top = jnp.maximum(m.max(axis=1), own)
    weight, own_weight = jnp.exp(m - top[:, None]), jnp.exp(own - top)
    total = (l * weight).sum(axis=1) + own_weight
    latent = ((acc * weight[..., None]).sum(axis=1) + own_weight[..., None] * new_kv.astype(f32)[:, None, :])
    latent = (latent / total[..., None]).astype(q_latent.dtype)
    w_v = _wkv_b_layer(wkv_b, layer, q_latent.shape[1], wkv_b_scale, q_latent.dtype)[:, -v_dim:]
    return jnp.einsum("bhc,hdc->bhd", latent.astype(f32), w_v).astype(q_latent.dtype)


def mla_decode_output(acc, m, l, q_latent, q_pe, new_kv, new_pe, wkv_b, layer=None, *, scale: float, v_dim: int,
                      wkv_b_scale=None, block_v: int | None = None, block_b: int | None = None, v_blocks: int = 1,
                      num_warps: int | None = None, num_stages: int = 1) -> jax.Array:
    """The end of the absorbed decode attention in one launch: `mla_decode_splits`' partial softmaxes
    (acc, m, l) merged with the new entry's (scored from q_latent, q_pe, new_kv, new_pe as `mla_decode`
    does), the latent output rounded to q_latent's dtype and projected through wkv_b's value half:
    out[b, h] = latent[b, h] @ W[h, D:]^T, (B, H, V) in q_latent's dtype, W = wkv_b viewed as (H, D + V, C).

    wkv_b: (H (D + V), C) in q_latent's dtype, or a stack (L, H (D + V), C) with `layer`, read in place;
    an fp8 one with `wkv_b_scale`, dequantized tile by tile (as in `mla_absorb_query`).
    One program per (head, `v_blocks` V blocks of `block_v` columns, batch block of at most `block_b` rows); each
    merges its rows' splits itself, once for its V blocks (more V blocks a program: fewer programs, each split
    read by fewer of them). A program holds its rows' (block_b, C) float32 latents: more than 16 rows spill
    registers. Under 16 rows (a power of two) the projection is products summed over C instead of a dot,
    so that a program of a few rows holds no padding rows. `block_b` None: one row at batch 1, else 16.
    `block_v`, `num_warps` None: `default_output_tiles`.
    """
    batch, splits, heads, rank = acc.shape
    block_b = (1 if batch == 1 else 16) if block_b is None else block_b
    w = _wkv_b_stack(_OUTPUT, wkv_b, layer, wkv_b_scale, heads, wkv_b.shape[-2] // heads - v_dim, rank,
                     q_latent.dtype)
    block_v, default_warps = default_output_tiles(batch, w.scale is not None, block_v)
    num_warps = default_warps if num_warps is None else num_warps
    _check_block(_OUTPUT, "block_v", block_v, None if w.scale is None else BLOCK)
    if block_b < 1 or block_b & (block_b - 1):
        fail(_OUTPUT, f"block_b={block_b} must be a power of two (under 16: rows projected without a dot)")
    if v_blocks < 1:
        fail(_OUTPUT, f"v_blocks={v_blocks} must be at least 1")
    v_blocks = min(v_blocks, cdiv(v_dim, block_v))
    if q_latent.shape != (batch, heads, rank) or m.shape != (batch, splits, heads):
        fail(_OUTPUT, f"acc {acc.shape}, m {m.shape}, q_latent {q_latent.shape} {q_latent.dtype} and wkv_b "
                      f"{w.stack.dtype} do not match")
    interpret = use_interpret()
    if batch == 0 or interpret_in_shard_map(interpret, acc, q_latent, wkv_b):
        return mla_decode_output_ref(acc, m, l, q_latent, q_pe, new_kv, new_pe, wkv_b, layer, scale=scale,
                                     v_dim=v_dim, wkv_b_scale=wkv_b_scale)
    block_b = block_b if block_b < 16 else min(block_b, _batch_block(batch))
    per_head = w.stack.shape[1] // heads
    kernel = functools.partial(_output_kernel, batch=batch, splits=splits, value_row=per_head - v_dim,
                               per_head=per_head, v_dim=v_dim, scale=scale, block_b=block_b, block_v=block_v,
                               splits_padded=1 << max(0, (splits - 1).bit_length()), fp8=w.scale is not None,
                               v_blocks=v_blocks)
    (out,) = _per_head_launch(_OUTPUT, kernel, [((batch, heads, v_dim), q_latent.dtype)],
                              (cdiv(v_dim, block_v * v_blocks), cdiv(batch, block_b)), (num_warps, num_stages),
                              interpret,
                              w.layer, acc, m, l, q_latent, q_pe, new_kv, new_pe, *w.refs)
    return out


def default_output_tiles(batch: int, fp8: bool, block_v: int | None = None) -> tuple[int, int]:
    """mla_decode_output's (block_v, num_warps) where block_v is None: V tiles wider above 16 rows with a wkv_b in
    q_latent's dtype (fewer programs, each merging its rows' splits once), else 16 (an fp8 wkv_b's dequantized
    64-wide tile spills beside 16 rows' latents); 8 warps for 128-wide tiles (at 4 their 16 rows spill)."""
    if block_v is None:
        block_v = 16 if fp8 or batch <= 16 else 128 if batch > WHOLE_VALUE_TILES_ABOVE_ROWS else 64
    return block_v, 8 if block_v >= 128 else 4


def _merged_latent(acc_ref, m_ref, l_ref, q_ref, qpe_ref, kv_ref, pe_ref, *, h, bs, row_ok, splits, scale,
                   splits_padded):
    """float32 (block_b, C): head h's attention output in latent space, its splits merged with the new entry."""
    f32 = jnp.float32
    new_kv = plgpu.load(kv_ref.at[bs, :], mask=row_ok[:, None], other=0).astype(f32)
    own = (jnp.sum(plgpu.load(q_ref.at[bs, h, :], mask=row_ok[:, None], other=0).astype(f32) * new_kv, axis=1)
           + jnp.sum(plgpu.load(qpe_ref.at[bs, h, :], mask=row_ok[:, None], other=0).astype(f32)
                     * plgpu.load(pe_ref.at[bs, :], mask=row_ok[:, None], other=0).astype(f32), axis=1)) * scale
    split_ok = row_ok[:, None] & (jnp.arange(splits_padded) < splits)[None, :]
    maxima = plgpu.load(m_ref.at[bs, pl.ds(0, splits_padded), h], mask=split_ok, other=_NEG)
    top = jnp.maximum(maxima.max(axis=1), own)
    weights = jnp.exp(maxima - top[:, None])
    own_weight = jnp.exp(own - top)
    total = jnp.sum(plgpu.load(l_ref.at[bs, pl.ds(0, splits_padded), h], mask=split_ok, other=0) * weights, axis=1)

    def add_split(split, ok, latent):
        weight = jnp.exp(plgpu.load(m_ref.at[bs, split, h], mask=ok, other=_NEG) - top)
        return latent + plgpu.load(acc_ref.at[bs, split, h, :], mask=ok[:, None], other=0) * weight[:, None]

    def add_group(g, latent):  # MERGE_GROUP splits a step, their loads in flight together
        for i in range(MERGE_GROUP):
            latent = add_split(g * MERGE_GROUP + i, row_ok & (g * MERGE_GROUP + i < splits), latent)
        return latent

    latent = own_weight[:, None] * new_kv
    if splits <= MERGE_GROUP:  # one split a step: a group loop of a single step measured far slower (benchmarks/NOTES)
        latent = jax.lax.fori_loop(0, splits, lambda split, x: add_split(split, row_ok, x), latent)
    else:
        latent = jax.lax.fori_loop(0, cdiv(splits, MERGE_GROUP), add_group, latent)
    return latent / (total + own_weight)[:, None]


def _output_kernel(layer_ref, acc_ref, m_ref, l_ref, q_ref, qpe_ref, kv_ref, pe_ref, w_ref, *refs, batch, splits,
                   value_row, per_head, v_dim, scale, block_b, block_v, splits_padded, fp8, v_blocks):
    """The rows' latents merged once, then projected through each of the program's V blocks."""
    s_ref, o_ref = refs if fp8 else (None, *refs)
    h, vg, bb = pl.program_id(0), pl.program_id(1), launch_dependents(pl.program_id(2))
    row_ok = bb * block_b + jnp.arange(block_b) < batch
    bs = pl.ds(bb * block_b, block_b)
    latent = _merged_latent(acc_ref, m_ref, l_ref, q_ref, qpe_ref, kv_ref, pe_ref, h=h, bs=bs, row_ok=row_ok,
                            splits=splits, scale=scale, splits_padded=splits_padded).astype(q_ref.dtype)
    blocks = cdiv(v_dim, block_v)

    def project(i, carry):  # a loop, not unrolled: unrolled, the blocks' weight loads were hoisted and spilled
        vb = vg * v_blocks + i
        block = functools.partial(_project_value_block, latent, w_ref, s_ref, o_ref, layer_ref[0], h, vb, bs, row_ok,
                                  value_row=value_row, per_head=per_head, v_dim=v_dim, block_v=block_v, fp8=fp8)
        if blocks % v_blocks:  # the last program's last blocks lie past V: they read and store nothing
            pl.when(vb < blocks)(block)
        else:
            block()
        return carry

    if v_blocks == 1:
        project(0, 0)
    else:
        jax.lax.fori_loop(0, v_blocks, project, 0)


def _project_value_block(latent, w_ref, s_ref, o_ref, layer, h, vb, bs, row_ok, *, value_row, per_head, v_dim,
                         block_v, fp8):
    """out[rows, h, V block vb] = latent @ W[h, D + V block]^T. An fp8 wkv_b's value rows of a block lie in one
    row of scale blocks (block_v <= 128): one scale per 128 columns, spread over the tile's columns."""
    v_ok = vb * block_v + jnp.arange(block_v) < v_dim
    first_row = h * per_head + value_row + vb * block_v
    w_v = _load_weight(w_ref.at[layer, pl.ds(first_row, block_v), :], None if v_dim % block_v == 0 else v_ok[:, None])
    if fp8:
        columns, scale_row = jnp.arange(w_v.shape[1]), first_row // BLOCK
        col_scale = jnp.zeros(w_v.shape[1:], jnp.float32)
        for c in range(w_v.shape[1] // BLOCK):
            col_scale = jnp.where(columns // BLOCK == c, s_ref[layer, scale_row, c], col_scale)
        w_v = _dequantized(w_v, col_scale[None, :], latent.dtype)
    if latent.shape[0] < 16:  # under a Triton dot's side: products summed over C (no rows of zeros to carry)
        f32 = jnp.float32
        out = jnp.sum(latent.astype(f32)[:, None, :] * w_v.astype(f32)[None, :, :], axis=2)
    else:
        out = jax.lax.dot_general(latent, w_v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    plgpu.store(o_ref.at[bs, h, pl.ds(vb * block_v, block_v)], out.astype(o_ref.dtype),
                mask=row_ok[:, None] & v_ok[None, :])
