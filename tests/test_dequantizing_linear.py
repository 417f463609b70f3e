"""`Linear` with an fp8 weight under gemm_impl "bf16" in decode-sized steps: the grouped kernel as one group,
dequantizing the weight's tiles to x's dtype as it reads them (`Linear.dequantizing_kernel`), against float64
numpy on the weight as `weight_dequant` rounds it (interpret mode on a CPU; on a GPU through `Linear.__call__`,
where `dequant_kernel_applies` sends such steps to it).

Block scales are powers of two from 1/16 to 4 times a random factor, so a tile given a neighbouring block's
scale, or another layer's weight, is off by 2x or more; N = 320 leaves a partial column tile."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.model.layers import DEQUANT_KERNEL_MAX_ROWS, Linear, dequant_kernel_applies

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
