"""The reference's sampler: temperature, top-k / top-p filtering, and an exact draw from a distribution."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def sample(logits: jax.Array, temperature: jax.Array, key: jax.Array, *, top_k: int = 0,
           top_p: float = 1.0) -> jax.Array:
    """One token per row of `logits` (B, vocab), as the reference samples.

    p = softmax(logits / max(T, 1e-5)) and token = argmax(p / E), E ~ Exponential(1) (an exact
    draw from p); T == 0 means argmax. `top_k` > 0 keeps the k most likely tokens and `top_p` < 1
    the smallest set whose probability reaches top_p (both off by default).
    """
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1)
    sampled = draw(distribution(logits, temperature, top_k=top_k, top_p=top_p), key)
    return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


def distribution(logits: jax.Array, temperature: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """The distribution `sample` draws from when temperature > 0: softmax(logits / T) with the
    top-k / top-p filters applied and renormalised (float32, the shape of `logits`)."""
    logits = logits.astype(jnp.float32)
    scaled = logits / jnp.maximum(temperature, 1e-5)
    if top_k:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    probs = jax.nn.softmax(scaled, axis=-1)
    if top_p < 1.0:
        ordered = -jnp.sort(-probs, axis=-1)
        mass_before = jnp.cumsum(ordered, axis=-1) - ordered
        kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
        smallest_kept = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        probs = jnp.where(probs >= smallest_kept, probs, 0.0)
    return probs


def draw(probs: jax.Array, key: jax.Array) -> jax.Array:
    """An exact draw from each row of (unnormalised, non-negative) `probs`: argmax(probs / E),
    E ~ Exponential(1)."""
    noise = jax.random.exponential(key, probs.shape, jnp.float32)
    return jnp.argmax(probs / noise, axis=-1).astype(jnp.int32)
