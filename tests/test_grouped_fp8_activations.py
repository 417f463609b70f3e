"""The grouped GEMMs with fp8 activations (`x_scale`): fp8 x times fp8 weights on the tensor cores, each
128-wide K block's product scaled by its x scale and weight scale (fp8_gemm's math), against float64 numpy
(interpret mode on a CPU; compiled with -m gpu).

Scales are powers of two from 1/16 to 4 times a random factor, per row and K block for x, per 128x128 block
for the weights: a kernel that applied a neighbouring block's or row's scale, or left one out, is off by
2x or more somewhere, far past the float32 tolerances below."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv3_jax.model.moe import SHORT_TILE_ROWS_PER_EXPERT, _kernel_inputs
from pallas_kernels import MOSAIC_MIN_ROWS, act_quant
from pallas_kernels.grouped import grouped_gemm, grouped_gemm_swiglu
from pallas_kernels.reference import grouped_gemm_ref

ROUTED, SHARED, N, K, LAYER = 3, 2, 128, 384, 1
# per row the group it names: 3 and 4 are the shared chunks (one run longer than a 16-row tile), -1 and 5 name none
ROW_GROUPS = np.array([4, 0, 3, -1, 2, 4, 3, 5] + [3] * 18 + [4] * 3 + [1], np.int32)


def block_scales(rng, shape):
    return (2.0 ** rng.integers(-4, 3, shape) * rng.uniform(0.5, 1.0, shape)).astype(np.float32)


def fp8_weight(rng, shape):
    """fp8 values (|w| < 2) and 128x128 block scales of a weight (..., rows, K)."""
    w = jnp.asarray(rng.uniform(-1.9, 1.9, shape), jnp.float8_e4m3fn)
    return w, jnp.asarray(block_scales(rng, shape[:-2] + (-(-shape[-2] // 128), shape[-1] // 128)) / 16)


def fp8_rows(rng, rows):
    x = jnp.asarray(rng.uniform(-1.9, 1.9, (rows, K)), jnp.float8_e4m3fn)
    return x, jnp.asarray(block_scales(rng, (rows, K // 128)))


def dequant64(w, scale):
    """float64 values of fp8 `w` (..., R, C) times their (..., R / 128 or R, C / 128) scales."""
    scale = np.asarray(scale, np.float64)
    if scale.shape[-2] != w.shape[-2]:
        scale = np.repeat(scale, 128, -2)[..., : w.shape[-2], :]
    return np.asarray(w, np.float64) * np.repeat(scale, 128, -1)


def per_row_weights(routed, shared, axis):
    """For each row of ROW_GROUPS the float64 (N, K) weight its group names at LAYER (None: no group)."""
    stack, wide = dequant64(*routed)[LAYER], dequant64(*shared)[LAYER]
    out = []
    for g in ROW_GROUPS:
        c = g - ROUTED
        if 0 <= g < ROUTED:
            out.append(stack[g])
        elif 0 <= c < SHARED:
            out.append(wide[c * N:(c + 1) * N] if axis == "n" else wide[:, c * K:(c + 1) * K])
        else:
            out.append(None)
    return out


def products(per_row, x64):
    return np.stack([np.zeros(N) if w is None else x64[r] @ w.T for r, w in enumerate(per_row)])


def rel(got, want):
    return np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)


def test_swiglu_with_fp8_activations_reads_routed_and_shared_experts():
    """h = silu(x W1^T) * (x W3^T) for routed experts (a layer of a stack, read in place) and shared chunks
    run as more groups, from fp8 x: float32 h to 1e-5, and the bfloat16 default to bfloat16 rounding."""
    rng = np.random.default_rng(31)
    w1, w3 = (fp8_weight(rng, (2, ROUTED, N, K)) for _ in range(2))
    sw1, sw3 = (fp8_weight(rng, (2, SHARED * N, K)) for _ in range(2))
    x, xs = fp8_rows(rng, len(ROW_GROUPS))
    x64 = dequant64(x, xs)
    want = [products(per_row_weights(w, s, "n"), x64) for w, s in ((w1, sw1), (w3, sw3))]
    want = want[0] / (1 + np.exp(-want[0])) * want[1]
    kw = dict(row_groups=jnp.asarray(ROW_GROUPS), layer=jnp.int32(LAYER), x_scale=xs, shared_w1=sw1[0],
              shared_w3=sw3[0], shared_w1_scale=sw1[1], shared_w3_scale=sw3[1])
    h32 = grouped_gemm_swiglu(x, w1[0], w3[0], None, w1[1], w3[1], out_dtype=jnp.float32, **kw)
    assert rel(h32, want) < 1e-5
    h = grouped_gemm_swiglu(x, w1[0], w3[0], None, w1[1], w3[1], **kw)
    assert h.dtype == jnp.bfloat16 and rel(h, want) < 2 ** -8
    named = (ROW_GROUPS >= 0) & (ROW_GROUPS < ROUTED + SHARED)
    assert not np.any(np.asarray(h32)[~named])


def test_down_projection_with_fp8_activations_and_row_scale():
    """The down projection from act_quant's pair of bfloat16 h: routed experts of one layer and the shared
    experts' wide w2 chunked along K, each row times its routing weight, against float64 on h's fp8 values."""
    rng = np.random.default_rng(32)
    w2 = fp8_weight(rng, (2, ROUTED, N, K))
    sw2 = fp8_weight(rng, (2, N, SHARED * K))
    h = jnp.asarray(rng.standard_normal((len(ROW_GROUPS), K)), jnp.bfloat16)
    hq, hs = act_quant(h)
    row_scale = jnp.asarray(rng.uniform(-2, 2, len(ROW_GROUPS)), jnp.float32)
    want = products(per_row_weights(w2, sw2, "k"), dequant64(hq, hs)) * np.asarray(row_scale)[:, None]
    got = grouped_gemm(hq, w2[0][LAYER], None, w2[1][LAYER], row_groups=jnp.asarray(ROW_GROUPS),
                       row_scale=row_scale, shared_w=sw2[0][LAYER], shared_w_scale=sw2[1][LAYER], x_scale=hs)
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("sizes, block_m", [([2, 0, 19, 5], 16), ([0, 40, 1, 0], 32)])
def test_sorted_groups_with_fp8_activations(sizes, block_m):
    """Rows sorted by group (group_sizes; tiles that end inside a group, idle groups), rows past the groups
    zero, the kernel and its twin against float64."""
    rng = np.random.default_rng(33 + block_m)
    w, ws = fp8_weight(rng, (len(sizes), N + 72, K))  # N not a multiple of the column tile
    x, xs = fp8_rows(rng, sum(sizes) + 3)
    x64, w64 = dequant64(x, xs), dequant64(w, ws)
    want = np.concatenate([x64[sum(sizes[:g]):sum(sizes[:g + 1])] @ w64[g].T for g in range(len(sizes))])
    for fn in (grouped_gemm, grouped_gemm_ref):
        got = np.asarray(fn(x, w, jnp.array(sizes, jnp.int32), ws, x_scale=xs, **(
            dict(block_m=block_m) if fn is grouped_gemm else {})))
        assert rel(got[: sum(sizes)], want) < 1e-5 and not np.any(got[sum(sizes):])


def test_fp8_activations_are_checked():
    rng = np.random.default_rng(34)
    w, ws = fp8_weight(rng, (2, N, K))
    x, xs = fp8_rows(rng, 4)
    sizes = jnp.array([1, 3], jnp.int32)
    with pytest.raises(ValueError, match="x_scale goes with an fp8 x and an fp8 w"):
        grouped_gemm(x.astype(jnp.bfloat16), w, sizes, ws, x_scale=xs)
    with pytest.raises(ValueError, match=r"x_scale has shape \(4, 2\) float32, expected float32 \(4, 3\)"):
        grouped_gemm(x, w, sizes, ws, x_scale=xs[:, :2])
    with pytest.raises(ValueError, match="float8_e4m3fn with x_scale"):
        grouped_gemm(x, w, sizes, ws)


@pytest.mark.gpu
def test_fp8_activations_compiled_on_gpu():
    """Also the twin's float32 ragged_dot, at float32 precision (not the GPU's default tf32)."""
    with jax.default_matmul_precision("highest"):
        test_swiglu_with_fp8_activations_reads_routed_and_shared_experts()
        test_down_projection_with_fp8_activations_and_row_scale()
        test_sorted_groups_with_fp8_activations([2, 0, 19, 5], 16)
        test_sorted_groups_with_fp8_activations([0, 2100, 1, 0], 64)  # prefill-sized: still the Triton kernel


PER_EXPERT = SHORT_TILE_ROWS_PER_EXPERT


@pytest.mark.parametrize("rows, experts, one_row_tiles, on_tensor_cores, block_m", [
    (9, 64, True, True, 16), (MOSAIC_MIN_ROWS, 256, False, True, 16), (PER_EXPERT * 64, 64, False, True, 16),
    (PER_EXPERT * 64 + 1, 64, False, True, 32), (MOSAIC_MIN_ROWS, 64, False, True, 32),
    (MOSAIC_MIN_ROWS + 1, 64, False, False, 64), (MOSAIC_MIN_ROWS + 1, 64, True, True, 16)])
def test_moe_feeds_fp8_activations_to_decode_sized_kernels(rows, experts, one_row_tiles, on_tensor_cores, block_m):
    """Under gemm_impl "fp8" the MoE hands the grouped kernels act_quant's fp8 pair where they run short row
    tiles (decode steps up to MOSAIC_MIN_ROWS rows, one-row tiles) and, in prefill-sized steps, x rounded
    through the same act_quant (its fp8 values times their scales, in x's dtype); bf16 weights or gemm_impl
    "bf16" get x untouched. The short tiles are 16 rows tall, 32 where the rows average more than
    SHORT_TILE_ROWS_PER_EXPERT an expert (one-row tiles excepted); prefill's 64."""
    x = jnp.asarray(np.random.default_rng(35).standard_normal((rows, 128)), jnp.bfloat16)
    xq, xs = act_quant(x)
    got, got_scale, tiles = _kernel_inputs(x, experts, True, "fp8", None, one_row_tiles)
    assert tiles["block_m"] == block_m
    if on_tensor_cores:
        assert got.dtype == jnp.float8_e4m3fn and np.array_equal(np.asarray(got, np.float32), np.asarray(xq, np.float32))
        assert np.array_equal(np.asarray(got_scale), np.asarray(xs))
    else:
        want = (dequant64(xq, xs)).astype(np.float32)
        assert got_scale is None and got.dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(got, np.float32), np.asarray(jnp.asarray(want, jnp.bfloat16), np.float32))
    for fp8_weights, gemm_impl in ((False, "fp8"), (True, "bf16")):
        same, none, _ = _kernel_inputs(x, experts, fp8_weights, gemm_impl, None, one_row_tiles)
        assert same is x and none is None
