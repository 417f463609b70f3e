"""The wgmma grouped GEMM and its SwiGLU form (`pallas_kernels.grouped_mgpu`, Pallas Mosaic GPU) against float32
oracles.

On a CPU: the kernel runs in Mosaic GPU interpret mode (a simulation of the threads, TMA copies,
barriers and wgmma, at small shapes) against `grouped_gemm_ref` (XLA ragged_dot in float32), and
is lowered for CUDA, which runs Mosaic GPU's layout inference and checks on the real kernel.
With -m gpu: compiled at the V2-Lite prefill and a V3 expert shape, against rows recomputed in
float32 (HIGHEST) from their own expert's weights.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels.grouped import grouped_gemm, grouped_gemm_backend, grouped_gemm_swiglu
from pallas_kernels.grouped_mgpu import (MOSAIC_MIN_ROWS, SWIGLU_TILES, MosaicTiles, aligned_tile_schedule,
                                         grouped_gemm_mgpu, grouped_swiglu_mgpu)
from pallas_kernels.reference import grouped_gemm_ref, grouped_gemm_swiglu_ref

SMALL = MosaicTiles(block_m=64, block_n=128, block_k=64, max_concurrent_steps=2)
# the warp-specialised variants (a memory warpgroup, two compute warpgroups), small
WS_N = MosaicTiles(block_m=64, block_n=64, max_concurrent_steps=2, compute_wgs=2, wg_split="n")
WS_M = MosaicTiles(block_m=64, block_n=128, max_concurrent_steps=2, compute_wgs=2, wg_split="m", epi_n=64,
                   grid_tile_width=2)  # and the snake order over the tiles


def _inputs(sizes, n, k, extra_rows, layers=None, seed=0):
    """x (M, K), w (G, N, K) or (layers, G, N, K), bf16 normals drawn on the default device (a V3
    weight stack is billions of values), group_sizes and a row_scale in [0.1, 1)."""
    m = sum(sizes) + extra_rows
    shape = (len(sizes), n, k) if layers is None else (layers, len(sizes), n, k)
    x, w, row_scale = _draw(seed, m, k, shape)
    return x, w, jnp.array(sizes, jnp.int32), row_scale


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _draw(seed, m, k, w_shape):
    """_inputs' random arrays, drawn in one program: x, w, row_scale."""
    kx, kw, ks = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kx, (m, k), jnp.bfloat16), jax.random.normal(kw, w_shape, jnp.bfloat16),
            jax.random.uniform(ks, (m,), jnp.float32, 0.1, 1.0))


def _jit(fn, **static):
    """fn with the keyword arguments `static` fixed, compiled as one program (as the model calls
    it, and one compilation instead of one per operation)."""
    return jax.jit(functools.partial(fn, **static))


# the float32 oracle as one program per shape, shared by the cases with the same inputs
_ref = jax.jit(grouped_gemm_ref)


def _assert_close(got, want, tol):
    """Every element within tol x the RMS of `want` (float32 sums of bf16 products differ only in
    summation order; a wrong row, column or group is off by about the RMS itself)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.sqrt(np.mean(want ** 2)))


def _assert_bf16_close(got, want):
    """A bf16 result against float32 values: each element within 2^-7 of its own size (bf16 keeps 8 bits), plus
    1e-5 x the RMS for values near zero (their float32 summation order)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-5 * np.sqrt(np.mean(want ** 2)))

@pytest.mark.parametrize("sizes, extra_rows, tiles", [
    ([0, 70, 1, 185], 0, SMALL),  # an empty group, a one-row group, groups across block boundaries
    ([0, 70, 1, 185], 0, MosaicTiles()),  # the default 128 x 128 tiles
    ([5, 0, 120, 3], 131, SMALL),  # rows past the groups (M = 259: x padded to whole blocks)
])
def test_interpret_matches_ragged_dot(sizes, extra_rows, tiles):
    x, w, group_sizes, _ = _inputs(sizes, 256, 256, extra_rows)
    got = _jit(grouped_gemm_mgpu, tiles=tiles)(x, w, group_sizes)
    total = sum(sizes)
    _assert_close(got[:total], _ref(x, w, group_sizes)[:total], 1e-5)
    assert not np.any(np.asarray(got[total:])), "rows past the groups must be zero"


