"""The rotary position embedding inside kernels, as DeepSeek's model applies it (float32, cast back).

Element j of a rotary head pairs with its partner (j +- 1 where the pairs are adjacent, DeepSeek's
layout; j +- R / 2 otherwise) and turns by the angle of its pair. Kernels get the partner without a
strided or gathered load (which Pallas' interpreter cannot run): one row by a masked sum over a (R, R)
tile (`rotate_row`), a tile of rows by a dot with a 0/1 permutation (`rotate_rows`); both exact.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_EXACT = jax.lax.Precision.HIGHEST  # float32 dots in IEEE float32 (not TF32): a 0/1 matrix copies values exactly


def rotate_ref(x, cos, sin, interleaved: bool):
    """x (..., R) rotated by the angles' cos and sin (..., R / 2), in float32, cast back (the model's rotary)."""
    xf = x.astype(jnp.float32)
    if interleaved:
        real, imag = xf[..., 0::2], xf[..., 1::2]
        return jnp.stack([real * cos - imag * sin, real * sin + imag * cos], -1).reshape(x.shape).astype(x.dtype)
    half = x.shape[-1] // 2
    real, imag = xf[..., :half], xf[..., half:]
    return jnp.concatenate([real * cos - imag * sin, imag * cos + real * sin], -1).astype(x.dtype)


def _pairs(width: int, interleaved: bool):
    """For each of R columns: its angle's index, its partner's column, whether it is the pair's first (real) part."""
    j = jnp.arange(width)
    if interleaved:
        return j // 2, j + 1 - 2 * (j % 2), j % 2 == 0
    half = width // 2
    return j % half, (j + half) % width, j < half


def rotate_row(x, cos, sin, interleaved: bool):
    """x (R,) float32 rotated by cos, sin (R / 2,) float32; each partner and angle selected from a (source, j)
    tile by a masked sum (one non-zero term)."""
    pair, partner, first = _pairs(x.shape[0], interleaved)

    def select(values, index):  # values[index]
        source = jnp.arange(values.shape[0])[:, None]
        return jnp.sum(jnp.where(source == index[None, :], values[:, None], 0.0), axis=0)

    other = select(x, partner)
    return x * select(cos, pair) + jnp.where(first, -other, other) * select(sin, pair)


def rotate_rows(x, cos, sin, interleaved: bool):
    """x (N, R) in its dtype (N and R / 2 >= 16: a Triton dot's sides) rotated by cos, sin (N, R / 2) float32 -> float32
    (N, R); the partners by x @ a 0/1 permutation, the angles spread to their columns by a 0/1 dot."""
    width = x.shape[1]
    pair, partner, first = _pairs(width, interleaved)
    swap = (jax.lax.broadcasted_iota(jnp.int32, (width, width), 0) == partner[None, :]).astype(x.dtype)
    spread = (jax.lax.broadcasted_iota(jnp.int32, (width // 2, width), 0) == pair[None, :]).astype(jnp.float32)
    other = jax.lax.dot(x, swap, precision=_EXACT, preferred_element_type=jnp.float32)
    cos_full, sin_full = (jax.lax.dot(a, spread, precision=_EXACT, preferred_element_type=jnp.float32)
                          for a in (cos, sin))
    return x.astype(jnp.float32) * cos_full + jnp.where(first[None, :], -other, other) * sin_full
