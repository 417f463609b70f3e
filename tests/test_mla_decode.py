"""The MLA decode kernels against float64 numpy attention (interpret mode on a CPU; compiled with -m gpu):
the attention over the latent cache, and wkv_b's absorption into the query and out of the output."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla
from pallas_kernels.mla import (WHOLE_VALUE_TILES_ABOVE_ROWS, mla_absorb_query, mla_decode, mla_decode_output,
                                mla_decode_splits)
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


@pytest.mark.parametrize("batch", [1, 8, 32, 64, 128, 132, 256, 1024])
def test_default_splits_fill_one_wave_with_at_least_two(monkeypatch, batch, sms=132, block_t=64):
    """The split count keeps the grid within the SMs' program slots (a partial second wave leaves most SMs
    idle), the most splits that do, but at least two where the window has two blocks, none shorter than a block."""
    monkeypatch.setattr(mla, "num_sms", lambda: sms)
    slots = mla.PROGRAMS_PER_SM * sms
    for heads in (16, 128):
        programs = batch * math.ceil(heads / 16)
        for kv_len in (64, 648, 131072):
            blocks = math.ceil(kv_len / block_t)
            splits = mla.default_splits(batch, heads, kv_len, block_t, 16)
            assert min(2, blocks) <= splits <= blocks
            if splits > 2:
                assert programs * splits <= slots
            assert splits in (blocks, min(2, blocks)) or programs * (splits + 1) > slots


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


@pytest.mark.parametrize("batch, heads, lengths, splits, kv_len", [
    (3, 4, [0, 77, 200], 3, 224),  # an empty row, splits past a row's end
    (70, 2, list(range(0, 210, 3)), 1, 224),  # two batch blocks of rows
    (2, 3, [13, 352], 11, 352),  # 11 splits of 32 positions: merged in two groups of MERGE_GROUP, the second partial
])
def test_absorbed_decode_in_three_launches(batch, heads, lengths, splits, kv_len, dtype=jnp.float32, tol=1e-5,
                                           nope=16, v_dim=32, rank=64, rope=16):
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


@pytest.mark.parametrize("v_blocks", [2, 3])
def test_decode_output_with_several_value_blocks_a_program(v_blocks, batch=18, heads=3, nope=16, v_dim=48, rank=64,
                                                           rope=16, kv_len=96, dtype=jnp.float32, tol=1e-5,
                                                           block_b=16, block_v=16):
    """mla_decode_output with `v_blocks` V blocks a program, each merging its rows' splits once: V = 48 is three
    blocks of 16, so v_blocks 2 leaves the second program one block past V (it must store nothing, and the
    first program's two blocks both), 3 puts all of them in one program; 18 rows: two batch blocks. Against
    float64."""
    rng = np.random.default_rng(29 + v_blocks)
    lengths = [(41 * b) % kv_len for b in range(batch)]
    wkv_b, q_nope, kv, pe, q_pe, new_kv, new_pe = absorbed_case(rng, batch, heads, nope, v_dim, rank, rope,
                                                                lengths, kv_len, dtype)
    q_latent = jnp.asarray(0.1 * rng.standard_normal((batch, heads, rank)), dtype)
    lengths = jnp.array(lengths, jnp.int32)
    splits = mla_decode_splits(q_latent, q_pe, kv, pe, jnp.int32(1), lengths, kv_len=kv_len, scale=0.3, block_t=32,
                               splits=3)
    got = mla_decode_output(*splits, q_latent, q_pe, new_kv, new_pe, wkv_b, jnp.int32(1), scale=0.3, v_dim=v_dim,
                            v_blocks=v_blocks, block_b=block_b, block_v=block_v)
    latent = float64_attention(q_latent, q_pe, kv, pe, 1, np.asarray(lengths), new_kv, new_pe, 0.3)
    w = np.asarray(wkv_b, np.float64)[1].reshape(heads, nope + v_dim, rank)
    want = np.einsum("bhc,hdc->bhd", latent, w[:, nope:])
    assert got.shape == want.shape and got.dtype == dtype
    assert np.abs(np.asarray(got, np.float64) - want).max() <= tol * np.abs(want).max()


@pytest.mark.parametrize("block_b, batch, v_blocks", [(1, 3, 1), (4, 18, 2)])
def test_decode_output_rows_without_a_dot(block_b, batch, v_blocks):
    """Programs of fewer rows than a Triton dot's side project by products summed over C: one row a program
    (b=1's case), and 4-row programs over 18 rows (the last program half masked) with two V blocks each (the
    second past V = 48), against float64."""
    test_decode_output_with_several_value_blocks_a_program(v_blocks, batch=batch, block_b=block_b)


@pytest.mark.parametrize("batch, v_dim", [(18, 80), (40, 64), (80, 144)])
def test_decode_output_default_value_tiles_above_16_rows(batch, v_dim):
    """Above 16 rows (a bf16 or float32 wkv_b) the output kernel's default V tiles are 64 wide, 128 wide past
    WHOLE_VALUE_TILES_ABOVE_ROWS: V = 80 is a full tile and one 16 columns into the next (the rest masked), V = 64
    one tile, over two and three batch blocks; at 80 rows (five batch blocks) V = 144 a 128-wide tile and 16
    columns of the next. Against float64."""
    assert 40 <= WHOLE_VALUE_TILES_ABOVE_ROWS < 80
    test_decode_output_with_several_value_blocks_a_program(1, batch=batch, v_dim=v_dim, block_v=None)


def fp8_wkv_b(rng, heads, per_head, rank):
    """A 2-layer fp8 wkv_b stack and its block scales: powers of two from 1/16 to 4 times a random factor,
    so that a tile scaled by a neighbouring block's scale is off by 2x or more."""
    w = jnp.asarray(rng.uniform(-1.5, 1.5, (2, heads * per_head, rank)), jnp.float8_e4m3fn)
    scale = 2.0 ** rng.integers(-4, 3, (2, heads * per_head // 128, rank // 128)) * rng.uniform(0.5, 1.0)
    return w, jnp.asarray(scale / np.sqrt(rank), jnp.float32)


def three_launches(q_nope, q_pe, kv, pe, new_kv, new_pe, lengths, wkv_b, wkv_b_scale, v_dim, kv_len, block_b=None):
    """q_latent and the output of the absorbed decode at layer 1 of the cache and of wkv_b (the output kernel's
    programs of `block_b` rows, None: its own choice)."""
    q_latent = mla_absorb_query(q_nope, wkv_b, jnp.int32(1), wkv_b_scale=wkv_b_scale)
    splits = mla_decode_splits(0.1 * q_latent, q_pe, kv, pe, jnp.int32(1), lengths, kv_len=kv_len, scale=0.3)
    return q_latent, mla_decode_output(*splits, 0.1 * q_latent, q_pe, new_kv, new_pe, wkv_b, jnp.int32(1),
                                       scale=0.3, v_dim=v_dim, wkv_b_scale=wkv_b_scale, block_b=block_b)


# one-row programs in float32 only: on the CPU, XLA keeps the products' bf16 weights in float32 (excess precision),
# so that bf16 comparison would test XLA's rounding, not the kernel's
@pytest.mark.parametrize("dtype, block_b", [(jnp.float32, 16), (jnp.bfloat16, 16), (jnp.float32, 1)])
def test_absorbed_decode_with_fp8_wkv_b(dtype, block_b, batch=3, heads=2, nope=128, v_dim=128, rank=256, kv_len=96):
    """An fp8 wkv_b read with its block scales, each tile dequantized in the kernels. float32: against
    float64 on the fp8 values times their scales (a tile given another block's scale is >= 2x off). bf16:
    the same as the kernels fed weight_dequant's bf16 stack, to a quarter of a bf16 step (a dequantization
    rounded otherwise moves outputs by whole steps). The output kernel in programs of 16 rows (a dot) and of
    one row (products summed)."""
    rng = np.random.default_rng(11)
    lengths = [(37 * b) % (kv_len - 5) for b in range(batch)]
    _, q_nope, kv, pe, q_pe, new_kv, new_pe = absorbed_case(rng, batch, heads, nope, v_dim, rank, 16, lengths,
                                                            kv_len, dtype)
    w, scale = fp8_wkv_b(rng, heads, nope + v_dim, rank)
    lengths = jnp.array(lengths, jnp.int32)
    operands = (q_nope, q_pe, kv, pe, new_kv, new_pe, lengths)
    q_latent, got = three_launches(*operands, w, scale, v_dim, kv_len, block_b)
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
        want_q, want = (np.asarray(a, np.float64)
                        for a in three_launches(*operands, bf16, None, v_dim, kv_len, block_b))
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


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-6), (jnp.bfloat16, 4e-3)])
@pytest.mark.parametrize("interleaved", [True, False])
def test_absorption_norms_the_latent_and_rotates_the_key(dtype, tol, interleaved, batch=20, heads=3, nope=16,
                                                         rope=64, rank=256, eps=1e-6):
    """With `latent_norm` the absorption also returns wkv_a's latent RMS-normed by layer 1 of the norm's weight
    stack and the shared key rotated by the query's angles, against float64 (layer 0's weights, a norm over
    another count of columns or a chunk left out are O(1) off; 20 rows: two batch blocks, the second partly
    masked, and a latent of two 128-column chunks). The query's outputs are those of the call without it."""
    rng = np.random.default_rng(11 + interleaved)
    q = jnp.asarray(rng.standard_normal((batch, heads, nope + rope)), dtype)
    wkv_b = jnp.asarray(rng.standard_normal((2, heads * (nope + 32), rank)), dtype)
    kv = jnp.asarray(3 * rng.standard_normal((batch, rank + rope)), dtype)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, (2, rank)), jnp.float32)
    angles = rng.uniform(-4, 4, (batch, rope // 2))
    cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
    rotary = (cos, sin, interleaved)
    q_latent, q_pe, latent, k_pe = mla_absorb_query(q, wkv_b, jnp.int32(1), nope=nope, rope=rotary,
                                                    latent_norm=(kv, weight, eps))
    x = np.asarray(kv, np.float64)
    want = x[:, :rank] / np.sqrt(np.mean(x[:, :rank] ** 2, axis=1, keepdims=True) + eps) * np.asarray(weight[1])
    assert latent.shape == (batch, rank) and latent.dtype == dtype and k_pe.shape == (batch, rope)
    assert np.linalg.norm(np.asarray(latent, np.float64) - want) / np.linalg.norm(want) < tol
    want_pe = float64_rotary(x[:, None, rank:], np.asarray(angles, np.float32).astype(np.float64), interleaved)[:, 0]
    assert np.linalg.norm(np.asarray(k_pe, np.float64) - want_pe) / np.linalg.norm(want_pe) < tol
    for got, alone in zip((q_latent, q_pe), mla_absorb_query(q, wkv_b, jnp.int32(1), nope=nope, rope=rotary)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(alone))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 70])
