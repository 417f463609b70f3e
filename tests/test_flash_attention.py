"""Prefill attention without materialised scores (pallas_kernels.flash_attention) against float64 math.

Oracle: `dense64`, the softmax attention written out in float64 numpy (the whole score matrix,
masked by kv_start <= t <= positions[b, s]), sharing no code with the kernels. On the CPU:
  * the jnp twin `flash_attention_ref` on float32 inputs equals it within float32 rounding
    (atol = rtol = 2e-6: the outputs are convex combinations of values of size ~1, so one mis-masked
    key among n visible moves a row by ~1/n, >= 3e-3 here; a wrong rescale moves it by O(1));
  * the Mosaic GPU kernel in Mosaic GPU's interpret mode (bf16 in, bf16 out) equals it within
    bf16 rounding, and equals the twin (same rounding points) within 2 ulps;
  * "pointer" data, where the last visible key (or the first, at kv_start) outscores all others by
    far, so that the output IS that key's value row: an off-by-one mask fails by O(1) even at bf16;
  * the compiled twin's temporary memory grows with S, never with S x T;
  * the kernel lowers for CUDA at V2-Lite and V3 shapes (the whole Pallas -> Mosaic GPU lowering).
With -m gpu: the compiled kernel at V2-Lite (16) and V3 (128) head counts, ragged positions.

On the CPU the twins and the interpreted kernel run under `jax.jit` (`twin`, `dense`, `mosaic`: one
program per shape, as in the model; the `auto` tests compare with the twin called eagerly) and the
operands go to the device already in their dtype (`jax.device_put`: no conversion programs).
"""
from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from pallas_kernels import FlashTiles, flash_attention
from pallas_kernels.flash_attention import flash_attention_ref, key_block, query_block
from pallas_kernels.flash_attention_mgpu import flash_attention_mgpu, kv_block_bounds
from pallas_kernels.reference import attention_dense_ref

D_QK, D_V = 192, 128  # DeepSeek MLA: nope 128 + rope 64, value 128
BF16_ULP = 2.0 ** -8  # bf16 spacing in [1, 2)
NUMPY_DTYPES = {jnp.float32: np.float32, jnp.bfloat16: ml_dtypes.bfloat16}

twin = jax.jit(flash_attention_ref, static_argnames=("scale", "kv_start", "block_kv", "block_q"))
dense = jax.jit(attention_dense_ref, static_argnames=("scale", "kv_start"))
mosaic = jax.jit(flash_attention_mgpu, static_argnames=("scale", "kv_start", "tiles", "interpret"))


def seed(name: str) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(name.encode()))


def operands(rng, b, s, h, t, dtype, d_qk=D_QK, d_v=D_V):
    q, k = rng.standard_normal((b, s, h, d_qk)), rng.standard_normal((b, t, h, d_qk))
    v = rng.standard_normal((b, t, h, d_v))
    return tuple(jax.device_put(x.astype(NUMPY_DTYPES[dtype])) for x in (q, k, v))


