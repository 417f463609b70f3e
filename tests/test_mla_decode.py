"""The MLA decode kernels against float64 numpy attention (interpret mode on a CPU; compiled with -m gpu):
the attention over the latent cache, and wkv_b's absorption into the query and out of the output."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import mla_absorb_query, mla_decode, mla_decode_output, mla_decode_splits
from pallas_kernels.reference import weight_dequant_ref


def float64_attention(q, qpe, kv, pe, layer, lengths, new_kv, new_pe, scale):
    q, qpe, kv, pe = (np.asarray(a, np.float64) for a in (q, qpe, kv, pe))
    new_kv, new_pe = np.asarray(new_kv, np.float64), np.asarray(new_pe, np.float64)
    out = np.zeros(q.shape)
    for b, length in enumerate(np.asarray(lengths)):
        keys = np.concatenate([kv[layer, b, :length], new_kv[b][None]])
        rotary = np.concatenate([pe[layer, b, :length], new_pe[b][None]])
        scores = (q[b] @ keys.T + qpe[b] @ rotary.T) * scale
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        out[b] = (probs / probs.sum(-1, keepdims=True)) @ keys
    return out


def check(heads, rank, rope, lengths, kv_len, splits, block_t=32, dtype=jnp.float32, tol=1e-5):
    rng = np.random.default_rng(len(lengths) + heads)
    layers, rows, length = 3, len(lengths) + 1, kv_len + 16
    kv = rng.standard_normal((layers, rows, length, rank))
    pe = rng.standard_normal((layers, rows, length, rope))
    q = 0.3 * rng.standard_normal((len(lengths), heads, rank))
    qpe = 0.3 * rng.standard_normal((len(lengths), heads, rope))
    new_kv, new_pe = rng.standard_normal((len(lengths), rank)), rng.standard_normal((len(lengths), rope))
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    got = mla_decode(cast(q), cast(qpe), cast(kv), cast(pe), jnp.int32(1), jnp.array(lengths, jnp.int32),
                     cast(new_kv), cast(new_pe), scale=0.2, kv_len=kv_len, block_t=block_t, splits=splits)
    expected = float64_attention(*(np.asarray(cast(a), np.float64) for a in (q, qpe, kv, pe)), 1, lengths,
                                 np.asarray(cast(new_kv)), np.asarray(cast(new_pe)), 0.2)
    assert np.abs(np.asarray(got) - expected).max() <= tol * np.abs(expected).max()


@pytest.mark.parametrize("heads, lengths, splits", [
    (16, [0, 77, 200], 1),  # an empty row (only its own entry), partial and long rows
    (20, [5, 64, 224], 3),  # heads not a multiple of the head block; splits past a row's end
    (4, [1], 2),
])
def test_mla_decode_interpret(heads, lengths, splits):
    check(heads, 64, 16, lengths, kv_len=224, splits=splits)


def absorbed_case(rng, batch, heads, nope, v_dim, rank, rope, lengths, kv_len, dtype):
    """Operands of one layer's absorbed decode, cast to `dtype`, and a 2-layer wkv_b stack (the model's form)."""
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    wkv_b = cast(rng.standard_normal((2, heads * (nope + v_dim), rank)) / np.sqrt(rank))
    q_nope = cast(rng.standard_normal((batch, heads, nope)))
    kv = cast(rng.standard_normal((3, batch + 1, kv_len + 16, rank)))
    pe = cast(rng.standard_normal((3, batch + 1, kv_len + 16, rope)))
    q_pe = cast(0.3 * rng.standard_normal((batch, heads, rope)))
    new_kv, new_pe = cast(rng.standard_normal((batch, rank))), cast(rng.standard_normal((batch, rope)))
    return wkv_b, q_nope, kv, pe, q_pe, new_kv, new_pe


@pytest.mark.parametrize("batch, heads, lengths, splits", [
    (3, 4, [0, 77, 200], 3),  # an empty row, splits past a row's end
    (70, 2, list(range(0, 210, 3)), 1),  # two batch blocks of rows
])
def test_absorbed_decode_in_three_launches(batch, heads, lengths, splits, dtype=jnp.float32, tol=1e-5,
                                           kv_len=224, nope=16, v_dim=32, rank=64, rope=16):
    """mla_absorb_query, then mla_decode_splits and mla_decode_output: wkv_b's key half into the query,
    the attention over the cache and the new entry, the merge and wkv_b's value half, against float64.
    They read layer 1 of the wkv_b stack (layer 0 and the other heads' rows are O(1) off) and layer 1 of
    the cache. The query's absorption reads q_nope from the whole query (B, H, nope + rope) with `nope`, as
    the model passes it (reading its rope columns instead is O(1) off)."""
    rng = np.random.default_rng(batch + heads)
    wkv_b, q_nope, kv, pe, q_pe, new_kv, new_pe = absorbed_case(rng, batch, heads, nope, v_dim, rank, rope,
                                                                lengths, kv_len, dtype)
    w = np.asarray(wkv_b, np.float64)[1].reshape(heads, nope + v_dim, rank)
    q_latent = mla_absorb_query(jnp.concatenate([q_nope, q_pe], -1), wkv_b, jnp.int32(1), nope=nope)
    want_q = np.einsum("bhd,hdc->bhc", np.asarray(q_nope, np.float64), w[:, :nope])
    assert np.abs(np.asarray(q_latent, np.float64) - want_q).max() <= tol * np.abs(want_q).max()
    q_latent = 0.1 * q_latent  # scores of a moderate spread
    lengths = jnp.array(lengths, jnp.int32)
    splits_out = mla_decode_splits(q_latent, q_pe, kv, pe, jnp.int32(1), lengths, kv_len=kv_len, scale=0.3,
                                   block_t=32, splits=splits)
    got = mla_decode_output(*splits_out, q_latent, q_pe, new_kv, new_pe, wkv_b, jnp.int32(1), scale=0.3, v_dim=v_dim)
    latent = float64_attention(*(np.asarray(a, np.float64) for a in (q_latent, q_pe, kv, pe)), 1,
                               np.asarray(lengths), np.asarray(new_kv), np.asarray(new_pe), 0.3)
    want = np.einsum("bhc,hdc->bhd", latent, w[:, nope:])
    assert got.shape == (batch, heads, v_dim) and got.dtype == dtype
    assert np.abs(np.asarray(got, np.float64) - want).max() <= tol * np.abs(want).max()


def fp8_wkv_b(rng, heads, per_head, rank):
    """A 2-layer fp8 wkv_b stack and its block scales: powers of two from 1/16 to 4 times a random factor,
    so that a tile scaled by a neighbouring block's scale is off by 2x or more."""
    w = jnp.asarray(rng.uniform(-1.5, 1.5, (2, heads * per_head, rank)), jnp.float8_e4m3fn)
    scale = 2.0 ** rng.integers(-4, 3, (2, heads * per_head // 128, rank // 128)) * rng.uniform(0.5, 1.0)
    return w, jnp.asarray(scale / np.sqrt(rank), jnp.float32)


def three_launches(q_nope, q_pe, kv, pe, new_kv, new_pe, lengths, wkv_b, wkv_b_scale, v_dim, kv_len):
    """q_latent and the output of the absorbed decode at layer 1 of the cache and of wkv_b."""
    q_latent = mla_absorb_query(q_nope, wkv_b, jnp.int32(1), wkv_b_scale=wkv_b_scale)
    splits = mla_decode_splits(0.1 * q_latent, q_pe, kv, pe, jnp.int32(1), lengths, kv_len=kv_len, scale=0.3)
    return q_latent, mla_decode_output(*splits, 0.1 * q_latent, q_pe, new_kv, new_pe, wkv_b, jnp.int32(1),
                                       scale=0.3, v_dim=v_dim, wkv_b_scale=wkv_b_scale)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_absorbed_decode_with_fp8_wkv_b(dtype, batch=3, heads=2, nope=128, v_dim=128, rank=256, kv_len=96):
    """An fp8 wkv_b read with its block scales, each tile dequantized in the kernels. float32: against
    float64 on the fp8 values times their scales (a tile given another block's scale is >= 2x off). bf16:
    the same as the kernels fed weight_dequant's bf16 stack, to a quarter of a bf16 step (a dequantization
    rounded otherwise moves outputs by whole steps)."""
    rng = np.random.default_rng(11)
    lengths = [(37 * b) % (kv_len - 5) for b in range(batch)]
    _, q_nope, kv, pe, q_pe, new_kv, new_pe = absorbed_case(rng, batch, heads, nope, v_dim, rank, 16, lengths,
                                                            kv_len, dtype)
    w, scale = fp8_wkv_b(rng, heads, nope + v_dim, rank)
    lengths = jnp.array(lengths, jnp.int32)
    operands = (q_nope, q_pe, kv, pe, new_kv, new_pe, lengths)
    q_latent, got = three_launches(*operands, w, scale, v_dim, kv_len)
    if dtype == jnp.float32:
        w64 = np.asarray(w[1], np.float64) * np.repeat(np.repeat(np.asarray(scale[1], np.float64), 128, 0), 128, 1)
        w64 = w64.reshape(heads, nope + v_dim, rank)
        want_q = np.einsum("bhd,hdc->bhc", np.asarray(q_nope, np.float64), w64[:, :nope])
        latent = float64_attention(0.1 * np.asarray(q_latent, np.float64), q_pe, kv, pe, 1, np.asarray(lengths),
                                   new_kv, new_pe, 0.3)
        want = np.einsum("bhc,hdc->bhd", latent, w64[:, nope:])
        tol = 1e-5
    else:
        bf16 = jnp.stack([weight_dequant_ref(w[i], scale[i], 128, dtype) for i in range(2)])
        want_q, want = (np.asarray(a, np.float64) for a in three_launches(*operands, bf16, None, v_dim, kv_len))
        tol = 2.0 ** -10
    assert np.abs(np.asarray(q_latent, np.float64) - want_q).max() <= tol * np.abs(want_q).max()
    assert got.dtype == dtype and np.abs(np.asarray(got, np.float64) - want).max() <= tol * np.abs(want).max()


def float64_rotary(x: np.ndarray, angles: np.ndarray, interleaved: bool) -> np.ndarray:
    """x (B, H, R) turned by angles (B, R / 2): complex pairs (adjacent, or half a head apart)."""
    half = x.shape[-1] // 2
    real, imag = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    turned = (real + 1j * imag) * np.exp(1j * angles)[:, None, :]
    if not interleaved:
        return np.concatenate([turned.real, turned.imag], -1)
    return np.stack([turned.real, turned.imag], -1).reshape(x.shape)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 4e-3)])
