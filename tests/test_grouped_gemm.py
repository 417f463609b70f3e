"""The Pallas grouped GEMMs (plain, row-scaled, swiglu) against float64 numpy (interpret mode on a CPU;
compiled with -m gpu).

The kernels run under `jax.jit` (`gemm`, `swiglu`: one program per shape, its tile schedule and
padding inside it, as in the model), except in test_layer_of_a_weight_stack and
test_swiglu_bf16_matches_its_twin, which call them eagerly. Operands go to the device with
`jax.device_put` of numpy arrays already in their dtype (no conversion program of their own), and
the oracles index numpy copies of them.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import act_quant
from pallas_kernels.grouped import (COVERED, SIZED_TILE_MAX_GROUPS, grouped_gemm, grouped_gemm_swiglu, row_schedule,
                                    tile_schedule)
from pallas_kernels.reference import grouped_gemm_ref, grouped_gemm_swiglu_ref

_STATIC = ("out_dtype", "block_m", "block_n", "num_warps", "num_stages")
gemm = jax.jit(grouped_gemm, static_argnames=_STATIC)
swiglu = jax.jit(grouped_gemm_swiglu, static_argnames=_STATIC)
twin = jax.jit(grouped_gemm_ref, static_argnames=("out_dtype",))
put = jax.device_put

CASES = [  # (rows per group, N, K, block_m, block_n)
    ([1, 0, 2, 0, 0, 3, 0, 0], 96, 256, 16, 64),  # decode: a few rows, most experts idle, N not a multiple of 64
    ([0, 20, 17, 0], 128, 128, 16, 32),  # groups longer than a tile
    ([0, 0, 5], 64, 256, 16, 64),  # trailing group only
    ([3, 4], 200, 384, 32, 128),
    ([1200, 0, 900], 64, 128, 64, 64),  # past MOSAIC_MIN_ROWS rows: the refs with a tile of slack past the last row
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


def _inputs(rng, sizes, n, k, extra_rows=0, fp8=False, dtype=np.float32):
    m = sum(sizes) + extra_rows
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((len(sizes), n, k)).astype(np.float32)
    scale = None
    if fp8:
        w = (w * 40).astype(ml_dtypes.float8_e4m3fn)
        scale = rng.uniform(0.001, 0.05, (len(sizes), -(-n // 128), k // 128)).astype(np.float32)
    return put(x.astype(dtype)), put(w if fp8 else w.astype(dtype)), scale


def check(sizes, n, k, block_m, block_n, fp8, extra_rows=3):
    rng = np.random.default_rng(sum(sizes) + n)
    x, w, scale = _inputs(rng, sizes, n, k, extra_rows, fp8)
    got = np.asarray(gemm(x, w, np.array(sizes, np.int32), scale, block_m=block_m, block_n=block_n))
    expected = float64_oracle(np.asarray(x)[: sum(sizes)], w, sizes, scale)
    rel = np.linalg.norm(got[: sum(sizes)] - expected) / np.linalg.norm(expected)
    assert rel < 1e-5, rel
    assert not np.any(got[sum(sizes):]), "rows past the groups must be zero"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("sizes, n, k, block_m, block_n", CASES)
def test_grouped_gemm_interpret(sizes, n, k, block_m, block_n, fp8):
    check(sizes, n, k, block_m, block_n, fp8)


def _silu(a):
    return a / (1 + np.exp(-a))


def check_fused(sizes, n, k, block_m, block_n, fp8, extra_rows=3):
    """grouped_gemm_swiglu and grouped_gemm with row_scale against float64."""
    rng = np.random.default_rng(sum(sizes) + n + 1)
    x, w1, s1 = _inputs(rng, sizes, n, k, extra_rows, fp8)
    _, w3, s3 = _inputs(rng, sizes, n, k, extra_rows, fp8)
    scales = () if not fp8 else (s1, s3)
    group_sizes, used = np.array(sizes, np.int32), sum(sizes)
    got = np.asarray(swiglu(x, w1, w3, group_sizes, *scales, block_m=block_m, block_n=block_n))
    xs = np.asarray(x)[:used]
    expected = _silu(float64_oracle(xs, w1, sizes, s1)) * float64_oracle(xs, w3, sizes, s3)
    assert got.dtype == np.float32
    rel = np.linalg.norm(got[:used] - expected) / np.linalg.norm(expected)
    assert rel < 1e-5, rel
    assert not np.any(got[used:]), "rows past the groups must be zero"
    row_scale = rng.uniform(-2, 2, x.shape[0]).astype(np.float32)
    got = np.asarray(gemm(x, w1, group_sizes, s1, row_scale=row_scale, block_m=block_m, block_n=block_n))
    expected = float64_oracle(xs, w1, sizes, s1) * row_scale.astype(np.float64)[:used, None]
    rel = np.linalg.norm(got[:used] - expected) / np.linalg.norm(expected)
    assert rel < 1e-5, rel
    assert not np.any(got[used:]), "rows past the groups must be zero"


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("sizes, n, k, block_m, block_n", CASES)
def test_swiglu_and_row_scale_interpret(sizes, n, k, block_m, block_n, fp8):
    check_fused(sizes, n, k, block_m, block_n, fp8)


def check_gathered(sizes, n, k, block_m, block_n, fp8, fp8_x=False, extra_rows=3, tokens=7):
    """grouped_gemm_swiglu and grouped_gemm (with row_scale) over rows x[x_rows] gathered by the kernel, against
    float64: x has `tokens` rows, each sorted row names one (repeats and all), as the "fused" decode path's
    (token, choice) rows do. With `fp8_x`, x is act_quant's fp8 pair, whose scales are gathered too."""
    rng = np.random.default_rng(sum(sizes) + n + 2)
    used = sum(sizes)
    x, w1, s1 = _inputs(rng, [tokens], n, k, 0, fp8)
    _, w3, s3 = _inputs(rng, sizes, n, k, 0, fp8)
    w1 = w3 if not fp8 else put(np.asarray(w3)[::-1].copy())  # another weight of the same groups
    s1 = s3 if not fp8 else s3[::-1].copy()
    x = put(np.asarray(x)[:tokens])
    x_rows = rng.integers(0, tokens, used + extra_rows).astype(np.int32)
    x_kw, x64 = {}, np.asarray(x, np.float64)
    if fp8_x:
        xq, x_scale = act_quant(x)
        x, x_kw = xq, dict(x_scale=x_scale)
        x64 = np.asarray(xq.astype(jnp.float32), np.float64) * np.repeat(np.asarray(x_scale, np.float64), 128, 1)
    rows64 = x64[x_rows[:used]]
    group_sizes = np.array(sizes, np.int32)
    got = np.asarray(swiglu(x, w1, w3, group_sizes, *(() if not fp8 else (s1, s3)), block_m=block_m,
                            block_n=block_n, x_rows=x_rows, out_dtype=jnp.float32, **x_kw))
    expected = _silu(float64_oracle(rows64, w1, sizes, s1)) * float64_oracle(rows64, w3, sizes, s3)
    assert np.linalg.norm(got[:used] - expected) / np.linalg.norm(expected) < 1e-5
    assert not np.any(got[used:]), "rows past the groups must be zero"
    row_scale = rng.uniform(-2, 2, len(x_rows)).astype(np.float32)
    got = np.asarray(gemm(x, w1, group_sizes, s1, row_scale=row_scale, block_m=block_m, block_n=block_n,
                          x_rows=x_rows, **x_kw))
    expected = float64_oracle(rows64, w1, sizes, s1) * row_scale.astype(np.float64)[:used, None]
    assert np.linalg.norm(got[:used] - expected) / np.linalg.norm(expected) < 1e-5
    assert not np.any(got[used:]), "rows past the groups must be zero"