def dense64(q, k, v, positions, scale, kv_start=0):
    """float64 softmax attention over the visible keys; a row that sees none is zero."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bshd,bthd->bsht", q, k, optimize=True) * scale
    key = np.arange(k.shape[1])
    pos = np.asarray(positions)
    visible = ((key[None, None, :] <= pos[:, :, None]) & (key >= kv_start))[:, :, None, :]
    s = np.where(visible, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    e = np.where(visible, np.exp(s - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    return np.einsum("bsht,bthd->bshd", e / np.where(total == 0, 1.0, total), v, optimize=True)


def ragged_positions(rows: int, starts) -> jnp.ndarray:
    """Each batch row a chunk of `rows` consecutive positions from its own start."""
    return jax.device_put(np.stack([np.arange(rows) + s for s in starts]).astype(np.int32))


def pointer_operands(b, s, h, t, dtype, first: bool):
    """Scores scale * q . k_t = 8 t (first=False) or -8 t (first=True), exactly, and v_t encodes t
    (v[0] = t // 16, v[1] = t % 16: small integers, exact in bf16): softmax puts weight
    1 - O(e^-8) on the last visible key (or the first) and the output decodes to its index."""
    scale, t_idx = 0.125, np.arange(t)
    q = np.zeros((b, s, h, D_QK))
    q[..., :2] = (-8.0 if first else 8.0) / scale
    k = np.zeros((b, t, h, D_QK))
    k[..., 0] = (16 * (t_idx // 16))[None, :, None]  # q . k = 64 * t, every term exact
    k[..., 1] = (t_idx % 16)[None, :, None]
    v = np.zeros((b, t, h, D_V))
    v[..., 0] = (t_idx // 16)[None, :, None]
    v[..., 1] = (t_idx % 16)[None, :, None]
    return tuple(jax.device_put(x.astype(NUMPY_DTYPES[dtype])) for x in (q, k, v))


def pointer_expected(positions, kv_start, t, first: bool):
    """(B, S, 2): the decoded index of the key the output points at (-1 where no key is visible)."""
    pos = np.asarray(positions)
    want = np.full(pos.shape, kv_start) if first else np.minimum(pos, t - 1)
    return np.where(pos >= kv_start, want, -1)


def decode_pointer(out):
    o = np.asarray(out, np.float64)
    idx = np.rint(o[..., 0] * 16 + o[..., 1])
    return np.where(np.abs(o).sum(axis=-1) == 0, -1, idx)


# ---------------------------------------------------------------- the jnp twin (CPU)
@pytest.mark.parametrize("s,t,starts,kv_start,block,block_q", [
    (37, 192, (150, 0, 60), 0, 64, None),   # S ragged, 3 key blocks, rows at unequal positions
    (37, 192, (150, 0, 60), 0, 64, 16),     # the same in 3 query chunks (the last one padded)
    (64, 256, (192, 5, 100), 70, 64, 32),   # kv_start inside a block; 2 chunks skipping differently
    (50, 128, (30, 78), 0, 32, None),       # the chunk's last rows at T - 1
    (16, 320, (300, 2), 128, None, None),   # kv_start on a block boundary, default block (64)
    (20, 100, (90, 0), 0, None, 8),         # T not a multiple of the block: padded keys stay hidden
])
def test_twin_matches_float64(s, t, starts, kv_start, block, block_q):
    rng = seed(f"twin-{s}-{t}-{kv_start}")
    q, k, v = operands(rng, len(starts), s, 3, t, jnp.float32)
    pos = ragged_positions(s, starts)
    scale = D_QK ** -0.5
    got = twin(q, k, v, pos, scale=scale, kv_start=kv_start, block_kv=block, block_q=block_q)
    want = dense64(q, k, v, pos, scale, kv_start)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=2e-6)
    # the materialised jnp reference (the benchmark's XLA baseline) is the same function
    materialised = dense(q, k, v, pos, scale=scale, kv_start=kv_start)
    np.testing.assert_allclose(np.asarray(materialised), want, rtol=2e-6, atol=2e-6)


def test_twin_rows_that_see_nothing_are_zero():
    q, k, v = operands(seed("nothing"), 2, 8, 2, 128, jnp.float32)
    pos = ragged_positions(8, (10, 90))  # with kv_start 80 the first row's queries see no key
    got = np.asarray(twin(q, k, v, pos, scale=0.1, kv_start=80))
    assert np.all(got[0] == 0) and np.all(np.isfinite(got))
    np.testing.assert_allclose(got, dense64(q, k, v, pos, 0.1, 80), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("first,kv_start,block_q", [(False, 0, None), (True, 70, None), (False, 70, 10)])
def test_twin_points_at_the_mask_boundary(first, kv_start, block_q):
    pos = ragged_positions(24, (100, 3, 60))
    q, k, v = pointer_operands(3, 24, 2, 192, jnp.float32, first)
    got = twin(q, k, v, pos, scale=0.125, kv_start=kv_start, block_kv=64, block_q=block_q)
    want = pointer_expected(pos, kv_start, 192, first)[..., None]
    np.testing.assert_array_equal(decode_pointer(got), np.broadcast_to(want, got.shape[:-1]))


def _temp_bytes(fn, s, t, h=2):
    args = (jax.ShapeDtypeStruct((1, s, h, D_QK), jnp.bfloat16), jax.ShapeDtypeStruct((1, t, h, D_QK), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, t, h, D_V), jnp.bfloat16), jax.ShapeDtypeStruct((1, s), jnp.int32))
    return jax.jit(functools.partial(fn, scale=0.1)).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("block_q", [None, 512])
def test_twin_temporaries_do_not_grow_with_s_times_t(block_q):
    """S = T from 1024 to 4096 multiplies S x T by 16 and S by 4: the twin's temporaries (the
    float32 accumulator, one key block's scores, the output) grow at most about 4x, the
    materialised path's ~16x. (Default chunk: all rows at this size; 512: 2 and 8 chunks.)"""
    chunked = functools.partial(flash_attention_ref, block_q=block_q)
    small, large = _temp_bytes(chunked, 1024, 1024), _temp_bytes(chunked, 4096, 4096)
    assert large < 5 * small, (small, large)
    score_bytes = 4096 * 4096 * 2 * 4  # one float32 (S, H, T) score tensor at the large size
    assert large < score_bytes / 4, (large, score_bytes)
    d_small, d_large = _temp_bytes(attention_dense_ref, 1024, 1024), _temp_bytes(attention_dense_ref, 4096, 4096)
    assert d_large > 12 * d_small and d_large >= score_bytes, (d_small, d_large)  # the test can tell


def test_key_block_divides_t():
    assert [key_block(t) for t in (64, 192, 320, 4096, 100, 7)] == [64, 64, 64, 128, 64, 7]


def test_query_block_aims_at_2_24_scores_a_step():
    assert query_block(1, 32768, 128, 128) == 1024 and query_block(1, 32768, 16, 128) == 8192
    assert query_block(4, 100, 16, 64) == 100 and query_block(8, 4096, 128, 128) == 256


def test_bounds_classify_key_blocks():
    """kv_block_bounds against brute force: blocks in [a, b) wholly visible to every real row,
    blocks from c on (and before kv_start's block) invisible to all, the rest partly visible."""
    rng = seed("bounds")
    t, bq, bkv, rows = 512, 64, 128, 200
    pos = rng.integers(-3, t + 40, size=(3, 256)).astype(np.int32)
    pos[0, :rows] = np.arange(rows) + 250  # a contiguous chunk
    for kv_start in (0, 70, 128):
        bounds = np.asarray(jax.jit(kv_block_bounds, static_argnums=(1, 2, 3, 4, 5))(pos, rows, t, kv_start, bq, bkv))
        for b in range(3):
            for blk in range(256 // bq):
                p = pos[b, blk * bq:(blk + 1) * bq][: max(0, rows - blk * bq)]
                full_lo, full_hi, end = bounds[b, blk]
                for j in range(t // bkv):
                    key = np.arange(j * bkv, (j + 1) * bkv)
                    vis = (key[None, :] <= p[:, None]) & (key >= kv_start)
                    if full_lo <= j < full_hi:
                        assert vis.all(), (kv_start, b, blk, j)
                    if j >= end or j < kv_start // bkv:
                        assert not vis.any(), (kv_start, b, blk, j)


def test_flash_attention_auto_is_the_twin_off_hopper():
    q, k, v = operands(seed("auto"), 2, 40, 2, 128, jnp.bfloat16)
    pos = ragged_positions(40, (80, 0))
    got = jax.jit(functools.partial(flash_attention, scale=0.1, kv_start=3))(q, k, v, pos)
    want = flash_attention_ref(q, k, v, pos, scale=0.1, kv_start=3)
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 40, 2, D_V)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("change,match", [
    (dict(impl="cuda"), r"flash_attention: impl is 'cuda', expected one of auto, mosaic, jnp"),
    (dict(k=jnp.zeros((2, 128, 3, D_QK))), r"flash_attention: k \(2, 128, 3, 192\) and v .* do not match q"),
    (dict(positions=jnp.zeros((2, 5), jnp.int32)), r"flash_attention: positions must be integer \(B, S\)"),
    (dict(kv_start=-1), r"flash_attention: kv_start must be a static int >= 0"),
    (dict(scale=0.0), r"flash_attention: scale must be positive"),
])
def test_bad_arguments_name_the_problem(change, match):
    q, k, v = operands(seed("bad"), 2, 8, 2, 128, jnp.float32)
    args = dict(q=q, k=k, v=v, positions=ragged_positions(8, (0, 0)), scale=0.1) | change
    with pytest.raises(ValueError, match=match):
        flash_attention(**args)


def test_mosaic_refuses_what_it_cannot_run():
    q, k, v = operands(seed("refuse"), 1, 8, 1, 128, jnp.float32)
    with pytest.raises(ValueError, match=r"flash_attention_mgpu: unsupported: dtype float32"):
        flash_attention_mgpu(q, k, v, ragged_positions(8, (0,)), scale=0.1)
    q, k, v = operands(seed("refuse"), 1, 8, 1, 96, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"flash_attention_mgpu: unsupported: T=96 keys"):
        flash_attention_mgpu(q, k, v, ragged_positions(8, (0,)), scale=0.1)
    with pytest.raises(ValueError, match=r"needs .*at most 232448 bytes of SMEM"):
        FlashTiles(block_kv=128, max_concurrent_steps=3).check(D_QK, D_V, 2)


# ---------------------------------------------------------------- the Mosaic GPU kernel, interpreted (CPU)
def check_kernel(got, q, k, v, pos, scale, kv_start):
    """bf16 kernel output against float64 (bf16 rounding of P and of the output: a few 2^-9
    relative) and against the twin on the same bf16 inputs (same rounding points: <= 2 ulps)."""
    assert got.dtype == q.dtype and got.shape == (*q.shape[:3], v.shape[-1])
    got = np.asarray(got, np.float32)
    want = dense64(q, k, v, pos, scale, kv_start)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    assert np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2)) < 5e-3
    same_rounding = np.asarray(twin(q, k, v, pos, scale=scale, kv_start=kv_start), np.float32)
    np.testing.assert_allclose(got, same_rounding, rtol=0, atol=2 * BF16_ULP * max(1.0, np.abs(same_rounding).max()))