@pytest.mark.parametrize("interleaved", [True, False])
def test_absorption_rotates_the_query_rope_columns(dtype, tol, interleaved, batch=20, heads=3, nope=16, rope=64):
    """With `rope` the absorption also returns the whole query's rope columns rotated by each row's angles,
    against float64 complex rotation (a wrong partner, sign or angle is O(1) off); 20 rows: two batch blocks
    of 16, the second partly masked. q_latent is unchanged by it."""
    rng = np.random.default_rng(7 + interleaved)
    q = jnp.asarray(rng.standard_normal((batch, heads, nope + rope)), dtype)
    wkv_b = jnp.asarray(rng.standard_normal((2, heads * (nope + 32), 64)), dtype)
    angles = rng.uniform(-4, 4, (batch, rope // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    q_latent, q_pe = mla_absorb_query(q, wkv_b, jnp.int32(1), nope=nope, rope=(cos, sin, interleaved))
    x = np.asarray(q, np.float64)
    want = float64_rotary(x[..., nope:], np.asarray(angles, np.float32).astype(np.float64), interleaved)
    assert q_pe.shape == (batch, heads, rope) and q_pe.dtype == dtype
    assert np.linalg.norm(np.asarray(q_pe, np.float64) - want) / np.linalg.norm(want) < tol
    np.testing.assert_array_equal(np.asarray(q_latent), np.asarray(mla_absorb_query(q, wkv_b, jnp.int32(1), nope=nope)))


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [True, False])
def test_absorption_rotates_the_query_on_gpu(interleaved):
    """V3's head shape (D = 128, rotary 64), bf16, compiled."""
    test_absorption_rotates_the_query_rope_columns(jnp.bfloat16, 4e-3, interleaved, batch=8, heads=16, nope=128)


def test_absorption_takes_one_layer_unstacked():
    """An unstacked wkv_b (one layer, as an fp8 layer's dequantized weight) gives the stack's layer."""
    rng = np.random.default_rng(5)
    wkv_b, q_nope, *_ = absorbed_case(rng, 2, 4, 16, 32, 64, 16, [1, 2], 32, jnp.float32)
    np.testing.assert_allclose(np.asarray(mla_absorb_query(q_nope, wkv_b[1])),
                               np.asarray(mla_absorb_query(q_nope, wkv_b, jnp.int32(1))), rtol=1e-6, atol=1e-6)


def test_argument_errors():
    q = jnp.zeros((1, 4, 32))
    with pytest.raises(ValueError, match="do not match"):
        mla_decode(q, jnp.zeros((1, 4, 8)), jnp.zeros((2, 1, 64, 16)), jnp.zeros((2, 1, 64, 8)), 0,
                   jnp.zeros(1, jnp.int32), jnp.zeros((1, 32)), jnp.zeros((1, 8)), scale=1.0, kv_len=64)
    with pytest.raises(ValueError, match="exceed the cache"):
        mla_decode(q, jnp.zeros((1, 4, 8)), jnp.zeros((2, 1, 64, 32)), jnp.zeros((2, 1, 64, 8)), 0,
                   jnp.zeros(1, jnp.int32), jnp.zeros((1, 32)), jnp.zeros((1, 8)), scale=1.0, kv_len=128)


def test_absorption_argument_errors():
    q = jnp.zeros((1, 4, 16))
    with pytest.raises(ValueError, match=r"mla_absorb_query: wkv_b has shape \(2, 192, 64\): a stack"):
        mla_absorb_query(q, jnp.zeros((2, 192, 64)))
    with pytest.raises(ValueError, match="expected H \\* \\(D \\+ V\\) rows for H=4"):
        mla_absorb_query(q, jnp.zeros((190, 64)))
    with pytest.raises(ValueError, match="D=12 must be a power of two"):
        mla_absorb_query(jnp.zeros((1, 4, 12)), jnp.zeros((192, 64)))
    angles = jnp.zeros((1, 16))
    with pytest.raises(ValueError, match=r"mla_absorb_query: rope needs the query's rotary columns \(8 after nope\)"):
        mla_absorb_query(jnp.zeros((1, 4, 24)), jnp.zeros((4 * 48, 64)), nope=16, rope=(angles, angles, True))
    with pytest.raises(ValueError, match="mla_decode_output: acc"):
        mla_decode_output(jnp.zeros((1, 2, 4, 64)), jnp.zeros((1, 2, 4)), jnp.zeros((1, 2, 4)), jnp.zeros((1, 4, 32)),
                          jnp.zeros((1, 4, 16)), jnp.zeros((1, 64)), jnp.zeros((1, 16)), jnp.zeros((192, 64)),
                          scale=1.0, v_dim=32)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, lengths", [(1, [1000]), (8, [0, 3, 77, 300, 511, 700, 1000, 1023])])
def test_absorbed_decode_compiled_on_gpu(batch, lengths):
    """V2-Lite's and V3's head shapes (D = V = 128, C = 512, rotary 64), bf16, default splits."""
    test_absorbed_decode_in_three_launches(batch, 16, lengths, None, dtype=jnp.bfloat16, tol=2e-2, kv_len=1024,
                                           nope=128, v_dim=128, rank=512, rope=64)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, lengths", [(16, [0, 300, 1000, 1023]), (128, [511]), (8, [3, 700])])
def test_mla_decode_compiled_on_gpu(heads, lengths):
    check(heads, 512, 64, lengths, kv_len=1024, splits=None, block_t=64, dtype=jnp.bfloat16, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_absorbed_decode_with_fp8_wkv_b_on_gpu(batch):
    """V3's head shape (D = V = 128, C = 512) with an fp8 wkv_b, bf16, compiled: the same as the kernels
    fed weight_dequant's bf16 stack."""
    test_absorbed_decode_with_fp8_wkv_b(jnp.bfloat16, batch=batch, heads=16, rank=512)
