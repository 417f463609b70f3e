"""The reference's sampler: temperature, top-k / top-p filtering, and an exact draw from a distribution.

One form serves a batch that shares its parameters (`generate`) and a batch whose rows belong to
different requests (the server): temperature, top_k and top_p are each one value for every row or
a (B,) array of per-row values, and the random key is one key or a (B,) array of per-row keys.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits: jax.Array, temperature: jax.Array, key: jax.Array, *, top_k=0, top_p=1.0) -> jax.Array:
    """One token per row of `logits` (B, vocab), as the reference samples.

    p = softmax(logits / max(T, 1e-5)) and token = argmax(p / E), E ~ Exponential(1) (an exact
    draw from p); T == 0 means argmax. `top_k` > 0 keeps the k most likely tokens and `top_p` < 1
    the smallest set whose probability reaches top_p (both off by default); see `distribution`.
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    sampled = draw(distribution(logits, temperature, top_k=top_k, top_p=top_p), key)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def _per_row(value, logits: jax.Array):
    """A (B,) array of per-row values as a column that broadcasts against `logits` (B, vocab); a scalar as is."""
    return jnp.reshape(value, jnp.shape(value) + (1,)) if jnp.ndim(value) else value


def distribution(logits: jax.Array, temperature, *, top_k=0, top_p=1.0) -> jax.Array:
    """The distribution `sample` draws from when temperature > 0: softmax(logits / T) over the top-k
    tokens, then zero outside the top-p set (float32, the shape of `logits` (B, vocab); the top-p cut
    is not renormalised: `draw` takes unnormalised weights).

    Each parameter is one value for all rows or a (B,) array, one per row (top_k 0 and top_p 1 turn
    a row's filter off). A Python int top_k is a static k (0: no filter); a Python float top_p >= 1
    skips the nucleus sort."""
    scaled = logits.astype(jnp.float32) / _per_row(jnp.maximum(temperature, 1e-5), logits)
    if isinstance(top_k, int):
        if top_k:
            kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
            scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    else:
        top_k = _per_row(jnp.asarray(top_k), logits)
        ordered = -jnp.sort(-scaled, axis=-1)
        kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, scaled.shape[-1] - 1), axis=-1)
        scaled = jnp.where((top_k > 0) & (scaled < kth), -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    if isinstance(top_p, float) and top_p >= 1.0:
        return probs
    top_p = _per_row(jnp.asarray(top_p, jnp.float32), logits)
    ordered = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(ordered, axis=-1) - ordered
    kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
    smallest_kept = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    # top_p 1 keeps every token even where the cumulative sum rounds up to 1 before the tail
    return jnp.where((top_p >= 1.0) | (probs >= smallest_kept), probs, 0.0)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per row: fold_in(key(seed), position), so that a seeded request's draws depend
    on its own seed and position only, not on the rows beside it."""
    return jax.vmap(lambda seed, position: jax.random.fold_in(jax.random.key(seed), position))(seeds, positions)


def random_rows(sampler, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """sampler(key, shape) for the batch (B, ...) of `shape`: from one key, or from row i's own key
    when `key` holds one per row ((B,))."""
    if key.ndim == 0:
        return sampler(key, shape)
    return jax.vmap(lambda k: sampler(k, shape[1:]))(key)


def draw(probs: jax.Array, key: jax.Array) -> jax.Array:
    """An exact draw from each row of (unnormalised, non-negative) `probs` (B, vocab): argmax(probs / E),
    E ~ Exponential(1); `key` is one key or one per row."""
    noise = random_rows(lambda k, shape: jax.random.exponential(k, shape, jnp.float32), key, probs.shape)
    return jnp.argmax(probs / noise, axis=-1).astype(jnp.int32)
