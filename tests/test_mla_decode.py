"""The MLA decode kernel against float64 numpy attention (interpret mode on a CPU; compiled with -m gpu)."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla import mla_decode


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


def test_argument_errors():
    q = jnp.zeros((1, 4, 32))
    with pytest.raises(ValueError, match="do not match"):
        mla_decode(q, jnp.zeros((1, 4, 8)), jnp.zeros((2, 1, 64, 16)), jnp.zeros((2, 1, 64, 8)), 0,
                   jnp.zeros(1, jnp.int32), jnp.zeros((1, 32)), jnp.zeros((1, 8)), scale=1.0, kv_len=64)
    with pytest.raises(ValueError, match="exceed the cache"):
        mla_decode(q, jnp.zeros((1, 4, 8)), jnp.zeros((2, 1, 64, 32)), jnp.zeros((2, 1, 64, 8)), 0,
                   jnp.zeros(1, jnp.int32), jnp.zeros((1, 32)), jnp.zeros((1, 8)), scale=1.0, kv_len=128)


@pytest.mark.gpu
@pytest.mark.parametrize("heads, lengths", [(16, [0, 300, 1000, 1023]), (128, [511]), (8, [3, 700])])
def test_mla_decode_compiled_on_gpu(heads, lengths):
    check(heads, 512, 64, lengths, kv_len=1024, splits=None, block_t=64, dtype=jnp.bfloat16, tol=2e-2)
