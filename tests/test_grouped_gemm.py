"""The Pallas grouped GEMM against float64 numpy (interpret mode on a CPU; compiled with -m gpu)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped import grouped_gemm, tile_schedule

CASES = [  # (rows per group, N, K, block_m, block_n)
    ([1, 0, 2, 0, 0, 3, 0, 0], 96, 256, 16, 64),  # decode: a few rows, most experts idle, N not a multiple of 64
    ([0, 20, 17, 0], 128, 128, 16, 32),  # groups longer than a tile
    ([0, 0, 5], 64, 256, 16, 64),  # trailing group only
    ([3, 4], 200, 384, 32, 128),
]


def float64_oracle(x, w, sizes, scale=None):
    w = np.asarray(w, np.float64)
    if scale is not None:
        full = np.repeat(np.repeat(np.asarray(scale, np.float64), 128, 1), 128, 2)[:, : w.shape[1], : w.shape[2]]
        w = (w * full).astype(np.float32).astype(np.float64)  # dequantised to x's dtype (float32) first
    x = np.asarray(x, np.float64)
    out = np.zeros((x.shape[0], w.shape[1]))
    start = 0
    for group, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size] @ w[group].T
        start += size
    return out


def _inputs(rng, sizes, n, k, extra_rows=0, fp8=False, dtype=jnp.float32):
    m = sum(sizes) + extra_rows
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((len(sizes), n, k)).astype(np.float32)
    scale = None
    if fp8:
        w = (w * 40).astype(jnp.float8_e4m3fn)
        scale = rng.uniform(0.001, 0.05, (len(sizes), -(-n // 128), k // 128)).astype(np.float32)
    return jnp.asarray(x, dtype), jnp.asarray(w if fp8 else w, None if fp8 else dtype), scale


def check(sizes, n, k, block_m, block_n, fp8, extra_rows=3):
    rng = np.random.default_rng(sum(sizes) + n)
    x, w, scale = _inputs(rng, sizes, n, k, extra_rows, fp8)
    got = np.asarray(grouped_gemm(x, w, jnp.array(sizes, jnp.int32), None if scale is None else jnp.asarray(scale),
                                  block_m=block_m, block_n=block_n))
    expected = float64_oracle(np.asarray(x)[: sum(sizes)], w, sizes, scale)
    rel = np.linalg.norm(got[: sum(sizes)] - expected) / np.linalg.norm(expected)
    assert rel < 1e-5, rel
    assert not np.any(got[sum(sizes):]), "rows past the groups must be zero"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("sizes, n, k, block_m, block_n", CASES)
def test_grouped_gemm_interpret(sizes, n, k, block_m, block_n, fp8):
    check(sizes, n, k, block_m, block_n, fp8)


def test_layer_of_a_weight_stack():
    """With `layer`, the kernel reads w[layer] of a (L, G, N, K) stack itself."""
    rng = np.random.default_rng(5)
    sizes = [2, 0, 3]
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    stack = jnp.asarray(rng.standard_normal((4, 3, 64, 256)), jnp.float32)
    for layer in (0, 2):
        got = np.asarray(grouped_gemm(x, stack, jnp.array(sizes, jnp.int32), layer=jnp.int32(layer)))
        expected = float64_oracle(x, stack[layer], sizes)
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-5
    with pytest.raises(ValueError, match="goes with `layer`"):
        grouped_gemm(x, stack, jnp.array(sizes, jnp.int32))


def test_tile_schedule_covers_every_row_once():
    sizes = jnp.array([0, 35, 1, 0, 16, 17], jnp.int32)
    schedule, max_tiles = np.asarray(tile_schedule(sizes, 69, 16)[0]), tile_schedule(sizes, 69, 16)[1]
    assert max_tiles == 5 + 6
    owner = np.full(69, -1)
    for group, row, end, exists, _ in schedule.T:
        if exists:
            for r in range(row, min(row + 16, end)):
                assert owner[r] == -1
                owner[r] = group
    np.testing.assert_array_equal(owner, np.repeat(np.arange(6), np.asarray(sizes)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(x=jnp.zeros((4, 100)), w=jnp.zeros((2, 8, 100))), "K=100"),
    (dict(x=jnp.zeros((4, 128)), w=jnp.zeros((2, 8, 256))), "w has shape"),
    (dict(x=jnp.zeros((4, 128)), w=jnp.zeros((2, 8, 128)), group_sizes=jnp.zeros(3, jnp.int32)), "3 entries"),
    (dict(x=jnp.zeros((4, 128)), w=jnp.zeros((2, 8, 128), jnp.bfloat16)), "must match x"),
    (dict(x=jnp.zeros((4, 128)), w=jnp.zeros((2, 8, 128), jnp.float8_e4m3fn), w_scale=jnp.zeros((2, 1, 2))), "w_scale"),
    (dict(x=jnp.zeros((4, 128)), w=jnp.zeros((2, 8, 128)), block_m=24), "block_m=24"),
])
def test_errors_name_the_argument(kwargs, message):
    kwargs.setdefault("group_sizes", jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=message):
        grouped_gemm(**kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_gemm_compiled_on_gpu(fp8):
    for sizes, n, k, block_m, block_n in CASES + [([1] * 6 + [0] * 58, 1408, 2048, 16, 64),
                                                   ([2, 0, 7, 1] * 8, 2048, 1408, 16, 64)]:
        check(sizes, n, k, block_m, block_n, fp8)


@pytest.mark.gpu
def test_layer_of_a_weight_stack_on_gpu():
    test_layer_of_a_weight_stack()


@pytest.mark.gpu
def test_grouped_gemm_bf16_on_gpu():
    rng = np.random.default_rng(0)
    sizes = [1, 0, 3, 0, 2, 0, 0, 2]
    x, w, _ = _inputs(rng, sizes, 512, 1024, dtype=jnp.bfloat16)
    got = np.asarray(grouped_gemm(x, w, jnp.array(sizes, jnp.int32)), np.float64)
    expected = float64_oracle(np.asarray(x, np.float32), np.asarray(w, np.float32), sizes)
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-2
    assert jax.devices()[0].platform == "gpu"