def test_absorption_norms_the_latent_on_gpu(batch):
    """V3's shapes (D = 128, C = 512, rotary 64), bf16, compiled; 70 rows: two batch blocks of 64."""
    test_absorption_norms_the_latent_and_rotates_the_key(jnp.bfloat16, 4e-3, True, batch=batch, heads=16, nope=128,
                                                         rank=512)


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
    q, wkv_b, rope = jnp.zeros((1, 4, 48)), jnp.zeros((2, 4 * 48, 64)), (angles, angles, True)
    with pytest.raises(ValueError, match=r"latent_norm needs rope, a wkv_b stack .* got weight \(64,\)"):
        mla_absorb_query(q, wkv_b, 1, nope=16, rope=rope, latent_norm=(jnp.zeros((1, 96)), jnp.zeros(64), 1e-6))
    with pytest.raises(ValueError, match=r"latent_norm's kv has shape \(1, 64\), expected \(1, 96\)"):
        mla_absorb_query(q, wkv_b, 1, nope=16, rope=rope, latent_norm=(jnp.zeros((1, 64)), jnp.zeros((2, 64)), 1e-6))
    with pytest.raises(ValueError, match="mla_decode_output: acc"):
        mla_decode_output(jnp.zeros((1, 2, 4, 64)), jnp.zeros((1, 2, 4)), jnp.zeros((1, 2, 4)), jnp.zeros((1, 4, 32)),
                          jnp.zeros((1, 4, 16)), jnp.zeros((1, 64)), jnp.zeros((1, 16)), jnp.zeros((192, 64)),
                          scale=1.0, v_dim=32)


