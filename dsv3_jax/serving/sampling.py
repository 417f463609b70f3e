"""Sampling with per-row parameters, for a batch whose rows belong to different requests.

The math is `dsv3_jax.decode.sampling.sample`'s (softmax(logits / max(T, 1e-5)), the top-k and top-p
filters, token = argmax(p / E) with E ~ Exponential(1); T == 0 is argmax), but temperature, top_k,
top_p and the random key are per row: each row's key is fold_in(key(seed), position) of its own
request, so a seeded request draws the same tokens whatever else shares its batch.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

GREEDY, SAMPLE, FILTER = "greedy", "sample", "filter"  # a batch's sampling mode (static: one compile each)


def row_distribution(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """softmax(logits / T) of each row (B, vocab) with its own top_k (0: off) and top_p (1: off)
    filters applied and renormalised; `decode.sampling.distribution` with per-row parameters."""
    scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-5)[:, None]
    vocab = scaled.shape[-1]
    ordered = -jnp.sort(-scaled, axis=-1)
    kth = jnp.take_along_axis(ordered, jnp.clip(top_k - 1, 0, vocab - 1)[:, None], axis=-1)
    scaled = jnp.where((top_k[:, None] > 0) & (scaled < kth), -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    ordered = -jnp.sort(-probs, axis=-1)
    mass_before = jnp.cumsum(ordered, axis=-1) - ordered
    kept = jnp.sum(mass_before < top_p[:, None], axis=-1, keepdims=True)
    smallest_kept = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    return jnp.where((top_p[:, None] >= 1.0) | (probs >= smallest_kept), probs, 0.0)


def row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per row: fold_in(key(seed), position of the token being fed)."""
    return jax.vmap(lambda seed, position: jax.random.fold_in(jax.random.key(seed), position))(seeds, positions)


def sample_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seeds: jax.Array,
                positions: jax.Array, *, mode: str) -> jax.Array:
    """One token per row of `logits` (B, vocab), each row with its own parameters (int32 (B,)).

    mode (static): GREEDY (every row has T == 0: argmax only), SAMPLE (no row filters: no sort),
    FILTER (some row has top_k > 0 or top_p < 1)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == GREEDY:
        return greedy
    if mode == FILTER:
        probs = row_distribution(logits, temperature, top_k, top_p)
    else:
        probs = jax.nn.softmax(logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-5)[:, None], axis=-1)
    noise = jax.vmap(lambda key: jax.random.exponential(key, probs.shape[-1:], jnp.float32))(
        row_keys(seeds, positions))
    sampled = jnp.argmax(probs / noise, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)


def batch_mode(temperatures, top_ks, top_ps) -> str:
    """The cheapest mode that samples every row right (host-side, from the rows' parameters)."""
    sampled = [(k, p) for t, k, p in zip(temperatures, top_ks, top_ps) if t > 0]
    if not sampled:
        return GREEDY
    return FILTER if any(k > 0 or p < 1.0 for k, p in sampled) else SAMPLE
