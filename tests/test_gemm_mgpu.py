"""The Mosaic GPU fp8 GEMM (pallas_kernels/gemm_mgpu.py) and fp8_gemm's choice of kernel, on a CPU.

Mosaic GPU's interpret mode simulates the kernel's warpgroups, TMA copies, barriers and wgmma on
the CPU, so the kernel's results are checked here at small shapes against the jnp twin
(`fp8_gemm_ref`) and float64 numpy. What the interpreter cannot say (that the kernel compiles for
sm_90, fits its SMEM, and is fast) is covered by lowering it for CUDA without a GPU (which runs
the whole Pallas -> Mosaic GPU lowering, SMEM budget included) and by the GPU tests at the end of
this file (`pytest -m gpu tests/test_gemm_mgpu.py`).
"""
from __future__ import annotations

import functools
import zlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from script_modules import load_script
from kernel_checks import BF16_ROUNDING, FP8, activations, fp8_weight, gemm_tolerance, kernel_twins, numpy_gemm, rel_l2
from pallas_kernels import act_quant, fp8_gemm
from pallas_kernels import gemm as GM
from pallas_kernels.gemm_mgpu import MosaicGemmConfig, default_mosaic_config, fp8_gemm_mosaic_2d
from pallas_kernels.reference import fp8_gemm_ref

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Compiled on sm_90, the Mosaic kernel's fp8 wgmma adds its products with about 14 mantissa bits
# (DeepSeek-V3 report, section 3.3.2) before each 128-K block's sum is scaled into float32. Each
# block sum thus errs by a few 2^-14 (6.1e-5) relative, independently across blocks, so the
# relative L2 over the whole product stays of that order whatever K: measured 1.27e-4 (~2 x 2^-14)
# at K = 2048 and K = 7168. 8 x 2^-14 (4.9e-4) bounds it; a tiling that drops or repeats one of
# the K/128 blocks, or writes one output tile wrong, errs by over 1e-2.
WGMMA_FP8_REL_L2 = 8 * 2.0**-14


def operands(rng, lead, n, k, scale_fmt=None):
    """(a, a_s, b, b_s) as the model makes them; ue8m0: power-of-two scales on both sides. Off a
    GPU, act_quant computes its jnp twin (the same bits, tests/test_kernels.py), not the interpreted
    kernel: the GEMM is the subject here."""
    x = activations(rng, (*lead, k), special_blocks=False)
    with kernel_twins("quantize"):
        a, a_s = jax.jit(functools.partial(act_quant, scale_fmt=scale_fmt))(x)
    b, b_s = fp8_weight(rng, n, k)
    if scale_fmt == "ue8m0":
        b_s = jnp.exp2(jnp.round(jnp.log2(b_s)))
    return a, a_s, b, b_s


class Product(NamedTuple):
    """A product's operands and its two oracles: the jnp twin (the same float32 math: only the
    order of additions differs) and float64 numpy."""
    a: jax.Array
    a_s: jax.Array
    b: jax.Array
    b_s: jax.Array
    twin: np.ndarray
    exact: np.ndarray

    @property
    def operands(self):
        return self.a, self.a_s, self.b, self.b_s


def product(m, n, k, scale_fmt=None, lead=None) -> Product:
    """Seeded operands of an (m, k) x (n, k)^T product (or (*lead, k) rows) and its oracles."""
    rng = np.random.default_rng(zlib.crc32(f"{lead or m},{n},{k},{scale_fmt}".encode()))
    a, a_s, b, b_s = operands(rng, lead or (m,), n, k, scale_fmt)
    twin = jax.jit(fp8_gemm_ref, static_argnames="out_dtype")(a, a_s, b, b_s, out_dtype=jnp.float32)
    return Product(a, a_s, b, b_s, np.asarray(twin, np.float64), numpy_gemm(a, a_s, b, b_s))


@pytest.fixture(scope="module")
def products():
    """product(...), computed once per shape in this module (cases sharing a shape share its
    operands and oracles)."""
    return functools.cache(product)


def check(c, p: Product, out_dtype):
    """c (interpret mode) against both oracles, within kernel_checks.gemm_tolerance (measured ~5e-8
    in float32)."""
    assert c.shape == (*p.a.shape[:-1], p.b.shape[0]) and c.dtype == jnp.dtype(out_dtype)
    assert rel_l2(c, p.twin) < gemm_tolerance(out_dtype, interpret=True)
    assert rel_l2(c, p.exact) < gemm_tolerance(out_dtype, interpret=True)