@pytest.mark.gpu
@pytest.mark.parametrize("batch, lengths", [(1, [1000]), (8, [0, 3, 77, 300, 511, 700, 1000, 1023]),
                                            (40, [(97 * b) % 1024 for b in range(40)]),
                                            (80, [(97 * b) % 1024 for b in range(80)])])
def test_absorbed_decode_compiled_on_gpu(batch, lengths):
    """V2-Lite's and V3's head shapes (D = V = 128, C = 512, rotary 64), bf16, default splits; 40 rows: three
    16-row blocks of the output kernel, the last partly filled; 80 rows: its 128-wide V tiles on 8 warps."""
    test_absorbed_decode_in_three_launches(batch, 16, lengths, None, dtype=jnp.bfloat16, tol=2e-2, kv_len=1024,
                                           nope=128, v_dim=128, rank=512, rope=64)


@pytest.mark.gpu
@pytest.mark.parametrize("v_blocks", [3, 8])
def test_decode_output_with_several_value_blocks_compiled_on_gpu(v_blocks):
    """V2-Lite's head shape (D = V = 128, C = 512, rotary 64), bf16, 40 rows: eight V blocks of 16 as three
    programs (the last with one block past V) or as one."""
    test_decode_output_with_several_value_blocks_a_program(v_blocks, batch=40, heads=16, nope=128, v_dim=128,
                                                           rank=512, rope=64, kv_len=1024, dtype=jnp.bfloat16,
                                                           tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("block_b, batch", [(1, 1), (4, 6)])
def test_decode_output_rows_without_a_dot_compiled_on_gpu(block_b, batch):
    """V2-Lite's head shape (D = V = 128, C = 512, rotary 64), bf16: programs of one row and of four (the second
    half masked) projecting by products summed over C."""
    test_decode_output_with_several_value_blocks_a_program(1, batch=batch, heads=16, nope=128, v_dim=128, rank=512,
                                                           rope=64, kv_len=1024, dtype=jnp.bfloat16, tol=2e-2,
                                                           block_b=block_b)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, lengths", [(16, [0, 300, 1000, 1023]), (128, [511]), (8, [3, 700])])
def test_mla_decode_compiled_on_gpu(heads, lengths):
    check(heads, 512, 64, lengths, kv_len=1024, splits=None, block_t=64, dtype=jnp.bfloat16, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8])
