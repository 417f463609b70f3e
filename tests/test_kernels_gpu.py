"""pallas_kernels compiled for the GPU (Pallas Triton backend): the checks of test_kernels.py at
realistic sizes, every tiling the benchmark times, jit and shard_map. Run on the device with
`pytest -m gpu tests/test_kernels_gpu.py`. Oracles run on the CPU (jnp twin, numpy float64)
or, for the largest GEMMs, as a float32 HIGHEST-precision XLA matmul of the dequantised operands."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from kernel_checks import (AQ, FP8, GM, activations, check_act_quant, check_fp8_gemm, check_weight_dequant,
                           fp8_weight, gemm_operands, gemm_tolerance, numpy_gemm, rel_l2)
from pallas_kernels import GemmConfig, act_quant, fp8_gemm
from script_modules import load_script

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # each test: gpu or gpu_slow


@pytest.mark.gpu
def test_runs_compiled():
    assert not AQ.use_interpret(), "expected a GPU backend"


# ---------------------------------------------------------------- act_quant
@pytest.mark.gpu
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("shape,dtype", [
    ((4096, 7168), jnp.bfloat16),
    ((37, 384), jnp.bfloat16),
    ((1, 7168), jnp.float32),
    ((3, 5, 1536), jnp.float16),
    ((9, 2048), jnp.bfloat16),     # decode rows (the V3 routed down launch's at one token): one-block programs
    ((1, 16384), jnp.bfloat16),
])
def test_act_quant(rng, shape, dtype, scale_fmt):
    check_act_quant(activations(rng, shape, dtype), scale_fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(8, 8, 4), (32, 8, 8), (4, 8, 4), (16, 4, 4), (8, 4, 2), (64, 1, 4), (2, 8, 2),
                                  (1, 1, 1), (1, 2, 1), (1, 8, 4)])
def test_act_quant_bench_tiles(rng, tile):
    check_act_quant(activations(rng, (300, 7168)), None, tile=tile, oracle_numpy=False)


# ---------------------------------------------------------------- weight_dequant
@pytest.mark.gpu
@pytest.mark.parametrize("m,n,out_dtype", [(7168, 2112, jnp.bfloat16), (200, 300, jnp.bfloat16),
                                           (1, 130, jnp.float32), (4096, 7168, jnp.float32)])
def test_weight_dequant(rng, m, n, out_dtype):
    w, s = fp8_weight(rng, m, n)
    check_weight_dequant(w, s, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(32, 512, 4), (128, 256, 8), (64, 128, 4), (128, 128, 4),
                                  (32, 1024, 8), (128, 512, 8), (16, 1024, 4)])
def test_weight_dequant_bench_tiles(rng, tile):
    w, s = fp8_weight(rng, 1000, 1500)
    check_weight_dequant(w, s, jnp.bfloat16, tile=tile)


# ---------------------------------------------------------------- fp8_gemm
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 37, 64, 200, 513])
def test_fp8_gemm_default_vs_numpy(rng, m):
    a, a_s, b, b_s = gemm_operands(rng, (m,), 2112, 1536)  # N = 16.5 blocks: ragged
    check_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32)
    check_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 200])  # split-K narrow tiles; taller tiles; the Mosaic kernel's slice
def test_fp8_gemm_reads_a_layer_of_a_stack(rng, m):
    """Layer 1 of a three-layer weight stack (a traced index), against float64 on that layer alone."""
    layers = [gemm_operands(rng, (m,), 576, 1536) for _ in range(3)]  # N = 4.5 blocks: ragged
    a, a_s = layers[0][:2]
    b, b_s = (jnp.stack([layer[i] for layer in layers]) for i in (2, 3))
    c = jax.jit(lambda layer: fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, layer=layer))(jnp.int32(1))
    assert rel_l2(c, numpy_gemm(a, a_s, b[1], b_s[1])) < gemm_tolerance(jnp.float32)


@pytest.mark.gpu
def test_gemms_read_a_stack_past_2_31_bytes():
    """A weight stack of 2^31..2^32 fp8 bytes (V3's wq_b on a device that holds every layer's attention: 61 x
    24,576 x 1,536), which fp8_gemm and dequant_gemm read in place as byte pairs: the last layer's last 256 output
    columns, whose bytes lie past 2^31, against float64 on that slice. Addressed with 32-bit signed offsets they
    fault or read other bytes."""
    layers, n, k = 3, 16384, 45056  # 2.21e9 bytes
    key = jax.random.PRNGKey(7)
    b = jnp.stack([jax.random.uniform(jax.random.fold_in(key, i), (n, k), jnp.bfloat16, -1.9, 1.9).astype(FP8)
                   for i in range(layers)])
    assert 2**31 <= b.size < 2**32
    b_s = jnp.exp2(jnp.floor(jax.random.uniform(jax.random.fold_in(key, 9), (layers, n // 128, k // 128),
                                                minval=-8, maxval=-3)))
    x = jax.random.normal(jax.random.fold_in(key, 10), (1, k), jnp.float32).astype(jnp.bfloat16)
    a, a_s = act_quant(x)
    last, cols = jnp.int32(layers - 1), slice(n - 256, n)
    w, w_s = b[layers - 1, cols], b_s[layers - 1, (n - 256) // 128:]
    c = np.asarray(fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, layer=last))
    assert np.isfinite(c).all() and rel_l2(c[:, cols], numpy_gemm(a, a_s, w, w_s)) < gemm_tolerance(jnp.float32)
    full = np.repeat(np.repeat(np.asarray(w_s, np.float64), 128, 0), 128, 1)
    w64 = np.asarray(jnp.asarray(np.asarray(w, np.float64) * full, jnp.float32).astype(jnp.bfloat16), np.float64)
    want = np.asarray(x, np.float64) @ w64.T
    got = np.asarray(GM.dequant_gemm(x, b, b_s, layer=last), np.float64)[:, cols]
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.gpu
def test_fp8_gemm_leading_dims(rng):
    a, a_s, b, b_s = gemm_operands(rng, (2, 3, 5), 640, 1024)
    check_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32)


def _bench_configs():
    bench = load_script("bench_kernels")
    out = []
    for m in (1, 64, 4096):
        for cfg in [GM.default_config(m, 2112, 1536)] + bench.candidates(m, 2112, 1536):
            out.append((m, cfg))
    return out


@pytest.mark.gpu_slow  # a sweep
@pytest.mark.parametrize("m,config", _bench_configs() if jax.default_backend() == "gpu" else [])
def test_fp8_gemm_bench_configs(rng, m, config):
    """Every tiling the benchmark times computes the right thing (at a ragged N)."""
    rows = {1: 3, 64: 50, 4096: 300}[m]
    a, a_s, b, b_s = gemm_operands(rng, (rows,), 2112, 1536)
    check_fp8_gemm(a, a_s, b, b_s, config=config, out_dtype=jnp.float32)


def _gpu_oracle(a, a_s, b, b_s):
    """float32, HIGHEST precision XLA product of the dequantised operands (on the GPU)."""
    k = a.shape[-1]
    ad = (a.astype(jnp.float32).reshape(-1, k // 128, 128) * a_s.reshape(-1, k // 128, 1)).reshape(-1, k)
    sb = jnp.repeat(b_s, 128, axis=0)[: b.shape[0]]
    bd = (b.astype(jnp.float32).reshape(b.shape[0], k // 128, 128) * sb[..., None]).reshape(b.shape)
    return jnp.dot(ad, bd.T, precision=jax.lax.Precision.HIGHEST)


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(4096, 7168, 2048), (4096, 2048, 7168), (1, 7168, 18432), (64, 7168, 18432)])
def test_fp8_gemm_realistic(m, n, k):
    key = jax.random.PRNGKey(m + n + k)
    x = jax.random.normal(key, (m, k), jnp.float32).astype(jnp.bfloat16)
    a, a_s = act_quant(x)
    b = (jax.random.normal(jax.random.fold_in(key, 1), (n, k)) * 64).astype(jnp.float8_e4m3fn)
    b_s = jnp.exp2(jax.random.uniform(jax.random.fold_in(key, 2), (-(-n // 128), k // 128), minval=-12, maxval=-4))
    want = np.asarray(_gpu_oracle(a, a_s, b, b_s))
    check_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.float32, want=want)
    check_fp8_gemm(a, a_s, b, b_s, out_dtype=jnp.bfloat16, want=want)


# ---------------------------------------------------------------- jit / shard_map
@pytest.mark.gpu
def test_shard_map_compiled(rng):
    mesh = jax.make_mesh((1,), ("mp",), devices=jax.devices()[:1])
    x = activations(rng, (64, 1024), special_blocks=False)
    b, b_s = fp8_weight(rng, 512, 1024)

    def local(x, b, b_s):
        q, s = act_quant(x, scale_fmt="ue8m0")
        return fp8_gemm(q, s, b, b_s, out_dtype=jnp.float32), q, s

    f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("mp"), P("mp"), P("mp")),
                              out_specs=(P("mp"), P("mp"), P("mp"))))
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    c, q, s = f(put(x, P("mp")), put(b, P("mp")), put(b_s, P("mp")))
    q2, s2 = act_quant(x, scale_fmt="ue8m0")
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(q2).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s2))
    assert rel_l2(c, _gpu_oracle(q2, s2, b, b_s)) < gemm_tolerance(jnp.float32)