# One compiled program per kernel, shape and out_dtype: cases with the same ones reuse it.
_mosaic_jit = jax.jit(functools.partial(fp8_gemm, impl="mosaic"), static_argnames=("out_dtype", "mosaic_config"))


# ---------------------------------------------------------------- interpret mode (CPU)
@pytest.mark.parametrize("m, scale_fmt", [(1, None), (100, None), (256, None), (256, "ue8m0")])
def test_mosaic_interpret_matches_twin(products, m, scale_fmt):
    """M = 1 and 100 (shorter than a CTA tile: padded), 256 (two row tiles); two column tiles, two
    K-blocks. ue8m0 (power-of-two scales on both sides) at one M: the kernel has no scale-format
    branch, so the program compiled for None at that M runs again, only on other scale values."""
    p = products(m, 256, 256, scale_fmt)
    for out_dtype in (jnp.float32, jnp.bfloat16):
        check(_mosaic_jit(*p.operands, out_dtype=out_dtype), p, out_dtype)


def test_mosaic_interpret_leading_dims_under_jit(products):
    p = products(None, 256, 256, lead=(2, 3))
    f = jax.jit(functools.partial(fp8_gemm, out_dtype=jnp.float32, impl="mosaic"))
    check(f(*p.operands), p, jnp.float32)


@pytest.mark.parametrize("config, k", [
    (MosaicGemmConfig(tile_m=128, tile_n=64, wg_dim="n"), 256),          # 128x128 CTA, split along N
    (MosaicGemmConfig(tile_n=64, wg_dim="n", max_ctas=2), 256),           # 64x128 CTA, 2 CTAs loop over 8 tiles
    (MosaicGemmConfig(num_compute_wgs=3, max_concurrent_steps=2), 384),    # 192-row CTA: ragged last tile;
                                                                          # 3 K-blocks wrap the ring of 2
    (MosaicGemmConfig(num_compute_wgs=1, tile_n=32, epi_tile_m=32, epi_tile_n=16, max_ctas=3,
                      grid_minor="m", grid_tile_width=1), 256),            # 4 output pieces, 2 slots
    (MosaicGemmConfig(cluster="n", max_ctas=2), 256),                     # CTA pairs share A (multicast)
    (MosaicGemmConfig(cluster="m", max_ctas=4), 256),                     # pairs share B; 2nd tile partly past M
])
def test_mosaic_interpret_configs(products, config, k):
    """Every kind of tiling, on a product of several tiles per CTA (M = 200 ragged, two column
    blocks of b_s, 2 K-blocks: more than one, fewer than the ring's 4 slots; 3 for a ring of 2)."""
    p = products(200, 256, k)
    c = fp8_gemm(*p.operands, out_dtype=jnp.float32, impl="mosaic", mosaic_config=config)
    check(c, p, jnp.float32)


@pytest.mark.parametrize("config", [
    MosaicGemmConfig(max_ctas=3),                                        # 3, 3 and 2 tiles per CTA
    MosaicGemmConfig(max_ctas=4, max_concurrent_steps=2),                # 2 tiles per CTA
    MosaicGemmConfig(max_ctas=8, max_concurrent_steps=2),                # one tile per CTA: not chained
    MosaicGemmConfig(max_ctas=2, cluster="n"),
    MosaicGemmConfig(max_ctas=3, chain=False),
])
def test_mosaic_interpret_chained_tiles(products, config):
    """K/128 = 4 steps, a multiple of the ring depth: one pipeline runs on across a CTA's tiles."""
    p = products(200, 512, 512)
    c = fp8_gemm(*p.operands, out_dtype=jnp.bfloat16, impl="mosaic", mosaic_config=config)
    check(c, p, jnp.bfloat16)