@pytest.mark.parametrize("s,t,starts,kv_start,tiles,heads", [
    # S ragged over 2 query tiles, kv_start mid-block; one head (each head is a CTA of its own, and the
    # interpreter's time grows faster than the CTA count): the next case reads 2 heads
    (200, 384, (150, 7), 70, None, 1),
    (128, 256, (0, 128), 0, FlashTiles(block_kv=64, max_concurrent_steps=3), 2),  # full causal + a cached row
])
def test_mosaic_interpret_matches_float64(s, t, starts, kv_start, tiles, heads):
    q, k, v = operands(seed(f"mosaic-{s}-{t}"), len(starts), s, heads, t, jnp.bfloat16)
    pos = ragged_positions(s, starts)
    got = mosaic(q, k, v, pos, scale=D_QK ** -0.5, kv_start=kv_start, tiles=tiles, interpret=True)
    check_kernel(got, q, k, v, pos, D_QK ** -0.5, kv_start)


@pytest.mark.parametrize("first,kv_start", [(False, 0), (True, 70)])
def test_mosaic_interpret_points_at_the_mask_boundary(first, kv_start):
    pos = ragged_positions(128, (120, 3))  # row 0 straddles the 128-key block boundary
    q, k, v = pointer_operands(2, 128, 1, 256, jnp.bfloat16, first)
    got = mosaic(q, k, v, pos, scale=0.125, kv_start=kv_start, interpret=True)
    want = pointer_expected(pos, kv_start, 256, first)[..., None]
    np.testing.assert_array_equal(decode_pointer(got), np.broadcast_to(want, got.shape[:-1]))


