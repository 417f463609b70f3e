"""`Linear` with an fp8 weight under gemm_impl "bf16" in decode-sized steps: `dequant_gemm`, dequantizing the
weight's tiles to x's dtype as it reads them (`Linear.dequantizing_kernel`), against float64 numpy on the weight
as `weight_dequant` rounds it (interpret mode on a CPU; on a GPU through `Linear.__call__`, where
`dequant_kernel_applies` sends such steps to it); and `dequant_gemm` itself where it splits K.

Block scales are powers of two from 1/16 to 4 times a random factor, so a tile given a neighbouring block's
scale, or another layer's weight, is off by 2x or more; N = 320 leaves a partial column tile."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.model.layers import DEQUANT_KERNEL_MAX_ROWS, Linear, dequant_kernel_applies
from pallas_kernels import dequant_gemm
from pallas_kernels.gemm import default_config

IN, OUT = 384, 320


def fp8_linear(rng, stack: tuple[int, ...]):
    linear = Linear(IN, OUT, fp8=True, stack=stack, rngs=None)
    w = rng.uniform(-1.9, 1.9, (*stack, OUT, IN)).astype(np.float32)
    scale = (2.0 ** rng.integers(-4, 3, (*stack, -(-OUT // 128), IN // 128)) * rng.uniform(0.5, 1.0)) / 32
    linear.weight.set_value(jnp.asarray(w, jnp.float8_e4m3fn))
    linear.scale.set_value(jnp.asarray(scale, jnp.float32))
    return linear


def dequantized64(linear, layer, dtype):
    w = np.asarray(linear.weight[...], np.float64)
    full = np.repeat(np.repeat(np.asarray(linear.scale[...], np.float64), 128, -2), 128, -1)[..., :OUT, :IN]
    w = np.asarray(jnp.asarray(w * full, jnp.float32).astype(dtype), np.float64)  # weight_dequant's rounding
    return w if layer is None else w[layer]


@pytest.mark.parametrize("stack, layer", [((), None), ((2,), 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dequantizing_kernel_matches_float64(stack, layer, dtype):
    rng = np.random.default_rng(len(stack) + (dtype == jnp.bfloat16))
    linear = fp8_linear(rng, stack)
    x = jnp.asarray(rng.standard_normal((2, 3, IN)), dtype)  # (B, S, in): rows flattened, shape kept
    got = linear.dequantizing_kernel(x, None if layer is None else jnp.int32(layer))
    want = np.asarray(x, np.float64) @ dequantized64(linear, layer, dtype).T
    assert got.shape == (2, 3, OUT) and got.dtype == jnp.float32
    assert np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.parametrize("m, stacked, dtype, pairs", [
    (1, False, jnp.float32, False), (5, True, jnp.bfloat16, False), (40, False, jnp.bfloat16, False),
    (70, True, jnp.float32, False), (5, True, jnp.bfloat16, True), (70, True, jnp.float32, True)])
def test_dequant_gemm_split_over_k_matches_float64(m, stacked, dtype, pairs, n=200, k=2048):
    """K = 2048 (16 K-blocks): 1 and 5 rows split it over 4 programs whose float32 partial sums are added
    (asserted, so that the split path is the one tested), 40 and 70 rows do not; N = 200 leaves a partial
    column tile; 70 rows span two 64-row tiles; `pairs`: the weight read as uint16 byte pairs (what a stack of
    2^31..2^32 bytes takes). A split's sum started at another K-block, a tile scaled by another block's scale, or a
    byte met by the wrong column of x, is off by O(1)."""
    rng = np.random.default_rng(m)
    w = jnp.asarray(rng.uniform(-1.9, 1.9, (3, n, k)), jnp.float8_e4m3fn)
    scale = jnp.asarray((2.0 ** rng.integers(-4, 3, (3, 2, k // 128)) * rng.uniform(0.5, 1.0)) / 32, jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    assert (default_config(m, n, k).split > 1) == (m <= 16)
    config = dataclasses.replace(default_config(m, n, k), byte_pairs=pairs)
    got = (dequant_gemm(x, w, scale, layer=jnp.int32(2), config=config) if stacked
           else dequant_gemm(x, w[2], scale[2], config=config))
    full = np.repeat(np.repeat(np.asarray(scale[2], np.float64), 128, 0), 128, 1)[:n]
    w64 = np.asarray(jnp.asarray(np.asarray(w[2], np.float64) * full, jnp.float32).astype(dtype), np.float64)
    want = np.asarray(x, np.float64) @ w64.T
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert np.linalg.norm(np.asarray(got) - want) / np.linalg.norm(want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 576, 7168), (8, 7168, 2048)])
def test_dequant_gemm_on_gpu(m, n, k):
    """V3's wkv_a at one row (9 column tiles over 56 K-blocks: split 14) and a wide weight at 8 rows, bf16,
    compiled, against float64 on weight_dequant's rounding."""
    rng = np.random.default_rng(n)
    w = jnp.asarray(rng.uniform(-1.9, 1.9, (n, k)).astype(np.float32), jnp.float8_e4m3fn)
    scale = jnp.asarray((2.0 ** rng.integers(-4, 3, (-(-n // 128), k // 128)) / 32), jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32), jnp.bfloat16)
    got = np.asarray(dequant_gemm(x, w, scale), np.float64)
    full = np.repeat(np.repeat(np.asarray(scale, np.float64), 128, 0), 128, 1)[:n]
    w64 = np.asarray(jnp.asarray(np.asarray(w, np.float64) * full, jnp.float32).astype(jnp.bfloat16), np.float64)
    want = np.asarray(x, np.float64) @ w64.T
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_dequant_gemm_errors():
    w, s = jnp.zeros((200, 256), jnp.float8_e4m3fn), jnp.ones((2, 2), jnp.float32)
    with pytest.raises(ValueError, match="dequant_gemm: a has dtype int32"):
        dequant_gemm(jnp.zeros((1, 256), jnp.int32), w, s)
    with pytest.raises(ValueError, match="dequant_gemm: b has dtype bfloat16"):
        dequant_gemm(jnp.zeros((1, 256), jnp.bfloat16), w.astype(jnp.bfloat16), s)
    with pytest.raises(ValueError, match=r"dequant_gemm: b_s has shape \(2, 3\)"):
        dequant_gemm(jnp.zeros((1, 256), jnp.bfloat16), w, jnp.ones((2, 3), jnp.float32))
    with pytest.raises(ValueError, match="a stack"):
        dequant_gemm(jnp.zeros((1, 256), jnp.bfloat16), w, s, layer=jnp.int32(0))


def test_dispatch_is_decode_sized_bf16_on_a_gpu():
    on_gpu = jax.default_backend() == "gpu"
    assert dequant_kernel_applies("bf16", DEQUANT_KERNEL_MAX_ROWS) == on_gpu
    assert not dequant_kernel_applies("bf16", DEQUANT_KERNEL_MAX_ROWS + 1)
    assert not dequant_kernel_applies("fp8", 1)


@pytest.mark.gpu
@pytest.mark.parametrize("stack, layer", [((), None), ((2,), 1)])
def test_decode_step_projection_on_gpu(stack, layer):
    """Linear.__call__ at 8 rows with gemm_impl "bf16": the kernel path, against float64."""
    rng = np.random.default_rng(7)
    linear = fp8_linear(rng, stack)
    x = jnp.asarray(rng.standard_normal((8, 1, IN)), jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        got = linear(x, gemm_impl="bf16", out_dtype=jnp.float32, layer=None if layer is None else jnp.int32(layer))
    want = np.asarray(x, np.float64) @ dequantized64(linear, layer, jnp.bfloat16).T
    assert np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want) < 1e-5