# ---------------------------------------------------------------- which kernel runs
def test_choose_path():
    ch = GM.choose_path
    assert ch(GM.MOSAIC_MIN_M, 18432, 7168, "auto", sm90=True) == "mosaic"
    assert ch(GM.MOSAIC_MIN_M - 1, 18432, 7168, "auto", sm90=True) == "triton"
    assert ch(4096, 2112, 7168, "auto", sm90=True) == "triton"  # N not a multiple of 128
    assert ch(4096, 18432, 7168, "auto", sm90=False) == "triton"
    assert ch(4096, 18432, 7168, "triton", sm90=True) == "triton"
    assert ch(1, 256, 128, "mosaic", sm90=False) == "mosaic"
    assert GM.fp8_gemm_path(4096, 18432, 7168) == "triton"  # a CPU: no sm_90


def _raises(fn, *args, match, **kw):
    with pytest.raises(ValueError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)


def test_errors(rng):
    a, a_s, b, b_s = operands(rng, (4,), 200, 256)
    _raises(fp8_gemm, a, a_s, b, b_s, impl="mosaic",
            match=r"fp8_gemm: impl='mosaic' cannot .* N=200 is not a multiple of 128")
    _raises(fp8_gemm, a, a_s, b, b_s, impl="cutlass", match=r"fp8_gemm: impl is 'cutlass', expected one of")
    a, a_s, b, b_s = operands(rng, (4,), 128, 256)
    _raises(fp8_gemm, a, a_s, b, b_s, impl="mosaic", mosaic_config=MosaicGemmConfig(tile_n=96),
            match=r"fp8_gemm_mosaic: .* needs tile_n a multiple of 16 dividing 128")
    _raises(fp8_gemm, a, a_s, b, b_s, impl="mosaic", mosaic_config=MosaicGemmConfig(wg_dim="n"),
            match=r"fp8_gemm_mosaic: N=128 is not a multiple of the 256 columns of a CTA tile ")


