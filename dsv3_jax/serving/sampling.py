"""Sampling with per-row parameters, for a batch whose rows belong to different requests.

The math is `dsv3_jax.decode.sampling`'s, with temperature, top_k, top_p and the random key per
row: each row's key is fold_in(key(seed), position) of its own request, so a seeded request draws
the same tokens whatever else shares its batch. A batch's mode (static: one compile each) skips
what none of its rows needs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ..decode.sampling import distribution, draw, row_keys

GREEDY, SAMPLE, FILTER = "greedy", "sample", "filter"  # a batch's sampling mode


def row_filters(top_k: jax.Array, top_p: jax.Array, mode: str):
    """The (top_k, top_p) that `distribution` takes in `mode`: the rows' own filters, or off (no sort)."""
    return (top_k, top_p) if mode == FILTER else (0, 1.0)


def sample_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, seeds: jax.Array,
                positions: jax.Array, *, mode: str) -> jax.Array:
    """One token per row of `logits` (B, vocab), each row with its own parameters ((B,) arrays).

    mode (static): GREEDY (every row has T == 0: argmax only), SAMPLE (no row filters: no sort),
    FILTER (some row has top_k > 0 or top_p < 1)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == GREEDY:
        return greedy
    top_k, top_p = row_filters(top_k, top_p, mode)
    probs = distribution(logits, temperature, top_k=top_k, top_p=top_p)
    sampled = draw(probs, row_keys(seeds, positions))
    return jnp.where(temperature > 0, sampled, greedy)


def batch_mode(temperatures, top_ks, top_ps) -> str:
    """The cheapest mode that samples every row right (host-side, from the rows' parameters)."""
    sampled = [(k, p) for t, k, p in zip(temperatures, top_ks, top_ps) if t > 0]
    if not sampled:
        return GREEDY
    return FILTER if any(k > 0 or p < 1.0 for k, p in sampled) else SAMPLE