@pytest.mark.parametrize("fp8, fp8_x", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("sizes, n, k, block_m, block_n", [CASES[1], CASES[3]])
def test_rows_gathered_by_the_kernel(sizes, n, k, block_m, block_n, fp8, fp8_x):
    check_gathered(sizes, n, k, block_m, block_n, fp8, fp8_x)


def test_gathered_rows_go_with_group_sizes():
    x, w = jnp.zeros((4, 128), jnp.float32), jnp.zeros((2, 64, 128), jnp.float32)
    with pytest.raises(ValueError, match="grouped_gemm: x_rows goes with group_sizes, an integer vector"):
        grouped_gemm(x, w, row_groups=jnp.zeros((4,), jnp.int32), x_rows=jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="grouped_gemm_swiglu: x_rows goes with group_sizes, an integer vector"):
        grouped_gemm_swiglu(x, w, w, jnp.array([2, 2], jnp.int32), x_rows=jnp.zeros((4,), jnp.float32))


@pytest.mark.parametrize("fp8", [False, True])
def test_swiglu_bf16_matches_its_twin(fp8):
    """bfloat16 x (and weights, or fp8 ones dequantised to bfloat16): h in bfloat16, as the twin."""
    rng = np.random.default_rng(7)
    sizes = [1, 0, 2, 0, 0, 3, 0, 0]
    x, w1, s1 = _inputs(rng, sizes, 96, 256, 2, fp8, dtype=ml_dtypes.bfloat16)
    _, w3, s3 = _inputs(rng, sizes, 96, 256, 2, fp8, dtype=ml_dtypes.bfloat16)
    scales = () if not fp8 else (put(s1), put(s3))
    group_sizes = put(np.array(sizes, np.int32))
    got = grouped_gemm_swiglu(x, w1, w3, group_sizes, *scales)
    want = grouped_gemm_swiglu_ref(x, w1, w3, group_sizes, *scales)
    assert got.dtype == jnp.bfloat16 and want.dtype == jnp.bfloat16
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2
    assert not np.any(got[sum(sizes):])


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_kernels_read_a_layer_of_a_weight_stack(fp8):
    """swiglu and row-scaled down kernels with `layer` read w[layer] of (L, G, N, K) stacks."""
    rng = np.random.default_rng(9)
    sizes, n, k, layers = [2, 0, 3], 160, 256, 3
    x = rng.standard_normal((6, k)).astype(np.float32)
    stacks = []
    for _ in range(2):
        w = rng.standard_normal((layers, len(sizes), n, k)).astype(np.float32)
        scale = None
        if fp8:
            w = (w * 40).astype(ml_dtypes.float8_e4m3fn)
            scale = rng.uniform(0.001, 0.05, (layers, len(sizes), 2, k // 128)).astype(np.float32)
        stacks.append((w, scale))
    (w1, s1), (w3, s3) = stacks
    scales = () if not fp8 else (s1, s3)
    row_scale = rng.uniform(0, 1, 6).astype(np.float32)
    group_sizes = np.array(sizes, np.int32)
    for layer in (0, 2):
        pick = lambda s: None if s is None else s[layer]  # noqa: E731
        got = np.asarray(swiglu(x, w1, w3, group_sizes, *scales, layer=np.int32(layer)))
        expected = (_silu(float64_oracle(x[:5], w1[layer], sizes, pick(s1)))
                    * float64_oracle(x[:5], w3[layer], sizes, pick(s3)))
        assert np.linalg.norm(got[:5] - expected) / np.linalg.norm(expected) < 1e-5
        got = np.asarray(gemm(x, w1, group_sizes, s1, layer=np.int32(layer), row_scale=row_scale))
        expected = float64_oracle(x[:5], w1[layer], sizes, pick(s1)) * row_scale.astype(np.float64)[:5, None]
        assert np.linalg.norm(got[:5] - expected) / np.linalg.norm(expected) < 1e-5
        assert not np.any(got[5:])


@pytest.mark.parametrize("rows", [8, 21])  # fewer rows than a tile, and more (masked loads past the last row)
@pytest.mark.parametrize("fp8", [False, True])
def test_row_groups_interpret(fp8, rows):
    """Rows in any order naming their groups (`row_groups`; -1 and G name none): plain with row_scale,
    swiglu, and a layer of a stack, against float64 row by row."""
    rng = np.random.default_rng(11)
    groups, n, k, layers = 5, 160, 256, 2
    row_groups = np.resize(np.array([3, -1, 0, 3, 4, 5, 1, 0], np.int32), rows)
    x = rng.standard_normal((len(row_groups), k)).astype(np.float32)
    stacks = []
    for _ in range(2):
        w = rng.standard_normal((layers, groups, n, k)).astype(np.float32)
        scale = None
        if fp8:
            w = (w * 40).astype(ml_dtypes.float8_e4m3fn)
            scale = rng.uniform(0.001, 0.05, (layers, groups, 2, k // 128)).astype(np.float32)
        stacks.append((w, scale))
    (w1, s1), (w3, s3) = stacks
    row_scale = rng.uniform(-2, 2, len(row_groups)).astype(np.float32)
    named = (row_groups >= 0) & (row_groups < groups)

    def oracle(w, scale, layer):
        out = np.zeros((len(row_groups), n))
        for r, g in enumerate(row_groups):
            if 0 <= g < groups:
                out[r] = float64_oracle(x[r:r + 1], w[layer][g:g + 1], [1],
                                        None if scale is None else scale[layer][g:g + 1])[0]
        return out

    for layer in (0, 1):
        scales = () if not fp8 else (s1, s3)
        got = np.asarray(gemm(x, w1, None, s1, row_groups=row_groups, layer=np.int32(layer), row_scale=row_scale))
        want = oracle(w1, s1, layer) * row_scale.astype(np.float64)[:, None]
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
        assert not np.any(got[~named]), "rows naming no group must be zero"
        got = np.asarray(swiglu(x, w1, w3, None, *scales, row_groups=row_groups, layer=np.int32(layer)))
        want = _silu(oracle(w1, s1, layer)) * oracle(w3, s3, layer)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
        assert not np.any(got[~named])


def _shared_case(rng, fp8: bool, groups: int, chunks: int, n: int, k: int):
    """Routed stacks (2, G, N, K) of w1, w3, w2^T-shaped (2, G, N, K) weights, and a 2-layer stack of the
    shared MLP: w1, w3 (2, S N, K) and w2 (2, N, S K); fp8 weights with their 128x128 block scales."""
    def weight(shape):
        w = rng.standard_normal(shape).astype(np.float32)
        if not fp8:
            return w, None
        scale = rng.uniform(0.001, 0.05, tuple(-(-d // 128) for d in shape[-2:])).astype(np.float32)
        if len(shape) > 2:
            scale = rng.uniform(0.001, 0.05, shape[:-2] + scale.shape).astype(np.float32)
        return (w * 40).astype(ml_dtypes.float8_e4m3fn), scale
    routed = [weight((2, groups, n, k)) for _ in range(3)]
    shared = [weight((2, chunks * n, k)), weight((2, chunks * n, k)), weight((2, n, chunks * k))]
    return routed, shared


def _dequant64(w, scale):
    w = np.asarray(w, np.float64)
    if scale is None:
        return w
    full = np.repeat(np.repeat(np.asarray(scale, np.float64), 128, -2), 128, -1)[..., : w.shape[-2], : w.shape[-1]]
    return (w * full).astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("fp8, form", [(False, "rows"), (True, "rows"), (False, "sizes"), (True, "sizes")])
def test_shared_chunks_run_as_more_groups(fp8, form):
    """Shared experts stored as one MLP (w1, w3 (S N, K), w2 (N, S K)) run as groups G .. G + S - 1 of the
    kernels, beside a layer of a routed stack: chunk s is hidden units [s N, (s + 1) N) of w1 and w3 and
    columns [s K, (s + 1) K) of w2 (a kernel that read chunk 0 for every s, or the routed weights, or the
    wrong layer, is off by O(1)); the twin (concatenated groups) agrees. Against float64. The swiglu reads
    stacks of both at `layer` in place (the layer scan's form); the down projection takes one layer's
    weights (an unstacked MoE's form). Rows naming their groups (`row_groups`), or the same rows sorted by
    group with `group_sizes` of G + S entries (the "fused" decode path's form; rows naming none last)."""
    rng = np.random.default_rng(21 + fp8)
    groups, chunks, n, k, layer = 3, 2, 128, 256, 1
    (w1, s1), (w3, s3), _ = (routed := _shared_case(rng, fp8, groups, chunks, n, k))[0]
    (sw1, ss1), (sw3, ss3), (sw2, ss2) = routed[1]
    # 3, 4: shared chunks 0, 1; -1 and 5 name none. Single shared rows, then runs of one chunk longer and
    # shorter than a tile (16 rows), which the kernel reads in merged tiles (a wrong tile end misses rows)
    row_groups = np.array([4, 0, 3, -1, 2, 4, 3, 5] + [3] * 18 + [4] * 3 + [1], np.int32)
    in_range = (row_groups >= 0) & (row_groups < groups + chunks)
    sizes = np.bincount(row_groups[in_range], minlength=groups + chunks).astype(np.int32)
    if form == "sizes":  # sorted: chunk 0's 20 rows span two tiles, the rows naming none after every group
        row_groups = row_groups[np.argsort(np.where(in_range, row_groups, groups + chunks), stable=True)]
    groups_kw = dict(row_groups=row_groups) if form == "rows" else dict(group_sizes=sizes)
    x = rng.standard_normal((len(row_groups), k)).astype(np.float32)
    row_scale = rng.uniform(-2, 2, len(row_groups)).astype(np.float32)

    def weights64(routed_w, routed_s, shared_w, shared_s, axis):
        """Per row, the float64 (N, K) weight its group names (None: no group)."""
        stack, wide = _dequant64(routed_w, routed_s)[layer], _dequant64(shared_w, shared_s)[layer]
        out = []
        for g in row_groups:
            if 0 <= g < groups:
                out.append(stack[g])
            elif groups <= g < groups + chunks:
                c = g - groups
                out.append(wide[c * n:(c + 1) * n] if axis == "n" else wide[:, c * k:(c + 1) * k])
            else:
                out.append(None)
        return out

    xs = np.asarray(x, np.float64)
    def product(per_row, inputs):
        return np.stack([np.zeros(n) if w is None else inputs[r] @ w.T for r, w in enumerate(per_row)])

    a1 = product(weights64(w1, s1, sw1, ss1, "n"), xs)
    a3 = product(weights64(w3, s3, sw3, ss3, "n"), xs)
    want_h = _silu(a1) * a3
    h = swiglu(x, w1, w3, w1_scale=s1, w3_scale=s3, shared_w1=sw1, shared_w3=sw3, shared_w1_scale=ss1,
               shared_w3_scale=ss3, layer=np.int32(layer), **groups_kw)
    assert np.linalg.norm(np.asarray(h) - want_h) / np.linalg.norm(want_h) < 1e-5
    # the down projection: routed (G, N, K) stand-ins and the shared (N, S K) chunked along K, one layer of each
    h_in = rng.standard_normal((len(row_groups), k)).astype(np.float32)
    w2, s2 = routed[0][2]
    want = product(weights64(w2, s2, sw2, ss2, "k"), np.asarray(h_in, np.float64)) * np.asarray(row_scale)[:, None]
    one = lambda a: None if a is None else a[layer]  # noqa: E731
    got = np.asarray(gemm(h_in, one(w2), w_scale=one(s2), shared_w=one(sw2), shared_w_scale=one(ss2),
                          row_scale=row_scale, **groups_kw))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    named = (row_groups >= 0) & (row_groups < groups + chunks)
    assert not np.any(got[~named]) and not np.any(np.asarray(h)[~named])
    # the twin (used under shard_map's interpreter) states the same
    routed_w2 = w2[layer] if s2 is None else _dequant64(w2, s2)[layer]
    groups_w = np.concatenate([routed_w2, np.stack([_dequant64(sw2, ss2)[layer, :, c * k:(c + 1) * k]
                                                    for c in range(chunks)])]).astype(np.float32)
    with jax.default_device(jax.devices()[0]), jax.default_matmul_precision("highest"):  # not TF32 on a GPU
        stated = twin(h_in, groups_w, groups_kw.get("group_sizes"), row_scale=row_scale,
                      row_groups=groups_kw.get("row_groups"))
    assert np.linalg.norm(np.asarray(stated) - want) / np.linalg.norm(want) < 1e-5


def test_shared_chunks_are_checked():
    x, w = jnp.zeros((4, 128)), jnp.zeros((2, 64, 128))
    rows = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"grouped_gemm: shared weight has shape \(64, 200\), expected \(N, S \* K\)"):
        grouped_gemm(x, w, row_groups=rows, shared_w=jnp.zeros((64, 200)))
    with pytest.raises(ValueError, match=r"shared weight has shape \(64, 256\), expected \(L, N, S \* K\)"):
        grouped_gemm(x, w[None], row_groups=rows, layer=0, shared_w=jnp.zeros((64, 256)))  # a stack's one layer
    with pytest.raises(ValueError, match="grouped_gemm_swiglu: group_sizes has 2 entries for 2 groups in w and 2 "
                                         "shared chunks"):
        grouped_gemm_swiglu(x, w, w, jnp.array([2, 2], jnp.int32), shared_w1=jnp.zeros((128, 128)),
                            shared_w3=jnp.zeros((128, 128)))
    with pytest.raises(ValueError, match="grouped_gemm_swiglu: shared_w1 and shared_w3 go together"):
        grouped_gemm_swiglu(x, w, w, row_groups=rows, shared_w1=jnp.zeros((128, 128)))


def test_row_groups_twin_matches_sorted_groups():
    """The twin's row_groups form equals its group_sizes form on sorted rows (the two statements agree)."""
    rng = np.random.default_rng(12)
    sizes = [2, 0, 3, 1]
    x, w, _ = _inputs(rng, sizes, 64, 128)
    row_groups = np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)
    a = twin(x, w, np.array(sizes, np.int32))
    b = twin(x, w, None, row_groups=row_groups)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_groups_given_once():
    x, w = jnp.zeros((4, 128), jnp.float32), jnp.zeros((2, 64, 128), jnp.float32)
    with pytest.raises(ValueError, match="as one of group_sizes .* got group_sizes and row_groups"):
        grouped_gemm(x, w, jnp.array([2, 2], jnp.int32), row_groups=jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="row_groups or slot_experts; got none"):
        grouped_gemm_swiglu(x, w, w)
    with pytest.raises(ValueError, match="row_groups has 3 entries for the 4 rows"):
        grouped_gemm(x, w, row_groups=jnp.zeros((3,), jnp.int32))


def test_twins_inside_shard_map_match_the_kernels():
    """Inside shard_map on a CPU the wrappers compute the jnp twins: they agree with the kernels."""
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(11)
    sizes = [0, 3, 1, 0]
    x, w1, _ = _inputs(rng, sizes, 128, 128, 1)
    _, w3, _ = _inputs(rng, sizes, 128, 128, 1)
    row_scale = rng.uniform(0, 1, x.shape[0]).astype(np.float32)
    group_sizes = np.array(sizes, np.int32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))

    def both(x, w1, w3, g, r):
        h = grouped_gemm_swiglu(x, w1, w3, g)
        return h, grouped_gemm(h, w3, g, row_scale=r)  # w3 stands in for a (G, dim, inter) down weight

    sharded = jax.jit(jax.shard_map(lambda *a: both(*a), mesh=mesh, in_specs=(P("model"),) * 5,
                                    out_specs=(P("model"), P("model"))))
    kernels = jax.jit(both)(x, w1, w3, group_sizes, row_scale)
    for got, want in zip(sharded(x, w1, w3, group_sizes, row_scale), kernels):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_layer_of_a_weight_stack():
    """With `layer`, the kernel reads w[layer] of a (L, G, N, K) stack itself."""
    rng = np.random.default_rng(5)
    sizes = [2, 0, 3]
    x = rng.standard_normal((5, 256)).astype(np.float32)
    stack = rng.standard_normal((4, 3, 64, 256)).astype(np.float32)
    group_sizes = put(np.array(sizes, np.int32))
    for layer in (0, 2):
        got = np.asarray(grouped_gemm(put(x), put(stack), group_sizes, layer=jnp.int32(layer)))
        expected = float64_oracle(x, stack[layer], sizes)
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-5
    with pytest.raises(ValueError, match="goes with `layer`"):
        grouped_gemm(put(x), put(stack), group_sizes)


@pytest.mark.parametrize("m", [69, 116])
def test_tile_schedule_covers_every_row_once(m):
    """Each row of a group lies in one existing tile of that group; each row past the groups' sum (M > 69)
    in one tile that does not exist (its program zeroes it); nothing else is covered."""
    sizes = jnp.array([0, 35, 1, 0, 16, 17], jnp.int32)
    schedule, max_tiles = np.asarray(tile_schedule(sizes, m, 16)[0]), tile_schedule(sizes, m, 16)[1]
    assert max_tiles == -(-m // 16) + 6
    owner = np.full(m, -2)
    for group, row, end, exists, _ in schedule.T:
        for r in range(row, min(row + 16, end)):
            assert owner[r] == -2
            owner[r] = group if exists else -1
    np.testing.assert_array_equal(owner, np.concatenate([np.repeat(np.arange(6), np.asarray(sizes)),
                                                         np.full(m - 69, -1)]))


def schedule_by_enumeration(sizes, m: int, block_m: int) -> np.ndarray:
    """(group, first row, end row, exists) of every tile, listed group by group, then block_m-row tiles over the
    rows past the groups (exists 0, group G - 1), up to `max_sized_tiles` tiles."""
    tiles, start = [], 0
    for group, size in enumerate(sizes):
        tiles += [(group, row, start + size, 1) for row in range(start, start + size, block_m)]
        start += size
    limit = -(-m // block_m) + len(sizes)
    past = start + block_m * np.arange(limit - len(tiles))
    return np.array(tiles + [(len(sizes) - 1, row, m, 0) for row in past], np.int64).reshape(-1, 4)


@pytest.mark.parametrize("groups", [1, 6, 16, 64, 66, 129])
def test_tile_schedule_lists_each_groups_tiles_in_order(groups):
    """The tiles the programs compute (`sized_tile`) against a plain enumeration, with empty groups, group counts
    at a power of two (the size vector's spare entry past them) and rows past the groups."""
    rng = np.random.default_rng(groups)
    for block_m in (1, 16, 32):
        sizes = rng.integers(0, 40, groups) * (rng.random(groups) < 0.7)
        m = int(sizes.sum()) + int(rng.integers(1, 50))
        got = np.asarray(tile_schedule(jnp.asarray(sizes, jnp.int32), m, block_m, layer=2)[0])
        np.testing.assert_array_equal(got[:4].T, schedule_by_enumeration(sizes, m, block_m))
        assert (got[4] == 2).all()


@pytest.mark.parametrize("fp8", [False, True])
def test_rows_past_the_groups_are_zeroed_without_a_zeroed_buffer(fp8):
    """Three tiles' worth of rows past the groups: the launch's spare programs zero them (the interpreter fills an
    output nothing writes with NaN), and the groups' rows stay right."""
    check([5, 0, 9], 64, 256, 16, 64, fp8, extra_rows=40)


@pytest.mark.parametrize("fp8", [False, True])
def test_many_groups_read_the_tile_table(fp8, monkeypatch):
    """Past SIZED_TILE_MAX_GROUPS groups the programs read XLA's tile table (`tile_schedule`): 150 groups, most
    empty, a few of several tiles, and rows past the groups, which the table's spare tiles zero."""
    sizes = [0] * 150
    sizes[3], sizes[77], sizes[148], sizes[149] = 18, 1, 5, 33
    monkeypatch.setattr("pallas_kernels.grouped.SIZED_TILE_MAX_GROUPS", min(SIZED_TILE_MAX_GROUPS, len(sizes) - 1))
    check(sizes, 64, 256, 16, 64, fp8, extra_rows=21)


def test_row_schedule_merges_shared_runs_into_tiles():
    """Rows of groups >= merge_from in runs of one group share tiles of up to block_m rows; every row that
    names a group lies in exactly one existing tile of its group, each tile starts at its own program's
    row, rows naming no group are zero-filled tiles of their own, and the rest of a run's programs idle."""
    groups = np.array([0, 5, 5, 2, 4, 4, 4, 4, 4, 1, 5, -1, 4, 4, 0, 6] + [5] * 5, np.int32)  # 4, 5 shared
    schedule = np.asarray(row_schedule(jnp.asarray(groups), 6, 3, merge_from=4, block_m=4))
    owner, tile_rows = np.full(len(groups), -1), []
    for program, (group, row, end, code, layer) in enumerate(schedule.T):
        assert row == program and layer == 3
        if code == 1:
            assert 1 <= end - row <= (4 if group >= 4 else 1)
            tile_rows.append(end - row)
            for r in range(row, end):
                assert owner[r] == -1
                owner[r] = group
        else:
            assert code == (COVERED if 0 <= groups[program] < 6 else 0)
    np.testing.assert_array_equal(owner, np.where((groups >= 0) & (groups < 6), groups, -1))
    assert tile_rows.count(4) == 2 and len(tile_rows) == 11  # 6 single rows; runs 5,5 | 4x5: 4+1 | 4,4 | 5x5: 4+1


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


def test_fused_errors_name_the_argument():
    x, w, sizes = jnp.zeros((4, 128)), jnp.zeros((2, 8, 128)), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="row_scale"):
        grouped_gemm(x, w, sizes, row_scale=jnp.zeros((3,)))
    with pytest.raises(ValueError, match="grouped_gemm_swiglu: w1 and w3"):
        grouped_gemm_swiglu(x, w, jnp.zeros((2, 16, 128)), sizes)
    with pytest.raises(ValueError, match="grouped_gemm_swiglu: x has last dim"):
        grouped_gemm_swiglu(jnp.zeros((4, 100)), jnp.zeros((2, 8, 100)), jnp.zeros((2, 8, 100)), sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_grouped_gemm_compiled_on_gpu(fp8):
    for sizes, n, k, block_m, block_n in CASES + [([1] * 6 + [0] * 58, 1408, 2048, 16, 64),
                                                   ([2, 0, 7, 1] * 8, 2048, 1408, 16, 64)]:
        check(sizes, n, k, block_m, block_n, fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_many_groups_read_the_tile_table_on_gpu(fp8, monkeypatch):
    test_many_groups_read_the_tile_table(fp8, monkeypatch)


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


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_swiglu_and_row_scale_compiled_on_gpu(fp8):
    for sizes, n, k, block_m, block_n in CASES + [([1] * 6 + [0] * 58, 1408, 2048, 16, 64),
                                                   ([2, 0, 7, 1] * 8, 2048, 1408, 16, 32)]:
        check_fused(sizes, n, k, block_m, block_n, fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8, fp8_x", [(False, False), (True, True)])
def test_rows_gathered_by_the_kernel_on_gpu(fp8, fp8_x):
    check_gathered([2, 0, 7, 1] * 8, 256, 512, 32, 64, fp8, fp8_x, tokens=13)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_fused_kernels_on_gpu(fp8):
    test_swiglu_bf16_matches_its_twin(fp8)
    test_fused_kernels_read_a_layer_of_a_weight_stack(fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_shared_chunks_compiled_on_gpu(fp8):
    test_shared_chunks_run_as_more_groups(fp8, "rows")
    test_shared_chunks_run_as_more_groups(fp8, "sizes")