def test_absorbed_decode_with_fp8_wkv_b_on_gpu(batch):
    """V3's head shape (D = V = 128, C = 512) with an fp8 wkv_b, bf16, compiled: the same as the kernels
    fed weight_dequant's bf16 stack; the output kernel's own programs (one row at batch 1, 16 rows at 8)."""
    test_absorbed_decode_with_fp8_wkv_b(jnp.bfloat16, None, batch=batch, heads=16, rank=512)


def test_the_models_decode_step_norms_the_latent_in_the_query_launch(monkeypatch):
    """The small V3 model of tests/test_auto_paths_gpu.py (bf16) with random kv_norm weights: a decode step with
    the MLA decode kernels (interpret mode) and the norm weights read from their stacks, as on a GPU, runs the
    latent's norm and the shared key's rotary inside mla_absorb_query's launch (no latent_norm_rope in its
    jaxpr) and agrees with the XLA attention (bf16 logits, relative L2 < 2e-2: a latent normed without its
    weight or with another layer's is O(1) off in the attention and in the cached entries a later step reads;
    the second step reads the first's)."""
    import dsv3_jax
    from dsv3_jax.decode.step import make_step
    from dsv3_jax.model import attention, block, layers
    from kernel_checks import KERNEL_MODULES, kernel_twins
    from test_auto_paths_gpu import small_v3, step_inputs, variant, with_random_norms

    base = with_random_norms(dsv3_jax.build(small_v3("bf16"), seed=0), ("kv_norm",))

    def run(decode_attn):
        model = variant(base, decode_attn=decode_attn)
        step, out = make_step.__wrapped__(model.parts), []  # a fresh jit: traced under the patch or not
        for seed, start in enumerate((5, 6)):
            tokens, starts, last, kv_len = step_inputs(model.args, 2, 1, start, seed)
            jaxpr = str(step.trace(model.state, model.cache, tokens, starts, last, kv_len=kv_len).jaxpr)
            logits, model.cache = step(model.state, model.cache, tokens, starts, last, kv_len=kv_len)
            out.append((np.asarray(logits, np.float32), jaxpr))
        return out

    with kernel_twins(*(name for name in KERNEL_MODULES if name != "mla")):  # the other kernels' twins: fast
        want = run("xla")
        with monkeypatch.context() as patch:
            for module in (attention, block, layers):
                patch.setattr(module, "norm_kernel_applies", lambda rows: True)
            got = run("kernel")
    for (g, jaxpr), (w, _) in zip(got, want, strict=True):
        assert "name=mla_absorb_query" in jaxpr and "latent_norm_rope" not in jaxpr
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 2e-2