def test_mosaic_interpret_rows_that_see_nothing_are_zero():
    q, k, v = operands(seed("mosaic-nothing"), 1, 128, 1, 256, jnp.bfloat16)
    pos = ragged_positions(128, (150,))  # kv_start 200: the first 50 rows see nothing, the rest keys 200..
    out = mosaic(q, k, v, pos, scale=0.1, kv_start=200, interpret=True)
    got = np.asarray(out, np.float32)
    assert np.all(got[0, :50] == 0) and np.all(np.abs(got[0, 50:]).sum(axis=-1) > 0) and np.all(np.isfinite(got))
    check_kernel(out, q, k, v, pos, 0.1, 200)


@pytest.mark.parametrize("b,s,h,t,kv_start,tiles", [
    (1, 4096, 16, 4096, 0, None),                                      # V2-Lite prefill
    (2, 1000, 128, 2048, 1, None),                                     # V3 heads, ragged chunk, MTP kv_start
    (1, 256, 128, 320, 0, FlashTiles(block_kv=64, max_concurrent_steps=4)),
])
def test_mosaic_lowers_for_cuda(b, s, h, t, kv_start, tiles):
    """The whole Pallas -> Mosaic GPU lowering (layout inference, SMEM union, TMA and wgmma checks)."""
    f = functools.partial(flash_attention_mgpu, scale=0.1, kv_start=kv_start, tiles=tiles)
    args = (jax.ShapeDtypeStruct((b, s, h, D_QK), jnp.bfloat16), jax.ShapeDtypeStruct((b, t, h, D_QK), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, t, h, D_V), jnp.bfloat16), jax.ShapeDtypeStruct((b, s), jnp.int32))
    assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("check_vma", [True, False])