@pytest.mark.parametrize("tiles", [SMALL, WS_N, WS_M], ids=["one_wg", "ws_n", "ws_m_epi64"])
def test_interpret_layer_stack_row_scale_bf16_out(tiles):
    """A layer of a weight stack read in place, the routing weights on the accumulator, bf16 out,
    rows past the groups: with one warpgroup and warp-specialised."""
    x, w, group_sizes, row_scale = _inputs([0, 70, 1, 150], 256, 256, 27, layers=3, seed=1)
    got = _jit(grouped_gemm_mgpu, out_dtype=jnp.bfloat16, tiles=tiles)(x, w, group_sizes, layer=jnp.int32(2),
                                                                     row_scale=row_scale)
    assert got.dtype == jnp.bfloat16
    want = _ref(x, w[2], group_sizes, row_scale=row_scale)
    _assert_close(got[:221], want[:221], 2e-2)  # bf16 rounding of the result
    assert not np.any(np.asarray(got[221:], np.float32))


def _fp8(w, seed):
    """w as float8_e4m3fn codes (x40) with float32 128x128 block scales, (..., G, ceil(N/128), K/128)."""
    *lead, n, k = w.shape
    scale = jax.random.uniform(jax.random.key(seed), (*lead, -(-n // 128), k // 128), jnp.float32, 0.001, 0.05)
    return (w.astype(jnp.float32) * 40).astype(jnp.float8_e4m3fn), scale


def test_interpret_fp8_weights():
    """fp8 weights dequantised in the kernel (bf16 semantics) from a layer stack, row_scale, rows
    past the groups; the oracle dequantises first (grouped_gemm_ref)."""
    x, w, group_sizes, row_scale = _inputs([0, 70, 1, 150], 256, 256, 29, layers=2, seed=4)
    w8, scale = _fp8(w, 5)
    got = _jit(grouped_gemm_mgpu, tiles=SMALL)(x, w8, group_sizes, scale, layer=jnp.int32(1), row_scale=row_scale)
    want = _ref(x, w8[1], group_sizes, scale[1], row_scale=row_scale)
    _assert_close(got[:221], want[:221], 1e-5)
    assert not np.any(np.asarray(got[221:]))


def test_grouped_gemm_backend_mosaic_runs_the_mgpu_kernel():
    x, w, group_sizes, row_scale = _inputs([0, 70, 1, 185], 128, 128, 0, seed=2)
    got = _jit(grouped_gemm, backend="mosaic", mosaic_tiles=SMALL)(x, w, group_sizes, row_scale=row_scale)
    _assert_close(got, _ref(x, w, group_sizes, row_scale=row_scale), 1e-5)


SMALL_SWIGLU = MosaicTiles(block_m=64, block_n=64, max_concurrent_steps=2)


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_interpret_swiglu_matches_its_twin(out_dtype):
    """silu(x W1^T) * (x W3^T) of each row's group from a layer of a stack read in place, with an empty group, a
    one-row group, groups across block boundaries and rows past the groups (zero), against float32 ragged_dot."""
    x, w1, group_sizes, _ = _inputs([0, 70, 1, 185], 128, 256, 13, layers=2, seed=12)
    w3 = _inputs([0, 70, 1, 185], 128, 256, 13, layers=2, seed=13)[1]
    got = _jit(grouped_swiglu_mgpu, out_dtype=out_dtype, tiles=SMALL_SWIGLU)(x, w1, w3, group_sizes,
                                                                            layer=jnp.int32(1))
    assert got.dtype == out_dtype and got.shape == (269, 128)
    want = grouped_gemm_swiglu_ref(x, w1[1], w3[1], group_sizes, out_dtype=jnp.float32)
    if out_dtype == jnp.float32:
        _assert_close(got[:256], want[:256], 1e-5)
    else:
        _assert_bf16_close(got[:256], want[:256])
    assert not np.any(np.asarray(got[256:], np.float32)), "rows past the groups must be zero"


def test_grouped_gemm_swiglu_backend_mosaic_runs_the_mgpu_kernel():
    x, w1, group_sizes, _ = _inputs([0, 70, 1, 185], 128, 128, 0, seed=14)
    w3 = _inputs([0, 70, 1, 185], 128, 128, 0, seed=15)[1]
    assert grouped_gemm_backend(x, w1, swiglu=True) == "triton"  # off a GPU
    got = _jit(grouped_gemm_swiglu, backend="mosaic", mosaic_tiles=SMALL_SWIGLU)(x, w1, w3, group_sizes)
    assert got.dtype == jnp.bfloat16
    _assert_bf16_close(got, grouped_gemm_swiglu_ref(x, w1, w3, group_sizes, out_dtype=jnp.float32))


def test_swiglu_backend_choice_and_errors():
    x = jnp.zeros((MOSAIC_MIN_ROWS + 1, 256), jnp.bfloat16)
    w = jnp.zeros((4, 128, 256), jnp.bfloat16)
    sizes = jnp.ones(4, jnp.int32)
    w8, scale = w.astype(jnp.float8_e4m3fn), jnp.ones((4, 1, 2))
    with pytest.raises(ValueError, match="grouped_gemm_swiglu: backend='mosaic' does not support this call: the "
                                         "SwiGLU kernel takes bf16 weights"):
        grouped_gemm_swiglu(x, w8, w8, sizes, scale, scale, backend="mosaic")
    with pytest.raises(ValueError, match="does not support this call: shared experts in the launch"):
        grouped_gemm_swiglu(x, w, w, jnp.ones(5, jnp.int32), shared_w1=w[0], shared_w3=w[0], backend="mosaic")
    with pytest.raises(ValueError, match=r"grouped_swiglu_mgpu: w1 and w3 must have one shape and dtype"):
        grouped_swiglu_mgpu(x, w, w[:, :64], sizes)
    with pytest.raises(ValueError, match="one warpgroup"):
        grouped_swiglu_mgpu(x, w, w, sizes, tiles=MosaicTiles(compute_wgs=2, block_n=64))
    with pytest.raises(ValueError, match="grouped_swiglu_mgpu: tiles .* shared memory"):
        grouped_swiglu_mgpu(x, w, w, sizes, tiles=MosaicTiles(block_n=128, max_concurrent_steps=6))
    assert SWIGLU_TILES.smem_bytes(jnp.bfloat16, weights=2) <= 227 * 1024

def _lower_for_cuda(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


LOWERED = [MosaicTiles(), MosaicTiles(epi_n=64, max_concurrent_steps=5),
           MosaicTiles(compute_wgs=2, block_n=64), MosaicTiles(compute_wgs=2, block_n=128, epi_n=64, max_concurrent_steps=3),
           MosaicTiles(compute_wgs=2, wg_split="m", epi_n=64, max_concurrent_steps=3)]


@pytest.mark.parametrize("tiles", LOWERED, ids=str)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_cuda(out_dtype, tiles):
    """Mosaic GPU's lowering (layout inference, TMA and wgmma checks) at V2-Lite's w2 shape, with
    a layer stack, row_scale and M neither a multiple of 128 nor of 8 (x padded)."""
    x = jax.ShapeDtypeStruct((24_576 + 8, 1408), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, 64, 2048, 1408), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
    row_scale = jax.ShapeDtypeStruct((24_576 + 8,), jnp.float32)
    for rows in (24_576 + 8, 24_576 + 5):
        args = (x.update(shape=(rows, 1408)), w, sizes, row_scale.update(shape=(rows,)))
        text = _lower_for_cuda(lambda x, w, s, r: grouped_gemm_mgpu(x, w, s, layer=1, row_scale=r, out_dtype=out_dtype,
                                                                    tiles=tiles, interpret=False), *args)
        assert "mosaic_gpu" in text


def test_fp8_lowers_for_cuda_at_v3_stack_shape():
    """fp8 weights at V3's expert stack shape (2 layers x 256 x 2048 x 7168 bytes: over 2^32)."""
    args = (jax.ShapeDtypeStruct((4096, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((2, 256, 2048, 7168), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((2, 256, 16, 56), jnp.float32), jax.ShapeDtypeStruct((256,), jnp.int32),
            jax.ShapeDtypeStruct((4096,), jnp.float32))
    text = _lower_for_cuda(lambda x, w, sc, s, r: grouped_gemm_mgpu(x, w, s, sc, layer=1, row_scale=r, interpret=False),
                           *args)
    assert "mosaic_gpu" in text


def test_lowers_for_cuda_inside_shard_map():
    """The model calls the grouped GEMM inside shard_map over the expert axis."""
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    fn = jax.shard_map(lambda x, w, s: grouped_gemm_mgpu(x, w, s, interpret=False), mesh=mesh,
                       in_specs=(P(), P("model"), P("model")), out_specs=P())
    text = _lower_for_cuda(fn, jax.ShapeDtypeStruct((4096, 2048), jnp.bfloat16),
                           jax.ShapeDtypeStruct((8, 512, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((8,), jnp.int32))
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("tiles", [SWIGLU_TILES, MosaicTiles(block_n=64, epi_n=64, max_concurrent_steps=5),
                                   MosaicTiles(block_m=64, block_n=128)], ids=str)
def test_swiglu_lowers_for_cuda(tiles):
    """The SwiGLU kernel through Mosaic GPU's lowering at V2-Lite's w1 / w3 shape, a layer stack, M neither a multiple
    of 128 nor of 8 (x padded), and inside shard_map over the experts."""
    x = jax.ShapeDtypeStruct((24_576 + 5, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, 64, 1408, 2048), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((64,), jnp.int32)
    text = _lower_for_cuda(lambda x, a, b, s: grouped_swiglu_mgpu(x, a, b, s, layer=1, tiles=tiles, interpret=False),
                           x, w, w, sizes)
    assert "mosaic_gpu" in text
    mesh = Mesh(np.array(jax.devices()[:1]), ("model",))
    fn = jax.shard_map(lambda x, a, b, s: grouped_swiglu_mgpu(x, a, b, s, tiles=tiles, interpret=False), mesh=mesh,
                       in_specs=(P(), P("model"), P("model"), P("model")), out_specs=P())
    w = jax.ShapeDtypeStruct((8, 512, 2048), jnp.bfloat16)
    assert "mosaic_gpu" in _lower_for_cuda(fn, x.update(shape=(4096, 2048)), w, w, sizes.update(shape=(8,)))

def test_aligned_tile_schedule_covers_each_row_once():
    rng = np.random.default_rng(3)
    for sizes, m, bm in [([0, 70, 1, 185], 256, 64), ([5, 0, 120, 3, 131], 259, 64), ([300], 300, 128),
                         (list(rng.multinomial(1000, np.ones(16) / 16)), 1000, 128)]:
        schedule, max_tiles = _jit(aligned_tile_schedule, m=m, block_m=bm)(jnp.array(sizes, jnp.int32))
        group, block, lo, hi, exists, _ = np.asarray(schedule)
        owner = np.full(m, -1)
        for t in np.flatnonzero(exists):
            assert block[t] * bm <= lo[t] < hi[t] <= (block[t] + 1) * bm
            assert np.all(owner[lo[t]:hi[t]] == -1), "a row stored twice"
            owner[lo[t]:hi[t]] = group[t]
        np.testing.assert_array_equal(owner, np.repeat(np.arange(len(sizes)), sizes))
        assert exists.sum() <= max_tiles


def test_backend_choice_and_errors():
    x = jnp.zeros((MOSAIC_MIN_ROWS + 1, 256), jnp.bfloat16)
    w = jnp.zeros((4, 256, 256), jnp.bfloat16)
    assert grouped_gemm_backend(x, w) == "triton"  # off a GPU the Triton path (interpret) as before
    assert grouped_gemm_backend(x, w, backend="mosaic") == "mosaic"
    with pytest.raises(ValueError, match="backend is 'cuda'"):
        grouped_gemm_backend(x, w, backend="cuda")
    with pytest.raises(ValueError, match="does not support this call: weights float8_e4m3fn without scales"):
        grouped_gemm_backend(x, w.astype(jnp.float8_e4m3fn), backend="mosaic")
    with pytest.raises(ValueError, match="fp8 weights need compute_wgs=1"):
        grouped_gemm_backend(x, w.astype(jnp.float8_e4m3fn), jnp.ones((4, 2, 2)), backend="mosaic",
                             mosaic_tiles=MosaicTiles(compute_wgs=2, block_n=64))
    with pytest.raises(ValueError, match=r"w_scale has shape \(4, 2, 3\)"):
        grouped_gemm_mgpu(x, w.astype(jnp.float8_e4m3fn), jnp.ones(4, jnp.int32), jnp.ones((4, 2, 3)))
    with pytest.raises(ValueError, match="must be multiples of 64"):
        grouped_gemm_mgpu(x, w, jnp.ones(4, jnp.int32), tiles=MosaicTiles(block_m=32))
    with pytest.raises(ValueError, match="shared memory"):
        grouped_gemm_mgpu(x, w, jnp.ones(4, jnp.int32), tiles=MosaicTiles(max_concurrent_steps=8))
    with pytest.raises(ValueError, match="compute_wgs 1 or 2"):
        grouped_gemm_mgpu(x, w, jnp.ones(4, jnp.int32), tiles=MosaicTiles(compute_wgs=3))
    with pytest.raises(ValueError, match="not a multiple of the tile's 256 columns"):
        grouped_gemm_mgpu(x, w[:, :192], jnp.ones(4, jnp.int32), tiles=MosaicTiles(compute_wgs=2, block_n=128))
    with pytest.raises(ValueError, match="a stack"):
        grouped_gemm_mgpu(x, w, jnp.ones(4, jnp.int32), layer=0)
    assert MosaicTiles.parse("block_m=64,max_concurrent_steps=3") == MosaicTiles(block_m=64, max_concurrent_steps=3)
    assert MosaicTiles.parse("compute_wgs=2,wg_split=m") == MosaicTiles(compute_wgs=2, wg_split="m")
    with pytest.raises(ValueError, match="bad item 'block_q=3'"):
        MosaicTiles.parse("block_q=3")


# ---- compiled (pytest -m gpu) ----

def _routed_sizes(rows, experts, seed):
    """Uneven expert loads, as a router gives: a multinomial over skewed expert probabilities."""
    rng = np.random.default_rng(seed)
    p = rng.gamma(1.0, size=experts)
    return [int(s) for s in rng.multinomial(rows, p / p.sum())]


def _check_rows(got, x, w, sizes, row_scale=None, w_scale=None, samples=128, seed=0):
    """Sampled rows (the first and last of 64 random non-empty groups, plus random ones) against
    x[r] @ w[g(r)]^T in float32 HIGHEST (w[g] dequantised to bf16 first with an fp8 w), 32 rows at
    a time; rows past the groups zero."""
    rng = np.random.default_rng(seed)
    total = sum(sizes)
    ends = np.cumsum(sizes)
    starts = ends - np.asarray(sizes)
    nonempty = np.flatnonzero(np.asarray(sizes) > 0)
    picked = rng.choice(nonempty, min(64, nonempty.size), replace=False)
    rows = np.unique(np.concatenate([starts[picked], ends[picked] - 1, rng.integers(0, total, samples)]))
    groups = np.searchsorted(ends, rows, side="right")
    want = []
    for i in range(0, rows.size, 32):
        r, g = rows[i:i + 32], groups[i:i + 32]
        wg = w[g].astype(jnp.float32)
        if w_scale is not None:
            full = jnp.repeat(jnp.repeat(w_scale[g], 128, 1), 128, 2)[:, :wg.shape[1], :wg.shape[2]]
            wg = (wg * full).astype(jnp.bfloat16).astype(jnp.float32)
        want.append(np.asarray(jnp.einsum("rk,rnk->rn", x[r].astype(jnp.float32), wg,
                                          precision=jax.lax.Precision.HIGHEST)))
    want = np.concatenate(want)
    if row_scale is not None:
        want = want * np.asarray(row_scale)[rows][:, None]
    _assert_close(np.asarray(got, np.float32)[rows], want, 1e-4)
    assert not np.any(np.asarray(got[total:], np.float32)), "rows past the groups must be zero"


@pytest.mark.gpu
@pytest.mark.parametrize("n, k", [(1408, 2048), (2048, 1408)])
def test_v2_lite_prefill_on_gpu(n, k):
    """V2-Lite prefill 8 x 512 tokens, top-6 of 64 experts: 24,576 rows; w1/w3 and w2 shapes,
    the default tiles and a warp-specialised 128 x (2 x 64) block."""
    sizes = _routed_sizes(24_576, 64, seed=n)
    x, w, group_sizes, _ = _inputs(sizes, n, k, 0, seed=k)
    assert grouped_gemm_backend(x, w) == "mosaic"  # the automatic choice at prefill on an H100/H200
    _check_rows(grouped_gemm(x, w, group_sizes), x, w, sizes)
    ws = MosaicTiles(compute_wgs=2, block_n=64)
    _check_rows(grouped_gemm(x, w, group_sizes, backend="mosaic", mosaic_tiles=ws), x, w, sizes)


@pytest.mark.gpu
def test_v2_lite_prefill_swiglu_on_gpu():
    """V2-Lite prefill 8 x 512 tokens through the SwiGLU kernel (what "auto" picks there with bf16 weights), its
    w1 / w3 shape from a layer of a stack: sampled rows against silu(a1) * a3 from float32 (HIGHEST) products of
    their own expert's weights."""
    sizes = _routed_sizes(24_576, 64, seed=21)
    x, w1, group_sizes, _ = _inputs(sizes, 1408, 2048, 0, layers=2, seed=22)
    w3 = _inputs(sizes, 1408, 2048, 0, layers=2, seed=23)[1]
    assert grouped_gemm_backend(x, w1, swiglu=True) == "mosaic"
    got = grouped_gemm_swiglu(x, w1, w3, group_sizes, layer=jnp.int32(1))
    rng = np.random.default_rng(24)
    rows = np.unique(np.concatenate([np.cumsum(sizes)[:-1], rng.integers(0, 24_576, 192)]))
    groups = np.searchsorted(np.cumsum(sizes), rows, side="right")
    product = functools.partial(jnp.einsum, "rk,rnk->rn", precision=jax.lax.Precision.HIGHEST)
    want = []
    for i in range(0, rows.size, 32):
        r, g = rows[i:i + 32], groups[i:i + 32]
        xr = x[r].astype(jnp.float32)
        a1, a3 = product(xr, w1[1, g].astype(jnp.float32)), product(xr, w3[1, g].astype(jnp.float32))
        want.append(np.asarray(jax.nn.silu(a1) * a3))
    _assert_bf16_close(np.asarray(got, np.float32)[rows], np.concatenate(want))

@pytest.mark.gpu_slow  # V3's whole expert stacks (up to 15 GB)
def test_v3_expert_shape_on_gpu():
    """V3's w1 shape (256 experts of (2048, 7168), here bf16) at 4,096 routed rows, with rows past
    the groups, a layer of a 2-layer stack read in place (a 15 GB stack: 64-bit addressing), row_scale."""
    sizes = _routed_sizes(4096 - 40, 256, seed=7)
    x, w, group_sizes, row_scale = _inputs(sizes, 2048, 7168, 40, layers=2, seed=8)
    got = grouped_gemm(x, w, group_sizes, layer=jnp.int32(1), row_scale=row_scale)
    _check_rows(got, x, w[1], sizes, row_scale)


@pytest.mark.gpu_slow  # V3's whole expert stacks (up to 15 GB)
def test_v3_fp8_expert_shape_on_gpu():
    """V3's w2 shape (256 experts of (7168, 2048)) with fp8 weights at 4,096 rows on the Mosaic
    kernel (backend="mosaic": "auto" keeps fp8 on Triton for now), against dequantised rows."""
    sizes = _routed_sizes(4096, 256, seed=9)
    x, w, group_sizes, row_scale = _inputs(sizes, 7168, 2048, 0, seed=10)
    w8, scale = _fp8(w, 11)
    del w
    got = grouped_gemm(x, w8, group_sizes, scale, row_scale=row_scale, backend="mosaic")
    _check_rows(got, x, w8, sizes, row_scale, w_scale=scale)


@pytest.mark.gpu
@pytest.mark.parametrize("rows, tiles", [(1000, SMALL), (1003, SMALL), (40, SMALL), (1000, WS_N), (1003, WS_M)],
                         ids=["1000-one_wg", "1003-one_wg", "40-one_wg", "1000-ws_n", "1003-ws_m_epi64"])
def test_ragged_rows_on_gpu(rows, tiles):
    """M not a multiple of 128 (TMA's zero fill past x), nor of 8 or under one block (x padded);
    bf16 out, small tiles, one warpgroup and warp-specialised."""
    sizes = _routed_sizes(rows - 9, 16, seed=rows)
    x, w, group_sizes, _ = _inputs(sizes, 256, 512, 9, seed=rows)
    got = grouped_gemm(x, w, group_sizes, out_dtype=jnp.bfloat16, backend="mosaic", mosaic_tiles=tiles)
    total = sum(sizes)
    _assert_close(got[:total], grouped_gemm_ref(x, w, group_sizes)[:total], 2e-2)
    assert not np.any(np.asarray(got[total:], np.float32))
