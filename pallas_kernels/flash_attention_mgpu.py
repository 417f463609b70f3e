"""Causal prefill attention on Hopper (sm_90) through Pallas' Mosaic GPU backend (FlashAttention-3 style).

Computes what `flash_attention.flash_attention_ref` computes -- per head, softmax over the visible
keys of (q . k) * scale, times v, with float32 scores, softmax and accumulation -- without ever
holding more than one (block_q, block_kv) tile of scores, in registers:

  * one CTA per (head, 2 * block_q query rows, batch row); two compute warpgroups own block_q query
    rows each, a third (producer) warpgroup streams key and value blocks of block_kv rows with TMA
    into a ring of `max_concurrent_steps` swizzled SMEM slots;
  * per key block: S = Q K^T by wgmma (d_qk 192 = three 64-wide swizzle tiles), the online-softmax
    update in registers (exp2 with the scale and log2(e) folded into one multiply), then P V by
    wgmma with P (bf16) straight from registers into a fresh accumulator (d_v 128), folded in as
    O = O * alpha + P V;
  * the two compute warpgroups take turns on the tensor cores (a two-arrival "schedule" barrier,
    as in jax's attention_mgpu example): one runs its softmax while the other's wgmma runs;
  * causality by per-row positions: key t is visible to query (b, s) iff kv_start <= t <=
    positions[b, s]. XLA computes, per block_q query rows, the key blocks that are wholly visible
    (no mask), partly visible (masked with an iota compare) and invisible (skipped: never loaded
    unless the CTA's other warpgroup needs them, and then only released). Causal prefill thus does
    about half the work of a full one, for any per-row positions;
  * query tiles are launched last-first, so the CTAs with the most key blocks start first.

A row that sees no key at all (kv_start > its position) gets zeros. Queries are padded to a
multiple of 2 * block_q (pad rows see nothing and are dropped); the key length T must be a
multiple of block_kv. The output staging buffer shares SMEM with Q (a `RefUnion`): Q is dead once
the warpgroup's last S = Q K^T is done, and this is what lets block_kv 128 with two slots fit.

Without a GPU the kernel runs in Mosaic GPU's interpret mode (a CPU simulation of the warpgroups,
TMA, barriers and wgmma): slow, for small test shapes. The one difference there: P goes to the
P V wgmma through SMEM, as the interpreter's wgmma reads its A operand from SMEM only.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ._common import SHARED_MEMORY_BYTES, cdiv, fail, match_vma, result, vma_union

_FN = "flash_attention_mgpu"
COMPUTE_WGS = 2  # query warpgroups per CTA (the ping-pong schedule needs exactly two)
M_FLOOR = -1e30  # running max before any visible key: finite, so an all-masked block gives p = 0, not NaN
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True)
class FlashTiles:
    """Tiling of one `flash_attention_mgpu` launch.

    block_q: query rows per compute warpgroup (a multiple of 64, the wgmma M); a CTA holds two.
    block_kv: key rows per pipeline step (a multiple of 64); a (block_q, block_kv) float32 score
      tile and the (block_q, d_v) accumulator live in each compute warpgroup's registers.
    max_concurrent_steps: key/value blocks in flight in SMEM (>= 2).
    """
    block_q: int = 64
    block_kv: int = 128
    max_concurrent_steps: int = 2

    def smem_bytes(self, d_qk: int, d_v: int, itemsize: int) -> int:
        q = COMPUTE_WGS * self.block_q * d_qk * itemsize  # also holds the output (RefUnion)
        kv = self.max_concurrent_steps * self.block_kv * (d_qk + d_v) * itemsize
        return q + kv + 1024  # + barriers and alignment

    def check(self, d_qk: int, d_v: int, itemsize: int) -> None:
        """One-line ValueError naming what is wrong with the tiling."""
        bad = []
        if self.block_q < 64 or self.block_q % 64:
            bad.append("block_q a multiple of 64")
        if self.block_kv < 64 or self.block_kv % 64:
            bad.append("block_kv a multiple of 64")
        if self.max_concurrent_steps < 2:
            bad.append("max_concurrent_steps >= 2")
        if not bad and (need := self.smem_bytes(d_qk, d_v, itemsize)) > SHARED_MEMORY_BYTES:
            bad.append(f"at most {SHARED_MEMORY_BYTES} bytes of SMEM (it takes {need} at d_qk={d_qk}, d_v={d_v})")
        if bad:
            raise ValueError(f"{_FN}: {self} needs {'; '.join(bad)}")


def default_tiles(t: int) -> FlashTiles:
    """block_kv 128 where T allows it (fewer, larger steps), else 64 with a three-deep ring."""
    return FlashTiles() if t % 128 == 0 else FlashTiles(block_kv=64, max_concurrent_steps=3)


def mosaic_unsupported(q_shape, k_shape, v_shape, dtype) -> str | None:
    """Why the kernel cannot take these operands (shapes as in `flash_attention`), or None if it can."""
    d_qk, d_v, t = q_shape[-1], v_shape[-1], k_shape[1]
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype).name} (the kernel takes bfloat16 or float16)"
    if d_qk % 64 or d_v % 64:
        return f"head dims d_qk={d_qk}, d_v={d_v} (each must be a multiple of 64)"
    if d_v > d_qk:
        return f"d_v={d_v} > d_qk={d_qk} (the output shares Q's SMEM)"
    if t % 64:
        return f"T={t} keys (must be a multiple of 64)"
    return None


def kv_block_bounds(positions: jax.Array, rows: int, t: int, kv_start: int, block_q: int,
                    block_kv: int) -> jax.Array:
    """int32 (B, S_pad // block_q, 3): per block_q query rows, key blocks [kv_start // block_kv, a)
    partly visible, [a, b) wholly visible to every real row, [b, c) partly visible, c.. invisible.

    positions (B, S_pad) int32; rows: the real (unpadded) query count, pad rows do not narrow [a, b).
    """
    batch, s_pad = positions.shape
    pos = positions.reshape(batch, s_pad // block_q, block_q)
    real = (jnp.arange(s_pad) < rows).reshape(1, s_pad // block_q, block_q)
    pmax = jnp.max(jnp.where(real, pos, -1), axis=-1)
    pmin = jnp.min(jnp.where(real, jnp.clip(pos, -1, t), t), axis=-1)
    lo, nkv = kv_start // block_kv, t // block_kv
    end = jnp.clip((jnp.minimum(pmax, t - 1) + block_kv) // block_kv, lo, nkv)  # blocks holding a key <= pmax
    end = jnp.where(pmax < kv_start, lo, end)
    full_lo = jnp.minimum(cdiv(kv_start, block_kv), end)
    full_hi = jnp.clip((pmin + 1) // block_kv, full_lo, end)  # blocks wholly <= pmin
    return jnp.stack([full_lo, full_hi, end], axis=-1).astype(jnp.int32)


def flash_attention_mgpu(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, *, scale: float,
                         kv_start: int = 0, tiles: FlashTiles | None = None, interpret: bool = False) -> jax.Array:
    """(B, S, H, d_v) attention output in q's dtype; operands as in `flash_attention.flash_attention`.

    interpret=True runs Mosaic GPU's CPU interpreter instead of compiling.
    """
    batch, rows, heads, d_qk = q.shape
    t, d_v = k.shape[1], v.shape[-1]
    if (why := mosaic_unsupported(q.shape, k.shape, v.shape, q.dtype)) is not None:
        fail(_FN, f"unsupported: {why}")
    tiles = tiles or default_tiles(t)
    tiles.check(d_qk, d_v, q.dtype.itemsize)
    if t % tiles.block_kv:
        fail(_FN, f"T={t} keys is not a multiple of block_kv={tiles.block_kv}")
    cta_rows = COMPUTE_WGS * tiles.block_q
    s_pad = cdiv(rows, cta_rows) * cta_rows
    positions = positions.astype(jnp.int32)
    if s_pad != rows:  # whole CTA tiles of queries: pad rows at position -1 see nothing
        q = jnp.pad(q, ((0, 0), (0, s_pad - rows), (0, 0), (0, 0)))
        positions = jnp.pad(positions, ((0, 0), (0, s_pad - rows)), constant_values=-1)
    bounds = kv_block_bounds(positions, rows, t, kv_start, tiles.block_q, tiles.block_kv)
    vma = vma_union(q, k, v, positions)  # inside shard_map: operands and result vary alike
    operands = match_vma(vma, q, k, v, positions, bounds)
    call = _build(batch, s_pad, heads, t, d_qk, d_v, jnp.dtype(q.dtype), float(scale), int(kv_start), tiles,
                  vma, interpret)
    out = call(*operands)
    return out[:, :rows] if s_pad != rows else out


@functools.lru_cache(maxsize=64)  # pure function of hashable arguments: no mutable state
def _build(batch, s_pad, heads, t, d_qk, d_v, dtype, scale, kv_start, tiles: FlashTiles, vma, interpret):
    bq, bkv, steps = tiles.block_q, tiles.block_kv, tiles.max_concurrent_steps
    swz = (plgpu.TilingTransform((8, 128 // dtype.itemsize)), plgpu.SwizzleTransform(128))
    o_rows = cdiv(cdiv(bq * d_qk, d_v), 8) * 8  # o[wg] starts at or past q[wg]'s first byte
    qo = plgpu.RefUnion(plgpu.SMEM((COMPUTE_WGS, bq, d_qk), dtype, transforms=swz),
                        plgpu.SMEM((COMPUTE_WGS, o_rows, d_v), dtype, transforms=swz))
    scratch = [
        (qo, plgpu.SMEM((steps, bkv, d_qk), dtype, transforms=swz),
         plgpu.SMEM((steps, bkv, d_v), dtype, transforms=swz)),
        (plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=steps), plgpu.Barrier(num_barriers=COMPUTE_WGS)),
        (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=steps),) * 2,
        plgpu.Barrier(num_arrivals=COMPUTE_WGS),
    ]
    if interpret:  # the interpreter's wgmma reads A from SMEM only: P goes through a buffer there
        scratch.append(plgpu.SMEM((COMPUTE_WGS, bq, bkv), dtype, transforms=swz))
    n_q_tiles = s_pad // (COMPUTE_WGS * bq)
    body = functools.partial(_kernel, n_q_tiles=n_q_tiles, scale=scale, kv_start=kv_start, tiles=tiles)
    return plgpu.kernel(
        body,
        out_type=result((batch, s_pad, heads, d_v), dtype, vma),
        scratch_types=scratch,
        grid=(heads, n_q_tiles, batch),
        grid_names=("heads", "q_seq", "batch"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else None,
        kernel_name=_FN,
    )


def _kernel(q_ref, k_ref, v_ref, pos_ref, bounds_ref, out_ref, smem, ready, consumed, schedule, p_smem=None, *,
            n_q_tiles: int, scale: float, kv_start: int, tiles: FlashTiles):
    b, h, wg = lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")
    first_blk = (n_q_tiles - 1 - lax.axis_index("q_seq")) * COMPUTE_WGS  # heaviest query tiles first
    bkv, steps = tiles.block_kv, tiles.max_concurrent_steps
    lo = kv_start // bkv  # no key block before this one is visible to anyone
    cta_end = bounds_ref[b, first_blk, 2]
    for i in range(1, COMPUTE_WGS):
        cta_end = jnp.maximum(cta_end, bounds_ref[b, first_blk + i, 2])
    k_smem, v_smem = smem[1], smem[2]

    def fetch(step, slot):
        keys = (b, pl.ds(step * bkv, bkv), h)
        plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], ready[0].at[slot])
        plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], ready[1].at[slot])

    @pl.when(wg == COMPUTE_WGS)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        for i in range(min(steps, k_ref.shape[1] // bkv - lo)):  # the ring's first fill
            pl.when(lo + i < cta_end)(functools.partial(fetch, lo + i, i))

        @pl.loop(lo + steps, jnp.maximum(cta_end, lo + steps))
        def _refill(step):
            slot = lax.rem(step - lo, steps)
            plgpu.barrier_wait(consumed[0].at[slot])
            keys = (b, pl.ds(step * bkv, bkv), h)
            plgpu.copy_gmem_to_smem(k_ref.at[keys], k_smem.at[slot], ready[0].at[slot])
            plgpu.barrier_wait(consumed[1].at[slot])
            plgpu.copy_gmem_to_smem(v_ref.at[keys], v_smem.at[slot], ready[1].at[slot])

        def drain(step, _):  # see the last blocks released (no barrier phase is left unobserved)
            slot = lax.rem(step - lo, steps)
            plgpu.barrier_wait(consumed[0].at[slot])
            plgpu.barrier_wait(consumed[1].at[slot])

        _loop(jnp.maximum(lo, cta_end - steps), cta_end, drain, None)

    @pl.when(wg < COMPUTE_WGS)
    def _consumer():
        plgpu.set_max_registers(232, action="increase")
        _compute(q_ref, pos_ref, bounds_ref, out_ref, smem, ready, consumed, schedule, p_smem, b=b, h=h, wg=wg,
                 blk=first_blk + wg, lo=lo, cta_end=cta_end, scale=scale, kv_start=kv_start, tiles=tiles)


@dataclasses.dataclass(frozen=True)
class _Warpgroup:
    """What one compute warpgroup's key-block steps read: its SMEM views, the barriers, its query
    positions (a row vector), the first key block lo, its own end, and the static tiling."""
    q_smem: object
    k_smem: object
    v_smem: object
    p_smem: object  # interpret mode only, see _build
    ready: tuple
    consumed: tuple
    schedule: object
    pos: jax.Array
    lo: jax.Array | int
    end: jax.Array
    c: float  # scale * log2(e): scores in log2 units, p = exp2(s * c - m)
    kv_start: int
    tiles: FlashTiles


def _compute(q_ref, pos_ref, bounds_ref, out_ref, smem, ready, consumed, schedule, p_smem, *, b, h, wg, blk, lo,
             cta_end, scale, kv_start, tiles: FlashTiles):
    """One compute warpgroup: its block_q query rows against key blocks [lo, end), then releases
    the blocks up to cta_end that only the other warpgroup reads."""
    bq, bkv = tiles.block_q, tiles.block_kv
    (q_all, o_all), k_smem, v_smem = smem
    q_smem, o_smem = q_all.at[wg], o_all.at[wg]
    full_lo, full_hi, end = bounds_ref[b, blk, 0], bounds_ref[b, blk, 1], bounds_ref[b, blk, 2]
    rows = pl.ds(blk * bq, bq)
    plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem, ready[2].at[wg])
    pos = plgpu.load(pos_ref.at[b, rows], layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)
    plgpu.barrier_wait(ready[2].at[wg])
    me = _Warpgroup(q_smem, k_smem, v_smem, None if p_smem is None else p_smem.at[wg], ready, consumed, schedule,
                    pos, lo, end, scale * _LOG2E, kv_start, tiles)

    row_vec = plgpu.Layout.WGMMA.reduce(1)
    carry = (plgpu.layout_cast(jnp.zeros((bq, o_smem.shape[-1]), jnp.float32), plgpu.Layout.WGMMA),
             plgpu.layout_cast(jnp.full((bq,), M_FLOOR, jnp.float32), row_vec),
             plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), row_vec))

    @pl.when(end > lo)
    def _():
        plgpu.barrier_wait(ready[0].at[0])

    pl.when(wg == 1)(functools.partial(_turn, schedule))
    masked = lambda step, carry: _kv_step(me, step, carry, masked=True)  # noqa: E731
    unmasked = lambda step, carry: _kv_step(me, step, carry, masked=False)  # noqa: E731
    if kv_start % bkv:
        carry = lax.fori_loop(lo, full_lo, masked, carry)
    carry = _loop(full_lo, full_hi, unmasked, carry)
    acc, _, l_i = _loop(full_hi, end, masked, carry)
    _loop(end, cta_end, lambda step, _: _release(me, step), None)
    pl.when(wg == 0)(functools.partial(_turn, schedule))

    inv = 1.0 / jnp.where(l_i == 0.0, 1.0, l_i)  # a row that saw no key: acc is 0, so is its output
    out = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(o_smem.dtype)
    o_rows = o_smem.at[pl.ds(0, bq)]
    o_rows[...] = out
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_rows, out_ref.at[b, rows, h])
    plgpu.wait_smem_to_gmem(0)


def _loop(lower, upper, body, carry):
    """lax.fori_loop over [lower, upper) with a traced lower bound, counted from 0: inside
    jax.shard_map a counter starting at a value read from an operand would vary along the mesh
    axes while the body's increment of it does not, which the loop's type check rejects."""
    return lax.fori_loop(0, upper - lower, lambda i, c: body(lower + i, c), carry)


def _turn(schedule):
    """The other compute warpgroup's turn on the tensor cores."""
    plgpu.barrier_arrive(schedule)
    plgpu.barrier_wait(schedule)


def _kv_step(me: _Warpgroup, step, carry, masked: bool):
    """One key block: S = Q K^T, the online-softmax update (with the mask on partly visible
    blocks), acc = acc * alpha + P V; waits for the next K block while P V runs."""
    acc, m_i, l_i = carry
    bq, bkv, steps = me.tiles.block_q, me.tiles.block_kv, me.tiles.max_concurrent_steps
    slot = lax.rem(step - me.lo, steps)

    def scores(s_ref):
        plgpu.wgmma(s_ref, me.q_smem, me.k_smem.at[slot].T)
        _turn(me.schedule)
        return s_ref[...]

    s = pl.run_scoped(scores, plgpu.ACC((bq, bkv), jnp.float32))
    plgpu.barrier_arrive(me.consumed[0].at[slot])
    if masked:
        key = plgpu.broadcasted_iota(jnp.int32, (bq, bkv), 1, layout=plgpu.Layout.WGMMA) + step * bkv
        visible = key <= lax.broadcast_in_dim(me.pos, (bq, bkv), [0])
        if me.kv_start:
            visible = visible & (key >= me.kv_start)
        s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m_i, s.max(axis=1) * me.c)
    alpha = jnp.exp2(m_i - m_new)
    p = jnp.exp2(s * me.c - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l_i = l_i * alpha + p.sum(axis=1)
    p16 = p.astype(me.q_smem.dtype)
    alpha, l_i, m_new, p16 = lax.optimization_barrier((alpha, l_i, m_new, p16))
    plgpu.barrier_arrive(me.schedule)  # softmax done
    plgpu.barrier_wait(me.ready[1].at[slot])
    plgpu.barrier_wait(me.schedule)  # the tensor cores are ours again
    if me.p_smem is not None:  # interpret mode only, see _build
        me.p_smem[...] = p16
        plgpu.commit_smem()
        p16 = me.p_smem

    def values(pv_ref):
        plgpu.wgmma(pv_ref, p16, me.v_smem.at[slot])
        nxt = step + 1

        @pl.when(nxt < me.end)
        def _():  # the next K block, while this wgmma runs
            plgpu.barrier_wait(me.ready[0].at[lax.rem(nxt - me.lo, steps)])

        return pv_ref[...]

    # P V into a fresh accumulator, folded in with the rescale (one FMA an element). Mosaic GPU's
    # interpreter has no pl.run_state, which would let the wgmma accumulate into acc in place.
    pv = pl.run_scoped(values, plgpu.ACC((bq, me.v_smem.shape[-1]), jnp.float32))
    plgpu.barrier_arrive(me.consumed[1].at[slot])
    return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv, m_new, l_i


def _release(me: _Warpgroup, step) -> None:
    """A key block only the other warpgroup reads: keep the barrier counts (and turns) in step."""
    slot = lax.rem(step - me.lo, me.tiles.max_concurrent_steps)
    plgpu.barrier_wait(me.ready[0].at[slot])  # observe every phase, as the interpreter checks
    plgpu.barrier_wait(me.ready[1].at[slot])
    plgpu.barrier_arrive(me.consumed[0].at[slot])
    plgpu.barrier_arrive(me.consumed[1].at[slot])
    _turn(me.schedule)
    _turn(me.schedule)
