"""The grouped kernels' slots form (`slot_experts`, an MoE decode step's router output read as it is)
against float64 numpy (interpret mode on a CPU; compiled with -m gpu).

Each program finds its rows from the expert ids: routed slot (t, c) is output row t k + c, computed from x's
row t (swiglu) or its own row (down); shared chunk s's rows follow chunk by chunk, one per token, in tiles
of up to 16 tokens. The cases use 20 tokens, so a shared chunk's rows span two tiles (a wrong tile end or
first row misses or doubles rows), ids of other ranks' experts on both sides of this rank's range (a wrong
offset reads a neighbouring expert: off by O(1)), a layer of a two-layer stack, and the offset as a traced
value (it is `axis_index` times the local experts in the model)."""
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_kernels import act_quant
from pallas_kernels.grouped import grouped_gemm, grouped_gemm_swiglu

TOKENS, TOPK, GROUPS, CHUNKS, N, K, LAYER, OFFSET = 20, 3, 5, 2, 128, 256, 1, 2


def _weight(rng, shape, fp8):
    """float32 values or fp8 values with 128x128 block scales, and their float64 values as the kernel reads them
    (fp8: dequantized to float32 first)."""
    w = rng.standard_normal(shape).astype(np.float32)
    if not fp8:
        return (w, None), w.astype(np.float64)
    scale = rng.uniform(0.001, 0.05, shape[:-2] + tuple(-(-d // 128) for d in shape[-2:])).astype(np.float32)
    q = (w * 40).astype(ml_dtypes.float8_e4m3fn)
    full = np.repeat(np.repeat(scale.astype(np.float64), 128, -2), 128, -1)[..., : shape[-2], : shape[-1]]
    return (q, scale), (np.asarray(q, np.float64) * full).astype(np.float32).astype(np.float64)


def _case(seed, fp8):
    rng = np.random.default_rng(seed)
    # this rank's experts are ids OFFSET .. OFFSET + GROUPS - 1; 0, 1 and 7, 8 and -1 (padding) name none
    ids = rng.integers(-1, GROUPS + OFFSET + 2, (TOKENS, TOPK)).astype(np.int32)
    weights = {name: _weight(rng, shape, fp8) for name, shape in (
        ("w1", (2, GROUPS, N, K)), ("w3", (2, GROUPS, N, K)), ("w2", (2, GROUPS, N, K)),
        ("s1", (2, CHUNKS * N, K)), ("s3", (2, CHUNKS * N, K)), ("s2", (2, N, CHUNKS * K)))}
    return rng, ids, weights


def _per_row(ids, weights, routed, shared, axis):
    """The float64 (N, K) weight of every output row at LAYER (None: the slot names no expert of this rank)."""
    stack, wide = weights[routed][1][LAYER], weights[shared][1][LAYER]
    rows = [stack[g - OFFSET] if 0 <= g - OFFSET < GROUPS else None for g in ids.reshape(-1)]
    for c in range(CHUNKS):
        chunk = wide[c * N:(c + 1) * N] if axis == "n" else wide[:, c * K:(c + 1) * K]
        rows += [chunk] * TOKENS
    return rows


def _apply(per_row, inputs):
    return np.stack([np.zeros(N) if w is None else inputs[r] @ w.T for r, w in enumerate(per_row)])


def _silu(a):
    return a / (1 + np.exp(-a))


@functools.partial(jax.jit, static_argnames=("down_block_n", "swiglu_block_n"))
def _both(x, x_scale, h, row_scale, ids, offset, w, down_block_n=64, swiglu_block_n=64):
    kw = dict(slot_experts=ids, expert_offset=offset, layer=jnp.int32(LAYER))
    hidden = grouped_gemm_swiglu(x, w["w1"][0], w["w3"][0], None, w["w1"][1], w["w3"][1], shared_w1=w["s1"][0],
                                 shared_w3=w["s3"][0], shared_w1_scale=w["s1"][1], shared_w3_scale=w["s3"][1],
                                 x_scale=x_scale, out_dtype=jnp.float32, block_n=swiglu_block_n, **kw)
    out = grouped_gemm(h, w["w2"][0], None, w["w2"][1], row_scale=row_scale, shared_w=w["s2"][0],
                       shared_w_scale=w["s2"][1], block_n=down_block_n, **kw)
    return hidden, out


def check(fp8: bool, fp8_activations: bool = False, down_block_n: int = 64, swiglu_block_n: int = 64):
    rng, ids, weights = _case(3 + fp8 + 2 * fp8_activations, fp8)
    x = rng.standard_normal((TOKENS, K)).astype(np.float32)
    x_scale, x64 = None, x.astype(np.float64)
    if fp8_activations:
        xq, x_scale = act_quant(jnp.asarray(x, jnp.bfloat16))
        x = xq
        x64 = np.asarray(xq, np.float64) * np.repeat(np.asarray(x_scale, np.float64), 128, 1)
    rows = TOKENS * (TOPK + CHUNKS)
    h = rng.standard_normal((rows, K)).astype(np.float32)
    row_scale = rng.uniform(-2, 2, TOKENS * TOPK).astype(np.float32)
    kernel_weights = {name: pair for name, (pair, _) in weights.items()}
    hidden, out = _both(x, x_scale, h, row_scale, ids, np.int32(OFFSET), kernel_weights, down_block_n=down_block_n,
                        swiglu_block_n=swiglu_block_n)

    token_of = np.concatenate([np.repeat(np.arange(TOKENS), TOPK), np.tile(np.arange(TOKENS), CHUNKS)])
    x_rows = x64[token_of]
    want_h = (_silu(_apply(_per_row(ids, weights, "w1", "s1", "n"), x_rows))
              * _apply(_per_row(ids, weights, "w3", "s3", "n"), x_rows))
    scale = np.concatenate([row_scale, np.ones(rows - TOKENS * TOPK)])[:, None]
    want = _apply(_per_row(ids, weights, "w2", "s2", "k"), h.astype(np.float64)) * scale
    for got, expected in ((hidden, want_h), (out, want)):
        got = np.asarray(got, np.float64)
        assert got.shape == expected.shape
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-5
    named = np.concatenate([(ids.reshape(-1) - OFFSET >= 0) & (ids.reshape(-1) - OFFSET < GROUPS),
                            np.ones(rows - TOKENS * TOPK, bool)])
    assert not np.any(np.asarray(out)[~named]) and not np.any(np.asarray(hidden)[~named])
    assert named.sum() < rows - 5  # the case has slots naming no expert of this rank


@pytest.mark.parametrize("fp8", [False, True])
def test_slots_match_float64(fp8):
    check(fp8)


def test_slots_with_fp8_activations_match_float64():
    """fp8 x per token with its act_quant scales (read at the token's row, not the slot's)."""
    check(True, fp8_activations=True)


@pytest.mark.parametrize("fp8", [False, True])
def test_slots_down_in_wide_tiles_matches_float64(fp8):
    """The down launch in 16 x 128 tiles (the model's at a token or two: `moe.WIDE_DOWN_TILE_MAX_ROWS`), one column
    program over all N = 128 columns."""
    check(fp8, fp8_activations=fp8, down_block_n=128)


@pytest.mark.parametrize("fp8", [False, True])
def test_slots_swiglu_in_narrow_tiles_matches_float64(fp8):
    """The swiglu launch in 16 x 32 tiles (the model's at one token: `moe.NARROW_SWIGLU_TILE_MAX_ROWS`), four
    column programs over N = 128, each reading a quarter of an fp8 weight's 128-column scale block."""
    check(fp8, fp8_activations=fp8, down_block_n=128, swiglu_block_n=32)


def test_slots_twin_inside_shard_map_matches_the_kernels():
    """Inside shard_map on a CPU the wrappers compute the twin from the same slots: they agree."""
    from jax.sharding import PartitionSpec as P

    rng, ids, weights = _case(9, False)
    w = {name: pair for name, (pair, _) in weights.items()}
    x = rng.standard_normal((TOKENS, K)).astype(np.float32)
    h = rng.standard_normal((TOKENS * (TOPK + CHUNKS), K)).astype(np.float32)
    row_scale = rng.uniform(-2, 2, TOKENS * TOPK).astype(np.float32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("model",))
    run = lambda x, h, r, ids, offset: _both(x, None, h, r, ids, offset, w)  # noqa: E731
    sharded = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=(P("model"),) * 4 + (P(),),
                                    out_specs=(P("model"), P("model"))))
    for got, want in zip(sharded(x, h, row_scale, ids, np.int32(OFFSET)), run(x, h, row_scale, ids, np.int32(OFFSET))):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_slots_errors_name_the_argument():
    x, w, ids = jnp.zeros((4, 128)), jnp.zeros((2, 64, 128)), jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(ValueError, match="grouped_gemm: x has 5 rows; with slot_experts of 4 tokens it needs one "
                                         r"a token \(4\) or one a slot \(8"):
        grouped_gemm(jnp.zeros((5, 128)), w, slot_experts=ids)
    with pytest.raises(ValueError, match=r"row_scale has shape \(4,\) float32, expected float32 \(8,\)"):
        grouped_gemm(x, w, slot_experts=ids, row_scale=jnp.zeros((4,), jnp.float32))
    with pytest.raises(ValueError, match="grouped_gemm_swiglu: slot_experts must be integer"):
        grouped_gemm_swiglu(x, w, w, slot_experts=jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="got row_groups and slot_experts"):
        grouped_gemm(x, w, row_groups=jnp.zeros((4,), jnp.int32), slot_experts=ids)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_slots_compiled_on_gpu(fp8):
    assert jax.devices()[0].platform == "gpu"
    check(fp8)
    check(fp8, fp8_activations=fp8, down_block_n=128)
    check(fp8, fp8_activations=fp8, down_block_n=128, swiglu_block_n=32)
    if fp8:
        check(True, fp8_activations=True)