# ---------------------------------------------------------------- lowering for CUDA (no GPU needed)
def _lower_cuda(f, *shapes, shardings=None):
    shardings = shardings or [None] * len(shapes)
    args = [jax.ShapeDtypeStruct(s, d, sharding=sh) for (s, d), sh in zip(shapes, shardings)]
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _v3_shapes(m, n, k):
    return ((m, k), FP8), ((m, k // 128), jnp.float32), ((n, k), FP8), ((n // 128, k // 128), jnp.float32)


@pytest.mark.parametrize("m,n,k", [(4096, 18432, 7168), (4096, 7168, 18432), (333, 24576, 1536)])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_mosaic_lowers_for_cuda(m, n, k, out_dtype):
    """The whole Pallas -> Mosaic GPU lowering at DeepSeek-V3's shapes, SMEM budget included."""
    f = functools.partial(fp8_gemm_mosaic_2d, out_dtype=out_dtype, config=default_mosaic_config(m, n, k))
    assert "mosaic_gpu" in _lower_cuda(f, *_v3_shapes(m, n, k))


def test_bench_sweep_configs_lower_for_cuda():
    """Every Mosaic tiling scripts/bench_kernels.py --mosaic-sweep times lowers (fits its SMEM)."""
    bench = load_script("bench_kernels")
    for cfg in bench.mosaic_candidates():
        f = functools.partial(fp8_gemm_mosaic_2d, out_dtype=jnp.bfloat16, config=cfg)
        assert "mosaic_gpu" in _lower_cuda(f, *_v3_shapes(4096, 18432, 7168)), cfg


@pytest.mark.parametrize("check_vma", [True, False])
def test_mosaic_lowers_in_shard_map_for_cuda(check_vma):
    """Column-parallel use, as in the model: B's rows split over the mesh. (fp8_gemm would take
    the jnp twin in CPU interpret mode here, so the test calls its compiled Mosaic branch.)"""
    mesh = jax.make_mesh((1,), ("mp",), devices=jax.devices()[:1])
    local = functools.partial(GM._mosaic_2d, out_dtype=jnp.bfloat16, config=None, interpret=False)
    specs = (P(), P(), P("mp"), P("mp"))
    f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(None, "mp"), check_vma=check_vma)
    shardings = [NamedSharding(mesh, s) for s in specs]
    assert "mosaic_gpu" in _lower_cuda(f, *_v3_shapes(256, 1024, 512), shardings=shardings)


# ---------------------------------------------------------------- compiled on an sm_90 GPU
def _gpu_oracle(a, a_s, b, b_s):
    """float32 on the GPU at HIGHEST precision: the jnp twin where its (K/128, M, N) partial
    products fit in 1 GiB, else the same sum as one product of the dequantised operands."""
    m, k = a.shape
    n = b.shape[0]
    with jax.default_matmul_precision("highest"):
        if m * n * (k // 128) * 4 <= 2**30:
            return fp8_gemm_ref(a, a_s, b, b_s, out_dtype=jnp.float32)
        ad = (a.astype(jnp.float32).reshape(m, k // 128, 128) * a_s[..., None]).reshape(m, k)
        sb = jnp.repeat(b_s, 128, axis=0)[:n]
        bd = (b.astype(jnp.float32).reshape(n, k // 128, 128) * sb[..., None]).reshape(n, k)
        return ad @ bd.T


def _v3_operands(m, n, k, scale_fmt):
    key = jax.random.PRNGKey(m + n + k)
    x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
    a, a_s = act_quant(x, scale_fmt=scale_fmt)
    b = (jax.random.normal(jax.random.fold_in(key, 1), (n, k)) * 64).astype(FP8)
    e = jax.random.uniform(jax.random.fold_in(key, 2), (n // 128, k // 128), minval=-12, maxval=-4)
    b_s = jnp.exp2(jnp.round(e) if scale_fmt == "ue8m0" else e)
    return a, a_s, b, b_s


@pytest.mark.gpu
def test_gpu_is_sm90():
    assert GM.hopper(), f"expected an sm_90 GPU, got {jax.devices()[0]}"
    assert GM.fp8_gemm_path(4096, 18432, 7168) == "mosaic" and GM.fp8_gemm_path(64, 18432, 7168) == "triton"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,scale_fmt,out_dtypes", [
    (4096, 18432, 7168, None, ("bfloat16", "float32")),
    (4096, 7168, 18432, "ue8m0", ("bfloat16",)),
    (513, 24576, 1536, None, ("bfloat16",)),       # ragged M (padded to a multiple of 8)
    (128, 7168, 18432, "ue8m0", ("float32",)),
    (1, 18432, 7168, None, ("bfloat16",)),          # forced Mosaic at M = 1 (auto takes Triton)
])
def test_gpu_mosaic_v3_shapes(m, n, k, scale_fmt, out_dtypes):
    a, a_s, b, b_s = _v3_operands(m, n, k, scale_fmt)
    want = np.asarray(_gpu_oracle(a, a_s, b, b_s))
    for out_dtype in map(jnp.dtype, out_dtypes):
        c = fp8_gemm(a, a_s, b, b_s, out_dtype=out_dtype, impl="mosaic")
        assert c.shape == (m, n) and c.dtype == out_dtype
        err = rel_l2(c, want)
        bound = WGMMA_FP8_REL_L2 + (0 if out_dtype == jnp.float32 else BF16_ROUNDING)
        assert err < bound, (str(out_dtype), err)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [MosaicGemmConfig(cluster="n"), MosaicGemmConfig(cluster="m", num_compute_wgs=3),
                                 MosaicGemmConfig(tile_m=128, tile_n=64, wg_dim="n", max_concurrent_steps=5)])
def test_gpu_mosaic_tilings(cfg):
    """Tilings the sweep may promote to default, on a ragged M."""
    a, a_s, b, b_s = _v3_operands(1000, 7168, 2048, None)
    c = fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, impl="mosaic", mosaic_config=cfg)
    assert rel_l2(c, np.asarray(_gpu_oracle(a, a_s, b, b_s))) < WGMMA_FP8_REL_L2


@pytest.mark.gpu
def test_gpu_mosaic_shard_map_and_leading_dims(rng):
    mesh = jax.make_mesh((1,), ("mp",), devices=jax.devices()[:1])
    a, a_s, b, b_s = operands(rng, (2, 160), 1024, 512)
    specs = (P(), P(), P("mp"), P("mp"))
    f = jax.jit(jax.shard_map(functools.partial(fp8_gemm, out_dtype=jnp.float32, impl="mosaic"), mesh=mesh,
                              in_specs=specs, out_specs=P(None, None, "mp")))
    c = f(*(jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((a, a_s, b, b_s), specs)))
    assert rel_l2(c, numpy_gemm(a, a_s, b, b_s)) < WGMMA_FP8_REL_L2