def test_mosaic_lowers_in_shard_map_for_cuda(check_vma):
    """Heads split over the mesh, as tensor parallelism splits them in the model."""
    mesh = jax.make_mesh((1,), ("mp",), devices=jax.devices()[:1])
    heads = P(None, None, "mp")
    specs = (heads, heads, heads, P())
    f = jax.shard_map(functools.partial(flash_attention_mgpu, scale=0.1, kv_start=3), mesh=mesh, in_specs=specs,
                      out_specs=heads, check_vma=check_vma)
    shapes = [((2, 200, 16, D_QK), jnp.bfloat16), ((2, 512, 16, D_QK), jnp.bfloat16),
              ((2, 512, 16, D_V), jnp.bfloat16), ((2, 200), jnp.int32)]
    args = [jax.ShapeDtypeStruct(sh, dt, sharding=NamedSharding(mesh, sp)) for (sh, dt), sp in zip(shapes, specs)]
    assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_auto_inside_shard_map_is_the_twin_off_hopper():
    mesh = jax.make_mesh((2,), ("mp",), devices=jax.devices()[:2])
    heads = P(None, None, "mp")
    q, k, v = operands(seed("auto-shard"), 2, 40, 4, 128, jnp.bfloat16)
    pos = ragged_positions(40, (80, 0))
    f = jax.shard_map(functools.partial(flash_attention, scale=0.1), mesh=mesh, in_specs=(heads, heads, heads, P()),
                      out_specs=heads)
    want = flash_attention_ref(q, k, v, pos, scale=0.1)
    placed = [jax.device_put(x, NamedSharding(mesh, sp)) for x, sp in zip((q, k, v, pos), (heads, heads, heads, P()))]
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(*placed), np.float32), np.asarray(want, np.float32))


# ---------------------------------------------------------------- compiled on an sm_90 GPU
@pytest.fixture
def highest():
    with jax.default_matmul_precision("highest"):
        yield


def _gpu_check(b, s, h, t, starts, kv_start, tiles=None, dense_heads=2):
    q, k, v = operands(seed(f"gpu-{s}-{h}-{t}"), b, s, h, t, jnp.bfloat16)
    pos = ragged_positions(s, starts)
    scale = D_QK ** -0.5
    got = flash_attention(q, k, v, pos, scale=scale, kv_start=kv_start, impl="mosaic", tiles=tiles)
    assert got.dtype == jnp.bfloat16 and got.shape == (b, s, h, D_V)
    got = np.asarray(got, np.float32)
    twin = np.asarray(flash_attention_ref(q, k, v, pos, scale=scale, kv_start=kv_start), np.float32)
    np.testing.assert_allclose(got, twin, rtol=0, atol=2 * BF16_ULP * max(1.0, np.abs(twin).max()))
    sub = (slice(None), slice(None), slice(0, dense_heads))  # float64 on a few heads (host time)
    want = dense64(q[sub], k[sub], v[sub], pos, scale, kv_start)
    np.testing.assert_allclose(got[sub], want, rtol=2e-2, atol=2e-2)
    assert np.sqrt(np.mean((got[sub] - want) ** 2) / np.mean(want ** 2)) < 5e-3


@pytest.mark.gpu
def test_gpu_v2_lite_heads_ragged(highest):
    _gpu_check(3, 640, 16, 2048, (1400, 0, 333), 0)


@pytest.mark.gpu
def test_gpu_v3_heads_ragged_kv_start(highest):
    _gpu_check(2, 300, 128, 1024, (700, 20), 65)


@pytest.mark.gpu
def test_gpu_block_kv_64(highest):
    _gpu_check(2, 512, 16, 704, (190, 0), 0, tiles=FlashTiles(block_kv=64, max_concurrent_steps=3))


@pytest.mark.gpu
def test_gpu_full_causal_prefill(highest):
    _gpu_check(1, 4096, 16, 4096, (0,), 0, dense_heads=1)


@pytest.mark.gpu
@pytest.mark.parametrize("first,kv_start", [(False, 0), (True, 70)])
def test_gpu_points_at_the_mask_boundary(first, kv_start):
    pos = ragged_positions(300, (120, 3, 900))
    q, k, v = pointer_operands(3, 300, 16, 1024, jnp.bfloat16, first)
    got = flash_attention(q, k, v, pos, scale=0.125, kv_start=kv_start, impl="mosaic")
    want = pointer_expected(pos, kv_start, 1024, first)[..., None]
    np.testing.assert_array_equal(decode_pointer(got), np.broadcast_to(want, got.shape[:-1]))


@pytest.mark.gpu
def test_gpu_auto_takes_the_kernel():
    q, k, v = operands(seed("gpu-auto"), 1, 256, 16, 256, jnp.bfloat16)
    pos = ragged_positions(256, (0,))
    auto = flash_attention(q, k, v, pos, scale=0.1)
    kernel = flash_attention(q, k, v, pos, scale=0.1, impl="mosaic")
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(kernel, np.float32))
